"""The ``torch`` backend: paged attention in plain PyTorch, the oracle other backends are tested against.

Each sequence's blocks are gathered with ``index_select`` into a contiguous
``[seq_len, num_kv_heads, head_size]`` run and handed (as a strided view, no further copy)
to ``scaled_dot_product_attention`` with an explicit mask. Decode rows (one new token per
sequence) are batched: sequences of similar length share one padded gather, so padding
stays small. The query heads of a GQA group ride along as extra query rows of their KV
head, so K/V is never repeated. A sliding-window layer narrows the masks; logit soft-capping
(Gemma 2) computes the scores explicitly, since ``scaled_dot_product_attention`` has no cap.
A cache of another element type than the query's (``backends.kv_cache``) is converted as it is
gathered.
"""

from __future__ import annotations

import attrs
import torch
import torch.nn.functional as F

from backends import kv_cache as kvc
from backends.base import AttentionMetadata, cache_shape
from backends.kv_cache import KEY, VALUE
from backends.layer_ops import TORCH_LAYER_OPS

# A decode bucket holds sequences whose lengths are within this factor of its longest, so a
# padded gather reads at most 1 / BUCKET_RATIO times the K/V it needs.
BUCKET_RATIO = 0.75


class TorchAttentionBackend:
    name = "torch"
    model_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    layer_ops = TORCH_LAYER_OPS
    # --batch-invariant: each query row attends alone, over exactly the keys it sees (no padded
    # buckets, no rows of a prompt together), so its sums follow its position alone (_attend_rows)
    batch_invariant = False
    def kv_cache_dtypes_for(self, model_dtype: torch.dtype) -> tuple[str, ...]:
        return tuple(kvc.KV_CACHE_DTYPES)

    def auto_kv_cache_dtype(self, model_dtype: torch.dtype) -> str:
        return kvc.same_as(model_dtype).name  # the oracle keeps what the model computes

    kv_cache_shape = staticmethod(cache_shape)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_scales: torch.Tensor | None = None) -> None:
        # key, value: [T, num_kv_heads, head_size]
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
        spec = kvc.dtype_of(kv_cache)
        scales = (None, None) if kv_scales is None else (kv_scales[KEY], kv_scales[VALUE])
        flat = kv_cache.view(2, -1, *kv_cache.shape[3:])  # [2, num_slots, num_kv_heads, row]
        for part, rows in ((KEY, key), (VALUE, value)):
            rows = kvc.to_rows(rows, spec, scales[part])
            if spec.is_fp8:  # (torch has no index_copy_ for fp8: the bytes are copied)
                flat[part].view(torch.uint8).index_copy_(0, slot_mapping, rows.view(torch.uint8))
            else:
                flat[part].index_copy_(0, slot_mapping, rows)

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               out: torch.Tensor, window: int | None = None, softcap: float | None = None,
               kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        plan = meta.scratch.get(("torch", window))  # (a sliding-window layer has its own masks)
        if plan is None:
            group = query.shape[1] // kv_cache.shape[3]
            plan = meta.scratch[("torch", window)] = _plan(meta, kv_cache.shape[2], group, query.device, window)
        cache = _Cache(kv_cache, query.dtype, kv_scales)
        if self.batch_invariant:
            return _attend_rows(query, cache, meta, scale, softcap, window, out)
        for bucket in plan.decode_buckets:
            _decode(query, cache, bucket, scale, softcap, out)
        for prefill in plan.prefills:
            _prefill(query, cache, prefill, scale, softcap, out)
        return out


@attrs.frozen
class _Cache:
    """One layer's cache as attention reads it: K or V rows gathered by block, in ``dtype``."""

    tensor: torch.Tensor
    dtype: torch.dtype
    scales: torch.Tensor | None

    @property
    def num_kv_heads(self) -> int:
        return self.tensor.shape[3]

    def gather(self, part: int, blocks: torch.Tensor, num_seqs: int) -> torch.Tensor:
        """``[num_seqs, kv_heads, S, head_size]`` (a strided view of one gathered copy)."""
        gathered = self.tensor[part].index_select(0, blocks)
        if gathered.dtype != self.dtype:
            gathered = kvc.from_rows(gathered, self.dtype, None if self.scales is None else self.scales[part])
        return gathered.view(num_seqs, -1, *gathered.shape[2:]).transpose(1, 2)


@attrs.frozen
class _DecodeBucket:
    rows: torch.Tensor  # [B] query rows
    blocks: torch.Tensor  # [B * max_blocks] block ids, row-major
    mask: torch.Tensor  # [B, 1, 1, S] True where the key position is inside the sequence (and the window)


@attrs.frozen
class _Prefill:
    row_start: int
    row_end: int
    seq_len: int
    blocks: torch.Tensor  # [num_blocks] block ids
    mask: torch.Tensor  # [group * L, S] causal (and windowed), True where allowed (a copy per query head of a group)


@attrs.frozen
class _Plan:
    decode_buckets: list[_DecodeBucket]
    prefills: list[_Prefill]


