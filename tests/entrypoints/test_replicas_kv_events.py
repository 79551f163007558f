"""Three replicas of the api_server behind vllm-router 0.1.17 with `--policy kv_aware`, fed by this engine's
KV-cache events (--kv-events-config, vLLM's ZMQ format): a conversation's next turn goes to the replica that
holds its prefix, a subscriber's replayed stream names exactly the blocks the replica can serve a hit at
(vLLM's hashes of the ids /v1/completions/render gives), a late subscriber is answered on the replay socket,
and a replica that dies leaves the others serving."""

from __future__ import annotations

import json
import os
import signal
import time

import msgpack
import pytest
import zmq

from fastdeploy.cache_manager.kv_events import chain_hashes
from fastdeploy.entrypoints.openai.server_process import free_port

pytestmark = pytest.mark.slow  # the slow tier: `pytest -m slow tests`

pytest.importorskip("msgpack")
BLOCK = 16
NUM_REPLICAS = 3


@pytest.fixture(scope="module")
def fleet(server_factory, router_factory):
    replicas = []
    for _ in range(NUM_REPLICAS):
        pub, replay = free_port(), free_port()
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{pub}",
                  "replay_endpoint": f"tcp://*:{replay}"}
        srv = server_factory("--kv-events-config", json.dumps(config), "--num-gpu-blocks-override", "96",
                             "--max-model-len", "1024", wait=False)
        srv.events, srv.replay = f"tcp://127.0.0.1:{pub}", f"tcp://127.0.0.1:{replay}"
        replicas.append(srv)
    for srv in replicas:
        srv.wait_ready()
    args = ["--worker-urls", *[s.base_url for s in replicas], "--policy", "kv_aware", "--kv-event-block-size",
            str(BLOCK), "--kv-event-model", "tiny"]
    for srv in replicas:
        args += ["--kv-event-source", f"{srv.base_url}={srv.events}",
                 "--kv-event-replay-source", f"{srv.base_url}={srv.replay}"]
    router = router_factory(args=args)
    return replicas, router


def prompt_of(session: int, turns: int) -> str:
    from pydoc_data.topics import topics

    words = topics[sorted(topics)[10 + session]].split()
    return " ".join(words[:30 + 10 * turns])  # six sessions fit one replica's cache, wherever they land


def cached_tokens(resp) -> int:
    assert resp.status_code == 200, resp.text
    details = resp.json()["usage"].get("prompt_tokens_details") or {}
    return details.get("cached_tokens") or 0


def events_settled(replicas) -> None:
    """Every replica's last step published (an idle engine's valid hit ends stop changing)."""
    for srv in replicas:
        srv.wait_idle_with_all_pages_free()
    time.sleep(0.3)  # the router's subscriber applies them


def test_the_next_turn_goes_to_the_replica_holding_its_prefix(fleet):
    """First turns arrive together (the router spreads them by load), second turns one by one: each must
    go to the replica that served its first turn, whichever that was."""
    from concurrent.futures import ThreadPoolExecutor

    replicas, router = fleet
    body = {"max_tokens": 4, "temperature": 0}
    with ThreadPoolExecutor(6) as pool:
        for resp in pool.map(lambda s: router.http.post("/v1/completions", json={**body, "prompt": prompt_of(s, 0)}),
                             range(6)):
            assert resp.status_code == 200, resp.text
    events_settled(replicas)
    served = [srv.metrics()["fastdeploy:prompt_tokens_total"] for srv in replicas]
    assert sum(1 for t in served if t) >= 2, served  # the sessions live on different replicas
    hits = [cached_tokens(router.http.post("/v1/completions", json={**body, "prompt": prompt_of(session, 1)}))
            for session in range(6)]
    assert all(h >= 3 * BLOCK for h in hits), hits  # every second turn found its first turn's blocks


def subscribe(endpoint: str):
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(endpoint)
    return sub


def decode(payload: bytes) -> list:
    ts, events, rank = msgpack.unpackb(payload, raw=False)
    assert isinstance(ts, float) and rank == 0
    return events


