"""The torch reference backend against dense causal attention computed from scratch.

Random shuffled block tables, decode and prefill rows mixed in one batch, chunks over a
cached prefix, GQA, empty (negative) slots skipped by write_kv.
"""

from __future__ import annotations

import pytest
import torch

from backends.base import AttentionMetadata
from backends.reference import TorchAttentionBackend


def dense_attention(q, k, v, scale, window=None, softcap=None):
    # q: [L, H, D] (the last L of S positions); k, v: [S, Hkv, D]
    group = q.shape[1] // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    scores = torch.einsum("lhd,shd->hls", q, k) * scale
    if softcap is not None:
        scores = softcap * torch.tanh(scores / softcap)
    seq_len, num_q = k.shape[0], q.shape[0]
    keys, queries = torch.arange(seq_len)[None, :], torch.arange(seq_len - num_q, seq_len)[:, None]
    hidden = keys > queries
    if window is not None:
        hidden |= keys <= queries - window
    scores = scores.masked_fill(hidden, float("-inf"))
    return torch.einsum("hls,shd->lhd", scores.softmax(-1), v)


@pytest.mark.parametrize("block_size, head_size, num_heads, num_kv_heads", [
    (16, 64, 9, 3), (32, 128, 8, 1), (16, 64, 4, 4),
])
@pytest.mark.parametrize("window, softcap", [(None, None), (17, None), (None, 2.0), (1, None), (40, 3.0)],
                         ids=["causal", "window", "softcap", "window-1", "window-softcap"])
def test_matches_dense_attention(block_size, head_size, num_heads, num_kv_heads, window, softcap):
    gen = torch.Generator().manual_seed(0)
    backend = TorchAttentionBackend()
    # (cached tokens, new tokens) per sequence: decodes, a prefill, a chunk over a prefix, a single token prompt
    seqs = [(40, 1), (0, 37), (100, 1), (50, 20), (0, 1), (3, 1)]
    num_blocks = 64
    cache = torch.zeros(backend.kv_cache_shape(num_blocks, block_size, num_kv_heads, head_size))
    free = torch.randperm(num_blocks, generator=gen).tolist()
    full_k, full_v, tables, queries, slots = [], [], [], [], []
    for cached, new in seqs:
        total = cached + new
        table = [free.pop() for _ in range(-(-total // block_size))]
        tables.append(table)
        k = torch.randn(total, num_kv_heads, head_size, generator=gen)
        v = torch.randn(total, num_kv_heads, head_size, generator=gen)
        full_k.append(k)
        full_v.append(v)
        seq_slots = torch.tensor([table[p // block_size] * block_size + p % block_size for p in range(total)])
        backend.write_kv(k[:cached], v[:cached], cache, seq_slots[:cached])  # the cached prefix
        slots.append(seq_slots[cached:])
        queries.append(torch.randn(new, num_heads, head_size, generator=gen))
    new_k = torch.cat([k[c:] for k, (c, _) in zip(full_k, seqs)])
    new_v = torch.cat([v[c:] for v, (c, _) in zip(full_v, seqs)])
    slot_mapping = torch.cat(slots)
    # An extra padding row with slot -1 must be skipped by write_kv.
    backend.write_kv(torch.cat([new_k, torch.full_like(new_k[:1], 4096.0)]),
                     torch.cat([new_v, torch.full_like(new_v[:1], 4096.0)]), cache,
                     torch.cat([slot_mapping, torch.tensor([-1])]))
    width = max(len(t) for t in tables)
    meta = AttentionMetadata(
        query_start_loc=torch.tensor([0] + torch.tensor([n for _, n in seqs]).cumsum(0).tolist(), dtype=torch.int32),
        seq_lens=torch.tensor([c + n for c, n in seqs], dtype=torch.int32),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        slot_mapping=slot_mapping,
        max_query_len=max(n for _, n in seqs),
        max_seq_len=max(c + n for c, n in seqs),
    )
    query = torch.cat(queries)
    out = torch.empty_like(query)
    scale = head_size**-0.5
    backend.attend(query, cache, meta, scale, out, window=window, softcap=softcap)
    expected = torch.cat([dense_attention(q, k, v, scale, window, softcap) for q, k, v in zip(queries, full_k, full_v)])
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)
    assert not (cache == 4096.0).any()
