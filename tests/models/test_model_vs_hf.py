"""tandem's models over the paged KV pool against HF transformers' forward logits (float32, CPU):
the prompt in one pass, in chunks over the cache, token by token, and several sequences mixed in
one batch — always with blocks scattered through the pool."""
from __future__ import annotations

import functools

import pytest
import torch

from tandem.models.config import kv_cache_shape
from tandem.plugins.attention_torch import TorchAttentionBackend
from tests.helpers.paged_batch import SeqSpec, build_metadata, positions_of, scattered_tables
from tests.helpers.tiny_models import hf_model, load_tiny_model, tiny_model_dir, tiny_tokenizer

BLOCK_SIZE = 4
NUM_BLOCKS = 64
ATOL = 1e-4
KINDS = ["llama", "llama3", "qwen2", "qwen2_sliding", "mistral", "llama_tied", "qwen3", "gemma3", "granite",
         "smollm3", "phi3"]
TEXTS = [
    "def load_model(path, *, dtype, device):\n    return build(path).to(device, dtype)  # done",
    "The quick brown fox jumps over the lazy dog.",
    "import os\nprint(os.getcwd())",
]


@functools.cache
def models(kind):
    path = tiny_model_dir(kind)
    model, arch = load_tiny_model(path)
    return model, arch, hf_model(path)


def prompt(i=0):
    return tiny_tokenizer().encode(TEXTS[i])


def hf_logits(hf, ids):
    with torch.no_grad():
        return hf(torch.tensor([ids])).logits[0]


@torch.inference_mode()
def step(model, pool, batch):
    """batch: list of (SeqSpec, token ids of the sequence). Returns logits per sequence."""
    seqs = [s for s, _ in batch]
    md = build_metadata(seqs, BLOCK_SIZE)
    TorchAttentionBackend.prepare_metadata(md)
    input_ids = torch.tensor([t for s, ids in batch for t in ids[s.context_len : s.seq_len]])
    logits = model.compute_logits(model(input_ids, positions_of(seqs), pool, md))
    assert logits.dtype == torch.float32
    return logits.split([s.query_len for s in seqs])


def run_schedule(kind, ids, chunks):
    model, arch, _ = models(kind)
    pool = torch.zeros(kv_cache_shape(arch, NUM_BLOCKS, BLOCK_SIZE))
    table = scattered_tables([len(ids)], BLOCK_SIZE, NUM_BLOCKS, seed=11)[0]
    outs, start = [], 0
    for n in chunks:
        outs.append(step(model, pool, [(SeqSpec(table, start, n), ids)])[0])
        start += n
    return torch.cat(outs)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("schedule", ["one_pass", "chunks", "token_by_token"])
def test_logits_match_hf(kind, schedule):
    ids = prompt()
    assert len(ids) > 2 * 8, "the prompt must outgrow the Mistral sliding window"
    chunks = {"one_pass": [len(ids)], "chunks": [7, 13, 1, len(ids) - 21], "token_by_token": [1] * len(ids)}
    ours = run_schedule(kind, ids, chunks[schedule])
    torch.testing.assert_close(ours, hf_logits(models(kind)[2], ids), atol=ATOL, rtol=ATOL)


@pytest.mark.parametrize("kind", ["llama", "mistral", "qwen2_sliding"])
def test_mixed_batch_of_prefill_chunk_and_decode_matches_hf(kind):
    model, arch, hf = models(kind)
    prompts = [prompt(0), prompt(1), prompt(2)]
    refs = [hf_logits(hf, ids) for ids in prompts]
    tables = scattered_tables([len(p) for p in prompts], BLOCK_SIZE, NUM_BLOCKS, seed=5)
    pool = torch.zeros(kv_cache_shape(arch, NUM_BLOCKS, BLOCK_SIZE))
    # step 1: A prefills 20 tokens, B prefills all, C prefills 3
    a, b, c = prompts
    done = [20, len(b), 3]
    out = step(model, pool, [(SeqSpec(tables[0], 0, 20), a), (SeqSpec(tables[1], 0, len(b)), b),
                             (SeqSpec(tables[2], 0, 3), c)])
    got = [[o] for o in out]
    # then every step: A continues in chunks of 9, C decodes one token at a time, B is done
    while done[0] < len(a) or done[2] < len(c):
        batch, who = [], []
        if done[2] < len(c):
            batch.append((SeqSpec(tables[2], done[2], 1), c))
            who.append(2)
        if done[0] < len(a):
            n = min(9, len(a) - done[0])
            batch.append((SeqSpec(tables[0], done[0], n), a))
            who.append(0)
        for i, o in zip(who, step(model, pool, batch)):
            got[i].append(o)
            done[i] += o.shape[0]
    for i in range(3):
        torch.testing.assert_close(torch.cat(got[i]), refs[i], atol=ATOL, rtol=ATOL)


def test_bfloat16_model_stays_close_to_float32_hf():
    model, arch = load_tiny_model(tiny_model_dir("llama"), dtype=torch.bfloat16)
    assert model.model.embed_tokens.weight.dtype == torch.bfloat16
    assert model.model.layers[0].self_attn.qkv_proj.weight.dtype == torch.bfloat16
    ids = prompt()
    pool = torch.zeros(kv_cache_shape(arch, NUM_BLOCKS, BLOCK_SIZE), dtype=torch.bfloat16)
    table = scattered_tables([len(ids)], BLOCK_SIZE, NUM_BLOCKS, seed=2)[0]
    ours = step(model, pool, [(SeqSpec(table, 0, len(ids)), ids)])[0]
    ref = hf_logits(models("llama")[2], ids)
    assert (ours - ref).abs().max() < 0.05 * ref.abs().max()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("kind", ["llama", "qwen2", "mistral"])
def test_cuda_float32_matches_hf_on_cpu(kind):
    model, arch = load_tiny_model(tiny_model_dir(kind), device="cuda")
    ids = prompt()
    pool = torch.zeros(kv_cache_shape(arch, NUM_BLOCKS, BLOCK_SIZE), device="cuda")
    table = scattered_tables([len(ids)], BLOCK_SIZE, NUM_BLOCKS, seed=3)[0]
    outs, start = [], 0
    with torch.inference_mode():
        for n in [11, 1, 1, len(ids) - 13]:
            seqs = [SeqSpec(table, start, n)]
            md = build_metadata(seqs, BLOCK_SIZE, device="cuda")
            TorchAttentionBackend.prepare_metadata(md)
            hidden = model(torch.tensor(ids[start : start + n], device="cuda"), positions_of(seqs).cuda(), pool, md)
            outs.append(model.compute_logits(hidden).cpu())
            start += n
    torch.testing.assert_close(torch.cat(outs), hf_logits(models(kind)[2], ids), atol=1e-3, rtol=1e-3)
