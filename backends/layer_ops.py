"""The small per-layer ops around attention: RMSNorm with the residual add before it, and the
rotary embedding with the K/V cache write after the qkv product.

``TorchLayerOps`` is the reference: the same operations, in the same order, as transformers'
Llama. A backend may fuse them natively (``backends.cpu.CpuLayerOps``: one call where torch
makes 6-10 dispatches); the model asks its attention backend for ``layer_ops``.
"""

from __future__ import annotations

from functools import cached_property
from typing import TYPE_CHECKING

import attrs
import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from backends.packed import PackedMatrix


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Same order of operations as transformers' LlamaRMSNorm, so fp32 results match bit for bit.
    # (In fp32 the two conversions are skipped: each no-op conversion is still a dispatch.)
    if x.dtype == torch.float32:
        return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    # x: [T, num_heads, head_dim], halves rotated as in transformers' Llama; cos, sin: [T, 1,
    # rotary_dim / 2]: a partial rotary (Phi-4-mini) turns the first rotary_dim values of a head.
    rotary_dim = 2 * cos.shape[-1]
    if rotary_dim != x.shape[-1]:
        return torch.cat((apply_rotary(x[..., :rotary_dim], cos, sin), x[..., rotary_dim:]), dim=-1)
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)


class Rope:
    """One step's rotary angles: the tokens' positions and the tables ``[max_positions, rotary_dim / 2]``.

    ``cos`` and ``sin`` (``[T, 1, rotary_dim / 2]``, shared by every layer) are gathered on first
    use; a fused op reads the tables by position instead.
    """

    def __init__(self, positions: torch.Tensor, cos_table: torch.Tensor, sin_table: torch.Tensor) -> None:
        self.positions, self.cos_table, self.sin_table = positions, cos_table, sin_table

    @cached_property
    def cos(self) -> torch.Tensor:
        return self.cos_table[self.positions][:, None, :]

    @cached_property
    def sin(self) -> torch.Tensor:
        return self.sin_table[self.positions][:, None, :]


class TorchLayerOps:
    """The reference implementations, in torch, for any device and dtype."""

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        """``(rms_norm(x + residual), x + residual)`` (just ``x`` without a residual).

        The residual stream is threaded through the layers this way (as vLLM does) so that a
        fused version can add and normalize in one pass; it may update ``residual`` in place.
        """
        if residual is not None:
            x = x + residual
        return rms_norm(x, weight, eps), x

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        """SwiGLU's ``silu(gate) * up`` for ``gate_up`` ``[T, 2 * intermediate]`` (gate first)."""
        gate, up = gate_up.chunk(2, dim=-1)
        return F.silu(gate) * up

    def rope_write_kv(self, backend, qkv: torch.Tensor, rope: Rope, num_heads: int, num_kv_heads: int,
                      kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        """Rotates q and k of ``qkv`` (``[T, (num_heads + 2 num_kv_heads) * head_dim]``), stores k
        and v in ``kv_cache`` through ``backend`` (with the layer's fp8 ``kv_scales``), and returns
        q, ``[T, num_heads, head_dim]``."""
        num_tokens = qkv.shape[0]
        head_dim = qkv.shape[1] // (num_heads + 2 * num_kv_heads)
        qk, v = qkv.split([(num_heads + num_kv_heads) * head_dim, num_kv_heads * head_dim], dim=-1)
        # q and k rotated in one pass (the same elementwise products as two)
        qk = apply_rotary(qk.view(num_tokens, num_heads + num_kv_heads, head_dim), rope.cos, rope.sin)
        q, k = qk.split([num_heads, num_kv_heads], dim=1)
        backend.write_kv(k, v.reshape(num_tokens, num_kv_heads, head_dim), kv_cache, slot_mapping, kv_scales)
        return q


TORCH_LAYER_OPS = TorchLayerOps()


@attrs.frozen(eq=False)
class StackLayer:
    """One Llama-shaped decoder layer as a backend's one-call stack runs it (``decoder_layers``:
    the cpu backend's): each product a packed library matrix (``backends.packed.PackedMatrix``)
    and its float32 bias or None."""

    qkv: tuple["PackedMatrix", torch.Tensor | None]
    o: tuple["PackedMatrix", torch.Tensor | None]
    gate_up: tuple["PackedMatrix", torch.Tensor | None]
    down: tuple["PackedMatrix", torch.Tensor | None]
    input_norm: torch.Tensor
    mlp_norm: torch.Tensor
    window: int | None


@attrs.frozen(eq=False)
class LayerStack:
    """A model's decoder layers and final norm, for a backend's ``decoder_layers``. ``native``
    holds what the backend built from them for the caches it last ran over."""

    layers: tuple[StackLayer, ...]
    final_norm: torch.Tensor
    hidden: int
    num_heads: int
    num_kv_heads: int
    head_size: int
    scale: float
    softcap: float | None
    eps: float
    native: list = attrs.field(factory=list)
