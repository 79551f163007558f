"""The engine's handle on its tensor-parallel workers: starts one worker process per rank, sends
every rank each step, returns rank 0's answer, and turns a dead or hung rank into WorkerFailure.

Ranks meet in paddle.distributed collectives (worker/worker_process.py); this side only speaks
ZeroMQ. Any failure stops every rank before raising, and a finalizer stops them when the engine
is collected or the interpreter exits, so no exit path leaves a worker behind.
"""

from __future__ import annotations

import logging
import os
import signal
import socket
import subprocess
import sys
import time
import weakref
from pathlib import Path


logger = logging.getLogger("fastdeploy.engine.worker_group")

WORKER_MODULE = "fastdeploy.worker.worker_process"
PACKAGE_ROOT = Path(__file__).resolve().parents[2]  # the directory holding this fastdeploy package
POLL_MS = 200


class WorkerFailure(RuntimeError):
    """A tensor-parallel worker died, failed or stopped answering; every worker has been stopped."""


def _free_ports(n: int, host: str) -> list:
    socks = []
    try:
        for _ in range(n):
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind((host, 0))
            socks.append(s)
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def _stop(procs: list, step_socks: list, result_sock, ctx, graceful: list) -> None:
    """Ask every rank to stop, then SIGTERM, then SIGKILL (at once after a failure: the surviving
    ranks may sit in a collective that never completes); close the sockets. Idempotent."""
    import zmq

    if step_socks[0].closed:
        return
    if graceful[0]:
        for rank, sock in enumerate(step_socks):
            if not procs or procs[rank].poll() is None:  # no procs: ranks launched elsewhere
                try:
                    sock.send_pyobj(None, flags=zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
    steps = ((None, 5.0), (signal.SIGTERM, 5.0), (signal.SIGKILL, 5.0)) if graceful[0] else ((signal.SIGKILL, 5.0),)
    for sig, wait_s in steps:
        alive = [p for p in procs if p.poll() is None]
        if not alive:
            break
        for p in alive:
            if sig is not None:
                p.send_signal(sig)
        deadline = time.monotonic() + wait_s
        for p in alive:
            try:
                p.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
    for sock in [*step_socks, result_sock]:
        sock.close(linger=1000 if graceful[0] else 0)  # let the stop message reach launched ranks
    ctx.term()


class WorkerGroup:
    def __init__(self, fd_config):
        import zmq

        self.tp = tp = fd_config.parallel_config.tensor_parallel_size
        self.table_rows = fd_config.table_rows  # the persistent block table's rows, all ranks (for_rank)
        env = fd_config.env
        self.step_timeout_s = env.FD_TP_STEP_TIMEOUT
        self.heartbeat_timeout_s = env.FD_TP_HEARTBEAT_TIMEOUT
        self._last_heard: list = [None] * tp  # monotonic time of each rank's last message, from its ready on
        host, base_port = env.FD_TP_ENGINE_HOST, env.FD_TP_ENGINE_PORT
        self._ctx = zmq.Context()
        self._results = self._ctx.socket(zmq.PULL)
        self._steps = [self._ctx.socket(zmq.PUSH) for _ in range(tp)]
        if base_port:  # fixed ports, so workers on other machines can find them
            self._results.bind(f"tcp://{host}:{base_port}")
            for rank, sock in enumerate(self._steps):
                sock.bind(f"tcp://{host}:{base_port + 1 + rank}")
            result_port, step_ports = base_port, [base_port + 1 + r for r in range(tp)]
        else:
            result_port = self._results.bind_to_random_port(f"tcp://{host}")
            step_ports = [s.bind_to_random_port(f"tcp://{host}") for s in self._steps]
        self.procs: list = []  # filled by _launch; the finalizer holds this same list
        self._graceful = [True]  # a list: the finalizer must see a failure recorded after it was made
        self._finalizer = weakref.finalize(self, _stop, self.procs, self._steps, self._results, self._ctx,
                                           self._graceful)
        self.rank_info: list = [None] * tp
        self._failure = None
        try:
            if env.FD_TP_LAUNCH_WORKERS:
                self._launch(tp, host, result_port, step_ports, getattr(fd_config, "device", "cpu") == "gpu")
            else:
                logger.info("waiting for %d tensor-parallel workers launched with --engine-address %s:%d", tp, host,
                            result_port)
            for sock in self._steps:
                self._send(sock, fd_config, env.FD_TP_START_TIMEOUT, "start")
            while None in self.rank_info:
                _, rank, info = self._receive("ready", env.FD_TP_START_TIMEOUT, "start")
                if self.rank_info[rank] is not None:
                    self._fail(f"two tensor-parallel workers claim rank {rank} (pids {self.rank_info[rank]['pid']} "
                               f"and {info['pid']}, endpoint {info.get('endpoint')}): paddle.distributed.launch "
                               f"could not tell which address in --ips is its own machine's (its host name "
                               f"resolves elsewhere); pass --host THIS_MACHINE_IP to it")
                self.rank_info[rank] = info
                self._last_heard[rank] = time.monotonic()
        except BaseException:
            self.close()
            raise
        logger.info("%d tensor-parallel workers ready: %s", tp,
                    "; ".join(f"rank {r} pid {i['pid']} at {i.get('endpoint')} (collectives on {i.get('interface')}) "
                              f"KV heads {i['kv_heads']} cache {i['cache_shape']}"
                              for r, i in enumerate(self.rank_info)))

    def _launch(self, tp: int, host: str, result_port: int, step_ports: list, gpu: bool = False) -> None:
        """One worker process per rank on this machine, with paddle.distributed's environment; on the
        GPU rank r uses GPU r (FLAGS_selected_gpus). Each worker picks its collective backend itself
        (worker_process.place_rank), as it must under paddle.distributed.launch too."""
        endpoints = [f"{host}:{p}" for p in _free_ports(tp, host)]
        env = dict(os.environ, PADDLE_TRAINERS_NUM=str(tp), PADDLE_TRAINER_ENDPOINTS=",".join(endpoints),
                   PADDLE_MASTER=endpoints[0])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(PACKAGE_ROOT), os.environ.get("PYTHONPATH")) if p)
        for rank in range(tp):
            cmd = [sys.executable, "-m", WORKER_MODULE, "--rank", str(rank),
                   "--step-address", f"tcp://{host}:{step_ports[rank]}",
                   "--result-address", f"tcp://{host}:{result_port}"]
            rank_env = dict(env, PADDLE_TRAINER_ID=str(rank), PADDLE_CURRENT_ENDPOINT=endpoints[rank])
            if gpu:
                rank_env["FLAGS_selected_gpus"] = str(rank)
            self.procs.append(subprocess.Popen(cmd, env=rank_env, cwd=PACKAGE_ROOT))

    @property
    def pids(self) -> list:
        """Worker pids (of this machine's ranks, or as the launched ranks reported them)."""
        return [p.pid for p in self.procs] or [i["pid"] for i in self.rank_info if i]

    def close(self) -> None:
        self._finalizer()

    def execute_model(self, step):
        if not self._finalizer.alive:  # stopped: by close(), or by an earlier failure
            raise WorkerFailure(self._failure or "the tensor-parallel workers were stopped")
        for rank, sock in enumerate(self._steps):
            self._send(sock, step.for_rank(rank, self.tp, self.table_rows), self.step_timeout_s, "step")
        return self._receive("step", self.step_timeout_s, "step")[1]

    # -- transport with liveness ----------------------------------------------------------------
    def _send(self, sock, obj, timeout_s: float, what: str) -> None:
        import zmq

        deadline = time.monotonic() + timeout_s
        while True:
            try:
                sock.send_pyobj(obj, flags=zmq.NOBLOCK)
                return
            except zmq.Again:  # the rank is not connected (yet, or any more)
                self._check_alive()
                if time.monotonic() > deadline:
                    self._fail(f"a tensor-parallel worker did not connect within {timeout_s:g} s "
                               f"(FD_TP_{what.upper()}_TIMEOUT)")
                time.sleep(POLL_MS / 1000)

    def _receive(self, kind: str, timeout_s: float, what: str):
        deadline = time.monotonic() + timeout_s
        while True:
            if self._results.poll(POLL_MS):
                msg = self._results.recv_pyobj()
                if msg[0] == "alive":
                    self._last_heard[msg[1]] = time.monotonic()
                    continue
                if msg[0] == "failed":
                    # A rank's collective fails when its peer died: name the dead peer as the cause.
                    deadline_peer = time.monotonic() + 1.0
                    while (cause := self._exit_message(exclude=msg[1])) is None and time.monotonic() < deadline_peer:
                        time.sleep(0.05)
                    error = f"tensor-parallel worker rank {msg[1]} failed: {msg[2]}"
                    self._fail(f"{cause} (then {error})" if cause else error)
                if msg[0] == kind:
                    return msg
                continue
            self._check_alive()
            self._check_heard()  # the queue is drained here: a heartbeat that is late really is late
            if time.monotonic() > deadline:
                self._fail(f"tensor-parallel workers did not finish a {what} within {timeout_s:g} s "
                           f"(FD_TP_{what.upper()}_TIMEOUT); a rank is hung")

    def _check_alive(self) -> None:
        message = self._exit_message()
        if message is not None:
            self._fail(message)

    def _check_heard(self) -> None:
        """A rank that has been silent (no heartbeat, no result) for FD_TP_HEARTBEAT_TIMEOUT: its host, its
        process or its network link is gone, and a collective waiting on it would never finish."""
        now = time.monotonic()
        for rank, heard in enumerate(self._last_heard):
            if heard is not None and now - heard > self.heartbeat_timeout_s:
                info = self.rank_info[rank] or {}
                self._fail(f"tensor-parallel worker rank {rank} (pid {info.get('pid')} at {info.get('endpoint')}) "
                           f"has not been heard from for {now - heard:.1f} s (FD_TP_HEARTBEAT_TIMEOUT="
                           f"{self.heartbeat_timeout_s:g}): its host or its network link to this engine is down")

    def _exit_message(self, exclude=None):
        for rank, proc in enumerate(self.procs):
            code = proc.poll()
            if code is not None and rank != exclude:
                how = f"was killed by signal {-code}" if code < 0 else f"exited with code {code}"
                return f"tensor-parallel worker rank {rank} (pid {proc.pid}) {how}"
        return None

    def _fail(self, message: str) -> None:
        logger.error("%s; stopping all %d workers", message, self.tp)
        self._failure = message
        self._graceful[0] = False
        self.close()
        raise WorkerFailure(message)
