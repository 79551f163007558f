"""Tensor parallelism across hosts, measured (docs/tensor_parallel.md, docs/scaling.md).

TP=2 with its two ranks on two hosts (network namespaces joined by veth pairs to a bridge, made here and
removed afterwards; needs CAP_NET_ADMIN) vs both ranks on one host, ranks started by
`paddle.distributed.launch --ips ... --host ...` against an api_server started with FD_TP_LAUNCH_WORKERS=0,
as docs/tensor_parallel.md says. The same greedy workload runs on both; per run: wall time, engine
steps, mean step time, and the bytes that crossed a network interface per step (the second host's veth
across hosts; the host's loopback when both ranks share it): the collectives (two all-reduces a layer,
the vocabulary-parallel logits) and the step message to rank 1. The greedy texts of the two runs are
compared.

Progress goes to stderr; --json writes every row.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import json
import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "tests"))  # network_hosts: the test suite's namespace hosts

from ab_harness import log, write_json  # noqa: E402


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="ernie-4.5-tiny-swa",
                   help="its KV heads must divide by 2 (SmolLM2 has 3, Gemma 3 270M one)")
    p.add_argument("--requests", type=int, default=8)
    p.add_argument("--concurrency", type=int, default=4)
    p.add_argument("--prompt-words", type=int, default=200)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--json", type=str, default=None)
    return p


def counter(ns: str, interface: str, which: str) -> int:
    out = subprocess.run(["ip", "netns", "exec", ns, "cat", f"/sys/class/net/{interface}/statistics/{which}"],
                         capture_output=True, text=True, check=True)
    return int(out.stdout)


def run(args, hosts: dict, across: bool, log_dir: Path) -> dict:
    import httpx

    from fastdeploy.entrypoints.openai.metrics import parse_prometheus_text
    from fastdeploy.entrypoints.openai.server_process import ApiServerProcess, free_port
    from pydoc_data.topics import topics

    (ens, eip, _), (sns, sip, _) = hosts["engine"], hosts["second"]
    port = free_port()
    server = ApiServerProcess(["--model", args.model, "--tensor-parallel-size", "2", "--max-model-len", "2048",
                               "--disable-uvicorn-access-log"], log_path=log_dir / f"server_{across}.log", host=eip,
                              port=free_port(), prefix=("ip", "netns", "exec", ens),
                              env={"FD_TP_LAUNCH_WORKERS": "0", "FD_TP_ENGINE_HOST": eip,
                                   "FD_TP_ENGINE_PORT": str(port), "FD_HEAD_WISE_KV_CACHE": "1"})
    env = {k: v for k, v in os.environ.items() if not k.endswith("_SOCKET_IFNAME")}
    env.update(PADDLE_DISTRI_BACKEND="gloo", FD_HEAD_WISE_KV_CACHE="1", OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
    worker = ["fastdeploy/worker/worker_process.py", "--engine-address", f"{eip}:{port}"]
    if across:
        launches = [(ns, ["--ips", f"{eip},{sip}", "--host", ip, "--nproc_per_node", "1"])
                    for ns, ip in ((ens, eip), (sns, sip))]
        link = (sns, "eth0")
    else:
        launches = [(ens, ["--nproc_per_node", "2"])]
        link = (ens, "lo")
    launchers = [subprocess.Popen(["ip", "netns", "exec", ns, sys.executable, "-m", "paddle.distributed.launch",
                                   *flags, "--log_dir", str(log_dir / f"launch_{across}_{i}"), *worker], cwd=REPO,
                                  env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                 for i, (ns, flags) in enumerate(launches)]
    try:
        server.wait_healthy(600)
        words = " ".join(topics[k] for k in sorted(topics)).split()
        prompts = [" ".join(words[i * 37:i * 37 + args.prompt_words]) for i in range(args.requests)]
        http = httpx.Client(base_url=server.base_url, timeout=600)
        metrics = lambda: parse_prometheus_text(http.get("/metrics").text)  # noqa: E731
        steps0, rx0, tx0 = metrics()["fastdeploy:engine_steps_total"], counter(*link, "rx_bytes"), \
            counter(*link, "tx_bytes")
        t0 = time.perf_counter()
        with concurrent.futures.ThreadPoolExecutor(args.concurrency) as pool:
            texts = list(pool.map(lambda p: http.post("/v1/completions", json={
                "prompt": p, "max_tokens": args.max_tokens, "temperature": 0, "ignore_eos": True}).json()
                ["choices"][0]["text"], prompts))
        wall = time.perf_counter() - t0
        time.sleep(1.0)  # the last step's stats reach /metrics
        steps = metrics()["fastdeploy:engine_steps_total"] - steps0
        moved = counter(*link, "rx_bytes") - rx0 + counter(*link, "tx_bytes") - tx0
        if not across:
            moved //= 2  # loopback counts every byte as both sent and received
        return {"ranks": "two hosts (veth)" if across else "one host (loopback)", "model": args.model,
                "requests": args.requests, "wall_s": round(wall, 2), "engine_steps": int(steps),
                "step_ms": round(1000 * wall / max(1, steps), 1),
                "link_bytes_per_step": int(moved / max(1, steps)), "texts": texts}
    finally:
        server.stop()
        for p in launchers:
            if p.poll() is None:
                p.kill()
            p.wait()


def main(argv=None) -> int:
    from network_hosts import network_hosts

    args = build_parser().parse_args(argv)
    log_dir = Path(os.environ.get("TMPDIR", "/tmp")) / f"bench_tp_hosts_{os.getpid()}"
    log_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    with network_hosts("engine", "second") as hosts:
        for across in (False, True):
            row = run(args, hosts, across, log_dir)
            rows.append(row)
            log(json.dumps({k: v for k, v in row.items() if k != "texts"}))
    same = rows[0].pop("texts") == rows[1].pop("texts")
    for row in rows:
        row["greedy_text_equal_across_runs"] = same
    print(json.dumps(rows, indent=1))
    write_json(args.json, {"argv": sys.argv[1:], "rows": rows}, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
