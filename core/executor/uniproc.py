"""The "uniproc" executor: one worker, in the engine's own process — no extra process, no channel.
The default when nothing is parallel."""
from __future__ import annotations

from tandem.config import TandemConfig
from tandem.worker.worker import Worker
from tandem.interfaces import Executor, KVConnector
from tandem.sched.output import ModelRunnerOutput, SchedulerOutput


class UniprocExecutor(Executor):
    name = "uniproc"

    def __init__(self, config: TandemConfig, eos_token_ids: frozenset[int]) -> None:
        self.worker = Worker(config, eos_token_ids)

    @property
    def num_kv_blocks(self) -> int:
        return self.worker.info.num_kv_blocks

    @property
    def max_model_len(self) -> int:
        return self.worker.info.max_model_len

    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        return self.worker.execute(scheduler_output)

    def connect_kv(self, connector_name: str, compat_hash: str) -> KVConnector:
        return self.worker.connect_kv(connector_name, compat_hash)

    def close(self) -> None:
        self.worker.close()
