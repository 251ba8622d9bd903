"""What the server refuses beyond the pydantic models of ``tandem.server.protocol``, before it
tokenizes anything: fields of OpenAI's or vLLM's API that tandem does not implement (unless sent
with their neutral value), text that is not valid Unicode, chat messages with nothing to answer;
and the log of unknown fields, at most one line per name a minute.

A field tandem does not implement would change the output (tools, a grammar…); answering 200
without it would silently drop a constraint the client relies on, so it is a 400 naming the
field. Its neutral value (``tools: []``, ``best_of`` equal to ``n``…) asks for nothing and is
accepted. Any other name is ignored, as vLLM does.
"""
from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pydantic import BaseModel

from tandem.errors import lone_surrogate
from tandem.server.errors import bad_request
from tandem.server.protocol import ChatCompletionRequest, SamplingFields

logger = logging.getLogger("tandem.server")


@dataclass(frozen=True, slots=True)
class Unimplemented:
    """A field tandem does not implement: what it does, and its neutral values — a predicate of
    (value, body) and how the error message spells them."""

    feature: str
    neutral: Callable[[Any, SamplingFields], bool]
    neutral_text: str


def _one_of(*values: Any) -> Callable[[Any, SamplingFields], bool]:
    return lambda value, body: any(value == v and type(value) is type(v) for v in (None, *values))


def _best_of(value: Any, body: SamplingFields) -> bool:
    return value is None or (type(value) is int and value == body.n)


_NULL = _one_of()
_GUIDED = "guided decoding"
_COMMON = {
    "best_of": Unimplemented("best-of sampling (best_of > n)", _best_of, "null or equal to n"),
    **{name: Unimplemented(_GUIDED, _NULL, "null") for name in (
        "guided_json", "guided_regex", "guided_choice", "guided_grammar", "guided_decoding_backend",
        "guided_whitespace_pattern")},
    "logits_processors": Unimplemented("logits processors", _one_of([]), "null or []"),
    "use_beam_search": Unimplemented("beam search", _one_of(False), "null or false"),
    "truncate_prompt_tokens": Unimplemented("prompt truncation", _NULL, "null"),
    "return_tokens_as_token_ids": Unimplemented("token ids as tokens", _one_of(False), "null or false"),
}
UNIMPLEMENTED: dict[str, dict[str, Unimplemented]] = {
    "/v1/completions": {
        **_COMMON,
        "suffix": Unimplemented("insertion (suffix)", _one_of(""), 'null or ""'),
        "add_special_tokens": Unimplemented("prompts without special tokens", _one_of(True),
                                            "null or true"),
    },
    "/v1/chat/completions": {
        **_COMMON,
        "functions": Unimplemented("the legacy function calling (use tools)", _one_of([]), "null or []"),
        "function_call": Unimplemented("the legacy function calling (use tool_choice)",
                                       _one_of("none", "auto"), 'null, "none" or "auto"'),
        "add_special_tokens": Unimplemented("chat prompts with special tokens", _one_of(False),
                                            "null or false"),
        "continue_final_message": Unimplemented("continuing the final message", _one_of(False),
                                                "null or false"),
        "echo": Unimplemented("echoing the last message", _one_of(False), "null or false"),
        "chat_template": Unimplemented("custom chat templates", _NULL, "null"),
        "chat_template_kwargs": Unimplemented("chat template arguments", _one_of({}), "null or {}"),
        "modalities": Unimplemented("output modalities other than text", _one_of(["text"]),
                                    'null or ["text"]'),
        "audio": Unimplemented("audio output", _NULL, "null"),
    },
}
"""Per route: the fields tandem refuses unless they hold a neutral value. ``function_call:
"auto"`` is neutral because no ``functions`` can be given."""

_MESSAGE_UNIMPLEMENTED = {"function_call": "the legacy function calls (use tool_calls)"}


def check_body(body: SamplingFields, route: str) -> None:
    """400 for an unimplemented field with a value that is not neutral, or a string anywhere in
    the body's fields that is not valid Unicode (a JSON lone surrogate such as ``"\\ud800"``)."""
    extra = body.model_extra or {}
    for name, field in UNIMPLEMENTED[route].items():
        if name in extra and not field.neutral(extra[name], body):
            raise bad_request(_unimplemented_message(name, field, extra[name], body), name)
    check_text(body)


def check_text(body: BaseModel) -> None:
    """400 for a string anywhere in the body's fields that is not valid Unicode."""
    for name in type(body).model_fields:
        bad = _bad_text(getattr(body, name), name)
        if bad is not None:
            path, text, index = bad
            raise bad_request(f"{path} is not valid UTF-8 text: it holds the lone surrogate "
                              f"U+{ord(text[index]):04X} at index {index}", name)


