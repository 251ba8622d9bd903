"""Structured outputs on the server: ``response_format`` (OpenAI) and ``structured_outputs``
(vLLM) become one ``StructuredOutputsParams``, and its grammar is checked before the request is
admitted, off the event loop (it compiles after admission, in the engine).

A request may constrain its answer one way only: ``response_format`` of type ``json_object``
or ``json_schema``, or ``structured_outputs``; ``response_format: {"type": "text"}`` asks for
nothing. A grammar the backend refuses is a 400 naming the field the client sent.
"""
from __future__ import annotations

import asyncio

from tandem.errors import InvalidRequest
from tandem.sampling_params import SamplingParams, StructuredOutputsParams
from tandem.server.errors import APIError, api_error_from, bad_request
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


async def prepare_grammar(engine, params: SamplingParams, body: SamplingFields,
                          param: str | None = None) -> None:
    """Check ``params``' grammar with the engine's backend (a parse: on a thread unless the
    grammar is small, so that small grammars never queue behind the parses of huge ones); a refusal
    is a 400 naming ``param``, else ``response_format`` or ``structured_outputs``. Nothing
    compiles here: the engine compiles the grammar once the request is admitted (queue checks
    first), and answers the admission when the grammar is ready."""
    spec = params.structured_outputs
    if spec is None:
        return
    manager = engine.structured
    try:
        if manager.is_cheap_to_validate(spec):
            manager.validate(spec)
        else:
            await asyncio.to_thread(manager.validate, spec)
    except InvalidRequest as exc:
        name = param or ("structured_outputs" if body.structured_outputs is not None else "response_format")
        raise APIError(400, f"{name} {exc.detail}", param=name,
                       code=getattr(exc, "code", "invalid_request")) from exc
