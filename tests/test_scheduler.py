"""Scheduler: budgets, chunked prefill, preemption, policies, stop conditions; and a hypothesis
state machine checking that, under random add/step/abort sequences, no block is leaked or
owned twice and every request ends finished or aborted."""

from __future__ import annotations

import random

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from engine.config import EngineConfig
from engine.sampling_params import SamplingParams
from engine.sched.kv_cache import BlockManager
from engine.sched.request import Request, RequestStatus
from engine.sched.scheduler import PREFILL_RATE_MARGIN as MARGIN
from engine.sched.scheduler import Scheduler

EOS = 0


def make_scheduler(num_blocks=64, block_size=4, max_model_len=64, **fields) -> Scheduler:
    config = EngineConfig(**fields)
    return Scheduler(config, BlockManager(num_blocks, block_size, config.enable_prefix_caching), max_model_len)


def make_request(request_id: str, prompt_len: int, max_tokens: int = 4, arrival: int = 0, priority: int = 0,
                 **params) -> Request:
    prompt = [1 + (i % 7) + 10 * int(request_id.strip("r") or 0) for i in range(prompt_len)]
    return Request(request_id, prompt, SamplingParams(max_tokens=max_tokens, **params), max_tokens, EOS, arrival,
                   priority=priority)


def run_step(scheduler: Scheduler, token: int = 5):
    out = scheduler.schedule()
    sampled = {c.request.request_id: token for c in out.chunks if c.samples}
    return out, scheduler.update(out, sampled)


def test_running_requests_come_first_and_budget_is_respected():
    s = make_scheduler(max_num_batched_tokens=10, max_num_seqs=4)
    s.add_request(make_request("r1", 6))
    out, _ = run_step(s)
    assert [(c.request.request_id, c.num_new_tokens) for c in out.chunks] == [("r1", 6)]
    s.add_request(make_request("r2", 20, arrival=1))
    out, _ = run_step(s)
    assert [(c.request.request_id, c.num_new_tokens) for c in out.chunks] == [("r1", 1), ("r2", 9)]
    assert out.num_batched_tokens == 10


def test_chunked_prefill_samples_only_after_the_last_chunk():
    s = make_scheduler(max_num_batched_tokens=8)
    request = make_request("r1", 20)
    s.add_request(request)
    chunks = [run_step(s)[0].chunks[0] for _ in range(3)]
    assert [c.num_new_tokens for c in chunks] == [8, 8, 4]
    assert [c.samples for c in chunks] == [False, False, True]
    assert request.num_output_tokens == 1


def test_without_chunked_prefill_a_long_prompt_waits_for_a_full_budget():
    s = make_scheduler(max_num_batched_tokens=16, enable_chunked_prefill=False, max_num_seqs=4)
    s.add_request(make_request("r1", 4))
    s.add_request(make_request("r2", 14, arrival=1))
    out, _ = run_step(s)
    assert [c.request.request_id for c in out.chunks] == ["r1"]
    out, _ = run_step(s)
    assert [(c.request.request_id, c.num_new_tokens) for c in out.chunks] == [("r1", 1), ("r2", 14)]


def test_max_num_seqs_limits_the_batch():
    s = make_scheduler(max_num_seqs=2)
    for i in range(3):
        s.add_request(make_request(f"r{i}", 3, arrival=i))
    out, _ = run_step(s)
    assert len(out.chunks) == 2 and len(s.waiting) == 1


def test_preemption_frees_the_newest_and_requeues_it_first():
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=16, max_num_seqs=4)
    old, new = make_request("r1", 8, max_tokens=8), make_request("r2", 8, max_tokens=8, arrival=1)
    s.add_request(old)
    s.add_request(new)
    run_step(s)  # both admitted: 8 tokens in 2 full blocks each, plus a sampled 9th token
    out, _ = run_step(s)  # both need a third block: none free
    assert out.preempted_ids == ["r2"]
    assert new.status == RequestStatus.WAITING and new.num_computed_tokens == 0
    assert s.waiting[0] is new and s.num_preemptions == 1
    s.kv.check_invariants([old, new])


