"""OpenAI's `response_format`, vLLM's `structured_outputs` and its older `guided_*` fields -> StructuredOutputs.

Three spellings of one constraint; a request sets at most one of them. Whether the schema, regex or
grammar is valid is admission's question (the scheduler compiles it), so gRPC and HTTP clients get
the same messages.
"""

from __future__ import annotations

import json
from typing import Any

from openai_api.errors import invalid_request
from openai_api.protocol import SamplingRequest, StructuredOutputsRequest
from protos import common_pb2

# vLLM's older per-field names -> the structured_outputs kind each sets.
_GUIDED = {"guided_json": "json", "guided_regex": "regex", "guided_choice": "choice", "guided_grammar": "grammar"}


def structured_outputs(req: SamplingRequest) -> common_pb2.StructuredOutputs | None:
    """The request's constraint, or None for free text; a 400 naming the field when it cannot be served."""
    given = {name: getattr(req, name) for name in ("response_format", "structured_outputs", *_GUIDED)}
    if given["response_format"] is not None and given["response_format"].get("type", "text") == "text":
        del given["response_format"]
    given = {name: value for name, value in given.items() if value is not None}
    if len(given) > 1:
        raise invalid_request(f"set only one of {', '.join(given)}: each constrains the output", list(given)[1])
    if not given:
        return None
    name, value = next(iter(given.items()))
    if name == "response_format":
        return _response_format(value)
    if name == "structured_outputs":
        return _vllm(value)
    return _kind(_GUIDED[name], value, name)


def _response_format(value: dict[str, Any]) -> common_pb2.StructuredOutputs:
    kind = value.get("type")
    if kind == "json_object":
        return common_pb2.StructuredOutputs(json_object=True)
    if kind == "json_schema":
        spec = value.get("json_schema")
        if not isinstance(spec, dict) or "schema" not in spec:
            raise invalid_request("response_format.json_schema must be an object with a `schema`",
                                  "response_format.json_schema")
        return _kind("json", spec["schema"], "response_format.json_schema.schema")
    raise invalid_request(f"response_format.type must be text, json_object or json_schema, got {kind!r}",
                          "response_format.type")


def _vllm(value: StructuredOutputsRequest) -> common_pb2.StructuredOutputs:
    unknown = value.unknown_fields()
    if unknown:
        raise invalid_request(f"unsupported structured_outputs field(s): {', '.join(unknown)}",
                              f"structured_outputs.{unknown[0]}")
    kinds = {k: v for k, v in (("json", value.json_), ("regex", value.regex), ("choice", value.choice),
                                ("grammar", value.grammar)) if v is not None}
    if value.json_object:
        kinds["json_object"] = True
    if len(kinds) != 1:
        got = ", ".join(kinds) or "none"
        raise invalid_request(f"structured_outputs must set exactly one of json, json_object, regex, choice, grammar; "
                              f"got {got}", "structured_outputs")
    kind, spec = next(iter(kinds.items()))
    msg = (common_pb2.StructuredOutputs(json_object=True) if kind == "json_object"
           else _kind(kind, spec, f"structured_outputs.{kind}"))
    msg.disable_any_whitespace = value.disable_any_whitespace
    return msg


def _kind(kind: str, spec: Any, field: str) -> common_pb2.StructuredOutputs:
    """One kind's message: a JSON schema as an object or JSON text, choices as strings, the rest as text."""
    if kind == "json":
        if isinstance(spec, dict):
            spec = json.dumps(spec)
        if not isinstance(spec, str):
            raise invalid_request(f"{field} must be a JSON schema (an object or its JSON text)", field)
        return common_pb2.StructuredOutputs(json=spec)
    if kind == "choice":
        if not isinstance(spec, list) or not all(isinstance(c, str) for c in spec):
            raise invalid_request(f"{field} must be a list of strings", field)
        return common_pb2.StructuredOutputs(choice=common_pb2.Choices(choices=spec))
    if not isinstance(spec, str):
        raise invalid_request(f"{field} must be a string", field)
    return common_pb2.StructuredOutputs(**{kind: spec})
