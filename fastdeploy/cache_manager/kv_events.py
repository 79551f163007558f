"""KV-cache events in vLLM's format, from the prefix cache's one source of truth: where a hit may end.

A consumer (a KV-aware router, an indexer) keeps, per replica, the set of block hashes announced as
stored. What a block being stored means here is one of two things (`stored_blocks`):

- "hit_ends": a block is stored exactly while a prefix hit ending at it is valid on this replica (the
  retention rule: every full head holds every block up to it, every recycling sliding head holds its sink
  blocks and the blocks of its window in front of it; prefix_tree.PrefixCache.valid_depth), and removed
  the moment that stops being true: when any page such a hit needs is evicted, not only when the block's
  last page goes. Valid ends need not be prefix-closed (a hit ending at block 9 may be valid while one
  ending at block 5 is not: block 5's window lost a page that block 9's window no longer covers), so a
  consumer that credits the run of stored blocks from a prompt's first block (vllm-router's kv_aware) is
  never credited a hit this replica cannot serve, and with sliding heads under memory pressure it is
  credited little: the window pages in the middle of a cached system prompt are the first evicted.
- "hit_paths" (the default): a block is stored while it lies on the way to a valid end (it or a
  descendant is one): the blocks a run-crediting consumer needs to see the whole cached prefix. A prompt
  that leaves the cached path at a valid end is credited exactly its hit; one that leaves it between two
  valid ends is credited more than the replica serves (the hit ends at the last valid end before).

With a host or disk tier (--swap-space), a page a tier holds counts as held: the lookup serves a hit on it
(copying it back first), so a block leaves the stored set only when its pages leave every tier.

With no recycling sliding heads (1-D mode, FD_HEAD_WISE_KV_CACHE=0, or no sliding heads) every valid
end's ancestors are valid ends and the two are the same: vLLM's meaning, a block is stored while cached.

Hashes are vLLM's (vllm/v1/core/kv_cache_utils.hash_block_tokens with its default `sha256`): the
SHA-256 of the pickled (parent hash, block token ids, extra keys = None), chained from NONE_HASH (the
hash of the seed "vllm-none-hash", or of PYTHONHASHSEED where set), sent as the digest's last 8 bytes
read as an unsigned integer (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES, on by default), so the same tokens
and block size give the same hashes on this engine and on vLLM.

Every event's parent was announced before it: where a newly stored block's ancestors never were (hit_ends),
they are announced stored and removed in the same batch (an anchor for the chain, no claim on them).
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
STORED_BLOCKS = ("hit_paths", "hit_ends")  # what a BlockStored announces (module docstring); the first is the default
MAX_ANCHORS = 1 << 20  # hashes ever announced (consumers keep them as parents) before a fresh start


class HitEndEvents:
    """Diffs the prefix cache's valid hit ends against what was last announced; events, oldest first.

    Incremental: a node's validity depends only on its own pages and its ancestors', so each call
    re-judges just the subtrees under the nodes the cache reports changed (PrefixCache.changed: a
    block registered or filled, a page evicted, a node removed), not the whole trie.
    """

    def __init__(self, prefix_cache, stored_blocks: str = STORED_BLOCKS[0]):
        if stored_blocks not in STORED_BLOCKS:
            raise ValueError(f"stored_blocks must be one of {', '.join(STORED_BLOCKS)}, not {stored_blocks!r}")
        self.cache = prefix_cache
        self.paths = stored_blocks == "hit_paths"
        self.block_size = prefix_cache.block_size
        prefix_cache.changed = set()
        self._everything = True    # the next call judges the whole trie (the first, or after a reset)
        self._digests: dict = {}   # node -> its chained digest (pruned of detached nodes now and then)
        self.valid: set = set()    # nodes a hit may end at, as last judged
        self.stored: dict = {}     # node -> event hash of every block announced stored and not removed
        self._below: dict = {}     # hit_paths: node -> valid ends in its subtree (the node's own included)
        self._parent: dict = {}    # hit_paths: node -> its parent, for walking up after it left the trie
        self._anchors: set = set()  # event hashes ever announced (a parent a consumer knows)
        self._none = none_hash()

    def valid_ends(self) -> list:
        """Every trie node at which a hit may end now, parents before children (the whole trie)."""
        valid, _ = self._judge(list(self.cache.root.children.values()), self._start_state())
        return valid

    def collect(self) -> list:
        """The events that bring a consumer from the last call's stored blocks to today's."""
        cache = self.cache
        changed, cache.changed = cache.changed, set()
        events = []
        if len(self._anchors) > MAX_ANCHORS:  # start the consumer over rather than grow without bound
            self._anchors.clear()
            self.stored.clear()
            self.valid.clear()
            self._below.clear()
            self._parent.clear()
            self._everything = True
            events.append(ALL_BLOCKS_CLEARED)
        if self._everything:
            self._everything = False
            now, judged = self.valid_ends(), None  # every node judged
        elif changed:
            now, judged = self._judge_changed(changed)
        else:
            return events
        now_set = set(now)
        lost = [n for n in self.valid if n not in now_set and (judged is None or n in judged or n.detached)]
        found = [n for n in now if n not in self.valid]
        self.valid.difference_update(lost)
        self.valid.update(found)
        if self.paths:
            gone, new = self._paths_changed(lost, found)
        else:
            gone, new = lost, found
        if gone:
            events.append(block_removed([self.stored.pop(n) for n in gone]))
        for node in sorted(new, key=lambda n: n.depth):
            # the node, then its ancestors no consumer has heard of, deepest first (hit_paths: none)
            chain, a = [node], node.parent
            while a is not cache.root and self._event_hash(a) not in self._anchors:
                chain.append(a)
                a = a.parent
            parent = None if a is cache.root else self._event_hash(a)
            for b in reversed(chain):
                h = self._event_hash(b)
                events.append(block_stored([h], parent, list(b.key), self.block_size))
                self._anchors.add(h)
                parent = h
            # ancestors are earlier in `new` (by depth): an unannounced one is not stored
            if len(chain) > 1:
                events.append(block_removed([self._event_hash(b) for b in chain[1:]]))
            self.stored[node] = self._event_hash(node)
        if len(self._digests) > 2 * cache.num_nodes + 1024:  # forget nodes that left the trie, now and then
            self._digests = {n: d for n, d in self._digests.items() if not n.detached}
        return events

    def _paths_changed(self, lost: list, found: list) -> tuple:
        """hit_paths: (blocks no longer on the way to any valid end, blocks newly on the way to one)."""
        root, below, up = self.cache.root, self._below, self._parent
        before = {}
        for node, delta in [(n, -1) for n in lost] + [(n, 1) for n in found]:
            while node is not None and node is not root:
                before.setdefault(node, node in below)
                count = below.get(node, 0) + delta
                if count:
                    below[node] = count
                    up.setdefault(node, node.parent)
                else:
                    del below[node]
                node = up.get(node) or node.parent
        for node in before:
            if node not in below:
                up.pop(node, None)
        gone = [n for n, was in before.items() if was and n not in below]
        new = [n for n, was in before.items() if not was and n in below]
        return gone, new

    # -- judging validity --------------------------------------------------------------------------
    def _judge_changed(self, changed: set) -> tuple:
        """(valid ends, every node judged) over the subtrees of the changed nodes still in the trie."""
        root, tops = self.cache.root, []
        for node in changed:
            if node.detached:
                continue
            a = node.parent
            while a is not root and a not in changed:
                a = a.parent
            if a is root:  # no changed ancestor judges it already
                tops.append(node)
        valid, judged = [], set()
        for top in tops:
            state = self._start_state()
            path, a = [], top.parent
            while a is not root:
                path.append(a)
                a = a.parent
            for a in reversed(path):
                state = self._step(a, state)
            v, j = self._judge([top], state)
            valid.extend(v)
            judged |= j
        valid.sort(key=lambda n: n.depth)
        return valid, judged

    def _start_state(self) -> tuple:
        n = len(self.cache.types)
        return True, (True,) * n, (-1,) * n

    def _step(self, node, state) -> tuple:
        """The state below `node`: (every full head holds every block so far, per type: its sink blocks
        held, the deepest block one of its heads lost)."""
        full_ok, sink_ok, missing = state
        gaps, d, cache = node.gaps, node.depth, self.cache
        if node.hosted is not None:  # a page the lower tier holds serves a hit (it is loaded back first)
            gaps = [g - h for g, h in zip(gaps, node.hosted)]
        full_ok = full_ok and not gaps[0]
        types = range(len(cache.types))
        sink_ok = tuple(sink_ok[k] and (not gaps[1 + k] or d >= cache.type_sink_blocks[k]) for k in types)
        missing = tuple(d if gaps[1 + k] else missing[k] for k in types)
        return full_ok, sink_ok, missing

    def _judge(self, tops: list, state: tuple) -> tuple:
        """(valid ends, every node judged) in the subtrees of `tops`, whose parents' state is `state`."""
        cache, valid, judged = self.cache, [], set()
        stack = [(node, state) for node in tops]
        while stack:
            node, state = stack.pop()
            judged.add(node)
            state = self._step(node, state)
            full_ok, sink_ok, missing = state
            d = node.depth
            if full_ok and all(sink_ok) and all(missing[k] < cache.dead_end(d + 1, k) for k in range(len(missing))):
                valid.append(node)
            for child in node.children.values():
                stack.append((child, state))
        valid.sort(key=lambda n: n.depth)
        return valid, judged

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
