"""N replicas of the api_server and, optionally, vllm-router in front of them (upstream FastDeploy's
`multi_api_server`; vLLM calls the same deployment data parallelism with external load balancing):

    python -m fastdeploy.entrypoints.openai.multi_api_server --num-servers 3 --ports 8001,8002,8003 \\
        --router-port 8000 --policy kv_aware --args --model smollm2-135m-instruct --kv-cache-memory 1073741824

Each replica is an api_server of its own (its own process group, engine and, with
--tensor-parallel-size in --args, its own tensor-parallel workers), logging to --log-dir. With the
kv_aware policy every replica publishes KV-cache events (--kv-events-config, vLLM's ZMQ format) on
--kv-events-ports and the router subscribes to them and to their replay sockets (PORT+1), so it sends a
conversation's next turn where its prefix is cached and valid. A replica that dies is reported here and
left out by the router (its in-flight requests fail; the others keep serving); the router dying, or
SIGINT / SIGTERM, stops everything.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

from fastdeploy.cache_manager.kv_events import STORED_BLOCKS
from fastdeploy.engine.args_utils import EngineArgs
from fastdeploy.entrypoints.openai.server_process import ApiServerProcess, ServerStartError

logger = logging.getLogger("fastdeploy.entrypoints.multi_api_server")

POLICIES = ("kv_aware", "cache_aware", "round_robin", "power_of_two", "random", "consistent_hash")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description="N api_server replicas behind vllm-router (docs/scaling.md)")
    p.add_argument("--num-servers", type=int, required=True, help="replicas to start")
    p.add_argument("--ports", type=str, required=True, help="comma-separated API port of each replica")
    p.add_argument("--metrics-ports", type=str, default=None,
                   help="comma-separated /metrics port of each replica (default: the API port serves /metrics)")
    p.add_argument("--host", type=str, default="127.0.0.1", help="address the replicas and the router listen on")
    p.add_argument("--router-port", type=int, default=None,
                   help="start vllm-router (pip install -e \".[cpu,pd]\") on this port in front of the replicas")
    p.add_argument("--router-metrics-port", type=int, default=None,
                   help="the router's Prometheus port (default: vllm-router's, 29000; set it to run two fleets "
                        "on one host)")
    p.add_argument("--policy", choices=POLICIES, default="kv_aware", help="the router's load-balancing policy")
    p.add_argument("--kv-events-ports", type=str, default=None,
                   help="comma-separated event port of each replica (its replay socket is PORT+1); default: "
                        "API port + 1000. Used with --policy kv_aware, or whenever given")
    p.add_argument("--kv-events-stored-blocks", choices=STORED_BLOCKS, default=STORED_BLOCKS[0],
                   help="what a replica's BlockStored announces with sliding heads: a block a hit may end at, "
                        "or a block on the way to one (docs/scaling.md)")
    p.add_argument("--log-dir", type=str, default="log/replicas", help="one server.log per replica, router.log")
    p.add_argument("--startup-timeout", type=float, default=600.0, help="seconds a replica may take to start")
    p.add_argument("--args", nargs=argparse.REMAINDER, default=[],
                   help="everything after --args goes to every replica's api_server")
    return p


def _ports(text: str, n: int, what: str) -> list:
    try:
        ports = [int(p) for p in text.split(",")]
    except ValueError:
        raise SystemExit(f"{what}: give {n} comma-separated port numbers, got {text!r}") from None
    if len(ports) != n:
        raise SystemExit(f"{what}: {len(ports)} ports for --num-servers {n}")
    return ports


def _option(args: list, name: str, default: str) -> str:
    """The value of `name` in an api_server command line (either `--x v` or `--x=v`)."""
    for i, a in enumerate(args):
        if a == name and i + 1 < len(args):
            return args[i + 1]
        if a.startswith(name + "="):
            return a.split("=", 1)[1]
    return default


class Fleet:
    def __init__(self, opts: argparse.Namespace):
        n = opts.num_servers
        if n < 1:
            raise SystemExit("--num-servers must be at least 1")
        self.opts = opts
        self.log_dir = Path(opts.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        ports = _ports(opts.ports, n, "--ports")
        metrics = _ports(opts.metrics_ports, n, "--metrics-ports") if opts.metrics_ports else [None] * n
        events = None
        if opts.kv_events_ports or opts.policy == "kv_aware":
            events = (_ports(opts.kv_events_ports, n, "--kv-events-ports") if opts.kv_events_ports
                      else [p + 1000 for p in ports])
        if "--kv-events-config" in opts.args and events is not None:
            raise SystemExit("--kv-events-config is set per replica by this launcher (--kv-events-ports)")
        self.events = events
        self.replicas: list = []
        self.router = None
        self._router_log = None
        for i in range(n):
            args = list(opts.args)
            if events is not None:
                args += ["--kv-events-config", json.dumps({
                    "enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{events[i]}",
                    "replay_endpoint": f"tcp://*:{events[i] + 1}", "stored_blocks": opts.kv_events_stored_blocks})]
            self.replicas.append(ApiServerProcess(args, log_path=self.log_dir / f"server{i}.log", port=ports[i],
                                                  metrics_port=metrics[i], host=opts.host))

    def wait_ready(self) -> None:
        deadline = time.monotonic() + self.opts.startup_timeout
        for i, srv in enumerate(self.replicas):
            try:
                srv.wait_healthy(max(1.0, deadline - time.monotonic()))
            except ServerStartError as e:
                raise SystemExit(f"replica {i} ({srv.base_url}) did not start: {e}") from None
            logger.info("replica %d ready at %s (log %s)", i, srv.base_url, srv.log_path)

    def start_router(self) -> None:
        opts = self.opts
        binary = shutil.which("vllm-router", path=str(Path(sys.executable).parent)) or shutil.which("vllm-router")
        if binary is None:
            raise SystemExit("--router-port: vllm-router is not installed (pip install -e \".[cpu,pd]\")")
        urls = [srv.base_url for srv in self.replicas]
        cmd = [binary, "--host", opts.host, "--port", str(opts.router_port), "--worker-urls", *urls,
               "--policy", opts.policy]
        if opts.router_metrics_port is not None:
            cmd += ["--prometheus-port", str(opts.router_metrics_port)]
        if opts.policy == "kv_aware":
            cmd += ["--kv-event-block-size", _option(opts.args, "--block-size", str(EngineArgs.block_size)),
                    "--kv-event-model", _option(opts.args, "--served-model-name", _option(opts.args, "--model", "default"))]
            for url, port in zip(urls, self.events):
                cmd += ["--kv-event-source", f"{url}=tcp://{_reachable(opts.host)}:{port}",
                        "--kv-event-replay-source", f"{url}=tcp://{_reachable(opts.host)}:{port + 1}"]
        self._router_log = open(self.log_dir / "router.log", "wb")
        self.router = subprocess.Popen(cmd, stdout=self._router_log, stderr=subprocess.STDOUT, start_new_session=True)
        url = f"http://{_reachable(opts.host)}:{opts.router_port}/health"
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            if self.router.poll() is not None:
                raise SystemExit(f"vllm-router exited with code {self.router.returncode}; see {self.log_dir}/router.log")
            try:
                with urllib.request.urlopen(url, timeout=2) as r:
                    if r.status == 200:
                        logger.info("vllm-router (%s) ready at http://%s:%d in front of %d replicas", opts.policy,
                                    opts.host, opts.router_port, len(urls))
                        return
            except OSError:
                pass
            time.sleep(0.2)
        raise SystemExit(f"vllm-router did not answer /health within 60 s; see {self.log_dir}/router.log")

    def watch(self, stop_requested) -> int:
        """Until a signal or the router's exit: report replicas that die (the router leaves them out)."""
        dead: set = set()
        while not stop_requested():
            for i, srv in enumerate(self.replicas):
                if i not in dead and srv.proc.poll() is not None:
                    dead.add(i)
                    logger.error("replica %d (%s) exited with code %s; the router leaves it out, %d of %d serve "
                                 "(log %s)", i, srv.base_url, srv.proc.returncode, len(self.replicas) - len(dead),
                                 len(self.replicas), srv.log_path)
            if len(dead) == len(self.replicas):
                logger.error("every replica has exited")
                return 1
            if self.router is not None and self.router.poll() is not None:
                logger.error("vllm-router exited with code %s", self.router.returncode)
                return 1
            time.sleep(0.5)
        return 0

    def stop(self) -> None:
        if self.router is not None and self.router.poll() is None:
            self.router.terminate()
            try:
                self.router.wait(10)
            except subprocess.TimeoutExpired:
                self.router.kill()
                self.router.wait()
        if self._router_log is not None:
            self._router_log.close()
        for srv in self.replicas:
            srv.stop()


def _reachable(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else host


def main(argv=None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    opts = build_parser().parse_args(argv)
    stopping, watching = [], []

    def on_signal(signum, _frame):
        stopping.append(signum)
        if not watching:  # still starting: unwind now (the finally stops what has started)
            raise SystemExit(128 + signum)

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, on_signal)
    fleet = Fleet(opts)
    try:
        fleet.wait_ready()
        if opts.router_port is not None:
            fleet.start_router()
        watching.append(True)
        return fleet.watch(lambda: bool(stopping))
    finally:
        fleet.stop()


if __name__ == "__main__":
    sys.exit(main())
