"""POST /v1/completions: one engine request per prompt, ``n`` choices each, choice index
``prompt_index * n + sequence_index``; OpenAI's completions logprobs shape; echo; SSE streaming.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tandem.async_engine import RequestStream
from tandem.outputs import CompletionOutput, Logprob, RequestOutput
from tandem.server.disagg import check_kv_secret, dump, hand_over, kv_transfer_args
from tandem.server.kv_progress import early_hand_over
from tandem.server.errors import APIError, bad_request
from tandem.server.protocol import (
    CompletionChoice,
    CompletionLogprobs,
    CompletionRequest,
    CompletionResponse,
    PromptTokensDetails,
    UsageInfo,
)
from tandem.server.serving import (
    SSE_DONE,
    ServingContext,
    SSEResponse,
    admit,
    close_all,
    log_unknown_fields,
    merged,
    prompt_logprobs_body,
    request_params,
    sse,
    sse_error,
    until_disconnect,
)
from tandem.server.validation import check_body, check_prompt_logprobs

ROUTE = "/v1/completions"


async def create_completion(ctx: ServingContext, body: CompletionRequest, request: Request) -> Response:
    if body.kv_transfer_params is not None:
        check_kv_secret(ctx.kv_secret, request)
    log_unknown_fields(body, ROUTE)
    check_body(body, ROUTE)
    ctx.check_model(body.model)
    ctx.check_ready()
    check_prompt_logprobs(body)
    ctx.bounds.check_prompts(body.prompt)
    prompt_logprobs, prompt_logprobs_name = _prompt_logprobs(body)
    params = request_params(ctx, body, body.max_tokens, body.logprobs, prompt_logprobs)
    grammar_name = "structured_outputs" if body.structured_outputs is not None else "response_format"
    prompts = _prompts(body.prompt)
    kv_transfer = await kv_transfer_args(ctx.engine, ctx.handshakes, body, len(prompts))
    request_id = f"cmpl-{uuid.uuid4().hex}"
    streams = await admit(ctx, prompts, params, body, request_id, kv_transfer,
                          {"prompt_logprobs": prompt_logprobs_name, "structured_outputs": grammar_name})
    if kv_transfer.remote_decode and (early := early_hand_over(ctx, streams[0], request)) is not None:
        return early
    try:
        view = await _view(ctx, body, request_id, streams)
    except BaseException:
        close_all(streams)
        raise
    if body.stream:
        return SSEResponse(view.stream(streams), ctx, streams)
    finals = await until_disconnect(request, lambda: view.collect(streams))
    response = view.response(finals)
    if kv_transfer.remote_decode:
        response.kv_transfer_params = hand_over(finals[0], request)
    return JSONResponse(dump(response))


def _prompt_logprobs(body: CompletionRequest) -> tuple[int | None, str]:
    """How many alternatives the prompt's logprobs need, and the request field that asks for
    the most: vLLM's ``prompt_logprobs``, or ``logprobs`` with ``echo`` (the echoed prompt's)."""
    echoed = body.logprobs if body.echo else None
    if echoed is not None and (body.prompt_logprobs is None or echoed > body.prompt_logprobs):
        return echoed, "logprobs"
    return body.prompt_logprobs, "prompt_logprobs"


def _prompts(prompt) -> list[str | list[int]]:
    """Each prompt of the body: a text or token ids."""
    if isinstance(prompt, str):
        prompt = [prompt]
    if not prompt:
        raise bad_request("the prompt is empty", "prompt")
    if isinstance(prompt[0], int):
        prompt = [prompt]
    if any(isinstance(p, str) and not p for p in prompt):
        raise bad_request("the prompt is empty", "prompt")
    return [p if isinstance(p, str) else list(p) for p in prompt]


async def _view(ctx: ServingContext, body: CompletionRequest, request_id: str,
                streams: list[RequestStream]) -> _CompletionView:
    prompts = [s.prompt_token_ids for s in streams]
    texts = [s.prompt for s in streams]
    if body.echo:
        texts = await ctx.tokenize(_echoed_texts, prompts, texts)
    return _CompletionView(ctx, body, request_id, prompts, texts)


def _echoed_texts(tokenizer, prompts: list[list[int]], texts: list[str | None]) -> list[str]:
    """The text each prompt echoes: as sent, or its token ids decoded (checked already)."""
    return [text if text is not None else tokenizer.decode(ids) for ids, text in zip(prompts, texts)]


@dataclass(slots=True)
class _ChoiceState:
    """What a stream has sent of one choice so far."""

    text_len: int = 0
    num_tokens: int = 0
    text_offset: int = 0
    finished: bool = False


@dataclass(slots=True)
class _CompletionView:
    """Renders engine outputs of one HTTP request as OpenAI completions."""

    ctx: ServingContext
    body: CompletionRequest
    request_id: str
    prompts: list[list[int]]
    texts: list[str | None]
    """Each prompt's text: all set when the body echoes."""
    states: dict[int, _ChoiceState] = field(default_factory=dict)

    async def collect(self, streams) -> list[RequestOutput]:
        finals: list[RequestOutput | None] = [None] * len(streams)
        async for index, out in merged(self.ctx, streams):
            finals[index] = out
        return finals

    def response(self, finals: list[RequestOutput]) -> CompletionResponse:
        choices = []
        for index, out in enumerate(finals):
            for seq in out.outputs:
                st = _ChoiceState()
                choice = self._choice(index, out, seq, st, first=True, last=True)
                choice.prompt_logprobs = prompt_logprobs_body(out.prompt_logprobs)
                choices.append(choice)
        return CompletionResponse(id=self.request_id, model=self.ctx.model_name, choices=choices,
                                  usage=self._usage(finals))

    def _usage(self, finals: list[RequestOutput]) -> UsageInfo:
        prompt = sum(len(p) for p in self.prompts)
        completion = sum(len(seq.token_ids) for out in finals for seq in out.outputs)
        cached = sum(out.num_cached_tokens for out in finals)
        return UsageInfo(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    async def stream(self, streams):
        finals: list[RequestOutput | None] = [None] * len(streams)
        try:
            async for index, out in merged(self.ctx, streams):
                finals[index] = out
                for seq in out.outputs:
                    chunk = self._delta(index, out, seq)
                    if chunk is not None:
                        yield sse(chunk.model_dump_json())
            options = self.body.stream_options
            if options is not None and options.include_usage:
                usage = CompletionResponse(id=self.request_id, model=self.ctx.model_name, choices=[],
                                           usage=self._usage(finals))
                yield sse(usage.model_dump_json())
        except APIError as exc:
            self.ctx.metrics.record_error(exc.code)
            yield sse_error(exc)
        yield SSE_DONE

    def _delta(self, index: int, out: RequestOutput, seq: CompletionOutput) -> CompletionResponse | None:
        key = index * self.body.n + seq.index
        first = key not in self.states
        st = self.states.setdefault(key, _ChoiceState())
        if st.finished or not (first or seq.finished or len(seq.token_ids) > st.num_tokens):
            return None
        choice = self._choice(index, out, seq, st, first=first, last=seq.finished)
        return CompletionResponse(id=self.request_id, model=self.ctx.model_name, choices=[choice])

    def _choice(self, index: int, out: RequestOutput, seq: CompletionOutput, st: _ChoiceState,
                first: bool, last: bool) -> CompletionChoice:
        """The part of choice ``seq`` not yet in ``st`` (everything when ``st`` is fresh)."""
        text = seq.text[st.text_len:]
        lp = None
        if self.body.logprobs is not None:
            lp = CompletionLogprobs()
            if first and self.body.echo:
                self._add_prompt_logprobs(lp, index, out, st)
            self._add_logprobs(lp, seq.token_ids[st.num_tokens:], seq.logprobs[st.num_tokens:], st)
        if first and self.body.echo:
            text = self.texts[index] + text
        st.text_len, st.num_tokens, st.finished = len(seq.text), len(seq.token_ids), seq.finished
        return CompletionChoice(index=index * self.body.n + seq.index, text=text, logprobs=lp,
                                finish_reason=seq.finish_reason if last else None,
                                stop_reason=seq.stop_reason if last else None)

    def _add_prompt_logprobs(self, lp: CompletionLogprobs, index: int, out: RequestOutput,
                             st: _ChoiceState) -> None:
        entries = out.prompt_logprobs or []
        prompt = self.prompts[index]
        tokenizer = self.ctx.tokenizer
        for pos, token_id in enumerate(prompt):
            entry = entries[pos] if pos < len(entries) else None
            if entry is None:
                self._append(lp, tokenizer.decode([token_id]), None, None, st)
            else:
                self._append_entry(lp, token_id, entry, st)

    def _add_logprobs(self, lp: CompletionLogprobs, token_ids: list[int],
                      entries: list[dict[int, Logprob]], st: _ChoiceState) -> None:
        for token_id, entry in zip(token_ids, entries):
            self._append_entry(lp, token_id, entry, st)

    def _append_entry(self, lp: CompletionLogprobs, token_id: int, entry: dict[int, Logprob],
                      st: _ChoiceState) -> None:
        """The token and its ``logprobs`` most likely alternatives (an echoed prompt's entry may
        hold more, for ``prompt_logprobs``)."""
        chosen = entry[token_id]
        top = {lp.decoded_token or "": lp.logprob for lp in sorted(entry.values(), key=lambda lp: lp.rank)
               if lp.rank <= self.body.logprobs or lp is chosen}
        self._append(lp, chosen.decoded_token or "", chosen.logprob, top, st)

    @staticmethod
    def _append(lp: CompletionLogprobs, token: str, logprob: float | None,
                top: dict[str, float] | None, st: _ChoiceState) -> None:
        lp.tokens.append(token)
        lp.token_logprobs.append(logprob)
        lp.top_logprobs.append(top)
        lp.text_offset.append(st.text_offset)
        st.text_offset += len(token)