def replay(endpoint: str, start: int = 0) -> list:
    """[(seq, events)] the replay socket still holds from `start`, as vllm-router asks for them."""
    sock = zmq.Context.instance().socket(zmq.DEALER)
    sock.connect(endpoint)
    sock.send_multipart([b"", start.to_bytes(8, "big")])
    out = []
    try:
        while True:
            assert sock.poll(5000), "the replay socket did not answer"
            empty, topic, seq, payload = sock.recv_multipart()
            seq = int.from_bytes(seq, "big", signed=True)
            if seq == -1:
                assert payload == b"" and topic == b""
                return out
            out.append((seq, decode(payload)))
    finally:
        sock.close(linger=0)


def test_a_late_subscriber_rebuilds_the_replicas_hit_ends_from_the_replay_socket(fleet):
    replicas, router = fleet
    srv = replicas[0]
    live = subscribe(srv.events)
    time.sleep(0.3)  # the subscription reaches the publisher
    prompt = prompt_of(20, 2)
    resp = srv.http.post("/v1/completions", json={"prompt": prompt, "max_tokens": 4, "temperature": 0})
    assert resp.status_code == 200, resp.text
    events_settled([srv])
    batches = replay(srv.replay)
    assert [seq for seq, _ in batches] == list(range(len(batches)))  # nothing evicted from a short run's buffer
    stored: set = set()
    known: set = set()
    for _, events in batches:
        for e in events:
            if e["type"] == "BlockStored":
                assert e["parent_block_hash"] is None or e["parent_block_hash"] in known
                assert e["block_size"] == BLOCK and e["medium"] == "GPU"
                known.update(e["block_hashes"])
                stored.update(e["block_hashes"])
            elif e["type"] == "BlockRemoved":
                stored.difference_update(e["block_hashes"])
            else:
                stored.clear()
    assert len(stored) == srv.metrics()["fastdeploy:kv_events_stored_blocks"]
    ids = srv.http.post("/v1/completions/render", json={"prompt": prompt}).json()[0]["token_ids"]
    full = (len(ids) - 1) // BLOCK  # a hit never takes the block of the last prompt token
    assert full >= 3 and set(chain_hashes(ids, BLOCK)[:full]) <= stored  # vLLM's hashes of the rendered ids
    frames = []
    while live.poll(500):
        frames.append(live.recv_multipart())
    live.close(linger=0)
    assert frames and all(len(f) == 3 and f[0] == b"" and len(f[1]) == 8 for f in frames)
    last = {int.from_bytes(f[1], "big") for f in frames}
    assert last <= {seq for seq, _ in batches}  # the live stream and the replay agree on numbering


def test_a_replica_that_dies_ends_its_requests_and_leaves_the_others_serving(fleet):
    """Requests in flight on the replica that dies end (retried elsewhere, or an error), none hangs; new ones
    are served by the others."""
    from concurrent.futures import ThreadPoolExecutor

    replicas, router = fleet
    dead = replicas[2]
    body = {"max_tokens": 600, "ignore_eos": True, "temperature": 0}
    with ThreadPoolExecutor(3) as pool:
        flights = [pool.submit(router.http.post, "/v1/completions", json={**body, "prompt": prompt_of(40 + i, 0)})
                   for i in range(3)]
        deadline = time.monotonic() + 60
        while dead.metrics()["fastdeploy:num_requests_running"] == 0:  # the load spreads them over the replicas
            assert time.monotonic() < deadline, "no request reached the third replica"
            time.sleep(0.05)
        os.killpg(dead.proc.pid, signal.SIGKILL)
        dead.proc.wait()
        ended = [f.result(timeout=120) for f in flights]  # a request left hanging fails here
    assert all(r.status_code == 200 or r.status_code >= 500 for r in ended), [r.status_code for r in ended]
    for session in range(6):
        resp = router.http.post("/v1/completions", json={"prompt": prompt_of(session, 3), "max_tokens": 3})
        assert resp.status_code == 200, resp.text
