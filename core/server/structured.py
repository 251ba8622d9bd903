"""Structured outputs on the server: ``response_format`` (OpenAI) and ``structured_outputs``
(vLLM) become one ``StructuredOutputsParams``; the engine's input processor checks its grammar
(``tandem.input_processor``), and it compiles after admission, in the engine.

A request may constrain its answer one way only: ``response_format`` of type ``json_object``
or ``json_schema``, or ``structured_outputs``; ``response_format: {"type": "text"}`` asks for
nothing. A grammar the backend refuses is a 400 naming the field the client sent.
"""
from __future__ import annotations

from tandem.errors import InvalidRequest
from tandem.sampling_params import StructuredOutputsParams
from tandem.server.errors import api_error_from, bad_request
from tandem.server.protocol import SamplingFields

RESPONSE_FORMATS = ("text", "json_object", "json_schema")


def structured_outputs_of(body: SamplingFields) -> StructuredOutputsParams | None:
    """What ``body`` constrains its answer to (None: plain text); 400 for a malformed or
    doubled constraint."""
    fmt = body.response_format
    if fmt is not None and fmt.type not in RESPONSE_FORMATS:
        raise bad_request(f"response_format type {fmt.type!r} is not supported: it must be one of "
                          + ", ".join(map(repr, RESPONSE_FORMATS)), "response_format")
    from_format = fmt is not None and fmt.type != "text"
    if from_format and body.structured_outputs is not None:
        raise bad_request("response_format and structured_outputs both constrain the answer: send "
                          "one of them", "structured_outputs")
    try:
        if body.structured_outputs is not None:
            return StructuredOutputsParams.from_dict(body.structured_outputs)
        if not from_format:
            return None
        if fmt.type == "json_object":
            return StructuredOutputsParams(json_object=True)
        if fmt.json_schema is None or fmt.json_schema.json_schema is None:
            raise bad_request('response_format of type "json_schema" needs json_schema.schema '
                              '(a JSON schema object)', "response_format")
        return StructuredOutputsParams(json=_schema(fmt.json_schema.json_schema))
    except InvalidRequest as exc:
        raise api_error_from(exc) from exc


def _schema(schema: dict | bool) -> dict:
    """A boolean schema (JSON Schema allows ``true``/``false``) as its object form."""
    if schema is True:
        return {}
    if schema is False:
        raise bad_request("response_format.json_schema.schema is false: no answer can be valid",
                          "response_format")
    return schema
