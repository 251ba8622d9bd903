"""Registers tandem's built-in quantization methods (entry point ``builtin_quant``): the
unquantized default and the checkpoint formats GPTQ, AWQ, FP8 and compressed-tensors FP8, each
under the ``quant_method`` name its checkpoints' quantization_config carries, and ``gguf``
(a GGUF file's blocks kept quantized; chosen by ``model.quantization`` only)."""
from __future__ import annotations

from collections.abc import Callable

import tandem
from tandem.quant.awq import AWQLinearMethod
from tandem.quant.compressed_tensors import CompressedTensorsFP8Method
from tandem.quant.fp8 import FP8LinearMethod
from tandem.quant.gguf import GGUFLinearMethod
from tandem.quant.gptq import GPTQLinearMethod
from tandem.quant.unquantized import UnquantizedLinearMethod


@tandem.hookimpl
def tandem_register_quant_methods(register: Callable[[str, type], None]) -> None:
    register("unquantized", UnquantizedLinearMethod)
    register("gptq", GPTQLinearMethod)
    register("awq", AWQLinearMethod)
    register("fp8", FP8LinearMethod)
    register("compressed-tensors", CompressedTensorsFP8Method)
    register("gguf", GGUFLinearMethod)
