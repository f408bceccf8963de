"""BlockManager: allocation, ref counts, prefix caching and LRU reuse; a hypothesis state machine
checks that no block is leaked or owned twice under random allocate/free sequences."""

from __future__ import annotations

import hypothesis.strategies as st
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from engine.sampling_params import SamplingParams
from engine.sched.kv_cache import WINDOWED_OUT, BlockManager, block_hash
from engine.sched.request import Request

PARAMS = SamplingParams(max_tokens=8)


def make_request(request_id: str, tokens: list[int]) -> Request:
    return Request(request_id, tokens, PARAMS, max_tokens=8, eos_token_id=None, arrival_order=0)


def test_allocate_rounds_up_to_blocks_and_free_returns_them():
    kv = BlockManager(num_blocks=8, block_size=4)
    request = make_request("a", list(range(10)))
    assert kv.allocate(request, 10)
    assert len(kv.block_ids("a")) == 3
    assert kv.num_free_blocks == 5
    kv.free(request)
    kv.free(request)  # idempotent
    assert kv.num_free_blocks == 8
    kv.check_invariants()


def test_blocks_every_window_has_passed_go_back_and_the_rest_stay():
    kv = BlockManager(num_blocks=8, block_size=4, windows=(6,))
    request = make_request("a", list(range(30)))
    assert kv.allocate(request, 16)  # positions 0-15: blocks 0-3
    request.num_computed_tokens = 16  # the next query, at 16, sees keys 11-16: blocks 2 on
    kv.free_out_of_window(request)
    assert request.num_windowed_out == 2 and kv.num_free_blocks == 6
    assert kv.block_ids("a")[:2] == [0, 0]  # placeholders that no kernel reads
    kv.free_out_of_window(request)  # nothing more to give back yet
    assert kv.num_free_blocks == 6
    kv.check_invariants([request])
    assert kv.allocate(request, 8)  # 16-23 in two new blocks, table places 4 and 5
    assert len(kv.block_ids("a")) == 6
    request.num_computed_tokens = 24
    kv.free_out_of_window(request)  # keys 19 on: blocks 0-3 out
    assert request.num_windowed_out == 4 and kv.num_free_blocks == 6
    kv.check_invariants([request])
    kv.free(request)
    assert kv.num_free_blocks == 8 and request.num_windowed_out == 0
    kv.check_invariants()


def test_a_shared_prefix_block_out_of_one_window_stays_for_its_other_owner():
    kv = BlockManager(num_blocks=8, block_size=4, windows=(8,))
    first, second = make_request("a", list(range(12))), make_request("b", list(range(12)))
    assert kv.allocate(first, 12)
    hits = kv.find_cached_prefix(second)
    assert len(hits) == 2 and kv.allocate(second, 4, hits)  # b's first new token, at 8, sees both
    first.num_computed_tokens = 12
    kv.free_out_of_window(first)  # keys 5 on: block 0 leaves a's table, but b owns it
    assert kv.num_free_blocks == 4 and kv.block_ids("b")[:2] == [b.block_id for b, in hits]  # (4 in use before)
    assert [b.ref_count for b, in hits] == [1, 2]
    kv.check_invariants([first, second])


def test_prefix_hits_a_new_requests_window_has_passed_are_not_taken():
    kv = BlockManager(num_blocks=8, block_size=4, windows=(4,))
    first, second = make_request("a", list(range(12))), make_request("b", list(range(12)))
    assert kv.allocate(first, 12)
    kv.free(first)  # its full blocks stay cached
    hits = kv.find_cached_prefix(second)
    assert len(hits) == 2 and kv.allocate(second, 4, hits)  # its first new token, at 8, sees keys 5 on
    assert second.num_windowed_out == 1 and kv.block_ids("b") == [0, hits[1][0].block_id, kv.block_ids("b")[2]]
    assert hits[0][0].ref_count == 0 and hits[0][0].block_hash is not None  # still cached, still free
    assert kv.num_free_blocks == 6
    kv.check_invariants([second])
    kv.free(second)
    assert kv.num_free_blocks == 8
    kv.check_invariants()


