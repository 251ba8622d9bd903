"""`tandem bench offline`: offline throughput of tandem against HF transformers, in one run.

Every mode gets the same checkpoint and the same requests (seeded random prompt and output
lengths, greedy, EOS ignored) and only the tokens each request asked for count:

- ``hf-sequential``: ``model.generate`` one request at a time;
- ``hf-static``: left-padded batches in arrival order, each run until its longest request is done;
- ``hf-continuous``: transformers' own continuous-batching manager, each request with its own
  ``max_new_tokens``;
- ``tandem``: ``tandem.LLM.generate`` over all requests;
- with ``--baseline vllm``, ``vllm``: vLLM's ``LLM.generate`` over the same requests, in vLLM's own
  venv (the peer tandem.bench.cli hands ``run``: tandem.bench.peers.vllm_offline);
- with ``--baseline llamacpp``, ``llamacpp``: llama.cpp on the same GGUF file, the requests one
  after another, then batch-1 prompt and decode rates of both (tandem.bench.peers.llamacpp_offline).

It prints tokens/s per mode and tandem's ratio to each baseline, then (unless ``--no-roofline``)
tandem's median pure decode step against this machine's floor for it, measured in the same run
(tandem.bench.roofline). With ``-tp``/``-pp`` above 1 the
baseline is tandem itself on one rank instead (tandem.bench.offline_parallel).
"""
from __future__ import annotations

import argparse
import statistics
import time
from typing import Protocol

from tandem.bench.workload import (ModeResult, Workload, agreement, describe_workload, make_workload,
                                   run_tandem, token_agreement)

MODES = ("hf-sequential", "hf-static", "hf-continuous", "tandem")


def run_hf_sequential(model, wl: Workload) -> ModeResult:
    import torch

    outputs = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for prompt, m in zip(wl.prompts, wl.max_tokens):
            ids = torch.tensor([prompt])
            out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=m,
                                 min_new_tokens=m, do_sample=False)
            outputs.append(out[0, len(prompt):].tolist())
    return ModeResult("hf-sequential", time.perf_counter() - t0, outputs)


def run_hf_static(model, wl: Workload, batch_size: int, pad_id: int) -> ModeResult:
    import torch

    outputs = []
    t0 = time.perf_counter()
    with torch.inference_mode():
        for start in range(0, len(wl.prompts), batch_size):
            prompts = wl.prompts[start:start + batch_size]
            wants = wl.max_tokens[start:start + batch_size]
            width = max(map(len, prompts))
            ids = torch.tensor([[pad_id] * (width - len(p)) + p for p in prompts])
            mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
            longest = max(wants)
            out = model.generate(ids, attention_mask=mask, max_new_tokens=longest,
                                 min_new_tokens=longest, do_sample=False, pad_token_id=pad_id)
            outputs.extend(out[i, width:width + m].tolist() for i, m in enumerate(wants))
    return ModeResult("hf-static", time.perf_counter() - t0, outputs)


