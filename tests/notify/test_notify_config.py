"""The ``notify:`` section: secrets from the environment under the usual ``VS_`` names, never
shown back (repr, errors), and mistakes named by field."""

from __future__ import annotations

import pytest

from pipelines.config import ConfigError, parse_config

HOOK = {"url": "https://hooks.example.com/api/webhook/abc?token=t0ken", "secret": "file-secret"}


@pytest.fixture(autouse=True)
def _no_vs_env(monkeypatch):
    import os

    for key in list(os.environ):
        if key.startswith("VS_"):
            monkeypatch.delenv(key)


def test_notify_is_off_by_default():
    config = parse_config({})
    assert config.notify.mqtt is None and config.notify.webhooks == []
    assert not config.notify.sinks_configured


def test_the_broker_password_and_webhook_secrets_come_from_the_environment(monkeypatch):
    monkeypatch.setenv("VS_NOTIFY__MQTT__PASSWORD", "env-mqtt-pass")
    monkeypatch.setenv("VS_NOTIFY__WEBHOOK_SECRETS__HOOKS_EXAMPLE_COM", "env-hook-secret")
    config = parse_config({"notify": {"mqtt": {"host": "broker"}, "webhooks": [{**HOOK}]}})
    assert config.notify.mqtt.host == "broker"
    assert config.notify.mqtt.password.get_secret_value() == "env-mqtt-pass"
    (hook,) = config.notify.webhooks
    assert hook.sink_name == "hooks_example_com"  # the default name: the URL's host
    assert config.notify.webhook_secret(hook) == "env-hook-secret"  # the env wins


def test_the_whole_broker_can_come_from_the_environment(monkeypatch):
    """compose sets VS_NOTIFY__MQTT__HOST / __PASSWORD; the file need not mention MQTT."""
    monkeypatch.setenv("VS_NOTIFY__MQTT__HOST", "mosquitto")
    monkeypatch.setenv("VS_NOTIFY__MQTT__USERNAME", "vision-serve")
    monkeypatch.setenv("VS_NOTIFY__MQTT__PASSWORD", "pw")
    config = parse_config({"cameras": [{"id": "cam", "url": "/v.mp4"}]})
    assert config.notify.mqtt.host == "mosquitto" and config.notify.sinks_configured


def test_secrets_never_show_in_a_repr_or_a_dump():
    config = parse_config({"notify": {"mqtt": {"host": "b", "password": 12345678},
                                      "webhooks": [HOOK]}})  # fmt: skip
    shown = repr(config) + str(config.model_dump(mode="json"))
    assert "12345678" not in shown and "file-secret" not in shown
    assert "t0ken" not in repr(config)  # a webhook URL may carry a token: not in the repr
    assert config.notify.mqtt.password.get_secret_value() == "12345678"  # YAML int -> text


def test_a_webhook_without_a_secret_is_refused_with_the_variable_to_set():
    with pytest.raises(ConfigError) as err:
        parse_config({"notify": {"webhooks": [{"url": HOOK["url"], "name": "ha"}]}})
    assert "webhooks[0] (ha): no secret" in str(err.value)
    assert "VS_NOTIFY__WEBHOOK_SECRETS__HA" in str(err.value)


def test_two_webhooks_on_one_host_need_names():
    with pytest.raises(ConfigError, match="a second webhook named 'hooks_example_com'"):
        parse_config({"notify": {"webhooks": [HOOK, {**HOOK, "url": HOOK["url"] + "2"}]}})
    config = parse_config({"notify": {"webhooks": [HOOK, {**HOOK, "name": "second"}]}})
    assert [h.sink_name for h in config.notify.webhooks] == ["hooks_example_com", "second"]


@pytest.mark.parametrize(
    ("notify", "field"),
    [
        ({"mqtt": {"host": "b", "prot": 1}}, "notify.mqtt.prot"),
        ({"mqtt": {"host": "b", "topic_prefix": "a/#"}}, "notify.mqtt.topic_prefix"),
        ({"webhooks": [{**HOOK, "url": "ftp://x/?token=t0ken"}]}, "notify.webhooks.0"),
        ({"webhooks": [{**HOOK, "name": "Has Space"}]}, "notify.webhooks.0.name"),
        ({"webhooks": [{**HOOK, "max_attempts": 0}]}, "notify.webhooks.0.max_attempts"),
        ({"concurrency": 0}, "notify.concurrency"),
    ],
)
def test_mistakes_are_named_by_field(notify, field):
    with pytest.raises(ConfigError) as err:
        parse_config({"notify": notify})
    assert f"  {field}:" in str(err.value)
    assert "t0ken" not in str(err.value)  # an invalid URL is not echoed


def test_the_example_file_documents_the_notify_section():
    from pathlib import Path

    import yaml

    example = Path(__file__).resolve().parents[2] / "pipelines" / "cameras.example.yaml"
    text = example.read_text()
    assert "# notify:" in text and "VS_NOTIFY__MQTT__PASSWORD" in text
    # uncommented, the block is a valid section
    lines = text.split("# notify:", 1)[1].splitlines()
    block = ["notify:"] + [ln[2:] for ln in lines[1:] if ln.startswith("#   ")]
    section = yaml.safe_load("\n".join(block))["notify"]
    section["webhooks"][0]["secret"] = "s"
    assert parse_config({"notify": section}).notify.sinks_configured
