"""The synchronous engine core on the tiny random model: request ids, per-request failures,
prompt logprobs across preemption, stop-string finishes."""

from __future__ import annotations

import pytest

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore, child_id
from engine.errors import InvalidParameterError
from engine.sampling_params import MAX_SEED, SamplingParams
from tests.conftest import fail_logits_processing

GREEDY = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True)


def prompt(i: int, length: int = 8) -> list[int]:
    return [10 + (i * 7 + j) % 400 for j in range(length)]


def run_to_end(core: EngineCore, max_steps: int = 1000) -> dict[tuple[str, int], list]:
    """Step until idle; every delta, per (request id, completion index)."""
    deltas: dict[tuple[str, int], list] = {}
    for _ in range(max_steps):
        if not core.has_unfinished_requests:
            return deltas
        for delta in core.step():
            deltas.setdefault((delta.request_id, delta.index), []).append(delta)
    raise AssertionError("the engine did not finish its requests")


def tokens(deltas) -> list[int]:
    return [t for d in deltas for t in d.new_token_ids]


def test_with_chunked_prefill_off_the_default_batch_takes_the_longest_prompt(tiny_model):
    """No max_num_batched_tokens: 1024 a pass, or with chunked prefill off max(max_model_len,
    2048) as vLLM (the fixed 1024 refused to start past a 1024-token context), of max_model_len
    as the cache caps it, and at least max_num_seqs; one given that is shorter than max_model_len
    is still refused."""
    from engine.errors import ConfigError

    import attrs
    import torch

    from engine.models.llama import LlamaModel
    from engine.models.loader import dummy_weights
    from tests.conftest import TINY_CONFIG

    config = attrs.evolve(TINY_CONFIG, max_position_embeddings=4096)
    long_model = LlamaModel.from_state_dict(config, dict(dummy_weights(config, seed=0)), torch.float32, "cpu")

    def core(model=long_model, **fields) -> EngineCore:
        config = dict(backend="torch", num_kv_blocks=512, max_num_seqs=4)
        return EngineCore(EngineConfig(**{**config, **fields}), model=model)

    assert core(max_model_len=256).scheduler.max_num_batched_tokens == 1024
    unchunked = core(max_model_len=4000, enable_chunked_prefill=False)
    assert unchunked.scheduler.max_num_batched_tokens == 4000
    unchunked.add_request("long", [3 + i % 500 for i in range(3987)], SamplingParams(max_tokens=2, ignore_eos=True))
    tokens = []
    while unchunked.has_unfinished_requests:
        tokens += [t for delta in unchunked.step() for t in delta.new_token_ids]
    assert len(tokens) == 2
    assert core(tiny_model, enable_chunked_prefill=False).scheduler.max_num_batched_tokens == 2048
    capped = core(enable_chunked_prefill=False, num_kv_blocks=200)  # (3200 tokens of 4096)
    assert (capped.max_model_len, capped.scheduler.max_num_batched_tokens) == (3200, 3200)
    assert core(max_model_len=256, enable_chunked_prefill=False, max_num_seqs=3000).scheduler.max_num_batched_tokens == 3000
    with pytest.raises(ConfigError, match=r"max_num_batched_tokens \(1024\) must be at least max_model_len \(4000\)"):
        core(max_model_len=4000, enable_chunked_prefill=False, max_num_batched_tokens=1024)


def test_child_ids_cannot_collide_with_caller_ids(tiny_core):
    pairs = [(r, i) for r in ("x", "0_x", "1_x", "0", "", "_", "1_", "10_x") for i in (0, 1, 10)]
    assert len({child_id(r, i) for r, i in pairs}) == len(pairs)
    tiny_core.add_request("0_x", prompt(1), GREEDY)
    tiny_core.add_request("x", prompt(2), SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True))
    deltas = run_to_end(tiny_core)
    assert sorted(deltas) == [("0_x", 0), ("x", 0), ("x", 1)]
    for key in deltas:
        assert len(tokens(deltas[key])) == 8 and deltas[key][-1].finish_reason == "length"
    assert tiny_core.stats().kv_blocks_used == 0


