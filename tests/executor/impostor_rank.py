"""An impostor rank 1 without the cluster secret: ``python -m tests.executor.impostor_rank HOST
PORT RECORD``. It connects to the head's rendezvous store as any client can; if challenged it
answers as a rank with no secret would (an HMAC under the empty key, in the documented format);
then it joins the process group as rank 1 and waits for the head's first message. It writes what
it got to RECORD (JSON) after each stage."""
from __future__ import annotations

import hashlib
import hmac
import json
import os
import sys
from datetime import timedelta

import torch
import torch.distributed as dist

CHALLENGE, RESPONSE = "tandem-rank-auth/challenge/1", "tandem-rank-auth/response/1"


def main(host: str, port: int, record_path: str) -> None:
    record: dict = {"challenged": False, "joined": False, "received_bytes": 0, "error": None}

    def save() -> None:
        with open(record_path, "w") as f:
            json.dump(record, f)

    save()
    try:
        store = dist.TCPStore(host, port, None, False, timedelta(seconds=60))
        try:
            store.wait([CHALLENGE], timedelta(seconds=20))
            challenge = store.get(CHALLENGE)
            record["challenged"] = True
            session, nonce, mine = challenge[:32], challenge[32:], os.urandom(32)
            message = b"tandem-ranks/rank" + session + (1).to_bytes(4, "big") + nonce + mine
            store.set(RESPONSE, mine + hmac.new(b"", message, hashlib.sha256).digest())
        except Exception as exc:  # noqa: BLE001 - not challenged: join as any torch rank would
            record["error"] = f"no challenge: {type(exc).__name__}"
        save()
        dist.init_process_group("gloo", store=store, rank=1, world_size=2, timeout=timedelta(seconds=30))
        record["joined"] = True
        save()
        size = torch.empty(1, dtype=torch.int64)
        dist.recv(size, 0)
        record["received_bytes"] = int(size)
    except Exception as exc:  # noqa: BLE001 - recorded for the test
        record["error"] = f"{type(exc).__name__}: {exc}"[:500]
    save()


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]), sys.argv[3])
