"""What a chat request's ``tools`` and ``tool_choice`` ask for (``tool_use``), as vLLM serves it:

    tool_choice   prompt           output                         parsed by            finish_reason
    none          tools rendered   free text                      —                    the engine's
    auto          tools rendered   free text                      server.tool_call_parser  "tool_calls" if calls
    required      tools rendered   constrained: a list of calls   RequiredCallsParser  "tool_calls" if it stopped
    {function}    tools rendered   constrained: its arguments     NamedCallParser      the engine's ("stop")

Unset means "auto" when tools are given, else "none". "none" and "auto" without tools are
plain chat; "required" with ``tools: []`` is "none" (as OpenAI and vLLM). "auto" needs
``server.enable_auto_tool_choice`` and a parser; without them it is a 400 naming the flags.
``parallel_tool_calls: false`` keeps the first call of "auto" (as vLLM) and holds "required"
to one.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from tandem.interfaces import ToolParser
from tandem.sampling_params import SamplingParams, StructuredOutputsParams
from tandem.server.errors import api_error_from, bad_request
from tandem.server.protocol import ChatCompletionRequest, NamedToolChoice
from tandem.server.tools.forced import NamedCallParser, RequiredCallsParser, parameters_schema, required_schema

AUTO_NEEDS_FLAGS = ('tool_choice "auto" needs the server started with --enable-auto-tool-choice and '
                    "--tool-call-parser NAME (server.enable_auto_tool_choice, server.tool_call_parser); "
                    'or ask for "required", a named function or "none"')


@dataclass(slots=True, frozen=True)
class ToolUse:
    """How one request uses its tools: ``mode`` is "none", "auto", "required" or "named";
    ``parser`` reads calls from the output (None: it is all content); ``schema`` is what
    constrained decoding holds the output to (None: nothing)."""

    mode: str
    parser: ToolParser | None = None
    schema: dict[str, Any] | None = None
    max_calls: int | None = None
    """At most this many calls per choice (``parallel_tool_calls: false``: 1); None: any."""

    def constrain(self, params: SamplingParams) -> SamplingParams:
        """``params`` with the output held to ``schema``, with JSON's whitespace as the model
        writes it (bounded by the backend), as vLLM holds it: compact JSON forces a trained
        model off the spacing it learnt (SmolLM2-135M-Instruct, asked for a named call, then
        spelt the city of the prompt wrong); a 400 when the request constrains its output
        otherwise too (response_format, structured_outputs)."""
        if self.schema is None:
            return params
        if params.structured_outputs is not None:
            raise bad_request(f"tool_choice {self.mode!r} constrains the output to tool calls; it "
                              "cannot be combined with response_format or structured_outputs",
                              "tool_choice")
        try:
            spec = StructuredOutputsParams(json=self.schema)
            return dataclasses.replace(params, structured_outputs=spec)
        except ValueError as exc:
            raise api_error_from(exc) from exc

    def finish_reason(self, engine_reason: str | None, has_calls: bool) -> str | None:
        """The choice's finish_reason: "tool_calls" for calls of "auto", and of "required" that
        stopped by themselves; otherwise the engine's (a named call keeps "stop", as OpenAI)."""
        if has_calls and (self.mode == "auto" or (self.mode == "required" and engine_reason == "stop")):
            return "tool_calls"
        return engine_reason


NO_TOOLS = ToolUse("none")


def tool_use(body: ChatCompletionRequest, auto_parser: ToolParser | None) -> ToolUse:
    """The request's ``ToolUse`` (see the module docstring); a 400 naming the field for a
    choice the request or the server cannot serve. ``auto_parser``: the server's parser for
    "auto", None unless auto tool choice is enabled."""
    tools = body.tools or []
    choice = body.tool_choice if body.tool_choice is not None else ("auto" if tools else "none")
    if choice == "none" or (choice == "auto" and not tools) or (choice == "required" and body.tools == []):
        return NO_TOOLS
    if not tools:
        raise bad_request(f"tool_choice {_shown(choice)} needs tools: give the functions in tools",
                          "tool_choice")
    if isinstance(choice, NamedToolChoice):
        tool = next((t for t in tools if t.function.name == choice.function.name), None)
        if tool is None:
            names = ", ".join(repr(t.function.name) for t in tools)
            raise bad_request(f"tool_choice names the function {choice.function.name!r}, which is not "
                              f"in tools (they are {names})", "tool_choice")
        return ToolUse("named", NamedCallParser(tool.function.name), parameters_schema(tool))
    if choice == "required":
        try:
            schema = required_schema(tools, single=not body.parallel_tool_calls)
        except ValueError as exc:
            raise bad_request(str(exc), "tools") from exc
        return ToolUse("required", RequiredCallsParser(), schema)
    if auto_parser is None:
        raise bad_request(AUTO_NEEDS_FLAGS, "tool_choice")
    return ToolUse("auto", auto_parser, max_calls=None if body.parallel_tool_calls else 1)


def _shown(choice: Any) -> str:
    return repr(choice) if isinstance(choice, str) else f"{{function: {choice.function.name!r}}}"