def _plan(meta: AttentionMetadata, block_size: int, group: int, device: torch.device, window: int | None) -> _Plan:
    """Per-step index tensors, derived once from the metadata and reused by every layer.
    With a ``window``, a query at position p sees the keys k with p - window < k <= p."""
    starts = meta.query_start_loc.tolist()
    seq_lens = meta.seq_lens.tolist()
    decodes, prefills = [], []
    for i, seq_len in enumerate(seq_lens):
        num_queries = starts[i + 1] - starts[i]
        if num_queries == 1:
            decodes.append(i)
        elif num_queries > 1:
            num_blocks = -(-seq_len // block_size)
            positions = torch.arange(seq_len, device=device)
            queries = positions[seq_len - num_queries:, None]
            mask = positions[None, :] <= queries
            if window is not None:
                mask &= positions[None, :] > queries - window
            prefills.append(_Prefill(starts[i], starts[i + 1], seq_len,
                                     meta.block_tables[i, :num_blocks].long(), mask.repeat(group, 1)))
    decodes.sort(key=lambda i: seq_lens[i], reverse=True)
    buckets = []
    while decodes:
        longest = seq_lens[decodes[0]]
        size = next((n for n, i in enumerate(decodes) if seq_lens[i] < BUCKET_RATIO * longest), len(decodes))
        buckets.append(_bucket(meta, decodes[:size], longest, block_size, starts, device, window))
        decodes = decodes[size:]
    return _Plan(buckets, prefills)


def _bucket(meta: AttentionMetadata, seqs: list[int], longest: int, block_size: int, starts: list[int],
            device: torch.device, window: int | None) -> _DecodeBucket:
    index = torch.tensor(seqs, device=device)
    num_blocks = -(-longest // block_size)
    lens = meta.seq_lens[index].long()
    positions = torch.arange(num_blocks * block_size, device=device)[None, :]
    mask = positions < lens[:, None]
    if window is not None:
        mask &= positions >= lens[:, None] - window
    rows = torch.tensor([starts[i] for i in seqs], device=device)
    blocks = meta.block_tables[index, :num_blocks].long().flatten()
    return _DecodeBucket(rows, blocks, mask[:, None, None, :])


def _scores_softmax_values(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor, scale: float,
                           softcap: float | None) -> torch.Tensor:
    """softmax(q k^T * scale) v over the keys ``mask`` allows; with ``softcap``, the scores
    become softcap * tanh(score / softcap) first (Gemma 2), in transformers' order."""
    if softcap is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
    scores = torch.matmul(q, k.transpose(-1, -2)) * scale
    scores = torch.tanh(scores / softcap) * softcap
    return torch.matmul(scores.masked_fill(~mask, float("-inf")).softmax(-1), v)


def _decode(query: torch.Tensor, cache: _Cache, bucket: _DecodeBucket, scale: float,
            softcap: float | None, out: torch.Tensor) -> None:
    num_seqs = bucket.rows.shape[0]
    num_heads, head_size = query.shape[1:]
    num_kv_heads = cache.num_kv_heads
    q = query.index_select(0, bucket.rows).view(num_seqs, num_kv_heads, num_heads // num_kv_heads, head_size)
    k = cache.gather(KEY, bucket.blocks, num_seqs)  # [B, kv_heads, S, head_size]
    v = cache.gather(VALUE, bucket.blocks, num_seqs)
    result = _scores_softmax_values(q, k, v, bucket.mask, scale, softcap)  # [B, kv_heads, group, D]
    out.index_copy_(0, bucket.rows, result.reshape(num_seqs, num_heads, head_size))


def _prefill(query: torch.Tensor, cache: _Cache, prefill: _Prefill, scale: float, softcap: float | None,
             out: torch.Tensor) -> None:
    q = query[prefill.row_start:prefill.row_end]  # [L, heads, head_size], the last L of seq_len positions
    num_queries, num_heads, head_size = q.shape
    num_kv_heads = cache.num_kv_heads
    group = num_heads // num_kv_heads
    k = cache.gather(KEY, prefill.blocks, 1)[0, :, :prefill.seq_len]  # [kv_heads, S, head_size]
    v = cache.gather(VALUE, prefill.blocks, 1)[0, :, :prefill.seq_len]
    # Each KV head's group of query heads becomes group * L query rows: [kv_heads, group * L, head_size].
    q = q.view(num_queries, num_kv_heads, group, head_size).permute(1, 2, 0, 3).reshape(num_kv_heads, -1, head_size)
    result = _scores_softmax_values(q, k, v, prefill.mask, scale, softcap)
    result = result.view(num_kv_heads, group, num_queries, head_size).permute(2, 0, 1, 3)
    out[prefill.row_start:prefill.row_end] = result.reshape(num_queries, num_heads, head_size)


def _attend_rows(query: torch.Tensor, cache: _Cache, meta: AttentionMetadata, scale: float, softcap: float | None,
                 window: int | None, out: torch.Tensor) -> torch.Tensor:
    """Every query row on its own, against a contiguous copy of exactly the keys it sees: the
    products' shapes, and so their sums, depend on the row's position (and window) alone, the
    same for a decode row and for that position in a prompt, whatever else the step holds."""
    block_size = cache.tensor.shape[2]
    num_heads, head_size = query.shape[1:]
    group = num_heads // cache.num_kv_heads
    starts, seq_lens = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    for i, seq_len in enumerate(seq_lens):
        num_queries = starts[i + 1] - starts[i]
        if num_queries == 0:
            continue
        blocks = meta.block_tables[i, :-(-seq_len // block_size)].long()
        keys = cache.gather(KEY, blocks, 1)[0, :, :seq_len]  # [kv_heads, S, head_size]
        values = cache.gather(VALUE, blocks, 1)[0, :, :seq_len]
        for row in range(num_queries):
            position = seq_len - num_queries + row
            first = 0 if window is None else max(0, position - window + 1)
            k = keys[:, first:position + 1].contiguous()
            v = values[:, first:position + 1].contiguous()
            q = query[starts[i] + row].view(cache.num_kv_heads, group, head_size)
            scores = torch.matmul(q, k.transpose(-1, -2)) * scale  # [kv_heads, group, keys]
            if softcap is not None:
                scores = torch.tanh(scores / softcap) * softcap
            out[starts[i] + row] = torch.matmul(scores.softmax(-1), v).view(num_heads, head_size)
    return out
