"""Typed configuration for the camera pipeline and the describers.

One YAML file drives both processes (``vision-serve pipeline`` and ``vision-serve
describe``), so they agree on stream names and per-camera prompts. Every section is a
pydantic model with defaults; unknown keys are rejected so a typo is an error that names the
field, not a silently ignored setting. Environment variables override the file (for compose
and secrets): ``VS_`` + the field path joined by ``__``, e.g. ``VS_REDIS_URL``,
``VS_DESCRIBER__BASE_URL``, ``VS_DESCRIBER__API_KEY``, ``VS_DETECTOR__DEVICE``; a list
such as ``VS_CAMERAS`` is given as JSON.
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator
from pydantic_settings import BaseSettings, PydanticBaseSettingsSource, SettingsConfigDict

from pipelines.events.config import EventsConfig, UIConfig
from pipelines.notify.config import NotifyConfig

ENV_PREFIX = "VS_"
CAMERA_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
# a clip camera's ring buffer keeps at most this many frames of its window (memory bound)
CLIP_MAX_WINDOW_FRAMES = 256
URL_SCHEMES = ("rtsp", "rtsps", "rtmp", "http", "https", "file", "udp", "tcp", "srt")


class ConfigError(ValueError):
    """A configuration a person must fix; the message names the file and the field."""


class Section(BaseModel):
    """Base for config sections: unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


class DetectorOverrides(Section):
    """Per-camera changes to the detector (the model itself is shared, for batching)."""

    conf: float | None = Field(None, ge=0.0, le=1.0)
    imgsz: int | None = Field(None, ge=32, le=4096)
    classes: list[int] | None = None


Point = tuple[float, float]


def parse_polygon(value: Any) -> list[Point]:
    """A polygon as Frigate writes it -- ``"x1,y1,x2,y2,..."``, ``["x1,y1", "x2,y2", ...]`` --
    or as ``[[x1, y1], [x2, y2], ...]``. Coordinates are relative (0-1) when none is above 1,
    else pixels of the frame as decoded (Frigate's rule)."""
    if isinstance(value, str):
        numbers = value.replace(" ", "").split(",")
    elif isinstance(value, list | tuple):
        numbers = []
        for point in value:
            pair = point.replace(" ", "").split(",") if isinstance(point, str) else point
            if not isinstance(pair, list | tuple) or len(pair) != 2:
                raise ValueError(f"a point is 'x,y' or [x, y], got {point!r}")
            numbers += list(pair)
    else:
        raise ValueError("a polygon is 'x1,y1,x2,y2,...' or a list of [x, y] points")
    try:
        values = [float(v) for v in numbers]
    except (TypeError, ValueError):
        raise ValueError(f"polygon coordinates must be numbers, got {value!r}") from None
    if len(values) % 2 or len(values) < 6:
        raise ValueError("a polygon needs at least 3 points, given as x,y pairs")
    if any(v < 0 for v in values):
        raise ValueError("polygon coordinates must be >= 0")
    return [(values[i], values[i + 1]) for i in range(0, len(values), 2)]


def parse_polygons(value: Any) -> list[list[Point]]:
    """One polygon (a string) or a list of polygons (each a string or a list of points)."""
    if value is None or value == "":
        return []
    if isinstance(value, str):
        return [parse_polygon(value)]
    if isinstance(value, list | tuple):
        return [parse_polygon(v) for v in value]
    raise ValueError("masks are a polygon string or a list of polygons")


