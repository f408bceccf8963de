"""The ``cuda`` backend: the CUDA paged-attention library through cffi, on torch's current stream.

Its KV cache is in the model's dtype (``auto``) or fp8 (e4m3 or e5m2, with the layer's scales).
"""

from __future__ import annotations

import torch

from backends import kv_cache as kvc
from backends import native
from backends.base import AttentionMetadata, cache_shape
from backends.layer_ops import TORCH_LAYER_OPS

DTYPES = (torch.float32, torch.bfloat16, torch.float16)
FP8 = ("fp8_e4m3", "fp8_e5m2")


class CudaAttentionBackend:
    name = "cuda"
    model_dtypes = DTYPES
    layer_ops = TORCH_LAYER_OPS
    device_type = "cuda"  # the library's kernels read device pointers

    def __init__(self, lib=None) -> None:
        if lib is None:
            lib = native.load_library("pa_cuda", "cuda")
            native.check_abi(lib, "pa_cuda")
        self._lib = lib

    def kv_cache_dtypes_for(self, model_dtype: torch.dtype) -> tuple[str, ...]:
        return (kvc.same_as(model_dtype).name, *FP8)

    def auto_kv_cache_dtype(self, model_dtype: torch.dtype) -> str:
        return kvc.same_as(model_dtype).name  # as vLLM's auto: fp8 is asked for by name

    kv_cache_shape = staticmethod(cache_shape)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_scales: torch.Tensor | None = None) -> None:
        key, value = key.contiguous(), value.contiguous()
        shape = native.write_kv_shape(key, value, kv_cache, slot_mapping, DTYPES, self.kv_cache_dtypes_for(key.dtype))
        self._check_device(key)
        rc = self._lib.pa_cuda_write_kv(shape, native.ptr(key), native.ptr(value), native.ptr(kv_cache),
                                        native.ptr(slot_mapping, "int64_t *"),
                                        native.scales_pointer(kv_scales, key.device), self._stream(key))
        native.check_rc(rc, self._lib, "pa_cuda", "write_kv")

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               out: torch.Tensor, window: int | None = None, softcap: float | None = None,
               kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        query = query.contiguous()
        shape = native.attention_shape(query, kv_cache, meta, out, DTYPES, self.kv_cache_dtypes_for(query.dtype))
        for name, t in (("query", query), ("kv_cache", kv_cache)):  # the kernel reads rows 16 bytes at a time
            if t.data_ptr() % 16:
                raise ValueError(f"{name} must start at a 16-byte aligned address")
        self._check_device(query)
        workspace = self._workspace(shape, meta, query.device)
        rc = self._lib.pa_cuda_attention(shape, native.ptr(out), native.ptr(query), native.ptr(kv_cache),
                                         native.scales_pointer(kv_scales, query.device),
                                         native.ptr(meta.query_start_loc, "int32_t *"),
                                         native.ptr(meta.seq_lens, "int32_t *"),
                                         native.ptr(meta.block_tables, "int32_t *"), scale, window or 0,
                                         softcap or 0.0,
                                         native.ptr(workspace), workspace.numel(), self._stream(query))
        native.check_rc(rc, self._lib, "pa_cuda", "attention")
        return out

    def _workspace(self, shape, meta: AttentionMetadata, device: torch.device) -> torch.Tensor:
        """Split-KV partials, sized once per step and shared by every layer."""
        workspace = meta.scratch.get("cuda_workspace")
        if workspace is None:
            size = max(int(self._lib.pa_cuda_workspace_bytes(shape)), 1)
            workspace = meta.scratch["cuda_workspace"] = torch.empty(size, dtype=torch.uint8, device=device)
        return workspace

    def _check_device(self, t: torch.Tensor) -> None:
        if t.device.type != self.device_type:
            raise ValueError(f"the {self.name} backend needs {self.device_type.upper()} tensors; got {t.device}")

    @staticmethod
    def _stream(t: torch.Tensor):
        return native.ffi().cast("void *", torch.cuda.current_stream(t.device).cuda_stream)


def unavailable_reason() -> str | None:
    """Why the cuda backend cannot run here, or None if it can."""
    return native.cuda_unavailable_reason("pa_cuda")