def run_hf_continuous(model, wl: Workload) -> ModeResult:
    from transformers import GenerationConfig

    gen_cfg = GenerationConfig(do_sample=False, max_new_tokens=max(wl.max_tokens), eos_token_id=-1,
                               pad_token_id=0)
    results = {}
    t0 = time.perf_counter()
    with model.continuous_batching_context_manager(generation_config=gen_cfg, block=True,
                                                   timeout=30, warmup=False) as manager:
        ids = [manager.add_request(p, request_id=f"r{i}", max_new_tokens=m, eos_token_id=-1)
               for i, (p, m) in enumerate(zip(wl.prompts, wl.max_tokens))]
        while len(results) < len(ids):
            result = manager.get_result(timeout=1)
            if result is not None and result.is_finished():
                results[result.request_id] = result.generated_tokens
            elif result is None and not manager.is_running():
                raise RuntimeError("transformers' continuous batching thread stopped")
    seconds = time.perf_counter() - t0
    return ModeResult("hf-continuous", seconds, [list(results[i]) for i in ids])


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", help="HF folder, .gguf file, preset (bench-100m, the default; demo) or "
                                   "registry model (smollm2-135m-instruct, gemma3-270m); the HF modes "
                                   "and --baseline get a .gguf dequantized to float32 (built once)")
    p.add_argument("--num-requests", type=int, default=64)
    p.add_argument("--prompt-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    p.add_argument("--output-len", type=int, nargs=2, default=(16, 256), metavar=("MIN", "MAX"))
    p.add_argument("--static-batch-size", type=int, default=32)
    p.add_argument("--modes", nargs="+", choices=MODES, default=None,
                   help="what runs on one rank (default: all); not with -tp/-pp")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=None,
                   help="torch threads (default: torch's); with -tp/-pp the total over the ranks "
                        "(default: every core)")
    p.add_argument("--tensor-parallel-size", "-tp", type=_positive, default=1, metavar="N",
                   help="above 1 (or -pp above 1): tandem on tp x pp ranks (the mp executor) against "
                        "tandem on one rank with as many torch threads, instead of the HF modes")
    p.add_argument("--pipeline-parallel-size", "-pp", type=_positive, default=1, metavar="N",
                   help="pipeline stages of the parallel run (see -tp)")
    p.add_argument("--repeats", type=_positive, default=3, metavar="N",
                   help="with -tp/-pp: timed runs of each setup, alternating (the median counts)")
    p.add_argument("--rounds", type=_positive, default=1, metavar="N",
                   help="with --baseline: timed runs of tandem and of the peer, alternating; each "
                        "round's ratio is printed and the median ratio counts")
    p.add_argument("--cpu-kernels", default="auto", metavar="NAME",
                   help="tandem's engine.cpu_kernels (auto, tandem, dpbf16, onednn, torch)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="tandem's max_num_seqs")
    p.add_argument("--max-num-batched-tokens", type=int, default=2048)
    p.add_argument("--num-speculative-tokens", type=int, default=0,
                   help="tandem's n-gram speculative decoding: drafts per step (0 = off)")
    p.add_argument("--quantization", default="auto", metavar="NAME",
                   help="tandem's model.quantization (gguf: a .gguf file's blocks kept packed)")
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32",
                   help="dtype of both tandem and HF (bfloat16 pays off on CPUs with AVX512-BF16/AMX)")
    p.add_argument("--no-roofline", dest="roofline", action="store_false",
                   help="skip measuring this machine's floor for tandem's decode steps (about 2 s)")


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be 1 or more, got {value}")
    return value


class Peer(Protocol):
    """Another engine run on the same workload (a module of tandem.bench.peers, which adds its
    own arguments, ``--baseline`` among them, and which tandem.bench.cli hands to ``run``)."""

    name: str

    def check_arguments(self, args: argparse.Namespace) -> None:
        """Raise ``ConfigError`` unless the peer can run as ``args`` ask."""

    def warm_up_tandem(self, llm, wl: Workload) -> None:
        """Give tandem's ``llm`` the untimed warm-up the peer gets."""

    def run(self, args: argparse.Namespace, model: str, wl: Workload) -> ModeResult:
        """The peer's timed run over ``wl`` on tandem's ``model`` path, as a mode named ``name``.
        A peer may also have ``batch1_report(args, llm, model, wl)``: figures of its own at batch
        1 beside tandem's, printed after the summary."""


def run(args: argparse.Namespace, peer: Peer | None = None) -> int:
    """The benchmark; with ``peer`` (given) and ``--baseline``, the peer runs too."""
    import torch
    from transformers import AutoModelForCausalLM

    from tandem import LLM
    from tandem.bench.checkpoint import hf_folder, model_path
    from tandem.config import ConfigError
    from tandem.models.config import ModelArchConfig
    from tandem.models.loader import load_generation_config

    if peer is not None and args.baseline is None:
        peer = None
    if peer is not None:
        peer.check_arguments(args)
    path = model_path(args.model)
    eos = set(load_generation_config(path)["eos_token_ids"])
    if args.tensor_parallel_size * args.pipeline_parallel_size > 1:
        from tandem.bench.offline_parallel import run_comparison

        if peer is not None:
            raise ConfigError("--baseline compares tandem on one rank with its peer: drop it with -tp/-pp")
        if args.modes is not None:
            raise ConfigError("--modes chooses the one-rank modes; with -tp/-pp the bench compares "
                              "tandem's parallel run with tandem on one rank: drop --modes")
        vocab = ModelArchConfig.from_pretrained_dir(path).vocab_size
        return run_comparison(args, path, _workload(args, vocab, eos))
    args.modes = args.modes or list(MODES)
    if args.threads:
        torch.set_num_threads(args.threads)
    hf = None
    if any(m.startswith("hf") for m in args.modes):
        hf = AutoModelForCausalLM.from_pretrained(hf_folder(path), dtype=getattr(torch, args.dtype)).eval()
    llm = LLM(model=path, dtype=args.dtype, quantization=args.quantization, max_num_seqs=args.max_num_seqs,
              num_speculative_tokens=args.num_speculative_tokens,
              max_num_batched_tokens=args.max_num_batched_tokens,
              cpu_kernels=args.cpu_kernels) if "tandem" in args.modes else None
    wl = _workload(args, llm.engine.arch.vocab_size if llm else hf.config.vocab_size, eos)
    print(f"{describe_workload(path, wl, args)}, torch threads {torch.get_num_threads()}")
    if peer is not None and llm:
        peer.warm_up_tandem(llm, wl)
    results: dict[str, ModeResult] = {}
    for mode in args.modes:
        if mode == "hf-sequential":
            results[mode] = run_hf_sequential(hf, wl)
        elif mode == "hf-static":
            results[mode] = run_hf_static(hf, wl, args.static_batch_size, pad_id=min(eos) if eos else 0)
        elif mode == "hf-continuous":
            results[mode] = run_hf_continuous(hf, wl)
        else:
            results[mode] = run_tandem(llm, wl)
        _print_mode(results[mode], wl)
    if peer is not None:
        results[peer.name] = peer.run(args, path, wl)
        _print_mode(results[peer.name], wl)
    _print_summary(results, wl, peer.name if peer is not None else None)
    if peer is not None and "tandem" in results and args.rounds > 1:
        _more_rounds(args, peer, llm, path, wl, results)
    if peer is not None and llm is not None and hasattr(peer, "batch1_report"):
        peer.batch1_report(args, llm, path, wl)
    if args.roofline and "tandem" in results:
        from tandem.bench.roofline import report

        report(llm.engine.arch, results["tandem"].steps, args.dtype, args.max_num_seqs)
    return 0


