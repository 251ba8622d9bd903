"""The flow of one client request through the router (pull model; docs/architecture.md §9).

Contract: a plan is chosen once per request (direct, needs_prompt, short_prompt, or prefill then
decode); each step tries the healthy instances its policy picks, one after another — 429 moves on,
503 or no answer takes the instance out of rotation, any other status is relayed — and a hand-over
no decode instance took is released at once (POST /kv/release) rather than at its expiry. Why the
limits: a request whose connection broke on MAX_BROKEN_CONNECTIONS instances may be what breaks
them, so it gets a 502 "instance_failed" instead of risking the fleet; a frozen instance
(``disaggregation.upstream_timeout_s``) counts as such a break (504 "upstream_timeout" when none is
left). A stream is retried only until its first token reaches the client; only requests carrying
kv_transfer_params (and the release) carry the cluster secret.
"""
from __future__ import annotations

import enum
import logging
import time
from collections.abc import AsyncIterator
from contextlib import ExitStack
from dataclasses import dataclass, replace

import httpx
from fastapi.responses import Response

from tandem.config import Role
from tandem.interfaces import RoutedPrompt, RouterContext, RoutingPolicy
from tandem.router.errors import RouterError
from tandem.router.metrics import RouterMetrics
from tandem.router.prompts import (
    KV_TRANSFER_PARAMS,
    PromptInfo,
    decode_body,
    needs_prompt_computed,
    prefill_body,
    tokenize_body,
)
from tandem.router.proxy import (
    SSE_DONE,
    Answer,
    OpenedStream,
    RawHeaders,
    RelayedStream,
    Unreachable,
    is_done,
    open_stream,
    post,
    timed_out,
)
from tandem.router.registry import InstanceRegistry, Step

logger = logging.getLogger("tandem.router")

MAX_BROKEN_CONNECTIONS = 2
KV_SECRET_HEADER = b"x-tandem-kv-secret"
KV_RELEASE_PATH = "/kv/release"
TOKENIZE_PATH = "/tokenize"
RELEASE_TIMEOUT_S = 5.0
"""A release that gets no answer in time is given up: the blocks go at the prefill's expiry."""
DRAIN_AFTER_DONE_S = 1.0
"""How long the end of a streamed body is read after its [DONE] (the client already has its
answer then) before the connection is closed rather than kept for the next request."""


class Plan(enum.StrEnum):
    """How a request is dispatched (the module docstring's "plan"; the values are the ``path``
    label of ``tandem:router_requests_total``)."""

    DISAGGREGATED = "disaggregated"
    """A prefill instance computed the prompt and handed its KV blocks to the decode instance."""
    LOCAL_PREFILL = "local_prefill"
    """Planned disaggregated, but no prefill instance took it: the decode instance computes the
    prompt."""
    SHORT_PROMPT = "short_prompt"
    """Under ``min_disaggregated_prompt_tokens``: straight to a decode instance."""
    CACHED_PREFIX = "cached_prefix"
    """The decode instance caches all of the prompt but less than
    ``min_uncached_prefill_tokens``: decoded in place there, without a prefill hop."""
    NEEDS_PROMPT = "needs_prompt"
    """Prompt logprobs or max_tokens 0: the decode instance computes the prompt."""
    DIRECT = "direct"
    """No prefill instance registered, several prompts, or an unreadable body."""


@dataclass(slots=True, frozen=True)
class RouterRequest:
    """A client request as the router handles it: ``path`` is the route ("/v1/completions"),
    ``headers`` those relayed to instances (raw name and value), ``arrival`` its
    ``time.monotonic()`` arrival."""

    path: str
    body: dict
    headers: RawHeaders
    prompt: PromptInfo
    arrival: float
    routed: RoutedPrompt | None = None
    """What the policies see (``Dispatcher.handle`` sets it)."""

    @property
    def stream(self) -> bool:
        return self.body.get("stream") is True


