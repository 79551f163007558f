"""Replicas behind vllm-router, measured (docs/scaling.md).

A multi-session chat: --sessions conversations of --turns turns, each opening with one of --system-prompts
shared system prompts (--system-tokens long, Python's documentation prose) and growing by its answers and
a new question every turn; --concurrency sessions talk at once, each turn waiting for the last. The same
workload (its --seed) runs against N replicas (each --kv-cache-memory bytes of KV, started by
fastdeploy.entrypoints.openai.multi_api_server) behind vllm-router with each --policies, flag off and on,
and against one replica with N x the memory (the ceiling). Per run: prefix hit rate (the responses'
usage.prompt_tokens_details.cached_tokens over prompt tokens), TTFT p50/p99 (streamed), requests/s and
output tokens/s.

Events check (kv_aware runs): a subscriber rebuilds each replica's stored blocks from its KV-cache events
during the run; afterwards, for --probes sessions on every replica, the deepest stored block among the
rendered prompt's blocks (what the events promise) is compared with the hit the replica then serves
(cached_tokens of a one-token request): disagreements are counted (goal 0).

Progress goes to stderr; --json writes every row.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from ab_harness import log, write_json  # noqa: E402
from fastdeploy.cache_manager.kv_events import STORED_BLOCKS  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="smollm2-135m-instruct")
    p.add_argument("--replicas", type=int, default=3)
    p.add_argument("--kv-cache-memory", type=int, default=64 << 20, help="bytes of KV per replica")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--max-model-len", type=int, default=4096)
    p.add_argument("--policies", nargs="+", default=["kv_aware", "cache_aware", "round_robin"])
    p.add_argument("--head-wise", nargs="+", default=["0", "1"], help="FD_HEAD_WISE_KV_CACHE values to run")
    p.add_argument("--stored-blocks", nargs="+", default=[STORED_BLOCKS[0]], choices=STORED_BLOCKS,
                   help="what the replicas' events announce with the flag on (kv_aware runs once per value)")
    p.add_argument("--no-ceiling", action="store_true", help="skip the one-replica run with the fleet's memory")
    p.add_argument("--sessions", type=int, default=48)
    p.add_argument("--turns", type=int, default=4)
    p.add_argument("--system-prompts", type=int, default=4)
    p.add_argument("--system-tokens", type=int, default=1500, help="about this many tokens per system prompt")
    p.add_argument("--question-words", type=int, default=40)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--concurrency", type=int, default=8)
    p.add_argument("--seed", type=int, default=0, help="which prose and questions (a held-out run: another seed)")
    p.add_argument("--probes", type=int, default=8, help="sessions probed per replica in the events check")
    p.add_argument("--json", type=str, default=None)
    return p


# -- the workload -------------------------------------------------------------------------------------------
def workload(args) -> tuple:
    """(system prompts, per session: its system prompt index and one question per turn)."""
    from pydoc_data.topics import topics

    rng = random.Random(args.seed)
    keys = sorted(topics)
    rng.shuffle(keys)
    words = " ".join(topics[k] for k in keys).split()
    per_prompt = int(args.system_tokens * 0.7)  # prose runs about 1.4 tokens a word
    systems = [" ".join(words[i * per_prompt:(i + 1) * per_prompt]) for i in range(args.system_prompts)]
    rest = words[args.system_prompts * per_prompt:]
    sessions = []
    for s in range(args.sessions):
        questions = []
        for _ in range(args.turns):
            start = rng.randrange(0, len(rest) - args.question_words)
            questions.append("Question: " + " ".join(rest[start:start + args.question_words]) + "\nAnswer:")
        sessions.append((s % args.system_prompts, questions))
    return systems, sessions


async def run_workload(url: str, args, systems, sessions) -> dict:
    import aiohttp

    results, wall = [], time.perf_counter()
    queue: asyncio.Queue = asyncio.Queue()
    for s in sessions:
        queue.put_nowait(s)

    async def talk(http, system, questions):
        history = system
        for q in questions:
            prompt = history + "\n" + q
            body = {"prompt": prompt, "max_tokens": args.max_tokens, "temperature": 0, "stream": True,
                    "stream_options": {"include_usage": True}, "ignore_eos": True}
            t0, ttft, text, usage = time.perf_counter(), None, "", None
            async with http.post(url + "/v1/completions", json=body) as resp:
                if resp.status != 200:
                    results.append({"error": resp.status})
                    log(f"  HTTP {resp.status}: {(await resp.text())[:300]}")
                    return
                async for line in resp.content:
                    line = line.strip()
                    if not line.startswith(b"data: {"):
                        continue
                    event = json.loads(line[6:])
                    if event.get("choices") and event["choices"][0].get("text"):
                        ttft = ttft or time.perf_counter() - t0
                        text += event["choices"][0]["text"]
                    usage = event.get("usage") or usage
            details = (usage or {}).get("prompt_tokens_details") or {}
            results.append({"ttft": ttft, "prompt": usage["prompt_tokens"], "cached": details.get("cached_tokens") or 0,
                            "output": usage["completion_tokens"]})
            history = prompt + text

    async def worker(http):
        while not queue.empty():
            index, questions = queue.get_nowait()
            await talk(http, systems[index], questions)

    timeout = aiohttp.ClientTimeout(total=3600)
    async with aiohttp.ClientSession(timeout=timeout) as http:
        await asyncio.gather(*(worker(http) for _ in range(args.concurrency)))
    wall = time.perf_counter() - wall
    ok = [r for r in results if "error" not in r]
    ttfts = sorted(r["ttft"] for r in ok if r["ttft"] is not None)
    return {"requests": len(results), "errors": len(results) - len(ok),
            "hit_rate": round(sum(r["cached"] for r in ok) / max(1, sum(r["prompt"] for r in ok)), 4),
            "ttft_p50_s": round(statistics.median(ttfts), 3) if ttfts else None,
            "ttft_p99_s": round(ttfts[min(len(ttfts) - 1, int(0.99 * len(ttfts)))], 3) if ttfts else None,
            "requests_per_s": round(len(ok) / wall, 3),
            "output_tok_per_s": round(sum(r["output"] for r in ok) / wall, 1), "wall_s": round(wall, 1)}


# -- the events check -----------------------------------------------------------------------------------------
class EventMirror:
    """Each replica's stored block hashes, rebuilt from its live KV-cache events on a thread."""

    def __init__(self, endpoints: list):
        import zmq

        self.stored = [set() for _ in endpoints]
        self._ctx = zmq.Context()
        self._socks = []
        for ep in endpoints:
            sock = self._ctx.socket(zmq.SUB)
            sock.setsockopt(zmq.SUBSCRIBE, b"")
            sock.connect(ep)
            self._socks.append(sock)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        import msgpack
        import zmq

        poller = zmq.Poller()
        for sock in self._socks:
            poller.register(sock, zmq.POLLIN)
        while not self._stop.is_set():
            for sock, _ in poller.poll(50):
                _, _, payload = sock.recv_multipart()
                stored = self.stored[self._socks.index(sock)]
                for e in msgpack.unpackb(payload, raw=False)[1]:
                    if e["type"] == "BlockStored":
                        stored.update(e["block_hashes"])
                    elif e["type"] == "BlockRemoved":
                        stored.difference_update(e["block_hashes"])
                    else:
                        stored.clear()

    def close(self) -> None:
        self._stop.set()
        self._thread.join()
        for sock in self._socks:
            sock.close(linger=0)
        self._ctx.term()


