"""The engine behind the server: ``LLMEngine`` steps in its own thread while requests arrive from
an asyncio loop.

::

    asyncio loop (server)                              engine thread (owns the LLMEngine)
    ─────────────────────                              ──────────────────────────────────
    add_requests(batch)
      ├─► InputProcessor.process, every prompt (tokenizer thread; 400s raise here, before any
      │   prompt of the batch is admitted)
      └─► per prompt: queue check (429) ── _Add ──► inbox (SimpleQueue) ──► engine.add_processed
        ▲                                                  │ accepted / ValueError
        └──── future ◄────────── call_soon_threadsafe ◄────┘
    RequestStream ◄── outputs ◄─ call_soon_threadsafe ◄─── engine.step()   (one call per step)
    stream closed early ─ _Abort ─► inbox ─────────────► engine.abort_request (before the next step)

Only the engine thread touches the ``LLMEngine`` (it is not thread-safe); only the loop touches the
streams and the queue accounting. The waiting queue the server bounds is "requests accepted that have
produced no output yet" (waiting, or computing their prompt): a request beyond ``max_queued_requests``
or ``max_queued_tokens`` prompt tokens raises ``QueueFull`` at once, before reaching the engine.

The tokenizer is never shared between the threads (a Rust tokenizer used from two threads at once
can fail with "Already borrowed"): the engine thread detokenizes with the engine's, the tokenizer
thread (``tokenizer_thread``) checks and encodes prompts and renders chat templates with a copy of
its own, and the loop decodes single tokens with ``AsyncEngine.tokenizer``, a third copy.

A stream's life (``StreamState``)::

    PENDING ──first output──► STREAMING ──finished output / error──► FINISHED ──read──► DONE
       │  └───────────finished output / error──────────────────────────┘
       └──────────┴── close() before finished ──► ABORTED

PENDING streams are the waiting queue the server bounds.

Failures. The engine fails a request alone when its step fails alone (``LLMEngine`` isolates the
others); its stream raises ``RequestFailed``. An ``EngineDeadError``, or exceptions in
``MAX_FAILED_STEPS_IN_ROW`` iterations in a row, end the engine thread: the state turns FAILED (no
more admissions, /health 503), every stream raises ``EngineError``, and ``died`` is set, on which
the server exits non-zero so that a supervisor restarts the process.
"""
from __future__ import annotations

import asyncio
import copy
import enum
import logging
import queue
import threading
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

from tandem.errors import (
    EngineError,
    EngineUnavailable,
    QueueFull,
    RequestAbortedByShutdown,
    RequestFailed,
)
from tandem.engine import MAX_FAILED_STEPS_IN_ROW, LLMEngine, StepStats
from tandem.errors import EngineDeadError
from tandem.input_processor import ProcessedRequest
from tandem.interfaces import KVStats
from tandem.kv_stream import AnnouncementBoard, KVAnnouncement
from tandem.kv_transfer import KVTransferFailed, KVTransferStats, RemotePrefill
from tandem.outputs import RequestOutput
from tandem.sampling_params import SamplingParams
from tandem.tokenizer_thread import TokenizerThread

logger = logging.getLogger("tandem")

_IDLE_WAIT_S = 0.5
_PIN_POLL_S = 0.05
"""While KV blocks are pinned for decode instances, the idle loop wakes this often to see their
release notifications and expiries."""
_LOAD_WAIT_S = 0.002
_STREAM_WAIT_S = 0.05
"""A step that computed nothing while every load waits for its prefill instance's next
announcement (a command, which ends the wait at once): the reads posted meanwhile are looked at
this often, so a decode instance does not spin while the prompt is computed elsewhere."""
"""A step that computed nothing (every request waits for remote KV) waits this long for
commands before polling the transfers again, instead of spinning."""


class EngineState(str, enum.Enum):
    CREATED = "created"
    LOADING = "loading"
    READY = "ready"
    DRAINING = "draining"
    FAILED = "failed"
    STOPPED = "stopped"


@dataclass(slots=True, frozen=True)
class QueueLimits:
    """Bounds of the waiting queue: requests, and prompt tokens summed over those requests."""

    max_requests: int = 256
    max_tokens: int = 262144


