"""One tensor-parallel rank: `python -m fastdeploy.worker.worker_process --rank R ...`, started by the
engine (engine/worker_group.py), one process per rank; or, across machines, by
`python -m paddle.distributed.launch --ips ... fastdeploy/worker/worker_process.py --engine-address H:P`
against an engine started with FD_TP_LAUNCH_WORKERS=0 (README: tensor parallelism).

The rank's place in the group comes from paddle.distributed's own environment variables
(PADDLE_TRAINER_ID, PADDLE_TRAINERS_NUM, PADDLE_TRAINER_ENDPOINTS, PADDLE_CURRENT_ENDPOINT), which
the engine sets as `paddle.distributed.launch` would; `init_parallel_env()` then builds the
collective group (gloo on CPU). Engine <-> worker messages go over ZeroMQ (pickled objects):

  engine -> every rank (PUSH/PULL, one socket per rank): FDConfig first, then StepInput per step,
                                                          None to stop
  every rank -> engine (PUSH/PULL, one shared socket):   ("ready", rank, info) once loaded,
                                                          ("failed", rank, message) before exiting on an error,
                                                          ("step", StepOutput) from rank 0 after each step

A worker dies with its parent (PR_SET_PDEATHSIG), exits quietly on SIGTERM, and exits when its
parent is gone, so no exit path of the engine leaves a rank behind.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import sys

PR_SET_NAME, PR_SET_PDEATHSIG = 15, 1
POLL_MS = 1000
HEARTBEAT_S = 1.0  # how often a rank tells the engine it is alive (engine/worker_group.py: FD_TP_HEARTBEAT_TIMEOUT)


def _tie_to_parent(name: str) -> None:
    """Linux: die with the parent (even if it is SIGKILLed) and show as `name` in ps -o comm."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL)
        libc.prctl(PR_SET_NAME, name.encode()[:15])
    except OSError:  # not Linux: the parent-poll in the loop still ends an orphan
        pass


def _exit_quietly(_signum, _frame) -> None:
    raise SystemExit(0)


def place_rank(device: str, rank: int) -> None:
    """Before the collective group, which reads both: its backend (from the device, not the
    launcher's environment) and this rank's device."""
    import paddle

    from fastdeploy.worker.device import collective_backend, paddle_device_name

    os.environ["PADDLE_DISTRI_BACKEND"] = collective_backend(device)
    paddle.set_device(paddle_device_name(device, rank))


def _heartbeat(ctx, result_address: str, rank: int, stop) -> None:
    """From a thread of its own (so a long step does not silence it), on a socket of its own: ("alive",
    rank) every HEARTBEAT_S. The engine tells a rank whose host or link went down from a slow step by it."""
    import zmq

    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.SNDHWM, 4)  # an unreachable engine holds a few, not an hour's worth
    sock.connect(result_address)
    try:
        while not stop.wait(HEARTBEAT_S):
            try:
                sock.send_pyobj(("alive", rank), flags=zmq.NOBLOCK)
            except zmq.Again:
                pass
    finally:
        sock.close()


def serve(rank: int, step_address: str, result_address: str) -> int:
    import threading

    import zmq

    ctx = zmq.Context()
    steps, results = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    for sock in (steps, results):
        sock.setsockopt(zmq.LINGER, 1000)
    steps.connect(step_address)
    results.connect(result_address)
    parent = os.getppid()
    stop_heartbeat = threading.Event()
    heartbeat = threading.Thread(target=_heartbeat, args=(ctx, result_address, rank, stop_heartbeat),
                                 name="fd-tp-heartbeat", daemon=True)
    try:
        fd_config = steps.recv_pyobj()
        if fd_config is None:  # the engine gave up before this rank started
            return 0
        tp = fd_config.parallel_config.tensor_parallel_size
        import paddle.distributed as dist

        from fastdeploy.worker.collective_interface import bind_collective_interface
        from fastdeploy.worker.device import collective_backend

        device = getattr(fd_config, "device", "cpu")
        place_rank(device, rank)
        interface = bind_collective_interface(collective_backend(device))
        if tp > 1:
            dist.init_parallel_env()
        from fastdeploy.worker.model_runner import ModelRunner

        runner = ModelRunner(fd_config, rank)
        # Paddle's import installs a SIGTERM handler that prints a C++ "traceback" and aborts.
        signal.signal(signal.SIGTERM, _exit_quietly)
        backend = runner.attn_backend
        caches = getattr(backend, "key_caches", None)
        results.send_pyobj(("ready", rank, {
            "pid": os.getpid(), "kv_heads": list(runner.kv_heads),
            "cache_shape": list(caches[0].shape) if caches else None, "weight_bytes": runner.model.weight_bytes(),
            "endpoint": os.environ.get("PADDLE_CURRENT_ENDPOINT"), "interface": interface}))
        heartbeat.start()
        while True:
            if not steps.poll(POLL_MS):
                if os.getppid() != parent:
                    return 1  # orphaned: nobody will send another step
                continue
            step = steps.recv_pyobj()
            if step is None:
                return 0
            out = runner.execute_model(step)
            if rank == 0:
                results.send_pyobj(("step", out))
    except SystemExit:
        raise
    except BaseException as exc:
        import traceback

        traceback.print_exc()
        results.send_pyobj(("failed", rank, f"{type(exc).__name__}: {exc}"))
        return 1
    finally:
        stop_heartbeat.set()
        if heartbeat.is_alive():
            heartbeat.join()
        steps.close()
        results.close()
        ctx.term()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description="one tensor-parallel worker rank (started by the engine)")
    parser.add_argument("--rank", type=int, default=int(os.environ.get("PADDLE_TRAINER_ID", 0)))
    parser.add_argument("--step-address", help="ZeroMQ address this rank pulls steps from")
    parser.add_argument("--result-address", help="ZeroMQ address this rank pushes results to")
    parser.add_argument("--engine-address", help="HOST:PORT of an engine started with FD_TP_LAUNCH_WORKERS=0: "
                        "results go to PORT, steps come from PORT+1+rank (instead of the two addresses)")
    args = parser.parse_args(argv)
    if args.engine_address:
        host, port = args.engine_address.rsplit(":", 1)
        args.result_address = f"tcp://{host}:{port}"
        args.step_address = f"tcp://{host}:{int(port) + 1 + args.rank}"
    if not (args.step_address and args.result_address):
        parser.error("give --engine-address, or both --step-address and --result-address")
    _tie_to_parent(f"fd-tp-rank{args.rank}")
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl+C reaches the process group; the engine decides
    signal.signal(signal.SIGTERM, _exit_quietly)
    return serve(args.rank, args.step_address, args.result_address)


if __name__ == "__main__":
    sys.exit(main())
