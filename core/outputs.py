"""What the offline API and the server return, shaped like vLLM's ``RequestOutput``."""
from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(slots=True)
class Logprob:
    """One candidate token at one position: its logprob, rank (1 = most likely) and text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


@dataclass(slots=True)
class CompletionOutput:
    """One of the ``n`` sequences of a request.

    ``logprobs[i]`` maps token id → Logprob for output position ``i`` (the sampled token and the
    top-k alternatives) when the request asked for logprobs, else None.
    """

    index: int
    text: str
    token_ids: list[int]
    cumulative_logprob: float | None = None
    logprobs: list[dict[int, Logprob]] | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class RequestOutput:
    """A request's state after a step (streaming) or at its end (``finished``)."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float | int | None] = field(default_factory=dict)
    kv_transfer_params: dict | None = None
    """On a prefill instance, in the final output of a request with ``do_remote_decode``: where
    its pinned KV blocks are (engine_id, transfer_id, block_ids, num_tokens, compat_hash)."""
    error: str | None = None
    """Set (with ``finished`` and finish reason "error") when the engine failed this request
    alone: a step it was in raised, and raised again with nothing else in it."""

    def absorb(self, delta: RequestOutput) -> None:
        """Append ``delta``, the next delta output of the same request (see
        ``OutputProcessor.output``), to this cumulative output. Costs what ``delta`` holds."""
        assert delta.request_id == self.request_id and len(delta.outputs) == len(self.outputs)
        for seq, new in zip(self.outputs, delta.outputs):
            seq.text += new.text
            seq.token_ids += new.token_ids
            if new.logprobs:
                seq.logprobs += new.logprobs
            seq.cumulative_logprob = new.cumulative_logprob
            seq.finish_reason, seq.stop_reason = new.finish_reason, new.stop_reason
        if delta.prompt_logprobs:
            if self.prompt_logprobs is None:
                self.prompt_logprobs = []
            self.prompt_logprobs += delta.prompt_logprobs
        self.finished = delta.finished
        self.num_cached_tokens = delta.num_cached_tokens
        self.metrics.update(delta.metrics)
        self.kv_transfer_params = delta.kv_transfer_params or self.kv_transfer_params
        self.error = delta.error
