"""The cpu backend's one-call layer stack (``CpuLayerOps.decoder_layers``, native
``pa_cpu_decoder_layers``) against the layer-by-layer loop it replaces: the same ops in the same
order, so every token and logprob must be the same bits, in every configuration it takes."""

from __future__ import annotations

import random

import pytest
import torch

from backends.cpu import CpuAttentionBackend
from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.models.linear import quantize_q8_m
from engine.models.llama import LlamaConfig, LlamaModel
from engine.models.loader import dummy_weights
from engine.sampling_params import SamplingParams
from tests.conftest import run_prompts

PARAMS = SamplingParams(temperature=0, max_tokens=8, ignore_eos=True, logprobs=3)


def prompts(vocab: int) -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in (3, 17, 60, 130, 200)]


def bits(output) -> tuple:
    tokens, logprobs = output
    return tokens, [(p.logprob, tuple(p.top_logprobs)) for p in logprobs]


def run(monkeypatch, stack: bool, prompt_ids, model=None, **fields) -> tuple[list, int]:
    """Every prompt's bits, and how many forward passes took the stack."""
    calls = []
    decoder_layers = CpuAttentionBackend().layer_ops.decoder_layers.__func__

    def counted(self, *args, **kwargs):
        calls.append(1)
        return decoder_layers(self, *args, **kwargs)

    monkeypatch.setattr("backends.cpu.CpuLayerOps.decoder_layers", counted)
    if not stack:
        monkeypatch.setattr(LlamaModel, "_layer_stack", lambda self, ops, rows: None)
    core = EngineCore(EngineConfig(backend="cpu", num_kv_blocks=256, **fields), model=model)
    outputs = [bits(o) for o in run_prompts(core, prompt_ids, PARAMS)]
    monkeypatch.undo()
    return outputs, len(calls)


# The default model (Q4_1 weights, a Q8_0 LM head): its default int8 cache, a float32 one,
# int16 activations, batch invariance (the row tiles and fixed-order attention), and prompts
# cut into chunks of 48 tokens (prefill chunks beside decodes).
@pytest.mark.parametrize("fields", [{}, {"kv_cache_dtype": "float32"}, {"activation_quantization": "int16"},
                                    {"batch_invariant": True}, {"max_num_batched_tokens": 48}],
                         ids=["default", "fp32-cache", "int16", "invariant", "chunked"])
def test_the_stack_gives_the_bits_of_the_layer_loop_on_the_default_model(monkeypatch, fields):
    ids = prompts(40000)
    want, loop_calls = run(monkeypatch, False, ids, **fields)
    got, stack_calls = run(monkeypatch, True, ids, **fields)
    assert loop_calls == 0 and stack_calls >= PARAMS.max_tokens - 1  # (a first step of 410 tokens may tile)
    assert got == want


def packed_model(**fields) -> LlamaModel:
    """Random weights whose products are packed (Q8_M, as --quantization int8 makes them), so
    that the stack can take them."""
    config = LlamaConfig(vocab_size=512, hidden_size=128, intermediate_size=320, num_layers=3, num_heads=4,
                         num_kv_heads=2, head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0,
                         max_position_embeddings=1024, tie_word_embeddings=True, eos_token_id=2, **fields)
    weights = {name: quantize_q8_m(w) if name.endswith("_proj.weight") else w
               for name, w in dummy_weights(config, seed=4)}
    return LlamaModel.from_state_dict(config, weights, torch.float32, "cpu")


# Qwen2's qkv bias; Mistral's window on every layer (shorter than the longer prompts), and one
# layer of three windowed; the attention's soft-cap (a Llama-shaped model with Gemma 2's cap).
@pytest.mark.parametrize("fields", [dict(attention_bias=True), dict(layer_windows=(24, 24, 24)),
                                    dict(layer_windows=(None, 40, None)), dict(attn_logit_softcapping=5.0)],
                         ids=["qkv-bias", "windows", "one-window", "softcap"])
def test_the_stack_gives_the_bits_of_the_layer_loop_on_other_shapes(monkeypatch, fields):
    model = packed_model(**fields)
    ids = prompts(512)
    want, _ = run(monkeypatch, False, ids, model=model, kv_cache_dtype="float32", max_num_batched_tokens=64)
    got, stack_calls = run(monkeypatch, True, ids, model=model, kv_cache_dtype="float32", max_num_batched_tokens=64)
    assert stack_calls > 0 and got == want


def test_models_the_stack_cannot_run_take_the_loop():
    ops = CpuAttentionBackend().layer_ops
    assert packed_model()._layer_stack(ops, 1) is not None
    dense = LlamaModel.from_state_dict(packed_model().config, dict(dummy_weights(packed_model().config, seed=4)),
                                       torch.float32, "cpu")
    assert dense._layer_stack(ops, 1) is None  # torch's GEMM for dense products
    assert packed_model(hidden_act="gelu_pytorch_tanh")._layer_stack(ops, 1) is None
    gemma2 = packed_model(model_type="gemma2")
    assert gemma2.layers[0].attn_out_norm is not None and gemma2._layer_stack(ops, 1) is None
    big = packed_model()
    assert big._layer_stack(ops, big.layers[0].o_proj.max_kernel_rows + 1) is None  # dequantized tiles there


def test_the_stack_checks_its_arguments(monkeypatch):
    model = packed_model()
    backend = CpuAttentionBackend()
    stack, activations = model._layer_stack(backend.layer_ops, 1)
    with pytest.raises(ValueError, match="one KV cache"):
        backend.layer_ops._stack_layers(stack, [], None)
    with pytest.raises(ValueError, match="contiguous float32"):
        backend.layer_ops.decoder_layers(stack, activations, torch.zeros(1, 64), None, [], None)
