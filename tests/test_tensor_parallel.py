"""Tensor parallelism (engine/models/parallel.py, engine/core/tensor_parallel.py) over gloo on this
CPU: ranks 1.. are real processes driven by the plans rank 0 broadcasts. The same greedy tokens
and logprobs within fp32 tolerance as one rank, on random-weight models (8 heads / 4 KV heads;
one KV head, copied to both ranks) through chunked prefill and preemption, and on the default
model split over 3 ranks; sizes that do not divide are refused before any rank starts; a hung
rank fails the step within the configured timeout."""

from __future__ import annotations

import os
import random
import signal
import time

import pytest
import torch

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.errors import ConfigError
from engine.sampling_params import SamplingParams
from tests.conftest import run_prompts

pytestmark = pytest.mark.slow

FP32 = dict(backend="cpu", dtype="float32", kv_cache_dtype="float32")


def random_llama(directory, num_kv_heads: int) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=250, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=num_kv_heads, head_dim=16,
                         max_position_embeddings=512, tie_word_embeddings=False, bos_token_id=1, eos_token_id=2)
    torch.manual_seed(num_kv_heads)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1 + 0.2 * torch.randn_like(param) if "norm" in name else 0.15 * torch.randn_like(param))
    model.save_pretrained(directory, safe_serialization=True)
    return str(directory)


def prompts(vocab: int, lengths=(3, 17, 60, 90)) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def run(size: int, model: str | None, batch, params, **fields) -> tuple[list, EngineCore]:
    core = EngineCore(EngineConfig(model=model, tensor_parallel_size=size, **{**FP32, **fields}))
    try:
        return run_prompts(core, batch, params), core
    finally:
        core.close()


@pytest.mark.parametrize("num_kv_heads", [4, 1])
def test_two_ranks_give_the_tokens_and_logprobs_of_one(tmp_path, num_kv_heads):
    """32 greedy steps; 16-token steps cut the prompts (chunked prefill), and 24 blocks of 16
    tokens cannot hold every request at once (preemption)."""
    model = random_llama(tmp_path, num_kv_heads)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=3)
    batch = prompts(250)
    fields = dict(max_num_batched_tokens=16, num_kv_blocks=14, max_num_seqs=4)
    one, _ = run(1, model, batch, params, **fields)
    two, core = run(2, model, batch, params, **fields)
    assert core.stats().num_preemptions > 0
    for (tokens, logprobs), (want, want_lps) in zip(two, one):
        assert tokens == want
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in logprobs]),
                                   torch.tensor([lp.logprob for lp in want_lps]), atol=1e-4, rtol=1e-4)


def test_the_default_model_over_three_ranks_writes_the_text_of_one(tokenizer):
    """9 heads and 3 KV heads: 3 of each per rank; the packed matrices split on their blocks."""
    texts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"]
    batch = [tokenizer.encode(t) for t in texts]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    one, _ = run(1, None, batch, params, num_kv_blocks=128)
    three, _ = run(3, None, batch, params, num_kv_blocks=128)
    assert [tokenizer.decode(t) for t, _ in three] == [tokenizer.decode(t) for t, _ in one]


@pytest.mark.parametrize("size, words", [(2, "does not divide the model's 9 attention heads"),
                                         (4, "does not divide the model's 9 attention heads")])
def test_sizes_that_do_not_divide_are_refused_before_any_rank_starts(size, words, monkeypatch):
    import engine.core.engine_core as engine_core

    started = []
    monkeypatch.setattr(engine_core, "TensorParallelDriver", lambda *a: started.append(a))
    with pytest.raises(ConfigError, match=words):
        EngineCore(EngineConfig(tensor_parallel_size=size, **FP32))
    assert not started


def test_a_hung_rank_fails_the_step_within_the_timeout(tmp_path):
    model = random_llama(tmp_path, 4)
    core = EngineCore(EngineConfig(model=model, tensor_parallel_size=2, distributed_timeout=3.0,
                                   num_kv_blocks=32, **FP32))
    rank = core.tensor_parallel.processes[0]
    try:
        run_prompts(core, prompts(250)[:1], SamplingParams(temperature=0, max_tokens=2))  # (the ranks work)
        os.kill(rank.pid, signal.SIGSTOP)  # hung: alive, answering nothing
        core.add_request("x", prompts(250)[0], SamplingParams(temperature=0, max_tokens=4))
        start = time.monotonic()
        with pytest.raises(Exception):
            while core.has_unfinished_requests:
                core.step()
        assert time.monotonic() - start < 3.0 + 10.0
    finally:
        os.kill(rank.pid, signal.SIGKILL)
        core.close()
    assert rank.wait(10) is not None
