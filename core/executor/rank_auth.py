"""Every rank proves it holds the cluster key, and rank 0 proves it back, over the rendezvous
store, before the process group exists (so before any rank reads a pickle or is sent a prompt).

The store (torch.distributed's TCPStore on ``parallel.master_addr:master_port``) accepts any
client, which may read and overwrite any key; the check therefore trusts nothing it reads there
but MACs over nonces each side keeps in its own memory::

    rank 0 (hosts the store)                             rank r (1 .. world-1)
      draws S, N_r
      challenge/r = S ‖ N_r                 ─────▶        draws M_r
                                            ◀─────        response/r = M_r ‖ HMAC(K, "rank" S r N_r M_r)
      checks it against its own S, N_r
      (constant time); wrong: refuses r
      proof/r = HMAC(K, "head" S r N_r M_r)  ─────▶       checks it against its own M_r;
                                                          wrong: refuses the head

A key an attacker writes (a forged challenge, response or proof) only makes a check fail: the
launch stops with ``ClusterAuthError``, naming the setting. Both sides then derive the session
key ``HMAC(K, "session" S)`` that seals every message between the ranks (``sealed_channel``).

K is the cluster secret (``disaggregation.kv_transfer_secret``) across hosts; on one host a
random key the engine hands its children (``cluster_key``).
"""
from __future__ import annotations

import hashlib
import hmac
import ipaddress
import logging
import secrets
import socket
import time
from typing import Any

from tandem.config import ConfigError, TandemConfig

logger = logging.getLogger("tandem")

SECRET_SETTING = "disaggregation.kv_transfer_secret (TANDEM_DISAGGREGATION__KV_TRANSFER_SECRET)"
PREFIX = "tandem-rank-auth/"
NONCE_BYTES = 32
POLL_S = 0.05


class ClusterAuthError(RuntimeError):
    """A rank, or the head, did not prove it holds the cluster key: the launch stops."""


def cluster_key(config: TandemConfig) -> bytes:
    """The key this launch's ranks prove themselves with: a fresh random one on one host (the
    engine passes it to its children on their stdin, never in argv or the environment), the cluster secret across hosts, and the empty key across "hosts" that are all
    this host's loopback when no secret is set. Raises ConfigError for several hosts without a
    secret and a master_addr that is not a loopback address."""
    par, secret = config.parallel, config.disaggregation.kv_transfer_secret
    if par.nnodes == 1:
        return secrets.token_bytes(NONCE_BYTES)
    if secret is not None:
        return secret.get_secret_value().encode()
    if not is_loopback(par.master_addr):
        raise ConfigError(
            f"parallel.nnodes = {par.nnodes} with parallel.master_addr = {par.master_addr!r} needs the "
            f"cluster secret {SECRET_SETTING}: every rank proves it holds it before any step is "
            "exchanged. Set the same secret on every host, or a loopback master_addr when every rank "
            "runs on this host")
    logger.warning("parallel.nnodes = %d on the loopback without %s: the ranks are not authenticated, "
                   "any local user can join them", par.nnodes, SECRET_SETTING)
    return b""


def is_loopback(address: str) -> bool:
    """Whether every address ``address`` resolves to is a loopback address."""
    try:
        infos = socket.getaddrinfo(address, None, proto=socket.IPPROTO_TCP)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(str(i[4][0]).split("%")[0]).is_loopback for i in infos)


def admit_ranks(store: Any, key: bytes, world_size: int, timeout_s: float) -> bytes:
    """Rank 0: challenge ranks 1 .. world_size-1 and admit each that answers right; returns the
    session key. Raises ClusterAuthError at the first wrong answer, TimeoutError when some rank
    has not answered within ``timeout_s``."""
    session = secrets.token_bytes(NONCE_BYTES)
    nonces = {r: secrets.token_bytes(NONCE_BYTES) for r in range(1, world_size)}
    for rank, nonce in nonces.items():
        store.set(f"{PREFIX}challenge/{rank}", session + nonce)
    deadline = time.monotonic() + timeout_s
    while nonces:
        for rank in [r for r in nonces if store.check([f"{PREFIX}response/{r}"])]:
            answer = store.get(f"{PREFIX}response/{rank}")
            theirs, tag = answer[:NONCE_BYTES], answer[NONCE_BYTES:]
            if not hmac.compare_digest(tag, _mac(key, b"rank", session, rank, nonces[rank], theirs)):
                raise ClusterAuthError(
                    f"rank {rank} did not prove it holds the cluster secret {SECRET_SETTING}: its answer "
                    "to the challenge is wrong. It is refused and nothing was sent to it; start every "
                    "host with the same secret")
            store.set(f"{PREFIX}proof/{rank}", _mac(key, b"head", session, rank, nonces.pop(rank), theirs))
        if nonces and time.monotonic() > deadline:
            raise TimeoutError(f"ranks {sorted(nonces)} did not answer the challenge that proves they hold "
                               f"the cluster secret {SECRET_SETTING}")
        time.sleep(POLL_S)
    return session_key(key, session)


def prove_rank(store: Any, key: bytes, rank: int, where: str, timeout_s: float) -> bytes:
    """Rank ``rank`` (1 or above): answer rank 0's challenge and check its proof; returns the
    session key. Raises ClusterAuthError when the head's proof is wrong or the store closes
    first (the head refused this rank), TimeoutError when nothing comes within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    challenge = _await(store, f"{PREFIX}challenge/{rank}", deadline, where)
    session, theirs = challenge[:NONCE_BYTES], challenge[NONCE_BYTES:]
    mine = secrets.token_bytes(NONCE_BYTES)
    store.set(f"{PREFIX}response/{rank}", mine + _mac(key, b"rank", session, rank, theirs, mine))
    proof = _await(store, f"{PREFIX}proof/{rank}", deadline, where)
    if not hmac.compare_digest(proof, _mac(key, b"head", session, rank, theirs, mine)):
        raise ClusterAuthError(f"the head at {where} did not prove it holds the cluster secret "
                               f"{SECRET_SETTING}: nothing it sends is read. Start every host with the "
                               "same secret")
    return session_key(key, session)


def session_key(key: bytes, session: bytes) -> bytes:
    return hmac.new(key, b"tandem-ranks/session" + session, hashlib.sha256).digest()


def _mac(key: bytes, label: bytes, session: bytes, rank: int, head_nonce: bytes, rank_nonce: bytes) -> bytes:
    # every field but the label has a fixed length, so the concatenation is unambiguous
    message = b"tandem-ranks/" + label + session + rank.to_bytes(4, "big") + head_nonce + rank_nonce
    return hmac.new(key, message, hashlib.sha256).digest()


def _await(store: Any, name: str, deadline: float, where: str) -> bytes:
    while True:
        try:
            if store.check([name]):
                return store.get(name)
        except Exception as exc:  # noqa: BLE001 - torch raises several kinds when the store goes away
            raise ClusterAuthError(
                f"the rendezvous at {where} closed before the head proved it holds the cluster secret "
                f"{SECRET_SETTING} (the head refuses a rank whose secret differs from its own): "
                f"{type(exc).__name__}") from None
        if time.monotonic() > deadline:
            raise TimeoutError(f"the head at {where} did not prove in time that it holds the cluster "
                               f"secret {SECRET_SETTING}")
        time.sleep(POLL_S)
