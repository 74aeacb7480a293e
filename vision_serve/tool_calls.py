"""Tools: checking ``tools`` / ``tool_choice``, the constraint a forced call decodes under, and
parsing Qwen2/2.5's ``<tool_call>{"name": ..., "arguments": ...}</tool_call>`` output into
OpenAI's ``tool_calls`` (whole, or as streamed ``delta.tool_calls``).

- ``auto``: the tools go into the chat template (Qwen's ``# Tools`` system section) and the
  model decides; whatever it writes is parsed (:func:`parse_tool_calls`).
- ``required``: the output is grammar-constrained to a JSON array of one or more
  ``{"name", "arguments"}`` objects, ``arguments`` valid against that function's
  ``parameters`` (vLLM's approach: a JSON document, not the model's tag format, because the
  grammar then covers the whole output).
- a named function: the output is constrained to that function's ``parameters``; it *is*
  the arguments.
- ``none``: no tools in the prompt, no parsing.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from engine.structured_output import StructuredOutputsParams
from vision_serve.errors import bad_request

TOOL_CALL_OPEN = "<tool_call>"
TOOL_CALL_CLOSE = "</tool_call>"
_TOOL_CALL_RE = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)


def new_call_id() -> str:
    return f"call_{uuid.uuid4().hex[:24]}"


@dataclass
class ToolPlan:
    """What one chat request does with tools: which are shown to the model and how its output
    is read (``mode``: ``none``, ``auto``, ``required`` or ``named``)."""

    mode: str = "none"
    tools: list[dict[str, Any]] = field(default_factory=list)  # for the chat template
    name: str | None = None  # the forced function (mode ``named``)
    parallel: bool = True  # ``parallel_tool_calls``: False allows one call only

    @property
    def constraint(self) -> StructuredOutputsParams | None:
        """The grammar a forced call decodes under (None for ``auto`` / ``none``)."""
        if self.mode == "named":
            fn = _function(self.tools, self.name)
            return StructuredOutputsParams(json=_parameters(fn), param="tool_choice")
        if self.mode == "required":
            items = [
                {
                    "type": "object",
                    "properties": {
                        "name": {"type": "string", "enum": [t["function"]["name"]]},
                        "arguments": _parameters(t["function"]),
                    },
                    "required": ["name", "arguments"],
                    "additionalProperties": False,
                }
                for t in self.tools
            ]
            schema = {"type": "array", "minItems": 1, "items": {"anyOf": items}}
            if not self.parallel:
                schema["maxItems"] = 1
            return StructuredOutputsParams(json=schema, param="tool_choice")
        return None

    @property
    def template_tools(self) -> list[dict[str, Any]] | None:
        return self.tools if self.mode != "none" and self.tools else None


def _parameters(fn: dict[str, Any]) -> dict[str, Any]:
    return fn.get("parameters") or {"type": "object", "properties": {}}


def _function(tools: list[dict[str, Any]], name: str | None) -> dict[str, Any]:
    return next(t["function"] for t in tools if t["function"]["name"] == name)


def plan_tools(
    tools: list[dict[str, Any]] | None, tool_choice: Any, parallel: bool | None = None
) -> ToolPlan:
    """Check ``tools`` and ``tool_choice`` (a 400 naming the field) and decide the mode."""
    plan = _plan(tools or [], tool_choice)
    plan.parallel = parallel is not False
    return plan


def _plan(tools: list[dict[str, Any]], tool_choice: Any) -> ToolPlan:
    for i, tool in enumerate(tools):
        fn = tool.get("function") if isinstance(tool, dict) else None
        if not isinstance(tool, dict) or tool.get("type", "function") != "function":
            raise bad_request("only tools of type 'function' are supported", f"tools[{i}].type")
        if not isinstance(fn, dict) or not isinstance(fn.get("name"), str) or not fn["name"]:
            raise bad_request("a tool needs function.name", param=f"tools[{i}].function.name")
        params = fn.get("parameters")
        if params is not None and not isinstance(params, dict):
            raise bad_request(
                "function.parameters must be a JSON schema object",
                param=f"tools[{i}].function.parameters",
            )
    names = [t["function"]["name"] for t in tools]
    if tool_choice is None:
        return ToolPlan("auto" if tools else "none", tools)
    if tool_choice in ("none", "auto", "required"):
        if tool_choice != "none" and not tools:
            raise bad_request(f"tool_choice {tool_choice!r} needs tools", param="tool_choice")
        return ToolPlan(tool_choice, tools)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        fn = tool_choice.get("function")
        name = fn.get("name") if isinstance(fn, dict) else None
        if name not in names:
            raise bad_request(
                f"tool_choice names function {name!r}, which is not in tools",
                param="tool_choice",
            )
        return ToolPlan("named", tools, name)
    raise bad_request(
        "tool_choice must be 'none', 'auto', 'required' or "
        "{'type': 'function', 'function': {'name': ...}}",
        param="tool_choice",
    )


def template_message(message: dict[str, Any], extra: dict[str, Any], index: int) -> None:
    """Carry an assistant message's ``tool_calls`` and a tool message's ``tool_call_id`` into
    the engine message (in place), as the chat template reads them: arguments as an object
    (Qwen's template writes ``arguments | tojson``; OpenAI sends them as a JSON string)."""
    calls = extra.get("tool_calls")
    if calls:
        if not isinstance(calls, list):
            raise bad_request("tool_calls must be a list", param=f"messages[{index}].tool_calls")
        rendered = []
        for j, call in enumerate(calls):
            fn = call.get("function") if isinstance(call, dict) else None
            if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
                raise bad_request(
                    "a tool call needs function.name",
                    param=f"messages[{index}].tool_calls[{j}].function",
                )
            args = fn.get("arguments", "{}")
            if isinstance(args, str):
                try:
                    args = json.loads(args) if args.strip() else {}
                except json.JSONDecodeError:
                    raise bad_request(
                        "tool call arguments must be a JSON string",
                        param=f"messages[{index}].tool_calls[{j}].function.arguments",
                    ) from None
            rendered.append(
                {
                    "id": call.get("id"),
                    "type": "function",
                    "function": {"name": fn["name"], "arguments": args},
                }
            )
        message["tool_calls"] = rendered
    if message["role"] == "tool":
        if not isinstance(extra.get("tool_call_id"), str):
            raise bad_request(
                "a tool message needs the tool_call_id it answers",
                param=f"messages[{index}].tool_call_id",
            )
        message["tool_call_id"] = extra["tool_call_id"]


# ---- output ---------------------------------------------------------------------------------


def _call(name: str, arguments: Any) -> dict[str, Any]:
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return {
        "id": new_call_id(),
        "type": "function",
        "function": {"name": name, "arguments": arguments},
    }


def parse_tool_calls(text: str) -> tuple[str | None, list[dict[str, Any]]]:
    """Qwen's format -> (content outside the calls or None, OpenAI tool calls). A block that
    is not a JSON object with a string ``name`` stays in the content, untouched."""
    calls: list[dict[str, Any]] = []
    kept: list[str] = []
    pos = 0
    for match in _TOOL_CALL_RE.finditer(text):
        try:
            obj = json.loads(match.group(1))
        except json.JSONDecodeError:
            continue
        if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
            continue
        args = obj.get("arguments", obj.get("parameters", {}))
        calls.append(_call(obj["name"], args))
        kept.append(text[pos : match.start()])
        pos = match.end()
    kept.append(text[pos:])
    content = "".join(kept).strip() if calls else text
    return (content or None), calls


def parse_forced(plan: ToolPlan, text: str) -> list[dict[str, Any]]:
    """The calls of a ``required`` / ``named`` output (empty if it does not parse, e.g. cut
    short by ``max_tokens``)."""
    try:
        obj = json.loads(text)
    except json.JSONDecodeError:
        return []
    if plan.mode == "named":
        return [_call(plan.name or "", obj)]
    if not isinstance(obj, list):
        return []
    return [
        _call(item["name"], item.get("arguments", {}))
        for item in obj
        if isinstance(item, dict) and isinstance(item.get("name"), str)
    ]


def finish_reason(calls: list[dict[str, Any]], reason: str | None) -> str | None:
    return "tool_calls" if calls and reason == "stop" else reason


def read_output(plan: ToolPlan, text: str, reason: str | None) -> tuple[str | None, list, Any]:
    """A finished chat output -> (content, tool calls, finish reason)."""
    if plan.mode in ("named", "required"):
        calls = parse_forced(plan, text)
        return (None if calls else text), calls, finish_reason(calls, reason)
    if plan.mode == "auto":
        content, calls = parse_tool_calls(text)
        return content, calls, finish_reason(calls, reason)
    return text, [], reason


class ToolCallStreamer:
    """One choice's streamed output -> content deltas and ``delta.tool_calls`` entries in
    OpenAI's chunk shape: a call's first entry carries index, id, type and function.name (with
    empty arguments), later ones ``function.arguments`` pieces.

    ``named`` streams the arguments as they are generated; ``required`` and ``auto`` calls are
    sent when their text is complete (``auto`` streams content until ``<tool_call>`` appears,
    holding back a possible prefix of it)."""

    def __init__(self, plan: ToolPlan) -> None:
        self.plan = plan
        self.buffer = ""
        self.num_calls = 0
        self.in_call = False

    def feed(self, delta: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        """(content to send now, tool-call delta entries to send now)."""
        mode = self.plan.mode
        if mode == "named":
            entries = []
            if self.num_calls == 0:
                entries.append(self._head(self.plan.name or ""))
                self.num_calls = 1
            if delta:
                entries.append({"index": 0, "function": {"arguments": delta}})
            return "", entries
        if mode == "required":
            self.buffer += delta
            if not finished:
                return "", []
            return "", self._entries(parse_forced(self.plan, self.buffer))
        if mode != "auto":
            return delta, []
        self.buffer += delta
        if not self.in_call:
            at = self.buffer.find(TOOL_CALL_OPEN)
            if at < 0:
                keep = _partial_suffix(self.buffer, TOOL_CALL_OPEN) if not finished else 0
                out, self.buffer = (
                    self.buffer[: len(self.buffer) - keep],
                    self.buffer[len(self.buffer) - keep :],
                )
                return out, []
            out, self.buffer = self.buffer[:at], self.buffer[at:]
            self.in_call = True
            if not finished:
                return out, []
        else:
            out = ""
        if not finished:
            return out, []
        content, calls = parse_tool_calls(self.buffer)
        if not calls:
            return out + self.buffer, []
        return out + (content or ""), self._entries(calls)

    def finish_reason(self, reason: str | None) -> str | None:
        return "tool_calls" if self.num_calls and reason == "stop" else reason

    def _head(self, name: str, call_id: str | None = None) -> dict[str, Any]:
        return {
            "index": self.num_calls,
            "id": call_id or new_call_id(),
            "type": "function",
            "function": {"name": name, "arguments": ""},
        }

    def _entries(self, calls: list[dict[str, Any]]) -> list[dict[str, Any]]:
        entries = []
        for call in calls:
            entries.append(self._head(call["function"]["name"], call["id"]))
            entries.append(
                {"index": self.num_calls, "function": {"arguments": call["function"]["arguments"]}}
            )
            self.num_calls += 1
        return entries


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``marker``."""
    for k in range(min(len(text), len(marker) - 1), 0, -1):
        if marker.startswith(text[-k:]):
            return k
    return 0