def test_a_hybrid_models_sliding_group_gives_back_what_its_window_passed_and_its_global_group_keeps_all():
    """Layer groups (a global and a sliding one, as Gemma 2): a table each, of equal lengths,
    from one pool; only the sliding group's blocks out of the window go back."""
    kv = BlockManager(num_blocks=10, block_size=4, windows=(None, 6))
    request = make_request("a", list(range(30)))
    assert kv.allocate(request, 16)  # 4 places, a block of each group at each
    assert kv.num_free_blocks == 2 and kv.new_block_ids("a", 2) == (*kv.block_ids("a")[2:], *kv.block_ids("a", 1)[2:])
    request.num_computed_tokens = 16  # the next query, at 16, sees keys 11-16: places 2 on
    kv.free_out_of_window(request)
    assert kv.num_free_blocks == 4 and request.num_windowed_out == 2
    global_table, sliding_table = kv.tables["a"]
    assert WINDOWED_OUT not in global_table and sliding_table[:2] == [WINDOWED_OUT] * 2
    assert not kv.allocate(request, 12)  # 3 more places: 6 blocks, 4 free
    assert kv.allocate(request, 8) and kv.num_free_blocks == 0
    kv.check_invariants([request])
    kv.free(request)
    assert kv.num_free_blocks == 10
    kv.check_invariants()


def test_a_hybrid_prefix_hit_needs_the_global_blocks_and_only_the_windows_sliding_ones():
    """A sliding group's blocks before the window of the hit's next token may have left the
    cache: the hit still holds (they stay WINDOWED_OUT); the global group's are taken."""
    kv = BlockManager(num_blocks=12, block_size=4, windows=(None, 4))
    first = make_request("a", list(range(16)))
    assert kv.allocate(first, 16)
    first.num_computed_tokens = 16
    kv.free_out_of_window(first)  # sliding places 0-2 go back (still cached)
    other = make_request("b", list(range(100, 112)))
    assert kv.allocate(other, 12)  # takes the free blocks, evicting two of them
    kv.free(other)
    third = make_request("c", list(range(16)) + [99])
    hits = kv.find_cached_prefix(third)
    assert len(hits) == 4 and [g for g, _ in hits] == [kv.blocks[i] for i in kv.block_ids("a")]
    assert hits[0][1] is WINDOWED_OUT and hits[3][1].block_id == kv.block_ids("a", 1)[3]
    assert kv.allocate(third, 1, hits)
    assert kv.block_ids("c")[:4] == kv.block_ids("a") and kv.tables["c"][1][:3] == [WINDOWED_OUT] * 3
    assert third.num_windowed_out == 3
    kv.check_invariants([first, third])
    for request in (first, third):
        kv.free(request)
    kv.check_invariants()
    assert kv.num_free_blocks == 12


def test_a_freed_hybrid_request_leaves_its_global_prefix_to_be_evicted_last():
    """free() gives back tail places first and, at a place, the sliding block before the global
    one: a later request reuses those first, and the global head block (which any hit needs)
    stays cached the longest."""
    kv = BlockManager(num_blocks=6, block_size=2, windows=(None, 100))
    first = make_request("a", [1, 2, 3, 4, 5])
    assert kv.allocate(first, 5)
    head, sliding_head = kv.block_ids("a")[0], kv.block_ids("a", 1)[0]
    kv.free(first)
    assert list(kv._free)[-2:] == [sliding_head, head]  # (the end of the free list is evicted last)
    other = make_request("b", [9, 8, 7, 6])
    assert kv.allocate(other, 4)  # 4 of the 6 blocks: the never-cached ones, then the tail's
    assert head not in kv.block_ids("b") + kv.block_ids("b", 1)
    hits = kv.find_cached_prefix(make_request("c", [1, 2, 3]))
    assert len(hits) == 1 and hits[0][0].block_id == head
    kv.check_invariants([other])


def test_a_hybrid_hit_stops_where_the_sliding_group_lacks_a_block_its_window_sees():
    kv = BlockManager(num_blocks=12, block_size=4, windows=(None, 8))
    first = make_request("a", list(range(16)))
    assert kv.allocate(first, 16)
    evicted = kv.block_ids("a", 1)[2]  # place 2 of the sliding group: its hash leaves the cache
    kv._cached[1].pop(kv.blocks[evicted].block_hash)
    kv.blocks[evicted].block_hash = None
    # a hit of 4 places would need sliding places 2-3 (a query at 16 sees 9 on): it stops at 2
    assert len(kv.find_cached_prefix(make_request("b", list(range(16)) + [1]))) == 2