class ZoneConfig(Section):
    """A named polygon of one camera (Frigate's ``zones``). A detection is in the zone when
    the bottom centre of its box (where a person stands) is inside the polygon.

    ``inertia`` and ``loitering_time`` (Frigate's names and defaults) judge a *tracked*
    object over its frames (``pipelines.presence``): it is in the zone once its feet were
    inside for ``inertia`` frames in a row and it stayed ``loitering_time`` seconds. They
    need track ids: on a camera gated per frame each detection is judged on its own frame
    (as with ``inertia: 1``), and setting either there is a configuration error."""

    coordinates: list[Point] = Field(
        description="'x1,y1,x2,y2,...' or [[x, y], ...]: relative 0-1, or pixels"
    )
    objects: list[str] = Field(
        default_factory=list, description="labels that count in this zone; empty: all"
    )
    inertia: int = Field(
        3,
        ge=1,
        description="frames in a row a tracked object's feet are inside before it is in the "
        "zone, and outside before it has left it (1: at once); tracked cameras only",
    )
    loitering_time: float = Field(
        0,
        ge=0,
        description="seconds a tracked object must stay in the zone before it counts (0: at "
        "once); tracked cameras only",
    )

    @field_validator("coordinates", mode="before")
    @classmethod
    def _polygon(cls, value: Any) -> list[Point]:
        return parse_polygon(value)

    @property
    def timed(self) -> bool:
        """Set to judge objects over several frames (what a per-frame gate cannot do)."""
        inertia = "inertia" in self.model_fields_set and self.inertia > 1
        return inertia or self.loitering_time > 0

    @field_validator("objects", mode="before")
    @classmethod
    def _labels(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value


def zone_timing_without_tracks(zones: dict[str, ZoneConfig]) -> str | None:
    """Why a camera gated per frame cannot have these zones: ``inertia`` > 1 or
    ``loitering_time`` set counts one object's frames, and a per-frame gate has no track ids
    to tell whose frames they are. An error rather than a warning: a zone that silently
    ignores its settings describes people its owner meant to wait for. The default inertia
    (not written in the file) stays quiet: per-frame cameras judge each frame on its own."""
    for name, zone in zones.items():
        if zone.timed:
            field = "loitering_time" if zone.loitering_time > 0 else "inertia"
            return (
                f"zones.{name}.{field}: counts a tracked object's frames, and this camera's "
                "gate is per frame (describe_on: [frame]: no track ids); set gate.describe_on "
                f"to track events such as [track_start], or remove {field}"
            )
    return None


class FilterConfig(Section):
    """Per-class detection filters (Frigate's ``objects.filters.<label>``). Areas are pixels
    when >= 1, else a fraction of the frame; ratios are box width / height."""

    min_area: float = Field(0, ge=0)
    max_area: float = Field(24_000_000, gt=0)
    min_ratio: float = Field(0, ge=0)
    max_ratio: float = Field(24_000_000, gt=0)
    min_score: float = Field(0.0, ge=0.0, le=1.0)
    mask: list[list[Point]] = Field(
        default_factory=list, description="polygons where this class is ignored"
    )

    @field_validator("mask", mode="before")
    @classmethod
    def _masks(cls, value: Any) -> list[list[Point]]:
        return parse_polygons(value)


class ObjectsConfig(Section):
    """Which detections count at all: ``mask`` polygons (any class whose box's bottom centre
    is inside is ignored) and ``filters`` per label."""

    mask: list[list[Point]] = Field(default_factory=list)
    filters: dict[str, FilterConfig] = Field(default_factory=dict)

    @field_validator("mask", mode="before")
    @classmethod
    def _masks(cls, value: Any) -> list[list[Point]]:
        return parse_polygons(value)


GateEvent = Literal["frame", "track_start", "track_end", "interval"]


class GateOverrides(Section):
    """Per-camera changes to ``gate`` (unset fields keep the global value)."""

    min_persons: int | None = Field(None, ge=0)
    cooldown_s: float | None = Field(None, ge=0)
    send_on_change: bool | None = None
    min_interval_s: float | None = Field(None, ge=0)
    describe_on: list[GateEvent] | None = None
    min_frames: int | None = Field(None, ge=1)
    max_descriptions: int | None = Field(None, ge=1)
    lost_frames: int | None = Field(None, ge=1)
    interval_s: float | None = Field(None, gt=0)


ClipFormat = Literal["frames", "video_url", "images"]


class CameraDescriberConfig(Section):
    """What the VLM sees of this camera's frames: the whole ``frame``, a padded ``crop``
    around the boxes that triggered the description (the union of the triggering tracks),
    the bounding rectangle of the zones (the required ones, else all: ``zone``), or a
    ``clip``: ``clip_frames`` frames sampled evenly over the last ``clip_seconds`` in which
    the triggering tracks were seen (per-frame gating: the camera's last frames), sent as one
    video and cropped to the padded union of those tracks' boxes over the clip unless
    ``clip_crop`` is false. A smaller image is fewer image tokens; motion needs a clip."""

    view: Literal["frame", "crop", "zone", "clip"] = "frame"
    crop_padding: float = Field(
        0.25, ge=0, le=4, description="crop: margin added on each side, as a share of the box"
    )
    min_crop: int = Field(96, ge=16, description="crop: smallest side in pixels")
    clip_frames: int = Field(
        8,
        ge=2,
        le=32,
        description="clip: frames in the clip (our server takes at most --max-video-frames, "
        "8 by default)",
    )
    clip_seconds: float | None = Field(
        None,
        gt=0,
        le=120,
        description="clip: how far back the clip reaches; default clip_frames / fps (the "
        "last clip_frames sampled frames)",
    )
    clip_crop: bool = Field(
        True, description="clip: crop to the padded union of the tracks' boxes over the clip"
    )
    response_schema: dict[str, Any] | None = Field(
        None,
        description="a JSON schema of the fields to get for this camera's frames (people "
        "count, activity, threat level ...): sent as response_format json_schema (strict), "
        "and the parsed answer is stored as the event's structured fields and published",
    )

    @model_validator(mode="after")
    def _clip_settings_need_the_clip_view(self) -> CameraDescriberConfig:
        # a setting left at its default is no mistake (a dumped config carries them all)
        fields = type(self).model_fields
        stray = sorted(
            name
            for name in ("clip_frames", "clip_seconds", "clip_crop")
            if name in self.model_fields_set and getattr(self, name) != fields[name].default
        )
        if stray and self.view != "clip":
            raise ValueError(
                f"{', '.join(stray)}: only used with view: clip (view is {self.view!r})"
            )
        return self

    @field_validator("response_schema")
    @classmethod
    def _schema_is_an_object(cls, value: dict[str, Any] | None) -> dict[str, Any] | None:
        if value is not None and not value:
            raise ValueError("response_schema: an empty schema constrains nothing; omit it")
        if value is not None and not isinstance(value.get("type", "object"), str | list):
            raise ValueError("response_schema: 'type' must be a JSON schema type")
        return value


class CameraConfig(Section):
    """One camera. ``url``: rtsp://..., a video file path, or a device index (int)."""

    id: str
    url: str | int
    fps: float = Field(2.0, gt=0.0, le=60.0, description="frames per second to sample")
    prompt: str | None = None
    detector: DetectorOverrides = Field(default_factory=DetectorOverrides)
    realtime: bool = Field(
        True, description="files: play at their own frame rate, like a live camera"
    )
    loop: bool = Field(True, description="files: start again at the end")
    gate: GateOverrides = Field(default_factory=GateOverrides)
    zones: dict[str, ZoneConfig] = Field(default_factory=dict)
    required_zones: list[str] = Field(
        default_factory=list,
        description="only detections in one of these zones are described (none: anywhere)",
    )
    objects: ObjectsConfig = Field(default_factory=ObjectsConfig)
    describer: CameraDescriberConfig = Field(default_factory=CameraDescriberConfig)

    @model_validator(mode="after")
    def _zones_exist(self) -> CameraConfig:
        for name in self.required_zones:
            if name not in self.zones:
                known = ", ".join(sorted(self.zones)) or "none configured"
                raise ValueError(f"required_zones: no zone named {name!r} (zones: {known})")
        if self.describer.view == "zone" and not self.zones:
            raise ValueError("describer.view: 'zone' needs at least one entry in zones")
        if self.describer.view == "clip":
            self._clip_fits_the_rate()
        return self

    def _clip_fits_the_rate(self) -> None:
        """The clip's window must hold ``clip_frames`` sampled frames, and the camera's ring
        buffer (``pipelines.clips``) must stay small."""
        d = self.describer
        if d.clip_seconds is None:
            return
        held = d.clip_seconds * self.fps
        if held + 1e-9 < d.clip_frames:
            raise ValueError(
                f"describer.clip_seconds: {d.clip_seconds:g} s at fps {self.fps:g} holds "
                f"{held:g} sampled frames, fewer than clip_frames {d.clip_frames}: raise "
                f"clip_seconds to {d.clip_frames / self.fps:g} (or fps), or lower clip_frames"
            )
        if held > CLIP_MAX_WINDOW_FRAMES:
            raise ValueError(
                f"describer.clip_seconds: {d.clip_seconds:g} s at fps {self.fps:g} is "
                f"{held:g} frames to keep; at most {CLIP_MAX_WINDOW_FRAMES} (lower "
                "clip_seconds or fps)"
            )

    @property
    def clip_seconds(self) -> float:
        """How far back a clip of this camera reaches (``describer.clip_seconds`` or
        ``clip_frames`` sampled frames)."""
        d = self.describer
        return d.clip_seconds if d.clip_seconds is not None else d.clip_frames / self.fps

    @field_validator("id")
    @classmethod
    def _id_is_a_key(cls, value: str) -> str:
        # ids become Redis key parts and Prometheus labels: keep them plain
        if not CAMERA_ID.match(value):
            raise ValueError("use 1-64 of letters, digits, '_', '.', '-' (start alphanumeric)")
        return value

    @field_validator("url")
    @classmethod
    def _url_is_a_source(cls, value: str | int) -> str | int:
        if isinstance(value, int):
            if value < 0:
                raise ValueError("a device index must be >= 0")
            return value
        value = value.strip()
        if not value:
            raise ValueError("must not be empty")
        if value.isdigit():
            return int(value)
        if "://" in value:
            scheme = value.split("://", 1)[0].lower()
            if scheme not in URL_SCHEMES:
                raise ValueError(f"unsupported scheme {scheme!r}; use one of {URL_SCHEMES}")
        return value

    @property
    def is_file(self) -> bool:
        """A local video file (paced and looped here), as opposed to a live stream or device."""
        return isinstance(self.url, str) and ("://" not in self.url or self.url.startswith("file:"))


class IngestConfig(Section):
    """How cameras are opened and re-opened."""

    ffmpeg_options: str = Field(
        "rtsp_transport;tcp|analyzeduration;500000",
        description="OPENCV_FFMPEG_CAPTURE_OPTIONS: RTSP over TCP, short stream probe",
    )
    open_timeout_s: float = Field(10.0, gt=0)
    read_timeout_s: float = Field(5.0, gt=0)
    backoff_initial_s: float = Field(0.5, gt=0)
    backoff_max_s: float = Field(30.0, gt=0)


class DetectorConfig(Section):
    """The shared YOLO model. ``weights`` ending in ``.yaml`` builds an untrained model."""

    weights: str = "yolo26n.pt"
    conf: float = Field(0.25, ge=0.0, le=1.0)
    iou: float = Field(
        0.6,
        gt=0.0,
        le=1.0,
        description="a box overlapping a higher-scored one of its class by more than this IoU "
        "is a duplicate and dropped (YOLO26's end-to-end head skips NMS; 1 keeps every box)",
    )
    nested: float | None = Field(
        0.8,
        gt=0.0,
        le=1.0,
        description="a box with at least this share of its area inside a box of its class "
        "scoring twice as high is a part of it (a head-and-torso box) and dropped, and of two "
        "such boxes at IoU 0.5 or more (one object) the lower-scored goes; null keeps nested "
        "boxes",
    )
    imgsz: int = Field(640, ge=32, le=4096)
    classes: list[int] = Field(default_factory=lambda: [0], description="COCO 0 = person")
    device: str = "cpu"
    max_batch: int = Field(16, ge=1, le=256)
    download: bool = Field(
        False, description="let Ultralytics fetch a missing asset such as yolo26n.pt (online)"
    )


class GateConfig(Section):
    """Which detected frames are worth a description."""

    min_persons: int = Field(1, ge=0, description="0 sends frames without people too")
    cooldown_s: float = Field(10.0, ge=0, description="at most one frame per camera per cooldown")
    send_on_change: bool = Field(True, description="a change of person count skips the cooldown")
    min_interval_s: float = Field(1.0, ge=0, description="floor between two frames of a camera")
    describe_on: list[GateEvent] = Field(
        default_factory=lambda: ["frame"],
        description="frame: the per-frame gate above; or per tracked object, any of "
        "track_start (once significant), track_end (lost for lost_frames), interval "
        "(again every interval_s while it stays)",
    )
    min_frames: int = Field(
        3,
        ge=1,
        description="frames a track is seen (anywhere) to be significant; with required "
        "zones, a track is described once it is significant and in one of them (the zone's "
        "inertia and loitering_time)",
    )
    max_descriptions: int = Field(3, ge=1, description="descriptions per track at most")
    lost_frames: int = Field(10, ge=1, description="frames unseen before a track has ended")
    interval_s: float = Field(60.0, gt=0, description="interval: seconds between descriptions")

    @field_validator("describe_on")
    @classmethod
    def _events(cls, value: list[str]) -> list[str]:
        if not value:
            raise ValueError("name at least one of frame, track_start, track_end, interval")
        if "frame" in value and len(set(value)) > 1:
            raise ValueError("'frame' is the per-frame gate: it cannot be mixed with track events")
        return list(dict.fromkeys(value))

    @property
    def tracks(self) -> bool:
        """Per-track gating (the camera runs a tracker) rather than per-frame."""
        return "frame" not in self.describe_on


class TrackerConfig(Section):
    """The per-camera multi-object tracker: Ultralytics' ByteTrack or BoT-SORT, configured
    from its ``cfg/trackers/<type>.yaml``; a field set here replaces that file's value."""

    type: Literal["bytetrack", "botsort"] = "bytetrack"
    track_high_thresh: float | None = Field(None, ge=0, le=1)
    track_low_thresh: float | None = Field(None, ge=0, le=1)
    new_track_thresh: float | None = Field(None, ge=0, le=1)
    track_buffer: int | None = Field(None, ge=1, description="frames a lost track is kept")
    match_thresh: float | None = Field(None, ge=0, le=1)
    fuse_score: bool | None = Field(
        None,
        description="match on IoU x detection score (Ultralytics' default: true); a detector "
        "whose scores sit near its threshold (a small trained one) needs false, or a track's "
        "second frame never matches it and the track never confirms",
    )
    gmc_method: str | None = Field(
        "none", description="botsort: camera-motion compensation; fixed cameras need none"
    )


class QueueConfig(Section):
    """Redis keys and bounds. Streams hold metadata; each JPEG is its own key with a TTL."""

    frames_stream: str = "vs:frames"
    group: str = "describers"
    descriptions_stream: str = "vs:descriptions"
    dead_letter_stream: str = "vs:frames:dead"
    latest_prefix: str = "vs:latest:"
    image_prefix: str = "vs:frame:"
    stats_key: str = "vs:stats"
    maxlen: int = Field(
        1000, ge=10, description="undelivered frames the stream holds (more are refused)"
    )
    descriptions_maxlen: int = Field(10000, ge=10)
    dead_letter_maxlen: int = Field(10000, ge=10)
    image_ttl_s: int = Field(300, ge=1)
    max_frame_age_s: float = Field(60.0, gt=0, description="older frames expire unsent")
    jpeg_quality: int = Field(85, ge=10, le=100)
    max_image_side: int = Field(1280, ge=64, description="larger frames are downscaled")
    max_clip_bytes: int = Field(
        8 * 1024 * 1024,
        ge=64 * 1024,
        description="a clip's JPEGs together (describer.view: clip); a larger clip is not "
        "enqueued, counted dropped:clip_too_large",
    )
    local_buffer: int = Field(64, ge=1, description="frames held while Redis is unreachable")
    dedupe_prefix: str = "vs:enqueued:"
    producer_prefix: str = "vs:producer:"
    camera_prefix: str = Field(
        "vs:camera:",
        description="<camera_prefix><camera id>: the pipeline's live numbers for the camera, "
        "refreshed every heartbeat_s, expiring after three (a stopped pipeline's go offline)",
    )
    instance: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$",
        description="this pipeline's name in <producer_prefix><instance> (default: the "
        "hostname); one running pipeline per name, kept across its restarts",
    )
    heartbeat_s: float = Field(
        1.0,
        gt=0,
        description="how often the pipeline records its locally buffered frames and its "
        "cameras' live numbers",
    )
    producer_ttl_s: int = Field(
        86400, ge=1, description="how long a stopped pipeline's record waits for its restart"
    )


