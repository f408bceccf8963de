"""The ``torch`` backend: paged attention in plain PyTorch, the oracle other backends are tested against.

Decode rows (one new token per sequence) are batched: their blocks are gathered into a
padded ``[B, max_seq_len]`` tensor and masked. Every sequence with more than one new token
(prefill, chunked prefill over a cached prefix) is done on its own with a causal mask.
"""

from __future__ import annotations

import torch

from backends.base import AttentionMetadata

# Cache layout: [2 (K, V), num_blocks, block_size, num_kv_heads, head_size].
KEY, VALUE = 0, 1


class TorchAttentionBackend:
    name = "torch"

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        # key, value: [T, num_kv_heads, head_size]
        keep = slot_mapping >= 0
        if not bool(keep.all()):
            key, value, slot_mapping = key[keep], value[keep], slot_mapping[keep]
        flat = kv_cache.view(2, -1, *kv_cache.shape[3:])  # [2, num_slots, num_kv_heads, head_size]
        flat[KEY].index_copy_(0, slot_mapping, key)
        flat[VALUE].index_copy_(0, slot_mapping, value)

    def attend(
        self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float, out: torch.Tensor
    ) -> torch.Tensor:
        plan = meta.scratch.get("torch")
        if plan is None:
            plan = meta.scratch["torch"] = _Plan.build(meta, kv_cache.shape[2])
        if plan.decode_rows.numel():
            _decode(query, kv_cache, plan, scale, out)
        for row_start, row_end, seq_len, blocks in plan.prefills:
            _prefill_one(query[row_start:row_end], kv_cache, blocks, seq_len, scale, out[row_start:row_end])
        return out


class _Plan:
    """Per-step index tensors, derived once from the metadata and reused by every layer."""

    def __init__(self) -> None:
        self.decode_rows = torch.empty(0, dtype=torch.long)
        self.decode_blocks = torch.empty(0, 0, dtype=torch.long)  # [Bd, max_blocks]
        self.decode_pad_mask = torch.empty(0, 0, dtype=torch.bool)  # [Bd, S]: True past seq_len
        self.prefills: list[tuple[int, int, int, torch.Tensor]] = []  # (row_start, row_end, seq_len, blocks)

    @classmethod
    def build(cls, meta: AttentionMetadata, block_size: int) -> _Plan:
        plan = cls()
        starts = meta.query_start_loc.tolist()
        seq_lens = meta.seq_lens.tolist()
        decode_seqs = []
        for i, seq_len in enumerate(seq_lens):
            num_blocks = -(-seq_len // block_size)
            if starts[i + 1] - starts[i] == 1:
                decode_seqs.append(i)
            elif starts[i + 1] > starts[i]:
                plan.prefills.append((starts[i], starts[i + 1], seq_len, meta.block_tables[i, :num_blocks].long()))
        if decode_seqs:
            index = torch.tensor(decode_seqs)
            lens = meta.seq_lens[index].long()
            max_blocks = -(-int(lens.max()) // block_size)
            plan.decode_rows = meta.query_start_loc[index].long()
            plan.decode_blocks = meta.block_tables[index, :max_blocks].long()
            plan.decode_pad_mask = torch.arange(max_blocks * block_size) >= lens[:, None]
        return plan


def _decode(query: torch.Tensor, kv_cache: torch.Tensor, plan: _Plan, scale: float, out: torch.Tensor) -> None:
    num_seqs = plan.decode_rows.shape[0]
    num_heads, head_size = query.shape[1:]
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    q = query[plan.decode_rows].view(num_seqs, num_kv_heads, group, head_size)
    k = kv_cache[KEY][plan.decode_blocks].flatten(1, 2)  # [Bd, S, num_kv_heads, head_size]
    v = kv_cache[VALUE][plan.decode_blocks].flatten(1, 2)
    scores = torch.einsum("bkgd,bskd->bkgs", q.float(), k.float()) * scale
    scores.masked_fill_(plan.decode_pad_mask[:, None, None, :], float("-inf"))
    probs = scores.softmax(dim=-1)
    result = torch.einsum("bkgs,bskd->bkgd", probs, v.float())
    out[plan.decode_rows] = result.reshape(num_seqs, num_heads, head_size).to(out.dtype)


def _prefill_one(
    query: torch.Tensor, kv_cache: torch.Tensor, blocks: torch.Tensor, seq_len: int, scale: float, out: torch.Tensor
) -> None:
    # query: [L, num_heads, head_size], the last L of seq_len tokens
    num_queries, num_heads, head_size = query.shape
    num_kv_heads = kv_cache.shape[3]
    group = num_heads // num_kv_heads
    k = kv_cache[KEY][blocks].flatten(0, 1)[:seq_len]  # [S, num_kv_heads, head_size]
    v = kv_cache[VALUE][blocks].flatten(0, 1)[:seq_len]
    q = query.view(num_queries, num_kv_heads, group, head_size)
    scores = torch.einsum("lkgd,skd->kgls", q.float(), k.float()) * scale
    query_pos = torch.arange(seq_len - num_queries, seq_len)
    future = torch.arange(seq_len)[None, :] > query_pos[:, None]  # [L, S]
    scores.masked_fill_(future, float("-inf"))
    probs = scores.softmax(dim=-1)
    result = torch.einsum("kgls,skd->lkgd", probs, v.float())
    out.copy_(result.reshape(num_queries, num_heads, head_size))
