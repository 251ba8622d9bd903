"""A GGUF file's tensors as the Hugging Face checkpoint they were converted from: HF names,
``[out, in]`` float32 values (every ggml type dequantized by ``gguf.quants.dequantize``), and the
two rewrites llama.cpp's converter made undone:

- Llama (and Mistral) Q and K rows are permuted from HF's rotate-half layout to ggml's
  interleaved rope: within each head, row ``2j + s`` of the file is HF row ``j + s * D/2``.
  ``_unpermute`` takes them back (transformers' GGUF loader does the same)::

      file rows of one head:  q0 q(D/2) q1 q(D/2+1) ...     HF rows:  q0 q1 ... q(D/2-1) q(D/2) ...

- Gemma norms are stored as ``1 + weight`` (ggml's plain RMSNorm); HF keeps ``weight``.

With ``packed=True`` (``model.quantization = "gguf"``, ``tandem.quant.gguf``) a matrix stored in
a block type comes as it is stored instead: ``<name>.ggml_type`` (a 0-d int64 tensor) and
``<name>.qweight``, uint8 ``[rows, blocks, block bytes]``; the Q/K permutation moves whole rows,
so it is undone on the packed rows exactly. Float tensors (F32, F16, BF16) come dequantized.
"""
from __future__ import annotations

import re
from collections.abc import Iterator

import numpy as np
import torch

from tandem.models.gguf_file import GGUFFile

_TOP_LEVEL = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}
_BLOCK = {
    "attn_q": "self_attn.q_proj", "attn_k": "self_attn.k_proj", "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj", "attn_q_norm": "self_attn.q_norm", "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm", "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj", "ffn_up": "mlp.up_proj", "ffn_down": "mlp.down_proj",
}
_GEMMA3_BLOCK = _BLOCK | {"ffn_norm": "pre_feedforward_layernorm", "post_attention_norm": "post_attention_layernorm",
                          "post_ffw_norm": "post_feedforward_layernorm"}
_BLOCK_NAME = re.compile(r"blk\.(\d+)\.(\w+)\.(weight|bias)")
_PERMUTED_ARCHS = ("llama", "mistral")


def hf_name(file: GGUFFile, gguf_name: str) -> str:
    """The HF checkpoint name of the file's tensor ``gguf_name``; ValueError for one that no
    supported architecture has."""
    base, _, suffix = gguf_name.rpartition(".")
    if base in _TOP_LEVEL:
        return f"{_TOP_LEVEL[base]}.{suffix}"
    match = _BLOCK_NAME.fullmatch(gguf_name)
    names = _GEMMA3_BLOCK if file.architecture == "gemma3" else _BLOCK
    if match is None or match[2] not in names:
        raise ValueError(f"{file.path.name}: tensor {gguf_name!r} is not part of a {file.architecture} model")
    return f"model.layers.{match[1]}.{names[match[2]]}.{match[3]}"


def iter_gguf_weights(file: GGUFFile, packed: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
    """Every (HF name, float32 tensor) of the file, one tensor dequantized at a time; with
    ``packed``, the block-type matrices as ``ggml_type`` and ``qweight`` (see the module doc)."""
    from gguf.quants import dequantize

    num_heads = int(file.arch_key("attention.head_count"))
    num_kv_heads = int(file.arch_key("attention.head_count_kv", num_heads))
    for tensor in file.tensors:
        name = hf_name(file, tensor.name)
        keep_blocks = packed and int(tensor.tensor_type) not in _FLOAT_TYPES
        values = tensor.data if keep_blocks else dequantize(tensor.data, tensor.tensor_type)
        if file.architecture in _PERMUTED_ARCHS and name.endswith(("q_proj.weight", "k_proj.weight")):
            values = _unpermute(values, num_heads if "q_proj" in name else num_kv_heads)
        if file.architecture == "gemma3" and name.endswith("norm.weight"):
            values = values - np.float32(1.0)
        if keep_blocks:
            yield from _packed(name, tensor, values)
        else:
            yield name, torch.from_numpy(np.array(values, dtype=np.float32, copy=not values.flags.writeable))


_FLOAT_TYPES = (0, 1, 30)  # F32, F16, BF16


def _packed(name: str, tensor, rows: np.ndarray) -> Iterator[tuple[str, torch.Tensor]]:
    from gguf.constants import GGML_QUANT_SIZES

    values_per_block, block_bytes = GGML_QUANT_SIZES[tensor.tensor_type]
    base = name.removesuffix(".weight")
    blocks = np.array(rows, dtype=np.uint8).reshape(rows.shape[0], -1, block_bytes)
    yield f"{base}.ggml_type", torch.tensor(int(tensor.tensor_type))
    yield f"{base}.qweight", torch.from_numpy(blocks)


def _unpermute(rows: np.ndarray, heads: int) -> np.ndarray:
    out, *rest = rows.shape
    return rows.reshape(heads, out // heads // 2, 2, *rest).swapaxes(1, 2).reshape(rows.shape)


def gguf_weight_count(file: GGUFFile) -> int:
    """Elements of all the file's tensors (each becomes one value of the serving dtype)."""
    return sum(int(t.n_elements) for t in file.tensors)


def gguf_packed_bytes(file: GGUFFile, dtype: torch.dtype) -> int:
    """Bytes of the file's tensors loaded ``packed``: block types as stored, floats in ``dtype``."""
    return sum(int(t.n_elements) * dtype.itemsize if int(t.tensor_type) in _FLOAT_TYPES else int(t.n_bytes)
               for t in file.tensors)