class EndpointConfig(Section):
    """One OpenAI-compatible server (ours, vLLM, llama.cpp's ``llama-server``, a hosted API).

    ``api_key`` / ``model`` left unset take the describer's. ``health_url`` / ``metrics_url``
    default to ``/health`` and ``/metrics`` at the server's root (``base_url`` without its
    ``/v1``); ``""`` turns one off (a hosted API has neither: the endpoint is then judged by
    its answers alone).
    """

    base_url: str
    api_key: str | None = None
    model: str | None = None
    name: str | None = Field(
        None, description="label in metrics and logs (default: host:port of base_url)"
    )
    health_url: str | None = None
    metrics_url: str | None = None
    clip_format: ClipFormat | None = Field(
        None, description="how clips go to this endpoint (default: describer.clip_format)"
    )

    @field_validator("base_url")
    @classmethod
    def _http_url(cls, value: str) -> str:
        from urllib.parse import urlsplit

        value = value.strip().rstrip("/")
        if not value.startswith(("http://", "https://")) or not urlsplit(value).hostname:
            raise ValueError(
                "must be an http:// or https:// URL with a host, e.g. http://vlm:8000/v1"
            )
        return value

    @property
    def root(self) -> str:
        """The server's root: ``base_url`` without a trailing ``/v1``."""
        return self.base_url.removesuffix("/v1")

    @property
    def label(self) -> str:
        from urllib.parse import urlsplit

        if self.name:
            return self.name
        parts = urlsplit(self.base_url)
        return parts.netloc.rpartition("@")[2] or self.base_url

    @property
    def health(self) -> str:
        return self.root + "/health" if self.health_url is None else self.health_url

    @property
    def metrics(self) -> str:
        return self.root + "/metrics" if self.metrics_url is None else self.metrics_url


