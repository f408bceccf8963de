"""The model runner's persistent block tables against the plain tables they stand for."""

from __future__ import annotations

import numpy as np
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.runner.model_runner import BlockTables

REQUESTS = [f"r{i}" for i in range(12)]

# One step: the requests released (finished or preempted: a later table starts afresh), block
# ids appended to some tables, and which requests are scheduled.
step = st.fixed_dictionaries({
    "grow": st.dictionaries(st.sampled_from(REQUESTS), st.integers(0, 40), max_size=6),
    "release": st.sets(st.sampled_from(REQUESTS), max_size=3),
    "scheduled": st.sets(st.sampled_from(REQUESTS), min_size=1, max_size=12),
})


@settings(max_examples=200, deadline=None)
@given(st.lists(step, min_size=1, max_size=25), st.randoms(use_true_random=False))
def test_gathered_tables_equal_the_block_lists(steps, rng):
    tables = BlockTables()
    lists: dict[str, list[int]] = {}
    for s in steps:
        tables.release(s["release"])
        for request_id in s["release"]:
            lists.pop(request_id, None)
        for request_id, n in s["grow"].items():
            new = [rng.randrange(1, 10_000) for _ in range(n)]
            lists.setdefault(request_id, []).extend(new)
            tables.extend(request_id, new)
        scheduled = [r for r in REQUESTS if r in s["scheduled"] and lists.get(r)]
        rng.shuffle(scheduled)
        if not scheduled:
            continue
        got = tables.gather(scheduled)
        width = max(len(lists[r]) for r in scheduled)
        want = np.zeros((len(scheduled), width), dtype=np.int32)
        for i, r in enumerate(scheduled):
            want[i, :len(lists[r])] = lists[r]
        np.testing.assert_array_equal(got, want)


def test_gathered_array_is_a_copy():
    tables = BlockTables()
    tables.extend("a", [3, 5])
    first = tables.gather(["a"])
    tables.extend("a", [9])
    tables.gather(["a"])
    assert first.tolist() == [[3, 5]]  # last step's tensor is not changed under the kernels