@dataclass(slots=True)
class _HandOver:
    """The blocks a prefill instance pinned for the decode step. ``may_be_claimed``: a
    connection broke after a decode request carrying them reached its instance, which may be
    reading them, so they are neither sent again nor released (they go at the prefill's expiry)."""

    params: dict
    prefill_url: str
    may_be_claimed: bool = False

    def given_up(self, status: int) -> bool:
        """Whether no decode instance holds the blocks after the decode step answered ``status``
        (409: the transfer id is someone else's hand-over, in flight)."""
        return not self.may_be_claimed and status not in (200, 409)


@dataclass(slots=True, frozen=True)
class _Prefilled:
    """The prefill step's result: the hand-over (None: the decode instance computes the
    prompt), and whether a prefill instance did the work."""

    hand_over: _HandOver | None
    by_instance: bool


@dataclass(slots=True)
class _Broken:
    """The instances whose connection broke (or that went silent: ``timed_out``) after the
    request reached them."""

    count: int = 0
    timed_out: bool = False

    def add(self, exc: Unreachable) -> bool:
        """Count one; whether the request must now stop going to other instances."""
        self.count += 1
        self.timed_out |= exc.timed_out
        return self.count >= MAX_BROKEN_CONNECTIONS

    def response(self) -> Response:
        if self.timed_out:
            return _timeout_error(self.count).response()
        return RouterError(502, f"the connection to {self.count} instances broke after the request reached "
                                f"them; it is not sent to another", code="instance_failed").response()


def _timeout_error(count: int) -> RouterError:
    return RouterError(504, f"{count} instance(s) took the request and sent nothing within "
                            f"disaggregation.upstream_timeout_s", code="upstream_timeout")


