"""Turns the scheduler's per-step updates into ``RequestOutput``s: detokenizes incrementally,
matches stop strings, gathers the n sequences of a request and their logprobs.

Runs on the engine thread after each step. A stop string ends its sequence through
``Scheduler.finish_requests`` before the next step is scheduled, so no token is computed past it.

Outputs are cumulative (everything so far: the offline API) or deltas (what changed since the
request's previous output: the server's streams, which fold them back into one cumulative output
on the event loop, so a step costs what it adds, not what a request holds).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from tandem.detokenizer import IncrementalDetokenizer
from tandem.outputs import CompletionOutput, Logprob, RequestOutput
from tandem.sched.output import ModelRunnerOutput, TokenLogprobs
from tandem.sched.request import Request, RequestStatus
from tandem.sampling_params import SamplingParams


@dataclass(slots=True)
class _Sequence:
    detokenizer: IncrementalDetokenizer | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, Logprob]] | None = None
    cumulative_logprob: float | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    text: str = ""
    num_sent_tokens: int = 0  # what earlier delta outputs carried
    num_sent_chars: int = 0


@dataclass(slots=True)
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    sequences: list[_Sequence]
    prompt_logprobs: list[dict[int, Logprob] | None] | None = None
    num_cached_tokens: int = 0
    metrics: dict[str, float | int | None] = field(default_factory=dict)
    error: str | None = None
    num_sent_prompt_logprobs: int = 0

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.sequences)


class OutputProcessor:
    """Keeps the output state of every live request, keyed by the user's request id."""

    def __init__(self, tokenizer) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, _RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                    params: SamplingParams) -> None:
        self.states[request_id] = _RequestState(
            request_id=request_id,
            prompt=prompt,
            prompt_token_ids=list(prompt_token_ids),
            params=params,
            sequences=[self._new_sequence(prompt_token_ids, params) for _ in range(params.n)],
            prompt_logprobs=[] if params.prompt_logprobs is not None else None,
        )

    def _new_sequence(self, prompt_token_ids: list[int], params: SamplingParams) -> _Sequence:
        detok = None
        if self.tokenizer is not None:
            detok = IncrementalDetokenizer(
                self.tokenizer,
                prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
        return _Sequence(detokenizer=detok, logprobs=[] if params.logprobs is not None else None,
                         cumulative_logprob=0.0 if params.logprobs is not None else None)

    def process(
        self, request: Request, new_token_ids: list[int], runner_out: ModelRunnerOutput | None
    ) -> str | None:
        """Add ``request``'s new tokens to its sequence. Returns the matched stop string when one
        ends the sequence here (the caller finishes the request in the scheduler)."""
        state = self.states.get(request.parent_id or request.request_id)
        if state is None:
            return None
        seq = state.sequences[request.sample_index]
        self._record_metrics(state, request)
        self.add_prompt_logprobs(request, runner_out)
        stop_str = None
        logprobs = runner_out.logprobs.get(request.request_id, ()) if runner_out is not None else ()
        for i, token in enumerate(new_token_ids):
            seq.token_ids.append(token)
            if seq.logprobs is not None and i < len(logprobs):
                seq.logprobs.append(self._logprob_dict(logprobs[i]))
                seq.cumulative_logprob += logprobs[i].logprob
            if seq.detokenizer is not None and stop_str is None:
                stop_str = seq.detokenizer.add_tokens([token]).stop_matched
                seq.text = seq.detokenizer.text
        if stop_str is not None:
            seq.finish_reason, seq.stop_reason = "stop", stop_str
        elif request.status.is_finished:
            self._finish_sequence(seq, request)
        return stop_str

    def add_prompt_logprobs(self, request: Request, runner_out: ModelRunnerOutput | None) -> bool:
        """Take ``request``'s prompt logprobs of this step, if any (whether there were). Entries
        that start at the first prompt token (None) replace those held: the prompt is being
        computed again (after a preemption), at the same positions."""
        state = self.states.get(request.parent_id or request.request_id)
        if state is None or runner_out is None or request.request_id not in runner_out.prompt_logprobs:
            return False
        entries = runner_out.prompt_logprobs[request.request_id]
        if entries and entries[0] is None:
            state.prompt_logprobs.clear()
        state.prompt_logprobs.extend(self._logprob_dict(e) if e is not None else None for e in entries)
        return True

    def finish(self, request: Request) -> None:
        """Mark the sequence of ``request`` finished with the request's own final status."""
        state = self.states.get(request.parent_id or request.request_id)
        if state is not None:
            self._record_metrics(state, request)
            self._finish_sequence(state.sequences[request.sample_index], request)

    def finish_all(self, request_id: str, reason: str, error: str | None = None) -> None:
        """End every unfinished sequence of ``request_id`` with ``reason`` ("abort", or "error"
        with the ``error`` message)."""
        state = self.states.get(request_id)
        if state is not None:
            state.error = error
            for seq in state.sequences:
                if seq.finish_reason is None:
                    seq.finish_reason = reason

    def _finish_sequence(self, seq: _Sequence, request: Request) -> None:
        if seq.finish_reason is not None:
            return
        seq.finish_reason = request.status.finish_reason or "abort"
        seq.stop_reason = request.stop_reason
        if seq.detokenizer is not None:
            seq.detokenizer.flush()
            seq.text = seq.detokenizer.text

    def _record_metrics(self, state: _RequestState, request: Request) -> None:
        m = request.metrics
        state.num_cached_tokens = max(state.num_cached_tokens, m.num_cached_prompt_tokens)
        cur = state.metrics
        cur["arrival_time"] = m.arrival_time
        for key in ("first_scheduled_time", "first_token_time"):
            value = getattr(m, key)
            if value is not None and (cur.get(key) is None or value < cur[key]):
                cur[key] = value
        for key in ("last_token_time", "finished_time"):
            value = getattr(m, key)
            if value is not None and (cur.get(key) is None or value > cur[key]):
                cur[key] = value
        cur["num_preemptions"] = max(cur.get("num_preemptions") or 0, m.num_preemptions)

    def _logprob_dict(self, lp: TokenLogprobs) -> dict[int, Logprob]:
        out = {tid: Logprob(logprob, rank, self._decode(tid)) for tid, logprob, rank in lp.top}
        out.setdefault(lp.token_id, Logprob(lp.logprob, lp.rank, self._decode(lp.token_id)))
        return out

    def _decode(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        return self.tokenizer.decode([token_id])

    def is_finished(self, request_id: str) -> bool:
        """Whether every sequence of ``request_id`` has ended (True for a request not held)."""
        state = self.states.get(request_id)
        return state is None or state.finished

    def output(self, request_id: str, delta: bool = False) -> RequestOutput | None:
        """The output of ``request_id``: cumulative, or with ``delta`` only what the request's
        previous delta output did not carry (every sequence is listed; the prompt token ids are
        shared, not copied). Forgets the request once it is finished."""
        state = self.states.get(request_id)
        if state is None:
            return None
        prompt_logprobs = state.prompt_logprobs
        if delta and prompt_logprobs is not None:
            prompt_logprobs = prompt_logprobs[state.num_sent_prompt_logprobs:]
            state.num_sent_prompt_logprobs += len(prompt_logprobs)
        out = RequestOutput(
            request_id=request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            outputs=[self._completion(i, s, delta) for i, s in enumerate(state.sequences)],
            finished=state.finished,
            prompt_logprobs=prompt_logprobs,
            num_cached_tokens=state.num_cached_tokens,
            metrics=dict(state.metrics),
            error=state.error,
        )
        if state.finished:
            del self.states[request_id]
        return out

    @staticmethod
    def _completion(index: int, s: _Sequence, delta: bool) -> CompletionOutput:
        tokens, chars = (s.num_sent_tokens, s.num_sent_chars) if delta else (0, 0)
        if delta:
            s.num_sent_tokens, s.num_sent_chars = len(s.token_ids), len(s.text)
        return CompletionOutput(
            index=index,
            text=s.text[chars:],
            token_ids=s.token_ids[tokens:],
            cumulative_logprob=s.cumulative_logprob,
            logprobs=s.logprobs[tokens:] if s.logprobs is not None else None,
            finish_reason=s.finish_reason,
            stop_reason=s.stop_reason,
        )
