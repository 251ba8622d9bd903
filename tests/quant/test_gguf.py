"""``model.quantization = "gguf"``: a GGUF file's blocks kept packed (tandem.quant.gguf). Oracles:
gguf's numpy ``dequantize`` for the blocks, and the same file loaded dequantized (quantization
"none", the path test_gguf_tiny checks against transformers) for the whole model."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType as Q
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import dequantize

from tandem import LLM, SamplingParams
from tandem.config import ConfigError
from tandem.interfaces import TensorSplit
from tandem.models.layers import LinearLayer
from tandem.models.loader import load_model
from tandem.plugins.attention_torch import TorchAttentionBackend
from tandem.quant.gguf import GGUFLinearMethod
from tandem.quant.gguf_blocks import BLOCKS, dequantize_rows
from tandem.quant.unquantized import UnquantizedLinearMethod
from tests.helpers.gguf_files import write_tiny_gguf
from tests.helpers.tiny_models import builtin_registry
from tests.models.test_gguf_tiny import PROMPTS, TYPES
from tests.quant.oracle import tandem_logits

NEW_TOKENS = 10


def _random_rows(ggml_type: int, rows: int, in_features: int, seed: int = 0) -> np.ndarray:
    """Rows of random bytes: every bit pattern of every field, scales included."""
    values, size = GGML_QUANT_SIZES[Q(ggml_type)]
    return np.random.default_rng(seed).integers(0, 256, (rows, in_features // values * size), dtype=np.uint8)


def _blocks(rows: np.ndarray, ggml_type: int) -> torch.Tensor:
    """The loader's ``qweight``: uint8 [rows, blocks, block bytes]."""
    return torch.from_numpy(rows.reshape(rows.shape[0], -1, GGML_QUANT_SIZES[Q(ggml_type)][1]).copy())


@pytest.mark.parametrize("ggml_type", sorted(BLOCKS), ids=lambda t: Q(t).name)
def test_torch_dequantizer_is_bit_identical_to_gguf_numpy(ggml_type):
    assert BLOCKS[ggml_type] == GGML_QUANT_SIZES[Q(ggml_type)]
    rows = _random_rows(ggml_type, 6, 512)
    with np.errstate(all="ignore"):  # random scales include NaN and inf bit patterns
        want = dequantize(rows, Q(ggml_type))
    np.testing.assert_array_equal(dequantize_rows(torch.from_numpy(rows), ggml_type, 512).numpy(), want)


# byte offsets of each type's float16 scales (d, then m/dmin where there is one)
_SCALE_OFFSETS = {Q.Q4_0: (0,), Q.Q4_1: (0, 2), Q.Q5_0: (0,), Q.Q5_1: (0, 2), Q.Q8_0: (0,), Q.Q2_K: (80, 82),
                  Q.Q3_K: (108,), Q.Q4_K: (0, 2), Q.Q5_K: (0, 2), Q.Q6_K: (208,)}


def _finite_rows(ggml_type: int, rows: int, in_features: int, seed: int) -> np.ndarray:
    """Random blocks whose float16 scales are set to small positive values: finite weights."""
    data = _random_rows(ggml_type, rows, in_features, seed)
    blocks = data.reshape(rows, -1, GGML_QUANT_SIZES[Q(ggml_type)][1])
    rng = np.random.default_rng(seed + 1)
    for offset in _SCALE_OFFSETS[Q(ggml_type)]:
        scales = rng.uniform(0.01, 0.1, blocks.shape[:2]).astype(np.float16)
        blocks[:, :, offset:offset + 2] = scales.view(np.uint8).reshape(*blocks.shape[:2], 2)
    return data


def _assert_close_f32(got: torch.Tensor, want: torch.Tensor, layers: int = 1) -> None:
    """Equal up to float32 summation order (the kernels sum in another order than F.linear, and
    MKL's own order moves with the threads it takes on a loaded machine), compounded over
    ``layers`` layers of a model."""
    tol = 1e-5 * layers
    torch.testing.assert_close(got, want, rtol=tol, atol=tol * float(want.abs().max()))


def _layer(input_size: int, shards: list[tuple[int, int]], splits=None) -> tuple[LinearLayer, torch.Tensor]:
    """A fused GGUF layer of shards (ggml type or 0 for F32, rows), loaded; and its weight as
    gguf dequantizes it (whole, before any split)."""
    layer = LinearLayer(input_size, [n for _, n in shards], False, GGUFLinearMethod(), splits)
    weights = []
    for shard, (ggml_type, n) in enumerate(shards):
        if ggml_type == 0:
            weight = torch.randn(n, input_size)
            layer.load("weight", weight, shard)
        else:
            rows = _finite_rows(ggml_type, n, input_size, seed=shard)
            weight = torch.from_numpy(dequantize(rows, Q(ggml_type)))
            layer.load("ggml_type", torch.tensor(ggml_type), shard)
            layer.load("qweight", _blocks(rows, ggml_type), shard)
        weights.append(weight)
    layer.quant_method.process_weights_after_loading(layer)
    return layer, torch.cat(weights)


