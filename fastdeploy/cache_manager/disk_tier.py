"""The disk tier's files (--kvcache-storage-backend file): pages of the prefix cache that outlive the process.

The host tier (host_tier.py) decides what goes to disk and when: the entries its LRU lets go, and at a
clean shutdown every page a hit can still read. This module only keeps the files. A file holds one
lower-tier entry (a page head-wise, a block of every head in 1-D mode) and what places it in the prefix
tree again after a restart: the chain digest of its block's parent, the block's token ids and the slot.

Files live in <directory>/<identity>/: the identity is a digest of the model (its file's path, size and
modification time) and of the cache layout (block size, page dtype and quantization, the head-wise
layout, each KV tensor's bytes per entry). Another model or layout never reads them; a start-up that
finds directories of other identities says so once and leaves them alone.

A file carries its payload's length and CRC-32: a truncated or corrupt file is deleted when it is found
(its header at start-up, its payload when a load reads it), never served. Writes go to a temporary name first and
are renamed into place, so a crash leaves a whole file or none.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import logging
import os
import struct
import zlib
from typing import Iterator, Optional

import numpy as np

logger = logging.getLogger("fastdeploy.cache")

MAGIC = b"FDKVPAGE1"
_LENGTHS = struct.Struct("<IQI")  # header bytes, payload bytes, payload CRC-32
SUFFIX = ".kv"


def chain_digest(parent: str, key: tuple) -> str:
    """The digest naming a block: its parent's digest and its exact token ids (the root's is the identity)."""
    return hashlib.sha256(parent.encode() + np.asarray(key, np.int64).tobytes()).hexdigest()[:32]


def cache_identity(**fields) -> str:
    """A digest of everything that decides what a page's bytes mean (keyword fields, JSON-serialisable)."""
    return hashlib.sha256(json.dumps(fields, sort_keys=True, default=repr).encode()).hexdigest()[:24]


def model_fingerprint(model: Optional[str]) -> dict:
    """What identifies the model's weights: a file's (or a directory's files') path, size and mtime."""
    if not model or not os.path.exists(model):
        return {"name": model}
    path = os.path.realpath(model)
    files = [path] if os.path.isfile(path) else sorted(
        os.path.join(path, f) for f in os.listdir(path) if os.path.isfile(os.path.join(path, f)))
    return {"path": path, "files": [(os.path.basename(f), os.stat(f).st_size, os.stat(f).st_mtime_ns) for f in files]}


class PageFiles:
    """One directory of page files for one cache identity."""

    def __init__(self, directory: str, identity: str, entry_bytes: int):
        self.root = os.path.abspath(directory)
        self.identity = identity
        self.entry_bytes = entry_bytes
        self.dir = os.path.join(self.root, identity)
        try:
            os.makedirs(self.dir, exist_ok=True)
            probe = os.path.join(self.dir, ".probe")
            with open(probe, "wb") as f:
                f.write(b"x")
            os.remove(probe)
        except OSError as exc:
            raise ValueError(f"--kvcache-storage-path {directory!r}: cannot write there ({exc.strerror})") from None
        # One engine per directory and identity: a second would delete and overwrite the first's files.
        self._lock = open(os.path.join(self.dir, ".lock"), "wb")
        try:
            fcntl.flock(self._lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            self._lock.close()
            raise ValueError(f"--kvcache-storage-path {directory!r}: another engine serving the same model and "
                             f"cache layout uses it; give each its own directory") from None
        others = [d for d in os.listdir(self.root) if d != identity and os.path.isdir(os.path.join(self.root, d))]
        if others:
            logger.warning("disk tier: %s holds pages of %d other model(s) or cache layout(s) (%s); they are "
                           "ignored", self.root, len(others), ", ".join(sorted(others)[:3]))
        self.corrupt_total = 0  # files found truncated or corrupt, and deleted
        self.write_errors_total = 0  # writes that failed (a full disk): those pages were dropped

    def close(self) -> None:
        """Let another engine use the directory (the files stay)."""
        if not self._lock.closed:
            self._lock.close()

    def name(self, digest: str, slot: int) -> str:
        return os.path.join(self.dir, f"{digest}-{slot}{SUFFIX}")

    def write(self, digest: str, parent: str, key: tuple, slot: int, payload: np.ndarray) -> str:
        """Write one entry's bytes with what places it in the trie; returns the file's path."""
        header = json.dumps({"parent": parent, "key": [int(t) for t in key], "slot": slot}).encode()
        path = self.name(digest, slot)
        data = payload.tobytes()
        tmp = path + ".tmp"
        with open(tmp, "wb") as f:
            f.write(MAGIC + _LENGTHS.pack(len(header), len(data), zlib.crc32(data)) + header)
            f.write(data)
        os.replace(tmp, path)
        return path

    def read_checked(self, path: str) -> Optional[np.ndarray]:
        """The entry's bytes, or None when it is missing, truncated or corrupt; changes nothing (the tier
        loader's thread reads with it, and the engine loop deletes a bad file when the load ends)."""
        try:
            with open(path, "rb") as f:
                head = self._header(f)
                data = f.read() if head is not None else b""
        except OSError:
            head, data = None, b""
        if head is None or len(data) != head[1] or zlib.crc32(data) != head[2] or len(data) != self.entry_bytes:
            return None
        return np.frombuffer(data, np.uint8)

    def scan(self) -> Iterator[tuple]:
        """(path, parent digest, key, slot, mtime) of every readable header, oldest first; files with a bad
        header, leftovers of interrupted writes and files of another entry size are deleted."""
        found = []
        for entry in os.scandir(self.dir):
            if entry.name.endswith(".tmp"):
                self.remove(entry.path)
                continue
            if not entry.name.endswith(SUFFIX):
                continue
            try:
                with open(entry.path, "rb") as f:
                    head = self._header(f)
                size = entry.stat().st_size
            except OSError:
                head = None
            if head is None or head[1] != self.entry_bytes or size != len(MAGIC) + _LENGTHS.size + head[0] + head[1]:
                self.drop_corrupt(entry.path)
                continue
            meta = head[3]
            found.append((entry.stat().st_mtime_ns, entry.path, meta["parent"], tuple(meta["key"]), meta["slot"]))
        found.sort()
        for mtime, path, parent, key, slot in found:
            yield path, parent, key, slot, mtime

    def remove(self, path: str) -> None:
        try:
            os.remove(path)
        except FileNotFoundError:
            pass

    def drop_corrupt(self, path: str) -> None:
        logger.warning("disk tier: %s is truncated or corrupt; deleted (its tokens are recomputed)", path)
        self.corrupt_total += 1
        self.remove(path)

    @staticmethod
    def _header(f) -> Optional[tuple]:
        """(header bytes, payload bytes, CRC-32, header fields) from an open file, or None if malformed."""
        lead = f.read(len(MAGIC) + _LENGTHS.size)
        if len(lead) != len(MAGIC) + _LENGTHS.size or not lead.startswith(MAGIC):
            return None
        size, nbytes, crc = _LENGTHS.unpack(lead[len(MAGIC):])
        raw = f.read(size)
        try:
            meta = json.loads(raw)
            if not (isinstance(meta, dict) and isinstance(meta.get("parent"), str) and isinstance(meta.get("slot"), int)
                    and isinstance(meta.get("key"), list)):
                return None
        except ValueError:
            return None
        return size, nbytes, crc, meta
