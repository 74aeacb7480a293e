"""/health, /metrics and the one structured log line per request make TTFT diagnosable."""

from __future__ import annotations

import httpx
from prometheus_client.parser import text_string_to_metric_families

from .support import data_url, image_message, make_image, request_log

IMAGE = image_message("Describe.", data_url(make_image(112, 112, (10, 200, 10))))


def test_health_is_ok_while_the_engine_runs(server):
    resp = httpx.get(server.base_url + "/health")
    assert resp.status_code == 200
    assert resp.json() == {"status": "ok"}


def test_request_log_line_splits_ttft_into_queue_prefill_decode(client, server, request_logs):
    resp = client.chat.completions.create(
        model=server.model,
        messages=IMAGE,
        max_tokens=3,
        temperature=0,
        user="camera-7",
        extra_body={"priority": "batch", "ignore_eos": True},
    )
    line = request_log(request_logs)[resp.id.removeprefix("chatcmpl-")]

    assert line["priority"] == "batch" and line["endpoint"] == "chat"
    assert line["status"] == 200 and line["finish_reason"] == "length"
    assert line["prompt_tokens"] == resp.usage.prompt_tokens
    assert line["image_tokens"] > 0
    assert line["output_tokens"] == 3
    assert line["user"] == "camera-7"
    for key in ("ttft_s", "e2e_s", "queue_s", "prefill_s", "decode_s"):
        assert line[key] >= 0, key
    assert line["prefill_chunks"] >= 1
    # TTFT is measured at the server and contains the engine's queue and prefill time.
    assert line["ttft_s"] >= line["queue_s"] + line["prefill_s"]
    assert line["e2e_s"] >= line["ttft_s"]


def _samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    out = {}
    for family in text_string_to_metric_families(text):
        for s in family.samples:
            out[(s.name, tuple(sorted(s.labels.items())))] = s.value
    return out


def test_metrics_expose_latency_histograms_per_class_and_engine_state(client, server):
    for priority in ("interactive", "batch"):
        client.chat.completions.create(
            model=server.model,
            messages=IMAGE,
            max_tokens=3,
            extra_body={"priority": priority, "ignore_eos": True},
        )
    resp = httpx.get(server.base_url + "/metrics")
    assert resp.status_code == 200
    assert resp.headers["content-type"].startswith("text/plain")
    samples = _samples(resp.text)

    for priority in ("interactive", "batch"):
        for hist in (
            "time_to_first_token_seconds",
            "inter_token_latency_seconds",
            "e2e_request_latency_seconds",
            "request_queue_time_seconds",
            "request_prefill_time_seconds",
            "request_prefill_chunks",
            "request_decode_time_seconds",
        ):
            key = (f"vision_serve_{hist}_count", (("priority", priority),))
            assert samples.get(key, 0) >= 1, key
    names = {name for name, _ in samples}
    for gauge_or_counter in (
        "vision_serve_num_requests_running",
        "vision_serve_num_requests_waiting",
        "vision_serve_kv_cache_usage_perc",
        "vision_serve_prefix_cache_hits_total",
        "vision_serve_num_preemptions_total",
        "vision_serve_requests_expired_total",
        "vision_serve_requests_aborted_total",
        "vision_serve_engine_steps_total",
        "vision_serve_step_prompt_tokens_total",
        "vision_serve_last_step_prefill_tokens",
    ):
        assert gauge_or_counter in names, gauge_or_counter
    assert samples[("vision_serve_engine_steps_total", ())] > 0


def test_metrics_expose_the_scheduling_policy(client, server):
    client.chat.completions.create(
        model=server.model, messages=IMAGE, max_tokens=2, extra_body={"priority": "batch"}
    )
    samples = _samples(httpx.get(server.base_url + "/metrics").text)
    names = {name for name, _ in samples}
    assert samples[("vision_serve_class_requests_finished_total", (("priority", "batch"),))] >= 1
    assert "vision_serve_step_tokens_bucket" in names
    assert "vision_serve_step_tokens_count" in names
    assert "vision_serve_itl_target_seconds" in names
    assert "vision_serve_prefill_budget_tokens" in names
