"""The error a bad chat request gets: HTTP 400 with a message that names the parameter."""

from __future__ import annotations


class ChatRequestError(ValueError):
    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param