def test_without_a_model_wide_window_nothing_is_given_back():
    kv = BlockManager(num_blocks=8, block_size=4)
    request = make_request("a", list(range(30)))
    assert kv.allocate(request, 16)
    request.num_computed_tokens = 16
    kv.free_out_of_window(request)
    assert kv.num_free_blocks == 4


def test_blocks_registered_for_tokens_never_computed_leave_the_cache_on_preemption():
    """allocate registers a block its scheduled tokens fill before the step writes its KV; a
    request preempted before that step ran (forget_uncomputed) takes such blocks out of the
    cache, and keeps those its computed tokens filled."""
    kv = BlockManager(num_blocks=8, block_size=4)
    request = make_request("a", list(range(10)))
    assert kv.allocate(request, 10)  # scheduled: blocks 0 and 1 full of known tokens, registered at once
    request.num_computed_tokens = 6  # (as if the step that computed tokens 0..5 had run, and 6..9 were next)
    kv.forget_uncomputed(request)
    probe = make_request("b", list(range(12)))
    assert len(kv.find_cached_prefix(probe)) == 1  # block 0 (computed); not block 1 (tokens 6, 7 never were)
    kv.free(request)
    kv.check_invariants()


def test_allocation_that_does_not_fit_changes_nothing():
    kv = BlockManager(num_blocks=2, block_size=4)
    assert not kv.allocate(make_request("a", list(range(9))), 9)
    assert kv.num_free_blocks == 2 and kv.block_ids("a") == []
    kv.check_invariants()


def test_prefix_hit_shares_blocks_and_leaves_last_token_to_compute():
    kv = BlockManager(num_blocks=16, block_size=4)
    first = make_request("a", list(range(12)))
    assert kv.allocate(first, 12)
    second = make_request("b", list(range(12)))
    hits = kv.find_cached_prefix(second)
    assert len(hits) == 2  # 12 tokens = 3 full blocks, but the last token must be computed
    assert kv.allocate(second, 4, hits)
    assert kv.block_ids("b")[:2] == kv.block_ids("a")[:2]
    assert kv.block_ids("b")[2] != kv.block_ids("a")[2]
    assert kv.blocks[kv.block_ids("a")[0]].ref_count == 2
    kv.check_invariants([first, second])


def test_different_prefix_does_not_hit():
    kv = BlockManager(num_blocks=16, block_size=4)
    assert kv.allocate(make_request("a", [1, 2, 3, 4, 5, 6, 7, 8, 9]), 9)
    assert kv.find_cached_prefix(make_request("b", [1, 2, 3, 5, 5, 6, 7, 8, 9])) == []


def test_freed_cached_blocks_stay_hittable_until_reused_in_lru_order():
    kv = BlockManager(num_blocks=4, block_size=2)
    old = make_request("old", [1, 2, 3, 4, 5])
    assert kv.allocate(old, 5)
    assert kv.block_ids("old") == [0, 1, 2]  # blocks 0 and 1 are full (cached), block 2 is not
    kv.free(old)
    assert len(kv.find_cached_prefix(make_request("again", [1, 2, 3, 4, 5]))) == 2
    # Reuse order: never-cached blocks first (2, then the untouched 3), then cached ones tail
    # first (1 before 0), so a shared prefix outlives the suffix that hangs off it.
    first = make_request("first", [9, 9, 8])
    assert kv.allocate(first, 3) and kv.block_ids("first") == [2, 3]
    second = make_request("second", [7])
    assert kv.allocate(second, 1) and kv.block_ids("second") == [1]
    assert [b.block_id for b, in kv.find_cached_prefix(make_request("again2", [1, 2, 3, 4, 5]))] == [0]
    kv.check_invariants([first, second])


def test_disabled_prefix_caching_never_hits():
    kv = BlockManager(num_blocks=8, block_size=2, enable_prefix_caching=False)
    first = make_request("a", [1, 2, 3, 4, 5])
    assert kv.allocate(first, 5)
    assert kv.find_cached_prefix(make_request("b", [1, 2, 3, 4, 5])) == []