@dataclass(slots=True, frozen=True)
class EngineSnapshot:
    """The engine's gauges and cumulative counters, published by the engine thread after every
    iteration; readers on any thread get a consistent (if slightly old) picture."""

    num_running: int = 0
    num_waiting: int = 0
    kv: KVStats | None = None
    num_preemptions: int = 0
    kv_transfer: KVTransferStats | None = None


StepListener = Callable[[StepStats], None]


@dataclass(slots=True, frozen=True)
class RequestBatch:
    """The engine requests of one request body: one per prompt, all with ``params``, the
    ``priority`` and the ``cache_salt``; ``request_ids[i]`` names the request of
    ``prompts[i]``. ``remote_decode``/``remote_prefill`` (see ``LLMEngine.add_processed``) go
    with a batch of one prompt."""

    prompts: list[str | list[int]]
    params: SamplingParams
    request_ids: list[str]
    priority: int = 0
    cache_salt: str | None = None
    remote_decode: bool = False
    remote_prefill: RemotePrefill | None = None

    def __post_init__(self) -> None:
        assert len(self.request_ids) == len(self.prompts), "one request id per prompt"
        assert len(self.prompts) == 1 or not (self.remote_decode or self.remote_prefill), \
            "a KV hand-over goes with one prompt"


@dataclass(slots=True)
class _Add:
    request_id: str
    request: ProcessedRequest
    future: asyncio.Future
    remote_decode: bool = False
    remote_prefill: RemotePrefill | None = None


@dataclass(slots=True)
class _Abort:
    request_id: str


@dataclass(slots=True)
class _ReleasePin:
    transfer_id: str
    future: asyncio.Future


@dataclass(slots=True)
class _ResetPrefixCache:
    future: asyncio.Future


@dataclass(slots=True)
class _Announce:
    announcement: KVAnnouncement


@dataclass(slots=True)
class _Drain:
    deadline: float


class _Stop:
    pass


class StreamState(enum.Enum):
    """Where a ``RequestStream`` is (the diagram in the module docstring)."""

    PENDING = "pending"
    """Admitted (or being admitted), no output yet: it counts in the waiting queue."""
    STREAMING = "streaming"
    FINISHED = "finished"
    """The finished output (or the error) has arrived; the reader has not seen it yet."""
    DONE = "done"
    """The reader has seen the end: iteration stops."""
    ABORTED = "aborted"
    """Closed before it finished."""


class RequestStream:
    """The outputs of one request as they are sampled, read on the event loop.

    The engine sends deltas; the stream folds them into one cumulative ``RequestOutput`` that it
    owns (``output``), so a reader that falls behind costs the request's own size, never a
    queue of copies. Iterating yields that same object each time it has grown (read what you
    need before the next ``await``: it keeps growing); iteration ends after it is finished and
    raises the engine's error if the request failed. ``close()`` aborts the request if it has
    not finished (state ``ABORTED``).
    """

    def __init__(self, engine: AsyncEngine, request_id: str, prompt: str | None,
                 prompt_token_ids: list[int], admission: asyncio.Future | None = None) -> None:
        self.request_id = request_id
        self.prompt_token_ids = prompt_token_ids
        self.arrival_time = time.monotonic()
        self.state = StreamState.PENDING
        self.output: RequestOutput | None = None
        self._engine = engine
        self.prompt = prompt
        """The prompt's text, None when it came as token ids."""
        self._admission = admission
        """Settled when the engine has accepted (or refused) the request."""
        self._error: BaseException | None = None
        self._changed = asyncio.Event()

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    def _on_output(self, item: RequestOutput) -> None:
        """PENDING/STREAMING → STREAMING, or FINISHED with the finished output."""
        if self.output is None:
            item.prompt = self.prompt
            self.output = item
        else:
            self.output.absorb(item)
        self.state = StreamState.FINISHED if item.finished else StreamState.STREAMING
        self._changed.set()

    def _on_error(self, error: BaseException) -> None:
        """→ FINISHED: the reader raises ``error``."""
        self._error = error
        self.state = StreamState.FINISHED
        self._changed.set()

    def __aiter__(self) -> RequestStream:
        return self

    async def __anext__(self) -> RequestOutput:
        if self.state is StreamState.DONE:
            raise StopAsyncIteration
        await self._changed.wait()
        self._changed.clear()
        if self._error is not None:
            self.state = StreamState.DONE
            raise self._error
        if self.output.finished:
            self.state = StreamState.DONE
        return self.output

    def close(self) -> None:
        """PENDING/STREAMING → ABORTED (the engine aborts the request); nothing once finished."""
        if self.state in (StreamState.PENDING, StreamState.STREAMING):
            self._engine._abort(self.request_id)
            self.state = StreamState.ABORTED