def test_a_seed_at_the_top_of_the_range_serves_n_completions(tiny_core):
    tiny_core.add_request("r", prompt(1), SamplingParams(n=3, seed=MAX_SEED, max_tokens=6, ignore_eos=True))
    deltas = run_to_end(tiny_core)
    assert [deltas[("r", i)][-1].finish_reason for i in range(3)] == ["length"] * 3
    with pytest.raises(InvalidParameterError) as exc:
        SamplingParams(n=2, seed=2**64 - 1)
    assert exc.value.param == "seed"


def test_a_request_that_fails_in_its_own_sampling_ends_alone(tiny_core, monkeypatch):
    fail_logits_processing(monkeypatch, lambda r: r.request_id.endswith("_bad") and r.num_output_tokens == 2)
    biased = SamplingParams(n=2, temperature=0, max_tokens=8, ignore_eos=True, logit_bias={5: 1.0})
    tiny_core.add_request("good", prompt(1), GREEDY)
    tiny_core.add_request("bad", prompt(2), biased)
    tiny_core.add_request("also-good", prompt(3), biased)
    deltas = run_to_end(tiny_core)
    assert len(tokens(deltas[("good", 0)])) == 8 and len(tokens(deltas[("also-good", 1)])) == 8
    failed, sibling = deltas[("bad", 0)][-1], deltas[("bad", 1)][-1]
    assert failed.finish_reason == "error" and "injected" in failed.error
    assert sibling.finish_reason in ("error", "abort")
    assert len(tokens(deltas[("bad", 0)])) == 2  # nothing after the failing step
    assert tiny_core.stats().kv_blocks_used == 0 and not tiny_core.has_unfinished_requests


def test_prompt_logprobs_are_reported_once_across_a_preemption(tiny_model):
    def run(num_blocks: int):
        core = EngineCore(EngineConfig(backend="torch", num_kv_blocks=num_blocks, max_model_len=96,
                                       enable_prefix_caching=False), model=tiny_model)
        long = SamplingParams(temperature=0, max_tokens=60, ignore_eos=True)
        core.add_request("a", prompt(1, 30), long)
        core.add_request("b", prompt(2, 30), long)
        core.add_request("c", prompt(3, 30), SamplingParams(temperature=0, max_tokens=40, ignore_eos=True,
                                                            prompt_logprobs=2))
        deltas = run_to_end(core)
        assert core.stats().num_request_prompt_tokens == 90  # (vllm:prompt_tokens: each prompt once, recomputed or not)
        return [lp for d in deltas[("c", 0)] for lp in d.new_prompt_logprobs], core.stats().num_preemptions

    roomy, none = run(64)
    tight, preemptions = run(6)
    assert none == 0 and preemptions > 0
    assert len(roomy) == len(tight) == 29
    assert [lp.token_id for lp in tight] == prompt(3, 30)[1:]
    assert [lp.logprob for lp in tight] == pytest.approx([lp.logprob for lp in roomy], abs=1e-4)


def test_a_stop_string_finish_frees_the_sequence_in_the_core(tiny_core):
    """The front found the stop string in the completion's first 2 tokens while the core had run
    4 steps: the sequence ends, and the tokens past the stop (which no output shows) leave
    vllm:generation_tokens, as they are not in usage or vllm:request_generation_tokens: out of
    later steps' counts, as a counter never falls."""
    tiny_core.add_request("r", prompt(1), SamplingParams(n=2, temperature=0, max_tokens=50, ignore_eos=True))
    for _ in range(4):
        tiny_core.step()
    assert tiny_core.finish_request("r", 1, "STOP", 2).finish_reason == "stop"
    assert tiny_core.finish_request("r", 1, "STOP", 2) is None  # already finished: nothing to report
    held, counts = tiny_core.stats().kv_blocks_used, [tiny_core.stats().num_generation_tokens]
    deltas = {}
    while tiny_core.has_unfinished_requests:
        for delta in tiny_core.step():
            deltas.setdefault((delta.request_id, delta.index), []).append(delta)
        counts.append(tiny_core.stats().num_generation_tokens)
    assert counts == sorted(counts) and counts[0] == 8  # (4 steps of 2; it never fell)
    assert ("r", 1) not in deltas  # not one more token for the stopped completion
    assert len(tokens(deltas[("r", 0)])) == 50 - 4 and held > 0 and tiny_core.stats().kv_blocks_used == 0
    assert tiny_core.stats().num_generation_tokens == 50 + 2
