"""A request's structured-output fields -> the engine's ``StructuredOutputsParams``.

Accepted, as OpenAI and vLLM spell them: ``response_format`` (``text``, ``json_object``,
``json_schema`` strict or not), vLLM's extra-body ``guided_json`` / ``guided_regex`` /
``guided_choice`` and its newer ``structured_outputs: {json, regex, choice}``, and (chat only)
a ``tool_choice`` that forces a call (vision_serve.tool_calls builds that schema). At most one
of them may constrain a request: two would silently override each other, so that is a 400.
Shape errors are 400s naming the field here; the schema itself is compiled at admission by the
engine, whose errors name the same field (``StructuredOutputsParams.param``).
"""

from __future__ import annotations

from typing import Any

from engine.structured_output import StructuredOutputsParams
from vision_serve.errors import bad_request

# pydantic's aliases of the same field names, kept short for the error messages
_STRUCTURED_OUTPUTS_KEYS = ("json", "regex", "choice", "json_object")


def from_response_format(fmt: dict[str, Any] | None) -> StructuredOutputsParams | None:
    if fmt is None:
        return None
    kind = fmt.get("type")
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return StructuredOutputsParams(json_object=True, param="response_format")
    if kind == "json_schema":
        spec = fmt.get("json_schema")
        if not isinstance(spec, dict):
            raise bad_request(
                "response_format.json_schema must be an object with a 'schema'",
                param="response_format",
            )
        schema = spec.get("schema", {"type": "object"})
        if not isinstance(schema, dict):
            raise bad_request(
                "response_format.json_schema.schema must be a JSON schema object",
                param="response_format",
            )
        return StructuredOutputsParams(json=schema, param="response_format")
    raise bad_request(
        f"response_format type {kind!r} is not supported (text, json_object, json_schema)",
        param="response_format",
    )


def _from_vllm_fields(req: Any) -> list[StructuredOutputsParams]:
    found = []
    if req.guided_json is not None:
        found.append(StructuredOutputsParams(json=req.guided_json, param="guided_json"))
    if req.guided_regex is not None:
        found.append(StructuredOutputsParams(regex=req.guided_regex, param="guided_regex"))
    if req.guided_choice is not None:
        found.append(StructuredOutputsParams(choice=req.guided_choice, param="guided_choice"))
    so = req.structured_outputs
    if so is not None:
        if not isinstance(so, dict):
            raise bad_request("structured_outputs must be an object", param="structured_outputs")
        given = {k: v for k, v in so.items() if k in _STRUCTURED_OUTPUTS_KEYS and v is not None}
        if len(given) != 1:
            raise bad_request(
                "structured_outputs takes exactly one of json, regex, choice, json_object",
                param="structured_outputs",
            )
        ((key, value),) = given.items()
        if key == "json_object":
            value = bool(value)
        found.append(StructuredOutputsParams(**{key: value}, param="structured_outputs"))
    return found


def structured_outputs_for(
    req: Any, forced_tool: StructuredOutputsParams | None = None
) -> StructuredOutputsParams | None:
    """The one constraint of this request (None: free text), shape-checked."""
    found = _from_vllm_fields(req)
    fmt = from_response_format(getattr(req, "response_format", None))
    if fmt is not None:
        found.append(fmt)
    if forced_tool is not None:
        found.append(forced_tool)
    if len(found) > 1:
        names = ", ".join(s.param for s in found)
        raise bad_request(
            f"only one structured output constraint per request, got {names}",
            param=found[1].param,
        )
    if not found:
        return None
    spec = found[0]
    try:
        spec.validate()
    except Exception as exc:  # InvalidRequestError: same message, as a 400
        raise bad_request(str(exc), param=spec.param) from None
    return spec
