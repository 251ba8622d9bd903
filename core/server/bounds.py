"""How much work one request may ask for, checked before anything is tokenized: prompt text
(``server.max_prompt_chars``), messages per chat (``server.max_messages``) and prompts per
batch completion (``server.max_prompts``); the engine's input processor holds the priority to
its range (``server.max_abs_priority``). Each refusal is a 400 naming the field and the
setting. The body itself is bounded earlier, while it is read (``tandem.http_limits``).
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from tandem.config import ServerConfig
from tandem.server.errors import bad_request
from tandem.server.protocol import ChatMessage

_DEFAULTS = ServerConfig()


@dataclass(frozen=True, slots=True)
class RequestBounds:
    """The server's per-request bounds (``[server]``)."""

    max_prompt_chars: int = _DEFAULTS.max_prompt_chars
    max_messages: int = _DEFAULTS.max_messages
    max_prompts: int = _DEFAULTS.max_prompts

    @classmethod
    def of(cls, server: ServerConfig) -> RequestBounds:
        return cls(server.max_prompt_chars, server.max_messages, server.max_prompts)

    def check_prompts(self, prompt: str | list) -> None:
        """A completion's prompt: at most ``max_prompts`` prompts, ``max_prompt_chars`` of text."""
        if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int):
            if len(prompt) > self.max_prompts:
                raise bad_request(f"prompt holds {len(prompt)} prompts; at most {self.max_prompts} "
                                  "per request (server.max_prompts)", "prompt")
            self._check_chars("prompt", sum(len(p) for p in prompt if isinstance(p, str)))
        elif isinstance(prompt, str):
            self._check_chars("prompt", len(prompt))

    def check_messages(self, messages: Sequence[ChatMessage]) -> None:
        """A conversation: at most ``max_messages`` messages, ``max_prompt_chars`` of text in
        their contents and tool-call arguments."""
        if len(messages) > self.max_messages:
            raise bad_request(f"messages holds {len(messages)} messages; at most {self.max_messages} "
                              "per request (server.max_messages)", "messages")
        self._check_chars("messages", sum(_message_chars(m) for m in messages))

    def _check_chars(self, name: str, num_chars: int) -> None:
        if num_chars > self.max_prompt_chars:
            raise bad_request(f"{name} holds {num_chars} characters of text; at most "
                              f"{self.max_prompt_chars} per request (server.max_prompt_chars)", name)


def _message_chars(message: ChatMessage) -> int:
    content = message.content
    chars = len(content) if isinstance(content, str) else sum(len(p.text) for p in content or ())
    return chars + sum(len(call.function.arguments or "") for call in message.tool_calls or ())
