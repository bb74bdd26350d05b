"""Errors that cross component boundaries; only the ingress turns them into HTTP responses."""

from __future__ import annotations


class InvalidRequest(ValueError):
    """The client's fault: the ingress answers 4xx with this message (400 unless `status` says otherwise)."""

    def __init__(self, message: str, param: str | None = None, code: str | None = None, status: int = 400):
        super().__init__(message)
        self.message, self.param, self.code, self.status = message, param, code, status

    def __reduce__(self):  # NOTE: keeps the fields when Ray pickles the error across processes.
        return (type(self), (self.message, self.param, self.code, self.status))


class Overloaded(RuntimeError):
    """No capacity now: the ingress answers 503 with Retry-After."""

    def __init__(self, message: str, retry_after_s: int = 1):
        super().__init__(message)
        self.message, self.retry_after_s = message, retry_after_s

    def __reduce__(self):
        return (type(self), (self.message, self.retry_after_s))


class EncoderUnavailable(RuntimeError):
    """Embeddings of these images could not be had (their replica died, or timed out): the ingress retries them."""

    def __init__(self, message: str, image_indices: list[int]):
        super().__init__(message)
        self.message, self.image_indices = message, image_indices

    def __reduce__(self):
        return (type(self), (self.message, self.image_indices))


__all__ = ["EncoderUnavailable", "InvalidRequest", "Overloaded"]
