"""The one check of a request before an engine holds it (as vLLM's Processor): ``InputProcessor``
takes the prompt (text or token ids), the ``SamplingParams`` and the per-request options, and
returns a ``ProcessedRequest`` (tokenized, bad words tokenized, every limit checked) or raises.
The offline ``LLM`` reaches it through ``LLMEngine.add_request``; the server through
``AsyncEngine.add_requests``, which runs it on the tokenizer thread (``tandem.tokenizer_thread``).

``SamplingParams`` checks what holds on every engine (ranges, finite numbers, seed width, stop
strings); ``check_request`` adds what depends on this engine: its vocabulary, its context length,
``max_num_seqs`` and ``max_logprobs``. Every refusal is an ``InvalidRequest`` — a ValueError that
names the field and the values it accepts; the server turns it into a 400 with that ``param``.

Pure Python: it must never import torch.
"""
from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from tandem.errors import InvalidRequest, check_text

if TYPE_CHECKING:
    from tandem.sampling_params import SamplingParams
    from tandem.structured_outputs import StructuredOutputManager


@dataclass(frozen=True, slots=True)
class RequestLimits:
    """What one engine can serve: its vocabulary, its context length in tokens, the sequences of
    one step and the most logprobs per token it computes (``engine.max_logprobs``)."""

    vocab_size: int
    max_model_len: int
    max_num_seqs: int
    max_logprobs: int
    max_abs_priority: int = 1_000_000
    """A request's priority lies in [-max_abs_priority, max_abs_priority] (``check_priority``)."""


@dataclass(slots=True)
class ProcessedRequest:
    """A request that passed every check: what ``LLMEngine.add_processed`` queues."""

    prompt: str | None
    """The prompt's text, None when it came as token ids."""
    prompt_token_ids: list[int]
    params: SamplingParams
    priority: int = 0
    cache_salt: str | None = None


class InputProcessor:
    """Checks and tokenizes requests for one engine: its ``limits`` and its grammar backend
    (``structured``). Thread-safe: it keeps no state of its own, and the caller passes the
    tokenizer of its own thread."""

    def __init__(self, limits: RequestLimits, structured: StructuredOutputManager) -> None:
        self.limits = limits
        self._structured = structured

    def process(self, tokenizer: Any, prompt: str | list[int], params: SamplingParams,
                priority: int = 0, cache_salt: str | None = None) -> ProcessedRequest:
        """The request checked and tokenized with ``tokenizer``. Raises ``InvalidRequest`` (a
        ValueError naming the field) for input this engine refuses (``check_priority``: a
        priority outside ``server.max_abs_priority``; ``check_cache_salt``; a prompt that is
        not valid Unicode; ``check_request``: token ids outside the vocabulary, n above
        max_num_seqs, logprobs above max_logprobs, no room in the context; a grammar the
        backend refuses, field ``structured_outputs``)."""
        check_priority(priority, self.limits.max_abs_priority)
        check_cache_salt(cache_salt)
        if isinstance(prompt, str):
            check_text("prompt", prompt)
            token_ids = tokenizer.encode(prompt)
        else:
            token_ids = list(prompt)
        params = params.tokenize_bad_words(tokenizer)
        check_request(token_ids, params, self.limits)
        if params.structured_outputs is not None:
            self._structured.validate(params.structured_outputs)
        return ProcessedRequest(prompt if isinstance(prompt, str) else None, token_ids, params,
                                priority, cache_salt)


