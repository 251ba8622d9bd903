"""The OpenAI API's request and response bodies, as pydantic models.

Requests are validated strictly (``"5"`` is not an integer; NaN and ±Infinity, which Python's
JSON parser accepts, are not numbers) and accept unknown fields, which the handlers log and
ignore, as vLLM does — except the fields of OpenAI's and vLLM's APIs that tandem does not
implement, which ``tandem.server.validation`` refuses unless they carry their neutral value.
Besides OpenAI's fields the requests accept vLLM's sampling extras (top_k, min_p,
repetition_penalty, ignore_eos, min_tokens, stop_token_ids, priority…). What depends on the
engine (vocabulary, context length, max_logprobs, max_num_seqs) is checked by
``tandem.input_processor`` once the prompt is tokenized.
"""
from __future__ import annotations

import time
import types
from typing import Annotated, Any, ClassVar, Literal, Union, get_args, get_origin
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator
from pydantic_core import PydanticCustomError

from tandem.input_processor import MAX_CACHE_SALT_CHARS
from tandem.sampling_params import (
    MAX_BAD_WORDS,
    MAX_TOKEN_ID_ENTRIES,
    SEED_MAX,
    SEED_MIN,
)

ROLES = ("system", "developer", "user", "assistant", "tool")
"""The chat roles of OpenAI's API (its deprecated "function" role belongs to the legacy
``functions`` API, which tandem does not implement; ``tools`` is its successor)."""


class _Request(BaseModel):
    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """An explicit ``null`` for a field that cannot be None means its default (clients send
        ``"n": null`` for "unset"); where None is meaningful (``max_tokens``) it is kept."""
        if not isinstance(data, dict):
            return data
        return {k: v for k, v in data.items()
                if v is not None or k not in cls.model_fields or _nullable(cls.model_fields[k].annotation)}


def _nullable(annotation: Any) -> bool:
    return get_origin(annotation) in (Union, types.UnionType) and type(None) in get_args(annotation)


class _Response(BaseModel):
    model_config = ConfigDict(extra="forbid")


class StreamOptions(_Request):
    include_usage: bool = False


class JsonSchemaFormat(_Request):
    """``response_format.json_schema``: OpenAI's structured outputs. ``strict`` is accepted and
    changes nothing: the answer always follows the schema (constrained decoding)."""

    name: str = Field(min_length=1, max_length=64, pattern=r"^[a-zA-Z0-9_-]+$")
    description: str | None = None
    json_schema: dict[str, Any] | bool | None = Field(None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Request):
    """OpenAI's ``response_format``: ``{"type": "text"}``, ``{"type": "json_object"}`` (JSON
    mode: the reply is one JSON object) or ``{"type": "json_schema", "json_schema": {"name",
    "schema", "strict"}}`` (the reply is valid against the schema)."""

    type: str
    json_schema: JsonSchemaFormat | None = None


BlockId = Annotated[int, Field(ge=0, lt=2**31)]


class KVTransferParams(_Request):
    """A request's ``kv_transfer_params``, which only the router sets (``tandem.server.disagg``)::

        prefill form   {"do_remote_decode": true}
        decode form    {"do_remote_prefill": true, "engine_id", "transfer_id", "block_ids",
                        "num_tokens", "prompt_digest", "compat_hash", "handshake_url",
                        "expires_at", "signature"}
                       (a prefill answer's kv_transfer_params plus the flag; "signature" only
                        when the cluster has a secret)

    Exactly one flag is true; the prefill form has no other field. An unknown field or a
    malformed value is a 400 naming it, on every instance. The decode form's other fields are
    required where they are used, on a decode instance (``missing_for_remote_prefill``): an
    instance of another role ignores the hand-over and serves the request in full."""

    model_config = ConfigDict(extra="forbid")

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    engine_id: str | None = Field(None, min_length=1, max_length=256)
    transfer_id: str | None = Field(None, min_length=1, max_length=512)
    block_ids: list[BlockId] | None = None
    num_tokens: int | None = Field(None, ge=1)
    prompt_digest: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    """The prefill instance's keyed digest of the prompt and its cache salt
    (``tandem.handover_auth.prompt_digest``)."""
    compat_hash: str | None = Field(None, min_length=1, max_length=128)
    handshake_url: str | None = Field(None, max_length=2048)
    """Where the decode instance fetches the prefill instance's KV handshake: http(s) only."""
    expires_at: int | None = Field(None, ge=0)
    """Unix time (s) after which the hand-over is refused: its pin expires then."""
    kv_checksums: list[Annotated[str, Field(pattern=r"^[0-9a-f]{8}$")]] | None = Field(None, max_length=1 << 20)
    """The prefill instance's checksum of each block (``KVConnector.block_checksums``), which
    the decode instance compares after its read; absent when its connector has none. Not
    signed: altered, it can only make the decode instance recompute the prompt."""
    signature: str | None = Field(None, pattern=r"^[0-9a-f]{64}$")
    """The prefill instance's HMAC-SHA256 of the other fields (``tandem.handover_auth``);
    absent only when neither instance has a ``kv_transfer_secret``."""
    stream: bool | None = None
    """True: a streamed hand-over (``tandem.kv_stream``): ``block_ids`` is empty and the blocks
    are announced at the prefill instance's ``/kv/progress`` as its prompt is computed."""

    REMOTE_PREFILL_FIELDS: ClassVar[tuple[str, ...]] = (
        "engine_id", "transfer_id", "block_ids", "num_tokens", "prompt_digest", "compat_hash",
        "handshake_url", "expires_at")

    @field_validator("handshake_url")
    @classmethod
    def _http_url(cls, value: str | None) -> str | None:
        if value is not None:
            parts = urlsplit(value)
            if parts.scheme not in ("http", "https") or not parts.hostname:
                raise PydanticCustomError("url", "must be an http:// or https:// URL with a host")
        return value

    @model_validator(mode="after")
    def _one_form(self) -> KVTransferParams:
        if self.do_remote_decode == self.do_remote_prefill:
            raise PydanticCustomError("kv_transfer_params", "set exactly one of do_remote_decode and "
                                      "do_remote_prefill to true")
        given = [name for name in (*self.REMOTE_PREFILL_FIELDS, "kv_checksums", "signature", "stream")
                 if getattr(self, name) is not None]
        if self.do_remote_decode and given:
            raise PydanticCustomError("kv_transfer_params", "do_remote_decode takes no other field "
                                      "(got {given})", {"given": ", ".join(given)})
        return self

    def missing_for_remote_prefill(self) -> list[str]:
        """The decode form's fields that are not set."""
        return [name for name in self.REMOTE_PREFILL_FIELDS if getattr(self, name) is None]

    def remote_prefill_params(self) -> dict[str, Any]:
        """The prefill answer's fields and signature, of a complete decode form."""
        return self.model_dump(include={*self.REMOTE_PREFILL_FIELDS, "kv_checksums", "signature", "stream"},
                               exclude_none=True)


