"""``vision-serve serve``: flags named as vLLM names them, environment defaults, a real run."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys

import httpx
import openai
import pytest

from tests.server.support import wait_until_healthy
from vision_serve.cli import build_parser
from vision_serve.server_cli import settings_from_namespace


def _parse(argv: list[str]):
    return build_parser(argv).parse_args(argv)


def test_serve_flags_parse_into_engine_args_and_settings():
    from engine.config import engine_args_from_namespace

    args = _parse(
        [
            "serve",
            "--model", "/ckpt/tiny",
            "--host", "0.0.0.0",
            "--port", "9000",
            "--served-model-name", "tiny", "tiny-alias",
            "--api-key", "k",
            "--dtype", "float32",
            "--max-num-batched-tokens", "256",
            "--max-num-seqs", "8",
            "--max-model-len", "2048",
            "--block-size", "32",
            "--no-chunked-prefill",
            "--max-queue-len", "5",
            "--allowed-media-domains", "cams.local", "example.com",
            "--allowed-local-media-path", "/data/frames",
        ]
    )  # fmt: skip
    engine_args = engine_args_from_namespace(args)
    settings = settings_from_namespace(args)

    assert callable(args.func)
    assert engine_args.model == "/ckpt/tiny" and engine_args.dtype == "float32"
    assert engine_args.max_num_batched_tokens == 256 and engine_args.max_num_seqs == 8
    assert engine_args.max_model_len == 2048 and engine_args.block_size == 32
    assert engine_args.enable_chunked_prefill is False and engine_args.max_queue_len == 5
    assert settings.host == "0.0.0.0" and settings.port == 9000
    assert settings.served_model_name == ["tiny", "tiny-alias"]
    assert settings.api_key == "k"
    assert settings.allowed_media_domains == ["cams.local", "example.com"]
    assert str(settings.allowed_local_media_path) == "/data/frames"


def test_environment_supplies_defaults_and_flags_win(monkeypatch):
    monkeypatch.setenv("VISION_SERVE_MODEL", "/env/model")
    monkeypatch.setenv("VISION_SERVE_MAX_NUM_SEQS", "3")
    monkeypatch.setenv("VISION_SERVE_PORT", "8123")
    monkeypatch.setenv("VISION_SERVE_API_KEY", "from-env")
    monkeypatch.setenv("VISION_SERVE_ALLOWED_MEDIA_DOMAINS", "a.example,b.example")
    from engine.config import engine_args_from_namespace

    args = _parse(["serve", "--port", "8200"])
    settings = settings_from_namespace(args)
    assert engine_args_from_namespace(args).model == "/env/model"
    assert engine_args_from_namespace(args).max_num_seqs == 3
    assert settings.port == 8200  # flag beats env
    assert settings.api_key == "from-env"
    assert settings.allowed_media_domains == ["a.example", "b.example"]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.timeout(120)
def test_serve_command_runs_a_real_server_configured_from_the_environment(checkpoint, tmp_path):
    port = _free_port()
    env = {
        **os.environ,
        "VISION_SERVE_MODEL": str(checkpoint),
        "VISION_SERVE_API_KEY": "cli-key",
        "VISION_SERVE_MAX_NUM_BATCHED_TOKENS": "128",
        "VISION_SERVE_NUM_THREADS": "1",
    }
    log_path = tmp_path / "serve.log"
    with open(log_path, "w") as log:
        proc = subprocess.Popen(
            [sys.executable, "-m", "vision_serve.cli", "serve", "--port", str(port),
             "--dtype", "float32", "--device", "cpu", "--served-model-name", "tiny"],
            env=env, stdout=log, stderr=subprocess.STDOUT,
        )  # fmt: skip
    base = f"http://127.0.0.1:{port}"
    try:
        wait_until_healthy(proc, base, log_path, timeout_s=90)

        with openai.OpenAI(base_url=base + "/v1", api_key="cli-key", max_retries=0) as client:
            resp = client.chat.completions.create(
                model="tiny", messages=[{"role": "user", "content": "Hi"}], max_tokens=3
            )
        assert resp.model == "tiny"
        assert httpx.get(base + "/v1/models").status_code == 401  # key from the environment
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            rc = proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
    assert rc == 0, log_path.read_text()
    lines = [json.loads(line.split(" ", 4)[4]) for line in log_path.read_text().splitlines()
             if " vision_serve.requests " in line]  # fmt: skip
    assert [line["id"] for line in lines] == [resp.id.removeprefix("chatcmpl-")]


def test_an_empty_api_key_is_refused_not_treated_as_a_key():
    """An empty key would let any ``Authorization: Bearer`` header in."""
    import pydantic

    from vision_serve.settings import ServerSettings

    with pytest.raises(pydantic.ValidationError, match="api_key is empty"):
        ServerSettings(api_key=" ")
