"""tandem.server.validation without a server: the log of unknown fields (one line per name a
minute, bounded under a fuzzer), driven by a fake clock, and the body checks on parsed models."""
from __future__ import annotations

import logging

import pytest
from pydantic import ValidationError

from tandem.server.errors import APIError
from tandem.server.protocol import ChatCompletionRequest, CompletionRequest
from tandem.server.validation import UnknownFieldLog, check_body, check_messages, unknown_fields


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _lines(caplog) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name == "tandem.server"]


def test_a_name_is_logged_once_a_minute(caplog):
    clock = Clock()
    log = UnknownFieldLog(clock=clock)
    with caplog.at_level(logging.WARNING, logger="tandem.server"):
        log.log("/v1/completions", ["frob", "zap"])
        clock.now += 30
        log.log("/v1/completions", ["frob"])
        clock.now += 29.9
        log.log("/v1/completions", ["frob", "zap"])
        assert len(_lines(caplog)) == 2
        clock.now += 0.2  # 60.1 s after the first line
        log.log("/v1/completions", ["frob"])
    lines = _lines(caplog)
    assert len(lines) == 3
    assert "'frob'" in lines[0] and "'zap'" in lines[1] and "'frob'" in lines[2]


def test_a_fuzzer_gets_at_most_max_lines_a_minute_then_one_summary(caplog):
    clock = Clock()
    log = UnknownFieldLog(max_lines=5, clock=clock)
    with caplog.at_level(logging.WARNING, logger="tandem.server"):
        for i in range(1000):
            log.log("/v1/completions", [f"random_{i}"])
            clock.now += 0.01
        assert len(_lines(caplog)) == 5
        clock.now += 60
        log.log("/v1/completions", ["random_0"])
    lines = _lines(caplog)
    assert len(lines) == 7
    assert "995 more unknown field names" in lines[5]
    assert "'random_0'" in lines[6]


def test_names_are_logged_as_ascii_and_cut(caplog):
    with caplog.at_level(logging.WARNING, logger="tandem.server"):
        UnknownFieldLog(clock=Clock()).log("/v1/chat/completions", ["\ud800\n" + "y" * 100])
    (line,) = _lines(caplog)
    assert "'\\ud800\\n" in line and "y" * 62 + "'…" in line and "y" * 63 not in line


def test_unimplemented_fields_are_not_unknown():
    body = CompletionRequest.model_validate({"prompt": "x", "best_of": 1, "suffix": "", "zap": 1})
    assert unknown_fields(body, "/v1/completions") == ["zap"]
    chat = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                 "tools": [], "suffix": "s"})
    assert unknown_fields(chat, "/v1/chat/completions") == ["suffix"]  # no suffix in chat


@pytest.mark.parametrize("extra, param", [
    ({"best_of": 2}, "best_of"), ({"best_of": True}, "best_of"), ({"suffix": "s"}, "suffix"),
    ({"use_beam_search": 0}, "use_beam_search"), ({"guided_json": {}}, "guided_json"),
    ({"add_special_tokens": False}, "add_special_tokens"),
])
def test_non_neutral_values_are_refused(extra, param):
    body = CompletionRequest.model_validate({"prompt": "x", **extra})
    with pytest.raises(APIError) as info:
        check_body(body, "/v1/completions")
    assert (info.value.status, info.value.param) == (400, param)
    assert "not supported" in info.value.message or "at least n" in info.value.message


@pytest.mark.parametrize("name", ["guided_json", "guided_regex", "guided_choice", "guided_grammar",
                                  "guided_decoding_backend"])
def test_removed_guided_fields_point_to_structured_outputs(name):
    body = ChatCompletionRequest.model_validate({"messages": [{"role": "user", "content": "x"}],
                                                 name: "a"})
    with pytest.raises(APIError) as info:
        check_body(body, "/v1/chat/completions")
    assert (info.value.status, info.value.param) == (400, name)
    assert info.value.message.startswith(f"{name} is not supported: vLLM removed")
    assert "send structured_outputs instead" in info.value.message


@pytest.mark.parametrize("extra", [
    {"best_of": 1}, {"best_of": None}, {"suffix": ""}, {"use_beam_search": False},
    {"add_special_tokens": True}, {"logits_processors": []},
])
def test_neutral_values_pass(extra):
    check_body(CompletionRequest.model_validate({"prompt": "x", **extra}), "/v1/completions")


def test_the_path_of_a_lone_surrogate_is_named():
    chat = ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "fine"},
        {"role": "user", "content": [{"type": "text", "text": "ok"}, {"type": "text", "text": "x\udc01"}]}]})
    with pytest.raises(APIError) as info:
        check_body(chat, "/v1/chat/completions")
    assert info.value.param == "messages"
    assert info.value.message.startswith("messages[1].content[1].text is not valid UTF-8 text")
    assert "U+DC01 at index 1" in info.value.message


@pytest.mark.parametrize("params, loc", [
    ({"\ud800": 1}, ("kv_transfer_params",)),
    ({"do_remote_prefill": True, "engine_id": "e\ud800"}, ("kv_transfer_params", "engine_id")),
])
def test_a_lone_surrogate_in_kv_transfer_params_is_refused_where_it_is_parsed(params, loc):
    with pytest.raises(ValidationError) as refused:
        CompletionRequest.model_validate({"prompt": "x", "kv_transfer_params": params})
    assert refused.value.errors()[0]["loc"] == loc


CALL = {"id": "1", "type": "function", "function": {"name": "f", "arguments": "{}"}}


@pytest.mark.parametrize("messages, match", [
    ([{"role": "user", "content": None}], r"messages\[0\].content is required"),
    ([{"role": "user"}], r"messages\[0\].content is required"),
    ([{"role": "user", "content": "x", "tool_calls": [CALL]}], r"messages\[0\].tool_calls: only an assistant"),
    ([{"role": "user", "content": "x"}, {"role": "assistant", "content": "", "function_call": {"name": "f"}}],
     r"messages\[1\].function_call is not supported"),
])
def test_malformed_tool_history_is_refused(messages, match):
    with pytest.raises(APIError, match=match):
        check_messages(ChatCompletionRequest.model_validate({"messages": messages}))


def test_an_assistant_tool_call_may_have_null_content():
    check_messages(ChatCompletionRequest.model_validate({"messages": [
        {"role": "user", "content": "x"}, {"role": "assistant", "content": None, "tool_calls": [CALL]},
        {"role": "tool", "content": "42", "tool_call_id": "1"}]}))
