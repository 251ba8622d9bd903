"""The ``tandem`` command line.

Each subcommand is a ``Subcommand`` in ``SUBCOMMANDS``: its name, help, a function that adds its
arguments and a function that runs it and returns the exit status. The configuration flags
(shaped like ``vllm serve``) come from ``tandem.config_flags``, so every subcommand that builds
an engine accepts the same flags. Nothing imports this module but the entry points
(``tandem``, ``python -m tandem``): the subcommands' modules sit below it.
"""
from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from tandem import __version__
from tandem.config import ConfigError, load_config
from tandem.config_flags import add_config_flags, flags_to_overrides
from tandem.plugin_manager import PluginError, UnknownPluginError, get_registry

logger = logging.getLogger("tandem")

EXIT_USAGE = 2
EXIT_FAILURE = 1


# --------------------------------------------------------------------------- subcommands


@dataclass(frozen=True, slots=True)
class Subcommand:
    """One ``tandem NAME`` command: ``add_arguments(parser)`` defines its arguments and
    ``run(args)`` does the work and returns the exit status."""

    name: str
    help: str
    run: Callable[[argparse.Namespace], int]
    add_arguments: Callable[[argparse.ArgumentParser], None] | None = None


def run_plugins(args: argparse.Namespace) -> int:
    """Print every installed plugin component: kind, name, package, class."""
    rows = [("KIND", "NAME", "PACKAGE", "CLASS")]
    rows += [(e.kind, e.name, e.package, f"{e.cls.__module__}.{e.cls.__qualname__}")
             for e in get_registry().entries()]
    widths = [max(len(row[i]) for row in rows) for i in range(3)]
    for row in rows:
        print("  ".join(cell.ljust(width) for cell, width in zip(row, widths)) + "  " + row[3])
    return 0


def run_config(args: argparse.Namespace) -> int:
    """Print the effective configuration (file < environment < flags) as TOML."""
    config = load_config(args.config_file, flags_to_overrides(args))
    print(config.to_toml(), end="")
    return 0


def _add_make_demo_model_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--preset", choices=["demo", "bench-100m"], default="demo",
                        help="demo: small, seconds to build; bench-100m: the ~100M Llama "
                             "used by the benchmarks (default: demo)")
    parser.add_argument("path", metavar="PATH", help="folder to write the model into")


def run_make_demo_model(args: argparse.Namespace) -> int:
    """Build a preset model folder (weights, config.json, tokenizer) at PATH."""
    from tandem.models.presets import make_demo_model

    path = make_demo_model(args.preset, args.path)
    logger.info("wrote the %s model to %s", args.preset, path)
    print(path)
    return 0


def _add_generate_arguments(parser: argparse.ArgumentParser) -> None:
    add_config_flags(parser)
    parser.add_argument("--prompt", "-p", action="append", required=True,
                        help="a prompt (repeat for several; they run as one batch)")
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--temperature", type=float, default=0.0, help="0 = greedy (default)")
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument("--top-k", type=int, default=0)
    parser.add_argument("--n", type=int, default=1, help="sequences per prompt")
    parser.add_argument("--sample-seed", type=int, default=None, help="per-request sampling seed")
    parser.add_argument("--stop", action="append", default=[], help="a stop string (repeatable)")


def run_generate(args: argparse.Namespace) -> int:
    """Generate for the given prompts with the offline engine and print each completion."""
    from tandem.llm import LLM
    from tandem.sampling_params import SamplingParams

    try:
        params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                                top_p=args.top_p, top_k=args.top_k, n=args.n,
                                seed=args.sample_seed, stop=args.stop)
    except ValueError as exc:
        raise ConfigError(str(exc)) from exc
    llm = LLM(config_file=args.config_file, **flags_to_overrides(args))
    for out in llm.generate(args.prompt, params):
        for completion in out.outputs:
            print(f"--- {out.prompt!r} [{completion.index}] ({completion.finish_reason}, "
                  f"{len(completion.token_ids)} tokens)")
            print(completion.text)
    return 0