@pytest.mark.parametrize("caching", [True, False])
def test_prefix_cache_counters_count_the_lookups_of_new_requests(caching):
    """As vLLM counts: a preempted request's return finds its own blocks (no hit a user's
    prompt earned), a request wanting prompt logprobs makes no lookup, and no cache none."""
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=16, max_num_seqs=4, enable_prefix_caching=caching)
    old, new = make_request("r1", 8, max_tokens=8), make_request("r2", 8, max_tokens=8, arrival=1)
    s.add_request(old)
    s.add_request(new)
    for _ in range(40):
        run_step(s)
    assert old.status == new.status == RequestStatus.FINISHED_LENGTH and s.num_preemptions >= 1
    assert (s.kv.prefix_cache_queries, s.kv.prefix_cache_hits) == ((16, 0) if caching else (0, 0))
    s.add_request(make_request("r2", 8, max_tokens=1, arrival=2))  # (new's prompt again: a block of it a hit,
    # the second its last token's, computed again)
    s.add_request(make_request("r9", 8, max_tokens=1, arrival=3, prompt_logprobs=1))
    for _ in range(4):
        run_step(s)
    assert (s.kv.prefix_cache_queries, s.kv.prefix_cache_hits) == ((24, 4) if caching else (0, 0))

def test_priority_policy_admits_by_priority():
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=16, max_num_seqs=1, scheduling_policy="priority")
    s.add_request(make_request("r1", 3, arrival=0, priority=5))
    s.add_request(make_request("r2", 3, arrival=1, priority=-1))
    out, _ = run_step(s)
    assert [c.request.request_id for c in out.chunks] == ["r2"]


@pytest.mark.parametrize("policy, victim", [("fcfs", "r2"), ("priority", "r1")])
def test_preemption_picks_the_newest_or_the_least_important(policy, victim):
    s = make_scheduler(num_blocks=4, block_size=4, max_model_len=16, max_num_seqs=4, scheduling_policy=policy)
    older_but_low = make_request("r1", 4, max_tokens=12, arrival=0, priority=5)
    newer_but_high = make_request("r2", 4, max_tokens=12, arrival=1, priority=-1)
    s.add_request(older_but_low)
    run_step(s)  # r1 runs alone first, so it is the older running request under either policy
    s.add_request(newer_but_high)
    for _ in range(20):  # both grow until the 4 blocks run out
        out, _ = run_step(s)
        if out.preempted_ids:
            break
    assert out.preempted_ids == [victim]
    assert [c.request.request_id for c in out.chunks] == [r for r in ("r1", "r2") if r != victim]
    s.kv.check_invariants([older_but_low, newer_but_high])


def test_stop_conditions():
    s = make_scheduler(max_num_seqs=8)
    eos = make_request("r1", 3)
    stop_token = make_request("r2", 3, arrival=1, stop_token_ids=[7])
    ignore = make_request("r3", 3, max_tokens=2, arrival=2, ignore_eos=True)
    min_tok = make_request("r4", 3, max_tokens=4, arrival=3, min_tokens=2)
    for r in (eos, stop_token, ignore, min_tok):
        s.add_request(r)
    out = s.schedule()
    s.update(out, {"r1": EOS, "r2": 7, "r3": EOS, "r4": EOS})
    assert (eos.finish_reason, eos.stop_reason) == ("stop", None)
    assert (stop_token.finish_reason, stop_token.stop_reason) == ("stop", 7)
    assert ignore.finish_reason is None and min_tok.finish_reason is None
    out = s.schedule()
    s.update(out, {"r3": EOS, "r4": EOS})
    assert ignore.finish_reason == "length" and min_tok.finish_reason == "stop"
    assert s.kv.num_used_blocks == 0 and s.requests == {}


def test_abort_frees_blocks_and_ignores_unknown_ids():
    s = make_scheduler()
    request = make_request("r1", 9)
    s.add_request(request)
    run_step(s)
    assert s.abort_requests(["r1", "nope"]) == [request]
    assert request.finish_reason == "abort" and s.kv.num_used_blocks == 0
    assert s.schedule().finished_ids == ["r1"]


