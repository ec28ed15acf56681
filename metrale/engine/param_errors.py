"""The refusal of a request's sampling parameters, apart from SamplingParams itself so
that the values it holds (a structured-output spec) can raise it too."""

from __future__ import annotations

from metrale.errors import MetraleError


class InvalidSamplingParamsError(MetraleError):
    """A sampling parameter is out of range; `param` names it (None: the request as a whole)."""

    def __init__(self, message: str, param: str | None = None) -> None:
        super().__init__(message)
        self.param = param
