"""Prometheus metrics for the pipeline and describer processes.

Why these: Frigate-style operability -- every camera's health is visible (up, fps,
reconnects) and every frame that does not become a description is counted with a reason
(``dropped`` in the pipeline, ``expired`` / ``dead`` in describers). Cluster-wide totals
also live in the Redis stats hash (see ``queue.py`` for the names and the identity they
keep), because each process's Prometheus counters only see that process.
"""

from __future__ import annotations

import logging

from prometheus_client import Counter, Gauge, Histogram, start_http_server

from pipelines.logs import kv

log = logging.getLogger(__name__)

LATENCY_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1, 2, 5, 10, 20, 30, 60, 120, 300)

# --- ingest (per camera) ---------------------------------------------------------------
CAMERA_UP = Gauge("vs_camera_up", "1 while the camera delivers frames", ["camera"])
CAMERA_FPS = Gauge("vs_camera_decoded_fps", "frames decoded per second (recent)", ["camera"])
CAMERA_DECODED = Counter("vs_camera_frames_decoded", "frames read from the source", ["camera"])
CAMERA_SAMPLED = Counter(
    "vs_camera_frames_sampled", "frames taken at the camera's sampling fps", ["camera"]
)
CAMERA_RECONNECTS = Counter(
    "vs_camera_reconnects", "stream (re)opens after a failure or end", ["camera", "reason"]
)
CAMERA_LAST_FRAME = Gauge(
    "vs_camera_last_frame_timestamp_seconds", "wall time of the newest frame", ["camera"]
)
FRAMES_DROPPED = Counter(
    "vs_frames_dropped", "sampled frames that were not enqueued, by reason", ["camera", "reason"]
)

# --- detect + gate ---------------------------------------------------------------------
DETECT_SECONDS = Histogram(
    "vs_detector_batch_seconds",
    "detector time per batch",
    buckets=(0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 5),
)
DETECT_BATCH = Histogram(
    "vs_detector_batch_size", "frames per detector batch", buckets=(1, 2, 4, 8, 16, 32, 64)
)
DETECT_FRAMES = Counter("vs_detector_frames", "frames run through the detector", ["camera"])
CAMERA_PERSONS = Gauge("vs_camera_persons", "detections in the camera's latest frame", ["camera"])
GATE_DECISIONS = Counter(
    "vs_gate_decisions", "gate verdicts by reason", ["camera", "decision", "reason"]
)
DETECTIONS_FILTERED = Counter(
    "vs_detections_filtered",
    "detections dropped by a camera's masks or object filters, by reason",
    ["camera", "reason"],
)
TRACKS_STARTED = Counter("vs_tracks_started", "tracks seen by a camera's tracker", ["camera"])

# --- queue producer --------------------------------------------------------------------
FRAMES_ENQUEUED = Counter("vs_frames_enqueued", "frames added to the Redis stream", ["camera"])
QUEUE_TRIMMED = Counter(
    "vs_queue_trimmed", "acknowledged stream entries removed (XTRIM MINID) to keep maxlen"
)
ENQUEUE_DUPLICATES = Counter(
    "vs_enqueue_duplicates", "retried sends whose frame was already enqueued (not added again)"
)
FRAMES_LOST_CRASH = Counter(
    "vs_frames_lost_crash", "frames a killed previous run of this pipeline held unsent"
)
ENQUEUE_BUFFER = Gauge("vs_enqueue_buffer_frames", "frames waiting in the ingest process")
REDIS_ERRORS = Counter("vs_redis_errors", "Redis connection failures", ["component"])

# --- describers ------------------------------------------------------------------------
DESCRIBE_OUTCOMES = Counter(
    "vs_describe_frames",
    "frames finished by this worker: described / expired / dead / duplicate",
    ["camera", "outcome", "reason"],
)
DESCRIBE_LATENCY = Histogram(
    "vs_describe_latency_seconds", "frame capture -> description stored", buckets=LATENCY_BUCKETS
)
VLM_SECONDS = Histogram(
    "vs_vlm_request_seconds", "one chat completion request", buckets=LATENCY_BUCKETS
)
VLM_ERRORS = Counter("vs_vlm_errors", "failed VLM requests by kind", ["kind"])
STRUCTURED_INVALID = Counter(
    "vs_structured_answers_invalid",
    "answers to a camera's response_schema that were not a JSON object (stored as text only)",
    ["camera"],
)
VLM_UP = Gauge("vs_vlm_up", "0 while every endpoint is failing (intake paused)")
# per endpoint (describer.endpoints; label: its name, default host:port)
ENDPOINT_UP = Gauge(
    "vs_vlm_endpoint_up", "1 while the endpoint is in rotation, 0 while it is out", ["endpoint"]
)
ENDPOINT_INFLIGHT = Gauge(
    "vs_vlm_endpoint_inflight", "requests this worker has open at the endpoint", ["endpoint"]
)
ENDPOINT_QUEUE = Gauge(
    "vs_vlm_endpoint_queue_depth",
    "waiting + running requests the endpoint's /metrics reported (all its clients)",
    ["endpoint"],
)
ENDPOINT_REQUESTS = Counter(
    "vs_vlm_endpoint_requests",
    "requests to the endpoint by outcome: ok / unavailable / server_error / rejected",
    ["endpoint", "outcome"],
)
ENDPOINT_TRANSITIONS = Counter(
    "vs_vlm_endpoint_transitions",
    "endpoint taken out of (to=down) / put back in (to=up) rotation",
    ["endpoint", "to"],
)
DESCRIBE_INFLIGHT = Gauge("vs_describe_inflight", "frames being described by this worker")
RECLAIMED = Counter("vs_describe_reclaimed", "pending frames claimed from idle consumers")
QUEUE_LAG = Gauge("vs_queue_lag_entries", "stream entries not yet delivered to any describer")
QUEUE_PENDING = Gauge("vs_queue_pending_entries", "delivered but not yet acknowledged")
QUEUE_LAG_SECONDS = Gauge("vs_queue_lag_seconds", "age of the oldest undelivered frame")


def serve_metrics(host: str, port: int) -> None:
    """Expose /metrics on a background thread; port 0 disables it."""
    if port <= 0:
        return
    start_http_server(port, addr=host)
    log.info(kv("metrics_listening", host=host, port=port))
