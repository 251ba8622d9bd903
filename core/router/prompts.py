"""What the router reads from an OpenAI request body, and the bodies it derives for each step.

The router does not tokenize (a policy that hashes the prompt's blocks, ``cache_aware``, gets the
ids from an instance's /tokenize, with ``tokenize_body``). It needs two things from a prompt:

- a length estimate, for conditional disaggregation: exact for a token-id prompt,
  ``characters // 4`` for text (of a chat: the characters of every message's content);
- a routing key for the policies: the token ids, or the UTF-8 bytes of the text (of a chat:
  ``role + "\\n" + content + "\\n"`` for each message).

A body with several prompts, or one the router cannot read, gets no estimate: it is never
disaggregated and goes whole to a decode instance, which validates it. Token ids outside
``[0, 2**63)`` (no vocabulary has them; routing policies pack ids as int64) make a prompt one the
router cannot read.

The disaggregated flow (docs/architecture.md §2) sends the prefill instance the request reduced to
one output token (``max_tokens = 1``, not streamed, one sequence, no logprobs, no echo) plus
``kv_transfer_params = {"do_remote_decode": true}``; the decode instance gets the client's
request plus the prefill answer's ``kv_transfer_params`` with ``"do_remote_prefill": true``.
``kv_transfer_params`` are the router's to set: the field is dropped from the client's body.

A request whose answer is about the prompt itself (``needs_prompt_computed``: vLLM's
``prompt_logprobs``, ``echo`` with ``logprobs``, ``max_tokens`` 0) is never disaggregated: a
decode instance that loads the prompt's KV computes no prompt logprobs, so one instance computes
the prompt and answers.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

KV_TRANSFER_PARAMS = "kv_transfer_params"
CHARS_PER_TOKEN = 4

# Fields that shape output the prefill step throws away, or that conflict with max_tokens = 1.
_PREFILL_DROPS = ("stream_options", "min_tokens", "logprobs", "top_logprobs", "echo",
                  "max_completion_tokens", KV_TRANSFER_PARAMS)


@dataclass(slots=True, frozen=True)
class PromptInfo:
    """``key``: what routing policies see; ``estimated_tokens``: None = not disaggregatable;
    ``token_ids``: True when ``key`` holds the client's token ids (not text bytes)."""

    key: list[int]
    estimated_tokens: int | None
    token_ids: bool = False


_UNREADABLE = PromptInfo(key=[], estimated_tokens=None)


def completion_prompt(body: dict[str, Any]) -> PromptInfo:
    """The prompt of a /v1/completions body: a string, token ids, or a list of one of those."""
    prompt = body.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return PromptInfo(list(prompt.encode()), len(prompt) // CHARS_PER_TOKEN)
    if isinstance(prompt, list) and prompt and all(_is_token_id(t) for t in prompt):
        return PromptInfo(list(prompt), len(prompt), token_ids=True)
    return _UNREADABLE


_TOKEN_ID_END = 2**63


def _is_token_id(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and 0 <= value < _TOKEN_ID_END


def chat_prompt(body: dict[str, Any]) -> PromptInfo:
    """The conversation of a /v1/chat/completions body."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        return _UNREADABLE
    key, num_chars = bytearray(), 0
    for message in messages:
        text = _message_text(message)
        if text is None:
            return _UNREADABLE
        key += f"{message.get('role')}\n{text}\n".encode()
        num_chars += len(text)
    return PromptInfo(list(key), num_chars // CHARS_PER_TOKEN)


def _message_text(message: Any) -> str | None:
    if not isinstance(message, dict):
        return None
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list) and all(isinstance(p, dict) for p in content):
        return "".join(str(p.get("text", "")) for p in content)
    return None


_TOKENIZE_FIELDS = {"/v1/completions": ("model", "prompt", "add_special_tokens"),
                    "/v1/chat/completions": ("model", "messages", "tools", "add_generation_prompt",
                                             "add_special_tokens")}


def tokenize_body(path: str, body: dict[str, Any]) -> dict[str, Any] | None:
    """The POST /tokenize body that gives the token ids an instance computes for this request
    (a cache-aware policy hashes them); None when /tokenize cannot say (several prompts, chat
    template options it does not take)."""
    fields = _TOKENIZE_FIELDS.get(path)
    if fields is None or "chat_template" in body or "chat_template_kwargs" in body:
        return None
    request = {k: body[k] for k in fields if body.get(k) is not None}
    prompt = request.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        request["prompt"] = prompt[0]
    elif prompt is not None and not isinstance(prompt, str):
        return None
    return request


def needs_prompt_computed(body: dict[str, Any]) -> bool:
    """Whether the answer needs the prompt computed where it is answered (module docstring)."""
    return (body.get("prompt_logprobs") is not None
            or (body.get("echo") is True and body.get("logprobs") is not None)
            or body.get("max_tokens") == 0)


def client_body(body: dict[str, Any]) -> dict[str, Any]:
    """The client's body without the router-only ``kv_transfer_params``."""
    return {k: v for k, v in body.items() if k != KV_TRANSFER_PARAMS}


def prefill_body(body: dict[str, Any]) -> dict[str, Any]:
    """The request a prefill instance gets: computes the prompt, answers one token."""
    reduced = {k: v for k, v in body.items() if k not in _PREFILL_DROPS}
    reduced.update(max_tokens=1, stream=False, n=1)
    reduced[KV_TRANSFER_PARAMS] = {"do_remote_decode": True}
    return reduced


def decode_body(body: dict[str, Any], kv_transfer_params: dict[str, Any] | None) -> dict[str, Any]:
    """The request a decode instance gets: the client's, plus the prefill's KV hand-over."""
    request = client_body(body)
    if kv_transfer_params is not None:
        request[KV_TRANSFER_PARAMS] = {**kv_transfer_params, "do_remote_prefill": True}
    return request
