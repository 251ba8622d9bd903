"""Registers tandem's built-in tool parsers (entry point ``builtin_tool_parsers``)."""
from __future__ import annotations

import tandem
from tandem.hookspecs import Register
from tandem.server.tools.hermes import HermesToolParser
from tandem.server.tools.llama3_json import Llama3JsonToolParser


@tandem.hookimpl
def tandem_register_tool_parsers(register: Register) -> None:
    register("hermes", HermesToolParser)
    register("llama3_json", Llama3JsonToolParser)
