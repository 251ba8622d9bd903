"""How the engine picks a quant method: config.json's quantization_config by default, an explicit
``model.quantization`` when it agrees, and an error naming both when it contradicts the checkpoint."""
from __future__ import annotations

import pytest

from tandem import LLM
from tandem.plugin_manager import get_registry
from tests.helpers.tiny_models import tiny_model_dir
from tests.quant.formats import build_pair


def test_the_builtin_methods_are_registered_under_their_checkpoint_names():
    assert {"unquantized", "gptq", "awq", "fp8", "compressed-tensors"} <= set(get_registry().names("quant_method"))


@pytest.mark.parametrize("fmt,opts", [("gptq", {}), ("awq", {}), ("fp8", {"scales": "channel"})])
def test_auto_takes_the_checkpoints_method(fmt, opts):
    quantized, _ = build_pair("llama", fmt, **opts)
    assert LLM(model=str(quantized), num_kv_blocks=16).engine.executor.worker.quant_method.name == fmt


def test_an_agreeing_explicit_choice_is_accepted():
    quantized, _ = build_pair("llama", "gptq")
    assert LLM(model=str(quantized), num_kv_blocks=16, quantization="gptq").engine.executor.worker.quant_method.name == "gptq"


@pytest.mark.parametrize("choice", ["awq", "none"])
def test_a_contradicting_choice_names_both(choice):
    quantized, _ = build_pair("llama", "gptq")
    with pytest.raises(ValueError, match=r"model.quantization = '(awq|unquantized)' contradicts .* 'gptq'"):
        LLM(model=str(quantized), num_kv_blocks=16, quantization=choice)


def test_a_quantized_method_on_an_unquantized_checkpoint_fails_on_its_weights():
    with pytest.raises(ValueError, match="expected float8_e4m3fn"):
        LLM(model=str(tiny_model_dir("llama")), num_kv_blocks=16, quantization="fp8")
