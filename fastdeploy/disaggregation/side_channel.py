"""The side channel where two servers' transfer agents meet (vLLM's NIXL handshake, over ZeroMQ).

The prefill server answers on `side_channel_host:side_channel_port` with its agent's metadata and the
layout of its KV memory; the decode server asks once per prefill engine, checks that the two layouts
agree (a clear error, never wrong attention, when they do not) and keeps the answer. JSON both ways;
the agent metadata travels as base64.
"""

from __future__ import annotations

import base64
import json
import logging
import threading

logger = logging.getLogger("fastdeploy.disaggregation.side_channel")

PROTOCOL_VERSION = 1


class SideChannelServer:
    """A daemon thread answering handshakes with a fixed description of this server."""

    def __init__(self, host: str, port: int, description: dict, agent_metadata: bytes):
        import zmq

        self._reply = json.dumps({"ok": True, "version": PROTOCOL_VERSION, **description,
                                  "agent_metadata": base64.b64encode(agent_metadata).decode()}).encode()
        self._ctx = zmq.Context()
        self._sock = self._ctx.socket(zmq.ROUTER)
        self._sock.setsockopt(zmq.LINGER, 0)
        try:
            if port == 0:  # any free port (tests, several servers on one host); the answer names it
                self.port = self._sock.bind_to_random_port(f"tcp://{_bind_host(host)}")
            else:
                self._sock.bind(f"tcp://{_bind_host(host)}:{port}")
                self.port = port
        except zmq.ZMQError as e:
            self._sock.close()
            self._ctx.term()
            raise ValueError(f"the KV transfer side channel cannot listen on {host}:{port} ({e}); set "
                             f"side_channel_port in --kv-transfer-config") from None
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kv-side-channel", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        import zmq

        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(200):
                continue
            ident, _, body = self._sock.recv_multipart()
            try:
                ask = json.loads(body)
                reply = self._reply if ask.get("version") == PROTOCOL_VERSION else json.dumps(
                    {"ok": False, "error": f"side channel protocol {ask.get('version')} asked, "
                                           f"{PROTOCOL_VERSION} spoken here"}).encode()
            except (ValueError, AttributeError):
                reply = json.dumps({"ok": False, "error": "malformed handshake"}).encode()
            self._sock.send_multipart([ident, b"", reply])

    def close(self) -> None:
        self._stop.set()
        self._thread.join(1.0)
        self._sock.close()
        self._ctx.term()


def handshake(host: str, port: int, timeout_s: float) -> dict:
    """The prefill server's description (its agent metadata decoded to bytes); ConnectionError if it does
    not answer within timeout_s or answers with an error."""
    import zmq

    ctx = zmq.Context.instance()
    sock = ctx.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(f"tcp://{_connect_host(host)}:{port}")
        sock.send(json.dumps({"version": PROTOCOL_VERSION}).encode())
        if not sock.poll(int(timeout_s * 1000)):
            raise ConnectionError(f"the prefill server's side channel {host}:{port} did not answer within "
                                  f"{timeout_s:g} s")
        reply = json.loads(sock.recv())
    finally:
        sock.close()
    if not reply.get("ok"):
        raise ConnectionError(f"the prefill server's side channel {host}:{port} refused: {reply.get('error')}")
    reply["agent_metadata"] = base64.b64decode(reply["agent_metadata"])
    return reply


def _bind_host(host: str) -> str:
    return "*" if host in ("", "0.0.0.0") else "127.0.0.1" if host == "localhost" else host


def _connect_host(host: str) -> str:
    return "127.0.0.1" if host in ("", "0.0.0.0", "localhost") else host
