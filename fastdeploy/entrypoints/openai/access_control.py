"""What makes the API server safe to expose: an API key on every /v1/* route (and vLLM's tokenizer
routes), a request-body limit.

Plain ASGI middleware (BaseHTTPMiddleware would interfere with streaming disconnects). /health,
/metrics and /version stay open, as in vLLM: load balancers and Prometheus probe them without a
key. Keys come from `--api-key` (repeatable) or, when that is absent, from the comma-separated
`FD_API_KEY` environment variable (upstream FastDeploy's name).
"""

from __future__ import annotations

import hmac
from typing import Iterable, Optional, Sequence

from starlette.responses import JSONResponse

from fastdeploy.entrypoints.openai.protocol import APIError

PROTECTED_PREFIX = "/v1"
PROTECTED_PATHS = ("/tokenize", "/detokenize", "/tokenizer_info")  # vLLM's names: outside /v1
DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


def resolve_api_keys(cli_keys: Optional[Sequence[str]], env_keys: Iterable[str]) -> list[str]:
    """`--api-key` wins over FD_API_KEY; empty strings are no keys (an empty key would open the door)."""
    keys = [k for k in (cli_keys if cli_keys else env_keys) if k]
    return list(dict.fromkeys(keys))


def _bearer_token(scope) -> Optional[bytes]:
    for name, value in scope.get("headers", ()):
        if name == b"authorization":
            scheme, _, token = value.partition(b" ")
            if scheme.lower() == b"bearer" and token.strip():
                return token.strip()
            return None
    return None


def _matches_any(token: bytes, keys: Sequence[bytes]) -> bool:
    # Compare with every key, without stopping at a match, so the time does not tell which one.
    found = False
    for key in keys:
        found |= hmac.compare_digest(token, key)
    return found


class APIKeyGuard:
    """401 (OpenAI's error body and `invalid_api_key` code) for a /v1/* request without
    `Authorization: Bearer <one of the keys>`."""

    def __init__(self, app, api_keys: Sequence[str]):
        if not api_keys:
            raise ValueError("APIKeyGuard needs at least one non-empty key")
        self.app = app
        self.keys = [k.encode() for k in api_keys]

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http" and _is_protected(scope["path"]) and scope.get("method") != "OPTIONS":
            token = _bearer_token(scope)
            if token is None or not _matches_any(token, self.keys):
                message = ("missing API key: send it as 'Authorization: Bearer <key>'" if token is None
                           else "incorrect API key provided")
                err = APIError(401, message, code="invalid_api_key")
                response = JSONResponse(err.to_dict(), status_code=401, headers={"WWW-Authenticate": "Bearer"})
                await response(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _is_protected(path: str) -> bool:
    return path == PROTECTED_PREFIX or path.startswith(PROTECTED_PREFIX + "/") or path.rstrip("/") in PROTECTED_PATHS


class BodySizeLimit:
    """413 for a request whose Content-Length exceeds the limit, before its body is read. A body
    without a Content-Length (chunked) is counted while the handler reads it (read_json_object)."""

    def __init__(self, app, max_body_bytes: int):
        self.app = app
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] == "http":
            length = _content_length(scope)
            if length is not None and length > self.max_body_bytes:
                err = body_too_large(self.max_body_bytes)
                if length <= DRAIN_LIMIT:
                    # Read what the client is still sending: answering and closing mid-upload resets the
                    # connection under the client, which then sees a reset instead of the 413.
                    await _drain(receive)
                await JSONResponse(err.to_dict(), status_code=413, headers={"Connection": "close"})(
                    scope, receive, send)
                return
        await self.app(scope, receive, send)


# Bodies up to this size are read and discarded before the 413 (cheap); larger ones get it at once.
DRAIN_LIMIT = 8 << 20


async def _drain(receive) -> None:
    while True:
        message = await receive()
        if message["type"] != "http.request" or not message.get("more_body", False):
            return


def body_too_large(limit: int) -> APIError:
    return APIError(413, f"request body exceeds {limit} bytes (--max-request-body-bytes)",
                    code="request_too_large")


def _content_length(scope) -> Optional[int]:
    for name, value in scope.get("headers", ()):
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None