class KVReleaseRequest(_Request):
    """POST /kv/release: the router gives up a hand-over that no decode instance took."""

    model_config = ConfigDict(extra="forbid")

    transfer_id: str = Field(min_length=1, max_length=512)


class KVReleaseResponse(_Response):
    transfer_id: str
    released: bool
    """False when no such pin was held (already read, released or expired)."""


class ResetPrefixCacheResponse(_Response):
    num_blocks_forgotten: int
    """Cached blocks dropped (those a running request holds stay)."""


class SamplingFields(_Request):
    """The fields that become ``SamplingParams``; None means the default."""

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    presence_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    frequency_penalty: float | None = Field(None, ge=-2.0, le=2.0)
    repetition_penalty: float | None = Field(None, gt=0.0)
    seed: int | None = Field(None, ge=SEED_MIN, le=SEED_MAX)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    skip_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    priority: int = 0
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    response_format: ResponseFormat | None = None
    """Chat and (as in vLLM) completions: plain text, JSON mode or a JSON schema."""
    structured_outputs: dict[str, Any] | None = None
    """vLLM's constrained decoding: exactly one of ``json`` (a schema), ``regex``, ``choice``,
    ``grammar`` (EBNF), ``json_object``, ``structural_tag`` (see
    ``tandem.sampling_params.StructuredOutputsParams``)."""
    logit_bias: dict[str, float] | None = Field(None, max_length=MAX_TOKEN_ID_ENTRIES)
    """OpenAI's: token id (a decimal string) → bias in [-100, 100], added to its logit."""
    allowed_token_ids: list[int] | None = Field(None, max_length=MAX_TOKEN_ID_ENTRIES)
    """vLLM's: the only tokens that may be sampled (non-empty)."""
    bad_words: list[str] | None = Field(None, max_length=MAX_BAD_WORDS)
    """vLLM's: words whose tokens may not be completed (``SamplingParams.tokenize_bad_words``)."""
    prompt_logprobs: int | None = Field(None, ge=0)
    """vLLM's: logprobs of every prompt token with this many alternatives (at most
    ``engine.max_logprobs``); not with ``stream`` unless 0."""
    cache_salt: str | None = Field(None, min_length=1, max_length=MAX_CACHE_SALT_CHARS)
    """vLLM's: the prompt shares prefix-cache blocks (and ``cached_tokens``) only with requests
    of the same salt (one per tenant, say)."""
    kv_transfer_params: KVTransferParams | None = None
    """Disaggregated prefill/decode, set by the router: ``{"do_remote_decode": true}`` on a
    prefill instance; the prefill answer's params plus ``"do_remote_prefill": true`` on a decode
    instance (see ``KVTransferParams`` and ``tandem.server.disagg``)."""


class CompletionRequest(SamplingFields):
    """POST /v1/completions. ``prompt``: a string, a list of strings, a list of token ids or a
    list of token-id lists; each prompt is one engine request with ``n`` sequences."""

    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)
    """0 computes the prompt only: with ``echo`` and ``logprobs``, the prompt's logprobs."""
    logprobs: int | None = Field(None, ge=0)
    """At most ``engine.max_logprobs`` (20 by default)."""
    echo: bool = False


class TextContentPart(_Request):
    type: Literal["text"]
    text: str


