"""Paged KV block bookkeeping with a prefix cache.

A full block's key is a hash chain over (adapter uid, its tokens, the previous block's
key): KV of one adapter landing is never reused under another (a reload gets a new uid).
A block becomes findable only once a step has computed its KV (`publish`): a chunked
prompt allocates all its blocks up front, and a request admitted meanwhile must not hit
one whose KV is not there yet. Freed blocks keep their key until reallocated.
"""

from __future__ import annotations

import hashlib
import time
from collections import deque

from metrale.engine.sequence import Sequence


def block_key(prev: bytes, uid: int, tokens: list[int]) -> bytes:
    h = hashlib.blake2b(prev, digest_size=16)
    h.update(uid.to_bytes(8, "little", signed=True))
    h.update(b"".join(t.to_bytes(4, "little") for t in tokens))
    return h.digest()


class BlockManager:
    def __init__(self, num_blocks: int, block_size: int, prefix_caching: bool = True) -> None:
        self.block_size = block_size
        self.prefix_caching = prefix_caching
        self.ref = [0] * num_blocks
        self.key: list[bytes | None] = [None] * num_blocks
        self.free: deque[int] = deque(range(num_blocks))  # front = next to reuse
        self.by_key: dict[bytes, int] = {}
        self.num_blocks = num_blocks
        self.hits = 0  # prefix-cache hits, in blocks
        # per block: when its current contents were allocated and last read (monotonic);
        # residency: (kind, seconds) observations since the last take_residency()
        self._born = [0.0] * num_blocks
        self._read = [0.0] * num_blocks
        self.residency: list[tuple[str, float]] = []

    @property
    def num_free(self) -> int:
        return len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def can_allocate(self, seq: Sequence) -> bool:
        return self.num_free >= self.blocks_needed(len(seq))

    def allocate(self, seq: Sequence) -> None:
        """Blocks for every token of seq, reusing cached full blocks of its prefix. The
        block holding the last token is always computed: its prefill samples a token."""
        assert not seq.block_table
        tokens, bs = seq.token_ids, self.block_size
        full = len(tokens) // bs if self.prefix_caching else 0
        cacheable = (len(tokens) - 1) // bs if self.prefix_caching else 0
        if seq.params.prompt_logprobs is not None:
            cacheable = 0  # every prompt position's logits are wanted: none may be skipped
        prev, hitting = b"", True
        for i in range(self.blocks_needed(len(tokens))):
            key = block_key(prev, seq.adapter_uid, tokens[i * bs:(i + 1) * bs]) if i < full else None
            prev = key
            block = None
            if hitting and i < cacheable:
                block = self.by_key.get(key)
            if block is None:
                hitting = False
                block = self._take()
            else:
                self.hits += 1
                now = time.monotonic()
                self.residency.append(("reuse_gap", now - self._read[block]))
                self._read[block] = now
                seq.num_cached_tokens += bs
                seq.num_published += 1
                if self.ref[block] == 0:
                    self.free.remove(block)
            self.ref[block] += 1
            seq.block_table.append(block)
            seq.block_keys.append(key)

    def free_seq(self, seq: Sequence) -> None:
        now = time.monotonic()
        for block in reversed(seq.block_table):
            self.ref[block] -= 1
            self._read[block] = now
            if self.ref[block] == 0:
                self.free.append(block)
        seq.block_table = []
        seq.block_keys = []
        seq.num_cached_tokens = 0
        seq.num_published = 0

    def publish(self, seq: Sequence) -> None:
        """Make seq's full blocks whose KV is computed (or queued) and whose tokens are on
        the host findable. A block that decoding filled gets its key here: its last token
        may have been pending when its KV was scheduled."""
        if not self.prefix_caching:
            return
        bs = self.block_size
        done = min(seq.num_computed, seq.known_len) // bs
        for i in range(seq.num_published, min(done, len(seq.block_keys))):
            key = seq.block_keys[i]
            if key is None:
                prev = seq.block_keys[i - 1] if i > 0 else b""
                if prev is None:
                    break  # a chain is only as findable as its first unkeyed block
                key = seq.block_keys[i] = block_key(prev, seq.adapter_uid, seq.tokens(i * bs, (i + 1) * bs))
            self.key[seq.block_table[i]] = key
            self.by_key.setdefault(key, seq.block_table[i])
            seq.num_published = i + 1

    def can_append(self, seq: Sequence) -> bool:
        """Room for the KV of seq's newest token (its last token)."""
        return len(seq.block_table) * self.block_size >= len(seq) or self.num_free > 0

    def append(self, seq: Sequence) -> None:
        """A block for seq's newest token if it needs one (a decode step)."""
        if len(seq.block_table) * self.block_size < len(seq):
            block = self._take()
            self.ref[block] = 1
            seq.block_table.append(block)
            seq.block_keys.append(None)

    def reset_prefix_cache(self) -> int:
        """Forget the contents of every cached block no sequence holds; returns how many
        (held blocks keep their keys: a request sharing their prefix may still hit them)."""
        dropped = 0
        for block in self.free:
            key = self.key[block]
            if key is None:
                continue
            if self.by_key.get(key) == block:
                del self.by_key[key]
            self.key[block] = None
            dropped += 1
        return dropped

    def take_residency(self) -> list[tuple[str, float]]:
        """KV-block residency observations (vLLM's kv_block_* histograms), cleared:
        "lifetime" (allocated to evicted), "idle" (last read to evicted), "reuse_gap"
        (between two reads of a cached block by different requests)."""
        out, self.residency = self.residency, []
        return out

    def _take(self) -> int:
        block = self.free.popleft()
        now = time.monotonic()
        if self._born[block]:  # its old contents are evicted now
            self.residency += [("lifetime", now - self._born[block]),
                               ("idle", now - self._read[block])]
        self._born[block] = self._read[block] = now
        old = self.key[block]
        if old is not None and self.by_key.get(old) == block:
            del self.by_key[old]
        self.key[block] = None
        return block
