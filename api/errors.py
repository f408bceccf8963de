"""OpenAI-shaped errors: ``{"error": {"message", "type", "param", "code"}}`` with the right status."""

from __future__ import annotations

from http import HTTPStatus

import attrs


@attrs.frozen
class APIError(Exception):
    """An error the client should see as-is."""

    status: int
    message: str
    param: str | None = None
    type: str | None = None
    code: str | None = None
    retry_after: float | None = None  # seconds, sent as the Retry-After header

    def body(self) -> dict:
        kind = self.type or _TYPES.get(self.status, "server_error")
        return {"error": {"message": self.message, "type": kind, "param": self.param,
                          "code": self.code or HTTPStatus(self.status).phrase.lower().replace(" ", "_")}}


_TYPES = {400: "invalid_request_error", 401: "authentication_error", 404: "not_found_error",
          405: "invalid_request_error", 408: "timeout_error", 413: "invalid_request_error", 431: "invalid_request_error",
          503: "service_unavailable_error", 504: "timeout_error"}


def bad_request(message: str, param: str | None = None) -> APIError:
    return APIError(400, message, param)


def unsupported(param: str, what: str) -> APIError:
    return APIError(400, f"{what} is not supported by this server", param, code="unsupported_parameter")
