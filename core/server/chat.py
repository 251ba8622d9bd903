"""POST /v1/chat/completions: the messages (and tools) go through the tokenizer's chat template,
then one engine request with ``n`` choices; logprobs in the chat shape; SSE deltas with the role
first; tool calls as ``tandem.server.tools.choice`` says.
"""
from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tandem.chat_template import NoChatTemplate, apply_chat_template, content_text
from tandem.outputs import CompletionOutput, Logprob, RequestOutput
from tandem.server.disagg import check_kv_secret, dump, hand_over, kv_transfer_args
from tandem.server.kv_progress import early_hand_over
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
    ChatCompletionTool,
    ChatStreamChoice,
    DeltaMessage,
    PromptTokensDetails,
    ToolCallFunction,
    ToolCallOut,
    TopLogprob,
    UsageInfo,
)
from tandem.server.serving import (
    SSE_DONE,
    ServingContext,
    SSEResponse,
    admit,
    log_unknown_fields,
    merged,
    prompt_logprobs_body,
    request_params,
    sse,
    sse_error,
    until_disconnect,
)
from tandem.server.tools.choice import ToolUse, tool_use
from tandem.server.tools.stream import ToolCallStream, new_tool_call_id
from tandem.server.validation import check_body, check_messages, check_prompt_logprobs

ROUTE = "/v1/chat/completions"


async def create_chat_completion(ctx: ServingContext, body: ChatCompletionRequest,
                                 request: Request) -> Response:
    if body.kv_transfer_params is not None:
        check_kv_secret(ctx.kv_secret, request)
    log_unknown_fields(body, ROUTE)
    check_body(body, ROUTE)
    check_messages(body)
    ctx.bounds.check_messages(body.messages)
    ctx.check_model(body.model)
    ctx.check_ready()
    if body.top_logprobs is not None and not body.logprobs:
        raise bad_request("top_logprobs needs logprobs = true", "top_logprobs")
    check_prompt_logprobs(body)
    tools = tool_use(body, ctx.tool_parser)
    max_tokens = body.max_completion_tokens or body.max_tokens
    params = tools.constrain(request_params(ctx, body, max_tokens,
                                            (body.top_logprobs or 0) if body.logprobs else None,
                                            body.prompt_logprobs))
    token_ids = await render_chat(ctx, body)
    max_tokens_name = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    grammar_name = "tools" if tools.schema is not None else (
        "structured_outputs" if body.structured_outputs is not None else "response_format")
    kv_transfer = await kv_transfer_args(ctx.engine, ctx.handshakes, body, 1)
    view = _ChatView(ctx, body, f"chatcmpl-{uuid.uuid4().hex}", len(token_ids), tools)
    streams = await admit(ctx, [token_ids], params, body, view.request_id, kv_transfer,
                          {"prompt": "messages", "logprobs": "top_logprobs",
                           "max_tokens": max_tokens_name, "structured_outputs": grammar_name})
    if kv_transfer.remote_decode and (early := early_hand_over(ctx, streams[0], request)) is not None:
        return early
    if body.stream:
        return SSEResponse(view.stream(streams), ctx, streams)
    final = await until_disconnect(request, lambda: view.collect(streams))
    response = view.response(final)
    if kv_transfer.remote_decode:
        response.kv_transfer_params = hand_over(final, request)
    return JSONResponse(dump(response))


async def render_chat(ctx: ServingContext, body: ChatCompletionRequest) -> list[int]:
    """The prompt token ids of the conversation, through the tokenizer's chat template. The
    tools are rendered whatever tool_choice says ("none" too, as vLLM by default)."""
    return await chat_token_ids(ctx, body.messages, body.add_generation_prompt, tools=body.tools)


async def chat_token_ids(ctx: ServingContext, messages: list[ChatMessage], add_generation_prompt: bool,
                         add_special_tokens: bool = False,
                         tools: list[ChatCompletionTool] | None = None) -> list[int]:
    """The token ids of ``messages`` (and ``tools``) rendered by the tokenizer's chat template
    on the tokenizer thread (a 400 when the model has none or the template refuses them)."""
    try:
        return await ctx.tokenize(_render, messages, add_generation_prompt, add_special_tokens, tools)
    except NoChatTemplate as exc:
        raise bad_request(f"the model {ctx.model_name!r} has no chat template, so it cannot serve "
                          "/v1/chat/completions; use /v1/completions", "messages") from exc
    except ValueError as exc:
        raise bad_request(str(exc), "messages") from exc


