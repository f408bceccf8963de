"""The ``triton`` backend: unified varlen paged attention and the cache write, in Triton.

One program per (query token, KV head, key split): it holds the GQA group's query heads as
the rows of a tile (padded to 16 for ``tl.dot``), walks its share of the sequence's cache
blocks up to the causal limit, and keeps an online softmax per row. When the batch alone
would give the GPU too few programs (a few sequences decoding long contexts), the keys are
split and a second kernel merges the splits' (max, sum, acc) partials by log-sum-exp. A
sliding-window layer walks only its window's blocks (the splits then cover the window). CI
runs it on the CPU under ``TRITON_INTERPRET=1`` (which must be set before triton is
imported).

The cache may be of any of ``backends.kv_cache``'s element types: fp8 and int8 rows are read
as bytes and converted in the kernel (fp8 through float16 bits, int8 times its row's float16
scale), so that no fp8 support of the GPU or of the interpreter is needed; rows are converted
for writing by the same torch code as the torch backend's, then scattered by a kernel.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from backends import kv_cache as kvc
from backends.base import AttentionMetadata, cache_shape
from backends.layer_ops import TORCH_LAYER_OPS

MIN_DOT = 16  # tl.dot needs every dimension >= 16
MIN_PROGRAMS = 512  # split the keys when (tokens x KV heads) is below this...
MIN_SPLIT_KEYS = 128  # ...but never into splits shorter than this
# How the kernel reads a cache's elements (KV_KIND): as they are, fp8 e4m3 / e5m2 bytes, int8 + scale.
PLAIN, E4M3, E5M2, INT8 = 0, 1, 2, 3
KV_KINDS = {"fp8_e4m3": E4M3, "fp8_e5m2": E5M2, "int8": INT8}


@triton.jit
def _load_rows(cache_ptr, offs, mask, row_start, KV_KIND: tl.constexpr, HEAD_SIZE: tl.constexpr,
               DTYPE: tl.constexpr):
    """Cache elements at ``offs`` (rows starting at ``row_start``) as values of DTYPE."""
    if KV_KIND == 0:
        x = tl.load(cache_ptr + offs, mask=mask, other=0.0).to(DTYPE)
    elif KV_KIND == 3:  # int8 values, then the row's float16 scale in its next two bytes
        q = tl.load(cache_ptr + offs, mask=mask, other=0).to(tl.float32)
        lo = tl.load(cache_ptr + row_start + HEAD_SIZE, mask=mask, other=0).to(tl.uint8).to(tl.uint16)
        hi = tl.load(cache_ptr + row_start + HEAD_SIZE + 1, mask=mask, other=0).to(tl.uint8).to(tl.uint16)
        scale = (lo | (hi << 8)).to(tl.float16, bitcast=True).to(tl.float32)
        x = (q * scale).to(DTYPE)
    else:
        b = tl.load(cache_ptr + offs, mask=mask, other=0).to(tl.uint16)
        if KV_KIND == 2:  # e5m2: the high byte of a float16
            x = (b << 8).to(tl.float16, bitcast=True).to(tl.float32).to(DTYPE)
        else:  # e4m3: its magnitude bits moved up 7 read as a float16 of 1/256 its value
            h = ((b & 0x80) << 8) | ((b & 0x7F) << 7)
            x = (h.to(tl.float16, bitcast=True).to(tl.float32) * 256.0).to(DTYPE)
    return x


@triton.jit
def _write_kv_kernel(key_ptr, value_ptr, cache_ptr, slot_ptr, kv_half, ROW: tl.constexpr, ROW_PAD: tl.constexpr):
    token = tl.program_id(0)
    slot = tl.load(slot_ptr + token)
    if slot >= 0:
        offs = tl.arange(0, ROW_PAD)
        mask = offs < ROW
        key = tl.load(key_ptr + token * ROW + offs, mask=mask)
        value = tl.load(value_ptr + token * ROW + offs, mask=mask)
        tl.store(cache_ptr + slot * ROW + offs, key, mask=mask)
        tl.store(cache_ptr + kv_half + slot * ROW + offs, value, mask=mask)


@triton.jit
def _online_softmax_step(q, k, v, key_mask, m, l, acc, scale, softcap, IEEE: tl.constexpr, SOFTCAP: tl.constexpr):
    """One block of keys into the rows' running (max, sum, weighted V): the flash-attention step."""
    if IEEE:
        s = tl.dot(q, tl.trans(k), input_precision="ieee") * scale
    else:
        s = tl.dot(q, tl.trans(k)) * scale
    if SOFTCAP:  # softcap * tanh(s / softcap), tanh from exp (saturates to +-1, no overflow)
        s = (1.0 - 2.0 / (tl.exp(2.0 * s / softcap) + 1.0)) * softcap
    s = tl.where(key_mask[None, :], s, float("-inf"))  # [GROUP_PAD, BLOCK_SIZE]
    m_new = tl.maximum(m, tl.max(s, axis=1))
    p = tl.exp(s - m_new[:, None])
    correction = tl.exp(m - m_new)
    l = l * correction + tl.sum(p, axis=1)
    if IEEE:
        acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v, input_precision="ieee")
    else:
        acc = acc * correction[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l, acc


@triton.jit
def _attention_kernel(out_ptr, partial_ptr, q_ptr, cache_ptr, scales_ptr, token_seq_ptr, qsl_ptr, seq_lens_ptr,
                      tables_ptr, scale, softcap, window, kv_half, max_blocks, split_blocks, NUM_HEADS: tl.constexpr,
                      NUM_KV_HEADS: tl.constexpr,
                      GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_SIZE: tl.constexpr, ROW: tl.constexpr,
                      BLOCK_SIZE: tl.constexpr, IEEE: tl.constexpr, SPLIT: tl.constexpr, WINDOW: tl.constexpr,
                      SOFTCAP: tl.constexpr, KV_KIND: tl.constexpr, SCALES: tl.constexpr):
    token = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq = tl.load(token_seq_ptr + token)
    q_start = tl.load(qsl_ptr + seq)
    q_len = tl.load(qsl_ptr + seq + 1) - q_start
    visible = tl.load(seq_lens_ptr + seq) - q_len + (token - q_start) + 1  # causal: keys [0, visible)
    first = tl.maximum(visible - window, 0) if WINDOW else 0  # a sliding window's first key

    offs_g = tl.arange(0, GROUP_PAD)
    offs_d = tl.arange(0, HEAD_SIZE)
    offs_k = tl.arange(0, BLOCK_SIZE)
    row_mask = offs_g < GROUP
    q_offs = (token * NUM_HEADS + kv_head * GROUP + offs_g[:, None]) * HEAD_SIZE + offs_d[None, :]
    q = tl.load(q_ptr + q_offs, mask=row_mask[:, None], other=0.0)  # [GROUP_PAD, HEAD_SIZE]
    v_scale = 1.0
    if SCALES:  # an fp8 cache's layer scales: K's joins the score scale, V's multiplies the result
        scale = scale * tl.load(scales_ptr)
        v_scale = tl.load(scales_ptr + 1)

    m = tl.full([GROUP_PAD], float("-inf"), dtype=tl.float32)
    l = tl.zeros([GROUP_PAD], dtype=tl.float32)
    acc = tl.zeros([GROUP_PAD, HEAD_SIZE], dtype=tl.float32)
    first_block = first // BLOCK_SIZE + split * split_blocks
    end_block = tl.minimum(tl.cdiv(visible, BLOCK_SIZE), first_block + split_blocks)
    for b in range(first_block, end_block):
        block = tl.load(tables_ptr + seq * max_blocks + b).to(tl.int64)
        key_mask = (b * BLOCK_SIZE + offs_k < visible) & (b * BLOCK_SIZE + offs_k >= first)
        rows = ((block * BLOCK_SIZE + offs_k[:, None]) * NUM_KV_HEADS + kv_head) * ROW
        kv_offs = rows + offs_d[None, :]
        # [BLOCK_SIZE, HEAD_SIZE], in the query's dtype
        k = _load_rows(cache_ptr, kv_offs, key_mask[:, None], rows, KV_KIND, HEAD_SIZE, q.dtype)
        v = _load_rows(cache_ptr + kv_half, kv_offs, key_mask[:, None], rows, KV_KIND, HEAD_SIZE, q.dtype)
        m, l, acc = _online_softmax_step(q, k, v, key_mask, m, l, acc, scale, softcap, IEEE, SOFTCAP)
    acc = acc * v_scale
    if SPLIT:  # partials [token, head, split, 2 + HEAD_SIZE]: max, sum, unnormalized acc
        num_splits = tl.num_programs(2)
        rows = ((token * NUM_HEADS + kv_head * GROUP + offs_g) * num_splits + split) * (HEAD_SIZE + 2)
        tl.store(partial_ptr + rows, m, mask=row_mask)
        tl.store(partial_ptr + rows + 1, l, mask=row_mask)
        tl.store(partial_ptr + rows[:, None] + 2 + offs_d[None, :], acc, mask=row_mask[:, None])
    else:
        result = acc / l[:, None]
        tl.store(out_ptr + q_offs, result.to(out_ptr.dtype.element_ty), mask=row_mask[:, None])


@triton.jit
def _merge_kernel(out_ptr, partial_ptr, num_splits, HEAD_SIZE: tl.constexpr, SPLITS_PAD: tl.constexpr):
    row = tl.program_id(0)  # token * num_heads + head
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_SIZE)
    split_mask = offs_s < num_splits
    base = (row * num_splits + offs_s) * (HEAD_SIZE + 2)
    m = tl.load(partial_ptr + base, mask=split_mask, other=float("-inf"))
    l = tl.load(partial_ptr + base + 1, mask=split_mask, other=0.0)
    acc = tl.load(partial_ptr + base[:, None] + 2 + offs_d[None, :], mask=split_mask[:, None], other=0.0)
    weight = tl.exp(m - tl.max(m, axis=0))  # 0 for empty splits (m = -inf); split 0 is never empty
    result = tl.sum(acc * weight[:, None], axis=0) / tl.sum(l * weight, axis=0)
    tl.store(out_ptr + row * HEAD_SIZE + offs_d, result.to(out_ptr.dtype.element_ty))