def _add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    from tandem.server.launch import add_serve_arguments

    add_serve_arguments(parser)


def _run_serve(args: argparse.Namespace) -> int:
    from tandem.server.launch import run_serve

    return run_serve(args)


def _add_router_arguments(parser: argparse.ArgumentParser) -> None:
    from tandem.router.launch import add_router_arguments

    add_router_arguments(parser)


def _run_router(args: argparse.Namespace) -> int:
    from tandem.router.launch import run_router

    return run_router(args)


def _add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    from tandem.bench.cli import add_bench_arguments

    add_bench_arguments(parser)


def _run_bench(args: argparse.Namespace) -> int:
    from tandem.bench.cli import run_bench

    return run_bench(args)


def _add_quantize_arguments(parser: argparse.ArgumentParser) -> None:
    from tandem.quant.quantize_args import add_arguments

    add_arguments(parser)


def _run_quantize(args: argparse.Namespace) -> int:
    from tandem.quant.quantize import run

    return run(args)


SUBCOMMANDS: list[Subcommand] = [
    Subcommand("serve", "serve a model over an OpenAI-compatible HTTP API (default: SmolLM2-135M-Instruct "
               "when its wheel is installed, else the demo model)",
               _run_serve, _add_serve_arguments),
    Subcommand("router", "route OpenAI requests over prefill and decode instances (--config FILE)",
               _run_router, _add_router_arguments),
    Subcommand("generate", "generate completions for prompts offline and print them",
               run_generate, _add_generate_arguments),
    Subcommand("bench", "benchmarks against baselines measured in the same run",
               _run_bench, _add_bench_arguments),
    Subcommand("plugins", "list the installed plugins: kind, name, package", run_plugins),
    Subcommand("config", "print the effective configuration as TOML (file, env, flags)",
               run_config, add_config_flags),
    Subcommand("make-demo-model", "write a small random-weight model folder for tests and demos",
               run_make_demo_model, _add_make_demo_model_arguments),
    Subcommand("quantize", "write a GPTQ, AWQ or FP8 copy of a model folder (round-to-nearest, no GPU)",
               _run_quantize, _add_quantize_arguments),
]


# --------------------------------------------------------------------------- entry point


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="tandem",
        description="tandem: an LLM inference server with a paged KV cache, continuous batching "
                    "and a plugin core. Configuration precedence: defaults < --config FILE < "
                    "TANDEM_<SECTION>__<FIELD> environment variables < flags.",
        epilog='Run "tandem COMMAND --help" for the options of a command.',
    )
    parser.add_argument("--version", action="version", version=f"tandem {__version__}")
    parser.add_argument("--log-level", default="INFO", type=str.upper,
                        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
                        help="level of the 'tandem' loggers (default: INFO)")
    subparsers = parser.add_subparsers(dest="command", title="commands", metavar="COMMAND")
    for command in SUBCOMMANDS:
        sub = subparsers.add_parser(command.name, help=command.help, description=command.help)
        if command.add_arguments is not None:
            command.add_arguments(sub)
        sub.set_defaults(run=command.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``tandem`` with ``argv`` (default ``sys.argv[1:]``) and return the exit status:
    0 on success, 2 for a usage or configuration error, 1 for a broken plugin."""
    parser = build_parser()
    args = parser.parse_args(argv)
    logging.basicConfig(format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logger.setLevel(args.log_level)
    if args.command is None:
        parser.print_help()
        return 0
    try:
        return args.run(args)
    except (ConfigError, UnknownPluginError) as exc:
        print(f"tandem {args.command}: {exc}", file=sys.stderr)
        return EXIT_USAGE
    except PluginError as exc:
        print(f"tandem {args.command}: plugin error: {exc}", file=sys.stderr)
        return EXIT_FAILURE


if __name__ == "__main__":
    sys.exit(main())
