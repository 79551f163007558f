"""`--kv-events-config` (vLLM's JSON shape) and the ZMQ publisher of KV-cache events in vLLM's wire format.

What goes on the wire (vLLM's ZmqEventPublisher, as vllm-router 0.1.17's kv_aware policy reads it):
- a PUB socket at `endpoint`, bound when the address has `*`/`::` or is ipc/inproc, else connected (to a
  proxy), sending three frames per batch: the topic, the sequence number (8 bytes, big-endian, from 0),
  and the msgpack batch `[ts (float), [events as tagged maps], data_parallel_rank (0)]`;
- a ROUTER socket at `replay_endpoint` (optional, always bound): a consumer that missed sequence
  numbers sends `[b"", start (8 bytes)]` and gets `[b"", topic, seq, batch]` for every batch still in the
  last `buffer_steps`, then `[b"", b"", -1, b""]`.
The events themselves (what "stored" means head-wise, vLLM's hashes) are cache_manager/kv_events.py's.
A thread of its own sends and answers replays, so a slow consumer never stalls an engine step.
"""

from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass
from typing import Optional, Union

from fastdeploy.cache_manager.kv_events import STORED_BLOCKS
from fastdeploy.json_flag import json_object

logger = logging.getLogger("fastdeploy.engine.kv_events")

END_SEQ = (-1).to_bytes(8, "big", signed=True)


@dataclass(frozen=True)
class KVEventsConfig:
    enable_kv_cache_events: bool = False
    publisher: str = "zmq"
    endpoint: str = "tcp://*:5557"
    replay_endpoint: Optional[str] = None
    buffer_steps: int = 10_000      # batches kept for replay
    hwm: int = 100_000              # the PUB socket's send high-water mark
    max_queue_size: int = 100_000   # batches waiting for the sender thread (more are dropped and counted)
    topic: str = ""
    # This engine's own field: what a BlockStored announces with sliding heads (cache_manager/kv_events.py):
    # "hit_ends", a block a hit may end at; "hit_paths", a block on the way to one (what a router that
    # credits the run of stored blocks from a prompt's first block can use).
    stored_blocks: str = STORED_BLOCKS[0]

    @classmethod
    def parse(cls, text: Union[None, str, dict]) -> Optional["KVEventsConfig"]:
        """None when events are off; ValueError naming the bad field otherwise."""
        if text is None:
            return None
        spec = dict(json_object(text, "--kv-events-config", "of vLLM's KVEventsConfig fields"))
        unknown = sorted(set(spec) - set(cls.__dataclass_fields__))
        if unknown:
            raise ValueError(f"--kv-events-config: unknown field(s) {', '.join(unknown)} (known: "
                             f"{', '.join(cls.__dataclass_fields__)})")
        if not isinstance(spec.get("enable_kv_cache_events", False), bool):
            raise ValueError("--kv-events-config: enable_kv_cache_events must be true or false")
        for name in ("buffer_steps", "hwm", "max_queue_size"):
            value = spec.get(name, 1)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--kv-events-config: {name} must be a positive integer")
        if spec.get("replay_endpoint") is not None and not isinstance(spec["replay_endpoint"], str):
            raise ValueError("--kv-events-config: replay_endpoint must be a string")
        for name in ("publisher", "endpoint", "topic", "stored_blocks"):
            if name in spec and not isinstance(spec[name], str):
                raise ValueError(f"--kv-events-config: {name} must be a string")
        config = cls(**spec)
        if config.stored_blocks not in STORED_BLOCKS:
            raise ValueError(f"--kv-events-config: stored_blocks {config.stored_blocks!r} is not one of "
                             f"{', '.join(STORED_BLOCKS)}")
        if not config.enable_kv_cache_events:
            return None
        if config.publisher not in ("zmq", "null"):
            raise ValueError(f"--kv-events-config: publisher {config.publisher!r} is not built here (zmq, null)")
        if config.publisher == "zmq" and not config.endpoint.startswith(("tcp://", "ipc://", "inproc://")):
            raise ValueError(f"--kv-events-config: endpoint {config.endpoint!r} is not a ZMQ address (tcp://HOST:PORT)")
        return config