class BlockManagerMachine(RuleBasedStateMachine):
    """Random allocations (with prefix hits), growth and frees over a small cache."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = BlockManager(num_blocks=12, block_size=2)
        self.live: dict[str, Request] = {}
        self.counter = 0

    @rule(prefix=st.sampled_from([[1, 2, 3, 4], [1, 2, 5, 6], [7, 8]]), suffix=st.lists(st.integers(0, 3), max_size=5))
    def add(self, prefix, suffix):
        self.counter += 1
        request = make_request(f"r{self.counter}", prefix + suffix)
        hits = self.kv.find_cached_prefix(request)
        num_new = request.num_tokens - len(hits) * self.kv.block_size
        if self.kv.allocate(request, num_new, hits):
            request.num_computed_tokens = request.num_tokens
            self.live[request.request_id] = request

    @precondition(lambda self: self.live)
    @rule(data=st.data(), token=st.integers(0, 3))
    def grow(self, data, token):
        request = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        request.append_token(token)
        if self.kv.allocate(request, 1):
            request.num_computed_tokens += 1
        else:
            request.token_ids.pop()

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def free(self, data):
        request = self.live.pop(data.draw(st.sampled_from(sorted(self.live))))
        self.kv.free(request)

    @invariant()
    def consistent(self):
        self.kv.check_invariants(list(self.live.values()))
        needed = sum(-(-r.num_tokens // 2) for r in self.live.values())
        assert self.kv.num_used_blocks <= needed  # sharing can only lower it

    def teardown(self):
        for request in self.live.values():
            self.kv.free(request)
        assert self.kv.num_used_blocks == 0


TestBlockManagerMachine = BlockManagerMachine.TestCase
TestBlockManagerMachine.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)


class HybridBlockManagerMachine(BlockManagerMachine):
    """The same over a global and a sliding layer group (window 3), the window's blocks given back."""

    def __init__(self) -> None:
        super().__init__()
        self.kv = BlockManager(num_blocks=16, block_size=2, windows=(None, 3))

    @precondition(lambda self: self.live)
    @rule(data=st.data())
    def slide(self, data):
        request = self.live[data.draw(st.sampled_from(sorted(self.live)))]
        self.kv.free_out_of_window(request)
        # every block wholly before the window is given back (the invariant checks the other side)
        gone = max(0, request.num_computed_tokens - 3 + 1) // 2
        assert all(block is WINDOWED_OUT for block in self.kv.tables[request.request_id][1][:gone])

    @invariant()
    def consistent(self):
        self.kv.check_invariants(list(self.live.values()))
        assert self.kv.num_used_blocks <= sum(2 * -(-r.num_tokens // 2) for r in self.live.values())
        for r in self.live.values():  # the global table holds every block, the sliding one what its window sees
            global_table, sliding_table = self.kv.tables[r.request_id]
            first_seen = max(0, r.num_computed_tokens - 3 + 1) // 2
            assert WINDOWED_OUT not in global_table and WINDOWED_OUT not in sliding_table[first_seen:]


TestHybridBlockManagerMachine = HybridBlockManagerMachine.TestCase
TestHybridBlockManagerMachine.settings = settings(max_examples=100, stateful_step_count=40, deadline=None)


def test_block_hashes_are_sha256_of_a_canonical_encoding():
    root = block_hash(None, [1, 2, 3, 4])
    assert len(root) == 32 and root == block_hash(None, [1, 2, 3, 4])
    assert block_hash(root, [5, 6, 7, 8]) != block_hash(None, [5, 6, 7, 8])  # the parent counts
    assert block_hash(None, [1, 2, 3, 4], "a") != root  # the salt counts
    # Python's hash() of small ints is the int itself; nothing here lets crafted ids collide.
    assert block_hash(None, [0, 1]) != block_hash(None, [1, 0]) and block_hash(None, [-1]) != block_hash(None, [-2])


def test_requests_with_different_salts_never_share_blocks():
    kv = BlockManager(num_blocks=16, block_size=4)
    tokens = list(range(12))

    def salted(request_id: str, salt: str | None) -> Request:
        return Request(request_id, tokens, SamplingParams(max_tokens=8, cache_salt=salt), 8, None, 0)

    alice = salted("alice", "tenant-a")
    assert kv.allocate(alice, 12)
    assert kv.find_cached_prefix(salted("mallory", "tenant-b")) == []
    assert kv.find_cached_prefix(salted("anonymous", None)) == []
    assert len(kv.find_cached_prefix(salted("alice-again", "tenant-a"))) == 2