class SchedulerMachine(RuleBasedStateMachine):
    """Random adds (shared prefixes, priorities), steps (random EOS) and aborts over a tight cache."""

    def __init__(self) -> None:
        super().__init__()
        self.rng = random.Random(0)
        self.all: list[Request] = []

    @initialize(policy=st.sampled_from(["fcfs", "priority"]), mixed_prefill=st.sampled_from([None, 3, 8]),
                per_decode=st.sampled_from([None, 0.5, 1.5]))
    def make(self, policy, mixed_prefill, per_decode):
        self.s = make_scheduler(num_blocks=12, block_size=4, max_model_len=48, max_num_seqs=4,
                                max_num_batched_tokens=16, scheduling_policy=policy,
                                max_num_mixed_prefill_tokens=mixed_prefill, mixed_prefill_per_decode=per_decode)

    @rule(prompt_len=st.integers(1, 20), max_tokens=st.integers(1, 20), priority=st.integers(-2, 2),
          shared=st.booleans())
    def add(self, prompt_len, max_tokens, priority, shared):
        n = len(self.all)
        prompt = ([3] * 8 if shared else []) + [100 + n] * prompt_len
        max_tokens = min(max_tokens, 48 - len(prompt))
        if max_tokens < 1:
            return
        request = Request(f"r{n}", prompt, SamplingParams(max_tokens=max_tokens), max_tokens, EOS, n,
                          priority=priority)
        self.s.add_request(request)
        self.all.append(request)

    @rule(eos_chance=st.sampled_from([0.0, 0.1, 0.5]))
    def step(self, eos_chance):
        out = self.s.schedule()
        assert out.num_batched_tokens <= 16 and len(out.chunks) <= 4
        for chunk in out.chunks:
            assert chunk.request.status == RequestStatus.RUNNING and chunk.num_new_tokens >= 1
        sampled = {c.request.request_id: (EOS if self.rng.random() < eos_chance else 9)
                   for c in out.chunks if c.samples}
        self.s.update(out, sampled)

    @precondition(lambda self: self.s.requests)
    @rule(data=st.data())
    def abort(self, data):
        request_id = data.draw(st.sampled_from(sorted(self.s.requests)))
        self.s.abort_requests([request_id])

    @invariant()
    def consistent(self):
        live = list(self.s.requests.values())
        self.s.kv.check_invariants(live)
        assert set(map(id, live)) == set(map(id, self.s.waiting)) | set(map(id, self.s.running))
        assert not set(map(id, self.s.waiting)) & set(map(id, self.s.running))
        for request in self.all:
            assert request.finished == (request.request_id not in self.s.requests)

    def teardown(self):
        for _ in range(2000):
            if not self.s.requests:
                break
            self.step(0.0)
        assert not self.s.requests, "requests left unfinished: the scheduler stalled"
        assert all(r.finish_reason in ("stop", "length", "abort") for r in self.all)
        assert self.s.kv.num_used_blocks == 0


TestSchedulerMachine = SchedulerMachine.TestCase
TestSchedulerMachine.settings = settings(max_examples=150, stateful_step_count=50, deadline=None)


def test_config_rejects_bad_combinations():
    from engine.errors import ConfigError

    with pytest.raises(ConfigError) as exc:
        EngineConfig(num_kv_blocks=4, kv_cache_memory=1 << 20)
    assert exc.value.param == "num_kv_blocks"
    with pytest.raises(ConfigError) as exc:
        EngineConfig(block_size=12)
    assert exc.value.param == "block_size"
    with pytest.raises(ConfigError) as exc:
        EngineConfig.from_kwargs(max_num_seq=3)
    assert exc.value.param == "max_num_seq"
    with pytest.raises(ConfigError) as exc:
        EngineConfig(scheduling_policy="lifo")
    assert "fcfs" in str(exc.value)
    with pytest.raises(ConfigError) as exc:
        EngineConfig(dtype="float64")
    assert exc.value.param == "dtype"


def test_config_takes_vllms_spellings():
    assert (EngineConfig(dtype="half").dtype, EngineConfig(dtype="float").dtype) == ("float16", "float32")
    assert EngineConfig(quantization=None).quantization == "auto"


def test_a_decoding_step_carries_at_most_the_mixed_prefill_budget():
    s = make_scheduler(num_blocks=64, max_model_len=256, max_num_batched_tokens=64, max_num_mixed_prefill_tokens=8)
    s.add_request(make_request("r1", 20, max_tokens=50))
    out, _ = run_step(s)
    assert [c.num_new_tokens for c in out.chunks] == [20]  # nothing decodes yet: the full budget
    s.add_request(make_request("r2", 30, max_tokens=50, arrival=1))
    s.add_request(make_request("r3", 30, max_tokens=50, arrival=2))
    sizes = []
    for _ in range(8):
        out, _ = run_step(s)
        assert sum(c.num_new_tokens for c in out.chunks if c.request.request_id != "r1") <= 8  # r1 decodes
        sizes.append({c.request.request_id: c.num_new_tokens for c in out.chunks})
    # r2's 30 tokens in four chunks of 7-8 (not 8 8 8 6); r3 starts with what the fourth step has left
    assert [size["r2"] for size in sizes[:4]] == [8, 8, 7, 7] and sizes[3] == {"r1": 1, "r2": 7, "r3": 1}
    assert all(size["r1"] == 1 for size in sizes)


