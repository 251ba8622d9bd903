"""``tandem router --config FILE [--host H] [--port N]``: the router app under uvicorn.

The instances, routing policies, conditional-disaggregation threshold, upstream timeouts, cluster
secret and admin key come from the config's ``[disaggregation]`` section (secrets also from the
environment or ``*_file`` fields), the address from ``[server]`` (127.0.0.1:8000 unless
told otherwise). SIGTERM or Ctrl-C stops it (streams in flight get a few seconds to finish; a
second signal forces the exit), with exit status 0.
"""
from __future__ import annotations

import argparse
import logging
import sys

import uvicorn

from tandem.config import ConfigError, load_config
from tandem.plugin_manager import UnknownPluginError
from tandem.router.app import create_router_app
from tandem.http_limits import uvicorn_config

logger = logging.getLogger("tandem.router")

EXIT_OK = 0
EXIT_USAGE = 2
SHUTDOWN_GRACE_S = 5.0


class _Server(uvicorn.Server):
    """uvicorn without re-raising the captured signal at exit (the exit status stays 0)."""

    def handle_exit(self, sig, frame) -> None:
        self.force_exit = self.should_exit
        self.should_exit = True


def add_router_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--config", dest="config_file", metavar="FILE",
                        help="TOML config file; its [disaggregation] section lists the instances")
    parser.add_argument("--host", default=None, help="address to listen on [server.host]")
    parser.add_argument("--port", type=int, default=None, help="TCP port [server.port]")
    parser.add_argument("--health-interval-s", type=float, default=1.0, metavar="SECONDS",
                        help="seconds between two health checks of each instance (default: 1.0)")
    parser.add_argument("--uvicorn-log-level", default="warning",
                        choices=["critical", "error", "warning", "info", "debug", "trace"],
                        help="uvicorn's own log level (default: warning)")


def run_router(args: argparse.Namespace) -> int:
    """Route until a signal; 0 after it, 2 for a bad configuration."""
    if args.health_interval_s <= 0:
        print("tandem router: --health-interval-s must be positive", file=sys.stderr)
        return EXIT_USAGE
    try:
        config = load_config(args.config_file, {"server.host": args.host, "server.port": args.port})
        app = create_router_app(config, health_interval_s=args.health_interval_s)
    except (ConfigError, UnknownPluginError) as exc:
        print(f"tandem router: {exc}", file=sys.stderr)
        return EXIT_USAGE
    disagg, srv = config.disaggregation, config.server
    if disagg.router_admin_key is None:
        logger.info("disaggregation.router_admin_key is unset: the admin API (/admin/*) is off")
    if disagg.kv_transfer_secret is None and disagg.is_disaggregated:
        logger.warning("disaggregation.kv_transfer_secret is unset (allow_insecure_no_secret): anyone "
                       "who reaches the instances can drive their hand-overs")
    if not disagg.instances:
        logger.warning("no instances configured: add them with POST /admin/instances "
                       "(which needs disaggregation.router_admin_key)")
    print(f"tandem: routing {len(disagg.instances)} instance(s) at http://{srv.host}:{srv.port} "
          f"(prefill policy {disagg.routing_policy}, decode policy {disagg.decode_routing_policy})",
          flush=True)
    server = _Server(uvicorn_config(app, srv, host=srv.host, port=srv.port, log_level=args.uvicorn_log_level,
                                    timeout_graceful_shutdown=SHUTDOWN_GRACE_S))
    server.run()
    return EXIT_OK