def events_check(urls: list, mirror: EventMirror, args, systems, sessions) -> dict:
    import httpx

    from fastdeploy.cache_manager.kv_events import chain_hashes

    checked = disagreements = 0
    for r, url in enumerate(urls):
        for index, questions in sessions[:args.probes]:
            prompt = systems[index] + "\n" + questions[-1]
            ids = httpx.post(url + "/v1/completions/render", json={"prompt": prompt}, timeout=60).json()[0]["token_ids"]
            hashes = chain_hashes(ids, args.block_size)[:(len(ids) - 1) // args.block_size]
            promised = max((i + 1 for i, h in enumerate(hashes) if h in mirror.stored[r]), default=0)
            resp = httpx.post(url + "/v1/completions", json={"prompt": prompt, "max_tokens": 1}, timeout=300)
            if resp.status_code != 200:
                raise SystemExit(f"events check: replica {r} answered {resp.status_code}: {resp.text[:300]}")
            served = (resp.json()["usage"].get("prompt_tokens_details") or {}).get("cached_tokens") or 0
            checked += 1
            if served != promised * args.block_size:
                disagreements += 1
                log(f"  replica {r}: events promise {promised * args.block_size} cached tokens, it served {served}")
            wait_events_settled(url)
    return {"events_checked": checked, "events_disagreements": disagreements}


def wait_events_settled(url: str) -> None:
    import httpx

    from fastdeploy.entrypoints.openai.metrics import parse_prometheus_text

    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        m = parse_prometheus_text(httpx.get(url + "/metrics", timeout=10).text)
        if m.get("fastdeploy:num_requests_running") == 0 and m.get("fastdeploy:num_requests_waiting") == 0:
            break
        time.sleep(0.05)
    time.sleep(0.3)  # the subscriber thread applies the last batch


# -- runs ------------------------------------------------------------------------------------------------------
def start_fleet(args, replicas: int, kv_memory: int, policy, head_wise: str, log_dir: Path, stored_blocks: str):
    from fastdeploy.entrypoints.openai.server_process import free_port, free_port_pair

    ports = [free_port() for _ in range(replicas)]
    events = [free_port_pair() for _ in range(replicas)]  # each replica's replay socket is E + 1
    router = free_port() if policy else None
    cmd = [sys.executable, "-m", "fastdeploy.entrypoints.openai.multi_api_server", "--num-servers", str(replicas),
           "--ports", ",".join(map(str, ports)), "--log-dir", str(log_dir), "--kv-events-ports",
           ",".join(map(str, events)), "--kv-events-stored-blocks", stored_blocks]
    if router:
        cmd += ["--router-port", str(router), "--router-metrics-port", str(free_port()), "--policy", policy]
    cmd += ["--args", "--model", args.model, "--kv-cache-memory", str(kv_memory), "--block-size", str(args.block_size),
            "--max-model-len", str(args.max_model_len), "--max-num-seqs", str(args.concurrency),
            "--disable-uvicorn-access-log"]
    proc = subprocess.Popen(cmd, env={**os.environ, "FD_HEAD_WISE_KV_CACHE": head_wise}, cwd=REPO,
                            stdout=open(log_dir.with_suffix(".log"), "wb"), stderr=subprocess.STDOUT)
    url = f"http://127.0.0.1:{router or ports[0]}"
    import httpx

    deadline = time.monotonic() + 900
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"the fleet exited ({proc.returncode}); see {log_dir.with_suffix('.log')}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200 and \
                    all(httpx.get(f"http://127.0.0.1:{p}/health", timeout=2).status_code == 200 for p in ports):
                break
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    return proc, url, [f"http://127.0.0.1:{p}" for p in ports], [f"tcp://127.0.0.1:{e}" for e in events]


def run_one(args, systems, sessions, replicas, kv_memory, policy, head_wise, log_dir, stored_blocks) -> dict:
    proc, url, urls, events = start_fleet(args, replicas, kv_memory, policy, head_wise, log_dir, stored_blocks)
    mirror = EventMirror(events) if policy == "kv_aware" else None
    try:
        time.sleep(0.5)  # subscriptions reach the publishers
        row = {"model": args.model, "head_wise": int(head_wise), "replicas": replicas,
               "policy": policy or "one replica", "kv_cache_memory_per_replica": kv_memory,
               **({"stored_blocks": stored_blocks} if policy == "kv_aware" else {}),
               **asyncio.run(run_workload(url, args, systems, sessions))}
        if mirror is not None:
            for u in urls:
                wait_events_settled(u)
            row.update(events_check(urls, mirror, args, systems, sessions))
        return row
    finally:
        if mirror is not None:
            mirror.close()
        proc.send_signal(signal.SIGTERM)
        proc.wait(120)


def main(argv=None) -> int:
    args = build_parser().parse_args(argv)
    systems, sessions = workload(args)
    runs = [(args.replicas, args.kv_cache_memory, p) for p in args.policies]
    if not args.no_ceiling:
        runs.append((1, args.kv_cache_memory * args.replicas, None))
    rows = []
    out_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_replicas_{os.getpid()}"
    out_dir.mkdir(parents=True, exist_ok=True)
    for head_wise in args.head_wise:
        for replicas, memory, policy in runs:
            # With the flag off every valid end's ancestors are valid ends: the two announcements agree.
            modes = args.stored_blocks if policy == "kv_aware" and head_wise != "0" else args.stored_blocks[:1]
            for stored_blocks in modes:
                what = f" ({stored_blocks})" if policy == "kv_aware" else ""
                log(f"== FD_HEAD_WISE_KV_CACHE={head_wise} {policy or 'one replica'}{what} x{replicas}, "
                    f"{memory >> 20} MiB each")
                row = run_one(args, systems, sessions, replicas, memory, policy, head_wise,
                              out_dir / f"{head_wise}_{policy or 'ceiling'}_{stored_blocks}", stored_blocks)
                rows.append(row)
                log(json.dumps(row))
    for row in rows:
        base = next((r for r in rows if r["head_wise"] == row["head_wise"] and r["policy"] == "round_robin"), None)
        ceiling = next((r for r in rows if r["head_wise"] == row["head_wise"] and r["policy"] == "one replica"), None)
        if base and base["hit_rate"]:
            row["hit_rate_vs_round_robin"] = round(row["hit_rate"] / base["hit_rate"], 2)
        if ceiling and ceiling["hit_rate"]:
            row["hit_rate_vs_ceiling"] = round(row["hit_rate"] / ceiling["hit_rate"], 3)
    print(json.dumps(rows, indent=1))
    write_json(args.json, {"argv": sys.argv[1:], "rows": rows}, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
