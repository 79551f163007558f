"""OpenAI-compatible HTTP server: `python -m fastdeploy.entrypoints.openai.api_server [--model DIR]`.

Endpoints: POST /v1/completions, POST /v1/chat/completions (JSON or SSE), GET /v1/models,
POST /tokenize, POST /detokenize, GET /tokenizer_info (vLLM's; serving_tokenization.py),
GET /health (200 once the engine process is ready, 503 while starting, after it died, or while
shutting down), GET /metrics (Prometheus text; also on --metrics-port when that differs).
With --api-key (or FD_API_KEY) every /v1/* and tokenizer route needs `Authorization: Bearer <key>`; bodies over
--max-request-body-bytes get 413 (access_control.py).

Every error a client can cause is a 4xx with an OpenAI error body; the engine runs in its own
process (engine_client.py). SIGTERM/SIGINT: stop accepting, end in-flight requests, stop the
engine process, exit 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import socket
import sys
from contextlib import asynccontextmanager
from typing import Callable, Optional, Sequence

import uvicorn
from fastapi import FastAPI
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, PlainTextResponse, Response

from fastdeploy import envs
from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.entrypoints.openai.access_control import (
    DEFAULT_MAX_BODY_BYTES,
    APIKeyGuard,
    BodySizeLimit,
    body_too_large,
    resolve_api_keys,
)
from fastdeploy.entrypoints.openai.engine_client import EngineClient, EngineUnavailableError
from fastdeploy.entrypoints.openai.metrics import CONTENT_TYPE, ServerMetrics
from fastdeploy.entrypoints.openai.protocol import (
    APIError,
    ChatCompletionRequest,
    CompletionRequest,
    ModelCard,
    ModelList,
    bad_request,
    validation_error_to_api_error,
)
from fastdeploy.entrypoints.openai.serving_chat import OpenAIServingChat
from fastdeploy.entrypoints.openai.serving_completion import OpenAIServingCompletion, engine_error_to_api_error
from fastdeploy.entrypoints.openai.serving_tokenization import (
    DetokenizeRequest,
    OpenAIServingTokenization,
    TokenizeRequest,
)
from fastdeploy.log_format import configure_logging, uvicorn_log_config
from fastdeploy.paddle_env import require_paddle

logger = logging.getLogger("fastdeploy.entrypoints.api_server")

# Backstop for uvicorn's wait on open connections at shutdown; in-flight requests are aborted
# first, so they normally close within a step.
GRACEFUL_SHUTDOWN_S = 10
# How often start-up checks whether the engine process is ready, to print the one "ready" line.
READY_POLL_S = 0.05
# Paths also served on --metrics-port when it differs from --port.
METRICS_PORT_PATHS = ("/metrics", "/health", "/version")


class _HelpFormatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Defaults after every flag's help; the environment-flag epilog keeps its line breaks."""


def env_flags_epilog() -> str:
    lines = ["environment flags (read at start-up; see docs/ for what they change):"]
    for name, default, meaning in envs.describe():
        lines.append(f"  {name}={default}")
        if meaning:
            lines.append(f"      {meaning}")
    return "\n".join(lines)


