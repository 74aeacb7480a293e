"""Requests that used to crash or mislead the engine are refused at the door with OpenAI's
400, and the server answers normally afterwards."""

from __future__ import annotations

import math
from typing import Any

import httpx
import openai
import pytest
import torch

from engine.errors import InvalidRequestError, PromptTooLongError
from engine.sampling_params import MAX_STOP_STRING_CHARS, SEED_MAX, SEED_MIN, SamplingParams
from tests.server.support import ServerHandle

pytestmark = pytest.mark.timeout(120)

MESSAGES = [{"role": "user", "content": "Hello there."}]


def post(server: ServerHandle, path: str = "/v1/chat/completions", **body: Any) -> httpx.Response:
    body.setdefault("model", server.model)
    if path.endswith("chat/completions"):
        body.setdefault("messages", MESSAGES)
    body.setdefault("max_tokens", 2)
    with server.http() as http:
        return http.post(path, json=body)


def assert_400(resp: httpx.Response, param: str, code: str | None = None) -> dict[str, Any]:
    assert resp.status_code == 400, resp.text
    body = resp.json()
    assert set(body) == {"error"}
    assert set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == "invalid_request_error"
    assert body["error"]["param"] == param
    assert body["error"]["message"]
    if code is not None:
        assert body["error"]["code"] == code
    return body["error"]


def assert_serves_normally(server: ServerHandle) -> None:
    with server.client() as client:
        resp = client.chat.completions.create(
            model=server.model, messages=MESSAGES, max_tokens=3, seed=7, temperature=1.0
        )
    assert resp.choices[0].finish_reason in ("stop", "length")
    assert resp.usage.completion_tokens >= 1
    assert server.engine.is_alive()
    assert httpx.get(server.base_url + "/health").status_code == 200


@pytest.mark.parametrize("seed", [2**64, 2**63, SEED_MIN - 1, -(2**64)])
def test_seed_outside_signed_64_bits_is_400_and_the_engine_survives(healthy, seed):
    error = assert_400(post(healthy, seed=seed), param="seed")
    assert "64-bit" in error["message"]
    with healthy.client() as client, pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=healthy.model, messages=MESSAGES, max_tokens=2, seed=seed
        )
    assert exc.value.param == "seed"
    assert_serves_normally(healthy)


@pytest.mark.parametrize("seed", [SEED_MAX, SEED_MIN, -1, 0])
def test_seeds_at_the_ends_of_the_range_are_served(healthy, seed):
    """The accepted range is one torch takes: the bounds reach the generator and work."""
    with healthy.client() as client:
        first, second = (
            client.chat.completions.create(
                model=healthy.model, messages=MESSAGES, max_tokens=4, seed=seed, temperature=1.0
            )
            for _ in range(2)
        )
    assert first.usage.completion_tokens >= 1
    assert first.choices[0].message.content == second.choices[0].message.content
    assert healthy.engine.is_alive()


def test_too_many_empty_or_long_stop_strings_are_400(healthy):
    error = assert_400(post(healthy, stop=["a", "b", "c", "d", "e"]), param="stop")
    assert "at most 4" in error["message"]
    assert_400(post(healthy, stop=["a", ""]), param="stop")
    assert_400(post(healthy, stop="x" * (MAX_STOP_STRING_CHARS + 1)), param="stop")
    assert_400(post(healthy, "/v1/completions", prompt="Hi", stop=list("abcde")), param="stop")
    ok = post(healthy, stop=["a", "b", "c", "x" * MAX_STOP_STRING_CHARS])
    assert ok.status_code == 200, ok.text
    assert_serves_normally(healthy)


def _prompt_tokens(server: ServerHandle) -> int:
    with server.client() as client:
        resp = client.chat.completions.create(model=server.model, messages=MESSAGES, max_tokens=1)
    return resp.usage.prompt_tokens


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_max_tokens_beyond_the_context_is_400(healthy, field):
    context = healthy.engine.max_model_len
    n = _prompt_tokens(healthy)
    body = {"max_tokens": None, field: context - n + 1}
    error = assert_400(post(healthy, **body), param="max_tokens", code="context_length_exceeded")
    assert error["message"].startswith(
        f"This model's maximum context length is {context} tokens. However, you requested "
        f"{context + 1} tokens ({n} in the messages, {context - n + 1} in the completion)."
    )
    with healthy.client() as client, pytest.raises(openai.BadRequestError) as exc:
        client.chat.completions.create(
            model=healthy.model, messages=MESSAGES, **{field: 10 * context}
        )
    assert exc.value.code == "context_length_exceeded"
    assert_serves_normally(healthy)


def test_max_tokens_beyond_the_context_is_400_on_completions(healthy):
    resp = post(healthy, "/v1/completions", prompt="Hi", max_tokens=healthy.engine.max_model_len)
    assert_400(resp, param="max_tokens", code="context_length_exceeded")


def test_engine_validate_allows_exactly_the_context(healthy):
    """The bound is prompt + max_tokens <= max_model_len, not one token less or more."""
    llm_engine = healthy.engine.engine
    prompt = llm_engine.process_inputs(MESSAGES)
    room = llm_engine.max_model_len - len(prompt.token_ids)
    llm_engine.validate(prompt, SamplingParams(max_tokens=room))
    with pytest.raises(PromptTooLongError, match="maximum context length"):
        llm_engine.validate(prompt, SamplingParams(max_tokens=room + 1))
    llm_engine.validate(prompt, SamplingParams(max_tokens=None))  # "until the context is full"


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"seed": 2**64}, "seed"),
        ({"seed": SEED_MIN - 1}, "seed"),
        ({"seed": 1.5}, "seed"),
        ({"seed": True}, "seed"),
        ({"max_tokens": 2.5}, "max_tokens"),
        ({"temperature": math.nan}, "temperature"),
        ({"temperature": math.inf}, "temperature"),
        ({"stop": [""]}, "stop"),
        ({"stop": ["x" * (MAX_STOP_STRING_CHARS + 1)]}, "stop"),
        ({"stop": [3]}, "stop"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
    ],
)
def test_sampling_params_refuse_what_would_raise_on_the_step_thread(kwargs, param):
    with pytest.raises(InvalidRequestError) as exc:
        SamplingParams(**kwargs)
    assert exc.value.param == param


def test_every_accepted_seed_is_one_torch_accepts():
    """Our range is a subset of what ``torch.Generator.manual_seed`` takes, and just past it
    torch raises (the crash this validation prevents)."""
    for seed in (SEED_MIN, -1, 0, SEED_MAX):
        SamplingParams(seed=seed)
        torch.Generator().manual_seed(seed)
    with pytest.raises((RuntimeError, ValueError, OverflowError)):
        torch.Generator().manual_seed(2**64)
    with pytest.raises((RuntimeError, ValueError, OverflowError)):
        torch.Generator().manual_seed(SEED_MIN - 1)
