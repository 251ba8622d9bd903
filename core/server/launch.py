"""``tandem serve [MODEL] [--config FILE] [flags]``: the app under uvicorn.

With no model it serves the demo preset (built once into a cache folder). SIGTERM or Ctrl-C
starts a graceful shutdown: /health turns 503 and new requests get 503, requests in flight may
finish within ``server.shutdown_timeout_s``, the rest are aborted with an error, and the process
exits 0. A second signal forces the exit.
"""
from __future__ import annotations

import argparse
import asyncio
import gc
import logging
import sys

# OMP_WAIT_POLICY=PASSIVE is set by ``import tandem`` (core/__init__.py), which this module's
# own import ran before torch's.

import uvicorn

from tandem.config_flags import add_config_flags, flags_to_overrides
from tandem.config import ConfigError, TandemConfig, load_config

logger = logging.getLogger("tandem.server")

EXIT_OK = 0
EXIT_FAILURE = 1
EXIT_USAGE = 2


class _Server(uvicorn.Server):
    """uvicorn, with signals starting tandem's graceful shutdown and no re-raised signal at the
    end (uvicorn re-raises a captured SIGTERM, which would make the exit status -15)."""

    def __init__(self, config: uvicorn.Config, on_first_signal) -> None:
        super().__init__(config)
        self._on_first_signal = on_first_signal
        self._loop: asyncio.AbstractEventLoop | None = None

    async def serve(self, sockets=None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig, frame) -> None:
        if self.should_exit:
            self.force_exit = True
            return
        self.should_exit = True
        if self._loop is not None:
            self._loop.call_soon_threadsafe(self._on_first_signal)


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    """The arguments of ``tandem serve``: the configuration flags plus uvicorn's log level."""
    add_config_flags(parser)
    parser.add_argument("--uvicorn-log-level", default="warning",
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="uvicorn's own log level (default: warning)")
    parser.add_argument("--disaggregated", action="store_true",
                        help="start a router (at --host/--port) with one prefill and one decode "
                             "instance on 127.0.0.1, and supervise them")
    parser.add_argument("--headless", action="store_true",
                        help="run this host's ranks of an instance spread over several hosts "
                             "(--nnodes, --node-rank 1 or above, --master-addr/--master-port of "
                             "the head) and serve nothing; ends when the head stops")


def run_serve(args: argparse.Namespace) -> int:
    """Serve until a signal; 0 after a graceful shutdown, 1 when the model failed to load or
    the engine failed for good (see tandem.async_engine), 2 for a bad configuration."""
    try:
        config = load_config(args.config_file, flags_to_overrides(args))
    except ConfigError as exc:
        print(f"tandem serve: {exc}", file=sys.stderr)
        return EXIT_USAGE
    from tandem.models.default_model import resolve_model

    config.model.path, served_name = resolve_model(config.model.path)
    config.model.served_model_name = config.model.served_model_name or served_name
    if getattr(args, "headless", False):
        return _run_headless(config)
    if getattr(args, "disaggregated", False):
        from tandem.server.supervisor import run_disaggregated

        return run_disaggregated(config, args.uvicorn_log_level)
    return asyncio.run(serve(config, args.uvicorn_log_level))


def _run_headless(config: TandemConfig) -> int:
    from tandem.executor.ranks import run_headless
    from tandem.models.loader import load_generation_config

    try:
        eos = frozenset(load_generation_config(config.model.path)["eos_token_ids"])
        return run_headless(config, eos)
    except ValueError as exc:
        print(f"tandem serve --headless: {exc}", file=sys.stderr)
        return EXIT_USAGE


async def serve(config: TandemConfig, uvicorn_log_level: str = "warning") -> int:
    """Serve ``config`` (model path resolved) until a signal; returns the exit status."""
    from tandem.server.app import create_app
    from tandem.http_limits import uvicorn_config

    app = create_app(config)
    ctx = app.state.tandem
    srv = config.server
    server = _Server(
        uvicorn_config(app, srv, host=srv.host, port=srv.port, log_level=uvicorn_log_level,
                       timeout_graceful_shutdown=srv.shutdown_timeout_s + 5.0),
        on_first_signal=lambda: ctx.engine.begin_shutdown(srv.shutdown_timeout_s),
    )
    print(f"tandem: serving model {ctx.model_name!r} from {config.model.path} "
          f"at http://{srv.host}:{srv.port} (OpenAI API under /v1)", flush=True)
    serving = asyncio.ensure_future(server.serve())
    loading = asyncio.ensure_future(_wait_loaded(ctx.engine))
    died = asyncio.ensure_future(ctx.engine.died.wait())
    await asyncio.wait({serving, loading}, return_when=asyncio.FIRST_COMPLETED)
    if loading.done() and not loading.result():
        server.should_exit = True
    else:
        await asyncio.wait({serving, died}, return_when=asyncio.FIRST_COMPLETED)
    engine_died = died.done()
    died.cancel()
    if engine_died:
        print(f"tandem serve: the engine failed, exiting: {ctx.engine.error}", file=sys.stderr,
              flush=True)
        server.should_exit = True
    await serving
    if engine_died:
        return EXIT_FAILURE
    if not loading.done():
        loading.cancel()
        return EXIT_OK
    return EXIT_OK if loading.result() else EXIT_FAILURE


async def _wait_loaded(engine) -> bool:
    try:
        await engine.wait_ready()
    except Exception as exc:  # noqa: BLE001 — reported, then the server exits
        print(f"tandem serve: {exc}", file=sys.stderr, flush=True)
        return False
    logger.info("ready: serving %s", engine.model_path)
    # Everything alive now (torch, the model, the tokenizers) lives as long as the server: out of
    # the collector's reach, a full collection triggered by a request's garbage walks only what
    # requests allocate, instead of stopping every thread (the event loop too) for the whole heap.
    gc.freeze()
    return True
