"""The CPU library's fused layer ops against the torch reference (``backends.layer_ops``)."""

from __future__ import annotations

import pytest
import torch

from backends import native
from backends.cpu import CpuAttentionBackend
from backends.layer_ops import TORCH_LAYER_OPS, Rope
from backends.reference import TorchAttentionBackend
from tests.conftest import on_every_core


@pytest.fixture(scope="module")
def cpu() -> CpuAttentionBackend:
    return CpuAttentionBackend()


# 1 and 7 tokens run on one thread; 300 x 576 is past the size where a second joins.
@pytest.mark.parametrize("rows, hidden", [(1, 576), (7, 64), (300, 576), (3, 13)])
@pytest.mark.parametrize("with_residual", [False, True])
def test_rms_norm_matches_torch(cpu, rows, hidden, with_residual):
    gen = torch.Generator().manual_seed(rows * hidden)
    x = torch.randn(rows, hidden, generator=gen) * 3
    residual = torch.randn(rows, hidden, generator=gen) if with_residual else None
    weight = torch.randn(hidden, generator=gen)
    want, want_residual = TORCH_LAYER_OPS.add_rms_norm(x, None if residual is None else residual.clone(), weight, 1e-5)
    got, got_residual = on_every_core(cpu.layer_ops.add_rms_norm, x, residual, weight, 1e-5)
    # The residual sum is one rounding either way; the norm sums its squares in another order.
    assert torch.equal(got_residual, want_residual)
    torch.testing.assert_close(got, want, rtol=2e-6, atol=2e-6)
    if with_residual:
        assert got_residual is residual  # updated in place, as the interface allows


def test_rms_norm_falls_back_to_torch_off_fp32(cpu):
    x = torch.randn(4, 64, dtype=torch.bfloat16)
    weight = torch.randn(64, dtype=torch.bfloat16)
    got, _ = cpu.layer_ops.add_rms_norm(x, x.clone(), weight, 1e-5)
    want, _ = TORCH_LAYER_OPS.add_rms_norm(x, x.clone(), weight, 1e-5)
    assert torch.equal(got, want)


def rope_case(num_tokens=5, num_heads=6, num_kv_heads=2, head_dim=16, block_size=4, num_blocks=8, seed=0,
              rotary_dim=16):
    gen = torch.Generator().manual_seed(seed)
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=gen)
    angles = torch.arange(64, dtype=torch.float32)[:, None] * torch.rand(rotary_dim // 2, generator=gen)[None, :]
    positions = torch.randint(0, 64, (num_tokens,), generator=gen)
    slots = torch.randperm(num_blocks * block_size, generator=gen)[:num_tokens]
    if num_tokens > 1:
        slots[1] = -1  # a padding token: query rotated, nothing stored
    cache = torch.zeros(2, num_blocks, block_size, num_kv_heads, head_dim)
    return qkv, Rope(positions, angles.cos(), angles.sin()), cache, slots


@pytest.mark.parametrize("num_tokens", [1, 5, 700])
@pytest.mark.parametrize("rotary_dim", [16, 12], ids=["full", "partial"])  # partial: Phi-4-mini's 3/4 of a head
def test_rope_write_kv_is_bit_equal_to_torch(cpu, num_tokens, rotary_dim):
    qkv, rope, cache, slots = rope_case(num_tokens, num_blocks=200, rotary_dim=rotary_dim)
    want_cache = cache.clone()
    want_q = TORCH_LAYER_OPS.rope_write_kv(TorchAttentionBackend(), qkv, rope, 6, 2, want_cache, slots)
    got_q = cpu.layer_ops.rope_write_kv(cpu, qkv, Rope(rope.positions, rope.cos_table, rope.sin_table), 6, 2,
                                        cache, slots)
    assert torch.equal(got_q, want_q)
    assert torch.equal(cache, want_cache)
    assert cache.abs().sum() > 0


@pytest.mark.parametrize("change, words", [
    (lambda qkv, rope, cache, slots: (qkv[:, :-16].contiguous(), rope, cache, slots), "do not hold"),
    (lambda qkv, rope, cache, slots: (qkv, rope, cache[:, :, :, :1].contiguous(), slots), "heads do not match"),
    (lambda qkv, rope, cache, slots: (qkv, rope, cache, slots[:2]), "one entry per token"),
    (lambda qkv, rope, cache, slots: (qkv, rope, cache, slots.int()), "slot_mapping must be torch.int64"),
    (lambda qkv, rope, cache, slots: (qkv, Rope(rope.positions, rope.cos_table[:, :4].contiguous(),
                                                rope.sin_table), cache, slots), "rotary table"),
    (lambda qkv, rope, cache, slots: (qkv[:, ::2], rope, cache, slots), "contiguous"),
])
def test_rope_write_kv_checks_its_arguments(cpu, change, words):
    qkv, rope, cache, slots = change(*rope_case())
    with pytest.raises(ValueError, match=words):
        cpu.layer_ops.rope_write_kv(cpu, qkv, rope, 6, 2, cache, slots)


def test_rope_write_kv_refuses_positions_and_slots_out_of_range(cpu):
    qkv, rope, cache, slots = rope_case()
    for positions, bad_slots in ((rope.positions + 64, slots), (rope.positions, slots + 1000)):
        with pytest.raises(native.NativeKernelError, match="outside"):
            cpu.layer_ops.rope_write_kv(cpu, qkv, Rope(positions, rope.cos_table, rope.sin_table), 6, 2, cache,
                                        bad_slots)


def test_silu_mul_is_torch_s_to_a_few_ulp_and_the_same_bits_on_every_path(cpu):
    gen = torch.Generator().manual_seed(5)
    special = [0.0, -0.0, 1e-30, -1e-30, 20.0, -20.0, 87.0, -87.0, 88.0, -88.0, 88.5, -88.5, 88.7, -88.7, 100.0,
               -100.0, 1e4, -1e4]
    gate = torch.cat([torch.tensor(special), torch.randn(2030, generator=gen) * 6])  # 2048 values
    up = torch.randn(gate.shape[0], generator=gen)
    # One row of 2048 takes the vector path for every value (where the CPU has AVX2); 2048 rows
    # of one value take the scalar path for each: the same bits either way.
    vector = cpu.layer_ops.silu_mul(torch.cat([gate, up])[None])[0]
    scalar = cpu.layer_ops.silu_mul(torch.stack([gate, up], dim=1))[:, 0]
    assert torch.equal(vector, scalar)
    want = TORCH_LAYER_OPS.silu_mul(torch.cat([gate, up])[None])[0]
    torch.testing.assert_close(vector, want, rtol=4e-7, atol=0)
    assert torch.equal(vector.signbit(), want.signbit())  # (-0 where torch's is)


def test_silu_mul_falls_back_to_torch_off_fp32(cpu):
    gate_up = torch.randn(3, 64, dtype=torch.bfloat16)
    assert torch.equal(cpu.layer_ops.silu_mul(gate_up), TORCH_LAYER_OPS.silu_mul(gate_up))
