"""``--generation-config``: the checkpoint's generation_config.json supplies defaults for the
sampling fields a request leaves out, as vLLM applies them; what the client sends wins."""

from __future__ import annotations

import json
import logging
import shutil
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine.generation_config import GenerationConfigError, load_sampling_defaults
from engine.sampling_params import SamplingParams
from vision_serve.protocol import ChatCompletionRequest
from vision_serve.sampling_defaults import SamplingDefaults
from vision_serve.settings import ServerSettings

from .support import API_KEY, ServerHandle, make_engine, start_server

AUTHOR_DEFAULTS = {"temperature": 0.0, "max_new_tokens": 4, "min_p": 0.05, "do_sample": True}
MESSAGES = [{"role": "user", "content": "Describe the frame."}]


@pytest.fixture(scope="module")
def tuned_checkpoint(checkpoint, tmp_path_factory) -> Path:
    """The tiny checkpoint with an author's sampling recommendation in generation_config.json."""
    out = tmp_path_factory.mktemp("tuned") / "tuned-tiny"
    shutil.copytree(checkpoint, out)
    path = out / "generation_config.json"
    path.write_text(json.dumps({**json.loads(path.read_text()), **AUTHOR_DEFAULTS}))
    return out


@pytest.fixture(scope="module")
def tuned_server(tuned_checkpoint) -> Iterator[ServerHandle]:
    engine = make_engine(str(tuned_checkpoint))
    handle = start_server(engine, ServerSettings(api_key=API_KEY))
    yield handle
    handle.stop()
    engine.shutdown()


def test_generated_checkpoints_recommend_no_sampling(checkpoint):
    """make-model's config is greedy-neutral: the other server tests' sampling is unchanged."""
    assert load_sampling_defaults("auto", checkpoint) == {}


def test_auto_reads_the_sampling_keys_and_vllm_ignores_them(tuned_checkpoint):
    defaults = load_sampling_defaults("auto", tuned_checkpoint)
    assert defaults == {"temperature": 0.0, "max_tokens": 4, "min_p": 0.05}  # not do_sample
    assert load_sampling_defaults("vllm", tuned_checkpoint) == {}
    assert load_sampling_defaults(str(tuned_checkpoint), "/nonexistent") == defaults


def test_a_folder_without_the_file_is_refused(tmp_path):
    with pytest.raises(GenerationConfigError, match=r"no generation_config\.json"):
        load_sampling_defaults(str(tmp_path), tmp_path)


def test_defaults_are_logged_at_start_and_all_applied(tuned_server, caplog):
    caplog.set_level(logging.INFO)
    defaults = SamplingDefaults.for_engine(tuned_server.engine)
    assert "Default sampling parameters have been overridden" in caplog.text
    assert defaults.values["min_p"] == 0.05 and "not applied" not in caplog.text
    unknown = SamplingDefaults({"temperature": 0.5, "typical_p": 0.9})
    assert unknown.values == {"temperature": 0.5}
    assert "not applied" in caplog.text and "typical_p" in caplog.text


def test_a_request_without_sampling_fields_gets_the_authors(tuned_server):
    with tuned_server.client() as client:
        default = client.chat.completions.create(
            model=tuned_server.model, messages=MESSAGES, extra_body={"ignore_eos": True}
        )
        explicit = client.chat.completions.create(
            model=tuned_server.model,
            messages=MESSAGES,
            temperature=0,
            max_tokens=4,
            extra_body={"ignore_eos": True},
        )
        reseeded = client.chat.completions.create(
            model=tuned_server.model, messages=MESSAGES, seed=7, extra_body={"ignore_eos": True}
        )
    assert default.usage.completion_tokens == 4  # max_new_tokens as the default max_tokens
    assert default.choices[0].finish_reason == "length"
    # temperature 0 by default: greedy, so the seed changes nothing
    assert default.choices[0].message.content == explicit.choices[0].message.content
    assert reseeded.choices[0].message.content == explicit.choices[0].message.content


def test_what_the_client_sends_wins(tuned_server):
    with tuned_server.client() as client:
        resp = client.chat.completions.create(
            model=tuned_server.model,
            messages=MESSAGES,
            max_completion_tokens=6,
            extra_body={"ignore_eos": True},
        )
        completion = client.completions.create(
            model=tuned_server.model, prompt="a gate", max_tokens=5, extra_body={"ignore_eos": True}
        )
    assert resp.usage.completion_tokens == 6
    assert completion.usage.completion_tokens == 5


def test_explicit_values_and_nulls():
    defaults = SamplingDefaults({"temperature": 0.3, "top_p": 0.8, "max_tokens": 9})
    sent = ChatCompletionRequest(model="m", messages=MESSAGES, temperature=1.5, top_p=None)
    params = defaults.apply(sent, SamplingParams(temperature=1.5, max_tokens=None))
    assert params.temperature == 1.5  # sent: kept
    assert params.top_p == 0.8  # explicit null counts as not sent
    assert params.max_tokens == 9


def test_repetition_penalty_default_applies_by_field_name():
    """The hook for repetition_penalty: applied whenever SamplingParams has the field."""
    defaults = SamplingDefaults({"repetition_penalty": 1.05})
    params = defaults.apply(ChatCompletionRequest(model="m", messages=MESSAGES), SamplingParams())
    assert params.repetition_penalty == 1.05


def test_an_invalid_default_fails_at_start_not_per_request():
    with pytest.raises(GenerationConfigError, match="temperature"):
        SamplingDefaults({"temperature": -1})