def _render(tokenizer, messages: list[ChatMessage], add_generation_prompt: bool,
            add_special_tokens: bool, tools: list[ChatCompletionTool] | None) -> list[int]:
    turns = [template_turn(i, m) for i, m in enumerate(messages)]
    return apply_chat_template(tokenizer, turns, add_generation_prompt, add_special_tokens,
                               tools=[t.template_dict() for t in tools or []] or None)


def template_turn(index: int, message: ChatMessage) -> dict:
    """``message`` as vLLM hands it to a chat template: content as text ("" for null), ``name``
    when given, an assistant's ``tool_calls`` (none when empty) with their arguments parsed from
    JSON text into values (templates render them with ``tojson``; empty means ``{}``), a tool
    message's ``tool_call_id``. A 400 when arguments are not JSON."""
    turn: dict = {"role": message.role, "content": content_text(message.content)}
    if message.name is not None:
        turn["name"] = message.name
    if message.tool_calls:
        turn["tool_calls"] = [_template_call(f"messages[{index}].tool_calls[{j}]", call)
                              for j, call in enumerate(message.tool_calls)]
    if message.tool_call_id is not None:
        turn["tool_call_id"] = message.tool_call_id
    return turn


def _template_call(path: str, call) -> dict:
    data = call.model_dump()
    try:
        data["function"]["arguments"] = json.loads(call.function.arguments) if call.function.arguments else {}
    except ValueError as exc:
        raise bad_request(f"{path}.function.arguments is not JSON text: {exc}", "messages") from None
    return data


@dataclass(slots=True)
class _ChoiceState:
    text_len: int = 0
    num_tokens: int = 0
    finished: bool = False
    tool_calls: ToolCallStream | None = None
    """The tool calls sent so far, when the request's tool use has a parser."""


@dataclass(slots=True)
class _ChatView:
    """Renders the engine outputs of one chat request in OpenAI's chat shapes."""

    ctx: ServingContext
    body: ChatCompletionRequest
    request_id: str
    num_prompt_tokens: int
    tools: ToolUse
    states: dict[int, _ChoiceState] = field(default_factory=dict)

    async def collect(self, streams) -> RequestOutput:
        final = None
        async for _, out in merged(self.ctx, streams):
            final = out
        return final

    def response(self, out: RequestOutput) -> ChatCompletionResponse:
        choices = []
        for seq in out.outputs:
            message = self._message(seq.text)
            choices.append(ChatChoice(
                index=seq.index, message=message, logprobs=self._logprobs(seq.token_ids, seq.logprobs),
                finish_reason=self.tools.finish_reason(seq.finish_reason, bool(message.tool_calls)),
                stop_reason=seq.stop_reason))
        return ChatCompletionResponse(id=self.request_id, model=self.ctx.model_name, choices=choices,
                                      usage=self._usage(out),
                                      prompt_logprobs=prompt_logprobs_body(out.prompt_logprobs))

    def _message(self, text: str) -> AssistantMessage:
        """The answer ``text`` as a message: content, and the tool calls the parser finds (when
        there are calls, empty content is null, as OpenAI)."""
        if self.tools.parser is None:
            return AssistantMessage(content=text)
        parse = self.tools.parser.parse(text, final=True)
        calls = [ToolCallOut(id=new_tool_call_id(),
                             function=ToolCallFunction(name=call.name, arguments=call.arguments))
                 for call in parse.calls[:self.tools.max_calls]]
        return AssistantMessage(content=(parse.content or None) if calls else parse.content,
                                tool_calls=calls)

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
        finish_reason = seq.finish_reason
        if self.tools.parser is None:
            delta = DeltaMessage(content=seq.text[st.text_len:])
        else:
            if st.tool_calls is None:
                st.tool_calls = ToolCallStream(self.tools.parser, self.tools.max_calls)
            content, calls = st.tool_calls.update(seq.text, seq.finished)
            delta = DeltaMessage(content=content if content or not calls else None, tool_calls=calls or None)
            if seq.finished:
                finish_reason = self.tools.finish_reason(seq.finish_reason, st.tool_calls.num_calls > 0)
        choice = ChatStreamChoice(
            index=seq.index,
            delta=delta,
            logprobs=self._logprobs(new_ids, entries),
            finish_reason=finish_reason,
            stop_reason=seq.stop_reason if seq.finished else None,
        )
        st.text_len, st.num_tokens, st.finished = len(seq.text), len(seq.token_ids), seq.finished
        return choice


def _token(lp: Logprob) -> dict:
    token = lp.decoded_token or ""
    return {"token": token, "logprob": lp.logprob, "bytes": list(token.encode("utf-8"))}