class DescriberConfig(Section):
    """The OpenAI-compatible endpoints and how workers use them.

    ``endpoints``: several servers, balanced by their queue depth (scraped from ``/metrics``,
    else this worker's requests in flight to each), taken out of rotation while they fail
    and put back when they recover (``pipelines.endpoints``). ``base_url`` alone is the
    one-endpoint form; giving both is an error.
    """

    base_url: str = "http://127.0.0.1:8000/v1"
    endpoints: list[EndpointConfig] = Field(default_factory=list)
    api_key: str = "EMPTY"
    model: str | None = None
    prompt: str = "Describe the people in this camera frame and what they are doing, briefly."
    max_pixels: int | None = Field(
        None,
        ge=1,
        description="frames are downscaled to at most this many pixels before sending (image "
        "tokens scale with pixels); None sends them as queued",
    )
    clip_format: ClipFormat = Field(
        "frames",
        description="how a clip (describer.view: clip) is sent: frames = one video part "
        "listing frame data URLs (vision-serve); video_url = one MP4 data URL (vLLM); images "
        "= one image_url part per frame (servers without video input, e.g. llama.cpp)",
    )
    max_tokens: int = Field(128, ge=1)
    temperature: float = Field(0.0, ge=0.0)
    timeout_s: float = Field(60.0, gt=0)
    retries: int = Field(2, ge=0, le=10, description="SDK retries per attempt")
    concurrency: int = Field(4, ge=1, le=256)
    priority: str | int | None = Field("batch", description="sent as extra_body priority")
    send_deadline: bool = Field(
        True,
        description="send the frame's remaining age as extra_body max_queue_seconds, so the "
        "server drops it unstarted once stale (vision-serve and vLLM-style servers accept it)",
    )
    block_ms: int = Field(1000, ge=10, le=60000)
    claim_idle_s: float = Field(30.0, gt=0, description="pending this long = worker is dead")
    claim_interval_s: float = Field(5.0, gt=0)
    max_deliveries: int = Field(5, ge=1, description="then the frame goes to the dead letters")
    max_failures: int = Field(
        3, ge=1, description="server errors (HTTP 500...) one frame may get, then it is dead"
    )
    backoff_initial_s: float = Field(0.5, gt=0)
    backoff_max_s: float = Field(10.0, gt=0)
    shutdown_grace_s: float = Field(10.0, ge=0)
    consumer_gc_s: float = Field(3600.0, gt=0, description="forget idle consumers with nothing")
    probe_interval_s: float = Field(
        2.0, gt=0, description="how often each endpoint's /health and /metrics are read"
    )
    down_after_errors: int = Field(
        3, ge=1, description="consecutive server errors (HTTP 5xx) that take an endpoint out"
    )

    @model_validator(mode="after")
    def _one_way_to_name_endpoints(self) -> DescriberConfig:
        if self.endpoints and "base_url" in self.model_fields_set:
            raise ValueError(
                "give either describer.base_url (env VS_DESCRIBER__BASE_URL) or "
                "describer.endpoints (env VS_DESCRIBER__ENDPOINTS, as JSON), not both"
            )
        labels = [e.label for e in self.endpoints]
        if len(set(labels)) != len(labels):
            raise ValueError(f"describer.endpoints: duplicate endpoint names {labels}; set name")
        return self

    def endpoint_list(self) -> list[EndpointConfig]:
        """The endpoints to use: ``endpoints``, else ``base_url`` as the only one."""
        return list(self.endpoints) or [EndpointConfig(base_url=self.base_url)]