def version_string() -> str:
    from importlib import metadata

    from fastdeploy.version import __version__

    paddle = "not installed"
    for dist in ("paddlepaddle", "paddlepaddle-gpu"):
        try:
            paddle = f"{dist} {metadata.version(dist)}"
            break
        except metadata.PackageNotFoundError:
            continue
    return f"fastdeploy-headwise-swa {__version__} ({paddle})"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m fastdeploy.entrypoints.openai.api_server",
        description="FastDeploy OpenAI-compatible API server (head-wise SWA KV cache).",
        epilog=env_flags_epilog(),
        formatter_class=_HelpFormatter,
        # EngineArgs may define some of these flags too; its definition wins.
        conflict_handler="resolve",
    )
    parser.add_argument("--version", action="version", version=version_string())
    server = parser.add_argument_group("server")
    server.add_argument("--host", type=str, default="0.0.0.0", help="address to listen on")
    server.add_argument("--port", type=int, default=8000, help="port of the API")
    server.add_argument("--metrics-port", type=int, default=None,
                        help="also serve /metrics on this port (None: only on --port)")
    server.add_argument("--max-concurrency", type=_positive_int, default=None,
                        help="most requests in flight; more get HTTP 429 (None: unlimited)")
    server.add_argument("--api-key", action="append", default=None, metavar="KEY",
                        help="require 'Authorization: Bearer KEY' on every /v1/* route (repeat for several "
                             "keys; /health, /metrics and /version stay open). None: the comma-separated "
                             "FD_API_KEY environment variable; neither set: no key needed")
    server.add_argument("--max-request-body-bytes", type=_positive_int, default=DEFAULT_MAX_BODY_BYTES,
                        help="larger request bodies get HTTP 413")
    server.add_argument("--disable-uvicorn-access-log", action="store_true", help="do not log every request")
    server.add_argument("--log-level", type=str, default="info",
                        choices=["critical", "error", "warning", "info", "debug"], help="server log level")
    EngineArgs.add_cli_args(parser)
    return parser


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


# ============================================================================ app

def error_response(err: APIError) -> JSONResponse:
    return JSONResponse(err.to_dict(), status_code=err.status)


async def read_json_object(raw_request: Request) -> dict:
    """The body as a JSON object; anything else is a 4xx naming what is wrong."""
    chunks, size = [], 0
    limit = raw_request.app.state.max_body_bytes
    async for chunk in raw_request.stream():
        size += len(chunk)
        if size > limit:
            raise body_too_large(limit)
        chunks.append(chunk)
    body = b"".join(chunks)
    try:
        text = body.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise bad_request(f"request body is not valid UTF-8 (invalid byte at offset {exc.start})") from None
    if not text.strip():
        raise bad_request("request body is empty; expected a JSON object")
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        raise bad_request(f"request body is not valid JSON: {exc.msg} (line {exc.lineno}, column {exc.colno})") \
            from None
    except RecursionError:
        raise bad_request("request body is nested too deeply") from None
    except ValueError as exc:  # e.g. an integer literal past Python's 4300-digit conversion limit
        raise bad_request(f"request body has a value that cannot be read: {exc}") from None
    if not isinstance(obj, dict):
        raise bad_request("request body must be a JSON object")
    # JSON may escape half a UTF-16 surrogate pair ("\ud800"); such a string is no text: it could
    # not be tokenized, nor even quoted back in an error message.
    if "\\u" in text and _has_lone_surrogate(obj):
        raise bad_request("request body contains an unpaired UTF-16 surrogate escape (\\ud800-\\udfff)")
    return obj


def _has_lone_surrogate(value) -> bool:
    stack = [value]
    while stack:
        item = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                return True
        elif isinstance(item, dict):
            stack.extend(item.keys())
            stack.extend(item.values())
        elif isinstance(item, list):
            stack.extend(item)
    return False


def parse_request(model_cls, obj: dict):
    try:
        return model_cls.model_validate(obj)
    except ValidationError as exc:
        raise validation_error_to_api_error(exc) from None


