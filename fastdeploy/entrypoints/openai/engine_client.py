"""Runs the LLMEngine in its own process and gives the HTTP server an async view of it.

The engine is CPU-bound and not thread-safe, so it gets a whole process (spawned, so it inherits no
event loop or threads): HTTP parsing and streaming never stall a model step, and a step never
stalls HTTP. Two multiprocessing queues connect them:

  server -> engine:  ("add", request_id, AddPayload) | ("abort", request_id) | ("shutdown",)
  engine -> server:  ("ready", info) | ("fatal", message) | ("added", request_id)
                     | ("rejected", request_id, message, is_client_error)
                     | ("outputs", [EngineOutput, ...]) | ("stats", dict)
                     (and ("reader_stop",), put by the server itself to end its reader at shutdown)

In the server one reader thread blocks on the output queue and hands every message to the event
loop, which routes outputs to per-request asyncio queues. The reader also watches the engine
process, so a crash turns into 503s for waiting requests instead of hangs.
"""

from __future__ import annotations

import asyncio
import logging
import math
import multiprocessing
import multiprocessing.connection
import queue
import signal
import sys
import threading
import time
import traceback
from dataclasses import dataclass, field
from typing import Any, AsyncIterator, Callable, Optional

from fastdeploy.entrypoints.openai.metrics import ServerMetrics
from fastdeploy.log_format import configure_logging

logger = logging.getLogger("fastdeploy.entrypoints.engine_client")

# How often the engine process publishes get_stats(): while stepping / while idle (seconds).
STATS_INTERVAL_BUSY_S = 0.1
STATS_INTERVAL_IDLE_S = 0.5
# How often the reader thread checks that the engine process is still alive.
LIVENESS_POLL_S = 0.5
# How often the engine polls KV transfers (disaggregation) while it has nothing else to run (seconds).
TRANSFER_POLL_S = 0.002
MIN_LOGPROB = -9999.0


class EngineUnavailableError(Exception):
    """The engine is starting, has died, or the server is shutting down (HTTP 503)."""


class KVTransferFailedError(EngineUnavailableError):
    """A decode request's prompt KV could not be read from the prefill server (kv_load_failure_policy
    "fail"; HTTP 503)."""


class ConcurrencyLimitError(Exception):
    """More requests in flight than --max-concurrency allows (HTTP 429)."""


class RequestRejectedError(Exception):
    """The engine refused the request; `is_client_error` tells 400 from 500."""

    def __init__(self, message: str, is_client_error: bool = True):
        super().__init__(message)
        self.is_client_error = is_client_error


@dataclass
class AddPayload:
    """What the engine process needs to admit one request."""

    prompt: Any                       # str or list[int]; ignored when messages is set
    messages: Optional[list] = None   # chat: rendered with the engine's chat template
    sampling: dict = field(default_factory=dict)  # SamplingParams kwargs; max_tokens None = fill context
    echo: bool = False                # completions echo: the first output carries the prompt's text
    kv_transfer_params: Optional[dict] = None  # its part in a prefill/decode pair (disaggregation/)


@dataclass
class TokenLogprob:
    token: str                 # the token's text; "bytes:\\xNN..." when it is not whole UTF-8 on its own
    logprob: Optional[float]
    top: list                  # [(token_str, logprob, token_bytes), ...], most likely first
    bytes: list = field(default_factory=list)  # the token's own bytes (OpenAI chat `bytes`)


@dataclass
class EngineOutput:
    """One request's progress after a step, trimmed to what the API needs."""

    request_id: str
    num_prompt_tokens: int
    num_output_tokens: int
    text: str                                   # cumulative decoded text
    finished: bool
    finish_reason: Optional[str]
    new_logprobs: Optional[list] = None         # TokenLogprob for tokens new since the last output
    # Upstream FastDeploy's `arrival_time`: seconds from the request's arrival in the engine to this
    # output (its newest token); clients derive server-side TTFT / ITL / E2E latency from it.
    arrival_time: float = 0.0
    num_cached_tokens: int = 0                  # prompt tokens served from the prefix cache
    # Echo (first output only): the prompt's text, and with prompt_logprobs one TokenLogprob per prompt
    # token (the first has logprob None and no top entries).
    prompt_text: Optional[str] = None
    prompt_logprobs: Optional[list] = None
    kv_transfer_params: Optional[dict] = None   # a prefill server's answer for the decode server
    error: Optional[str] = None                 # the request failed (its KV could not be loaded)
    # A chat reply read by a reasoning parser (--reasoning-parser harmony): `text` is then its content and this
    # its cumulative reasoning; None for every other request.
    reasoning_text: Optional[str] = None


