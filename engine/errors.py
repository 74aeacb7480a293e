"""Exceptions the engine raises for bad input.

Every input problem is a subclass of :class:`InvalidRequestError` (itself a ``ValueError``) so a
server can map the whole family to HTTP 400 with one ``except``, while the engine keeps serving
the other requests.
"""


class InvalidRequestError(ValueError):
    """The request cannot be served as given; nothing was scheduled for it."""

    param: str | None = None

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param


class EmptyPromptError(InvalidRequestError):
    """The prompt tokenised to zero tokens."""


class PromptTooLongError(InvalidRequestError):
    """Prompt (plus requested output) does not fit the model's context (``max_model_len``)."""


class InvalidImageError(InvalidRequestError):
    """An image could not be read or decoded."""


class UnsupportedModelError(ValueError):
    """The checkpoint's architecture is not one this engine implements."""


class EngineDeadError(RuntimeError):
    """The step loop died; the engine no longer serves requests."""


class QueueFullError(RuntimeError):
    """The engine's waiting queue is at its configured limit."""
