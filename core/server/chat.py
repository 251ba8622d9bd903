"""POST /v1/chat/completions: the messages go through the tokenizer's chat template, then one
engine request with ``n`` choices; logprobs in the chat shape; SSE deltas with the role first.
"""
from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tandem.chat_template import NoChatTemplate, apply_chat_template, content_text
from tandem.outputs import CompletionOutput, Logprob, RequestOutput
from tandem.server.disagg import check_kv_secret, dump, hand_over, kv_transfer_args
from tandem.server.errors import APIError, bad_request
from tandem.server.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobEntry,
    ChatLogprobs,
    ChatMessage,
    ChatStreamChoice,
    DeltaMessage,
    PromptTokensDetails,
    TopLogprob,
    UsageInfo,
)
from tandem.server.serving import (
    SSE_DONE,
    ServingContext,
    SSEResponse,
    admit,
    check_prompt,
    log_unknown_fields,
    merged,
    prompt_logprobs_body,
    request_params,
    sse,
    sse_error,
    until_disconnect,
)
from tandem.server.structured import prepare_grammar
from tandem.server.validation import check_body, check_messages, check_prompt_logprobs

ROUTE = "/v1/chat/completions"


async def create_chat_completion(ctx: ServingContext, body: ChatCompletionRequest,
                                 request: Request) -> Response:
    if body.kv_transfer_params is not None:
        check_kv_secret(ctx.kv_secret, request)
    log_unknown_fields(body, ROUTE)
    check_body(body, ROUTE)
    check_messages(body)
    ctx.check_model(body.model)
    ctx.check_ready()
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs = true", "top_logprobs")
    check_prompt_logprobs(body)
    max_tokens = body.max_completion_tokens or body.max_tokens
    params = request_params(ctx, body, max_tokens, (body.top_logprobs or 0) if body.logprobs else None,
                            body.prompt_logprobs)
    token_ids = render_chat(ctx, body)
    max_tokens_name = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    check_prompt(ctx, token_ids, params, {"prompt": "messages", "logprobs": "top_logprobs",
                                          "max_tokens": max_tokens_name})
    await prepare_grammar(ctx.engine.engine, params, body)
    kv_transfer = await kv_transfer_args(ctx.engine.engine, ctx.handshakes, body, 1)
    view = _ChatView(ctx, body, f"chatcmpl-{uuid.uuid4().hex}", len(token_ids))
    streams = await admit(ctx, [token_ids], params, view.request_id, body.priority, kv_transfer)
    if body.stream:
        return SSEResponse(view.stream(streams), ctx, streams)
    final = await until_disconnect(request, lambda: view.collect(streams))
    response = view.response(final)
    if kv_transfer.remote_decode:
        response.kv_transfer_params = hand_over(final, request)
    return JSONResponse(dump(response))


def render_chat(ctx: ServingContext, body: ChatCompletionRequest) -> list[int]:
    """The prompt token ids of the conversation, through the tokenizer's chat template."""
    return chat_token_ids(ctx, body.messages, body.add_generation_prompt)


def chat_token_ids(ctx: ServingContext, messages: list[ChatMessage], add_generation_prompt: bool,
                   add_special_tokens: bool = False) -> list[int]:
    """The token ids of ``messages`` rendered by the tokenizer's chat template (a 400 when the
    model has none or the template refuses them)."""
    turns = [{"role": m.role, "content": content_text(m.content)} for m in messages]
    try:
        return apply_chat_template(ctx.tokenizer, turns, add_generation_prompt, add_special_tokens)
    except NoChatTemplate as exc:
        raise bad_request(f"the model {ctx.model_name!r} has no chat template, so it cannot serve "
                          "/v1/chat/completions; use /v1/completions", "messages") from exc
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from exc


@dataclass(slots=True)
class _ChoiceState:
    text_len: int = 0
    num_tokens: int = 0
    finished: bool = False