def _unimplemented_message(name: str, field: Unimplemented, value: Any, body: SamplingFields) -> str:
    if name == "best_of" and type(value) is int and value < body.n:
        return f"best_of ({value}) must be at least n ({body.n})"
    if field.feature == _GUIDED:
        return (f"{name} is not supported: vLLM removed the guided_* fields; send structured_outputs "
                'instead, e.g. {"structured_outputs": {"json": <schema>}} (or "regex", "choice", '
                '"grammar", "json_object")')
    return (f"{name} is not supported: tandem does not implement {field.feature}; omit it or send "
            f"{field.neutral_text}")


def _bad_text(value: Any, path: str) -> tuple[str, str, int] | None:
    """(path, text, index) of the first string under ``value`` with a lone surrogate."""
    if isinstance(value, str):
        index = lone_surrogate(value)
        return None if index is None else (path, value, index)
    if isinstance(value, BaseModel):
        items = [(name, getattr(value, name)) for name in type(value).model_fields]
        return _first_bad((f"{path}.{name}", v) for name, v in items)
    if isinstance(value, dict):
        return _first_bad(pair for key, v in value.items()
                          for pair in ((f"{path} key", key), (f"{path}.{key}", v)))
    if isinstance(value, (list, tuple)):
        return _first_bad((f"{path}[{i}]", v) for i, v in enumerate(value))
    return None


def _first_bad(pairs) -> tuple[str, str, int] | None:
    for path, value in pairs:
        bad = _bad_text(value, path)
        if bad is not None:
            return bad
    return None


def check_prompt_logprobs(body: SamplingFields) -> None:
    """400 for ``prompt_logprobs`` above 0 with ``stream``, as vLLM: streams carry no prompt
    logprobs."""
    if body.stream and body.prompt_logprobs:
        raise bad_request("prompt_logprobs are not available when stream is true (only 0 is "
                          "accepted, and not streamed)", "prompt_logprobs")


def check_messages(body: ChatCompletionRequest) -> None:
    """400 for a message that carries the legacy function calls (not implemented), content null
    outside an assistant message with tool calls, tool calls outside an assistant message, or a
    conversation in which every message is empty: there is nothing to answer."""
    for i, message in enumerate(body.messages):
        for name, feature in _MESSAGE_UNIMPLEMENTED.items():
            if (message.model_extra or {}).get(name) not in (None, []):
                raise bad_request(f"messages[{i}].{name} is not supported: tandem does not implement "
                                  f"{feature}", "messages")
        if message.tool_calls and message.role != "assistant":
            raise bad_request(f"messages[{i}].tool_calls: only an assistant message has tool calls",
                              "messages")
        if message.content is None and not message.tool_calls:
            raise bad_request(f"messages[{i}].content is required (null only in an assistant "
                              "message with tool_calls)", "messages")
    if not any(_has_text(m.content) or m.tool_calls for m in body.messages):
        raise bad_request("messages holds no text: at least one message needs non-empty content, "
                          "or there is nothing to answer", "messages")


def _has_text(content: str | list | None) -> bool:
    return bool(content) if not isinstance(content, list) else any(part.text for part in content)


class UnknownFieldLog:
    """Logs each unknown field name at most once per ``interval_s``, and at most ``max_lines``
    lines per interval in all: a fuzzer's random names neither flood the log nor grow memory
    (only logged names are remembered, for one interval). Names past the cap are counted and the
    count is logged once the interval is over. Not thread-safe: call it from the event loop."""

    def __init__(self, interval_s: float = 60.0, max_lines: int = 32,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.interval_s = interval_s
        self.max_lines = max_lines
        self._clock = clock
        self._logged: dict[str, float] = {}
        self._window_start = clock()
        self._lines = 0
        self._suppressed = 0

    def log(self, route: str, names: list[str]) -> None:
        now = self._clock()
        if now - self._window_start >= self.interval_s:
            self._new_window(now)
        for name in names:
            last = self._logged.get(name)
            if last is not None and now - last < self.interval_s:
                continue
            if self._lines >= self.max_lines:
                self._suppressed += 1
                continue
            self._logged[name] = now
            self._lines += 1
            logger.warning("%s: ignoring the unknown field %s (logged at most once a minute per "
                           "name)", route, _shown(name))

    def _new_window(self, now: float) -> None:
        if self._suppressed:
            logger.warning("%d more unknown field names were ignored without a log line in the "
                           "last %.0f s", self._suppressed, now - self._window_start)
        self._logged = {n: t for n, t in self._logged.items() if now - t < self.interval_s}
        self._window_start, self._lines, self._suppressed = now, 0, 0


def _shown(name: str) -> str:
    """The name as ASCII (a surrogate or a control character cannot break the log line), cut to
    64 characters."""
    return ascii(name[:64]) + ("…" if len(name) > 64 else "")


UNKNOWN_FIELDS = UnknownFieldLog()


def unknown_fields(body: SamplingFields, route: str) -> list[str]:
    """The body's field names that neither the model nor ``UNIMPLEMENTED`` knows."""
    known = UNIMPLEMENTED[route]
    return sorted(name for name in body.model_extra or {} if name not in known)