class MetricsConfig(Section):
    """Prometheus endpoints; port 0 disables one."""

    host: str = "0.0.0.0"
    pipeline_port: int = Field(9101, ge=0, le=65535)
    describe_port: int = Field(9102, ge=0, le=65535)


def redacted_redis_url(url: str) -> str:
    """``url`` fit for a log line or an error message: password (and any ``password=``
    query value) replaced by ``***``; a URL too broken to tell where its password ends is
    shown as ``scheme://***``."""
    from urllib.parse import urlsplit

    scheme = url.partition("://")[0] if "://" in url else "redis"
    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018  (raises on a port that is not a number)
    except ValueError:
        return f"{scheme}://***"
    if "@" in url and "@" not in parts.netloc:  # a '/', '?' or '#' in the password
        return f"{scheme}://***"
    if "@" in parts.netloc:
        userinfo, _, host = parts.netloc.rpartition("@")
        user, colon, _ = userinfo.partition(":")
        # user-only userinfo may be a password given without the ':' (redis://secret@host)
        url = url.replace(parts.netloc, f"{user}:***@{host}" if colon else f"***@{host}", 1)
    base, question, rest = url.partition("?")
    query, hash_, fragment = rest.partition("#")
    pairs = [
        p.partition("=")[0] + "=***" if "password" in p.lower() else p for p in query.split("&")
    ]
    return base + question + "&".join(pairs) + hash_ + fragment


