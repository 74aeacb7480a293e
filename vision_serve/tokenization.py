"""``POST /tokenize`` and ``POST /detokenize``, with vLLM's request and response shapes.

Clients use these to count a prompt's tokens before sending it (budgeting context, pricing a
camera frame). A count is only useful if it is the count the engine will use, so a prompt goes
through the very path a completion's does: messages are converted and their images loaded by
:class:`vision_serve.serving.OpenAIServing` (same media policy and limits), then the engine's
own input processing applies the chat template and expands each image into its placeholder
tokens. ``count`` therefore equals ``usage.prompt_tokens`` of the same request.

``add_special_tokens`` is accepted for vLLM compatibility; the engine tokenises as it does for
completions, and the Qwen2-VL tokenizers add no special tokens either way.
"""

from __future__ import annotations

import asyncio
from typing import Any

from fastapi import Request
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from engine.errors import EmptyPromptError
from vision_serve.errors import APIError, _param_from_loc, bad_request, from_engine_error
from vision_serve.protocol import ChatMessage, MMProcessorKwargs, refuse_lone_surrogates
from vision_serve.serving import OpenAIServing

# chat_template_kwargs a client may not set: they change what apply_chat_template returns or
# which template runs, not what the template renders
_RESERVED_TEMPLATE_KWARGS = frozenset(
    {"tokenize", "return_dict", "return_tensors", "chat_template", "conversation", "tools"}
)


class _TokenizeBase(BaseModel):
    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    return_token_strs: bool | None = False

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        """A lone surrogate would make the tokenizer raise (a 500); refused at the door."""
        return refuse_lone_surrogates(data)


class TokenizeCompletionRequest(_TokenizeBase):
    prompt: str
    add_special_tokens: bool = True


class TokenizeChatRequest(_TokenizeBase):
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    add_special_tokens: bool = False
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    mm_processor_kwargs: MMProcessorKwargs | None = None
    tools: list[dict[str, Any]] | None = None

    def check_supported(self) -> None:
        if self.add_generation_prompt and self.continue_final_message:
            raise bad_request(
                "Cannot set both `continue_final_message` and `add_generation_prompt` to True.",
                param="continue_final_message",
            )
        if self.chat_template is not None:
            # running a client-supplied Jinja template is a door we keep shut (vLLM, too, only
            # with --trust-request-chat-template)
            raise bad_request("chat_template is not supported", param="chat_template")
        if self.tools:
            raise bad_request("tools are not supported", param="tools")
        for key in self.chat_template_kwargs or {}:
            if key in _RESERVED_TEMPLATE_KWARGS:
                raise bad_request(
                    f"chat_template_kwargs.{key} is not allowed",
                    param=f"chat_template_kwargs.{key}",
                )

    def template_kwargs(self) -> dict[str, Any]:
        kwargs = dict(self.chat_template_kwargs or {})
        kwargs["add_generation_prompt"] = self.add_generation_prompt
        if self.continue_final_message:
            kwargs["continue_final_message"] = True
        return kwargs


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeRequest(_TokenizeBase):
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


def _parse(model: type[BaseModel], data: Any) -> Any:
    """Validate like FastAPI would, but report the first error as OpenAI's 400 naming the
    param (the tokenize body is a union; FastAPI would name the union member, not the field)."""
    if not isinstance(data, dict):
        raise bad_request("request body must be a JSON object")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        first = exc.errors()[0]
        param = _param_from_loc(tuple(first.get("loc", ())))
        msg = first.get("msg", "invalid request")
        raise bad_request(f"{param}: {msg}" if param else msg, param=param) from None


async def _json_body(raw: Request) -> Any:
    try:
        return await raw.json()
    except ValueError:
        raise bad_request("request body is not valid JSON") from None


class TokenizeServing:
    """The two endpoints, over the app's :class:`OpenAIServing` and its engine."""

    def __init__(self, serving: OpenAIServing) -> None:
        self.serving = serving
        self.engine = serving.engine
        inner = getattr(self.engine, "engine", self.engine)
        self.tokenizer = inner.tokenizer
        self._process = inner.process_inputs
        self.vocab_size: int = inner.hf_config.text_config.vocab_size

    async def tokenize(self, raw: Request) -> TokenizeResponse:
        data = await _json_body(raw)
        is_chat = isinstance(data, dict) and "messages" in data
        req = _parse(TokenizeChatRequest if is_chat else TokenizeCompletionRequest, data)
        if req.model is not None:
            self.serving.check_model(req.model)
        if isinstance(req, TokenizeChatRequest):
            req.check_supported()
            messages = await self.serving._engine_messages(req.messages)
            inputs: Any = {"messages": messages, "chat_template_kwargs": req.template_kwargs()}
            if req.mm_processor_kwargs is not None:
                inputs["mm_processor_kwargs"] = req.mm_processor_kwargs.model_dump(
                    exclude_none=True
                )
        else:
            inputs = req.prompt
        try:
            # off the event loop: templating and image preprocessing are CPU work
            tokens = list((await asyncio.to_thread(self._process, inputs)).token_ids)
        except EmptyPromptError:
            tokens = []
        except Exception as exc:
            err = from_engine_error(exc)
            if err.status == 500:
                raise
            raise err from None
        strs = self.tokenizer.convert_ids_to_tokens(tokens) if req.return_token_strs else None
        return TokenizeResponse(
            count=len(tokens),
            max_model_len=self.engine.max_model_len,
            tokens=tokens,
            token_strs=strs,
        )

    async def detokenize(self, raw: Request) -> DetokenizeResponse:
        req = _parse(DetokenizeRequest, await _json_body(raw))
        if req.model is not None:
            self.serving.check_model(req.model)
        bad = next((t for t in req.tokens if not 0 <= t < self.vocab_size), None)
        if bad is not None:
            raise APIError(
                400,
                f"token id {bad} is out of the vocabulary (size {self.vocab_size})",
                param="tokens",
            )
        return DetokenizeResponse(prompt=self.tokenizer.decode(req.tokens))
