"""The ``cpu`` backend: the C++ paged-attention library (AVX2/FMA or portable, OpenMP) through cffi."""

from __future__ import annotations

import torch

from backends import native
from backends.base import AttentionMetadata

DTYPES = (torch.float32, torch.bfloat16)


class CpuAttentionBackend:
    name = "cpu"

    def __init__(self, lib=None) -> None:
        self._lib = lib if lib is not None else native.load_library("pa_cpu", "cpu")

    @property
    def isa(self) -> str:
        """The vector path the library chose for this CPU ("avx2+fma" or "portable")."""
        return native.ffi().string(self._lib.pa_cpu_isa()).decode()

    def kv_cache_shape(self, num_blocks: int, block_size: int, num_kv_heads: int, head_size: int) -> tuple[int, ...]:
        return (2, num_blocks, block_size, num_kv_heads, head_size)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        key, value = key.contiguous(), value.contiguous()
        shape = native.write_kv_shape(key, value, kv_cache, slot_mapping, DTYPES)
        rc = self._lib.pa_cpu_write_kv(shape, native.ptr(key), native.ptr(value), native.ptr(kv_cache),
                                       native.ptr(slot_mapping, "int64_t *"))
        native.check_rc(rc, self._lib, "pa_cpu", "write_kv")

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               out: torch.Tensor) -> torch.Tensor:
        query = query.contiguous()
        shape = native.attention_shape(query, kv_cache, meta, out, DTYPES)
        rc = self._lib.pa_cpu_attention(shape, native.ptr(out), native.ptr(query), native.ptr(kv_cache),
                                        native.ptr(meta.query_start_loc, "int32_t *"),
                                        native.ptr(meta.seq_lens, "int32_t *"),
                                        native.ptr(meta.block_tables, "int32_t *"), scale)
        native.check_rc(rc, self._lib, "pa_cpu", "attention")
        return out
