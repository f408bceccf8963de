"""The cpu backend's one-call layer stack (``CpuLayerOps.decoder_layers``, native
``pa_cpu_decoder_layers``) against the layer-by-layer loop it replaces: the same ops in the same
order, so every token and logprob must be the same bits, in every configuration it takes."""

from __future__ import annotations

import random

import attrs
import pytest
import torch

from backends.base import AttentionMetadata
from backends.cpu import CpuAttentionBackend
from backends.native import NativeKernelError
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


def run(monkeypatch, stack: bool, prompt_ids, model=None, **fields) -> tuple[list, list[str]]:
    """Every prompt's bits, and how the products took x in each forward pass that took the stack."""
    calls = []
    decoder_layers = CpuAttentionBackend().layer_ops.decoder_layers.__func__

    def counted(self, backend, stack, activations, *args):
        calls.append(activations)
        return decoder_layers(self, backend, stack, activations, *args)

    monkeypatch.setattr("backends.cpu.CpuLayerOps.decoder_layers", counted)
    if not stack:
        monkeypatch.setattr(LlamaModel, "_layer_stack", lambda self, ops, rows: None)
    core = EngineCore(EngineConfig(backend="cpu", num_kv_blocks=256, **fields), model=model)
    outputs = [bits(o) for o in run_prompts(core, prompt_ids, PARAMS)]
    monkeypatch.undo()
    return outputs, calls


# The default model (Q4_1 weights, a Q8_0 LM head): its default int8 cache, a float32 one,
# int16 activations (two requests at a time, so that decode steps have the two rows int16 takes),
# batch invariance (the row tiles and fixed-order attention), and prompts cut into chunks of 48
# tokens (prefill chunks beside decodes).
@pytest.mark.parametrize("fields, activations", [
    ({}, "float32"), ({"kv_cache_dtype": "float32"}, "float32"),
    ({"activation_quantization": "int16", "max_num_seqs": 2}, "int16"),
    ({"batch_invariant": True}, "fixed_order"), ({"max_num_batched_tokens": 48}, "float32")],
    ids=["default", "fp32-cache", "int16", "invariant", "chunked"])
def test_the_stack_gives_the_bits_of_the_layer_loop_on_the_default_model(monkeypatch, fields, activations):
    ids = prompts(40000)
    want, loop_calls = run(monkeypatch, False, ids, **fields)
    got, stack_calls = run(monkeypatch, True, ids, **fields)
    assert loop_calls == [] and len(stack_calls) >= PARAMS.max_tokens - 1  # (a first step of 410 tokens may tile)
    assert activations in stack_calls
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
    # (one block table: with a table per layer group the stack is not used, engine/kv_groups.py)
    one_table = dict(kv_cache_dtype="float32", max_num_batched_tokens=64, disable_hybrid_kv_cache_manager=True)
    want, _ = run(monkeypatch, False, ids, model=model, **one_table)
    got, stack_calls = run(monkeypatch, True, ids, model=model, **one_table)
    assert stack_calls and got == want


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


def engine_step_inputs(model: LlamaModel):
    """What one decode step of one token hands the stack: caches, rotary angles, metadata."""
    backend = CpuAttentionBackend()
    cfg = model.config
    caches = [torch.zeros(backend.kv_cache_shape(4, 16, cfg.num_kv_heads, cfg.head_dim)) for _ in model.layers]
    meta = AttentionMetadata(query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
                             seq_lens=torch.tensor([1], dtype=torch.int32),
                             block_tables=torch.tensor([[0]], dtype=torch.int32), slot_mapping=torch.tensor([0]),
                             max_query_len=1, max_seq_len=1)
    return backend, caches, model.rotary.at(torch.tensor([0])), meta


def test_the_stack_checks_its_arguments():
    model = packed_model()
    backend, caches, rope, meta = engine_step_inputs(model)
    stack, activations = model._layer_stack(backend.layer_ops, 1)
    with pytest.raises(ValueError, match="one KV cache"):
        backend.layer_ops.decoder_layers(backend, stack, activations, torch.zeros(1, 128), rope, caches[:1], meta)
    with pytest.raises(ValueError, match="contiguous float32"):
        backend.layer_ops.decoder_layers(backend, stack, activations, torch.zeros(1, 64), rope, caches, meta)
    layers = list(stack.layers)
    layers[1] = attrs.evolve(layers[1], o=layers[0].gate_up)  # a product that does not chain
    with pytest.raises(ValueError, match="layer 1 o: a \\[640, 128\\] weight where the stack needs \\[128, 128\\]"):
        backend.layer_ops.decoder_layers(backend, attrs.evolve(stack, layers=tuple(layers), native=[]), activations,
                                         torch.zeros(1, 128), rope, caches, meta)
    out = backend.layer_ops.decoder_layers(backend, stack, activations, torch.randn(1, 128), rope, caches, meta)
    assert out.shape == (1, 128) and torch.isfinite(out).all() and caches[0].abs().sum() > 0


def test_a_failing_product_is_an_error_with_the_packed_library_s_message():
    model = packed_model()
    backend, caches, rope, meta = engine_step_inputs(model)
    stack, activations = model._layer_stack(backend.layer_ops, 1)
    matrix, bias = stack.layers[0].qkv

    class Unknown:  # a weight in a layout the packed library does not know
        type_id, n, k, data = 77, matrix.n, matrix.k, matrix.data

    layers = (attrs.evolve(stack.layers[0], qkv=(Unknown(), bias)), *stack.layers[1:])
    with pytest.raises(NativeKernelError, match="decoder layers: a matrix product failed: .*type"):
        backend.layer_ops.decoder_layers(backend, attrs.evolve(stack, layers=layers, native=[]), activations,
                                         torch.randn(1, 128), rope, caches, meta)
