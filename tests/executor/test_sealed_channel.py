"""The step channel between ranks opens only messages sealed under this launch's session key: two
real processes on a gloo group, first under one key (the control), then with rank 1 under another
(as a process on rank 0's connection without the cluster secret would be). Under another key
neither side takes the other's frames, and rank 0 never unpickles a reply whose pickle creates a
file when loaded (the control shows that it does)."""
from __future__ import annotations

import json
import multiprocessing
import pickle
import socket
from datetime import timedelta
from pathlib import Path

import pytest

pytestmark = pytest.mark.timeout(180)
KEY, OTHER_KEY = b"k" * 32, b"x" * 32


class _Trap:
    """A pickle that creates ``path`` when it is loaded."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def _round(channel, rank: int, trap: Path) -> dict:
    """One step's traffic: rank 0 broadcasts a pickle, every rank replies with a trap; rank 0
    unpickles the replies as the step loop does."""
    from tandem.executor.rank_auth import ClusterAuthError

    record: dict = {}
    try:
        record["broadcast"] = channel.broadcast(pickle.dumps("a prompt") if rank == 0 else None).hex()
    except ClusterAuthError as exc:
        record["broadcast_refused"] = str(exc)
    try:
        replies = channel.gather(pickle.dumps(_Trap(str(trap))))
        if replies is not None:
            record["gathered"] = len([pickle.loads(r) for r in replies[1:]])
    except ClusterAuthError as exc:
        record["gather_refused"] = str(exc)
    return record


def _rank(rank: int, port: int, out: str) -> None:
    import torch.distributed as dist

    from tandem.executor.sealed_channel import SealedChannel

    store = dist.TCPStore("127.0.0.1", port, None, rank == 0, timedelta(seconds=60), wait_for_workers=False)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timedelta(seconds=60))
    folder = Path(out).parent
    control = _round(SealedChannel(KEY, rank, 2, dist.group.WORLD), rank, folder / "control.trap")
    forged_key = KEY if rank == 0 else OTHER_KEY
    forged = _round(SealedChannel(forged_key, rank, 2, dist.group.WORLD), rank, folder / "forged.trap")
    Path(out).write_text(json.dumps({"control": control, "forged": forged}))


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> tuple[dict, dict, Path]:
    folder = tmp_path_factory.mktemp("sealed")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = multiprocessing.get_context("spawn")
    procs = [ctx.Process(target=_rank, args=(r, port, str(folder / f"rank{r}.json"))) for r in (0, 1)]
    for proc in procs:
        proc.start()
    for proc in procs:
        proc.join(150)
        assert proc.exitcode == 0, proc.exitcode
    rank0, rank1 = (json.loads((folder / f"rank{r}.json").read_text()) for r in (0, 1))
    return rank0, rank1, folder


def test_frames_under_the_same_key_arrive_and_are_unpickled(records):
    rank0, rank1, folder = records
    assert pickle.loads(bytes.fromhex(rank1["control"]["broadcast"])) == "a prompt"
    assert rank0["control"]["gathered"] == 1 and (folder / "control.trap").exists()


def test_frames_under_another_key_are_refused_before_unpickling(records):
    rank0, rank1, folder = records
    assert "a message from rank 0 is not sealed with this launch's key" in rank1["forged"]["broadcast_refused"]
    refused = rank0["forged"]["gather_refused"]
    assert "a message from rank 1 is not sealed" in refused and "disaggregation.kv_transfer_secret" in refused
    assert not (folder / "forged.trap").exists()
