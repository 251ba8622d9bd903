"""``model.quantization = "gguf"`` on the trained checkpoints (SmolLM2-135M-Instruct Q4_1 with a
Q8_0 embedding; Gemma 3 270M Q4_K_M, whose fused projections mix Q5_0 and Q8_0 shards). The
oracle is the same file loaded dequantized (quantization "none", which test_gguf_trained checks
against transformers), float32: greedy tokens identical, logprobs of the chosen tokens equal up
to summation order. One load of each model per quantization for the module."""
from __future__ import annotations

import math

import gguf
import pytest
import torch

from tandem import LLM, SamplingParams
from tandem.models.cpu_linear import BucketedLinear, PackedLinear
from tests.helpers.gguf_files import dense_trained_llm, registry_gguf

PROMPTS = ["The capital of France is", "Water boils at"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, logprobs=0)


def _run(llm: LLM) -> tuple[list, int]:
    """Greedy outputs of PROMPTS and the model's resident weight bytes (parameters, buffers and
    the CPU kernels' packed copies, each storage once)."""
    outs = llm.generate(PROMPTS, GREEDY)
    model = llm.engine.executor.worker.model
    packed = []
    for m in model.modules():
        p = getattr(m, "packed", None)
        packed += [p] if isinstance(p, PackedLinear) else list(p.by_bucket) if isinstance(p, BucketedLinear) else []
    tensors = {}
    for t in [*model.parameters(), *model.buffers(), *(p.weight for p in packed)]:
        tensors[t.data_ptr() if t.layout == torch.strided else id(t)] = t
    held = sum(t.numel() * t.element_size() for t in tensors.values())
    print(f"{llm.engine.config.model.path} quantization={llm.engine.config.model.quantization}: {held} weight bytes")
    return outs, held


@pytest.fixture(scope="module", params=["smollm2-135m-instruct", "gemma3-270m"])
def runs(request):
    packed = LLM(model=str(registry_gguf(request.param)), num_kv_blocks=32, dtype="float32", quantization="gguf")
    runs = request.param, _run(dense_trained_llm(request.param)), _run(packed)
    del packed
    return runs


def test_greedy_tokens_and_logprobs_equal_the_dequantized_model(runs):
    _, (dense, _), (packed, _) = runs
    assert [o.outputs[0].token_ids for o in packed] == [o.outputs[0].token_ids for o in dense]
    for p, d in zip(packed, dense):
        for lp_p, lp_d, token in zip(p.outputs[0].logprobs, d.outputs[0].logprobs, d.outputs[0].token_ids):
            assert math.isclose(lp_p[token].logprob, lp_d[token].logprob, rel_tol=1e-3, abs_tol=1e-4)
    assert packed[0].outputs[0].text != packed[1].outputs[0].text


def test_resident_weights_are_the_files_blocks(runs):
    """The packed model holds the file's tensors as they are stored (the gguf package's byte
    count of each: Q4_1 is 5 bits a weight, the embeddings' Q8_0 8.5), plus only small buffers
    (rotary frequencies) — nothing dequantized stays resident; the dense float32 load holds
    more than twice as much."""
    name, (_, dense_bytes), (_, packed_bytes) = runs
    file_bytes = sum(int(t.n_bytes) for t in gguf.GGUFReader(str(registry_gguf(name))).tensors)
    assert file_bytes <= packed_bytes <= file_bytes + (1 << 20), (packed_bytes, file_bytes)
    assert dense_bytes > 2 * packed_bytes


def test_bfloat16_packed_decodes_like_the_float32_model(runs):
    """A bfloat16 model kept packed: its decode steps multiply the blocks by bfloat16 activations
    (on AVX512-BF16, kernels/cpu/gguf_dpbf16.cpp; else gguf_matmul.cpp). Oracle: the dequantized
    float32 model; the first tokens agree (bfloat16's rounding moves logprobs by tenths, and
    later tokens may part where the float32 model's choice was close; the kernel's values are
    checked to the bit in tests/kernels/test_gguf_matmul.py)."""
    name, (dense, _), _ = runs
    packed = LLM(model=str(registry_gguf(name)), num_kv_blocks=32, dtype="bfloat16", quantization="gguf")
    outs = packed.generate(PROMPTS, GREEDY)
    for p, d in zip(outs, dense):
        assert p.outputs[0].token_ids[:4] == d.outputs[0].token_ids[:4]