def build_app(client: EngineClient, metrics: ServerMetrics, api_port: Optional[int] = None,
              on_startup_failure=None, api_keys: Sequence[str] = (),
              max_body_bytes: int = DEFAULT_MAX_BODY_BYTES, on_ready: Optional[Callable[[], None]] = None,
              model_config=None) -> FastAPI:
    """The ASGI app. When api_port is given, requests arriving on any other port (the metrics
    port) may only reach /metrics and /health. With api_keys, /v1/* needs one of them. on_ready
    runs once, when the engine process is ready (when /health turns 200). model_config: the engine's
    (its tokenizer serves the tokenizer routes); None: built from the client's engine args."""

    async def announce_ready():
        while client.info is None:
            await asyncio.sleep(READY_POLL_S)
        on_ready()

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        client.start(on_fatal=on_startup_failure)
        ready_task = asyncio.create_task(announce_ready()) if on_ready is not None else None
        try:
            yield
        finally:
            if ready_task is not None:
                ready_task.cancel()
            await client.shutdown()

    app = FastAPI(title="FastDeploy OpenAI-compatible API", lifespan=lifespan, docs_url=None, redoc_url=None)
    completions = OpenAIServingCompletion(client)
    chat = OpenAIServingChat(client)
    tokenization = _tokenization(client, model_config)

    app.state.max_body_bytes = max_body_bytes
    if api_port is not None:
        app.add_middleware(MetricsPortGuard, api_port=api_port)
    app.add_middleware(BodySizeLimit, max_body_bytes=max_body_bytes)
    if api_keys:
        app.add_middleware(APIKeyGuard, api_keys=api_keys)

    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError):
        return error_response(exc)

    @app.exception_handler(EngineUnavailableError)
    async def _engine_unavailable(_: Request, exc: EngineUnavailableError):
        return error_response(engine_error_to_api_error(exc))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException):
        kind = "invalid_request_error" if exc.status_code < 500 else "internal_server_error"
        return JSONResponse(APIError(exc.status_code, str(exc.detail), type=kind).to_dict(),
                            status_code=exc.status_code, headers=getattr(exc, "headers", None))

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception):
        # Starlette re-raises after this response is sent, and uvicorn logs the traceback once.
        return error_response(APIError(500, "internal server error", type="internal_server_error"))

    @app.post("/v1/completions")
    async def create_completion(raw_request: Request) -> Response:
        request = parse_request(CompletionRequest, await read_json_object(raw_request))
        return await completions.create_completion(request, raw_request)

    @app.post("/v1/chat/completions")
    async def create_chat_completion(raw_request: Request) -> Response:
        request = parse_request(ChatCompletionRequest, await read_json_object(raw_request))
        return await chat.create_chat_completion(request, raw_request)

    # vLLM's render endpoints: the token ids a completion / chat body becomes, without running it. A KV-aware
    # router (vllm-router's kv_aware and cache_aware) asks every replica for them and matches them against
    # the replica's KV-cache events, which carry the same ids.
    @app.post("/v1/completions/render")
    async def render_completion(raw_request: Request) -> Response:
        request = parse_request(CompletionRequest, await read_json_object(raw_request))
        prompts = request.prompt
        if isinstance(prompts, str) or prompts and isinstance(prompts[0], int):
            prompts = [prompts]
        return JSONResponse([{"token_ids": p if not isinstance(p, str) else tokenization.tokenize(
            TokenizeRequest(prompt=p))["tokens"]} for p in prompts])

    @app.post("/v1/chat/completions/render")
    async def render_chat_completion(raw_request: Request) -> Response:
        request = parse_request(ChatCompletionRequest, await read_json_object(raw_request))
        ids = tokenization.tokenize(TokenizeRequest(messages=request.messages))["tokens"]
        return JSONResponse({"token_ids": ids})

    @app.post("/tokenize")
    async def tokenize(raw_request: Request) -> Response:
        request = parse_request(TokenizeRequest, await read_json_object(raw_request))
        return JSONResponse(tokenization.tokenize(request))

    @app.post("/detokenize")
    async def detokenize(raw_request: Request) -> Response:
        request = parse_request(DetokenizeRequest, await read_json_object(raw_request))
        return JSONResponse(tokenization.detokenize(request))

    @app.get("/tokenizer_info")
    async def tokenizer_info() -> Response:
        return JSONResponse(tokenization.info())

    @app.get("/v1/models")
    async def list_models() -> Response:
        client.check_available()
        info = client.info
        card = ModelCard(id=info.served_model_name, root=info.served_model_name,
                         max_model_len=info.max_model_len, vocab_size=info.vocab_size)
        return JSONResponse(ModelList(data=[card]).model_dump())

    @app.get("/version")
    async def version() -> Response:
        from fastdeploy.version import __version__

        return JSONResponse({"version": __version__})

    @app.get("/health")
    async def health() -> Response:
        client.check_available()
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> Response:
        return PlainTextResponse(metrics.render(client.stats, client.num_in_flight), media_type=CONTENT_TYPE)

    return app


