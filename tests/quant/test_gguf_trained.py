"""``model.quantization = "gguf"`` on the trained checkpoints (SmolLM2-135M-Instruct Q4_1 with a
Q8_0 embedding; Gemma 3 270M Q4_K_M, whose fused projections mix Q5_0 and Q8_0 shards). The
oracle is the same file loaded dequantized (quantization "none", which test_gguf_trained checks
against transformers), float32: greedy tokens identical, logprobs of the chosen tokens equal up
to summation order. One load of each model per quantization for the module."""
from __future__ import annotations

import math

import pytest

from tandem import LLM, SamplingParams
from tandem.models.cpu_linear import PackedLinear
from tests.helpers.gguf_files import dense_trained_llm, registry_gguf

PROMPTS = ["The capital of France is", "Water boils at"]
GREEDY = SamplingParams(temperature=0, max_tokens=12, logprobs=0)


def _run(llm: LLM) -> tuple[list, int]:
    """Greedy outputs of PROMPTS and the model's resident weight bytes (parameters, buffers and
    the CPU kernels' packed copies)."""
    outs = llm.generate(PROMPTS, GREEDY)
    model = llm.engine.executor.worker.model
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}
    tensors |= {id(m.packed.weight): m.packed.weight for m in model.modules()
                if isinstance(getattr(m, "packed", None), PackedLinear)}
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


def test_resident_weights_are_at_most_035_of_the_bfloat16_model(runs):
    """The dense model here is float32: in bfloat16 it holds half its bytes (every tensor is a
    float, the packed copy of its tied LM head included); the packed one keeps the file's blocks
    (Q4_1: 5 bits a weight; both files keep the embedding in Q8_0, 8.5 bits)."""
    _, (_, dense_bytes), (_, packed_bytes) = runs
    assert packed_bytes <= 0.35 * (dense_bytes / 2)
