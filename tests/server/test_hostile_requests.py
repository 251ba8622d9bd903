"""A table of hostile but plausible requests, each with the status it must get — streamed and not —
then the server must still answer a greedy request exactly as the offline oracle does, be
healthy and hold no KV block.

Expected statuses are worked out by hand from the API's rules (docs/api.md, "What a request may
ask"): values vLLM accepts are served (200, the sampler must cope with them); values outside the
documented ranges, NaN/±Infinity, token ids outside the vocabulary, text that is not Unicode,
unknown roles, empty conversations and fields tandem does not implement get a 400 naming the
field. A 400 must be the HTTP status, before any stream starts — never an SSE error event.

The tiny model: vocabulary 512, context 512 tokens (a prompt of 512 with max_tokens 0 fits); the server's KV pool holds 63 blocks of 16,
max_num_seqs 8, max_logprobs 20 (the default). This module runs its own server, so that a
request that kills the engine fails these tests only.
"""
from __future__ import annotations

import json
import math
import time

import httpx
import pytest

from tandem import SamplingParams
from tests.server.server_helpers import running_server, server_config

VOCAB = 512
I64_MAX = 2**63 - 1
I64_MIN = -(2**63)


class Raw:
    """A JSON value written as is (an integer literal Python's json module will not write)."""

    def __init__(self, text: str) -> None:
        self.text = text


def encode(body: dict) -> bytes:
    """``body`` as JSON the way a hostile client may write it: NaN and Infinity as Python's
    json writes them, lone surrogates as ``\\udXXX`` escapes, ``Raw`` values verbatim."""
    raws: dict[str, str] = {}

    def swap(value):
        if isinstance(value, Raw):
            key = f"__raw_{len(raws)}__"
            raws[key] = value.text
            return key
        if isinstance(value, dict):
            return {k: swap(v) for k, v in value.items()}
        if isinstance(value, list):
            return [swap(v) for v in value]
        return value

    text = json.dumps(swap(body), allow_nan=True, ensure_ascii=True)
    for key, raw in raws.items():
        text = text.replace(json.dumps(key), raw)
    return text.encode()


P = {"prompt": "def f(x):", "max_tokens": 4}
CHAT = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
HOT = {"temperature": 1.0, "seed": 7}

