"""The errors that cross floors: a request refused at the boundary, and the engine's failures
as the server and the executor see them. Nothing here imports the rest of tandem."""

from __future__ import annotations

from collections.abc import Mapping


class InvalidRequest(ValueError):
    """A request refused at the boundary. ``param`` is the field (a ``SamplingParams`` name, or
    ``prompt``); ``detail`` what is wrong with it, readable after the field's name. ``owner``
    prefixes the name in the message (``SamplingParams.temperature must be…``)."""

    def __init__(self, param: str, detail: str, owner: str | None = None) -> None:
        self.param = param
        self.detail = detail
        super().__init__(f"{owner}.{param} {detail}" if owner else f"{param} {detail}")

    def renamed(self, names: Mapping[str, str]) -> InvalidRequest:
        """The same refusal under the name a client used for the field (the chat API's
        ``top_logprobs`` is ``SamplingParams.logprobs``)."""
        return InvalidRequest(names.get(self.param, self.param), self.detail)


class RequestRejected(ValueError):
    """A request that can never be served (too long, too many sequences for the KV pool…)."""


class EngineDeadError(RuntimeError):
    """The engine cannot go on: fail what is in flight and stop the process (see the module
    docstring for when)."""


class EngineUnavailable(RuntimeError):
    """The engine is loading, failed, or shutting down: the request was not admitted (HTTP 503)."""


class QueueFull(RuntimeError):
    """The waiting queue is at its bound; retry after ``retry_after_s`` (HTTP 429)."""

    def __init__(self, message: str, retry_after_s: int = 1) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


class EngineError(RuntimeError):
    """The engine thread died while the request was in flight."""


class RequestFailed(RuntimeError):
    """The engine failed this request alone (an exception in a step it was in by itself, or
    while admitting or post-processing it); the message names the request and the exception."""


class RequestAbortedByShutdown(RuntimeError):
    """The request was still running when the graceful-shutdown deadline passed."""


def lone_surrogate(text: str) -> int | None:
    """The index of the first lone surrogate (U+D800–U+DFFF) in ``text``, None when it is valid
    Unicode. JSON's ``"\\ud800"`` decodes to one; it has no UTF-8 encoding, so no tokenizer can
    take it."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError as exc:
        return exc.start
    return None


def check_text(name: str, text: str, owner: str | None = None) -> None:
    """Raise ``InvalidRequest`` when ``text`` (the field ``name``) is not valid Unicode."""
    index = lone_surrogate(text)
    if index is not None:
        raise InvalidRequest(name, f"is not valid UTF-8 text: it holds the lone surrogate "
                                   f"U+{ord(text[index]):04X} at index {index}", owner)
