"""``/tokenize`` and ``/detokenize``: vLLM's shapes, counts that match what a completion bills."""

from __future__ import annotations

import pytest

from .support import data_url, image_message, make_image

TEXT_MESSAGES = [
    {"role": "system", "content": "You describe camera frames."},
    {"role": "user", "content": "Is anyone at the door?"},
]


def _tokenize(server, body):
    with server.http() as http:
        return http.post("/tokenize", json=body)


def test_chat_count_equals_the_prompt_tokens_a_completion_bills(server, client):
    tok = _tokenize(server, {"model": server.model, "messages": TEXT_MESSAGES})
    assert tok.status_code == 200, tok.text
    body = tok.json()
    resp = client.chat.completions.create(model=server.model, messages=TEXT_MESSAGES, max_tokens=1)
    assert body["count"] == len(body["tokens"]) == resp.usage.prompt_tokens
    assert body["max_model_len"] == server.engine.max_model_len
    assert body["token_strs"] is None


def test_image_placeholders_are_counted_as_the_engine_expands_them(server, client):
    messages = image_message("What is in this frame?", data_url(make_image(112, 112)))
    with_image = _tokenize(server, {"messages": messages}).json()
    text_only = _tokenize(
        server, {"messages": [{"role": "user", "content": "What is in this frame?"}]}
    ).json()
    resp = client.chat.completions.create(model=server.model, messages=messages, max_tokens=1)
    assert with_image["count"] == resp.usage.prompt_tokens
    image_token = server.engine.engine.hf_config.image_token_id
    placeholders = with_image["tokens"].count(image_token)
    assert placeholders > 1  # one per merged patch, not a single marker
    assert with_image["count"] > text_only["count"] + placeholders - 1


def test_mm_processor_kwargs_change_the_image_token_count(server):
    messages = image_message("frame", data_url(make_image(224, 224)))
    full = _tokenize(server, {"messages": messages}).json()["count"]
    small = _tokenize(
        server, {"messages": messages, "mm_processor_kwargs": {"max_pixels": 56 * 56}}
    ).json()["count"]
    assert small < full


def test_generation_prompt_can_be_left_out(server):
    on = _tokenize(server, {"messages": TEXT_MESSAGES}).json()
    off = _tokenize(server, {"messages": TEXT_MESSAGES, "add_generation_prompt": False}).json()
    assert off["count"] < on["count"]
    assert on["tokens"][: off["count"]] == off["tokens"]


def test_prompt_tokenize_and_detokenize_round_trip(server):
    text = "a person walks past the gate"
    tok = _tokenize(server, {"prompt": text, "return_token_strs": True}).json()
    assert tok["count"] == len(tok["tokens"]) == len(tok["token_strs"]) > 0
    with server.http() as http:
        detok = http.post("/detokenize", json={"model": server.model, "tokens": tok["tokens"]})
    assert detok.status_code == 200
    assert detok.json() == {"prompt": text}


def test_empty_prompt_has_no_tokens(server):
    assert _tokenize(server, {"prompt": ""}).json()["count"] == 0


def test_the_api_key_is_required(server):
    import httpx

    for path, body in (("/tokenize", {"prompt": "hi"}), ("/detokenize", {"tokens": [1]})):
        resp = httpx.post(server.base_url + path, json=body)
        assert resp.status_code == 401
        assert resp.json()["error"]["code"] == "invalid_api_key"


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"model": "x"}, "prompt"),
        ("/tokenize", {"prompt": 5}, "prompt"),
        ("/tokenize", {"messages": []}, "messages"),
        ("/tokenize", {"messages": TEXT_MESSAGES, "continue_final_message": True},
         "continue_final_message"),
        ("/tokenize", {"messages": TEXT_MESSAGES, "chat_template": "{{ 1 }}"}, "chat_template"),
        ("/tokenize", {"messages": TEXT_MESSAGES, "chat_template_kwargs": {"tokenize": True}},
         "chat_template_kwargs.tokenize"),
        ("/tokenize", {"messages": image_message("x", "data:image/png;base64,AAAA")},
         "messages[0].content[1].image_url"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
        ("/detokenize", {"tokens": [10**9]}, "tokens"),
    ],
)  # fmt: skip
def test_bad_input_is_an_openai_400_naming_the_param(server, path, body, param):
    with server.http() as http:
        resp = http.post(path, json=body)
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["type"] == "invalid_request_error"
    assert error["param"] == param


def test_a_body_that_is_not_json_is_a_400(server):
    with server.http() as http:
        resp = http.post("/tokenize", content=b"{not json", headers={"content-type": "x"})
    assert resp.status_code == 400


def test_an_unknown_model_is_a_404(server):
    resp = _tokenize(server, {"model": "nope", "prompt": "hi"})
    assert resp.status_code == 404
    assert resp.json()["error"]["code"] == "model_not_found"