def _more_rounds(args: argparse.Namespace, peer: Peer, llm, path: str, wl: Workload,
                 first: dict[str, ModeResult]) -> None:
    """Rounds 2..``--rounds`` of tandem then the peer, one after the other; prints every round's
    rates and ratio and the median ratio (round 1 is ``first``)."""
    rates = [(first["tandem"].tokens_per_s(wl), first[peer.name].tokens_per_s(wl))]
    for _ in range(args.rounds - 1):
        ours = run_tandem(llm, wl, cold=True)
        _print_mode(ours, wl)
        theirs = peer.run(args, path, wl)
        _print_mode(theirs, wl)
        rates.append((ours.tokens_per_s(wl), theirs.tokens_per_s(wl)))
    print(f"\nround   tandem tok/s   {peer.name} tok/s   ratio")
    for i, (ours, theirs) in enumerate(rates, 1):
        print(f"{i:>5}   {ours:12.1f}   {theirs:10.1f}   {ours / theirs:5.2f}x")
    ratios = [ours / theirs for ours, theirs in rates]
    print(f"tandem / {peer.name}, median of {len(ratios)} interleaved rounds: {statistics.median(ratios):.2f}x "
          f"(range {min(ratios):.2f}-{max(ratios):.2f}x)")


def _workload(args: argparse.Namespace, vocab_size: int, eos: set[int]) -> Workload:
    return make_workload(args.num_requests, tuple(args.prompt_len), tuple(args.output_len), vocab_size,
                         eos, args.seed)


def _print_mode(r: ModeResult, wl: Workload) -> None:
    print(f"  {r.mode:<14} {r.seconds:8.1f} s  {r.tokens_per_s(wl):8.1f} tok/s", flush=True)


def _print_summary(results: dict[str, ModeResult], wl: Workload, peer_name: str | None) -> None:
    print("\nmode            tok/s   tandem ratio   greedy agreement with tandem")
    ours = results.get("tandem")
    for mode, r in results.items():
        ratio = f"{ours.tokens_per_s(wl) / r.tokens_per_s(wl):10.2f}x" if ours else "-"
        agree = f"{agreement(ours.outputs, r.outputs):6.0%}" if ours and mode != "tandem" else ""
        print(f"{mode:<14} {r.tokens_per_s(wl):7.1f}   {ratio:>12}   {agree}")
    baselines = [r.tokens_per_s(wl) for m, r in results.items() if m.startswith("hf")]
    if ours and baselines:
        print(f"\ntandem / best HF mode: {ours.tokens_per_s(wl) / max(baselines):.2f}x; "
              f"median HF mode {statistics.median(baselines):.1f} tok/s")
    peer = results.get(peer_name)
    if ours and peer:
        print(f"tandem / {peer_name}: {ours.tokens_per_s(wl) / peer.tokens_per_s(wl):.2f}x; greedy agreement "
              f"{token_agreement(ours.outputs, peer.outputs):.1%} of output tokens")