class FunctionCall(_Request):
    """A call the assistant made, in the conversation's history: ``arguments`` is JSON text."""

    name: str
    arguments: str


class ToolCall(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(_Request):
    """One message (text only). ``content`` may be null only in an assistant message that has
    ``tool_calls``; a ``tool`` message answers the call ``tool_call_id``."""

    role: Literal[ROLES]
    content: str | list[TextContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(_Request):
    """A function the model may call: ``parameters`` is the JSON schema of its arguments (an
    object; none means "no arguments")."""

    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatCompletionTool(_Request):
    type: Literal["function"] = "function"
    function: FunctionDefinition

    def template_dict(self) -> dict[str, Any]:
        """What the chat template gets, as vLLM passes it (``strict`` only when sent)."""
        return self.model_dump(exclude={"function": {"strict"}} if self.function.strict is None else None)


class NamedFunction(_Request):
    name: str


class NamedToolChoice(_Request):
    """``tool_choice: {"type": "function", "function": {"name": ...}}``: call that function."""

    type: Literal["function"] = "function"
    function: NamedFunction


ToolChoice = Literal["none", "auto", "required"] | NamedToolChoice


class ChatCompletionRequest(SamplingFields):
    """POST /v1/chat/completions. ``max_completion_tokens`` wins over ``max_tokens``; both unset
    means "up to the context length"."""

    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    """At most ``engine.max_logprobs`` (20 by default)."""
    add_generation_prompt: bool = True
    tools: list[ChatCompletionTool] | None = None
    """Functions the model may call (rendered by the chat template); see tool_choice."""
    tool_choice: ToolChoice | None = None
    """"none" (no call; the tools are still rendered), "auto" (the model decides; needs
    ``server.enable_auto_tool_choice``), "required" (at least one call) or a named function
    (exactly that call); unset means "auto" with tools, "none" without (as OpenAI)."""
    parallel_tool_calls: bool = True
    """False: at most one tool call per choice (the first the model writes; "required" is held
    to one)."""


class TokenizeRequest(_Request):
    """POST /tokenize, vLLM's two forms: ``prompt`` (a string, tokenized as /v1/completions
    does) or ``messages`` (through the chat template, as /v1/chat/completions does). Exactly
    one of them. ``add_special_tokens`` defaults to true for a prompt, false for messages (the
    template writes them)."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ChatCompletionTool] | None = None
    """With ``messages``: rendered by the chat template, as on /v1/chat/completions."""
    add_generation_prompt: bool = True
    add_special_tokens: bool | None = None
    return_token_strs: bool = False


class DetokenizeRequest(_Request):
    """POST /detokenize: token ids back to text."""

    model: str | None = None
    tokens: list[int]


# ----------------------------------------------------------------------------- responses


class PromptTokensDetails(_Response):
    cached_tokens: int = 0
    """Prompt tokens whose KV came from the prefix cache (whole blocks), not computed."""


class UsageInfo(_Response):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(_Response):
    """OpenAI's completions shape: one entry per token; ``text_offset`` indexes into the choice's
    ``text``; the first prompt token (echo) has no logprob."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(_Response):
    """One token of vLLM's ``prompt_logprobs``: its logprob, its rank in the vocabulary (1 =
    the most likely) and its text."""

    logprob: float
    rank: int
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptLogprob] | None]
"""vLLM's shape: per prompt token, None for the first, else token id → ``PromptLogprob`` for the
prompt's token and the ``prompt_logprobs`` most likely ones."""


class CompletionChoice(_Response):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    prompt_logprobs: PromptLogprobs | None = None


def _now() -> int:
    return int(time.time())


class CompletionResponse(_Response):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None
    kv_transfer_params: dict[str, Any] | None = None


class TopLogprob(_Response):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(_Response):
    content: list[ChatLogprobEntry] | None = None


class ToolCallFunction(_Response):
    name: str
    arguments: str
    """JSON text."""


class ToolCallOut(_Response):
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class AssistantMessage(_Response):
    role: Literal["assistant"] = "assistant"
    content: str | None
    """None when the answer is tool calls only (as OpenAI)."""
    tool_calls: list[ToolCallOut] = Field(default_factory=list)


class ChatChoice(_Response):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(_Response):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo
    prompt_logprobs: PromptLogprobs | None = None
    kv_transfer_params: dict[str, Any] | None = None


class DeltaFunctionCall(_Response):
    name: str | None = None
    arguments: str | None = None


class DeltaToolCall(_Response):
    """One piece of a streamed tool call: the first of call ``index`` has its id, type and
    function name; the next ones add fragments of ``function.arguments``."""

    index: int
    id: str | None = None
    type: Literal["function"] | None = None
    function: DeltaFunctionCall


class DeltaMessage(_Response):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(_Response):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(_Response):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(_Response):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "tandem"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(_Response):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(_Response):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(_Response):
    prompt: str


class VersionResponse(_Response):
    version: str


class ErrorInfo(_Response):
    message: str
    type: str
    param: str | None = None
    code: str | None = None


class ErrorResponse(_Response):
    error: ErrorInfo