@dataclass(slots=True)
class _ChatView:
    """Renders the engine outputs of one chat request in OpenAI's chat shapes."""

    ctx: ServingContext
    body: ChatCompletionRequest
    request_id: str
    num_prompt_tokens: int
    states: dict[int, _ChoiceState] = field(default_factory=dict)

    async def collect(self, streams) -> RequestOutput:
        final = None
        async for _, out in merged(self.ctx, streams):
            final = out
        return final

    def response(self, out: RequestOutput) -> ChatCompletionResponse:
        choices = [
            ChatChoice(index=seq.index, message=AssistantMessage(content=seq.text),
                       logprobs=self._logprobs(seq.token_ids, seq.logprobs),
                       finish_reason=seq.finish_reason, stop_reason=seq.stop_reason)
            for seq in out.outputs
        ]
        return ChatCompletionResponse(id=self.request_id, model=self.ctx.model_name, choices=choices,
                                      usage=self._usage(out),
                                      prompt_logprobs=prompt_logprobs_body(out.prompt_logprobs))

    def _usage(self, out: RequestOutput | None) -> UsageInfo:
        completion = sum(len(seq.token_ids) for seq in out.outputs) if out is not None else 0
        cached = out.num_cached_tokens if out is not None else 0
        return UsageInfo(prompt_tokens=self.num_prompt_tokens, completion_tokens=completion,
                         total_tokens=self.num_prompt_tokens + completion,
                         prompt_tokens_details=PromptTokensDetails(cached_tokens=cached))

    def _logprobs(self, token_ids: list[int],
                  entries: list[dict[int, Logprob]] | None) -> ChatLogprobs | None:
        if not self.body.logprobs or entries is None:
            return None
        k = self.body.top_logprobs or 0
        content = []
        for token_id, entry in zip(token_ids, entries):
            chosen = entry[token_id]
            top = sorted(entry.values(), key=lambda lp: lp.rank)[:k]
            content.append(ChatLogprobEntry(**_token(chosen),
                                            top_logprobs=[TopLogprob(**_token(t)) for t in top]))
        return ChatLogprobs(content=content)

    def _chunk(self, choice: ChatStreamChoice) -> str:
        return sse(ChatCompletionChunk(id=self.request_id, model=self.ctx.model_name,
                                       choices=[choice]).model_dump_json())

    async def stream(self, streams):
        for i in range(self.body.n):
            yield self._chunk(ChatStreamChoice(index=i, delta=DeltaMessage(role="assistant", content="")))
        final = None
        try:
            async for _, out in merged(self.ctx, streams):
                final = out
                for seq in out.outputs:
                    choice = self._delta(seq)
                    if choice is not None:
                        yield self._chunk(choice)
            options = self.body.stream_options
            if options is not None and options.include_usage:
                usage = ChatCompletionChunk(id=self.request_id, model=self.ctx.model_name, choices=[],
                                            usage=self._usage(final))
                yield sse(usage.model_dump_json())
        except APIError as exc:
            self.ctx.metrics.record_error(exc.code)
            yield sse_error(exc)
        yield SSE_DONE

    def _delta(self, seq: CompletionOutput) -> ChatStreamChoice | None:
        st = self.states.setdefault(seq.index, _ChoiceState())
        if st.finished or not (seq.finished or len(seq.token_ids) > st.num_tokens):
            return None
        new_ids = seq.token_ids[st.num_tokens:]
        entries = seq.logprobs[st.num_tokens:] if seq.logprobs is not None else None
        choice = ChatStreamChoice(
            index=seq.index,
            delta=DeltaMessage(content=seq.text[st.text_len:]),
            logprobs=self._logprobs(new_ids, entries),
            finish_reason=seq.finish_reason,
            stop_reason=seq.stop_reason if seq.finished else None,
        )
        st.text_len, st.num_tokens, st.finished = len(seq.text), len(seq.token_ids), seq.finished
        return choice


def _token(lp: Logprob) -> dict:
    token = lp.decoded_token or ""
    return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode("utf-8"))}