# (route, body, status, param): param is the error's "param" (None for a 200)
COMPLETIONS = [
    # --- extreme values vLLM accepts: the sampler must serve them (issue 11, point 2)
    ({**P, "repetition_penalty": 5e-324}, 200, None),
    ({**P, "repetition_penalty": 5e-324, "logprobs": 5}, 200, None),
    ({**P, "repetition_penalty": 1e308}, 200, None),
    ({**P, **HOT, "repetition_penalty": 5e-324}, 200, None),
    ({**P, **HOT, "repetition_penalty": 1e308}, 200, None),
    ({**P, "temperature": 1e-300}, 200, None),
    ({**P, "temperature": 1e300}, 200, None),
    ({**P, "temperature": 5e-324, "seed": 1}, 200, None),
    ({**P, "temperature": 1.7976931348623157e308}, 200, None),
    ({**P, **HOT, "top_p": 5e-324}, 200, None),
    ({**P, **HOT, "top_p": 1e-300, "logprobs": 3}, 200, None),
    ({**P, **HOT, "top_k": 10**9}, 200, None),
    ({**P, **HOT, "top_k": 10**30}, 200, None),
    ({**P, **HOT, "top_k": VOCAB}, 200, None),
    ({**P, **HOT, "top_k": 1}, 200, None),
    ({**P, **HOT, "top_k": -1}, 200, None),
    ({**P, **HOT, "min_p": 1}, 200, None),
    ({**P, **HOT, "min_p": 1.0, "top_p": 5e-324, "top_k": 1}, 200, None),
    ({**P, "temperature": 1e300, "min_p": 1.0}, 200, None),
    ({**P, **HOT, "presence_penalty": 2, "frequency_penalty": 2, "max_tokens": 8}, 200, None),
    ({**P, **HOT, "presence_penalty": -2, "frequency_penalty": -2, "max_tokens": 8}, 200, None),
    ({**P, "temperature": 1e-300, "repetition_penalty": 1e308, "presence_penalty": -2,
      "frequency_penalty": 2, "top_p": 5e-324, "min_p": 1, "top_k": 10**9, "seed": 3,
      "logprobs": 20, "n": 2}, 200, None),
    ({**P, **HOT, "n": 8}, 200, None),
    ({**P, "logprobs": 20}, 200, None),
    ({**P, "logprobs": 20, "echo": True}, 200, None),
    ({**P, "logprobs": 0}, 200, None),
    ({**P, "min_tokens": 4}, 200, None),
    ({**P, "min_tokens": 4, "ignore_eos": True, "stop_token_ids": [0, 1, 2]}, 200, None),
    # --- seeds: signed 64 bits, as vLLM
    ({**P, **HOT, "seed": I64_MAX}, 200, None),
    ({**P, **HOT, "seed": I64_MIN}, 200, None),
    ({**P, **HOT, "seed": 0}, 200, None),
    ({**P, **HOT, "seed": I64_MAX + 1}, 400, "seed"),
    ({**P, **HOT, "seed": I64_MIN - 1}, 400, "seed"),
    ({**P, **HOT, "seed": 2**64}, 400, "seed"),
    ({**P, **HOT, "seed": 10**30}, 400, "seed"),
    ({**P, **HOT, "seed": -(10**30)}, 400, "seed"),
    # --- logprobs up to max_logprobs (20)
    ({**P, "logprobs": 21}, 400, "logprobs"),
    ({**P, "logprobs": 21, "echo": True}, 400, "logprobs"),
    ({**P, "logprobs": 10**30}, 400, "logprobs"),
    ({**P, "logprobs": -1}, 400, "logprobs"),
    # --- min_tokens, max_tokens, n
    ({**P, "min_tokens": 5}, 400, "min_tokens"),
    ({**P, "min_tokens": 10**30}, 400, "min_tokens"),
    ({**P, "min_tokens": 600, "max_tokens": None}, 400, "min_tokens"),
    ({**P, "max_tokens": 10**30}, 400, "max_tokens"),
    ({**P, "max_tokens": 600}, 400, "max_tokens"),
    ({"prompt": [7] * 512, "max_tokens": None}, 400, "prompt"),
    ({**P, "n": 9}, 400, "n"),
    ({**P, "n": 128}, 400, "n"),
    ({**P, "n": 129}, 400, "n"),
    ({**P, "n": 10**30}, 400, "n"),
    ({**P, "n": 8, "max_tokens": 500}, 400, None),  # the KV pool cannot hold 8 x 500 tokens
    # --- token ids: inside the vocabulary [0, 512), never negative
    ({"prompt": [0, VOCAB - 1], "max_tokens": 2}, 200, None),
    ({"prompt": [5, VOCAB], "max_tokens": 2}, 400, "prompt"),
    ({"prompt": [-1], "max_tokens": 2}, 400, "prompt"),
    ({"prompt": [[1, 2], [10**30]], "max_tokens": 2}, 400, "prompt"),
    ({"prompt": [2**63], "max_tokens": 2}, 400, "prompt"),
    ({**P, "stop_token_ids": [VOCAB - 1]}, 200, None),
    ({**P, "stop_token_ids": [VOCAB]}, 400, "stop_token_ids"),
    ({**P, "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ({**P, "stop_token_ids": [2**70]}, 400, "stop_token_ids"),
    ({**P, "stop_token_ids": [1] * 1025}, 400, "stop_token_ids"),
    # --- NaN and ±Infinity, which Python's json parser accepts
    ({**P, "temperature": math.nan}, 400, "temperature"),
    ({**P, "temperature": math.inf}, 400, "temperature"),
    ({**P, "temperature": -math.inf}, 400, "temperature"),
    ({**P, "top_p": math.nan}, 400, "top_p"),
    ({**P, "min_p": math.nan}, 400, "min_p"),
    ({**P, "repetition_penalty": math.inf}, 400, "repetition_penalty"),
    ({**P, "repetition_penalty": math.nan}, 400, "repetition_penalty"),
    ({**P, "presence_penalty": math.nan}, 400, "presence_penalty"),
    ({**P, "frequency_penalty": -math.inf}, 400, "frequency_penalty"),
    ({**P, "top_k": math.inf}, 400, "top_k"),
    ({**P, "max_tokens": math.inf}, 400, "max_tokens"),
    ({**P, "seed": math.nan}, 400, "seed"),
    ({**P, "n": math.inf}, 400, "n"),
    ({**P, "logprobs": math.nan}, 400, "logprobs"),
    ({**P, "priority": math.nan}, 400, "priority"),
    ({**P, "temperature": Raw("1" * 400)}, 400, "temperature"),  # an integer too big for a float
    ({**P, "priority": Raw("9" * 5000)}, 400, None),  # past Python's integer-parsing limit
    # --- priority within server.max_abs_priority (1e6 by default): a client cannot jump every queue
    ({**P, "priority": 1_000_000}, 200, None),
    ({**P, "priority": -1_000_000}, 200, None),
    ({**P, "priority": -1_000_001}, 400, "priority"),
    ({**P, "priority": Raw("-1e30")}, 400, "priority"),
    ({**P, "priority": -(2**63)}, 400, "priority"),
    # --- text that is not valid UTF-8 (lone surrogates)
    ({**P, "prompt": "\ud800"}, 400, "prompt"),
    ({**P, "prompt": ["ok", "a\udfffb"]}, 400, "prompt"),
    ({**P, "stop": ["\ud800"]}, 400, "stop"),
    ({**P, "stop": "x\udc00"}, 400, "stop"),
    ({**P, "user": "\ud83d"}, 400, "user"),
    ({**P, "prompt": "smile \ud83d\ude00"}, 200, None),  # an escaped surrogate pair is one character
    ({**P, "\ud800": 1}, 400, None),
    # --- stop strings: at most 64, of at most 1024 characters
    ({**P, "stop": [f"s{i}" for i in range(64)]}, 200, None),
    ({**P, "stop": [f"s{i}" for i in range(65)]}, 400, "stop"),
    ({**P, "stop": ["z" * 1024]}, 200, None),
    ({**P, "stop": ["z" * 1025]}, 400, "stop"),
    ({**P, "stop": [""]}, 400, "stop"),
    # --- logit_bias: token ids (decimal strings) of the vocabulary, biases in [-100, 100]
    ({**P, "logit_bias": {"5": 100}}, 200, None),
    ({**P, "logit_bias": {"0": -100, str(VOCAB - 1): 100, "7": 1e-300}}, 200, None),
    ({**P, **HOT, "logit_bias": {str(t): 100 for t in range(VOCAB)}}, 200, None),
    ({**P, "logit_bias": {}}, 200, None),
    ({**P, "logit_bias": None}, 200, None),
    ({**P, "logit_bias": {str(VOCAB): 1}}, 400, "logit_bias"),
    ({**P, "logit_bias": {"-1": 1}}, 400, "logit_bias"),
    ({**P, "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ({**P, "logit_bias": {"1.5": 1}}, 400, "logit_bias"),
    ({**P, "logit_bias": {" 5": 1}}, 400, "logit_bias"),
    ({**P, "logit_bias": {"9" * 5000: 1}}, 400, "logit_bias"),
    ({**P, "logit_bias": {"5": 100.5}}, 400, "logit_bias"),
    ({**P, "logit_bias": {"5": -1e308}}, 400, "logit_bias"),
    ({**P, "logit_bias": {"5": math.nan}}, 400, "logit_bias"),
    ({**P, "logit_bias": {"5": math.inf}}, 400, "logit_bias"),
    ({**P, "logit_bias": {"5": Raw("1" * 400)}}, 400, "logit_bias"),
    ({**P, "logit_bias": {"5": "1"}}, 400, "logit_bias"),
    ({**P, "logit_bias": [5]}, 400, "logit_bias"),
    ({**P, "logit_bias": {str(t): 1 for t in range(65537)}}, 400, "logit_bias"),
    # --- allowed_token_ids: a non-empty list of ids of the vocabulary, at most 65536
    ({**P, "allowed_token_ids": [1, 2]}, 200, None),
    ({**P, **HOT, "allowed_token_ids": [VOCAB - 1] * 3, "min_tokens": 4, "stop_token_ids": [VOCAB - 1]},
     200, None),
    ({**P, "allowed_token_ids": list(range(VOCAB)) * 100}, 200, None),
    ({**P, "allowed_token_ids": []}, 400, "allowed_token_ids"),
    ({**P, "allowed_token_ids": [VOCAB]}, 400, "allowed_token_ids"),
    ({**P, "allowed_token_ids": [-1]}, 400, "allowed_token_ids"),
    ({**P, "allowed_token_ids": [2**70]}, 400, "allowed_token_ids"),
    ({**P, "allowed_token_ids": [1] * 65537}, 400, "allowed_token_ids"),
    # --- bad_words: at most 128 words of at most 1024 characters, not blank
    ({**P, "bad_words": ["def", " return", "x"]}, 200, None),
    ({**P, **HOT, "bad_words": [chr(c) for c in range(33, 127)]}, 200, None),
    ({**P, "bad_words": ["z" * 1024]}, 200, None),
    ({**P, "bad_words": []}, 200, None),
    ({**P, "bad_words": [""]}, 400, "bad_words"),
    ({**P, "bad_words": [" \n"]}, 400, "bad_words"),
    ({**P, "bad_words": ["z" * 1025]}, 400, "bad_words"),
    ({**P, "bad_words": [f"w{i}" for i in range(129)]}, 400, "bad_words"),
    ({**P, "bad_words": [5]}, 400, "bad_words"),
    ({**P, "bad_words": ["\ud800"]}, 400, "bad_words"),
    # --- prompt logprobs and prompt-only requests (max_tokens 0; streams take prompt_logprobs 0)
    ({**P, "prompt_logprobs": 0}, 200, None),
    ({**P, "prompt_logprobs": None}, 200, None),
    ({**P, "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ({**P, "prompt_logprobs": -1}, 400, "prompt_logprobs"),
    ({**P, "prompt_logprobs": 10**30}, 400, "prompt_logprobs"),
    ({**P, "max_tokens": 0}, 200, None),
    ({**P, "max_tokens": 0, "echo": True, "logprobs": 20}, 200, None),
    ({**P, **HOT, "max_tokens": 0, "echo": True, "logprobs": 1, "n": 8, "prompt_logprobs": 0}, 200, None),
    ({"prompt": [7] * 512, "max_tokens": 0, "echo": True, "logprobs": 0}, 200, None),
    ({**P, "max_tokens": 0, "min_tokens": 1}, 400, "min_tokens"),
    ({**P, "max_tokens": -1}, 400, "max_tokens"),
    # --- fields tandem does not implement: a 400 unless neutral
    ({**P, "best_of": 3}, 400, "best_of"),
    ({**P, "best_of": 1}, 200, None),
    ({**P, **HOT, "best_of": 2, "n": 2}, 200, None),
    ({**P, **HOT, "best_of": 1, "n": 2}, 400, "best_of"),
    ({**P, "suffix": "return x"}, 400, "suffix"),
    ({**P, "suffix": ""}, 200, None),
    ({**P, "suffix": None}, 200, None),
    ({**P, "guided_json": {"type": "object"}}, 400, "guided_json"),
    ({**P, "guided_regex": "a+"}, 400, "guided_regex"),
    ({**P, "guided_choice": ["yes", "no"]}, 400, "guided_choice"),
    ({**P, "guided_grammar": "root ::= 'a'"}, 400, "guided_grammar"),
    ({**P, "guided_decoding_backend": "xgrammar"}, 400, "guided_decoding_backend"),
    ({**P, "guided_whitespace_pattern": " "}, 400, "guided_whitespace_pattern"),
    ({**P, "guided_json": None}, 200, None),
    ({**P, "structured_outputs": {"regex": "a+("}}, 400, "structured_outputs"),
    ({**P, "structured_outputs": {"regex": "a" * 100_000}}, 400, "structured_outputs.regex"),
    ({**P, "structured_outputs": {"json": {"type": "object", "properties": {"a": {"$ref": "#/nowhere"}}}}}, 400,
     "structured_outputs"),
    ({**P, "structured_outputs": {"choice": ["a", 1]}}, 400, "structured_outputs.choice"),
    ({**P, "structured_outputs": "a+"}, 400, "structured_outputs"),
    ({**P, "logits_processors": ["my.Processor"]}, 400, "logits_processors"),
    ({**P, "use_beam_search": True}, 400, "use_beam_search"),
    ({**P, "truncate_prompt_tokens": 2}, 400, "truncate_prompt_tokens"),
    ({**P, "add_special_tokens": False}, 400, "add_special_tokens"),
    ({**P, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400,
     "response_format"),
    ({**P, "response_format": {"type": "json_object"}, "max_tokens": 8}, 200, None),
    ({**P, "frobnicate": {"deep": [1, 2]}, "x-trace": "abc"}, 200, None),  # unknown: ignored
]

CHAT_ROWS = [
    # --- extreme values vLLM accepts
    ({**CHAT, "repetition_penalty": 5e-324}, 200, None),
    ({**CHAT, **HOT, "repetition_penalty": 1e308}, 200, None),
    ({**CHAT, "temperature": 1e-300}, 200, None),
    ({**CHAT, "temperature": 1e300, "top_p": 5e-324}, 200, None),
    ({**CHAT, **HOT, "top_k": 10**9, "min_p": 1}, 200, None),
    ({**CHAT, "logprobs": True, "top_logprobs": 20}, 200, None),
    ({**CHAT, "logprobs": True, "top_logprobs": 20, "repetition_penalty": 5e-324}, 200, None),
    ({**CHAT, **HOT, "logprobs": True, "top_logprobs": 20, "top_p": 5e-324}, 200, None),
    ({**CHAT, "logprobs": True, "top_logprobs": 21}, 400, "top_logprobs"),
    ({**CHAT, **HOT, "seed": I64_MIN, "n": 2}, 200, None),
    ({**CHAT, "seed": 2**64}, 400, "seed"),
    ({**CHAT, "min_tokens": 5}, 400, "min_tokens"),
    ({**CHAT, "max_tokens": None, "max_completion_tokens": 2, "min_tokens": 3}, 400, "min_tokens"),
    ({**CHAT, "max_tokens": None, "min_tokens": 10**6}, 400, "min_tokens"),
    ({**CHAT, "max_tokens": None, "max_completion_tokens": 600}, 400, "max_completion_tokens"),
    ({**CHAT, "n": 9}, 400, "n"),
    ({**CHAT, "temperature": math.nan}, 400, "temperature"),
    ({**CHAT, "top_p": math.inf}, 400, "top_p"),
    ({**CHAT, "max_completion_tokens": math.inf}, 400, "max_completion_tokens"),
    ({**CHAT, "stop_token_ids": [VOCAB]}, 400, "stop_token_ids"),
    ({**CHAT, "stop": ["\udbff"]}, 400, "stop"),
    # --- messages: roles, content, something to answer
    ({**CHAT, "messages": [{"role": r, "content": f"a {r} says hi"}
                           for r in ("system", "developer", "user", "assistant", "tool", "user")]},
     200, None),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}]}, 200, None),
    ({**CHAT, "messages": [{"role": "user", "content": " "}]}, 200, None),
    ({**CHAT, "messages": [{"role": "system", "content": ""}, {"role": "user", "content": "hi"}]},
     200, None),
    ({**CHAT, "messages": [{"role": "user", "content": "hi", "name": "bob"}]}, 200, None),
    ({**CHAT, "messages": []}, 400, "messages"),
    ({**CHAT, "messages": "hi"}, 400, "messages"),
    ({**CHAT, "messages": [{"role": "user"}]}, 400, "messages"),
    ({**CHAT, "messages": [{"role": "user", "content": None}]}, 400, "messages"),
    ({**CHAT, "messages": [{"content": "hi"}]}, 400, "messages"),
    ({**CHAT, "messages": [{"role": "robot", "content": "hi"}]}, 400, "messages"),
    ({**CHAT, "messages": [{"role": "function", "content": "hi", "name": "f"}]}, 400, "messages"),
    ({**CHAT, "messages": [{"role": "USER", "content": "hi"}]}, 400, "messages"),
    ({**CHAT, "messages": [{"role": "user", "content": ""}]}, 400, "messages"),
    ({**CHAT, "messages": [{"role": "system", "content": ""}, {"role": "user", "content": []}]},
     400, "messages"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": ""}]}]},
     400, "messages"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": ""},
                                                         {"type": "text", "text": ""}]}]},
     400, "messages"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "image_url",
                                                          "image_url": {"url": "x"}}]}]},
     400, "messages"),
    ({**CHAT, "messages": [{"role": "user", "content": 5}]}, 400, "messages"),
    ({**CHAT, "messages": [{"role": "user", "content": "\ud800"}]}, 400, "messages"),
    ({**CHAT, "messages": [{"role": "user", "content": [{"type": "text", "text": "a\udc00"}]}]},
     400, "messages"),
    ({**CHAT, "messages": [{"role": "user", "content": "hi", "name": "\udc00"}]}, 400, "messages"),
    ({**CHAT, "messages": [{"role": "user", "content": "hi"},
                           {"role": "assistant", "content": None,
                            "tool_calls": [{"id": "1", "type": "function",
                                            "function": {"name": "f", "arguments": "{}"}}]},
                           {"role": "tool", "content": "1", "tool_call_id": "1"}]},
     200, None),
    ({**CHAT, "messages": [{"role": "user", "content": "hi"},
                           {"role": "assistant", "content": "",
                            "tool_calls": [{"id": "1", "type": "function",
                                            "function": {"name": "f", "arguments": "{nope"}}]}]},
     400, "messages"),
    ({**CHAT, "messages": [{"role": "user", "content": "hi"},
                           {"role": "assistant", "tool_calls": [{"id": "1", "function": {"name": "f"}}]}]},
     400, "messages"),
    ({**CHAT, "messages": [{"role": "user", "content": None}]}, 400, "messages"),
    # --- tools
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": {}}}]},
     400, "tool_choice"),  # unset means "auto", which this server does not serve
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "none"},
     200, None),
    ({**CHAT, "tools": []}, 200, None),
    ({**CHAT, "tools": [], "tool_choice": "required"}, 200, None),
    ({**CHAT, "tool_choice": "required"}, 400, "tool_choice"),
    ({**CHAT, "tool_choice": {"type": "function", "function": {"name": "f"}}}, 400, "tool_choice"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}],
      "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "tool_choice"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "sometimes"},
     400, "tool_choice"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": "required",
      "response_format": {"type": "json_object"}}, 400, "tool_choice"),
    ({**CHAT, "tools": [{"type": "function", "function": {"description": "no name"}}]}, 400, "tools"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": "f", "parameters": [1]}}]}, 400, "tools"),
    ({**CHAT, "tools": [{"type": "retrieval"}]}, 400, "tools"),
    ({**CHAT, "tools": {"f": 1}}, 400, "tools"),
    ({**CHAT, "tool_choice": "none"}, 200, None),
    ({**CHAT, "tool_choice": "auto"}, 200, None),
    # --- fields tandem does not implement
    ({**CHAT, "functions": [{"name": "f", "parameters": {}}]}, 400, "functions"),
    ({**CHAT, "function_call": {"name": "f"}}, 400, "function_call"),
    ({**CHAT, "function_call": "none", "functions": []}, 200, None),
    ({**CHAT, "logit_bias": {"5": -100}}, 200, None),
    ({**CHAT, "logit_bias": {"x": -100}}, 400, "logit_bias"),
    ({**CHAT, "allowed_token_ids": [5, 6]}, 200, None),
    ({**CHAT, "allowed_token_ids": [VOCAB]}, 400, "allowed_token_ids"),
    ({**CHAT, "bad_words": ["hi"]}, 200, None),
    ({**CHAT, "bad_words": [""]}, 400, "bad_words"),
    ({**CHAT, "prompt_logprobs": 0}, 200, None),
    ({**CHAT, "prompt_logprobs": 21}, 400, "prompt_logprobs"),
    ({**CHAT, "max_tokens": 0}, 400, "max_tokens"),
    ({**CHAT, "guided_choice": ["a", "b"]}, 400, "guided_choice"),
    ({**CHAT, "structured_outputs": {"json": []}}, 400, "structured_outputs.json"),
    ({**CHAT, "response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, 400,
     "response_format"),
    ({**CHAT, "response_format": {"type": "json_object"}, "max_tokens": 8}, 200, None),
    ({**CHAT, "continue_final_message": True}, 400, "continue_final_message"),
    ({**CHAT, "chat_template": "{{ messages }}"}, 400, "chat_template"),
    ({**CHAT, "chat_template_kwargs": {"enable_thinking": True}}, 400, "chat_template_kwargs"),
    ({**CHAT, "echo": True}, 400, "echo"),
    ({**CHAT, "modalities": ["text", "audio"]}, 400, "modalities"),
    ({**CHAT, "modalities": ["text"]}, 200, None),
    ({**CHAT, "best_of": 2}, 400, "best_of"),
    ({**CHAT, "parallel_tool_calls": False, "store": False, "metadata": {"a": "b"}}, 200, None),
]

ROWS = [("completions", *row) for row in COMPLETIONS] + [("chat/completions", *row) for row in CHAT_ROWS]


@pytest.fixture(scope="module")
def hostile_server(model_dir):
    """A server of its own (same engine settings as the offline oracle)."""
    with running_server(server_config(model_dir, served_model_name="tiny")) as srv:
        yield srv


def _check_error(response: httpx.Response, param: str | None) -> None:
    assert response.headers["content-type"].startswith("application/json"), response.headers
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param, error
    assert error["message"]
    if param is not None:
        assert param in error["message"], error


def _num_choices(route: str, body: dict) -> int:
    prompt = body.get("prompt")
    prompts = len(prompt) if isinstance(prompt, list) and prompt and not isinstance(prompt[0], int) else 1
    return body.get("n", 1) * (prompts if route == "completions" else 1)


def _check_served(route: str, body: dict, response: httpx.Response) -> None:
    out = response.json()
    assert [c["index"] for c in out["choices"]] == list(range(_num_choices(route, body)))
    for choice in out["choices"]:
        assert choice["finish_reason"] in ("length", "stop"), choice
        lp = choice["logprobs"]
        if route == "completions" and body.get("logprobs") is not None:
            assert all(math.isfinite(v) and v <= 0 for v in lp["token_logprobs"] if v is not None)
            assert all(math.isfinite(v) for top in lp["top_logprobs"] if top for v in top.values())
        if route == "chat/completions" and body.get("logprobs"):
            for entry in lp["content"]:
                assert math.isfinite(entry["logprob"]) and entry["logprob"] <= 0
                assert len(entry["top_logprobs"]) == body.get("top_logprobs", 0)
                assert all(math.isfinite(t["logprob"]) for t in entry["top_logprobs"])
    max_tokens = body.get("max_completion_tokens") or body.get("max_tokens") or 512
    assert out["usage"]["completion_tokens"] <= max_tokens * len(out["choices"])


def _check_streamed(route: str, body: dict, response: httpx.Response) -> None:
    assert response.headers["content-type"].startswith("text/event-stream")
    events = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all("error" not in c for c in chunks), chunks
    finished = {c["index"] for chunk in chunks for c in chunk["choices"] if c["finish_reason"] is not None}
    assert finished == set(range(_num_choices(route, body)))


@pytest.mark.parametrize("stream", [False, True], ids=["plain", "stream"])
@pytest.mark.parametrize("route, body, status, param", ROWS,
                         ids=[f"{r.split('/')[0]}-{i}" for i, (r, *_) in enumerate(ROWS)])
def test_hostile_request(hostile_server, route, body, status, param, stream):
    body = {**body, "stream": True} if stream else body
    with httpx.stream("POST", f"{hostile_server.url}/v1/{route}", content=encode(body), timeout=60,
                      headers={"content-type": "application/json"}) as response:
        response.read()
    assert response.status_code == status, response.text[:2000]
    if status != 200:
        _check_error(response, param)
    elif stream:
        _check_streamed(route, body, response)
    else:
        _check_served(route, body, response)


def test_the_server_is_unharmed_after_the_table(hostile_server, offline):
    """Runs after the table (pytest keeps the file's order): same greedy text as the offline
    oracle, healthy, every KV block back."""
    want = offline.generate("def main():", SamplingParams(temperature=0, max_tokens=24))[0].outputs[0]
    response = httpx.post(f"{hostile_server.url}/v1/completions", timeout=60,
                          json={"prompt": "def main():", "max_tokens": 24, "temperature": 0})
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["text"] == want.text
    assert httpx.get(f"{hostile_server.url}/health").status_code == 200
    kv = hostile_server.engine._engine.scheduler.kv
    deadline = time.monotonic() + 10
    while kv.stats().num_used_blocks and time.monotonic() < deadline:
        time.sleep(0.05)
    assert kv.stats().num_used_blocks == 0


def test_the_encoder_writes_what_a_hostile_client_sends():
    """The table's bodies reach the server as the literals the rows describe."""
    raw = encode({"t": math.nan, "u": -math.inf, "s": "\ud800", "r": Raw("1" * 5)}).decode()
    assert raw == '{"t": NaN, "u": -Infinity, "s": "\\ud800", "r": 11111}'
