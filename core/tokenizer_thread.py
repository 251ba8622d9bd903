"""Tokenizer work off the event loop: the ``AsyncEngine``'s input processing (prompts, bad
words, grammar checks) and the server's chat templates, /tokenize and /detokenize run on one
thread of their own, so that /health and every stream keep answering while a long prompt is
encoded (a Rust tokenizer releases the GIL; a Jinja template yields it every few milliseconds).

The thread has its own copy of the tokenizer, made on its first call: a Rust tokenizer used
from two threads at once can fail with "Already borrowed", so the event loop's copy
(``AsyncEngine.tokenizer``, used for single-token decodes while rendering) and this one are
never the same object. One thread: requests' tokenizations queue behind each other, each one
bounded by ``server.max_prompt_chars``.
"""
from __future__ import annotations

import asyncio
import copy
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

T = TypeVar("T")


class TokenizerThread:
    """Runs ``fn(tokenizer, *args)`` on the tokenizer thread; ``source()`` gives the tokenizer
    to copy (called on the thread, once the engine has loaded)."""

    def __init__(self, source: Callable[[], Any]) -> None:
        self._source = source
        self._tokenizer = None
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tandem-tokenizer")

    async def run(self, fn: Callable[..., T], *args: Any) -> T:
        """``fn(tokenizer, *args)``'s result (or exception), awaited on the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._executor, self._call, fn, args)

    def _call(self, fn: Callable[..., T], args: tuple) -> T:
        if self._tokenizer is None:
            self._tokenizer = copy.deepcopy(self._source())
        return fn(self._tokenizer, *args)

    def close(self) -> None:
        """Stop the thread once the calls already running end; queued ones are dropped."""
        self._executor.shutdown(wait=False, cancel_futures=True)