@dataclass
class EngineInfo:
    served_model_name: str
    max_model_len: int
    vocab_size: int


# ============================================================================ engine process

def run_engine_process(engine_args, requests_q, outputs_q) -> None:
    """Entry point of the engine process: build the engine, then serve the request queue."""
    # Ctrl+C reaches the whole process group; the server decides when the engine stops.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    # Before Paddle's import: with no root handler it installs one of its own format.
    configure_logging()
    try:
        from fastdeploy.engine.engine import LLMEngine

        engine = LLMEngine.from_engine_args(engine_args)
        mc = engine.fd_config.model_config
        info = EngineInfo(served_model_name=mc.served_model_name, max_model_len=int(mc.max_model_len),
                          vocab_size=int(engine.tokenizer.vocab_size))
        harmony = _reasoning_parser(engine_args, engine)
    except Exception as exc:  # start-up failure: report it, the server exits with it
        outputs_q.put(("fatal", f"{type(exc).__name__}: {exc}"))
        if not isinstance(exc, ValueError):
            traceback.print_exc()
        _flush_and_exit(outputs_q, 1)
    # Paddle's import installs a SIGTERM handler that prints a C++ "traceback" and aborts; a
    # SIGTERM sent to the whole process group (docker stop, systemd) should end us quietly.
    signal.signal(signal.SIGTERM, _exit_quietly)
    loop = _EngineLoop(engine, info, requests_q, outputs_q, harmony)
    # The first snapshot goes out before "ready" (the queue keeps the order), so /metrics carries the
    # page gauges from the moment /health turns 200, even when the first step is a long prefill.
    loop.publish_stats()
    outputs_q.put(("ready", info))
    try:
        loop.run()
    except Exception as exc:
        traceback.print_exc()
        outputs_q.put(("fatal", f"engine step failed: {type(exc).__name__}: {exc}"))
        _flush_and_exit(outputs_q, 1)
    finally:
        engine.close()  # stops the tensor-parallel workers on every exit path (SIGTERM included)
    _flush_and_exit(outputs_q, 0)


def _reasoning_parser(engine_args, engine):
    """The harmony markers chat replies are parsed with (--reasoning-parser harmony, or a gpt-oss checkpoint with
    a harmony tokenizer), or None."""
    from fastdeploy.input.harmony_parser import end_stops_replies, harmony_for

    mc = engine.fd_config.model_config
    try:
        tokens = harmony_for(getattr(engine_args, "reasoning_parser", None), mc.architectures, engine.tokenizer)
    except ValueError:
        engine.close()
        raise
    if tokens is not None and end_stops_replies(tokens, mc.eos_token_ids):
        logger.warning("the model's end tokens (config.json / generation_config.json) include <|end|>, which closes "
                       "every harmony message: replies stop after their first message, and their content is only "
                       "the final-channel text written before it")
    return tokens


def _exit_quietly(_signum, _frame) -> None:
    raise SystemExit(0)


def _flush_and_exit(outputs_q, code: int) -> None:
    outputs_q.close()
    outputs_q.join_thread()
    sys.exit(code)


