"""Request and response bodies, field for field as OpenAI's API reference spells them.

Requests accept OpenAI's fields plus the extra-body fields vLLM accepts (``top_k``,
``min_tokens``, ``ignore_eos``, ``mm_processor_kwargs``) and our scheduling fields
(``priority``, ``max_queue_seconds``).
Fields that would change the answer and that we do not implement (tools, logprobs, penalties)
are refused with a 400 instead of being silently ignored; unknown fields are ignored, as
OpenAI-compatible servers commonly do.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vision_serve.errors import bad_request

Priority = Literal["interactive", "batch"]
FinishReason = Literal["stop", "length"]
MAX_STOP_SEQUENCES = 4  # OpenAI's limit; the length of each is checked by SamplingParams


# ---------------------------------------------------------------------------------------------
# Requests
# ---------------------------------------------------------------------------------------------


class ImageURL(BaseModel):
    url: str
    detail: str | None = None


class TextPart(BaseModel):
    type: Literal["text"]
    text: str


class ImagePart(BaseModel):
    type: Literal["image_url"]
    # Some clients send the URL as a bare string; accept both shapes.
    image_url: ImageURL | str


class OtherPart(BaseModel):
    """Any other part type (input_audio, file ...): parsed so we can refuse it by name."""

    model_config = ConfigDict(extra="allow")
    type: str


ContentPart = TextPart | ImagePart | OtherPart


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="allow")

    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None


class StreamOptions(BaseModel):
    include_usage: bool = False


class MMProcessorKwargs(BaseModel):
    """vLLM's per-request ``mm_processor_kwargs``: this request's image size bounds (pixels).

    Unknown keys are a 400 here, unlike unknown top-level fields: a misspelt key would be
    silently ignored and the client would pay for the image tokens it meant to save.
    """

    model_config = ConfigDict(extra="forbid")

    min_pixels: int | None = Field(default=None, gt=0, strict=True)
    max_pixels: int | None = Field(default=None, gt=0, strict=True)


def _lone_surrogate_at(value: Any, path: str = "") -> str | None:
    """The OpenAI-style path (``messages[0].content``) of the first string in a parsed JSON
    value that is not encodable as UTF-8, or None."""
    if isinstance(value, str):
        if value.isascii():  # the common case (base64 images included): no copy
            return None
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path
        return None
    if isinstance(value, dict):
        for key, item in value.items():
            found = _lone_surrogate_at(key, path) if isinstance(key, str) else None
            if found is None:
                found = _lone_surrogate_at(item, f"{path}.{key}" if path else str(key))
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, item in enumerate(value):
            found = _lone_surrogate_at(item, f"{path}[{i}]")
            if found is not None:
                return found
    return None


class SamplingFields(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = 0.0
    frequency_penalty: float | None = 0.0
    logit_bias: dict[str, float] | None = None
    # vLLM extra-body sampling fields
    top_k: int | None = None
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    # scheduling (handed to the engine's policy)
    priority: Priority = "interactive"
    max_queue_seconds: float | None = Field(default=None, gt=0)
    # vLLM extra body: image size bounds for this request's images only
    mm_processor_kwargs: MMProcessorKwargs | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        """JSON may escape lone UTF-16 surrogates (``"\\ud800"``); Python then holds a string
        that cannot be encoded, and the tokenizer or the response writer would fail with a 500
        long after the door. Refused here, naming the field."""
        where = _lone_surrogate_at(data)
        if where is not None:
            raise bad_request(
                f"{where or 'body'}: string contains a lone UTF-16 surrogate (not valid Unicode)",
                param=where or None,
                code="invalid_unicode",
            )
        return data

    def check_supported(self) -> None:
        """Refuse what we would otherwise get silently wrong."""
        if self.n != 1:
            raise bad_request("only n=1 is supported", param="n", code="unsupported_value")
        if self.presence_penalty or self.frequency_penalty:
            param = "presence_penalty" if self.presence_penalty else "frequency_penalty"
            raise bad_request(f"{param} is not supported", param=param, code="unsupported_value")
        if self.logit_bias:
            raise bad_request("logit_bias is not supported", param="logit_bias")
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_SEQUENCES:
            raise bad_request(f"at most {MAX_STOP_SEQUENCES} stop sequences", param="stop")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None
    response_format: dict[str, Any] | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.logprobs or self.top_logprobs:
            raise bad_request("logprobs are not supported", param="logprobs")
        if self.tools:
            raise bad_request("tools are not supported", param="tools")
        if self.tool_choice not in (None, "none", "auto"):
            raise bad_request("tool_choice is not supported", param="tool_choice")
        if self.response_format and self.response_format.get("type") not in (None, "text"):
            raise bad_request("only response_format type 'text' is supported", "response_format")

    @property
    def output_limit(self) -> int | None:
        """``max_completion_tokens`` is OpenAI's newer name; it wins when both are given."""
        return self.max_completion_tokens or self.max_tokens


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int]
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise bad_request("echo is not supported", param="echo")
        if self.logprobs:
            raise bad_request("logprobs are not supported", param="logprobs")
        if self.best_of not in (None, 1):
            raise bad_request("only best_of=1 is supported", param="best_of")
        if self.suffix:
            raise bad_request("suffix is not supported", param="suffix")

    def prompt_text(self) -> str:
        """One text prompt; batches of prompts and token-id prompts are refused."""
        prompt = self.prompt
        if isinstance(prompt, list):
            if len(prompt) == 1 and isinstance(prompt[0], str):
                return prompt[0]
            if prompt and all(isinstance(p, int) for p in prompt):
                raise bad_request("token-id prompts are not supported", param="prompt")
            raise bad_request("exactly one prompt string per request", param="prompt")
        return prompt

    @property
    def output_limit(self) -> int | None:
        return self.max_tokens if self.max_tokens is not None else 16  # OpenAI's default


# ---------------------------------------------------------------------------------------------
# Responses
# ---------------------------------------------------------------------------------------------


def _now() -> int:
    return int(time.time())


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class ResponseMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str
    refusal: None = None


class ChatChoice(BaseModel):
    index: int = 0
    message: ResponseMessage
    logprobs: None = None
    finish_reason: FinishReason


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None


class ChoiceDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: ChoiceDelta
    logprobs: None = None
    finish_reason: FinishReason | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChunkChoice]
    system_fingerprint: str | None = None
    usage: Usage | None = None


class CompletionChoice(BaseModel):
    index: int = 0
    text: str
    logprobs: None = None
    finish_reason: FinishReason | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=_now)
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=_now)
    owned_by: str = "vision-serve"
    max_model_len: int | None = None


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