class Dispatcher:
    """Routes requests over ``registry``'s instances; one per router app."""

    def __init__(self, registry: InstanceRegistry, prefill_policy: RoutingPolicy,
                 decode_policy: RoutingPolicy, metrics: RouterMetrics, client: httpx.AsyncClient,
                 min_disaggregated_prompt_tokens: int, kv_secret: str | None = None,
                 min_uncached_prefill_tokens: int = 0) -> None:
        self.registry = registry
        self.policies = {Step.PREFILL: prefill_policy, Step.DECODE: decode_policy}
        self.metrics = metrics
        self.client = client
        self.min_disaggregated_prompt_tokens = min_disaggregated_prompt_tokens
        self.min_uncached_prefill_tokens = min_uncached_prefill_tokens
        self._secret_header = [] if kv_secret is None else [(KV_SECRET_HEADER, kv_secret.encode())]
        for policy in {id(p): p for p in self.policies.values()}.values():
            registry.rotation_listeners.append(policy.rotation_changed)
            policy.start(RouterContext(kv_secret=kv_secret))

    def close(self) -> None:
        """Stop the policies (their event streams)."""
        for policy in {id(p): p for p in self.policies.values()}.values():
            policy.close()

    async def handle(self, request: RouterRequest) -> Response:
        request = replace(request, routed=await self._routed_prompt(request))
        plan = self._plan(request)
        hand_over = None
        broken = _Broken()
        if plan is Plan.DISAGGREGATED:
            prefilled = await self._prefill(request, broken)
            if isinstance(prefilled, Response):
                self.metrics.dispatched(plan)
                self._done(request)
                return prefilled
            hand_over = prefilled.hand_over
            plan = Plan.DISAGGREGATED if prefilled.by_instance else Plan.LOCAL_PREFILL
        self.metrics.dispatched(plan)
        response = await self._decode(request, hand_over, broken)
        if hand_over is not None and hand_over.given_up(response.status_code):
            await self._release(hand_over)
        return response

    def _plan(self, request: RouterRequest) -> Plan:
        estimate = request.prompt.estimated_tokens
        if estimate is None or not self.registry.has_role(Role.PREFILL):
            return Plan.DIRECT
        if needs_prompt_computed(request.body):
            return Plan.NEEDS_PROMPT
        if estimate < self.min_disaggregated_prompt_tokens:
            return Plan.SHORT_PROMPT
        if self._uncached_tokens(request) < self.min_uncached_prefill_tokens:
            return Plan.CACHED_PREFIX
        return Plan.DISAGGREGATED

    def _uncached_tokens(self, request: RouterRequest) -> int | float:
        """The prompt tokens the decode instance the policy picks does not cache, as the decode
        policy knows it; infinite when it does not know."""
        routed = request.routed
        if not self.min_uncached_prefill_tokens or routed is None or routed.token_ids is None:
            return float("inf")
        url = self._pick(Step.DECODE, request, set())
        cached = None if url is None else self.policies[Step.DECODE].cached_tokens(url, routed)
        return float("inf") if cached is None else len(routed.token_ids) - cached

    async def _routed_prompt(self, request: RouterRequest) -> RoutedPrompt:
        """The prompt for the policies: with its token ids when a policy asks for them (the
        client's, or an instance's /tokenize answer; None when neither is to be had)."""
        salt = request.body.get("cache_salt")
        salt = salt if isinstance(salt, str) else None
        key = request.prompt.key
        if not any(p.needs_token_ids for p in self.policies.values()):
            return RoutedPrompt(key, None, salt)
        if request.prompt.token_ids:
            return RoutedPrompt(key, key, salt)
        return RoutedPrompt(key, await self._tokenize(request), salt)

    async def _tokenize(self, request: RouterRequest) -> list[int] | None:
        body = tokenize_body(request.path, request.body)
        if body is None or request.prompt.estimated_tokens is None:
            return None
        for info in self.registry.candidates(Step.DECODE):
            try:
                answer = await post(self.client, info.url + TOKENIZE_PATH, body, request.headers)
            except Unreachable:
                continue
            data = answer.json() if answer.status == 200 else None
            tokens = data.get("tokens") if isinstance(data, dict) else None
            if isinstance(tokens, list):
                return tokens
            return None
        return None

    def _pick(self, step: Step, request: RouterRequest, tried: set[str]) -> str | None:
        candidates = self.registry.candidates(step, exclude=tried)
        if not candidates:
            return None
        policy = self.policies[step]
        url = policy.select_prompt(candidates, request.routed or RoutedPrompt(request.prompt.key)).url
        if url not in {c.url for c in candidates}:
            raise RuntimeError(f"routing policy {type(policy).__qualname__} chose {url}, which is "
                               f"not one of the {step} candidates {[c.url for c in candidates]}")
        return url

    def _lost(self, url: str, step: Step, outcome: str, reason: str) -> None:
        self.registry.mark_down(url, reason)
        self.metrics.attempt(url, step, outcome)

    def _done(self, request: RouterRequest) -> None:
        self.metrics.e2e.observe(time.monotonic() - request.arrival)

    # ----------------------------------------------------------------------- prefill

    async def _prefill(self, request: RouterRequest, broken: _Broken) -> _Prefilled | Response:
        body = prefill_body(request.body)
        headers = request.headers + self._secret_header
        tried: set[str] = set()
        while (url := self._pick(Step.PREFILL, request, tried)) is not None:
            tried.add(url)
            try:
                with self.registry.in_flight(url):
                    answer = await post(self.client, url + request.path, body, headers)
            except Unreachable as exc:
                self._lost(url, Step.PREFILL, "unreachable", f"prefill request failed: {exc}")
                if exc.connected and broken.add(exc):
                    return broken.response()
                continue
            if answer.status == 429:
                self.metrics.attempt(url, Step.PREFILL, "busy")
                continue
            if answer.status == 503:
                self._lost(url, Step.PREFILL, "unavailable", "answered 503")
                continue
            self.metrics.attempt(url, Step.PREFILL, "ok" if answer.status == 200 else "error")
            if answer.status != 200:
                return answer.response()
            params = _hand_over(answer)
            return _Prefilled(None if params is None else _HandOver(params, url), by_instance=True)
        logger.info("no prefill instance took the request: the decode instance computes it")
        return _Prefilled(None, by_instance=False)

    # ----------------------------------------------------------------------- decode

    async def _decode(self, request: RouterRequest, hand_over: _HandOver | None,
                      broken: _Broken) -> Response:
        tried: set[str] = set()
        busy: Answer | None = None
        while (url := self._pick(Step.DECODE, request, tried)) is not None:
            tried.add(url)
            flight = ExitStack()
            flight.enter_context(self.registry.in_flight(url))
            offered = hand_over is not None and not hand_over.may_be_claimed
            body = decode_body(request.body, hand_over.params if offered else None)
            try:
                result = await self._send(request, url, body, offered)
            except Unreachable as exc:
                flight.close()
                self._lost(url, Step.DECODE, "unreachable", f"decode request failed: {exc}")
                if exc.connected:
                    if offered:
                        hand_over.may_be_claimed = True
                    if broken.add(exc):
                        self._done(request)
                        return broken.response()
                continue
            except BaseException:
                flight.close()
                raise
            if isinstance(result, OpenedStream):
                return self._relay(request, url, result, flight)
            flight.close()
            if result.status == 429:
                self.metrics.attempt(url, Step.DECODE, "busy")
                busy = result
                continue
            if result.status == 503:
                self._lost(url, Step.DECODE, "unavailable", "answered 503")
                continue
            self.metrics.attempt(url, Step.DECODE, "ok" if result.status == 200 else "error")
            self._done(request)
            return result.response()
        self._done(request)
        if busy is not None:
            return busy.response()
        if broken.timed_out:
            return _timeout_error(broken.count).response()
        return RouterError(503, "no healthy decode instance could take the request",
                           code="no_instance").response()

    async def _send(self, request: RouterRequest, url: str, body: dict,
                    with_hand_over: bool) -> Answer | OpenedStream:
        headers = request.headers + self._secret_header if with_hand_over else request.headers
        if request.stream:
            return await open_stream(self.client, url + request.path, body, headers)
        return await post(self.client, url + request.path, body, headers)

    async def _release(self, hand_over: _HandOver) -> None:
        """Tell the prefill instance to release the blocks no decode instance took; a failure
        leaves them to its kv_expiry_s."""
        url = hand_over.prefill_url
        transfer_id = hand_over.params.get("transfer_id")
        if not isinstance(transfer_id, str):
            return
        try:
            answer = await self.client.post(url + KV_RELEASE_PATH, json={"transfer_id": transfer_id},
                                            headers=self._secret_header, timeout=RELEASE_TIMEOUT_S)
        except httpx.HTTPError as exc:
            self.metrics.attempt(url, "release", "unreachable")
            logger.warning("releasing %s on %s failed (%s: %s): its blocks stay pinned until its "
                           "kv_expiry_s", transfer_id, url, type(exc).__name__, exc)
            return
        self.metrics.attempt(url, "release", "ok" if answer.status_code == 200 else "error")
        if answer.status_code != 200:
            logger.warning("releasing %s on %s: answered %d; its blocks stay pinned until its "
                           "kv_expiry_s", transfer_id, url, answer.status_code)

    def _relay(self, request: RouterRequest, url: str, opened: OpenedStream,
               flight: ExitStack) -> RelayedStream:
        self.metrics.ttft.observe(time.monotonic() - request.arrival)
        outcome, done = ["ok"], [False]

        async def events() -> AsyncIterator[str]:
            # The stream is whole once [DONE] is relayed: the client's response ends there, so
            # an instance that dies right after its last event (before closing the chunked body)
            # does not append an error event and a second [DONE] to a finished stream. The rest
            # of the body is read in close(), after the client has its answer.
            for event in opened.head:
                yield event
                if is_done(event):
                    done[0] = True
                    return
            try:
                async for event in opened.rest:
                    yield event
                    if is_done(event):
                        done[0] = True
                        return
            except httpx.TransportError as exc:
                outcome[0] = "broken"
                self.registry.mark_down(url, f"a stream broke: {type(exc).__name__}: {exc}")
                error = (_timeout_error(1) if timed_out(exc) else
                         RouterError(502, "the decode instance failed mid-stream", code="instance_failed"))
                yield error.sse()
                yield SSE_DONE

        async def close() -> None:
            try:
                await opened.close(DRAIN_AFTER_DONE_S if done[0] else 0.0)
            finally:
                flight.close()
                self.metrics.attempt(url, Step.DECODE, outcome[0])
                self._done(request)

        return RelayedStream(events(), close)


def _hand_over(answer: Answer) -> dict | None:
    body = answer.json()
    params = body.get(KV_TRANSFER_PARAMS) if isinstance(body, dict) else None
    return params if isinstance(params, dict) else None
