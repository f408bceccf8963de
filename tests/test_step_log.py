"""bench/step_log.py: the step timer it installs in the engine, and its report's arithmetic."""

from __future__ import annotations

import numpy as np
import pytest

from engine.sampling_params import SamplingParams
from tests.conftest import load_script, tiny_engine_core


@pytest.fixture(scope="module")
def step_log():
    return load_script("bench/step_log.py")


def test_the_timer_logs_each_step_with_its_decodes_and_prompt_tokens(step_log, tiny_model, tmp_path, monkeypatch):
    from engine.core import engine_core

    monkeypatch.setattr(engine_core.EngineCore, "execute", engine_core.EngineCore.execute)  # (undone after)
    step_log.install(str(tmp_path / "steps.tsv"))
    core = tiny_engine_core(tiny_model, max_num_batched_tokens=32)
    core.add_request("a", list(range(1, 41)), SamplingParams(max_tokens=3))  # 40 prompt tokens: 32 + 8
    core.add_request("b", list(range(1, 5)), SamplingParams(max_tokens=3))
    core.add_request("c", list(range(50, 71)), SamplingParams(max_tokens=2))  # 21: 20 + a last chunk of 1
    steps = 0
    while core.has_unfinished_requests:
        core.step()
        steps += 1
    rows = np.loadtxt(tmp_path / "steps.tsv", ndmin=2)
    assert len(rows) == steps
    assert (rows[:, 1] > 0).all()
    # (decodes, prompt tokens, drafted) step by step: a's first 32; a's last 8, b's 4 and 20 of c's
    # prompt; a and b decode, c's one-token last chunk costs as one (a decode); then a and b's third
    # token and c's second
    assert rows[:, 2:].astype(int).tolist() == [[0, 32, 0], [0, 32, 0], [3, 0, 0], [3, 0, 0]]


def test_the_timer_counts_a_drafted_row_as_a_decode_and_its_drafts(step_log, tiny_model, tmp_path, monkeypatch):
    from engine.config import EngineConfig
    from engine.core import engine_core

    monkeypatch.setattr(engine_core.EngineCore, "execute", engine_core.EngineCore.execute)
    step_log.install(str(tmp_path / "steps.tsv"))
    ngram = {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "prompt_lookup_max": 4,
             "disable_by_batch_size": 8}
    core = engine_core.EngineCore(EngineConfig(backend="torch", dtype="float32", num_kv_blocks=64, max_num_seqs=8,
                                               max_num_batched_tokens=128, speculative_config=ngram), model=tiny_model)
    scheduled = []
    schedule = core.schedule
    core.schedule = lambda: scheduled.append(schedule()) or scheduled[-1]
    core.add_request("a", [5, 6, 7, 8] * 8, SamplingParams(max_tokens=24))  # (proposals from its own repeats)
    while core.has_unfinished_requests:
        core.step()
    rows = np.loadtxt(tmp_path / "steps.tsv", ndmin=2).astype(int)
    drafts = [sum(out.plan.num_draft_tokens) for out in scheduled]
    assert rows[:, 4].tolist() == drafts and sum(drafts) > 0
    assert (rows[:, 2] + rows[:, 3] + rows[:, 4]).tolist() == [out.num_batched_tokens for out in scheduled]
    assert all(d == 1 and p == 0 for d, p, k in rows[1:, 2:] if k > 0)  # a drafted row: one decode, no prompt


def test_step_to_step_gaps_count_the_hosts_time_between_steps(step_log):
    run = np.array([[1.000, 10.0, 2, 0, 0], [1.015, 10.0, 2, 0, 0], [1.040, 10.0, 2, 0, 0]])
    assert step_log.step_to_step_ms(run) == pytest.approx([10.0, 15.0, 25.0])


def test_the_report_separates_the_streams_from_the_prompt_chunks(step_log):
    """Steps costing exactly 10 + 3 D + 2 P ms, back to back: the fit finds it; with every step decode-only at
    the same D the gaps are all alike (1x), with prompt chunks in some of them they are not."""
    rng = np.random.default_rng(0)
    decodes = rng.integers(1, 9, 400).astype(float)
    prompt = np.where(rng.random(400) < 0.3, rng.integers(1, 20, 400), 0).astype(float)
    ms = 10 + 3 * decodes + 2 * prompt
    starts = np.concatenate([[0.0], np.cumsum(ms)[:-1]]) / 1e3  # (back to back: no host time between)
    steps = np.column_stack([starts, ms, decodes, prompt, np.zeros(400)])
    a = step_log.analyse(steps)
    assert a["fit"] == pytest.approx([10, 3, 2])
    assert a["ratio"] == pytest.approx(a["ratio_device"]) and a["ratio"] == pytest.approx(a["ratio_fitted"])
    gaps = np.repeat(ms, decodes.astype(int))
    assert a["ratio"] == pytest.approx(np.percentile(gaps, 99) / np.median(gaps))
    alone = np.repeat(10 + 3 * decodes, decodes.astype(int))
    assert a["ratio_streams_alone"] == pytest.approx(np.percentile(alone, 99) / np.median(alone))
    assert a["ratio"] > a["ratio_streams_alone"] > 1
    same = steps.copy()
    same[:, 2], same[:, 3], same[:, 1] = 4, 0, 22
    assert step_log.gap_ratio(same[:, 1], same[:, 2]) == 1.0


def test_the_report_cuts_runs_at_idle_gaps(step_log):
    t = np.array([0.0, 0.1, 0.2, 10.0, 10.1, 30.0])
    steps = np.column_stack([t, np.ones(6), np.ones(6), np.zeros(6), np.zeros(6)])
    assert [len(r) for r in step_log.runs(steps)] == [3, 2, 1]
    assert [len(r) for r in step_log.runs(steps, idle_gap_s=15)] == [5, 1]
