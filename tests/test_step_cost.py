"""The step-cost fit (engine/sched/step_cost.py) and the prefill floor the scheduler takes from it."""

from __future__ import annotations

import random

import pytest

from engine.sched.scheduler import MIXED_STEP_COST_RATIO
from engine.sched.step_cost import MIN_PROMPT_SHARE, MIN_STEPS, SKIPPED_STEPS, StepCost
from engine.sampling_params import SamplingParams
from tests.conftest import tiny_engine_core
from tests.test_scheduler import decoding_scheduler, make_request, run_step

# Seconds: fixed part, per decoding row, per prompt token. Zen 3 as its step logs read (float32
# products, 2 cores); a Zen 4-like machine where a prompt token is cheap beside the fixed part.
ZEN3 = (0.010, 0.0027, 0.0018)
CHEAP_PROMPTS = (0.012, 0.0015, 0.00055)


def feed(cost: StepCost, machine, steps: int = 300, seed: int = 0, noise: float = 0.0) -> StepCost:
    """Steps of a serving load's shapes (decode-only, with a prompt chunk) timed on ``machine``."""
    rng = random.Random(seed)
    fixed, per_decode, per_prompt = machine
    for _ in range(steps):
        decodes = rng.randrange(0, 65)
        prompt = rng.choice([0, 0, rng.randrange(1, 130)])
        seconds = (fixed + per_decode * decodes + per_prompt * prompt) * (1 + noise * rng.uniform(-1, 1))
        cost.observe(decodes, prompt, seconds)
    return cost


def test_the_fit_recovers_a_machines_step_costs():
    cost = feed(StepCost(), ZEN3)
    assert cost.coefficients() == pytest.approx(ZEN3, rel=1e-6)
    # 4 decoding rows cost 20.8 ms; half of that again is 10.4 ms of prompt tokens at 1.8 ms
    assert cost.prompt_tokens_within(4, 1.5) == pytest.approx(0.5 * (0.010 + 4 * 0.0027) / 0.0018)


def test_the_fit_follows_a_change_of_machine_load():
    """Steps twice as slow (a core lent to another process) take over the fit in a few windows."""
    cost = feed(StepCost(), ZEN3)
    feed(cost, tuple(2 * c for c in ZEN3), steps=1200, seed=1)
    assert cost.coefficients() == pytest.approx(tuple(2 * c for c in ZEN3), rel=0.01)


def test_a_fresh_processs_first_steps_are_left_out():
    cost = StepCost()
    for _ in range(SKIPPED_STEPS):
        cost.observe(0, 500, 30.0)  # cold: seconds for what will take 1
    feed(cost, ZEN3)
    assert cost.coefficients() == pytest.approx(ZEN3, rel=1e-6)


def test_noisy_steps_still_give_costs_near_the_machines():
    fixed, per_decode, per_prompt = feed(StepCost(), ZEN3, steps=1000, noise=0.2).coefficients()
    assert per_decode == pytest.approx(ZEN3[1], rel=0.1) and per_prompt == pytest.approx(ZEN3[2], rel=0.15)
    assert fixed == pytest.approx(ZEN3[0], rel=0.5)


def test_the_fit_waits_for_steps_that_tell_its_terms_apart():
    cost = feed(StepCost(), ZEN3, steps=SKIPPED_STEPS + MIN_STEPS - 1)
    assert cost.coefficients() is None and cost.prompt_tokens_within(4, 1.5) is None
    feed(cost, ZEN3, steps=1, seed=1)
    assert cost.coefficients() is not None
    collinear = StepCost()  # every step carried twice its decodes in prompt tokens: which costs what?
    for d in range(1, 200):
        collinear.observe(d % 64, 2 * (d % 64), 0.01 + 0.005 * (d % 64))
    assert collinear.coefficients() is None
    decoding_only = StepCost()
    for d in range(1, 200):  # no step carried a prompt token: its cost is unknown
        decoding_only.observe(d % 64, 0, 0.01 + 0.002 * (d % 64))
    assert decoding_only.coefficients() is None


def test_prompt_tokens_that_look_free_are_held_to_a_share_of_a_decode_row():
    """A fit that reads prompt tokens as (nearly) free must not let a long prefill in."""
    cost = feed(StepCost(), (0.010, 0.0027, 0.0))
    assert cost.coefficients()[2] == pytest.approx(MIN_PROMPT_SHARE * 0.0027)


@pytest.mark.parametrize("machine, chunk", [(ZEN3, 5), (CHEAP_PROMPTS, 12)])
def test_a_decoding_step_takes_the_prompt_tokens_the_machines_step_costs_allow(machine, chunk):
    """4 decoding streams, a 200-token prompt: 12-token chunks (16 - 4) until the engine has timed
    its steps, then no more than keeps a step within 1.5x a decode-only one on this machine: 5.8
    tokens where a prompt token costs 1.8 ms beside 20.8 ms of decoding; where it costs 0.55 of 18
    (16.4 tokens) still 12: the fit lowers the floor, never raises it."""
    s = decoding_scheduler(4, mixed_prefill_per_decode=1.0)
    s.add_request(make_request("r1000", 200, max_tokens=1000, arrival=1000))
    assert sum(c.num_new_tokens for c in run_step(s)[0].chunks if c.num_new_tokens > 1) == 12
    feed(s.step_cost, machine)
    fixed, per_decode, per_prompt = machine
    assert MIXED_STEP_COST_RATIO == 1.5
    for _ in range(3):
        out, _ = run_step(s)
        prompt = sum(c.num_new_tokens for c in out.chunks if c.num_new_tokens > 1)
        assert prompt == chunk
        assert fixed + per_decode * 4 + per_prompt * prompt <= 1.5 * (fixed + per_decode * 4)


def test_the_engine_times_its_steps_into_the_fit_only_under_the_per_decode_cap(tiny_model):
    for ratio, timed in ((1.2, True), (None, False)):
        core = tiny_engine_core(tiny_model, mixed_prefill_per_decode=ratio)
        core.add_request("a", list(range(1, 40)), SamplingParams(max_tokens=8))
        steps = 0
        while core.has_unfinished_requests:
            core.step()
            steps += 1
        fit = core.scheduler.step_cost
        assert fit.num_steps == (steps - SKIPPED_STEPS if timed else 0)
        assert (fit._xy[0] > 0) == timed  # (the steps' seconds went in)


def test_a_step_verifying_drafts_is_not_fitted():
    """Its rows are a decode and k drafted tokens each: neither shape the fit knows."""
    from types import SimpleNamespace

    s = decoding_scheduler(4, mixed_prefill_per_decode=1.0)
    out, _ = run_step(s)  # 4 decodes
    drafted = SimpleNamespace(chunks=out.chunks, plan=SimpleNamespace(num_draft_tokens=(2, 0, 0, 0),
                                                                      num_batched_tokens=6))
    for _ in range(SKIPPED_STEPS + 3):
        s.observe_step(drafted, 0.02)
    assert s.step_cost.num_steps == 0
    for _ in range(SKIPPED_STEPS + 3):
        s.observe_step(out, 0.02)
    assert s.step_cost.num_steps == 3
