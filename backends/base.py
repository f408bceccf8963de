"""The attention backend interface: one varlen paged-attention call for prefill, decode and mixed batches."""

from __future__ import annotations

from typing import Any, Protocol

import attrs
import torch

from backends.kv_cache import KVCacheDtype


@attrs.define(eq=False)
class AttentionMetadata:
    """Where each sequence's tokens sit in the flat batch and in the paged KV cache.

    Built once per step by the model runner and shared by every layer. Sequence ``i`` owns
    query rows ``query_start_loc[i]:query_start_loc[i+1]``; those are its newest tokens, and
    they attend causally to its first ``seq_lens[i]`` tokens (cached prefix + themselves),
    whose K/V live in blocks ``block_tables[i, :]``.

    ``scratch`` holds what a backend derives from these once per step (index tensors,
    masks) so that the 30-odd layers that follow reuse it; only backends write it.
    """

    query_start_loc: torch.Tensor  # [B + 1] int32
    seq_lens: torch.Tensor  # [B] int32, cached + new tokens
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32
    slot_mapping: torch.Tensor  # [T] int64, cache slot (block * block_size + offset) per new token; < 0 skips
    max_query_len: int
    max_seq_len: int
    scratch: dict[str, Any] = attrs.field(factory=dict)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]


def cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                kv_dtype: KVCacheDtype | None = None) -> tuple[int, ...]:
    """One layer's cache tensor (K and V together), every backend's layout: rows of ``kv_dtype``
    (see ``backends.kv_cache``; None: plain rows of head_size elements)."""
    row = head_size if kv_dtype is None else kv_dtype.row_elements(head_size)
    return (2, num_blocks, block_size, num_kv_heads, row)


class AttentionBackend(Protocol):
    """What the model needs from an attention implementation.

    The cache's element type is its tensor's dtype (``backends.kv_cache``); ``kv_scales`` is the
    layer's float32 ``[2]`` K and V scales of an fp8 cache (None: 1.0)."""

    name: str
    layer_ops: Any  # backends.layer_ops.TorchLayerOps or a fused subclass of it
    model_dtypes: tuple[torch.dtype, ...]  # what a model may compute in with it

    def kv_cache_dtypes_for(self, model_dtype: torch.dtype) -> tuple[str, ...]:
        """The cache element types it reads and writes for a model computing in ``model_dtype``
        (``backends.kv_cache`` names)."""
        ...

    def auto_kv_cache_dtype(self, model_dtype: torch.dtype) -> str:
        """The element type ``--kv-cache-dtype auto`` picks for a model computing in ``model_dtype``."""
        ...

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                       kv_dtype: KVCacheDtype | None = None) -> tuple[int, ...]:
        """Shape of one layer's cache tensor (K and V together)."""
        ...

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_scales: torch.Tensor | None = None) -> None:
        """Store new tokens' K/V (``[T, num_kv_heads, head_size]``) at their slots."""
        ...

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               out: torch.Tensor, window: int | None = None, softcap: float | None = None,
               kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        """Attention of ``query`` (``[T, num_heads, head_size]``) over the paged cache into ``out`` (same shape).

        ``window``: a query at position p sees only the keys k with p - window < k <= p (a
        sliding-window layer; transformers' convention). ``softcap``: each score s (after
        ``scale``) becomes softcap * tanh(s / softcap) before the softmax (Gemma 2)."""
        ...