def _tokenization(client: EngineClient, model_config) -> OpenAIServingTokenization:
    """The tokenizer routes' handler, with the tokenizer the engine process loads for the same config."""
    from fastdeploy.input.tokenizer_loader import load_tokenizer

    if model_config is None:
        model_config = client.engine_args.create_engine_config().model_config
    fallback = int(model_config.max_model_len)
    return OpenAIServingTokenization(load_tokenizer(model_config), int(model_config.vocab_size),
                                     lambda: client.info.max_model_len if client.info is not None else fallback)


class MetricsPortGuard:
    """Plain ASGI middleware (BaseHTTPMiddleware would interfere with streaming disconnects):
    on any port but the API port, only METRICS_PORT_PATHS exist."""

    def __init__(self, app, api_port: int):
        self.app = app
        self.api_port = api_port

    async def __call__(self, scope, receive, send):
        server = scope.get("server") if scope["type"] == "http" else None
        if server and server[1] != self.api_port and scope["path"] not in METRICS_PORT_PATHS:
            response = error_response(APIError(404, "only /metrics, /health and /version are served here",
                                               code="not_found"))
            await response(scope, receive, send)
            return
        await self.app(scope, receive, send)


# ============================================================================ process

class _Server(uvicorn.Server):
    """uvicorn's server, plus: a shutdown signal also ends in-flight requests at once, so the
    graceful wait for open connections does not wait for long generations to finish."""

    def __init__(self, config: uvicorn.Config, client: EngineClient):
        super().__init__(config)
        self.client = client
        self.loop: Optional[asyncio.AbstractEventLoop] = None
        self.startup_error: Optional[str] = None

    async def startup(self, sockets=None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)

    def handle_exit(self, sig, frame) -> None:
        super().handle_exit(sig, frame)
        if self.loop is not None:
            self.loop.call_soon_threadsafe(self.client.begin_shutdown)

    def fail_startup(self, reason: str) -> None:
        """The engine died before it was ready: nothing to serve, exit non-zero."""
        if self.client.info is None:
            self.startup_error = reason
            self.should_exit = True


def bind_socket(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def main(argv: Optional[list] = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        require_paddle()
    except ImportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    configure_logging(args.log_level)
    engine_args = EngineArgs.from_cli_args(args)
    try:
        fd_config = engine_args.create_engine_config()  # fail on a bad flag before opening any port
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2

    listen = [("--port", args.port)]
    if args.metrics_port is not None and args.metrics_port != args.port:
        listen.append(("--metrics-port", args.metrics_port))
    sockets = []
    for flag, port in listen:
        try:
            sockets.append(bind_socket(args.host, port))
        except OSError as exc:
            print(f"error: cannot listen on {args.host}:{port} ({flag}): {exc.strerror or exc}", file=sys.stderr)
            return 2

    metrics = ServerMetrics()
    client = EngineClient(engine_args, metrics, max_concurrency=args.max_concurrency)
    server_box: list[_Server] = []
    api_keys = resolve_api_keys(args.api_key, envs.FD_API_KEY)

    def announce_ready() -> None:
        logger.info("ready: serving %s on http://%s:%d%s%s", client.info.served_model_name, args.host, args.port,
                    f" (metrics also on port {args.metrics_port})" if len(sockets) > 1 else "",
                    " (API key required on /v1/*)" if api_keys else "")

    app = build_app(client, metrics, api_port=args.port,
                    on_startup_failure=lambda reason: server_box[0].fail_startup(reason),
                    api_keys=api_keys, max_body_bytes=args.max_request_body_bytes, on_ready=announce_ready,
                    model_config=fd_config.model_config)
    config = uvicorn.Config(app, log_level=args.log_level, access_log=not args.disable_uvicorn_access_log,
                            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S,
                            log_config=uvicorn_log_config(args.log_level))
    server = _Server(config, client)
    server_box.append(server)

    # uvicorn re-raises the shutdown signal once it has stopped; with these handlers installed
    # first, that re-raise is a no-op and a graceful shutdown exits 0.
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: None)
    logger.info("starting on http://%s:%d: building the engine; a 'ready' line follows", args.host, args.port)
    server.run(sockets=sockets)
    if server.startup_error is not None:
        print(f"error: the engine failed to start: {server.startup_error}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
