"""``--step-trace``: one JSON line per step, the budget's promise beside what the step did."""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import pytest

from engine import EngineArgs, SamplingParams
from engine.config import add_engine_cli_args, engine_args_from_namespace
from engine.llm_engine import LLMEngine
from engine.scheduler import SchedulerOutput
from engine.step_trace import StepTrace, StepTraceError
from tests.engine.helpers import image_conv, noise_image, text_conv


def test_the_flag_reaches_the_engine_args(tmp_path):
    parser = argparse.ArgumentParser()
    add_engine_cli_args(parser)
    path = str(tmp_path / "steps.jsonl")
    ns = parser.parse_args(["--model", "m", "--step-trace", path])
    assert engine_args_from_namespace(ns).step_trace == path
    assert EngineArgs(model="m").step_trace is None  # off by default


def test_every_step_is_traced_with_its_encoder_work(tiny_qwen2_vl, tmp_path):
    path = tmp_path / "traces" / "steps.jsonl"  # a missing folder is made
    engine = LLMEngine(EngineArgs(model=str(tiny_qwen2_vl), dtype="float32", step_trace=str(path)))
    params = SamplingParams(temperature=0, max_tokens=4, ignore_eos=True)
    engine.add_request("chat", text_conv("Hello there"), params, priority="interactive")
    frame = image_conv("Who is in view?", noise_image(224, 168, seed=3))
    engine.add_request("frame", frame, params, priority="batch")
    while engine.has_unfinished():
        engine.step()
    engine.close()
    engine.close()  # twice is harmless (the server's shutdown and an owner may both call it)

    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(lines) == engine.stats.num_steps
    assert sum(r["decodes"] for r in lines) == 2 * (params.max_tokens - 1)
    assert sum(r["encoder_items"] for r in lines) > 0
    encoding = [r for r in lines if r["encoder_items"]]
    assert all(r["encoder_units"] > 0 and r["encoder_s"] > 0 for r in encoding)
    assert all(r["step_s"] > 0 and r["at"] > 0 for r in lines)
    # the step thread's own CPU time: some, and never more than the step's wall time allows
    # (its OpenMP workers' time is theirs)
    assert all(0 < r["cpu_s"] <= r["step_s"] * 1.05 + 1e-3 for r in lines)
    assert {"predicted_s", "target_s", "encoder_grant", "item_overhead", "forward_s"} <= set(
        lines[0]
    )
    # the chat's decodes alone, priced by the cost model: in steps where the chat decodes
    # (calibrated at start: every such step has a price), and in no other
    chat_decoding = [r for r in lines if r["chat_decode_s"] is not None]
    assert len(chat_decoding) >= params.max_tokens - 1
    assert all(r["chat_decode_s"] > 0 and r["decodes"] >= 1 for r in chat_decoding)
    # a chat in the engine from the start: no step was interruptible, none interrupted
    assert not any(r["interruptible"] or r["interrupted"] for r in lines[:2])


def test_a_trace_path_the_engine_cannot_write_is_refused_at_start_up(tmp_path):
    with pytest.raises(ValueError, match="is a folder"):
        EngineArgs(model="m", step_trace=str(tmp_path))
    EngineArgs(model="m", step_trace=str(tmp_path / "a" / "b" / "steps.jsonl"))  # made later
    blocker = tmp_path / "file"
    blocker.write_text("")
    with pytest.raises(StepTraceError, match="step-trace"):
        StepTrace(blocker / "steps.jsonl")  # a file where a folder must be


@pytest.mark.parametrize(
    "flags, message",
    [
        (["--max-step-ms", "soon"], "max_step_ms must be a number"),
        (["--step-trace", "."], "is a folder"),
    ],
)
def test_serve_with_a_bad_flag_value_exits_with_one_clear_line(tiny_qwen2_vl, flags, message):
    proc = subprocess.run(
        [sys.executable, "-m", "vision_serve.cli", "serve", "--model", str(tiny_qwen2_vl),
         "--port", "0", *flags],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert message in proc.stderr and "Traceback" not in proc.stderr


def test_a_trace_that_cannot_be_written_ends_itself_not_the_engine(tmp_path, caplog):
    trace = StepTrace(tmp_path / "steps.jsonl", flush_every=1)

    class FullDisk:
        def write(self, _):
            raise OSError(28, "No space left on device")

        def close(self):
            raise OSError(28, "No space left on device")

    trace._file.close()
    trace._file = FullDisk()
    sched = SchedulerOutput()  # an empty step: the record is written all the same
    trace.record(sched, None, 0.01)  # logs and stops: no exception into the step loop
    trace.record(sched, None, 0.01)
    trace.close()
    assert "No space left" in caplog.text
