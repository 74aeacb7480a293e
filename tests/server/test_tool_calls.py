"""Parsing Qwen's ``<tool_call>`` output (``tool_choice: auto``), whole and streamed: random
weights rarely write a call, so the parser is specified here on crafted text."""

from __future__ import annotations

import json

import pytest

from vision_serve.tool_calls import ToolCallStreamer, ToolPlan, parse_tool_calls, read_output

TWO_CALLS = (
    "Let me check.\n<tool_call>\n"
    '{"name": "snapshot", "arguments": {"camera": "front"}}\n</tool_call>\n'
    '<tool_call>\n{"name": "set_alarm", "arguments": {"zone": "porch", "armed": true}}\n'
    "</tool_call>"
)


def test_calls_and_content_are_separated():
    content, calls = parse_tool_calls(TWO_CALLS)
    assert content == "Let me check."
    assert [c["function"]["name"] for c in calls] == ["snapshot", "set_alarm"]
    assert json.loads(calls[1]["function"]["arguments"]) == {"zone": "porch", "armed": True}
    assert all(c["id"].startswith("call_") and c["type"] == "function" for c in calls)
    assert calls[0]["id"] != calls[1]["id"]


def test_text_without_calls_or_with_a_broken_call_is_content():
    assert parse_tool_calls("just text") == ("just text", [])
    broken = "<tool_call>\n{not json}\n</tool_call>"
    assert parse_tool_calls(broken) == (broken, [])


def test_unterminated_last_call_is_still_a_call():
    content, calls = parse_tool_calls('<tool_call>\n{"name": "snapshot", "arguments": {}}')
    assert content is None and calls[0]["function"]["arguments"] == "{}"


def test_finish_reason_is_tool_calls_only_after_a_stop():
    plan = ToolPlan("auto", [])
    assert read_output(plan, TWO_CALLS, "stop")[2] == "tool_calls"
    assert read_output(plan, TWO_CALLS, "length")[2] == "length"
    assert read_output(plan, "plain", "stop") == ("plain", [], "stop")


@pytest.mark.parametrize("piece", [1, 3, 7])
def test_streamed_auto_output_gives_content_then_openai_shaped_calls(piece):
    streamer = ToolCallStreamer(ToolPlan("auto", []))
    content, entries = "", []
    deltas = [TWO_CALLS[i : i + piece] for i in range(0, len(TWO_CALLS), piece)]
    for k, delta in enumerate(deltas):
        text, calls = streamer.feed(delta, finished=k == len(deltas) - 1)
        content += text
        entries += calls
        assert "<" not in text  # never a piece of the marker
    assert content.strip() == "Let me check."
    heads = [e for e in entries if "id" in e]
    assert [(h["index"], h["function"]["name"]) for h in heads] == [
        (0, "snapshot"),
        (1, "set_alarm"),
    ]
    args = {}
    for e in entries:
        args[e["index"]] = args.get(e["index"], "") + e["function"]["arguments"]
    assert json.loads(args[0]) == {"camera": "front"}
    assert streamer.finish_reason("stop") == "tool_calls"


def test_streamed_text_that_only_looks_like_a_marker_is_released():
    streamer = ToolCallStreamer(ToolPlan("auto", []))
    assert streamer.feed("a <tool", finished=False) == ("a ", [])
    assert streamer.feed("box> b", finished=True) == ("<toolbox> b", [])
    assert streamer.finish_reason("stop") == "stop"
