"""Tool calling on /v1/chat/completions: which calls a request allows (``choice``), the output
parsers of "auto" (``hermes``, ``llama3_json``, registered as ``tool_parser`` plugins), the
constrained forms of "required" and a named function (``forced``), and streaming them as
deltas (``stream``)."""
