"""`tandem bench KIND`: the benchmarks, each comparing against a baseline measured in the same run.

Each kind lives in its own module with ``add_arguments(parser)`` and ``run(args) -> int``; they are
imported only when their command runs, so ``tandem --help`` stays light. A kind with a peer
engine (``PEERS``, a module of tandem.bench.peers) gets the peer's arguments too and the peer
itself, ``run(args, peer)``: this is the one module that imports the peers.
"""
from __future__ import annotations

import argparse
import importlib

BENCHMARKS = {
    "offline": ("tandem.bench.offline", "offline throughput of tandem vs HF transformers "
                "(sequential, static batching, continuous batching); with -tp/-pp, tandem on several ranks "
                "vs tandem on one"),
    "serve": ("tandem.bench.serve", "serving benchmark over HTTP: request and token throughput, "
              "TTFT, TPOT, ITL and latency percentiles, goodput under SLOs"),
    "kv-transfer": ("tandem.bench.kv_transfer", "KV block hand-over bandwidth over NIXL, on one host "
                    "(shared memory, TCP) and between two test hosts (network namespaces, TCP; as root), "
                    "vs an in-process torch copy of the same blocks"),
    "structured": ("tandem.bench.structured", "constrained decoding (a cached JSON schema) vs unconstrained, "
                   "same engine, prompts and output lengths: throughput ratio, first compile time, "
                   "bitmask time per step"),
    "disagg": ("tandem.bench.disagg", "colocated vs disaggregated serving on the same cores: TTFT and "
               "TPOT of steady decoding streams under bursts of long prompts"),
    "multiturn": ("tandem.bench.multiturn", "multi-turn conversations on 1 prefill + 2 decode instances in "
                  "three test hosts (as root): cache-aware routing with in-place decoding vs the same "
                  "cluster without prefix reuse vs two colocated instances behind round robin"),
    "chaos": ("tandem.bench.chaos", "a prefill/decode cluster under injected KV-transfer faults (the "
              "\"faulty\" connector over NIXL): requests lost, answers against a colocated instance's, "
              "blocks left held, faults injected vs observed"),
    "disagg-ttft": ("tandem.bench.disagg_ttft", "TTFT of disaggregated requests by prompt length: "
                    "whole-request KV hand-overs vs streamed ones (disaggregation.stream_kv), prefill "
                    "and decode on two network namespaces over UCX/TCP (as root)"),
}
PEERS = {"offline": {"vllm": "tandem.bench.peers.vllm_offline", "llamacpp": "tandem.bench.peers.llamacpp_offline"},
         "serve": {"vllm": "tandem.bench.peers.vllm_serve"}}
"""Per benchmark kind, its peers by ``--baseline`` name; the first also serves runs without one
(``bench serve --client vllm``)."""
BASELINE_HELP = {"vllm": "vLLM's CPU build, needs --vllm-python",
                 "llamacpp": "llama.cpp through llama-cpp-python on the same GGUF file, needs --llamacpp-python"}


def add_bench_arguments(parser: argparse.ArgumentParser) -> None:
    kinds = parser.add_subparsers(dest="bench_kind", title="benchmarks", metavar="KIND", required=True)
    for kind, (module_name, help_text) in BENCHMARKS.items():
        sub = kinds.add_parser(kind, help=help_text, description=help_text)
        sub.set_defaults(bench_module=module_name)
        importlib.import_module(module_name).add_arguments(sub)
        if kind in PEERS:
            sub.add_argument("--baseline", choices=list(PEERS[kind]), default=None,
                             help="also run this peer on the same model, prompts and lengths, and print "
                                  "tandem's ratio to it (" + "; ".join(f"{n}: {BASELINE_HELP[n]}"
                                                                       for n in PEERS[kind]) + ")")
            for peer in PEERS[kind].values():
                importlib.import_module(peer).add_arguments(sub)


def run_bench(args: argparse.Namespace) -> int:
    module = importlib.import_module(args.bench_module)
    if args.bench_kind not in PEERS:
        return module.run(args)
    peers = PEERS[args.bench_kind]
    return module.run(args, importlib.import_module(peers[args.baseline or next(iter(peers))]))