def check_request(token_ids: Sequence[int], params: SamplingParams, limits: RequestLimits) -> None:
    """Raise ``InvalidRequest`` unless the engine of ``limits`` can serve ``token_ids`` (the
    prompt) with ``params``: prompt, ``stop_token_ids``, ``allowed_token_ids``, the keys of
    ``logit_bias`` and the tokens of the bad words inside the vocabulary, ``n`` at most
    ``max_num_seqs``, ``logprobs``/``prompt_logprobs`` at most ``max_logprobs`` (and the
    vocabulary), room in the context for ``max_tokens`` — or for at least one token when it is
    None — and for ``min_tokens``. The KV pool's own limit is the scheduler's to check."""
    params.validate()
    _check_ids("prompt", token_ids, limits.vocab_size)
    if not token_ids:
        raise InvalidRequest("prompt", "is empty")
    _check_ids("stop_token_ids", params.stop_token_ids, limits.vocab_size)
    _check_ids("allowed_token_ids", params.allowed_token_ids or (), limits.vocab_size)
    _check_ids("logit_bias", list(params.logit_bias or ()), limits.vocab_size)
    for ids in params.bad_words_token_ids or ():
        _check_ids("bad_words", ids, limits.vocab_size)
    if params.n > limits.max_num_seqs:
        raise InvalidRequest("n", f"must be at most max_num_seqs ({limits.max_num_seqs}): the n "
                                  f"sequences of a request run in one batch; got {params.n}")
    most = min(limits.max_logprobs, limits.vocab_size)
    for name in ("logprobs", "prompt_logprobs"):
        value = getattr(params, name)
        if value is not None and value > most:
            raise InvalidRequest(name, f"must be at most {most} (engine.max_logprobs = "
                                       f"{limits.max_logprobs}, vocabulary {limits.vocab_size}); "
                                       f"got {value}")
    _check_room(len(token_ids), params, limits.max_model_len)


MAX_CACHE_SALT_CHARS = 256
"""The longest ``cache_salt`` a client may send (a tenant's name or a random token fits)."""


def check_cache_salt(cache_salt: object) -> None:
    """Raise ``InvalidRequest`` unless ``cache_salt`` is None or a string of 1 to
    ``MAX_CACHE_SALT_CHARS`` characters."""
    if cache_salt is None:
        return
    if not isinstance(cache_salt, str) or not 1 <= len(cache_salt) <= MAX_CACHE_SALT_CHARS:
        raise InvalidRequest("cache_salt", f"must be a string of 1 to {MAX_CACHE_SALT_CHARS} characters")


def check_priority(priority: object, max_abs: int) -> None:
    """Raise ``InvalidRequest`` unless ``priority`` is an integer (not a bool) in
    [-max_abs, max_abs] (``server.max_abs_priority``): an unbounded one lets any client jump
    every queue of the priority scheduler."""
    if isinstance(priority, int) and not isinstance(priority, bool) and -max_abs <= priority <= max_abs:
        return
    shown = repr(priority) if not isinstance(priority, int) or abs(priority) < 10**30 else "a larger integer"
    raise InvalidRequest("priority", f"must be an integer in [-{max_abs}, {max_abs}] "
                                     f"(server.max_abs_priority); got {shown[:40]}")


def _check_ids(name: str, token_ids: Sequence[int], vocab_size: int) -> None:
    bad = [t for t in token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(name, f"holds token ids {bad[:5]} outside the vocabulary "
                                   f"[0, {vocab_size})")


def _check_room(num_prompt_tokens: int, params: SamplingParams, max_model_len: int) -> None:
    room = max_model_len - num_prompt_tokens
    if params.max_tokens is None:
        if room < 1:
            raise InvalidRequest("prompt", f"has {num_prompt_tokens} tokens; the context length is "
                                           f"{max_model_len}, which leaves no room for output")
    elif params.max_tokens > room:
        raise InvalidRequest("max_tokens", f"({params.max_tokens}) plus the prompt "
                                           f"({num_prompt_tokens} tokens) exceeds the context "
                                           f"length ({max_model_len} tokens): at most {max(room, 0)}")
    if params.min_tokens > room:
        raise InvalidRequest("min_tokens", f"({params.min_tokens}) exceeds the room for output: the "
                                           f"context length ({max_model_len}) minus the prompt "
                                           f"({num_prompt_tokens} tokens) is {max(room, 0)}")