def _binds(endpoint: str) -> bool:
    return "*" in endpoint or "::" in endpoint or endpoint.startswith(("ipc://", "inproc://"))


class ZmqEventPublisher:
    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0):
        import msgpack
        import zmq

        self.config = config
        self._pack = msgpack.Packer(use_bin_type=True).pack
        self._rank = data_parallel_rank
        self._topic = config.topic.encode()
        self._ctx = zmq.Context()
        self._pub = self._ctx.socket(zmq.PUB)
        self._pub.setsockopt(zmq.SNDHWM, config.hwm)
        self._pub.setsockopt(zmq.LINGER, 0)
        self._replay = None
        try:
            (self._pub.bind if _binds(config.endpoint) else self._pub.connect)(config.endpoint)
            if config.replay_endpoint:
                self._replay = self._ctx.socket(zmq.ROUTER)
                self._replay.setsockopt(zmq.LINGER, 0)
                self._replay.bind(config.replay_endpoint)
        except zmq.ZMQError as e:
            self._close_sockets()
            raise ValueError(f"--kv-events-config: cannot open {config.endpoint} / {config.replay_endpoint}: {e}") \
                from None
        self._queue: queue.Queue = queue.Queue(maxsize=config.max_queue_size)
        self._buffer: collections.deque = collections.deque(maxlen=config.buffer_steps)
        self._seq = 0
        self.batches_dropped_total = 0
        self.events_published_total = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="kv-events", daemon=True)
        self._thread.start()
        logger.info("KV-cache events: publishing on %s%s", config.endpoint,
                    f", replay on {config.replay_endpoint}" if config.replay_endpoint else "")

    def publish(self, events: list) -> None:
        """Queue one batch (from the engine's thread); never blocks."""
        if not events:
            return
        try:
            self._queue.put_nowait([time.time(), events, self._rank])
            self.events_published_total += len(events)
        except queue.Full:
            self.batches_dropped_total += 1  # the consumer will see a gap and replay or start over

    def close(self) -> None:
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=5)
        self._close_sockets()

    # -- the sender thread ---------------------------------------------------------------------
    def _run(self) -> None:
        import zmq

        poller = zmq.Poller()
        if self._replay is not None:
            poller.register(self._replay, zmq.POLLIN)
        while not self._stop.is_set():
            try:
                batch = self._queue.get(timeout=0.005)
            except queue.Empty:
                batch = None
            if batch is not None:
                payload = self._pack(batch)
                seq = self._seq.to_bytes(8, "big")
                self._pub.send_multipart((self._topic, seq, payload))
                self._buffer.append((self._seq, payload))
                self._seq += 1
            if self._replay is not None and dict(poller.poll(0)):
                self._answer_replay()

    def _answer_replay(self) -> None:
        frames = self._replay.recv_multipart()
        if len(frames) != 3 or len(frames[2]) != 8:
            logger.warning("KV-cache events: a malformed replay request (%d frames) was ignored", len(frames))
            return
        client, start = frames[0], int.from_bytes(frames[2], "big")
        for seq, payload in list(self._buffer):
            if seq >= start:
                self._replay.send_multipart((client, b"", self._topic, seq.to_bytes(8, "big"), payload))
        self._replay.send_multipart((client, b"", b"", END_SEQ, b""))

    def _close_sockets(self) -> None:
        for sock in (self._pub, self._replay):
            if sock is not None:
                sock.close(linger=0)
        self._ctx.term()


class NullEventPublisher:
    """publisher "null": events are computed (and counted) but sent nowhere."""

    def __init__(self, config: KVEventsConfig, data_parallel_rank: int = 0):
        self.config = config
        self.batches_dropped_total = 0
        self.events_published_total = 0

    def publish(self, events: list) -> None:
        self.events_published_total += len(events)

    def close(self) -> None:
        pass


def make_publisher(config: KVEventsConfig):
    return (ZmqEventPublisher if config.publisher == "zmq" else NullEventPublisher)(config)
