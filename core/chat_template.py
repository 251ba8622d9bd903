"""Conversations through a tokenizer's chat template: what ``/v1/chat/completions`` (and
``/tokenize``) and the offline ``LLM.chat`` share, so that both send the model the same tokens.
"""
from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any


class NoChatTemplate(ValueError):
    """The tokenizer has no chat template."""


def content_text(content: str | Sequence[Any] | None) -> str:
    """The text of a message's content: a string, or text parts (objects with ``.text`` or
    dicts ``{"type": "text", "text": ...}``) joined by newlines; "" for None (an assistant
    message with tool calls only, as vLLM gives the template). ValueError for another part."""
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    texts = []
    for part in content:
        if isinstance(part, Mapping):
            if part.get("type") != "text" or not isinstance(part.get("text"), str):
                raise ValueError(f"a message part must be {{'type': 'text', 'text': str}} (got {part!r:.80})")
            texts.append(part["text"])
        else:
            texts.append(part.text)
    return "\n".join(texts)


def apply_chat_template(tokenizer: Any, turns: Sequence[Mapping[str, Any]],
                        add_generation_prompt: bool = True, add_special_tokens: bool = False,
                        tools: list[dict] | None = None) -> list[int]:
    """The token ids of ``turns`` (``{"role", "content"}`` with text content, and what else the
    template reads: ``name``, ``tool_calls``…) and ``tools`` (function definitions) rendered by
    the tokenizer's chat template, then encoded (without special tokens by default: the template
    writes them). ``NoChatTemplate`` without a template; ValueError when the template raises."""
    if not getattr(tokenizer, "chat_template", None):
        raise NoChatTemplate("the tokenizer has no chat template")
    try:
        text = tokenizer.apply_chat_template([dict(t) for t in turns], tools=tools, tokenize=False,
                                             add_generation_prompt=add_generation_prompt)
    except Exception as exc:  # noqa: BLE001 — a template may raise anything on bad input
        raise ValueError(f"the chat template refused the messages: {exc}") from exc
    return tokenizer.encode(text, add_special_tokens=add_special_tokens)