def test_one_token_prompt_chunks_count_against_the_prefill_cap_too():
    """Equal chunks leave a step a token or two of its cap: a prompt may take one (a chunk of one
    token), but then no other prompt gets another one for free."""
    s = make_scheduler(num_blocks=256, max_model_len=256, max_num_batched_tokens=64, max_num_mixed_prefill_tokens=8,
                       max_num_seqs=16)
    s.add_request(make_request("r1", 4, max_tokens=200))
    run_step(s)
    for i in range(7):
        s.add_request(make_request(f"r{i + 2}", 30, max_tokens=2, arrival=i + 1))
    for _ in range(40):
        out, _ = run_step(s)
        prompt_tokens = sum(c.num_new_tokens for c in out.chunks if not c.samples or c.num_new_tokens > 1)
        assert prompt_tokens <= 8


def decoding_scheduler(num_decoding: int, **fields) -> Scheduler:
    """A scheduler whose first ``num_decoding`` requests decode from the next step on."""
    s = make_scheduler(num_blocks=4096, max_model_len=4096, max_num_batched_tokens=2048, max_num_seqs=256, **fields)
    for i in range(num_decoding):
        s.add_request(make_request(f"r{i}", 4, max_tokens=1000, arrival=i))
    run_step(s)  # nothing decodes yet: every prompt in one step
    return s


@pytest.mark.parametrize("decoding, fields, prompts, expected", [
    (40, dict(mixed_prefill_per_decode=1.0), 1, [40, 40, 40]),  # ratio x the decoding streams
    (40, dict(mixed_prefill_per_decode=1.5), 1, [50, 50, 50, 50]),  # 200 tokens in 4 equal chunks, not 60 60 60 20
    (4, dict(mixed_prefill_per_decode=1.0), 1, [12, 12, 12]),  # never below a step of 16 tokens: 4 decodes + 12
    (8, dict(mixed_prefill_per_decode=1.0), 40, [125, 123]),  # a backlog of 40 x 200 tokens, over 64 steps
    (40, dict(mixed_prefill_per_decode=1.0, max_num_mixed_prefill_tokens=16), 1, [16, 16, 16]),  # the smaller cap
])
def test_the_mixed_prefill_cap_that_follows_the_batch(decoding, fields, prompts, expected):
    s = decoding_scheduler(decoding, **fields)
    for j in range(prompts):
        s.add_request(make_request(f"r{1000 + j}", 200, max_tokens=1000, arrival=1000 + j))
    for want in expected:  # step after step, with a prompt part-way through its prefill
        out, _ = run_step(s)
        assert sum(1 for c in out.chunks if c.num_new_tokens == 1) == decoding
        assert sum(c.num_new_tokens for c in out.chunks if c.num_new_tokens > 1) == want


def test_a_short_prompt_is_never_starved_by_a_tiny_ratio_past_16_decodes():
    """20 decoding streams at a ratio of 0.01 and a 30-token prompt: every term of the cap is under
    one token (16 - 20, 0.2, 30 / 64); the prompt still goes in, a token a step."""
    s = decoding_scheduler(20, mixed_prefill_per_decode=0.01)
    prompt = make_request("r1000", 30, max_tokens=1000, arrival=1000)
    s.add_request(prompt)
    for _ in range(31):
        run_step(s)
    assert prompt.num_output_tokens >= 1  # its whole prompt computed, its first token out


def test_a_fractional_cap_cuts_a_prompt_into_equal_whole_chunks():
    s = decoding_scheduler(32, mixed_prefill_per_decode=1.2)  # a cap of 38.4 tokens: 38 of them
    s.add_request(make_request("r1000", 115, max_tokens=1000, arrival=1000))
    chunks = [sum(c.num_new_tokens for c in run_step(s)[0].chunks if c.num_new_tokens > 1) for _ in range(4)]
    assert chunks == [29, 29, 29, 28]  # not 38 26 26 25