class _EngineLoop:
    def __init__(self, engine, info: EngineInfo, requests_q, outputs_q, harmony=None):
        self.engine = engine
        self.harmony = harmony  # HarmonyTokens: chat replies are split into content and reasoning
        self.parsers: dict = {}  # request id -> its HarmonyParser (chat requests, with harmony on)
        self.info = info
        self.requests_q = requests_q
        self.outputs_q = outputs_q
        self.logprobs_sent: dict[str, int] = {}   # request id -> logprob entries already shipped
        self.wants_logprobs: dict[str, int] = {}  # request id -> top-k asked for
        self.echo_pending: dict[str, Optional[str]] = {}  # request id -> its prompt string (None: token ids)
        self.last_stats = 0.0
        self.was_active = False
        self.parent = multiprocessing.parent_process()

    def run(self) -> None:
        while True:
            aborted = False
            # Block for the next message while nothing can run; KV transfers in flight are polled often.
            transfers = self.engine.transfers_pending
            for msg in self._drain(block=not self.engine.has_runnable_requests(),
                                   timeout=TRANSFER_POLL_S if transfers else STATS_INTERVAL_IDLE_S):
                if msg[0] == "shutdown":
                    return
                if msg[0] == "add":
                    self._add(msg[1], msg[2])
                elif msg[0] == "abort":
                    self._forget(msg[1])
                    self.engine.abort_request(msg[1])
                    aborted = True
            stepped = self.engine.has_unfinished_requests() or transfers
            if stepped:
                outputs = self.engine.step()
                if outputs:
                    self.outputs_q.put(("outputs", [self._convert(o) for o in outputs]))
            busy = self.engine.has_unfinished_requests()
            active = busy or self.engine.transfers_pending
            # Publish at once when the engine falls idle (an abort, the last request done, the last parked
            # pages read; also a request that came and went within one step), so /metrics never shows an
            # idle engine with the counters of before its last work.
            self._publish_stats(0.0 if aborted or not active and (self.was_active or stepped)
                                else STATS_INTERVAL_BUSY_S if busy else STATS_INTERVAL_IDLE_S)
            self.was_active = active
            if self.parent is not None and not self.parent.is_alive():
                return  # orphaned: nobody can read our outputs

    def _drain(self, block: bool, timeout: float = STATS_INTERVAL_IDLE_S) -> list:
        msgs = []
        try:
            msgs.append(self.requests_q.get(timeout=timeout) if block
                        else self.requests_q.get_nowait())
            while True:
                msgs.append(self.requests_q.get_nowait())
        except queue.Empty:
            pass
        return msgs

    def _add(self, request_id: str, payload: AddPayload) -> None:
        from fastdeploy.engine.request import SamplingParams
        from fastdeploy.input.chat_template import with_turn_stops

        parser = None
        try:
            prompt = payload.prompt
            params = SamplingParams(**payload.sampling)
            if payload.messages is not None:  # rendered and tokenized as LLM.chat does
                tokenizer = self.engine.tokenizer
                prompt = tokenizer.encode_chat(payload.messages)
                params = with_turn_stops(params, tokenizer.chat_template)
                if self.harmony is not None:
                    from fastdeploy.input.harmony_parser import HarmonyParser

                    parser = HarmonyParser(self.harmony, tokenizer.decode, params.stop)
            # validates prompt, length, params and kv_transfer_params
            self.engine.add_request(request_id, prompt, params, payload.kv_transfer_params)
        except ValueError as exc:
            self.outputs_q.put(("rejected", request_id, str(exc), True))
            return
        except Exception as exc:  # an engine bug must not take the loop down for one request
            traceback.print_exc()
            self.outputs_q.put(("rejected", request_id, f"internal error: {type(exc).__name__}", False))
            return
        if parser is not None:
            self.parsers[request_id] = parser
        if params.logprobs is not None:
            self.wants_logprobs[request_id] = params.logprobs
            self.logprobs_sent[request_id] = 0
        if payload.echo:
            self.echo_pending[request_id] = prompt if isinstance(prompt, str) else None
        self.outputs_q.put(("added", request_id))

    def _forget(self, request_id: str) -> None:
        self.wants_logprobs.pop(request_id, None)
        self.logprobs_sent.pop(request_id, None)
        self.echo_pending.pop(request_id, None)
        self.parsers.pop(request_id, None)

    def _convert(self, out) -> EngineOutput:
        comp = out.outputs
        converted = EngineOutput(
            request_id=out.request_id, num_prompt_tokens=len(out.prompt_token_ids),
            num_output_tokens=len(comp.token_ids), text=comp.text, finished=out.finished,
            finish_reason=comp.finish_reason,
            arrival_time=max(0.0, time.time() - out.metrics.get("arrival_time", time.time())),
            num_cached_tokens=int(out.metrics.get("num_cached_tokens") or 0),
            kv_transfer_params=out.kv_transfer_params, error=out.error,
        )
        parser = self.parsers.get(out.request_id)
        if parser is not None:
            parser.feed(comp.token_ids)
            converted.text, converted.reasoning_text = parser.result(comp.text, out.finished)
        if out.request_id in self.wants_logprobs:
            converted.new_logprobs = self._new_logprobs(out.request_id, comp)
        if out.request_id in self.echo_pending:
            text = self.echo_pending.pop(out.request_id)
            converted.prompt_text = self.engine.tokenizer.decode(out.prompt_token_ids) if text is None else text
            if out.prompt_logprobs is not None:
                converted.prompt_logprobs = self._prompt_logprobs(out)
        if out.finished:
            self._forget(out.request_id)
        return converted

    def _new_logprobs(self, request_id: str, comp) -> list:
        # Decoding token strings here keeps the tokenizer in one process.
        sent = self.logprobs_sent.get(request_id, 0)
        k = self.wants_logprobs[request_id]
        entries = [self._entry(token_id, dist or {}, k)
                   for token_id, dist in zip(comp.token_ids[sent:], (comp.logprobs or [])[sent:])]
        self.logprobs_sent[request_id] = sent + len(entries)
        return entries

    def _prompt_logprobs(self, out) -> list:
        # The first prompt token has nothing before it to predict it: its dist is None.
        k = self.wants_logprobs.get(out.request_id, 0)
        return [self._entry(token_id, dist, k) for token_id, dist in zip(out.prompt_token_ids, out.prompt_logprobs)]

    def _entry(self, token_id: int, dist, k: int) -> TokenLogprob:
        """One token's entry: its logprob in `dist` (None where absent) and the k most likely of `dist`."""
        tokenizer = self.engine.tokenizer
        text, raw = token_text_and_bytes(tokenizer, token_id)
        dist = dist or {}
        chosen = dist.get(token_id)
        top = sorted(dist.items(), key=lambda kv: kv[1], reverse=True)[:k]
        return TokenLogprob(token=text, logprob=None if chosen is None else _finite(chosen), bytes=raw,
                            top=[_top_entry(tokenizer, t, lp) for t, lp in top])

    def _publish_stats(self, min_interval: float) -> None:
        if time.monotonic() - self.last_stats >= min_interval:
            self.publish_stats()

    def publish_stats(self) -> None:
        """Ship a snapshot now; the server shows it until the next one (never nothing)."""
        self.last_stats = time.monotonic()
        self.outputs_q.put(("stats", self.engine.get_stats()))


