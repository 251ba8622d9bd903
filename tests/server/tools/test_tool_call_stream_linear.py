"""A 100 KB tool-call stream is parsed in time linear in its length: the parser is never asked
to re-parse the whole output per chunk, and a longer output takes proportionally longer
(not the square). The calls streamed are those of the non-streamed parse and of ``json.loads`` of
the hand-built calls."""
from __future__ import annotations

import gc
import json
import random
import time

import pytest

from tandem.server.tools.forced import RequiredCallsParser
from tandem.server.tools.hermes import HermesToolParser
from tandem.server.tools.llama3_json import Llama3JsonToolParser
from tests.server.tools.test_tool_call_stream import streamed


def hand_built_calls(num_bytes: int, seed: int) -> list[dict]:
    """Calls of varied arguments (escapes, nesting, one long string) of about ``num_bytes``."""
    rng = random.Random(seed)
    calls, size = [], 0
    while size < num_bytes:
        i = len(calls)
        arguments = {"city": f"Par\"is {i}\\", "days": [rng.randint(0, 9) for _ in range(rng.randint(0, 6))],
                     "nested": {"a": [{"b": None}, True, -1.5e3], "text": "x}]{[" * rng.randint(0, 20)}}
        if i % 50 == 7:
            arguments["long"] = "".join(rng.choice("ab \"\\{}[]") for _ in range(8000))
        calls.append({"name": f"tool_{i}", "arguments": arguments})
        size += len(json.dumps(arguments)) + 40
    return calls


def output_of(fmt: str, calls: list[dict]) -> str:
    if fmt == "hermes":
        return "Let me look.\n" + "\n".join(f"<tool_call>\n{json.dumps(c)}\n</tool_call>" for c in calls)
    if fmt == "llama3_json":
        return "; ".join(json.dumps({"name": c["name"], "parameters": c["arguments"]}) for c in calls)
    return json.dumps([{"name": c["name"], "parameters": c["arguments"]} for c in calls])


PARSERS = {"hermes": HermesToolParser, "llama3_json": Llama3JsonToolParser, "required": RequiredCallsParser}


class CountingParser:
    """Counts ``parse`` calls of a parser class (a stream must not re-parse per chunk)."""

    def __init__(self, cls) -> None:
        self.calls = 0
        counter = self

        class Counted(cls):
            def parse(self, text, final):
                counter.calls += 1
                return super().parse(text, final)

        self.parser = Counted()


def chunks_of(text: str, seed: int) -> list[str]:
    rng = random.Random(seed)
    out, i = [], 0
    while i < len(text):
        n = rng.randint(1, 8)
        out.append(text[i:i + n])
        i += n
    return out


def _stream_s(parser, chunks: list[str]) -> float:
    """CPU seconds of this thread (not wall time: a test worker beside it on a 2-core machine
    would add its own time slices), the collector paused so a collection cannot land in one
    side only."""
    gc.collect()
    gc.disable()
    try:
        t0 = time.thread_time()
        streamed(parser, chunks)
        return time.thread_time() - t0
    finally:
        gc.enable()


@pytest.mark.parametrize("fmt", sorted(PARSERS))
def test_a_100kb_stream_gives_the_calls_of_the_whole_parse(fmt):
    calls = hand_built_calls(100_000, seed=1)
    text = output_of(fmt, calls)
    assert len(text) >= 100_000
    counting = CountingParser(PARSERS[fmt])
    content, got, ids = streamed(counting.parser, chunks_of(text, seed=2))
    assert counting.calls == 0  # fed only the new text, never the whole output again
    whole = PARSERS[fmt]().parse(text, final=True)
    assert got == [(c.name, c.arguments) for c in whole.calls]
    assert [(name, json.loads(arguments)) for name, arguments in got] == \
        [(c["name"], c["arguments"]) for c in calls]
    assert content == whole.content and len(ids) == len(calls)


def test_a_longer_stream_takes_time_in_proportion():
    """About 3.5 times the text takes about 3.5 times the time; a parser that re-scanned its
    output per chunk would take its square (~12 times). The bound, twice the size ratio, sits
    between the two with room for a noisy machine either way."""
    short = chunks_of(output_of("hermes", hand_built_calls(25_000, seed=3)), seed=4)
    long = chunks_of(output_of("hermes", hand_built_calls(100_000, seed=3)), seed=4)
    rounds = [(_stream_s(HermesToolParser(), short), _stream_s(HermesToolParser(), long)) for _ in range(7)]
    t_short, t_long = (min(times) for times in zip(*rounds))  # interleaved: the machine's drift hits both
    size_ratio = sum(map(len, long)) / sum(map(len, short))
    assert size_ratio > 3
    assert t_long / t_short < 2 * size_ratio, (t_short, t_long, size_ratio)
