"""NixlConnector: moves a prompt's KV pages from a prefill server to a decode server over NIXL (UCX).

Both servers register their KV pools with a NIXL agent once. The prefill server keeps a finished
request's pages (KVCacheManager.park) and answers with the live entries of its table: per table row
(a slot head-wise, the one row of blocks in 1-D mode) the pages a query after the prompt can still read
(KVCacheManager.live_pages: sink + window for a sliding slot, every block for a full one). The decode
server takes pages for those entries only (KVCacheManager.start_remote), reads (NIXL READ) each one
into its own page, K and V of every lane (codes and scales for quantized pages), and the read's
notification tells the prefill server to free them. A page is the same bytes on both sides, so one
entry is one contiguous range per KV tensor; runs of consecutive entries are read as one range.

Everything here runs on the engine thread but the handshakes (side_channel.py), which run on a small
thread pool so a dead prefill server never stalls a step.
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import queue
import threading
import time
import uuid
from dataclasses import dataclass, field
from typing import Optional

import numpy as np

from fastdeploy.disaggregation.side_channel import SideChannelServer, handshake
from fastdeploy.disaggregation.transfer_config import KVTransferConfig, RemotePrefill, parse_kv_transfer_params

logger = logging.getLogger("fastdeploy.disaggregation")

READS_REMEMBERED = 65536  # (prefill engine, request) pairs a decode server remembers having read
PROGRESS_S = 0.001  # how often the progress thread moves transfers on (and collects read notifications)
# Seconds buckets of the transfer-time histogram (a read of one request's pages).
TRANSFER_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


def load_nixl():
    try:
        import nixl_cu12 as nixl
    except ImportError:
        raise ValueError("--kv-transfer-config needs NIXL: pip install -e \".[cpu,pd]\" (nixl-cu12 1.5.1 and "
                         "vllm-router, with the CPU torch)") from None
    return nixl


@dataclass
class _Remote:
    """A prefill engine this server has met: its agent's name here and its KV regions."""

    agent: str
    regions: list  # [(base address, bytes per entry)] per KV tensor, in the same order as ours


@dataclass
class _Load:
    request: object
    remote: RemotePrefill
    handle: object = None
    started: float = field(default_factory=time.monotonic)
    bytes: int = 0
    pages: int = 0


@dataclass
class TransferOutcome:
    request: object
    error: Optional[str] = None  # None: loaded


