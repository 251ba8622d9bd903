"""The ``cache_aware`` routing policy: each request goes to the instance whose prefix cache holds
the longest run of the prompt's leading blocks, as the instances' KV events tell it
(``kv_events.enabled`` on every instance it routes to; docs/disaggregation.md).

It follows each instance in rotation: ``GET /kv/events`` names the instance's publisher and block
size, an ``EventStream`` feeds the ``BlockIndex``. A prompt's blocks are hashed the way the
instances hash them (``tandem.sched.block_pool.extend_chain``: the same chain, the request's
cache salt included), so a hit in the index is a block the instance would take from its cache.
(A longrope model's engine adds its KV variant to the salt, which the router does not know:
such a model's salted or long prompts find no hit, and are routed by load.)
Ties (no hit anywhere, or the same hit) go to the least loaded instance; a prompt whose token
ids the router could not get goes to the least loaded instance too.
"""
from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import ClassVar
from urllib.parse import urlsplit

import httpx

from tandem.interfaces import InstanceInfo, RoutedPrompt, RouterContext, RoutingPolicy
from tandem.kv_events.subscriber import EventStream, StreamAddress
from tandem.plugins.routing import queue_length
from tandem.router.kv_index import BlockIndex
from tandem.sched.block_pool import extend_chain
from tandem.sched.request import request_cache_salt

logger = logging.getLogger("tandem.router")

KV_EVENTS_PATH = "/kv/events"
KV_SECRET_HEADER = "X-Tandem-KV-Secret"
LOCATE_TIMEOUT_S = 2.0
_ANY_HOST = ("*", "0.0.0.0", "::", "[::]")


class CacheAware(RoutingPolicy):
    name = "cache_aware"
    needs_token_ids = True
    entry_ttl_s: ClassVar[float] = 3600.0
    """An index entry older than this no longer counts (a block kept cached that long without
    being stored again is still a hit on the instance, only the router stops betting on it)."""

    def __init__(self) -> None:
        self.index = BlockIndex(self.entry_ttl_s)
        self._streams: dict[str, EventStream] = {}
        self._block_sizes: dict[str, int] = {}
        self._secret: str | None = None
        self._without_events: set[str] = set()

    def start(self, context: RouterContext) -> None:
        self._secret = context.kv_secret

    def close(self) -> None:
        for stream in self._streams.values():
            stream.close()
        self._streams.clear()

    def rotation_changed(self, url: str, in_rotation: bool) -> None:
        """A stream per instance in rotation; an instance out of rotation is forgotten (it may
        come back restarted, with an empty cache and other ports)."""
        stream = self._streams.pop(url, None)
        if stream is not None:
            stream.close(wait=False)
        self.index.forget(url)
        if in_rotation:
            self._streams[url] = EventStream(url, lambda: self._locate(url), self.index)

    def select(self, instances: Sequence[InstanceInfo], prompt_token_ids: Sequence[int]) -> InstanceInfo:
        return min(instances, key=lambda i: (queue_length(i), i.kv_usage))

    def select_prompt(self, instances: Sequence[InstanceInfo], prompt: RoutedPrompt) -> InstanceInfo:
        if prompt.token_ids is None:
            return self.select(instances, prompt.key)
        hits = {i.url: self.cached_tokens(i.url, prompt) or 0 for i in instances}
        return min(instances, key=lambda i: (-hits[i.url], queue_length(i), i.kv_usage))

    def cached_tokens(self, url: str, prompt: RoutedPrompt) -> int | None:
        """Leading prompt tokens ``url`` caches (None: its block size is not known yet)."""
        block_size = self._block_sizes.get(url)
        if block_size is None or prompt.token_ids is None:
            return None
        ids = prompt.token_ids
        salt = request_cache_salt(prompt.cache_salt, None)
        hashes = extend_chain([], ids, block_size, len(ids) // block_size, salt)
        return self.index.hit_blocks(url, hashes) * block_size

    def _locate(self, url: str) -> StreamAddress | None:
        """The instance's publisher (``GET /kv/events``; runs on the stream's thread)."""
        headers = {KV_SECRET_HEADER: self._secret} if self._secret is not None else {}
        answer = httpx.get(url + KV_EVENTS_PATH, headers=headers, timeout=LOCATE_TIMEOUT_S, trust_env=False)
        if answer.status_code == 404:
            if url not in self._without_events:
                self._without_events.add(url)
                logger.warning("instance %s publishes no KV events: cache_aware routes it by load "
                               "only (set kv_events.enabled there)", url)
            return None
        answer.raise_for_status()
        info = answer.json()
        self._block_sizes[url] = int(info["block_size"])
        host = urlsplit(url).hostname or "127.0.0.1"
        replay = info.get("replay_endpoint")
        return StreamAddress(endpoint=_reachable(info["endpoint"], host),
                             replay_endpoint=None if replay is None else _reachable(replay, host),
                             topic=str(info.get("topic", "")))


def _reachable(endpoint: str, host: str) -> str:
    """``endpoint`` as the router reaches it: a wildcard bind address becomes the instance's
    host (from its URL)."""
    scheme, _, rest = endpoint.partition("://")
    bound, _, port = rest.rpartition(":")
    if scheme == "tcp" and bound in _ANY_HOST:
        return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
    return endpoint
