"""The model's sampling defaults (``--generation-config``) applied to one request.

A default fills only a field the client did not send (pydantic's ``model_fields_set``; an
explicit ``null`` counts as not sent), so ``temperature=0`` from a client always wins over the
checkpoint's recommendation, and a client that sends nothing gets the author's sampling as it
would from vLLM. Keys are matched to :class:`SamplingParams` fields by name; one the engine has
no field for is logged once at start and skipped.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

from pydantic import BaseModel

from engine.errors import InvalidRequestError
from engine.generation_config import GenerationConfigError, load_sampling_defaults
from engine.sampling_params import SamplingParams
from vision_serve.errors import from_engine_error

log = logging.getLogger("vision_serve.sampling_defaults")

# default name -> request fields that, when sent, mean the client chose it
_REQUEST_FIELDS = {"max_tokens": ("max_tokens", "max_completion_tokens")}


class SamplingDefaults:
    """Defaults checked once at start (a bad value fails the server, not every request)."""

    def __init__(self, defaults: dict[str, Any]) -> None:
        known = {f.name for f in dataclasses.fields(SamplingParams)}
        self.values = {k: v for k, v in defaults.items() if k in known}
        skipped = sorted(set(defaults) - known)
        if skipped:
            log.warning(
                "generation config defaults not applied (the engine has no such sampling "
                "field): %s",
                ", ".join(skipped),
            )
        try:
            SamplingParams(**self.values)
        except (InvalidRequestError, TypeError) as exc:
            raise GenerationConfigError(f"generation config default is invalid: {exc}") from None

    @classmethod
    def for_engine(cls, engine: Any) -> SamplingDefaults:
        """The defaults ``engine`` was started with (``EngineArgs.generation_config``); none
        for an engine that does not say (a test double)."""
        inner = getattr(engine, "engine", engine)
        args = getattr(inner, "args", None)
        model_dir = getattr(inner, "model_dir", None)
        if args is None or model_dir is None:
            return cls({})
        return cls(load_sampling_defaults(getattr(args, "generation_config", "auto"), model_dir))

    def apply(self, req: BaseModel, params: SamplingParams) -> SamplingParams:
        """``params`` with the defaults of the fields ``req`` did not send."""
        overrides = {k: v for k, v in self.values.items() if not _sent(req, k)}
        if not overrides:
            return params
        try:
            return dataclasses.replace(params, **overrides)
        except InvalidRequestError as exc:  # e.g. min_tokens above the default max_tokens
            raise from_engine_error(exc) from None


def _sent(req: BaseModel, name: str) -> bool:
    return any(
        field in req.model_fields_set and getattr(req, field, None) is not None
        for field in _REQUEST_FIELDS.get(name, (name,))
    )