class TritonAttentionBackend:
    name = "triton"
    model_dtypes = (torch.float32, torch.bfloat16, torch.float16)
    layer_ops = TORCH_LAYER_OPS

    def kv_cache_dtypes_for(self, model_dtype: torch.dtype) -> tuple[str, ...]:
        return tuple(kvc.KV_CACHE_DTYPES)

    def auto_kv_cache_dtype(self, model_dtype: torch.dtype) -> str:
        return kvc.same_as(model_dtype).name  # as vLLM's auto

    kv_cache_shape = staticmethod(cache_shape)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_scales: torch.Tensor | None = None) -> None:
        num_tokens = key.shape[0]
        if num_tokens == 0:
            return
        spec = kvc.dtype_of(kv_cache)
        cache = kv_cache
        if spec.storage != key.dtype:  # rows converted as the torch backend converts them
            scales = (None, None) if kv_scales is None else (kv_scales[0], kv_scales[1])
            key, value = kvc.to_rows(key, spec, scales[0]), kvc.to_rows(value, spec, scales[1])
            if spec.is_fp8:  # (moved as bytes)
                key, value, cache = key.view(torch.uint8), value.view(torch.uint8), kv_cache.view(torch.uint8)
        row = key.shape[1] * key.shape[2]
        _write_kv_kernel[(num_tokens,)](key.contiguous(), value.contiguous(), cache, slot_mapping,
                                        kv_cache[0].numel(), ROW=row, ROW_PAD=triton.next_power_of_2(row))

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               out: torch.Tensor, window: int | None = None, softcap: float | None = None,
               kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        num_tokens, num_heads, head_size = query.shape
        spec = kvc.dtype_of(kv_cache)
        kind = KV_KINDS.get(spec.name, PLAIN)
        cache = kv_cache.view(torch.uint8) if spec.is_fp8 else kv_cache
        _, _, block_size, num_kv_heads, _ = kv_cache.shape
        group = num_heads // num_kv_heads
        token_seq = meta.scratch.get("triton_token_seq")
        if token_seq is None:  # which sequence each query row belongs to, once per step
            lengths = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).long()
            token_seq = meta.scratch["triton_token_seq"] = torch.repeat_interleave(
                torch.arange(meta.num_seqs, device=query.device, dtype=torch.int32), lengths)
        # A window spans at most window + 1 blocks (its first one partly): split that span.
        span = meta.max_seq_len if window is None else min(meta.max_seq_len, window + block_size)
        num_splits, split_blocks = _splits(num_tokens * num_kv_heads, span, block_size)
        partials = out  # unused without splits
        if num_splits > 1:  # shared by every layer of the step that splits as many times
            partials = meta.scratch.get(("triton_partials", num_splits))
            if partials is None:
                partials = meta.scratch[("triton_partials", num_splits)] = torch.empty(
                    (num_tokens, num_heads, num_splits, head_size + 2), dtype=torch.float32, device=query.device)
        with_scales = spec.is_fp8 and kv_scales is not None
        _attention_kernel[(num_tokens, num_kv_heads, num_splits)](
            out, partials, query.contiguous(), cache, kv_scales if with_scales else out, token_seq,
            meta.query_start_loc, meta.seq_lens,
            meta.block_tables, scale, softcap or 1.0, window or 0, kv_cache[0].numel(), meta.block_tables.shape[1],
            split_blocks,
            NUM_HEADS=num_heads, NUM_KV_HEADS=num_kv_heads, GROUP=group,
            GROUP_PAD=max(MIN_DOT, triton.next_power_of_2(group)), HEAD_SIZE=head_size, ROW=kv_cache.shape[4],
            BLOCK_SIZE=block_size, IEEE=query.dtype == torch.float32, SPLIT=num_splits > 1,
            WINDOW=window is not None, SOFTCAP=softcap is not None, KV_KIND=kind, SCALES=with_scales)
        if num_splits > 1:
            _merge_kernel[(num_tokens * num_heads,)](out, partials, num_splits, HEAD_SIZE=head_size,
                                                    SPLITS_PAD=triton.next_power_of_2(num_splits))
        return out


def _splits(num_programs: int, max_seq_len: int, block_size: int) -> tuple[int, int]:
    """(number of key splits, cache blocks per split) for a batch of ``num_programs``
    (token, KV head) pairs: enough splits to reach ``MIN_PROGRAMS`` programs, none shorter
    than ``MIN_SPLIT_KEYS`` keys."""
    num_blocks = triton.cdiv(max_seq_len, block_size)
    wanted = triton.cdiv(MIN_PROGRAMS, num_programs)
    most = max(1, max_seq_len // MIN_SPLIT_KEYS)
    num_splits = max(1, min(wanted, most))
    split_blocks = triton.cdiv(num_blocks, num_splits)
    return triton.cdiv(num_blocks, split_blocks), split_blocks
