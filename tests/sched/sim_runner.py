"""A simulated model runner for the scheduler's property tests.

It keeps its own per-request state from the scheduler's diffs only (new requests in full, cached
ones as new blocks and copy-on-write replacements, forks as copies of the parent), the way a real
runner does, and writes into a shadow KV pool: every slot records the exact token prefix whose KV
it would hold. Before a request's tokens are "attended", every context slot its block table
points at must hold that request's own prefix — so a prefix-cache hit onto blocks holding other
tokens, a missed copy-on-write, or a block handed to two owners shows up as a mismatch.
"""
from __future__ import annotations

import zlib
from dataclasses import dataclass

from tandem.sched.output import ModelRunnerOutput, SchedulerOutput

VOCAB = 40
EOS = 0


def fake_token(request_id: str, position: int) -> int:
    """The deterministic token request ``request_id`` samples at ``position``."""
    return zlib.crc32(f"{request_id}@{position}".encode()) % VOCAB


@dataclass
class _Held:
    tokens: list[int]
    table: list[int]
    num_computed: int


class SimulatedRunner:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        self.block_size = block_size
        self.shadow: list[list[tuple[int, ...] | None]] = [
            [None] * block_size for _ in range(num_blocks)]
        self.held: dict[str, _Held] = {}

    def execute(self, out: SchedulerOutput) -> ModelRunnerOutput:
        starts = self._apply_diff(out)
        for src, dst in out.block_copies:
            self.shadow[dst] = list(self.shadow[src])
        for rid, num in out.num_scheduled_tokens.items():
            self._write(self.held[rid], starts[rid], starts[rid] + num, out.spec_token_ids.get(rid, []))
        for rid, num in out.num_scheduled_tokens.items():
            self._check_context(rid, starts[rid] + num, out.spec_token_ids.get(rid, []))
        result = ModelRunnerOutput()
        for rid, num in out.num_scheduled_tokens.items():
            held = self.held[rid]
            drafts = out.spec_token_ids.get(rid, [])
            if drafts:
                assert starts[rid] == len(held.tokens) - 1 and num == 1 + len(drafts)
                result.sampled_token_ids[rid] = self._check_drafts(rid, held, drafts)
                held.num_computed = starts[rid] + len(result.sampled_token_ids[rid])
                continue
            held.num_computed = starts[rid] + num
            if held.num_computed == len(held.tokens):
                result.sampled_token_ids[rid] = [self._sample(rid, held)]
        for fork in out.forked_requests:
            parent = self.held[fork.parent_id]
            tokens = parent.tokens[:parent.num_computed]
            child = _Held(tokens=tokens, table=list(parent.table), num_computed=parent.num_computed)
            self.held[fork.request_id] = child
            result.sampled_token_ids[fork.request_id] = [self._sample(fork.request_id, child)]
        return result

    def _apply_diff(self, out: SchedulerOutput) -> dict[str, int]:
        for rid in out.finished_req_ids | out.preempted_req_ids:
            self.held.pop(rid, None)
        starts = {}
        for new in out.new_requests:
            assert new.request_id not in self.held, f"{new.request_id} sent in full while held"
            assert new.num_prompt_tokens <= len(new.token_ids)
            self.held[new.request_id] = _Held(
                list(new.token_ids), list(new.block_ids), new.num_computed_tokens)
            starts[new.request_id] = new.num_computed_tokens
        for cached in out.cached_requests:
            held = self.held[cached.request_id]
            assert cached.num_computed_tokens == held.num_computed, "progress out of sync"
            for index, block_id in cached.replaced_blocks:
                held.table[index] = block_id
            held.table.extend(cached.new_block_ids)
            starts[cached.request_id] = cached.num_computed_tokens
        assert set(starts) == set(out.num_scheduled_tokens)
        return starts

    def _write(self, held: _Held, start: int, end: int, drafts: list[int]) -> None:
        tokens = held.tokens + drafts
        assert end <= len(tokens), "scheduled past the last known token"
        bs = self.block_size
        for pos in range(start, end):
            self.shadow[held.table[pos // bs]][pos % bs] = tuple(tokens[:pos + 1])

    def _check_context(self, rid: str, end: int, drafts: list[int]) -> None:
        held, bs = self.held[rid], self.block_size
        tokens = held.tokens + drafts
        for pos in range(end):
            found = self.shadow[held.table[pos // bs]][pos % bs]
            assert found == tuple(tokens[:pos + 1]), (
                f"{rid} position {pos}: block {held.table[pos // bs]} holds KV of {found}")

    @staticmethod
    def _sample(rid: str, held: _Held) -> int:
        token = fake_token(rid, len(held.tokens))
        held.tokens.append(token)
        return token

    @classmethod
    def _check_drafts(cls, rid: str, held: _Held, drafts: list[int]) -> list[int]:
        """The simulated model agrees with a draft when a hash of the position says so (about
        half the time), else samples its own token there; it always adds one token after the
        accepted drafts."""
        tokens = []
        for draft in drafts:
            if zlib.crc32(f"{rid}#{len(held.tokens)}".encode()) % 2:
                break
            held.tokens.append(draft)
            tokens.append(draft)
        tokens.append(cls._sample(rid, held))
        return tokens