def token_text_and_bytes(tokenizer, token_id: int, name_specials: bool = False) -> tuple:
    """(text, bytes) of one token, as OpenAI reports logprob tokens: a token that is only part of
    a UTF-8 character (a lone byte of a byte-level vocabulary) has no text of its own, so its text
    is `bytes:\\xNN...` (unique per token, unlike the U+FFFD its decoding shows) and its bytes are
    its real bytes, from which a client can rebuild the output text. `name_specials`: a special
    token that decodes to nothing is shown by its vocabulary name (top_logprobs keys stay unique)."""
    text = tokenizer.decode([token_id])
    raw = tokenizer.token_bytes(token_id) if hasattr(tokenizer, "token_bytes") else text.encode("utf-8")
    if "\ufffd" in text and "\ufffd" not in raw.decode("utf-8", errors="ignore"):
        text = "bytes:" + "".join(f"\\x{b:02x}" for b in raw)
    elif not text and name_specials and hasattr(tokenizer, "id_to_token"):  # a special token decodes to nothing
        text = tokenizer.id_to_token(token_id) or ""
    return text, list(raw)


def _top_entry(tokenizer, token_id: int, logprob) -> tuple:
    text, raw = token_text_and_bytes(tokenizer, token_id, name_specials=True)
    return text, _finite(logprob), raw


def _finite(logprob) -> float:
    """JSON has no -Infinity; OpenAI reports impossible tokens as -9999.0."""
    value = float(logprob)
    return value if math.isfinite(value) else MIN_LOGPROB


# ============================================================================ server side

class _RequestState:
    __slots__ = ("accepted", "queue", "arrival", "first_token")

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.accepted: asyncio.Future = loop.create_future()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.arrival = time.monotonic()
        self.first_token: Optional[float] = None


