"""Request and response bodies, field for field as OpenAI's API reference spells them.

Requests accept OpenAI's fields plus the extra-body fields vLLM accepts (``top_k``,
``min_tokens``, ``ignore_eos``, ``mm_processor_kwargs``) and our scheduling fields
(``priority``, ``max_queue_seconds``).
Fields that would change the answer and that we do not implement (``echo``, ``suffix``,
``best_of``) are refused with a 400 instead of being silently ignored; unknown fields are
ignored, as OpenAI-compatible servers commonly do.
"""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from vision_serve.errors import bad_request

Priority = Literal["interactive", "batch"]
FinishReason = Literal["stop", "length", "tool_calls"]
MAX_STOP_SEQUENCES = 4  # OpenAI's limit; the length of each is checked by SamplingParams
# choices per request: each is a full decode (sharing the prompt's KV), so bounded like a batch
MAX_CHOICES = 16


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


class VideoURLPart(BaseModel):
    """vLLM's video part: a video file (data:, allowed http(s) or file:// URL)."""

    type: Literal["video_url"]
    video_url: ImageURL | str


class VideoPart(BaseModel):
    """A clip as a list of frames (image URLs), Qwen's own API shape; ``fps`` is the rate
    they were taken at (it spaces Qwen2.5-VL's temporal positions)."""

    type: Literal["video"]
    video: list[str]
    fps: float | None = Field(default=None, gt=0)


class OtherPart(BaseModel):
    """Any other part type (input_audio, file ...): parsed so we can refuse it by name."""

    model_config = ConfigDict(extra="allow")
    type: str


ContentPart = TextPart | ImagePart | VideoURLPart | VideoPart | OtherPart


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


def refuse_lone_surrogates(data: Any) -> Any:
    """``data`` unchanged, or a 400 naming the first field holding a lone UTF-16 surrogate
    (every request body's ``mode="before"`` validator calls this)."""
    where = _lone_surrogate_at(data)
    if where is not None:
        raise bad_request(
            f"{where or 'body'}: string contains a lone UTF-16 surrogate (not valid Unicode)",
            param=where or None,
            code="invalid_unicode",
        )
    return data


class SamplingFields(BaseModel):
    """Fields shared by chat and text completions."""

    model_config = ConfigDict(extra="ignore")

    model: str
    max_tokens: int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    seed: int | None = None
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1, le=MAX_CHOICES, strict=True)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # vLLM extra-body sampling fields
    repetition_penalty: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    min_tokens: int = Field(default=0, ge=0)
    ignore_eos: bool = False
    # scheduling (handed to the engine's policy)
    priority: Priority = "interactive"
    max_queue_seconds: float | None = Field(default=None, gt=0)
    # vLLM extra body: image size bounds for this request's images only
    mm_processor_kwargs: MMProcessorKwargs | None = None
    # structured output (vision_serve/structured_output.py): OpenAI's response_format and
    # vLLM's extra-body fields; at most one of them per request
    response_format: dict[str, Any] | None = None
    guided_json: dict[str, Any] | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_unicode(cls, data: Any) -> Any:
        """JSON may escape lone UTF-16 surrogates (``"\\ud800"``); Python then holds a string
        that cannot be encoded, and the tokenizer or the response writer would fail with a 500
        long after the door. Refused here, naming the field."""
        return refuse_lone_surrogates(data)

    def check_supported(self) -> None:
        """Refuse what we would otherwise get silently wrong."""
        if isinstance(self.stop, list) and len(self.stop) > MAX_STOP_SEQUENCES:
            raise bad_request(f"at most {MAX_STOP_SEQUENCES} stop sequences", param="stop")

    @property
    def include_usage(self) -> bool:
        return bool(self.stream_options and self.stream_options.include_usage)

    def token_logit_bias(self) -> dict[int, float] | None:
        """OpenAI sends token ids as JSON object keys (strings); a key that is not an integer
        is a 400 rather than a bias silently applied to nothing."""
        if not self.logit_bias:
            return None
        out: dict[int, float] = {}
        for key, value in self.logit_bias.items():
            try:
                out[int(key)] = value
            except ValueError:
                raise bad_request(
                    f"logit_bias keys must be token ids, got {key!r}", param="logit_bias"
                ) from None
        return out

    @property
    def num_logprobs(self) -> int | None:
        """How many alternatives per token the engine should return (None: no logprobs)."""
        return None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool | None = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[dict[str, Any]] | None = None
    tool_choice: Any = None  # checked by vision_serve.tool_calls.plan_tools
    parallel_tool_calls: bool | None = None  # False: at most one call (tool_choice required)

    def check_supported(self) -> None:
        super().check_supported()
        if self.top_logprobs is not None and not self.logprobs:
            raise bad_request("top_logprobs requires logprobs to be true", param="top_logprobs")

    @property
    def output_limit(self) -> int | None:
        """``max_completion_tokens`` is OpenAI's newer name; it wins when both are given."""
        return self.max_completion_tokens or self.max_tokens

    @property
    def num_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int]
    echo: bool = False
    logprobs: int | None = Field(default=None, ge=0, le=20)
    best_of: int | None = None
    suffix: str | None = None

    def check_supported(self) -> None:
        super().check_supported()
        if self.echo:
            raise bad_request("echo is not supported", param="echo")
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

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs


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
    content: str | None
    refusal: None = None
    tool_calls: list[dict[str, Any]] | None = None  # vision_serve.tool_calls


class ChatChoice(BaseModel):
    index: int = 0
    message: ResponseMessage
    logprobs: dict[str, Any] | None = None  # vision_serve.logprobs.chat_logprobs
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
    tool_calls: list[dict[str, Any]] | None = None


class ChunkChoice(BaseModel):
    index: int = 0
    delta: ChoiceDelta
    logprobs: dict[str, Any] | None = None
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
    logprobs: dict[str, Any] | None = None  # vision_serve.logprobs.completion_logprobs
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