class PipelineConfig(BaseSettings):
    """The whole file."""

    model_config = SettingsConfigDict(
        env_prefix=ENV_PREFIX,
        env_nested_delimiter="__",
        extra="forbid",
        validate_assignment=True,
    )

    redis_url: str = "redis://127.0.0.1:6379/0"
    cameras: list[CameraConfig] = Field(default_factory=list)
    ingest: IngestConfig = Field(default_factory=IngestConfig)
    detector: DetectorConfig = Field(default_factory=DetectorConfig)
    gate: GateConfig = Field(default_factory=GateConfig)
    tracker: TrackerConfig = Field(default_factory=TrackerConfig)
    queue: QueueConfig = Field(default_factory=QueueConfig)
    describer: DescriberConfig = Field(default_factory=DescriberConfig)
    metrics: MetricsConfig = Field(default_factory=MetricsConfig)
    events: EventsConfig = Field(default_factory=EventsConfig)
    ui: UIConfig = Field(default_factory=UIConfig)
    notify: NotifyConfig = Field(default_factory=NotifyConfig)
    log_level: Literal["DEBUG", "INFO", "WARNING", "ERROR"] = "INFO"

    @classmethod
    def settings_customise_sources(
        cls,
        settings_cls: type[BaseSettings],
        init_settings: PydanticBaseSettingsSource,
        env_settings: PydanticBaseSettingsSource,
        dotenv_settings: PydanticBaseSettingsSource,
        file_secret_settings: PydanticBaseSettingsSource,
    ) -> tuple[PydanticBaseSettingsSource, ...]:
        # environment first: it overrides the YAML file (passed as init values)
        return (env_settings, init_settings)

    @field_validator("redis_url")
    @classmethod
    def _redis_url(cls, value: str) -> str:
        # the messages never repeat the URL: it may carry a password
        from urllib.parse import urlsplit

        from pipelines import redis_urls

        schemes = (
            *redis_urls.PLAIN_SCHEMES,
            *redis_urls.SENTINEL_SCHEMES,
            *redis_urls.CLUSTER_SCHEMES,
        )
        if redis_urls.scheme_of(value) not in schemes:
            raise ValueError(f"must start with one of {', '.join(s + '://' for s in schemes)}")
        if value.startswith("unix://"):
            return value
        if redis_urls.is_sentinel(value):
            redis_urls.parse_sentinel_url(value)  # its errors never repeat the URL
            return value
        try:
            parts = urlsplit(value)
            parts.port  # noqa: B018  (raises on a port that is not a number)
        except ValueError:
            parts = None
        if parts is None or not parts.hostname:
            raise ValueError(
                "no host[:port] found; a password with '/', '?', '#' or '%' must be "
                "percent-encoded (or use one of letters and digits: openssl rand -hex 32)"
            )
        return value

    @model_validator(mode="after")
    def _cluster_keys_share_a_slot(self) -> PipelineConfig:
        from pipelines import redis_urls

        if redis_urls.is_cluster(self.redis_url):
            q = self.queue
            names = ("frames_stream", "descriptions_stream", "dead_letter_stream", "stats_key")
            names += ("latest_prefix", "image_prefix", "dedupe_prefix", "producer_prefix")
            names += ("camera_prefix",)
            problem = redis_urls.cluster_key_problem({n: getattr(q, n) for n in names})
            if problem:
                raise ValueError(f"redis_url is a cluster: {problem}")
        return self

    @model_validator(mode="after")
    def _unique_camera_ids(self) -> PipelineConfig:
        seen: set[str] = set()
        for camera in self.cameras:
            if camera.id in seen:
                raise ValueError(f"cameras: duplicate camera id {camera.id!r}")
            seen.add(camera.id)
            try:
                self.gate_for(camera.id)
            except ValidationError as exc:
                why = "; ".join(e["msg"] for e in exc.errors())
                raise ValueError(f"cameras: {camera.id!r}: gate: {why}") from None
        return self

    @model_validator(mode="after")
    def _zone_timing_needs_tracks(self) -> PipelineConfig:
        # after _unique_camera_ids: every camera's gate resolves
        for camera in self.cameras:
            if not self.gate_for(camera.id).tracks:
                problem = zone_timing_without_tracks(camera.zones)
                if problem:
                    raise ValueError(f"cameras: {camera.id!r}: {problem}")
        return self

    def camera(self, camera_id: str) -> CameraConfig | None:
        """The camera with this id, if configured (describers use it for the prompt)."""
        return next((c for c in self.cameras if c.id == camera_id), None)

    def gate_for(self, camera_id: str) -> GateConfig:
        """The global ``gate`` with the camera's ``gate`` overrides applied."""
        camera = self.camera(camera_id)
        if camera is None:
            return self.gate
        changes = camera.gate.model_dump(exclude_none=True)
        return GateConfig(**{**self.gate.model_dump(), **changes}) if changes else self.gate

    def prompt_for(self, camera_id: str) -> str:
        """Per-camera prompt if set, else the describer's."""
        camera = self.camera(camera_id)
        return camera.prompt if camera and camera.prompt else self.describer.prompt