class EngineClient:
    """Async handle on the engine process; every method runs on the server's event loop thread."""

    def __init__(self, engine_args, metrics: ServerMetrics, max_concurrency: Optional[int] = None):
        self.engine_args = engine_args
        self.metrics = metrics
        self.max_concurrency = max_concurrency
        self.info: Optional[EngineInfo] = None
        self.stats: Optional[dict] = None
        self.closing = False
        self.dead_reason: Optional[str] = None
        self._ctx = multiprocessing.get_context("spawn")
        self._requests_q = self._ctx.Queue()
        self._outputs_q = self._ctx.Queue()
        self._proc = None
        self._reader: Optional[threading.Thread] = None
        self._stop_reader = threading.Event()
        self._loop: Optional[asyncio.AbstractEventLoop] = None
        self._states: dict[str, _RequestState] = {}
        self._on_fatal: Optional[Callable[[str], None]] = None

    # ---------------------------------------------------------------- lifecycle
    def start(self, on_fatal: Optional[Callable[[str], None]] = None) -> None:
        """Spawn the engine process; returns at once (readiness arrives as a message)."""
        self._loop = asyncio.get_running_loop()
        self._on_fatal = on_fatal
        self._proc = self._ctx.Process(target=run_engine_process, name="fastdeploy-engine",
                                       args=(self.engine_args, self._requests_q, self._outputs_q))
        self._proc.start()
        self._reader = threading.Thread(target=self._read_outputs, name="engine-output-reader", daemon=True)
        self._reader.start()

    @property
    def ready(self) -> bool:
        return self.info is not None and self.dead_reason is None and not self.closing

    @property
    def num_in_flight(self) -> int:
        return len(self._states)

    def begin_shutdown(self) -> None:
        """Stop taking requests and end every in-flight one (their streams see a 503 error)."""
        if self.closing:
            return
        self.closing = True
        for request_id in list(self._states):
            self.abort(request_id, EngineUnavailableError("the server is shutting down"))

    async def shutdown(self, timeout: float = 10.0) -> None:
        """Stop the engine process (gracefully, then by force) and the reader thread."""
        self.begin_shutdown()
        proc = self._proc
        if proc is not None and proc.is_alive():
            self._requests_q.put(("shutdown",))
            await asyncio.to_thread(proc.join, timeout)
            if proc.is_alive():
                logger.warning("engine process did not stop in %.0fs; terminating it", timeout)
                proc.terminate()
                await asyncio.to_thread(proc.join, 5.0)
            if proc.is_alive():
                proc.kill()
                await asyncio.to_thread(proc.join, 5.0)
        self._stop_reader.set()
        self._outputs_q.put(("reader_stop",))  # wake the reader now rather than at its next poll
        if self._reader is not None:
            await asyncio.to_thread(self._reader.join, 2 * LIVENESS_POLL_S)
        # Queues own feeder threads; do not let a half-written message block interpreter exit.
        self._requests_q.cancel_join_thread()
        self._outputs_q.cancel_join_thread()

    # ---------------------------------------------------------------- requests
    def check_available(self) -> None:
        if self.closing:
            raise EngineUnavailableError("the server is shutting down")
        if self.dead_reason is not None:
            raise EngineUnavailableError(f"the engine is not running ({self.dead_reason})")
        if self.info is None:
            raise EngineUnavailableError("the engine is still starting; retry shortly")

    def check_capacity(self, num_requests: int = 1) -> None:
        """Raise ConcurrencyLimitError unless `num_requests` more requests fit under --max-concurrency."""
        if self.max_concurrency is not None and len(self._states) + num_requests > self.max_concurrency:
            raise ConcurrencyLimitError(f"the server is at its limit of {self.max_concurrency} concurrent "
                                        f"requests (each of n choices counts as one); retry later")

    async def add_request(self, request_id: str, payload: AddPayload) -> "RequestStream":
        """Admit one request; raises EngineUnavailableError, ConcurrencyLimitError or RequestRejectedError."""
        return (await self.add_requests([(request_id, payload)]))[0]

    async def add_requests(self, items: list) -> list:
        """Admit [(request_id, payload), ...] together, all or none: their slots are taken before
        the first await, and if one is rejected (or the caller is cancelled) the others are aborted."""
        self.check_available()
        self.check_capacity(len(items))
        states = []
        for request_id, payload in items:
            state = _RequestState(self._loop)
            self._states[request_id] = state
            self._requests_q.put(("add", request_id, payload))
            states.append(state)
        try:
            results = await asyncio.gather(*(state.accepted for state in states), return_exceptions=True)
        except asyncio.CancelledError:
            for request_id, _ in items:
                self.abort(request_id)
            raise
        failure = next((r for r in results if isinstance(r, BaseException)), None)
        if failure is not None:
            for request_id, _ in items:
                self.abort(request_id)
            raise failure
        # one API request, whatever its number of choices
        self.metrics.observe_admitted(items[0][1].sampling.get("max_tokens"))
        return [RequestStream(self, request_id, state) for (request_id, _), state in zip(items, states)]

    def abort(self, request_id: str, reason: Optional[BaseException] = None) -> None:
        """Idempotent: drop the request here and free its pages in the engine."""
        state = self._states.pop(request_id, None)
        if state is None:
            return
        if self.dead_reason is None:
            self._requests_q.put(("abort", request_id))
        if reason is not None:
            if not state.accepted.done():
                state.accepted.set_exception(reason)
            state.queue.put_nowait(reason)

    # ---------------------------------------------------------------- engine messages
    def _read_outputs(self) -> None:
        """Reader thread: block on the output queue, forward to the loop, watch the process."""
        while not self._stop_reader.is_set():
            try:
                msg = self._outputs_q.get(timeout=LIVENESS_POLL_S)
            except queue.Empty:
                # The sentinel, not is_alive(): reaping the child here would race the join at shutdown.
                if multiprocessing.connection.wait([self._proc.sentinel], timeout=0):
                    self._call_in_loop(self._on_engine_exit, "engine process exited")
                    return
                continue
            except (EOFError, OSError, ValueError):  # queue torn down under us
                self._call_in_loop(self._on_engine_exit, "engine output queue closed")
                return
            if msg[0] == "reader_stop":
                return
            self._call_in_loop(self._handle, msg)

    def _call_in_loop(self, fn, *args) -> None:
        try:
            self._loop.call_soon_threadsafe(fn, *args)
        except RuntimeError:  # loop already closed during interpreter shutdown
            pass

    def _handle(self, msg: tuple) -> None:
        kind = msg[0]
        if kind == "outputs":
            for out in msg[1]:
                self._route(out)
        elif kind == "stats":
            self.stats = msg[1]
        elif kind == "added":
            state = self._states.get(msg[1])
            if state is not None and not state.accepted.done():
                state.accepted.set_result(None)
        elif kind == "rejected":
            state = self._states.pop(msg[1], None)
            if state is not None and not state.accepted.done():
                state.accepted.set_exception(RequestRejectedError(msg[2], msg[3]))
        elif kind == "ready":
            self.info = msg[1]
            logger.debug("engine ready: model %s, max_model_len %d", self.info.served_model_name,
                        self.info.max_model_len)
        elif kind == "fatal":
            self._on_engine_exit(msg[1])

    def _route(self, out: EngineOutput) -> None:
        state = self._states.get(out.request_id)
        if state is None:  # aborted while this step ran
            return
        now = time.monotonic()
        if state.first_token is None and out.num_output_tokens > 0:
            state.first_token = now
            self.metrics.observe_first_token(now - state.arrival)
        if out.finished:
            del self._states[out.request_id]
            self.metrics.observe_finished(state.arrival, state.first_token, now, out.num_output_tokens,
                                          out.finish_reason, out.num_prompt_tokens)
        state.queue.put_nowait(out)

    def _on_engine_exit(self, reason: str) -> None:
        if self.dead_reason is not None:
            return
        self.dead_reason = reason
        if not self.closing:
            logger.error("engine failed: %s", reason)
        err = EngineUnavailableError(f"the engine is not running ({reason})")
        for request_id in list(self._states):
            self.abort(request_id, err)
        if self._on_fatal is not None and not self.closing:
            self._on_fatal(reason)


class RequestStream:
    """Async iterator over one request's EngineOutputs; ends after the finished one."""

    def __init__(self, client: EngineClient, request_id: str, state: _RequestState):
        self.client = client
        self.request_id = request_id
        self._state = state
        self.finished = False

    def __aiter__(self) -> AsyncIterator[EngineOutput]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[EngineOutput]:
        while not self.finished:
            item = await self._state.queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            if item.error is not None:
                self.finished = True
                raise KVTransferFailedError(item.error)
            self.finished = item.finished
            yield item

    def abort(self) -> None:
        if not self.finished:
            self.finished = True
            self.client.abort(self.request_id)
