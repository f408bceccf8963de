"""KV cache block bookkeeping: free list, ref counts, block tables and prefix caching.

Pure Python, no torch: the tensors live in the model runner; this module only decides which
block ids each request owns.

Prefix caching (as in vLLM v1): a block that is full of known tokens gets a hash of
(parent block's hash, its token ids, and the request's cache salt for the first block).
Hashes map to blocks; a new request whose leading full blocks hash the same reuses them (ref
count + 1) and skips their prefill. A block whose ref count drops to zero goes to the free
queue but keeps its hash, so it can still be hit until the allocator reuses it: the free
queue is in LRU order, with never-cached blocks in front so that they are reused first.

Sliding windows: a block whose tokens have all left the window of every query still to come is
given back at once (``free_out_of_window``), so a long request holds about its window, not its
length. Its place in the request's table keeps a placeholder (``WINDOWED_OUT``, block id 0)
that no kernel reads: each walks a windowed layer's keys from the window's first, and the
torch backend masks what it gathers. A model that mixes global and sliding layers (Gemma 2)
has a table per layer group (engine/kv_groups.py, vLLM's hybrid KV cache manager): all of one
pool's blocks, of equal lengths, the sliding groups' giving back what their window passed, the
global groups' keeping every block. A prefix hit is then the longest run of leading blocks
cached in every global group whose last window's worth is cached in every sliding group.

The hash is SHA-256 of a canonical encoding, not Python's ``hash()``: integers hash to
themselves there, so a crafted prompt could collide with another tenant's blocks and read
their KV (the class of vLLM's CVE-2025-25183). Requests with different ``cache_salt`` never
share a block, since the salt enters the first block's hash and every later hash chains it.
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from types import MappingProxyType

import attrs

from engine.sched.request import Request

# The parent of a request's first block: a fixed value, so equal prompts (and salts) hit.
_ROOT_HASH = hashlib.sha256(b"trio-llm-engine prefix cache v1").digest()


def block_hash(parent: bytes | None, token_ids: Sequence[int], cache_salt: str | None = None) -> bytes:
    """SHA-256 of (parent hash, salt, token ids), each in a fixed-width or length-prefixed form,
    so that no two different inputs share an encoding."""
    if parent is None:  # a first block: the fixed root, then the salt (length-prefixed)
        salt = b"" if cache_salt is None else cache_salt.encode("utf-8", "surrogatepass")
        head = _ROOT_HASH + struct.pack("<I", len(salt)) + salt
    else:
        head = parent
    return hashlib.sha256(head + struct.pack(f"<{len(token_ids)}i", *token_ids)).digest()


@attrs.define(eq=False)
class KVBlock:
    block_id: int
    ref_count: int = 0
    block_hash: bytes | None = None  # set while the block is registered in the prefix cache
    group: int = 0  # the layer group whose prefix cache holds it (while it has a hash)


# The table entry of a block given back out of the window (never owned, never free).
WINDOWED_OUT = KVBlock(0, ref_count=-1)


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


class BlockManager:
    """Allocates KV blocks to requests: per request a table per layer group (``windows``: each
    group's sliding window or None; one group, global, by default), all of equal lengths.

    Invariants (checked by ``check_invariants`` in tests): every block is either owned by at
    least one request (ref_count == number of owners) or in the free queue with ref_count 0,
    never both; a hash maps to exactly one block of a group and that block carries the hash.
    """

    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True,
                 windows: Sequence[int | None] = (None,)) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.windows = tuple(windows)
        sliding = {w for w in self.windows if w is not None}
        if len(sliding) > 1:
            raise ValueError(f"the sliding groups' windows differ: {sorted(sliding)}")
        # The sliding groups' window (None: none is sliding).
        self.sliding_window = sliding.pop() if sliding else None
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Free blocks, reused from the front: never-cached ones first, then least recently freed.
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._cached: list[dict[bytes, KVBlock]] = [{} for _ in self.windows]  # per group
        self._owned: dict[str, list[list[KVBlock]]] = {}
        # Request id -> its tables (one per group) of blocks in order: a read-only view of the
        # manager's own lists (not copied out request by request each step; do not modify them).
        # While a request holds blocks its tables only grow; once they are freed (finish,
        # abort, preemption) a later allocation starts new ones. So a reader that remembers how
        # much of them it has seen can pick up just the new blocks (``new_block_ids``).
        self.tables: Mapping[str, list[list[KVBlock]]] = MappingProxyType(self._owned)
        self.prefix_cache_queries = 0  # tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # of those, tokens found

    # ---- queries ----

    @property
    def num_groups(self) -> int:
        return len(self.windows)

    @property
    def num_free_blocks(self) -> int:
        return len(self._free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self._free)

    @property
    def usage(self) -> float:
        """Fraction of blocks owned by requests (cached-but-free blocks count as free)."""
        return self.num_used_blocks / self.num_blocks

    def block_ids(self, request_id: str, group: int = 0) -> list[int]:
        tables = self._owned.get(request_id)
        return [b.block_id for b in tables[group]] if tables else []

    def new_block_ids(self, request_id: str, have: int) -> tuple[int, ...]:
        """The block ids of ``request_id``'s tables from place ``have`` on, group after group
        (the runner splits them in as many equal parts as there are groups)."""
        tables = self._owned[request_id]
        if len(tables) == 1:
            return tuple([b.block_id for b in tables[0][have:]])
        return tuple([b.block_id for table in tables for b in table[have:]])

    # ---- prefix cache ----

    def find_cached_prefix(self, request: Request) -> list[tuple[KVBlock, ...]]:
        """The longest run of leading full blocks of ``request`` already in the cache: per block,
        each group's. A sliding group's block that the window of the first token after the run
        has passed need not be cached (it is ``WINDOWED_OUT`` then, and is never taken).

        At least the last token is always left to compute, since its logits are needed.
        """
        if not self.enable_prefix_caching:
            return []
        self._update_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hashes = request.block_hashes[:max_blocks]
        found: list[list[KVBlock | None]] = []
        n = max_blocks
        for window, cached in zip(self.windows, self._cached):
            blocks = []
            for block_hash in hashes[:n] if window is None else hashes:
                block = cached.get(block_hash)
                if block is None and window is None:
                    n = len(blocks)  # a global group needs every block
                    break
                blocks.append(block)
            found.append(blocks)
        if self.sliding_window is not None:
            n = self._windowed_hit(found, n)
        return [tuple(blocks[i] or WINDOWED_OUT for blocks in found) for i in range(n)]

    def _windowed_hit(self, found: list[list[KVBlock | None]], n: int) -> int:
        """The longest hit of at most ``n`` blocks whose blocks in the window of its next token
        every sliding group has."""
        last_miss = -1
        misses = []  # misses[m]: the last block before m missing in some sliding group
        for i in range(n):
            misses.append(last_miss)
            if any(found[g][i] is None for g, w in enumerate(self.windows) if w is not None):
                last_miss = i
        misses.append(last_miss)
        for m in range(n, 0, -1):
            if misses[m] < self._passed(m * self.block_size, m):
                return m
        return 0

    def _passed(self, num_done: int, most: int) -> int:
        """How many leading blocks (at most ``most``) the window of the query at ``num_done``
        has passed."""
        return min(most, max(0, (num_done - self.sliding_window + 1) // self.block_size))

    def record_prefix_lookup(self, num_queried_tokens: int, num_hit_tokens: int) -> None:
        self.prefix_cache_queries += num_queried_tokens
        self.prefix_cache_hits += num_hit_tokens

    def _update_hashes(self, request: Request) -> None:
        hashes = request.block_hashes
        bs = self.block_size
        salt = request.params.cache_salt
        for i in range(len(hashes), request.num_tokens // bs):
            parent = hashes[-1] if hashes else None
            hashes.append(block_hash(parent, request.token_ids[i * bs:(i + 1) * bs], salt))

    # ---- allocation ----

    def allocate(self, request: Request, num_new_tokens: int,
                 cached_prefix: Sequence[tuple[KVBlock, ...]] = ()) -> bool:
        """Give ``request`` blocks for ``num_new_tokens`` more tokens, after ``cached_prefix``.

        ``cached_prefix`` (from ``find_cached_prefix``, only for a request that owns nothing
        yet) is taken over first, but for a sliding group's leading blocks that the first new
        token's window has passed: those stay in the cache, untaken, and their places hold
        ``WINDOWED_OUT``. Returns False, changing nothing, if the free blocks do not suffice.
        Blocks that become full of known tokens are registered in the prefix cache at once, so
        a request admitted later in the same step can already hit them (their K/V is written,
        layer by layer, before anyone attends to it).
        """
        tables = self._owned.get(request.request_id)
        if tables is None:  # (not setdefault: that builds lists per call, and most calls own blocks)
            tables = self._owned[request.request_id] = [[] for _ in self.windows]
        owned = tables[0]
        num_done = request.num_computed_tokens + len(cached_prefix) * self.block_size
        num_tokens = num_done + num_new_tokens
        bs = self.block_size
        if num_tokens <= len(owned) * bs and num_tokens // bs == num_done // bs:
            return True  # the common decode step: room in the last block, and it did not fill up
        num_needed = max(cdiv(num_tokens, self.block_size) - len(owned) - len(cached_prefix), 0)
        passed = 0  # leading hits out of the sliding groups' window from the first new token on
        if cached_prefix and self.sliding_window is not None:
            passed = self._passed(num_done, len(cached_prefix))
        taken = [(g, i) for g, window in enumerate(self.windows) for i in range(0 if window is None else passed,
                                                                               len(cached_prefix))]
        num_revived = sum(1 for g, i in taken if cached_prefix[i][g].ref_count == 0)
        if num_needed * len(tables) > self.num_free_blocks - num_revived:
            if not owned:
                del self._owned[request.request_id]
            return False
        if passed:
            request.num_windowed_out = passed
        for g, table in enumerate(tables):  # every group's hits first: a free one is not to be popped
            if self.windows[g] is None or not passed:
                table.extend(self._take(entry[g]) for entry in cached_prefix)
            else:
                table.extend([WINDOWED_OUT] * passed)
                table.extend(self._take(entry[g]) for entry in cached_prefix[passed:])
        for table in tables:
            for _ in range(num_needed):
                table.append(self._pop_free())
        if self.enable_prefix_caching and num_tokens // self.block_size > num_done // self.block_size:
            self._cache_full_blocks(request, tables, num_done // self.block_size, num_tokens // self.block_size)
        return True

    def cache_computed_blocks(self, request: Request, start: int) -> None:
        """Register in the prefix cache the blocks that the tokens computed from position
        ``start`` on filled, once those tokens are known: a step that computed proposed tokens
        (speculative decoding) allocated their blocks before they were known."""
        tables = self._owned.get(request.request_id)
        first, end = start // self.block_size, request.num_computed_tokens // self.block_size
        if self.enable_prefix_caching and tables and end > first:
            self._cache_full_blocks(request, tables, first, end)

    def forget_uncomputed(self, request: Request) -> None:
        """Take out of the prefix cache the blocks of ``request`` that ``allocate`` registered
        for tokens not computed yet (a block is registered when a scheduled chunk fills it, before
        the step writes its KV): for a request preempted before its step ran."""
        for table, cached in zip(self._owned.get(request.request_id, ()), self._cached):
            for block in table[request.num_computed_tokens // self.block_size:]:
                if block.block_hash is not None and cached.get(block.block_hash) is block and block.ref_count == 1:
                    del cached[block.block_hash]
                    block.block_hash = None

    def free(self, request: Request) -> None:
        """Release every block ``request`` owns; idempotent. Tail places are freed first, and
        at a place the sliding groups' blocks before the global ones', so that a shared prefix
        outlives the request's private suffix in the LRU order (a hit needs the global blocks)."""
        tables = self._owned.pop(request.request_id, None)
        if tables:
            for i in range(len(tables[0]) - 1, -1, -1):
                for table in reversed(tables):  # (groups are listed global first)
                    if table[i] is not WINDOWED_OUT:
                        self._release(table[i])
        request.num_windowed_out = 0

    def free_out_of_window(self, request: Request) -> None:
        """Give back the leading blocks of ``request``'s sliding groups that no query from its
        next token on can see: a query at position p sees keys p - window < k <= p, and the next
        is at ``num_computed_tokens``. A no-op where no group is sliding."""
        window = self.sliding_window
        if window is None:
            return
        end = (request.num_computed_tokens - window + 1) // self.block_size  # blocks wholly before it
        if end <= request.num_windowed_out:
            return
        for g, table in enumerate(self._owned[request.request_id]):
            if self.windows[g] is not None:
                for i in range(request.num_windowed_out, end):
                    self._release(table[i])
                    table[i] = WINDOWED_OUT
        request.num_windowed_out = end

    def _release(self, block: KVBlock) -> None:
        block.ref_count -= 1
        if block.ref_count == 0:
            self._free[block.block_id] = None
            if block.block_hash is None:
                self._free.move_to_end(block.block_id, last=False)

    def reset_prefix_cache(self) -> None:
        """Forget every cached hash (blocks in use keep their contents)."""
        for cached in self._cached:
            for block in cached.values():
                block.block_hash = None
            cached.clear()

    def _pop_free(self) -> KVBlock:
        block_id, _ = self._free.popitem(last=False)
        block = self.blocks[block_id]
        if block.block_hash is not None:  # evict it from the prefix cache
            del self._cached[block.group][block.block_hash]
            block.block_hash = None
        block.ref_count = 1
        return block

    def _take(self, block: KVBlock) -> KVBlock:
        if block.ref_count == 0:
            del self._free[block.block_id]
        block.ref_count += 1
        return block

    def _cache_full_blocks(self, request: Request, tables: list[list[KVBlock]], first: int, end: int) -> None:
        """Register blocks ``first:end`` (just filled) of each group in its prefix cache."""
        self._update_hashes(request)
        hashes = request.block_hashes
        for g, (table, cached) in enumerate(zip(tables, self._cached)):
            for i in range(first, min(end, len(hashes))):
                block, block_hash = table[i], hashes[i]
                if block.block_hash is None and block is not WINDOWED_OUT and block_hash not in cached:
                    block.block_hash, block.group = block_hash, g
                    cached[block_hash] = block

    # ---- testing aid ----

    def check_invariants(self, live_requests: Sequence[Request] = ()) -> None:
        """Raise AssertionError if the bookkeeping is inconsistent (used by tests)."""
        owners: dict[int, int] = {}
        group_of: dict[int, int] = {}
        for tables in self._owned.values():
            assert len(tables) == self.num_groups and len({len(t) for t in tables}) == 1, "tables of unequal lengths"
            blocks = [(g, b) for g, table in enumerate(tables) for b in table if b is not WINDOWED_OUT]
            assert len({b.block_id for _, b in blocks}) == len(blocks), "a request owns a block twice"
            for g, b in blocks:
                owners[b.block_id] = owners.get(b.block_id, 0) + 1
                assert group_of.setdefault(b.block_id, g) == g, f"block {b.block_id} is in two groups' tables"
        for block in self.blocks:
            assert block.ref_count == owners.get(block.block_id, 0), f"block {block.block_id} ref count is off"
            assert (block.ref_count == 0) == (block.block_id in self._free), f"block {block.block_id} free state is off"
        for g, cached in enumerate(self._cached):
            for block_hash, block in cached.items():
                assert block.block_hash == block_hash and block.group == g, "cache maps a hash to a block without it"
        live_ids = {r.request_id for r in live_requests}
        assert set(self._owned) <= live_ids, f"blocks owned by gone requests: {set(self._owned) - live_ids}"