def test_a_fused_layer_with_shards_of_different_types_computes_each_with_its_own():
    layer, weight = _layer(512, [(Q.Q4_K, 64), (Q.Q4_K, 32), (Q.Q6_K, 32), (0, 16), (Q.Q8_0, 8)])
    # adjacent shards of one type share a part: q+k Q4_K, v Q6_K, then the F32 and Q8_0 shards
    assert [(p.ggml_type, p.start, p.size) for p in layer.gguf_parts] == [
        (Q.Q4_K, 0, 96), (Q.Q6_K, 96, 32), (None, 128, 16), (Q.Q8_0, 144, 8)]
    x = torch.randn(5, 512)
    _assert_close_f32(layer(x), torch.nn.functional.linear(x, weight))


def test_the_layer_keeps_the_file_bytes_only():
    layer, _ = _layer(256, [(Q.Q4_0, 64), (Q.Q4_0, 64)])
    held = sum(t.numel() * t.element_size() for t in list(layer.parameters()) + list(layer.buffers()))
    assert held == 128 * 256 // 32 * 18


@pytest.mark.parametrize("ggml_type", [Q.Q4_0, Q.Q6_K], ids=lambda t: t.name)
def test_tensor_parallel_ranks_hold_their_rows_and_inputs(ggml_type):
    """Column split: each rank's outputs; row split: each rank's inputs, whole blocks (the
    dequantized halves equal the halves of the dequantized whole)."""
    rows = _finite_rows(ggml_type, 8, 1024, seed=1)
    whole = torch.from_numpy(dequantize(rows, ggml_type))
    method = GGUFLinearMethod()
    for index in range(2):
        out = method.split_tensor("qweight", _blocks(rows, ggml_type), TensorSplit("output", 2, index), 8)
        assert torch.equal(dequantize_rows(out.reshape(4, -1), ggml_type, 1024), whole[4 * index:4 * index + 4])
        inp = method.split_tensor("qweight", _blocks(rows, ggml_type), TensorSplit("input", 2, index), 1024)
        assert torch.equal(dequantize_rows(inp.reshape(8, -1), ggml_type, 512), whole[:, 512 * index:512 * index + 512])
    layer, weight = _layer(1024, [(ggml_type, 8)], [TensorSplit("input", 2, 1)])
    x = torch.randn(3, 512)
    _assert_close_f32(layer.quant_method.apply(layer, x), torch.nn.functional.linear(x, weight[:, 512:]))


def test_an_input_split_inside_a_block_is_refused_naming_the_tensor():
    rows = _random_rows(Q.Q4_K, 4, 256)
    with pytest.raises(ValueError, match=r"qweight of shape \(4, 1, 144\): 256 inputs in 1 blocks of 256 do not "
                                         r"split into 2 parts of whole blocks"):
        GGUFLinearMethod().split_tensor("qweight", _blocks(rows, Q.Q4_K), TensorSplit("input", 2, 0), 256)


def test_a_type_without_support_is_refused_by_name():
    layer = LinearLayer(256, [4], False, GGUFLinearMethod())
    layer.load("ggml_type", torch.tensor(int(Q.IQ4_XS)), 0)
    layer.load("qweight", torch.zeros(4, 1, 136, dtype=torch.uint8), 0)
    with pytest.raises(ValueError, match=r"ggml type 23 blocks are not supported; supported: Q4_0, Q4_1"):
        layer.quant_method.process_weights_after_loading(layer)


def test_gguf_quantization_of_a_folder_checkpoint_is_a_config_error():
    with pytest.raises(ConfigError, match=r"model.quantization = 'gguf' keeps a GGUF file's blocks: it needs "
                                          r"model.path to be a .gguf file"):
        LLM(model="demo", quantization="gguf", num_kv_blocks=16)


@pytest.fixture(scope="module")
def gguf_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("gguf")
    for kind, types in TYPES.items():
        write_tiny_gguf(root / f"{kind}.gguf", kind, types)
    return root


def _load(path, method):
    return load_model(path, dtype=torch.float32, device=torch.device("cpu"), registry=builtin_registry(),
                      attn_backend_cls=TorchAttentionBackend, quant_method=method)


@pytest.mark.parametrize("kind", list(TYPES))
def test_logits_and_greedy_tokens_equal_the_dequantized_model(gguf_dir, kind):
    path = gguf_dir / f"{kind}.gguf"
    packed, arch = _load(path, GGUFLinearMethod())
    dense, _ = _load(path, UnquantizedLinearMethod())
    assert type(packed.model.embed_tokens).__name__ == "QuantizedEmbedding"
    for ids in PROMPTS:
        want = tandem_logits(dense, arch, ids)
        _assert_close_f32(tandem_logits(packed, arch, ids), want, layers=arch.num_hidden_layers)
    greedy = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
    outs = {q: [o.outputs[0].token_ids for o in LLM(model=str(path), num_kv_blocks=32, dtype="float32", num_threads=1,
                                                    quantization=q).generate(PROMPTS, greedy)]
            for q in ("none", "gguf")}
    assert outs["gguf"] == outs["none"]
    assert outs["gguf"][0] != outs["gguf"][1]