class NixlConnector:
    def __init__(self, config: KVTransferConfig, fd_config, kv_cache_manager, kv_tensors: list):
        nixl = load_nixl()
        self.config = config
        self.kv = kv_cache_manager
        self.engine_id = config.engine_id or uuid.uuid4().hex
        self.tp_size = fd_config.parallel_config.tensor_parallel_size
        # Not nixl's progress thread: it spins without pause (pthrDelay 0) and takes a core from the model.
        # Ours (_progress) polls notifications every PROGRESS_S, which moves UCX's transfers on, also while
        # the engine thread runs a long step; the agent locks its calls (STRICT) for the two threads.
        self.agent = nixl.nixl_agent(f"fastdeploy-{self.engine_id}", nixl.nixl_agent_config(
            enable_prog_thread=False, backends=["UCX"], sync_mode=nixl.nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT))
        num_entries = kv_cache_manager.pages_per_rank // kv_cache_manager.pages_per_entry
        self.regions = []
        for tensor in kv_tensors:
            nbytes = int(tensor.numel()) * tensor.element_size()
            self.regions.append((int(tensor.data_ptr()), nbytes // num_entries))
        self._memory = self.agent.register_memory(
            [(base, unit * num_entries, 0, "") for base, unit in self.regions], "DRAM")
        self.layout = layout_fingerprint(fd_config, kv_cache_manager, [unit for _, unit in self.regions])
        self.side_channel = None
        if config.produces:
            self.side_channel = SideChannelServer(
                config.side_channel_host, config.side_channel_port,
                {"engine_id": self.engine_id, "layout": self.layout,
                 "regions": [[base, unit] for base, unit in self.regions]},
                self.agent.get_agent_metadata())
        self._parked: dict = {}     # request id -> the monotonic time its pages are freed unread
        self._remotes: dict = {}    # prefill engine id -> _Remote
        self._handshakes: dict = {}  # prefill engine id -> future of its description
        self._pending: dict = {}    # prefill engine id -> [_Load] waiting for its handshake
        self._loads: dict = {}      # request id -> _Load being read
        self._outcomes: list = []
        # (prefill engine, its request) of the reads already made: a second read of the same parked pages
        # (a retried request) would find them freed and perhaps reused by then, so it is refused
        self._read_before: collections.OrderedDict = collections.OrderedDict()
        self._pool = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="kv-handshake")
        self.counters = dict(kv_transfer_bytes_sent_total=0, kv_transfer_pages_sent_total=0,
                             kv_transfer_bytes_received_total=0, kv_transfer_pages_received_total=0,
                             kv_transfer_requests_sent_total=0, kv_transfer_requests_received_total=0,
                             kv_transfer_failed_total=0, kv_transfer_timed_out_total=0,
                             kv_transfer_expired_total=0)
        self._seconds = [0] * (len(TRANSFER_BUCKETS) + 1)
        self._seconds_sum = 0.0
        self._notifs: queue.SimpleQueue = queue.SimpleQueue()  # read notifications, from the progress thread
        self._stop = threading.Event()
        self._progress_thread = threading.Thread(target=self._progress, name="kv-transfer-progress", daemon=True)
        self._progress_thread.start()
        logger.info("KV transfer: NIXL agent %s (%s), %d KV tensors registered%s", self.agent.name,
                    self.config.splitwise_role, len(self.regions),
                    f", side channel {config.side_channel_host}:{self.side_channel.port}" if self.side_channel else "")

    # -- requests ------------------------------------------------------------------------------
    def accept(self, request, params) -> None:
        """Read a request's kv_transfer_params (ValueError: a 400) and mark what it asks of this server."""
        what = parse_kv_transfer_params(params, self.config, request.num_prompt_tokens)
        if what == "hand_off":
            if request.sampling_params.prompt_logprobs is not None:
                raise ValueError("kv_transfer_params.do_remote_decode cannot be combined with prompt_logprobs")
            request.hands_off_kv = True
        elif isinstance(what, RemotePrefill):
            if what.tp_size != self.tp_size:
                raise ValueError(f"kv_transfer_params.tp_size: the prefill server runs {what.tp_size} "
                                 f"tensor-parallel ranks, this one {self.tp_size}; both must match")
            if len(what.rows) != self.kv.num_rows:
                raise ValueError(f"kv_transfer_params.remote_block_ids has {len(what.rows)} rows, this server's "
                                 f"tables {self.kv.num_rows}: the two servers' KV layouts differ (head-wise "
                                 f"configuration or FD_HEAD_WISE_KV_CACHE)")
            if what.num_tokens > 0:
                request.remote_kv = what

    def hand_off(self, request) -> dict:
        """A prefill request finished: park its pages for the decode server; the kv_transfer_params of the
        answer (vLLM's fields, plus remote_num_tokens)."""
        rid = request.request_id
        num_tokens = request.num_prompt_tokens - 1  # the decode server computes the last prompt token
        if num_tokens < 1 or not self.kv.holds(rid):
            self.kv.free(rid)
            return {"do_remote_prefill": False, "do_remote_decode": False}
        rows = self.kv.live_pages(rid, num_tokens)
        entries = -(-num_tokens // self.kv.block_size)
        table = [[-1] * entries for _ in rows]
        for out, row in zip(table, rows):
            for i, page in row:
                out[i] = page
        self._parked[rid] = time.monotonic() + self.config.abort_timeout_s
        pages = sum(len(row) for row in rows)
        self.counters["kv_transfer_requests_sent_total"] += 1
        self.counters["kv_transfer_pages_sent_total"] += pages * self.kv.pages_per_entry
        self.counters["kv_transfer_bytes_sent_total"] += pages * self.entry_bytes
        return {"do_remote_prefill": True, "do_remote_decode": False, "remote_engine_id": self.engine_id,
                "remote_request_id": rid, "remote_host": _advertised(self.config.side_channel_host),
                "remote_port": self.side_channel.port, "remote_block_ids": table,
                "remote_num_tokens": num_tokens, "tp_size": self.tp_size}

    def start_load(self, request) -> None:
        """The scheduler took pages for a decode request's remote KV: read them (after a handshake with
        its prefill engine, the first time)."""
        load = _Load(request, request.remote_kv)
        engine = load.remote.engine_id
        if engine in self._remotes:
            self._read(load)
            return
        self._pending.setdefault(engine, []).append(load)
        if engine not in self._handshakes:
            self._handshakes[engine] = self._pool.submit(handshake, load.remote.host, load.remote.port,
                                                         self.config.handshake_timeout_s)

    def forget(self, request_id) -> bool:
        """A loading request was aborted: True if its read is still running (the engine frees its pages
        once the read ends, never before: they are being written)."""
        for loads in self._pending.values():
            loads[:] = [load for load in loads if load.request.request_id != request_id]
        return request_id in self._loads

    @property
    def entry_bytes(self) -> int:
        return sum(unit for _, unit in self.regions)

    @property
    def busy(self) -> bool:
        """Transfers or parked pages to watch: the engine polls often instead of sleeping."""
        return bool(self._parked or self._loads or self._pending)

    # -- progress ------------------------------------------------------------------------------
    def _progress(self) -> None:
        while not self._stop.wait(PROGRESS_S):
            try:
                notifs = self.agent.get_new_notifs()
            except Exception as e:  # the agent is being torn down
                logger.debug("KV transfer progress stopped: %s", e)
                return
            for messages in notifs.values():
                for message in messages:
                    self._notifs.put(message)

    def poll(self) -> list:
        """Advance handshakes and reads, free parked pages that were read or timed out; returns the
        TransferOutcome of every decode read that ended since the last call."""
        self._finish_handshakes()
        now = time.monotonic()
        for rid, load in list(self._loads.items()):
            state = self.agent.check_xfer_state(load.handle)
            if state == "DONE":
                self._end(load, None)
            elif state != "PROC":
                self._end(load, f"the NIXL read from prefill engine {load.remote.engine_id} failed ({state})")
                self._drop_remote(load.remote.engine_id)
            elif now - load.started > self.config.transfer_timeout_s:
                self.counters["kv_transfer_timed_out_total"] += 1
                self._end(load, f"the NIXL read did not finish within {self.config.transfer_timeout_s:g} s")
        if self._parked:
            self._release_parked(now)
        outcomes, self._outcomes = self._outcomes, []
        return outcomes

    def _finish_handshakes(self) -> None:
        for engine, future in list(self._handshakes.items()):
            if not future.done():
                continue
            del self._handshakes[engine]
            loads = self._pending.pop(engine, [])
            try:
                self._meet(engine, future.result())
            except (ConnectionError, ValueError, OSError, RuntimeError) as e:
                for load in loads:
                    self._fail(load, str(e))
                continue
            for load in loads:
                self._read(load)

    def _meet(self, engine: str, description: dict) -> None:
        if description.get("engine_id") != engine:
            raise ConnectionError(f"the side channel answered as engine {description.get('engine_id')!r}, not "
                                  f"{engine!r}: the prefill server restarted")
        theirs = description["layout"]
        diff = [f"{k}: prefill {theirs.get(k)!r}, decode {v!r}" for k, v in self.layout.items() if theirs.get(k) != v]
        if diff:
            raise ValueError("the prefill and decode servers' KV layouts differ, so pages cannot move between "
                             "them: " + "; ".join(diff))
        agent = self.agent.add_remote_agent(description["agent_metadata"])
        name = agent.decode() if isinstance(agent, bytes) else agent
        self._remotes[engine] = _Remote(name, [tuple(r) for r in description["regions"]])

    def _read(self, load: _Load) -> None:
        """Post one NIXL READ of every live entry of the request, into the pages its table holds here."""
        rid = load.request.request_id
        remote = self._remotes[load.remote.engine_id]
        source = (load.remote.engine_id, load.remote.request_id)
        if source in self._read_before:
            self._fail(load, f"the prefill pages of request {load.remote.request_id!r} were read already (a "
                             f"retried request): they may hold another request's KV by now")
            return
        try:
            local_entries, remote_entries = _pairs(self.kv.live_pages(rid, load.remote.num_tokens), load.remote.rows)
        except ValueError as e:
            self._notify(remote, load.remote.request_id)  # its pages are of no use: the prefill frees them now
            self._fail(load, str(e))
            return
        self._read_before[source] = None
        while len(self._read_before) > READS_REMEMBERED:
            self._read_before.popitem(last=False)
        local, theirs = _descriptors(self.regions, remote.regions, local_entries, remote_entries)
        try:
            handle = self.agent.initialize_xfer("READ", self.agent.get_xfer_descs(local, "DRAM"),
                                                self.agent.get_xfer_descs(theirs, "DRAM"), remote.agent,
                                                load.remote.request_id.encode())
            state = self.agent.transfer(handle)
        except Exception as e:  # nixl raises its own error types (a dead peer, a refused registration)
            self._drop_remote(load.remote.engine_id)
            self._fail(load, f"the NIXL read could not start: {type(e).__name__}: {e}")
            return
        load.handle, load.pages = handle, len(local_entries)
        load.bytes = len(local_entries) * self.entry_bytes
        self._loads[rid] = load
        if state == "ERR":
            self._end(load, "the NIXL read failed at once")

    def _notify(self, remote: _Remote, prefill_request_id: str) -> None:
        try:
            self.agent.send_notif(remote.agent, prefill_request_id.encode())
        except Exception as e:  # the prefill server frees them at its abort timeout instead
            logger.debug("notifying the prefill server: %s", e)

    def _end(self, load: _Load, error: Optional[str]) -> None:
        del self._loads[load.request.request_id]
        try:
            self.agent.release_xfer_handle(load.handle)
        except Exception as e:  # an unfinished read that cannot be aborted: nothing more to do here
            logger.warning("releasing the NIXL read of %s: %s", load.request.request_id, e)
        if error is not None:
            self._fail(load, error)
            return
        seconds = time.monotonic() - load.started
        self._seconds[next((i for i, b in enumerate(TRANSFER_BUCKETS) if seconds <= b), len(TRANSFER_BUCKETS))] += 1
        self._seconds_sum += seconds
        self.counters["kv_transfer_requests_received_total"] += 1
        self.counters["kv_transfer_pages_received_total"] += load.pages * self.kv.pages_per_entry
        self.counters["kv_transfer_bytes_received_total"] += load.bytes
        self._outcomes.append(TransferOutcome(load.request))

    def _fail(self, load: _Load, error: str) -> None:
        logger.warning("request %s: loading its KV from prefill engine %s failed: %s", load.request.request_id,
                       load.remote.engine_id, error)
        self.counters["kv_transfer_failed_total"] += 1
        self._outcomes.append(TransferOutcome(load.request, error))

    def _drop_remote(self, engine: str) -> None:
        """Forget a prefill engine after a failed read: the next request meets it (or its successor) anew."""
        remote = self._remotes.pop(engine, None)
        if remote is not None:
            try:
                self.agent.remove_remote_agent(remote.agent)
            except Exception:  # already gone
                pass

    def _release_parked(self, now: float) -> None:
        """Free the parked pages a decode server has read (its read's notification) or never will."""
        while not self._notifs.empty():
            rid = self._notifs.get().decode(errors="replace")
            if self._parked.pop(rid, None) is not None:
                self.kv.free(rid)
        for rid, deadline in list(self._parked.items()):
            if now > deadline:
                del self._parked[rid]
                self.kv.free(rid)
                self.counters["kv_transfer_expired_total"] += 1
                logger.warning("request %s: no decode server read its KV within %g s; its pages are freed",
                               rid, self.config.abort_timeout_s)

    # -- observability -------------------------------------------------------------------------
    def stats(self) -> dict:
        return {**self.counters, "kv_transfer_parked_requests": len(self._parked),
                "kv_transfer_loading_requests": len(self._loads) + sum(map(len, self._pending.values())),
                "kv_transfer_seconds": {"buckets": TRANSFER_BUCKETS, "counts": list(self._seconds),
                                        "sum": self._seconds_sum}}

    def close(self) -> None:
        self._stop.set()
        self._progress_thread.join(1.0)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.side_channel is not None:
            self.side_channel.close()
            self.side_channel = None


def layout_fingerprint(fd_config, kv, units: list) -> dict:
    """What must be equal on both servers for a page to mean the same thing on each."""
    model, cache, slots = fd_config.model_config, fd_config.cache_config, fd_config.slot_layout
    return {"architecture": str(model.model_type), "num_layers": int(model.num_hidden_layers),
            "num_key_value_heads": int(model.num_key_value_heads), "head_dim": int(model.head_dim),
            "block_size": int(cache.block_size), "cache_dtype": cache.cache_dtype,
            "kv_cache_quant_type": cache.kv_cache_quant_type or "none",
            "tensor_parallel_size": int(fd_config.parallel_config.tensor_parallel_size),
            "head_wise_kv_cache": bool(fd_config.head_wise_kv_cache), "table_rows": int(kv.num_rows),
            "lane_of_layer": list(slots.lane_of_layer), "head_slots": [list(r) for r in slots.head_slots],
            "slot_types": [str(t) for t in slots.slot_types], "entry_bytes": list(units)}


def _pairs(live_rows: list, remote_rows: list) -> tuple:
    """(local entries, remote entries) of every page a query here can read (the live entries of this
    server's table), in table order; ValueError where the prefill server sent no page for one."""
    local, remote = [], []
    for r, (live, theirs) in enumerate(zip(live_rows, remote_rows)):
        for i, page in live:
            if i >= len(theirs) or theirs[i] == -1:
                raise ValueError(f"the prefill server sent no page for table row {r}, block {i}, which a query "
                                 f"here reads: the two servers' sliding windows differ")
            local.append(page)
            remote.append(theirs[i])
    return local, remote


def _descriptors(local_regions: list, remote_regions: list, local: list, remote: list) -> tuple:
    """Nx3 (address, bytes, device) arrays, local and remote, for the pages `local[j]` <- `remote[j]` of
    every KV tensor; runs where both sides' entries are consecutive become one range. Sorted by local
    entry first: head-wise, the pages of one block's slots are often neighbours on both sides (each slot
    takes from its own free list, page p = block * slots + slot), while a row's own pages never are."""
    order = np.argsort(np.asarray(local, np.int64), kind="stable")
    lo, re_ = np.asarray(local, np.uint64)[order], np.asarray(remote, np.uint64)[order]
    breaks = np.ones(len(lo), bool)
    breaks[1:] = (lo[1:] != lo[:-1] + 1) | (re_[1:] != re_[:-1] + 1)
    starts = np.flatnonzero(breaks)
    lengths = np.diff(np.append(starts, len(lo))).astype(np.uint64)
    mine, theirs = [], []
    for (base, unit), (rbase, runit) in zip(local_regions, remote_regions):
        for out, b, u, entries in ((mine, base, unit, lo), (theirs, rbase, runit, re_)):
            d = np.zeros((len(starts), 3), np.uint64)
            d[:, 0] = np.uint64(b) + entries[starts] * np.uint64(u)
            d[:, 1] = lengths * np.uint64(u)
            out.append(d)
    return np.concatenate(mine), np.concatenate(theirs)


def _advertised(host: str) -> str:
    """The side channel host a decode server can dial (a wildcard bind is reached on loopback)."""
    return "127.0.0.1" if host in ("", "0.0.0.0", "*") else host
