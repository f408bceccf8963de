"""The model runner's persistent block tables against the plain tables they stand for."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.kv_cache import KVBlock
from engine.model_runner import BlockTables

REQUESTS = [f"r{i}" for i in range(12)]

# One step: for some requests, blocks appended to their live list (or a fresh list, as after
# a preemption), the ones released (finished), and which requests are scheduled.
step = st.fixed_dictionaries({
    "grow": st.dictionaries(st.sampled_from(REQUESTS), st.integers(0, 40), max_size=6),
    "fresh": st.sets(st.sampled_from(REQUESTS), max_size=3),
    "release": st.sets(st.sampled_from(REQUESTS), max_size=3),
    "scheduled": st.sets(st.sampled_from(REQUESTS), min_size=1, max_size=12),
})


@settings(max_examples=200, deadline=None)
@given(st.lists(step, min_size=1, max_size=25), st.randoms(use_true_random=False))
def test_gathered_tables_equal_the_block_lists(steps, rng):
    tables = BlockTables()
    lists: dict[str, list[KVBlock]] = {}
    for s in steps:
        tables.release(s["release"])
        for request_id in s["release"] | s["fresh"]:
            lists[request_id] = []  # freed: a later allocation starts a new list
        for request_id, n in s["grow"].items():
            lists.setdefault(request_id, []).extend(KVBlock(rng.randrange(1, 10_000)) for _ in range(n))
        scheduled = [r for r in REQUESTS if r in s["scheduled"] and lists.get(r)]
        rng.shuffle(scheduled)
        if not scheduled:
            continue
        got = tables.gather(scheduled, [lists[r] for r in scheduled])
        width = max(len(lists[r]) for r in scheduled)
        want = np.zeros((len(scheduled), width), dtype=np.int32)
        for i, r in enumerate(scheduled):
            want[i, :len(lists[r])] = [b.block_id for b in lists[r]]
        np.testing.assert_array_equal(got, want)


def test_gathered_array_is_a_copy():
    tables = BlockTables()
    blocks = [KVBlock(3), KVBlock(5)]
    first = tables.gather(["a"], [blocks])
    blocks.append(KVBlock(9))
    tables.gather(["a"], [blocks])
    assert first.tolist() == [[3, 5]]  # last step's tensor is not changed under the kernels
