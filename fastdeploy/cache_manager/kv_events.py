"""KV-cache events in vLLM's format, from the prefix cache's one source of truth: where a hit may end.

A consumer (a KV-aware router, an indexer) keeps, per replica, the set of block hashes announced as
stored. Here a block is *stored* exactly while a prefix hit ending at it is valid on this replica (the
retention rule: every full head holds every block up to it, every recycling sliding head holds its sink
blocks and the blocks of its window in front of it; prefix_tree.PrefixCache.valid_depth), and *removed*
the moment that stops being true: when any page such a hit needs is evicted, not only when the block's
last page goes. Valid ends need not be prefix-closed (a hit ending at block 9 may be valid while one
ending at block 5 is not: block 5's window lost a page that block 9's window no longer covers), so a
consumer that credits the longest run of stored blocks from the first one (vllm-router's kv_aware) is
never credited a hit this replica cannot serve; one that takes the deepest stored block gets all it can.

Hashes are vLLM's (vllm/v1/core/kv_cache_utils.hash_block_tokens with its default `sha256`): the
SHA-256 of the pickled (parent hash, block token ids, extra keys = None), chained from NONE_HASH (the
hash of the seed "vllm-none-hash", or of PYTHONHASHSEED where set), sent as the digest's last 8 bytes
read as an unsigned integer (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, on by default), so the same tokens
and block size give the same hashes on this engine and on vLLM.

Every event's parent was announced before it: where a newly valid block's ancestors never were, they are
announced stored and removed in the same batch (an anchor for the chain, no claim on them).
"""

from __future__ import annotations

import hashlib
import os
import pickle
from typing import Optional

NONE_HASH_SEED = "vllm-none-hash"
MEDIUM = "GPU"  # vLLM's name for the engine's own KV pool (what the router credits as device tier)


def _sha256(obj) -> bytes:
    return hashlib.sha256(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)).digest()


def none_hash() -> bytes:
    """The parent of a prompt's first block (vLLM's NONE_HASH for a cryptographic hash)."""
    seed = os.environ.get("PYTHONHASHSEED")
    return _sha256(seed if seed is not None else NONE_HASH_SEED)


def block_hash(parent: bytes, token_ids: tuple) -> bytes:
    """vLLM's hash of one full block under its parent's hash."""
    return _sha256((parent, tuple(token_ids), None))


def external_hash(digest: bytes) -> int:
    """What an event carries: the digest's low 64 bits, big-endian (vLLM's int block hashes)."""
    return int.from_bytes(digest[-8:], "big")


def chain_hashes(token_ids, block_size: int) -> list:
    """The event hashes of every full block of a token sequence, as a consumer computes them."""
    parent, out = none_hash(), []
    for i in range(len(token_ids) // block_size):
        parent = block_hash(parent, tuple(token_ids[i * block_size:(i + 1) * block_size]))
        out.append(external_hash(parent))
    return out


def block_stored(hashes: list, parent: Optional[int], token_ids: list, block_size: int) -> dict:
    return {"type": "BlockStored", "block_hashes": hashes, "parent_block_hash": parent, "token_ids": token_ids,
            "block_size": block_size, "lora_id": None, "medium": MEDIUM, "lora_name": None}


def block_removed(hashes: list) -> dict:
    return {"type": "BlockRemoved", "block_hashes": hashes, "medium": MEDIUM}


ALL_BLOCKS_CLEARED = {"type": "AllBlocksCleared"}
MAX_ANCHORS = 1 << 20  # hashes ever announced (consumers keep them as parents) before a fresh start


class HitEndEvents:
    """Diffs the prefix cache's valid hit ends against what was last announced; events, oldest first."""

    def __init__(self, prefix_cache):
        self.cache = prefix_cache
        self.block_size = prefix_cache.block_size
        self._version = None
        self._digests: dict = {}   # node -> its chained digest (pruned of detached nodes now and then)
        self.stored: dict = {}     # node -> event hash of every block announced stored and not removed
        self._anchors: set = set()  # event hashes ever announced (a parent a consumer knows)
        self._none = none_hash()

    def valid_ends(self) -> list:
        """Every trie node at which a hit may end now, parents before children."""
        cache = self.cache
        full, types = cache.full_slots, range(len(cache.types))
        type_slots, sinks = cache.type_slots, cache.type_sink_blocks
        out = []
        # (node, every full head holds every block so far, per type: sink blocks held, last block missing one)
        stack = [(child, True, (True,) * len(cache.types), (-1,) * len(cache.types))
                 for child in cache.root.children.values()]
        while stack:
            node, full_ok, sink_ok, missing = stack.pop()
            pages, d = node.pages, node.depth
            full_ok = full_ok and all(pages[s] >= 0 for s in full)
            if not full_ok:
                continue  # no hit ends below a block a full head lost
            held = [all(pages[s] >= 0 for s in type_slots[k]) for k in types]
            sink_ok = tuple(sink_ok[k] and (held[k] or d >= sinks[k]) for k in types)
            missing = tuple(missing[k] if held[k] else d for k in types)
            if all(sink_ok) and all(missing[k] < cache.dead_end(d + 1, k) for k in types):
                out.append(node)
            for child in node.children.values():
                stack.append((child, full_ok, sink_ok, missing))
        out.sort(key=lambda n: n.depth)
        return out

    def collect(self) -> list:
        """The events that bring a consumer from the last call's valid ends to today's."""
        if self.cache.version == self._version:
            return []
        self._version = self.cache.version
        now = self.valid_ends()
        now_set = set(now)
        events = []
        if len(self._anchors) > MAX_ANCHORS:  # start the consumer over rather than grow without bound
            self._anchors.clear()
            self.stored.clear()
            events.append(ALL_BLOCKS_CLEARED)
        gone = [self.stored.pop(n) for n in list(self.stored) if n not in now_set]
        if gone:
            events.append(block_removed(gone))
        for node in now:
            if node in self.stored:
                continue
            # the node, then its ancestors no consumer has heard of, deepest first
            chain, a = [node], node.parent
            while a is not self.cache.root and self._event_hash(a) not in self._anchors:
                chain.append(a)
                a = a.parent
            parent = None if a is self.cache.root else self._event_hash(a)
            for b in reversed(chain):
                h = self._event_hash(b)
                events.append(block_stored([h], parent, list(b.key), self.block_size))
                self._anchors.add(h)
                parent = h
            # ancestors are earlier in `now` (by depth): an unannounced one is not a valid end
            if len(chain) > 1:
                events.append(block_removed([self._event_hash(b) for b in chain[1:]]))
            self.stored[node] = self._event_hash(node)
        if len(self._digests) > 2 * self.cache.num_nodes + 1024:  # forget nodes that left the trie, now and then
            self._digests = {n: d for n, d in self._digests.items() if not n.detached}
        return events

    def _event_hash(self, node) -> int:
        return external_hash(self._digest(node))

    def _digest(self, node) -> bytes:
        """The node's chained digest, hashing (once) whichever of its ancestors were not hashed yet."""
        unknown = []  # deepest first
        while node is not self.cache.root and node not in self._digests:
            unknown.append(node)
            node = node.parent
        d = self._none if node is self.cache.root else self._digests[node]
        for n in reversed(unknown):
            d = self._digests[n] = block_hash(d, n.key)
        return d