def test_the_per_decode_ratio_rises_to_the_workloads_prompt_tokens_per_output_token():
    s = decoding_scheduler(0, mixed_prefill_per_decode=1.5)
    assert s.prefill_per_decode == 1.5  # nothing finished yet
    for i in range(3):  # 64-token prompts, 8 output tokens: 8 prompt tokens per output token
        s.add_request(make_request(f"r{i + 1}", 64, max_tokens=8, arrival=i))
    while s.num_unfinished:
        run_step(s)
    assert s.prefill_per_decode == pytest.approx(MARGIN * 8, rel=0.05)  # (the counts decay step by step)
    aborted = make_request("r9", 4, max_tokens=1000, arrival=9)
    s.add_request(aborted)
    run_step(s)
    before = s.prefill_per_decode
    s.abort_requests(["r9"])  # an aborted request's prompt says nothing of the workload
    assert s.prefill_per_decode == before
    for i in range(40):  # short prompts, long outputs: the configured ratio again
        s.add_request(make_request(f"r{100 + i}", 4, max_tokens=32, arrival=100 + i))
    while s.num_unfinished:
        run_step(s)
    assert s.prefill_per_decode == 1.5
    decoding = decoding_scheduler(8, mixed_prefill_per_decode=1.0)
    decoding._recent_prefill, decoding._recent_output = 400.0, 100.0  # 4 prompt tokens per output token
    cap = MARGIN * 4 * 8  # the margin x 4 x 8 streams
    decoding.add_request(make_request("r1000", 4 * int(cap), max_tokens=1000, arrival=1000))  # 4 chunks of the cap
    out, _ = run_step(decoding)
    assert sum(c.num_new_tokens for c in out.chunks if c.num_new_tokens > 1) == int(cap)


def test_the_per_decode_ratio_does_not_overshoot_while_the_short_outputs_finish_first():
    """Of requests that started together, the shortest outputs finish first: prompt / output of the
    finished ones would start at 64 / 4 (x the margin) here. The prompt tokens of the finished over
    the output tokens of all stays near the workload's 64 / 35 as they finish."""
    s = decoding_scheduler(0, mixed_prefill_per_decode=1.5)
    for i in range(32):  # 64-token prompts, outputs of 4 to 66 tokens: 2048 / 1120 prompt tokens per output token
        s.add_request(make_request(f"r{i + 1}", 64, max_tokens=4 + 2 * i, arrival=i))
    ratios = []
    while s.num_unfinished:
        run_step(s)
        ratios.append(s.prefill_per_decode)
    workload = MARGIN * 2048 / 1120
    assert max(ratios) <= workload * 1.05
    assert ratios[-1] == pytest.approx(workload, rel=0.1)


def test_before_requests_finish_the_ratio_is_held_up_by_prompt_per_max_tokens_of_admitted_ones():
    """Answers end at max_tokens at the latest: prompt / max_tokens of the admitted requests is a
    floor under the workload's rate, known before anything finishes (exact where answers run to
    max_tokens, as in a benchmark that ignores EOS); with no max_tokens set it says nothing."""
    s = decoding_scheduler(0, mixed_prefill_per_decode=1.5)
    for i in range(4):  # 64-token prompts, at most 16 output tokens each
        s.add_request(make_request(f"r{i + 1}", 64, max_tokens=16, arrival=i))
    run_step(s)
    assert s.num_unfinished == 4 and s.prefill_per_decode == pytest.approx(MARGIN * 4)
    chat = decoding_scheduler(0, mixed_prefill_per_decode=1.5)
    for i in range(4):  # max_tokens unset: resolved to the rest of the model's length (4096)
        chat.add_request(make_request(f"r{i + 1}", 64, max_tokens=4096 - 64, arrival=i))
    run_step(chat)
    assert chat.prefill_per_decode == 1.5


def test_without_chunked_prefill_the_mixed_budget_does_not_apply():
    s = make_scheduler(num_blocks=64, max_model_len=256, max_num_batched_tokens=64, max_num_mixed_prefill_tokens=8,
                       max_num_seqs=4, enable_chunked_prefill=False)
    s.add_request(make_request("r1", 4, max_tokens=50))
    run_step(s)
    s.add_request(make_request("r2", 30, max_tokens=50, arrival=1))
    out, _ = run_step(s)
    assert {c.request.request_id: c.num_new_tokens for c in out.chunks} == {"r1": 1, "r2": 30}

