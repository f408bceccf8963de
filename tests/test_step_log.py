"""bench/step_log.py: the step timer it installs in the engine, and its report's arithmetic."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import numpy as np
import pytest

from engine.sampling_params import SamplingParams
from tests.conftest import tiny_engine_core


@pytest.fixture(scope="module")
def step_log():
    path = Path(__file__).resolve().parent.parent / "bench" / "step_log.py"
    spec = importlib.util.spec_from_file_location("bench_step_log", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_timer_logs_each_step_with_its_decodes_and_prompt_tokens(step_log, tiny_model, tmp_path, monkeypatch):
    from engine.core import engine_core

    monkeypatch.setattr(engine_core.EngineCore, "execute", engine_core.EngineCore.execute)  # (undone after)
    step_log.install(str(tmp_path / "steps.tsv"))
    core = tiny_engine_core(tiny_model, max_num_batched_tokens=32)
    core.add_request("a", list(range(1, 41)), SamplingParams(max_tokens=3))  # 40 prompt tokens: 32 + 8
    core.add_request("b", list(range(1, 5)), SamplingParams(max_tokens=3))
    steps = 0
    while core.has_unfinished_requests:
        core.step()
        steps += 1
    rows = np.loadtxt(tmp_path / "steps.tsv", ndmin=2)
    assert len(rows) == steps
    assert (rows[:, 1] > 0).all()
    # (decodes, prompt tokens, drafted) step by step: a's first 32, a's last 8 + b's 4 prompt
    # tokens, then both decode twice
    assert rows[:, 2:].astype(int).tolist() == [[0, 32, 0], [0, 12, 0], [2, 0, 0], [2, 0, 0]]


def test_the_report_separates_the_streams_from_the_prompt_chunks(step_log):
    """Steps costing exactly 10 + 3 D + 2 P ms: the fit finds it; with every step decode-only at
    the same D the gaps are all alike (1x), with prompt chunks in some of them they are not."""
    rng = np.random.default_rng(0)
    decodes = rng.integers(1, 9, 400).astype(float)
    prompt = np.where(rng.random(400) < 0.3, rng.integers(1, 20, 400), 0).astype(float)
    ms = 10 + 3 * decodes + 2 * prompt
    steps = np.column_stack([np.arange(400) * 0.05, ms, decodes, prompt, np.zeros(400)])
    a = step_log.analyse(steps)
    assert a["fit"] == pytest.approx([10, 3, 2])
    assert a["ratio"] == pytest.approx(a["ratio_fitted"])
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
