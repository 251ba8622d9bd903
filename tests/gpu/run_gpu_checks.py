"""Every GPU check of tandem in one go, on a machine with an NVIDIA GPU (issue 6, item 5)::

    python tests/gpu/run_gpu_checks.py [--wheels DIR] [--no-install] [--smoke]

1. installs tandem with ``pip install --no-deps --no-build-isolation -e .``, after the wheels in
   DIR (default ``.whl/`` when it holds any: the small packages such a machine lacks, e.g.
   pydantic-settings), then restarts itself so that the install is visible;
2. runs the kernel tests, the ``gpu`` tests and the quantized-matmul tests on the GPU (pytest in
   a child process);
3. compares the "triton" and "torch" attention backends on a mixed and a decode-only batch;
4. times paged decode attention against the memory-bandwidth roofline: the KV bytes it must read
   over the device-to-device copy bandwidth measured on the spot;
5. times offline throughput of a ~1.1B-parameter random-weight Llama in bfloat16 at batch 1, 16
   and 64 (128 prompt + 128 generated tokens per request), tandem with CUDA graphs and with
   ``enforce_eager`` against HF ``generate``, and checks that both tandem runs give the same
   greedy tokens;

and prints one table. It takes about three minutes on an H100/H200. ``--smoke`` runs the same
steps with tiny shapes on any machine (CPU: kernels in Triton's interpreter), to check the script.
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import re
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
KV_HEADS, HEADS, HEAD_DIM, BLOCK_SIZE = 8, 32, 128, 16


@dataclass(frozen=True, slots=True)
class Sizes:
    """Everything the smoke mode shrinks."""

    decode_cases: tuple[tuple[int, int], ...]  # (batch, context tokens)
    copy_bytes: int
    timing_iters: int
    llama: dict
    batches: tuple[int, ...]
    prompt_len: int
    new_tokens: int


FULL = Sizes(
    decode_cases=((1, 65536), (8, 16384), (64, 4096), (256, 1024)),
    copy_bytes=2 << 30,
    timing_iters=20,
    llama=dict(vocab_size=32000, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
               num_attention_heads=32, num_key_value_heads=8),
    batches=(1, 16, 64),
    prompt_len=128,
    new_tokens=128,
)
SMOKE = Sizes(
    decode_cases=((2, 64),),
    copy_bytes=1 << 22,
    timing_iters=2,
    llama=dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2),
    batches=(1, 2),
    prompt_len=8,
    new_tokens=4,
)


@dataclass(slots=True)
class Row:
    check: str
    result: str
    detail: str = ""


# ------------------------------------------------------------------------------ install, pytest


def install(wheels: Path) -> None:
    pip = [sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--no-deps"]
    found = sorted(str(w) for w in wheels.glob("*.whl")) if wheels.is_dir() else []
    if found:
        subprocess.run([*pip, "--no-index", *found], check=True)
    subprocess.run([*pip, "--no-build-isolation", "-e", str(ROOT)], check=True)


OTHER_GPU_TESTS = ["tests/quant/test_cuda.py", "tests/quant/test_int4_dequant_gemm.py",
                   "tests/quant/test_fp8_matmul.py", "tests/executor/test_mp_one_rank.py",
                   "tests/models/test_cuda_fusion.py"]


def run_pytest(smoke: bool) -> Row:
    folders = ["tests/gpu"] if smoke else ["tests/kernels", "tests/gpu", *OTHER_GPU_TESTS]
    cmd = [sys.executable, "-m", "pytest", *folders, "-q", "-p", "no:cacheprovider"]
    if not smoke and importlib.util.find_spec("xdist"):
        cmd += ["-n", "8"]
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=300)
    seconds = time.perf_counter() - t0
    print(proc.stdout[-6000:], proc.stderr[-2000:], sep="\n", flush=True)
    counts = re.compile(r"\d+ (passed|failed|error|skipped)")
    summary = [line for line in proc.stdout.splitlines() if counts.search(line)]
    detail = summary[-1].strip("= ") if summary else f"exit status {proc.returncode}"
    return Row(f"pytest {' '.join(folders)}", "ok" if proc.returncode == 0 else "FAILED",
               f"{detail} ({seconds:.0f} s wall)")


# ------------------------------------------------------------------------------ backends


def compare_backends(device, dtype) -> list[Row]:
    import torch

    from tandem.plugins.attention_torch import TorchAttentionBackend
    from tandem.plugins.attention_triton import TritonAttentionBackend

    cases = {"mixed batch": [(0, 300), (256, 77), (1000, 1), (0, 1)],
             "decode batch": [(1, 1), (500, 1), (3000, 1), (4100, 1)]}
    rows = []
    for name, chunks in cases.items():
        out, pool = _attention_step(TritonAttentionBackend, chunks, device, dtype)
        ref_out, ref_pool = _attention_step(TorchAttentionBackend, chunks, device, dtype)
        diff = (out.float() - ref_out.float()).abs().max().item()
        same_pool = torch.equal(pool, ref_pool)
        ok = same_pool and diff < (2e-2 if dtype != torch.float32 else 1e-4)
        rows.append(Row(f"triton vs torch backend, {name}", "ok" if ok else "MISMATCH",
                        f"max |out diff| {diff:.1e} ({str(dtype)[6:]}), KV writes "
                        f"{'identical' if same_pool else 'DIFFER'}"))
    return rows


def _attention_step(backend_cls, chunks, device, dtype):
    import torch

    from tests.helpers.paged_batch import SeqSpec, build_metadata, scattered_tables

    gen = torch.Generator().manual_seed(0)
    num_blocks = sum(-(-(c + n) // BLOCK_SIZE) for c, n in chunks) + 8
    pool = torch.randn(num_blocks, 2, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, generator=gen)
    pool = pool.to(device=device, dtype=dtype)
    tables = scattered_tables([c + n for c, n in chunks], BLOCK_SIZE, num_blocks, seed=1)
    md = build_metadata([SeqSpec(t, c, n) for t, (c, n) in zip(tables, chunks)], BLOCK_SIZE, device=device)
    q, k, v = (torch.randn(md.num_tokens, h, HEAD_DIM, generator=gen).to(device=device, dtype=dtype)
               for h in (HEADS, KV_HEADS, KV_HEADS))
    backend = backend_cls(HEADS, KV_HEADS, HEAD_DIM, scale=HEAD_DIM ** -0.5)
    backend_cls.prepare_metadata(md)
    return backend.forward(q, k, v, pool[:, 1], md), pool


# ------------------------------------------------------------------------------ roofline


def time_s(fn: Callable[[], object], iters: int, device) -> float:
    """Mean wall time of ``fn`` over ``iters`` runs after one warm-up, device synchronised."""
    import torch

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    fn()
    sync()
    t0 = time.perf_counter()
    for _ in range(iters):
        fn()
    sync()
    return (time.perf_counter() - t0) / iters


def decode_roofline(sizes: Sizes, device, dtype) -> list[Row]:
    import torch

    from tandem.kernels.paged_decode_attention import (
        choose_num_splits,
        multiprocessor_count,
        paged_decode_attention,
    )

    src = torch.empty(sizes.copy_bytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    copy_bw = 2 * sizes.copy_bytes / time_s(lambda: dst.copy_(src), sizes.timing_iters, device)
    del src, dst
    rows = [Row("device-to-device copy", f"{copy_bw / 1e9:.0f} GB/s", "bytes read + written")]
    elem = torch.empty((), dtype=dtype).element_size()
    for batch, context in sizes.decode_cases:
        num_blocks = batch * context // BLOCK_SIZE + 1
        cache = torch.empty(num_blocks, 2, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
        cache.normal_()
        tables = (torch.randperm(num_blocks - 1, device=device) + 1).view(batch, -1).to(torch.int32)
        lens = torch.full((batch,), context, dtype=torch.int32, device=device)
        q = torch.randn(batch, HEADS, HEAD_DIM, dtype=dtype, device=device)
        seconds = time_s(lambda: paged_decode_attention(q, cache, tables, lens, HEAD_DIM ** -0.5,
                                                        max_seq_len=context),
                         sizes.timing_iters, device)
        kv_bytes = batch * context * KV_HEADS * HEAD_DIM * 2 * elem
        splits = choose_num_splits(batch, KV_HEADS, context, multiprocessor_count(device))
        rows.append(Row(f"decode attention B={batch} ctx={context}",
                        f"{kv_bytes / seconds / copy_bw:.0%} of roofline",
                        f"{seconds * 1e6:.0f} us, {kv_bytes / seconds / 1e9:.0f} GB/s over "
                        f"{kv_bytes / 2**20:.0f} MiB of KV, {splits} split(s), {HEADS}/{KV_HEADS} heads, "
                        f"d={HEAD_DIM}"))
        del cache
    return rows


# ------------------------------------------------------------------------------ throughput


def build_llama(path: Path, spec: dict, device, dtype):
    """A random-weight Llama (HF's own init) saved with a word-level tokenizer; returns the HF
    model, left on ``device`` for the baseline."""
    import torch
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    config = LlamaConfig(architectures=["LlamaForCausalLM"], max_position_embeddings=4096,
                         tie_word_embeddings=False, rms_norm_eps=1e-5, bos_token_id=1, eos_token_id=2,
                         pad_token_id=0, **spec)
    torch.manual_seed(0)
    with torch.device(device):
        model = LlamaForCausalLM(config).to(dtype).eval()
    model.save_pretrained(path)
    vocab = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, spec["vocab_size"])}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                            unk_token="<pad>").save_pretrained(path)
    return model


def throughput(sizes: Sizes, device, dtype) -> list[Row]:
    import torch

    from tandem import LLM, SamplingParams

    gen = torch.Generator().manual_seed(0)
    vocab = sizes.llama["vocab_size"]
    new = sizes.new_tokens
    with tempfile.TemporaryDirectory() as tmp:
        hf = build_llama(Path(tmp), sizes.llama, device, dtype)
        params = sum(p.numel() for p in hf.parameters())
        hf_tok_s = {}
        with torch.inference_mode():
            for batch in sizes.batches:
                ids = torch.randint(3, vocab, (batch, sizes.prompt_len), generator=gen).to(device)
                def run(ids=ids):
                    return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new,
                                       min_new_tokens=new, do_sample=False, pad_token_id=0)

                hf_tok_s[batch] = batch * new / time_s(run, 1, device)
        del hf
        if device.type == "cuda":
            torch.cuda.empty_cache()
        sampling = SamplingParams(temperature=0.0, max_tokens=new, ignore_eos=True)
        prompts = {b: torch.randint(3, vocab, (b, sizes.prompt_len), generator=gen).tolist()
                   for b in sizes.batches}
        ours: dict[tuple[bool, int], float] = {}
        tokens: dict[bool, list] = {}
        for eager in (True, False):
            # On the CPU (--smoke) graphs cannot be captured: both runs are eager.
            llm = LLM(model=tmp, dtype=str(dtype)[6:], device=device.type, attention_backend="triton",
                      max_num_seqs=max(sizes.batches), max_num_batched_tokens=8192,
                      enable_prefix_caching=False, enforce_eager=eager,
                      num_kv_blocks=max(sizes.batches) * (sizes.prompt_len + new) // BLOCK_SIZE * 2 + 2)
            for batch in sizes.batches:
                seconds = time_s(lambda: llm.generate(prompts[batch], sampling), 1, device)
                ours[eager, batch] = batch * new / seconds
            tokens[eager] = [o.outputs[0].token_ids for o in llm.generate(prompts[sizes.batches[-1]], sampling)]
            del llm
            if device.type == "cuda":
                torch.cuda.empty_cache()
        same = sum(a == b for a, b in zip(tokens[True], tokens[False]))
        rows = [Row("CUDA graphs vs eager, greedy tokens", "ok" if same == len(tokens[True]) else "MISMATCH",
                    f"{same}/{len(tokens[True])} sequences identical at batch {sizes.batches[-1]}")]
        for batch in sizes.batches:
            graphs, eager = ours[False, batch], ours[True, batch]
            rows.append(Row(f"throughput batch {batch}", f"{graphs / hf_tok_s[batch]:.2f}x HF",
                            f"tandem graphs {graphs:.0f} tok/s, eager {eager:.0f} tok/s "
                            f"({graphs / eager:.2f}x), HF generate {hf_tok_s[batch]:.0f} tok/s; "
                            f"{params / 1e9:.2f}B params, {str(dtype)[6:]}, {sizes.prompt_len}+{new} tokens"))
    return rows


# ------------------------------------------------------------------------------ main


def guarded(name: str, fn: Callable[[], list[Row]]) -> list[Row]:
    """Run one stage; a failure becomes a row of the table instead of ending the script."""
    t0 = time.perf_counter()
    try:
        rows = fn()
    except Exception as exc:  # noqa: BLE001 - every stage's failure is reported in the table
        traceback.print_exc()
        return [Row(name, "ERROR", f"{type(exc).__name__}: {exc}"[:160])]
    print(f"[{name}: {time.perf_counter() - t0:.0f} s]", flush=True)
    return rows


def print_table(rows: list[Row]) -> None:
    width = max(len(r.check) for r in rows)
    res = max(len(r.result) for r in rows)
    print(f"\n{'check':<{width}}  {'result':<{res}}  detail")
    print(f"{'-' * width}  {'-' * res}  {'-' * 40}")
    for r in rows:
        print(f"{r.check:<{width}}  {r.result:<{res}}  {r.detail}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--wheels", type=Path, default=ROOT / ".whl", help="wheels to install first")
    p.add_argument("--no-install", action="store_true", help="tandem is installed already")
    p.add_argument("--smoke", action="store_true", help="tiny shapes, any device: checks the script")
    args = p.parse_args()
    if not args.no_install:
        install(args.wheels)
        os.execv(sys.executable, [sys.executable, __file__, "--no-install", *sys.argv[1:]])
    t0 = time.perf_counter()
    sys.path.insert(0, str(ROOT))
    import torch

    if not torch.cuda.is_available() and not args.smoke:
        print("no CUDA device: nothing to check (use --smoke to try the script on this machine)")
        return 1
    if not torch.cuda.is_available():
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import triton

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    sizes = SMOKE if args.smoke else FULL
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU"
    rows = [Row("environment", name, f"python {sys.version.split()[0]}, torch {torch.__version__}, "
                                     f"triton {triton.__version__}")]
    rows.append(run_pytest(args.smoke))
    rows += guarded("backends", lambda: compare_backends(device, dtype))
    rows += guarded("roofline", lambda: decode_roofline(sizes, device, dtype))
    rows += guarded("throughput", lambda: throughput(sizes, device, dtype))
    rows.append(Row("total", f"{time.perf_counter() - t0:.0f} s", "after the install"))
    print_table(rows)
    return 0 if all(r.result not in ("FAILED", "ERROR", "MISMATCH") for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
