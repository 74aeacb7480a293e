"""The ``notify:`` section of the cameras file: where descriptions are sent, and how hard.

Secrets (the broker password, each webhook's signing secret) are ``SecretStr``: they print
as ``**********`` in any repr, log line or error, and come from the environment like every
other field -- ``VS_NOTIFY__MQTT__PASSWORD``, and per webhook
``VS_NOTIFY__WEBHOOK_SECRETS__<NAME>`` (a list item cannot be addressed by an environment
variable, a name can).
"""

from __future__ import annotations

import re
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

SINK_NAME = re.compile(r"^[a-z0-9][a-z0-9_]{0,63}$")
TOPIC_PART = re.compile(r"^[^#+\s]+$")


class Section(BaseModel):
    """As ``pipelines.config.Section`` (which imports this module, so it cannot be imported
    here): unknown keys are errors, values are validated on assignment."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


def _numbers_as_text(value: Any) -> Any:
    # YAML reads `password: 123456` as an int; a secret is text (and an error would echo it)
    return str(value) if isinstance(value, int | float) and not isinstance(value, bool) else value


class MqttConfig(Section):
    """An MQTT broker (Mosquitto, Home Assistant's add-on...). QoS 1 throughout."""

    host: str = Field(min_length=1)
    port: int = Field(1883, ge=1, le=65535)
    username: str | None = None
    password: SecretStr | None = None
    client_id: str | None = Field(
        None, description="default vision-serve-notify-<hostname>; unique per broker"
    )
    tls: bool = False
    ca_certs: str | None = Field(None, description="CA bundle (PEM); default: the system's")
    certfile: str | None = Field(None, description="client certificate (PEM), if required")
    keyfile: str | None = None
    topic_prefix: str = "vision-serve"
    discovery: bool = Field(True, description="Home Assistant MQTT discovery")
    discovery_prefix: str = "homeassistant"
    keepalive_s: int = Field(30, ge=5, le=3600)
    publish_timeout_s: float = Field(10.0, gt=0, description="wait this long for a PUBACK")

    _password = field_validator("password", mode="before")(_numbers_as_text)

    @field_validator("topic_prefix", "discovery_prefix")
    @classmethod
    def _plain_topic(cls, value: str) -> str:
        value = value.strip("/")
        if not value or not TOPIC_PART.match(value):
            raise ValueError("a topic prefix: not empty, no '+', '#' or spaces")
        return value


class WebhookConfig(Section):
    """One HTTPS endpoint that receives each event as a signed JSON POST."""

    url: str = Field(repr=False)  # may carry a token
    name: str | None = Field(
        None,
        description="the sink's name in metrics, dead letters, its consumer group and "
        "VS_NOTIFY__WEBHOOK_SECRETS__<NAME>; default: the URL's host, '.'/'-' as '_'",
    )
    secret: SecretStr | None = Field(None, description="HMAC-SHA256 key (or from the env)")
    timeout_s: float = Field(10.0, gt=0, le=300)
    max_attempts: int = Field(8, ge=1, le=100, description="then the event is dead-lettered")

    _secret = field_validator("secret", mode="before")(_numbers_as_text)

    @field_validator("url", mode="before")
    @classmethod
    def _strip(cls, value: Any) -> Any:
        return value.strip() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _http_url(self) -> WebhookConfig:
        # checked here, not as a field: a field's error message would repeat the URL, and
        # it may carry a token
        try:
            parts = urlsplit(self.url)
            ok = parts.scheme in ("http", "https") and bool(parts.hostname)
        except ValueError:
            ok = False
        if not ok:
            raise ValueError("url: must be an http:// or https:// URL with a host")
        return self

    @field_validator("name")
    @classmethod
    def _name(cls, value: str | None) -> str | None:
        if value is not None and not SINK_NAME.match(value):
            raise ValueError("use 1-64 of lowercase letters, digits and '_' (start alphanumeric)")
        return value

    @property
    def sink_name(self) -> str:
        if self.name:
            return self.name
        host = urlsplit(self.url).hostname or "webhook"
        return re.sub(r"[^a-z0-9_]", "_", host.lower())[:64]


class NotifyConfig(Section):
    """``vision-serve notify``: descriptions -> MQTT and webhooks, at least once."""

    mqtt: MqttConfig | None = None
    webhooks: list[WebhookConfig] = Field(default_factory=list)
    webhook_secrets: dict[str, SecretStr] = Field(
        default_factory=dict,
        description="webhook name -> secret, for VS_NOTIFY__WEBHOOK_SECRETS__*",
    )
    group: str = Field(
        "notifiers", description="consumer groups <group>:<sink> on the descriptions stream"
    )
    consumer: str | None = Field(None, description="default: the hostname")
    dead_letter_stream: str = "vs:notify:dead"
    dead_letter_maxlen: int = Field(10000, ge=10)
    stats_key: str = "vs:notify:stats"
    concurrency: int = Field(8, ge=1, le=256, description="events in flight per sink")
    block_ms: int = Field(1000, ge=10, le=60000)
    claim_idle_s: float = Field(60.0, gt=0, description="pending this long = its notifier died")
    claim_interval_s: float = Field(5.0, gt=0)
    backoff_initial_s: float = Field(1.0, gt=0)
    backoff_max_s: float = Field(60.0, gt=0)
    max_event_age_s: float | None = Field(
        None, gt=0, description="older events are skipped (counted), not sent; None sends all"
    )
    shutdown_grace_s: float = Field(5.0, ge=0)
    metrics_port: int = Field(9103, ge=0, le=65535)

    @field_validator("webhook_secrets", mode="before")
    @classmethod
    def _secret_texts(cls, value: Any) -> Any:
        if isinstance(value, dict):
            return {str(k).lower(): _numbers_as_text(v) for k, v in value.items()}
        return value

    @model_validator(mode="after")
    def _webhooks_named_and_keyed(self) -> NotifyConfig:
        seen: set[str] = set()
        for i, hook in enumerate(self.webhooks):
            name = hook.sink_name
            if name in seen:
                raise ValueError(f"webhooks[{i}]: a second webhook named {name!r}; set `name`")
            seen.add(name)
            if not self.webhook_secret(hook):
                raise ValueError(
                    f"webhooks[{i}] ({name}): no secret; set `secret` or "
                    f"VS_NOTIFY__WEBHOOK_SECRETS__{name.upper()} (e.g. openssl rand -hex 32)"
                )
        return self

    def webhook_secret(self, hook: WebhookConfig) -> str:
        """The secret the environment gave for this webhook, else the file's ('' if none)."""
        secret = self.webhook_secrets.get(hook.sink_name) or hook.secret
        return secret.get_secret_value() if secret is not None else ""

    @property
    def sinks_configured(self) -> bool:
        return self.mqtt is not None or bool(self.webhooks)
