"""The step plan is the runner's only input: a runner driven by plans written by hand computes
what the model computes, and every plan an engine makes survives the wire codec unchanged."""

from __future__ import annotations

import numpy as np
import pytest

from backends import get_backend
from engine.plan import NewRequest, RunnerOutput, StepPlan
from engine.runner.model_runner import ModelRunner
from engine.sampling_params import SamplingParams
from engine.transport.wire import Codec
from tests.conftest import tiny_engine_core

CODEC = Codec([StepPlan, RunnerOutput])
# Greedy with the top-5 logprobs: the tiny model's argmax often repeats its last input token
# whatever came before, but its distribution depends on every token in the KV cache.
GREEDY = SamplingParams(temperature=0, max_tokens=64, logprobs=5)


def runner(model, num_blocks: int = 32, block_size: int = 4) -> ModelRunner:
    return ModelRunner(model, get_backend("torch", "cpu"), num_blocks, block_size, "cpu", seed=0)


def from_scratch(model, tokens: list[int]):
    """The next token's logprobs after ``tokens``, computed by a fresh runner in one prefill."""
    fresh = runner(model)
    blocks = tuple(range(-(-len(tokens) // 4)))
    plan = StepPlan(("x",), (0,), (len(tokens),), tuple(tokens), (0,),
                    new_requests=(NewRequest("x", tuple(tokens), len(tokens), GREEDY, None),),
                    new_block_ids=(("x", blocks),))
    return fresh.execute(plan).logprobs["x"]


def assert_same_distribution(got, want) -> None:
    assert got.token_id == want.token_id and got.top_ids == want.top_ids
    assert got.top_logprobs == pytest.approx(want.top_logprobs, abs=1e-4)


def check(model, out: RunnerOutput, request_id: str, tokens: list[int]) -> None:
    """``out``'s token for ``request_id`` is the greedy one after ``tokens``, with the same logprobs."""
    assert_same_distribution(out.logprobs[request_id], from_scratch(model, tokens))
    assert out.sampled[request_id] == out.logprobs[request_id].token_id


def test_a_runner_driven_by_hand_written_plans_computes_what_the_model_does(tiny_model):
    """Two requests, one prompt cut in two chunks, scattered block ids that grow as they decode,
    then one finished: no scheduler anywhere, and each step's distribution equals a from-scratch
    prefill's."""
    r = runner(tiny_model)
    a, b = [5, 6, 7, 8, 9, 10], [11, 12, 13]
    new = (NewRequest("a", tuple(a), len(a), GREEDY, None), NewRequest("b", tuple(b), len(b), GREEDY, None))
    # Step 1: a's first 4 prompt tokens (no sample), all of b's (samples).
    out = r.execute(StepPlan(("a", "b"), (0, 0), (4, 3), (*a[:4], *b), (1,), new_requests=new,
                             new_block_ids=(("a", (17, 3)), ("b", (9,)))))
    assert set(out.sampled) == {"b"}
    check(tiny_model, out, "b", b)
    b.append(out.sampled["b"])
    # Step 2: the rest of a's prompt and b's first decode (b's table grows: position 4 is in block 2).
    out = r.execute(StepPlan(("a", "b"), (4, 3), (2, 1), (*a[4:], b[3]), (0, 1), new_block_ids=(("b", (30,)),)))
    check(tiny_model, out, "a", a)
    check(tiny_model, out, "b", b)
    a.append(out.sampled["a"])
    b.append(out.sampled["b"])
    blocks = {"a": [17, 3], "b": [9, 30]}
    spare = iter([1, 2, 4, 6, 8, 10, 12, 14])
    for _ in range(6):  # decode both, a block more whenever a table is full
        rows = ("a", "b")
        seqs = {"a": a, "b": b}
        grown = []
        for rid in rows:
            if len(seqs[rid]) > 4 * len(blocks[rid]):
                blocks[rid].append(next(spare))
                grown.append((rid, (blocks[rid][-1],)))
        plan = StepPlan(rows, (len(a) - 1, len(b) - 1), (1, 1), (a[-1], b[-1]), (0, 1), new_block_ids=tuple(grown))
        out = r.execute(plan)
        for rid in rows:
            check(tiny_model, out, rid, seqs[rid])
            seqs[rid].append(out.sampled[rid])
    # a finishes; b goes on alone, and a's state is gone.
    out = r.execute(StepPlan(("b",), (len(b) - 1,), (1,), (b[-1],), (0,), finished_ids=("a",)))
    check(tiny_model, out, "b", b)
    assert set(r.requests) == {"b"}


def test_a_wrong_block_table_in_the_plan_gives_another_distribution(tiny_model):
    """The check above can fail: the same decode step reading its first block from a block that
    holds another prompt's K/V computes something else."""
    def decode(first_block: int):
        r = runner(tiny_model)
        new = (NewRequest("a", (5, 6, 7, 8, 9), 5, GREEDY, None), NewRequest("b", (20, 21, 22, 23), 4, GREEDY, None))
        r.execute(StepPlan(("a", "b"), (0, 0), (5, 4), (5, 6, 7, 8, 9, 20, 21, 22, 23), (), new_requests=new,
                           new_block_ids=(("a", (0, 1)), ("b", (2,)))))
        c = NewRequest("c", (5, 6, 7, 8, 9), 5, GREEDY, None)  # a's prompt again, its first block chosen here
        r.execute(StepPlan(("c",), (4,), (1,), (9,), (), new_requests=(c,), new_block_ids=(("c", (first_block, 1)),)))
        return r.execute(StepPlan(("c",), (5,), (1,), (9,), (0,), new_block_ids=(("c", (3,)),))).logprobs["c"]

    right, wrong = decode(0), decode(2)  # block 0 holds a's first 4 tokens; block 2 holds b's
    assert_same_distribution(right, from_scratch(tiny_model, [5, 6, 7, 8, 9, 9]))
    assert right.top_logprobs != pytest.approx(wrong.top_logprobs, abs=1e-4)


def test_a_grammar_bitmask_in_the_plan_masks_that_row_only(tiny_model):
    r = runner(tiny_model)
    vocab = tiny_model.config.vocab_size
    words = np.zeros((1, vocab // 32), dtype=np.int32)
    words[0, 1] = 1 << 3  # only token 35 allowed
    new = tuple(NewRequest(i, (5, 6, 7), 3, GREEDY, None) for i in ("free", "masked"))
    plan = StepPlan(("free", "masked"), (0, 0), (3, 3), (5, 6, 7, 5, 6, 7), (0, 1), new_requests=new,
                    new_block_ids=(("free", (0,)), ("masked", (1,))), grammar_rows=(1,),
                    grammar_bitmask=words.tobytes())
    out = r.execute(plan)
    assert out.sampled["masked"] == 35
    assert out.sampled["free"] == from_scratch(tiny_model, [5, 6, 7]).token_id != 35
    assert out.logprobs["free"].top_ids[0] != 35


def test_every_plan_of_an_engine_run_round_trips_the_wire_codec(tiny_model):
    """Chunked prefill, preemption (a KV cache too small for all), n > 1 with seeds, logprobs and
    prompt logprobs: each plan encodes, decodes equal, and the runner is given the decoded copy,
    so the run's outputs come from values that crossed the wire."""
    def run(through_wire: bool) -> list:
        core = tiny_engine_core(tiny_model, num_kv_blocks=12, block_size=4, max_num_batched_tokens=16, max_model_len=40,
                                max_num_seqs=4)
        real = core.runner.execute
        plans = []

        def execute(plan):
            # What the scheduler's decode fast path relies on: a running request owns exactly the
            # blocks the runner has been sent.
            for r in core.scheduler.running:
                assert r.num_runner_blocks == len(core.block_manager.tables[r.request_id][0])
            if through_wire:
                decoded = CODEC.decode(CODEC.encode(plan))
                assert decoded == plan and type(decoded) is StepPlan
                plan = decoded
            plans.append(plan)
            result = real(plan)
            if through_wire and not result.failed:
                assert CODEC.decode(CODEC.encode(result)) == result
            return result

        core.runner.execute = execute
        prompts = [[3 + i, 40, 41, 42, 43, 44, 45, 46, 47 + i][: 5 + i] for i in range(4)]
        core.add_request("n2", prompts[0], SamplingParams(n=2, temperature=1.0, seed=7, max_tokens=10,
                                                          ignore_eos=True))
        core.add_request("lp", prompts[1], SamplingParams(temperature=0, logprobs=2, prompt_logprobs=1,
                                                          max_tokens=10, ignore_eos=True))
        core.add_request("pen", prompts[2], SamplingParams(temperature=0, frequency_penalty=1.0, max_tokens=10,
                                                           ignore_eos=True))
        core.add_request("long", prompts[3] * 3, SamplingParams(temperature=0, max_tokens=12, ignore_eos=True))
        deltas = []
        while core.has_unfinished_requests:
            deltas += core.step()
        assert core.scheduler.num_preemptions > 0  # the small cache made the plans carry preemptions
        preempted, resumed = set(), set()
        for p in plans:
            resumed |= preempted & {n.request_id for n in p.new_requests}
            preempted |= set(p.preempted_ids)
        assert resumed, "a preempted request came back as a NewRequest"
        core.step()  # an empty plan, naming the last finished requests
        assert core.runner.requests == {}  # every request's runner state was dropped
        return [(d.request_id, d.index, d.new_token_ids, d.new_logprobs, d.new_prompt_logprobs) for d in deltas]

    assert run(through_wire=True) == run(through_wire=False)


def test_a_plan_is_frozen():
    plan = StepPlan(("a",), (0,), (1,), (5,), (0,))
    with pytest.raises(AttributeError):
        plan.token_ids = (6,)