class AsyncEngine:
    """Runs an ``LLMEngine`` in a thread and serves it to asyncio code.

    ``engine_factory`` builds the engine on the engine thread (model loading happens there, so the
    server can answer /health with 503 meanwhile). ``step_listener`` is called on the engine thread
    after every step with its ``StepStats`` (metrics); it must be fast and thread-safe.
    """

    def __init__(
        self,
        engine_factory: Callable[[], LLMEngine],
        limits: QueueLimits = QueueLimits(),
        step_listener: StepListener | None = None,
    ) -> None:
        self._factory = engine_factory
        self.limits = limits
        self._step_listener = step_listener
        self.state = EngineState.CREATED
        self.error: BaseException | None = None
        self._engine: LLMEngine | None = None
        self.tokenizer = None
        """The event loop's tokenizer (a copy of the engine's), for single-token decodes."""
        self.default_sampling: dict = {}
        """The sampling fields a request leaves out take these (``LLMEngine.default_sampling``,
        copied when the model has loaded)."""
        self.tokenizer_thread = TokenizerThread(lambda: self.tokenizer)
        """Where prompts are checked and encoded and chat templates rendered, off the loop."""
        self.snapshot = EngineSnapshot()
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._loaded = asyncio.Event()
        self.died = asyncio.Event()
        """Set on the loop when the engine thread ends with an error after loading."""
        self._streams: dict[str, RequestStream] = {}
        self._releases: set[asyncio.Future] = set()
        """Engine-thread calls not yet answered (release_kv_transfer, reset_prefix_cache)."""

    # ------------------------------------------------------------------ lifecycle (event loop)

    async def start(self) -> None:
        """Start the engine thread, which loads the model; returns at once."""
        assert self.state == EngineState.CREATED, "an AsyncEngine starts once"
        self._loop = asyncio.get_running_loop()
        self.state = EngineState.LOADING
        self._thread = threading.Thread(target=self._run, name="tandem-engine", daemon=True)
        self._thread.start()

    async def wait_ready(self) -> None:
        """Wait until the model is loaded (once started); raises if loading failed."""
        await self._loaded.wait()
        if self.state == EngineState.FAILED:
            raise EngineUnavailable(f"the engine failed to start: {self.error}") from self.error

    @property
    def is_ready(self) -> bool:
        return self.state == EngineState.READY

    @property
    def num_queued_requests(self) -> int:
        return sum(s.state is StreamState.PENDING for s in self._streams.values())

    # ------------------------------------------------------------------ what the server reads

    @property
    def model_path(self) -> str | None:
        """The loaded model's path (None until loaded)."""
        return self._engine.config.model.path if self._engine is not None else None

    @property
    def max_model_len(self) -> int | None:
        """The context length in tokens (None until loaded)."""
        return self._engine.max_model_len if self._engine is not None else None

    @property
    def vocab_size(self) -> int:
        """The model's vocabulary size (once loaded)."""
        return self._engine.request_limits.vocab_size

    @property
    def disaggregation(self):
        """The ``[disaggregation]`` settings of the loaded engine (its role, its policies)."""
        return self._engine.config.disaggregation

    @property
    def has_kv_connector(self) -> bool:
        """True on a loaded prefill or decode instance (False when colocated or not loaded)."""
        return self._engine is not None and self._engine.kv_transfer is not None

    @property
    def kv_compat_hash(self) -> str:
        """What a peer's KV must match (``LLMEngine.kv_compat_hash``; needs a KV connector)."""
        return self._engine.kv_transfer.compat_hash

    @property
    def kv_secret(self) -> bytes | None:
        """The key hand-overs are signed with (needs a KV connector)."""
        return self._engine.kv_transfer.secret

    def take_stale_kv_handshakes(self) -> list[str]:
        """Prefill engines whose cached handshakes are stale (see
        ``KVTransferCoordinator.take_stale_handshakes``); empty without a KV connector."""
        kv_transfer = self._engine.kv_transfer if self._engine is not None else None
        return kv_transfer.take_stale_handshakes() if kv_transfer is not None else []

    @property
    def kv_board(self) -> AnnouncementBoard:
        """Where a prefill engine announces its streamed hand-overs (thread-safe)."""
        return self._engine.kv_transfer.board

    def announce_kv(self, announcement: KVAnnouncement) -> None:
        """Hand a streamed load's announcement (its signature checked) to the engine thread."""
        self._inbox.put(_Announce(announcement))

    def kv_handshake(self) -> dict:
        """What a decode instance needs to read this instance's KV blocks: the connector's
        handshake plus the engine id (needs a KV connector)."""
        kv_transfer = self._engine.kv_transfer
        return {**kv_transfer.connector.handshake_info(), "engine_id": kv_transfer.engine_id}

    def kv_events_info(self) -> dict | None:
        """Where this instance publishes its KV events, and its block size; None when
        ``kv_events`` is off (or the engine is not loaded)."""
        publisher = self._engine.kv_events if self._engine is not None else None
        if publisher is None:
            return None
        return {"endpoint": publisher.endpoint, "replay_endpoint": publisher.replay_endpoint,
                "topic": publisher.settings.topic, "block_size": self._engine.config.engine.block_size}

    def begin_shutdown(self, timeout_s: float) -> None:
        """Stop admitting requests; requests in flight may finish within ``timeout_s``, after which
        the engine thread aborts them and their streams raise ``RequestAbortedByShutdown``."""
        if self.state in (EngineState.DRAINING, EngineState.STOPPED):
            return
        if self.state in (EngineState.READY, EngineState.LOADING):
            self.state = EngineState.DRAINING
        self._inbox.put(_Drain(deadline=time.monotonic() + timeout_s))

    async def shutdown(self, timeout_s: float = 0.0) -> None:
        """Drain (as ``begin_shutdown``), wait for the streams to end, then stop the thread."""
        self.begin_shutdown(timeout_s)
        while self._streams and self._thread is not None and self._thread.is_alive():
            await asyncio.sleep(0.02)
        self._inbox.put(_Stop())
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join)
        self.tokenizer_thread.close()
        if self.state != EngineState.FAILED:
            self.state = EngineState.STOPPED

    # ------------------------------------------------------------------ requests (event loop)

    async def add_requests(self, batch: RequestBatch) -> list[RequestStream]:
        """Admit the requests of one body, all or none, and return their streams (in the
        batch's order). The server's one way in.

        Every prompt is checked and tokenized first (``InputProcessor.process``, on the
        tokenizer thread), so a bad prompt anywhere refuses the batch before any is queued; a
        refusal while admitting closes those already admitted. Raises ``EngineUnavailable``
        (not ready / shutting down), ``InvalidRequest`` (a ValueError naming the field: empty
        prompt, ids outside the vocabulary, too long, a grammar the backend refuses…),
        ``QueueFull`` (waiting queue at its bound), ``ValueError`` (an id in use — this path's
        one check of ids; the engine refuses it: an ``n`` the KV pool can never hold, a grammar
        that does not compile…), ``RequestFailed`` (admitting it raised something else: a
        plugin's bug)."""
        self.check_admitting()
        requests = await self.tokenizer_thread.run(self._process_all, self._engine.input_processor,
                                                   batch)
        streams: list[RequestStream] = []
        try:
            for request, request_id in zip(requests, batch.request_ids):
                streams.append(await self._admit(request, request_id, batch.remote_decode,
                                                 batch.remote_prefill))
        except BaseException:
            for stream in streams:
                stream.close()
            raise
        return streams

    @staticmethod
    def _process_all(tokenizer, input_processor, batch: RequestBatch) -> list[ProcessedRequest]:
        return [input_processor.process(tokenizer, prompt, batch.params, batch.priority, batch.cache_salt)
                for prompt in batch.prompts]

    async def add_request(
        self,
        prompt: str | list[int],
        params: SamplingParams,
        request_id: str | None = None,
        priority: int = 0,
        remote_decode: bool = False,
        remote_prefill: RemotePrefill | None = None,
        cache_salt: str | None = None,
    ) -> RequestStream:
        """Admit one request (``add_requests`` of a batch of one) and return its stream."""
        batch = RequestBatch([prompt], params, [request_id if request_id is not None else uuid.uuid4().hex],
                             priority, cache_salt, remote_decode, remote_prefill)
        return (await self.add_requests(batch))[0]

    async def _admit(self, request: ProcessedRequest, request_id: str, remote_decode: bool,
                     remote_prefill: RemotePrefill | None) -> RequestStream:
        self.check_admitting()
        self._check_queue(len(request.prompt_token_ids))
        if request_id in self._streams:
            raise ValueError(f"request id {request_id!r} is already in use")
        future = self._loop.create_future()
        stream = RequestStream(self, request_id, request.prompt, request.prompt_token_ids, future)
        self._streams[request_id] = stream
        self._inbox.put(_Add(request_id, request, future, remote_decode, remote_prefill))
        try:
            await future
        except asyncio.CancelledError:
            stream.close()
            raise
        except BaseException:
            self._forget(stream)
            raise
        return stream

    async def generate(
        self,
        prompt: str | list[int],
        params: SamplingParams | None = None,
        request_id: str | None = None,
        priority: int = 0,
    ) -> AsyncIterator[RequestOutput]:
        """Yield the cumulative outputs of one request as tokens are sampled. Leaving the loop early
        (break, cancellation, client disconnect) aborts the request: its KV blocks are free before
        the next engine step."""
        stream = await self.add_request(prompt, params or SamplingParams(), request_id, priority)
        try:
            async for out in stream:
                yield out
        finally:
            stream.close()

    async def release_kv_transfer(self, transfer_id: str) -> bool:
        """Release the KV blocks pinned for ``transfer_id`` on the engine thread (see
        ``KVTransferCoordinator.release``); False when no such pin is held. Works while draining;
        raises ``EngineUnavailable`` when the engine is not running."""
        if self.state not in (EngineState.READY, EngineState.DRAINING):
            self.check_admitting()
        future = self._loop.create_future()
        self._releases.add(future)
        future.add_done_callback(self._releases.discard)
        self._inbox.put(_ReleasePin(transfer_id, future))
        return await future

    async def reset_prefix_cache(self) -> int:
        """Forget every cached block no request holds, on the engine thread (``LLMEngine.
        reset_prefix_cache``); returns how many. Raises ``EngineUnavailable`` unless serving."""
        self.check_admitting()
        future = self._loop.create_future()
        self._releases.add(future)
        future.add_done_callback(self._releases.discard)
        self._inbox.put(_ResetPrefixCache(future))
        return await future

    def check_admitting(self) -> None:
        """Raise ``EngineUnavailable`` (with the reason) unless requests are admitted now."""
        if self.state != EngineState.READY:
            reason = {
                EngineState.CREATED: "the engine has not been started",
                EngineState.LOADING: "the model is still loading",
                EngineState.DRAINING: "the server is shutting down",
                EngineState.STOPPED: "the server is shut down",
                EngineState.FAILED: f"the engine failed: {self.error}",
            }[self.state]
            raise EngineUnavailable(reason)

    def _check_queue(self, num_tokens: int) -> None:
        lim = self.limits
        queued = [s for s in self._streams.values() if s.state is StreamState.PENDING]
        if len(queued) + 1 > lim.max_requests:
            raise QueueFull(f"the waiting queue is full ({len(queued)} requests waiting, "
                            f"limit {lim.max_requests}); retry later")
        queued_tokens = sum(s.num_prompt_tokens for s in queued)
        # An empty queue admits any prompt, so that no request is refused forever.
        if queued and queued_tokens + num_tokens > lim.max_tokens:
            raise QueueFull(f"the waiting queue is full ({queued_tokens} prompt tokens waiting, "
                            f"limit {lim.max_tokens}); retry later")

    def _abort(self, request_id: str) -> None:
        stream = self._streams.get(request_id)
        if stream is not None:
            self._forget(stream)
        self._inbox.put(_Abort(request_id))

    def _forget(self, stream: RequestStream) -> None:
        self._streams.pop(stream.request_id, None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            stream = self._streams.get(out.request_id)
            if stream is None:
                continue
            if out.error is not None:
                self._fail([out.request_id], RequestFailed(out.error))
                continue
            stream._on_output(out)
            if out.finished:
                del self._streams[out.request_id]

    def _fail(self, request_ids: list[str] | None, error: BaseException) -> None:
        """Fail the given streams (all of them when None) and their pending admissions (and,
        for all of them, the pending releases)."""
        ids = list(self._streams) if request_ids is None else request_ids
        futures = [] if request_ids is not None else list(self._releases)
        for rid in ids:
            stream = self._streams.get(rid)
            if stream is not None:
                self._forget(stream)
                stream._on_error(error)
                futures.append(stream._admission)
        for fut in filter(None, futures):
            self._settle(fut, error)

    def _admitted(self, request_id: str, error: BaseException | None) -> None:
        """The grammar wait of ``request_id`` ended: settle its admission (a refusal when
        ``error``); nothing when its stream has gone (aborted meanwhile)."""
        stream = self._streams.get(request_id)
        if stream is not None and stream._admission is not None:
            self._settle(stream._admission, error)

    def _on_loaded(self, error: BaseException | None) -> None:
        if error is not None:
            self.error = error
            self.state = EngineState.FAILED
        elif self.state == EngineState.LOADING:
            self.state = EngineState.READY
        self._loaded.set()

    def _on_engine_died(self, error: BaseException) -> None:
        self.error = error
        self.state = EngineState.FAILED
        self._fail(None, EngineError(f"the engine failed: {error}"))
        self.died.set()

    def _on_thread_ended(self) -> None:
        for fut in list(self._releases):
            if not fut.done():
                fut.set_exception(EngineUnavailable("the engine has stopped"))

    @staticmethod
    def _settle(future: asyncio.Future, error: BaseException | None) -> None:
        if future.done():
            return
        if error is None:
            future.set_result(None)
        else:
            future.set_exception(error)

    # ------------------------------------------------------------------ engine thread

    def _post(self, fn: Callable, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:
            logger.debug("event loop closed; dropped %s", getattr(fn, "__name__", fn))

    def _run(self) -> None:
        try:
            self._engine = self._factory()
            self._engine.delta_outputs = True
            self._engine.report_grammar_admissions = True
            self.tokenizer = copy.deepcopy(self._engine.tokenizer)
            self.default_sampling = dict(self._engine.default_sampling)
        except BaseException as exc:  # noqa: BLE001 — reported to the loop, which decides
            logger.exception("the engine failed to load")
            self._post(self._on_loaded, exc)
            return
        self._post(self._on_loaded, None)
        try:
            self._loop_forever(self._engine)
        except BaseException as exc:  # noqa: BLE001 — every in-flight request must learn of it
            logger.exception("the engine thread died")
            self._post(self._on_engine_died, exc)
        finally:
            self._engine.close()
            self._post(self._on_thread_ended)

    def _loop_forever(self, engine: LLMEngine) -> None:
        deadline: float | None = None
        failures_in_row = 0
        while True:
            try:
                for cmd in self._take_commands(self._wait_s(engine)):
                    if isinstance(cmd, _Stop):
                        self._abort_all(engine, RequestAbortedByShutdown("the server stopped"))
                        return
                    if isinstance(cmd, _Drain):
                        deadline = cmd.deadline if deadline is None else min(deadline, cmd.deadline)
                    else:
                        self._handle(engine, cmd)
                if deadline is not None and time.monotonic() >= deadline and engine.has_unfinished_requests():
                    self._abort_all(engine, RequestAbortedByShutdown(
                        "the request did not finish before the server's shutdown deadline"))
                self._iterate(engine)
            except EngineDeadError:
                raise
            except Exception as exc:  # noqa: BLE001 — counted: only a run of them is fatal
                failures_in_row += 1
                logger.exception("the engine loop failed (%d in a row)", failures_in_row)
                if failures_in_row >= MAX_FAILED_STEPS_IN_ROW:
                    raise EngineDeadError(f"the engine loop failed {failures_in_row} times in a row; "
                                          f"the last time: {type(exc).__name__}: {exc}") from exc
            else:
                failures_in_row = 0

    def _iterate(self, engine: LLMEngine) -> None:
        """One step (or a poll of the KV transfers while idle), then publish the outputs and
        the snapshot."""
        if engine.has_unfinished_requests():
            outputs = self._settle_grammar_waits(engine, engine.step())
            if self._step_listener is not None and engine.last_step is not None:
                try:
                    self._step_listener(engine.last_step)
                except Exception:  # noqa: BLE001 — metrics must not stop the engine
                    logger.exception("the step listener raised")
            if outputs:
                self._post(self._deliver, outputs)
        else:
            engine.check_health()
            engine.poll_kv_transfers()
        self._fail_transfers(engine)
        kv_transfer = engine.kv_transfer
        self.snapshot = EngineSnapshot(
            num_running=engine.scheduler.num_running,
            num_waiting=engine.scheduler.num_waiting + engine.scheduler.num_loading,
            kv=engine.scheduler.kv.stats(),
            num_preemptions=engine.scheduler.num_preemptions,
            kv_transfer=kv_transfer.stats() if kv_transfer is not None else None,
        )

    def _settle_grammar_waits(self, engine: LLMEngine, outputs: list[RequestOutput]) -> list[RequestOutput]:
        """Answer the admissions whose grammar wait ended: a compile that failed or timed out
        refuses the request (its ``add_request`` raises, as for any refusal: an HTTP 400)."""
        refused = set()
        for request_id, error in engine.take_grammar_admissions():
            if error is not None:
                refused.add(request_id)
            self._post(self._admitted, request_id, error)
        return [out for out in outputs if out.request_id not in refused] if refused else outputs

    @staticmethod
    def _wait_s(engine: LLMEngine) -> float | None:
        """How long to wait for commands before the next iteration (None: do not wait)."""
        if engine.has_unfinished_requests():
            last = engine.last_step
            if last is None or last.num_tokens > 0:
                return None
            return _STREAM_WAIT_S if engine.awaits_kv_announcements() else _LOAD_WAIT_S
        return _PIN_POLL_S if engine.has_kv_pins() else _IDLE_WAIT_S

    def _fail_transfers(self, engine: LLMEngine) -> None:
        for request_id, message in engine.take_failed_requests():
            self._post(self._fail, [request_id], KVTransferFailed(message))

    def _take_commands(self, wait_s: float | None) -> list:
        cmds = []
        if wait_s is not None:
            try:
                cmds.append(self._inbox.get(timeout=wait_s))
            except queue.Empty:
                return cmds
        while True:
            try:
                cmds.append(self._inbox.get_nowait())
            except queue.Empty:
                return cmds

    def _handle(self, engine: LLMEngine, cmd: _Add | _Abort | _ReleasePin | _Announce | _ResetPrefixCache) -> None:
        if isinstance(cmd, _ResetPrefixCache):
            self._post(_set_result, cmd.future, engine.reset_prefix_cache())
            return
        if isinstance(cmd, _Announce):
            if engine.kv_transfer is not None:
                engine.kv_transfer.on_announcement(cmd.announcement)
            return
        if isinstance(cmd, _ReleasePin):
            released = engine.kv_transfer is not None and engine.kv_transfer.release(cmd.transfer_id)
            self._post(_set_result, cmd.future, released)
            return
        if isinstance(cmd, _Abort):
            try:
                engine.abort_request(cmd.request_id)
            except Exception:  # noqa: BLE001 — the next commands must still be handled
                logger.exception("aborting request %s failed", cmd.request_id)
            return
        try:
            engine.add_processed(cmd.request_id, cmd.request, remote_decode=cmd.remote_decode,
                                 remote_prefill=cmd.remote_prefill)
        except (ValueError, KVTransferFailed) as exc:
            self._post(self._settle, cmd.future, exc)
        except Exception as exc:  # noqa: BLE001 — this request alone fails
            logger.exception("admitting request %s failed", cmd.request_id)
            self._post(self._settle, cmd.future, RequestFailed(
                f"request {cmd.request_id} failed in the engine (admission): {type(exc).__name__}: {exc}"))
        else:
            if not engine.is_awaiting_grammar(cmd.request_id):  # else: take_grammar_admissions
                self._post(self._settle, cmd.future, None)

    def _abort_all(self, engine: LLMEngine, error: BaseException) -> None:
        ids = engine.request_ids()
        if ids:
            engine.abort_request(ids)
            self._post(self._fail, ids, error)


def _set_result(future: asyncio.Future, value: object) -> None:
    if not future.done():
        future.set_result(value)
