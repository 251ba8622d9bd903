"""Train a byte-level BPE tokenizer locally, with no download: the corpus is the running
interpreter's own standard library (``Lib/*.py``), a fixed sorted subset, so a given Python build
always yields the same tokenizer.

The tokenizer adds ``<|bos|>`` in front of every encoded text and ships a Llama-3-like chat
template (with tool calling, ``CHAT_TEMPLATE``) that itself starts with ``<|bos|>``: tokenize a rendered chat with
``add_special_tokens=False`` (as ``apply_chat_template(tokenize=True)`` does).
"""
from __future__ import annotations

import sysconfig
from collections.abc import Iterator, Sequence
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
from transformers import PreTrainedTokenizerFast

BOS = "<|bos|>"
EOS = "<|eos|>"
PAD = "<|pad|>"
START_HEADER = "<|start_header|>"
END_HEADER = "<|end_header|>"
EOT = "<|eot|>"
SPECIAL_TOKENS = (BOS, EOS, PAD, START_HEADER, END_HEADER, EOT)

CHAT_TEMPLATE = (
    "{{- bos_token -}}"
    "{%- if tools -%}"
    "{{- '" + START_HEADER + "system" + END_HEADER + "\\n\\n' -}}"
    "{%- if messages[0]['role'] == 'system' -%}{{- messages[0]['content'] + '\\n\\n' -}}{%- endif -%}"
    "{{- '# Tools\\n<tools>' -}}"
    "{%- for tool in tools -%}{{- '\\n' + (tool | tojson) -}}{%- endfor -%}"
    "{{- '\\n</tools>\\nTo call one, write <tool_call>{\"name\": ..., \"arguments\": {...}}</tool_call>"
    + EOT + "' -}}"
    "{%- endif -%}"
    "{%- for message in messages -%}"
    "{%- if tools and loop.first and message['role'] == 'system' -%}"
    "{%- elif message['role'] == 'tool' -%}"
    "{%- if loop.first or messages[loop.index0 - 1]['role'] != 'tool' -%}"
    "{{- '" + START_HEADER + "user" + END_HEADER + "\\n\\n' -}}"
    "{%- else -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_response>\\n' + message['content'] + '\\n</tool_response>' -}}"
    "{%- if loop.last or messages[loop.index0 + 1]['role'] != 'tool' -%}{{- '" + EOT + "' -}}{%- endif -%}"
    "{%- else -%}"
    "{{- '" + START_HEADER + "' + message['role'] + '" + END_HEADER + "\\n\\n' + message['content'] -}}"
    "{%- for call in message['tool_calls'] or [] -%}"
    "{%- if message['content'] or not loop.first -%}{{- '\\n' -}}{%- endif -%}"
    "{{- '<tool_call>\\n{\"name\": \"' + call['function']['name'] + '\", \"arguments\": ' "
    "+ (call['function']['arguments'] | tojson) + '}\\n</tool_call>' -}}"
    "{%- endfor -%}"
    "{{- '" + EOT + "' -}}"
    "{%- endif -%}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '" + START_HEADER + "assistant" + END_HEADER + "\\n\\n' -}}"
    "{%- endif -%}"
)
"""A Llama-3-like template with Qwen-style tools: given ``tools``, a system turn lists them as
JSON in a ``<tools>`` block (after the system message's own text) and says how to call them;
an assistant's ``tool_calls`` (arguments as values, rendered with ``tojson``) follow its
content as ``<tool_call>{"name": ..., "arguments": ...}</tool_call>``; consecutive ``tool``
messages form one user turn of ``<tool_response>`` blocks. Without tools, tool calls or tool
messages it renders as a plain Llama-3-like chat."""


def stdlib_corpus_files(max_files: int | None = None) -> list[Path]:
    """The interpreter's ``Lib/*.py`` files, sorted by name; the first ``max_files`` of them."""
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    if not files:
        raise FileNotFoundError("the Python standard library sources (Lib/*.py) are not installed")
    return files[:max_files]


def _read_texts(files: Sequence[Path]) -> Iterator[str]:
    for f in files:
        yield f.read_text(encoding="utf-8", errors="replace")


def train_bpe_tokenizer(vocab_size: int, files: Sequence[Path]) -> PreTrainedTokenizerFast:
    """A byte-level BPE of exactly ``vocab_size`` entries (the 6 special tokens first, ids 0..5)
    trained on ``files``. Raises ValueError when the corpus is too small to reach that size."""
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_read_texts(files), trainer)
    if tok.get_vocab_size() != vocab_size:
        raise ValueError(f"the corpus yields only {tok.get_vocab_size()} tokens, {vocab_size} wanted")
    bos_id = tok.token_to_id(BOS)
    tok.post_processor = processors.TemplateProcessing(
        single=f"{BOS} $A", pair=f"{BOS} $A {BOS} $B", special_tokens=[(BOS, bos_id)]
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD)
    fast.chat_template = CHAT_TEMPLATE
    return fast