def _describe_errors(exc: ValidationError) -> str:
    lines = []
    for err in exc.errors():
        where = ".".join(str(p) for p in err["loc"]) or "(top level)"
        got = err.get("input")
        if err["loc"] and err["loc"][-1] == "redis_url" and isinstance(got, str):
            got = redacted_redis_url(got)  # never echo a password into logs
        shown = "" if isinstance(got, dict | list) or got is None else f" (got {got!r})"
        lines.append(f"  {where}: {err['msg']}{shown}")
    return "\n".join(lines)


def parse_config(data: dict[str, Any] | None, source: str = "<config>") -> PipelineConfig:
    """Validate a config mapping (plus ``VS_*`` env overrides); ConfigError names each field."""
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise ConfigError(f"{source}: the top level must be a mapping, got {type(data).__name__}")
    try:
        return PipelineConfig(**data)
    except ValidationError as exc:
        raise ConfigError(f"{source}: invalid configuration\n{_describe_errors(exc)}") from None


def load_config(path: str | Path) -> PipelineConfig:
    """Read and validate a YAML config file."""
    path = Path(path)
    try:
        text = path.read_text()
    except OSError as exc:
        raise ConfigError(f"{path}: cannot read config: {exc.strerror or exc}") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as exc:
        raise ConfigError(f"{path}: not valid YAML: {exc}") from None
    return parse_config(data, str(path))
