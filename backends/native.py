"""Loading the native libraries with cffi (ABI mode) and checking arguments before every call.

A raw pointer carries no dtype, device, shape or layout, so everything the C side assumes
is checked here first; a violation raises ``ValueError`` naming the argument.
"""

from __future__ import annotations

import os
import re
from functools import cache
from pathlib import Path

import torch
from cffi import FFI

from backends import kv_cache as kvc
from backends.base import AttentionMetadata
from backends.errors import BackendUnavailableError

HEADER = Path(__file__).resolve().parent.parent / "native" / "include" / "paged_attention.h"
ABI_VERSION = int(re.search(r"#define PA_ABI_VERSION (\d+)", HEADER.read_text()).group(1))
LIB_DIR = Path(os.environ.get("ENGINE_NATIVE_LIB_DIR") or Path(__file__).resolve().parent / "lib")
DTYPE_CODES = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}


class NativeKernelError(RuntimeError):
    """A native kernel reported an error; the message is the library's (e.g. CUDA's)."""


def _cdef_source(header: Path = HEADER) -> str:
    """The header's declarations, without preprocessor lines, C++ guards or comments (cffi parses plain C)."""
    text = re.sub(r"/\*.*?\*/", "", header.read_text(), flags=re.S)
    text = re.sub(r"#ifdef __cplusplus.*?#endif", "", text, flags=re.S)
    return "\n".join(line for line in text.splitlines() if not line.lstrip().startswith("#"))


def ffi(header: Path = HEADER) -> FFI:
    """The one FFI instance of ``header`` (types from two instances do not mix)."""
    return _ffi(header)  # (cached per path: called for every pointer passed, so nothing costly here)


@cache
def _ffi(header: Path) -> FFI:
    instance = FFI()
    instance.cdef(_cdef_source(header))
    return instance


def load_library(name: str, backend: str, header: Path = HEADER, what: str = "attention backend"):
    """``dlopen`` ``lib{name}.so`` (declared by ``header``), or explain how to build it."""
    path = LIB_DIR / f"lib{name}.so"
    if not path.exists():
        raise BackendUnavailableError(
            f"the {backend} {what} needs {path.name}, which is not built in {LIB_DIR}: "
            f"run `python native/build.py` (or reinstall: pip install -e .)")
    try:
        return ffi(header).dlopen(str(path))
    except OSError as exc:
        raise BackendUnavailableError(f"the {backend} {what} could not load {path}: {exc}") from exc


def check_abi(lib, prefix: str) -> None:
    """Refuse a library built from other sources than these (a stale build after an update)."""
    try:
        version = getattr(lib, f"{prefix}_abi_version")()
    except AttributeError:  # (older than the version function itself)
        version = None
    if version != ABI_VERSION:
        raise BackendUnavailableError(
            f"lib{prefix}.so in {LIB_DIR} was built from other sources (ABI {version}; these need {ABI_VERSION}): "
            "run `python native/build.py` (or reinstall: pip install -e .)")


def cuda_unavailable_reason(library: str) -> str | None:
    """Why the CUDA library ``lib{library}.so`` cannot run here, or None if it can."""
    if not torch.cuda.is_available():
        return "no CUDA GPU is visible to torch (is this a CPU-only torch build, or no GPU?)"
    if not (LIB_DIR / f"lib{library}.so").exists():
        return f"lib{library}.so is not built in {LIB_DIR}: install nvcc and run `python native/build.py`"
    return None


@cache
def _attention_ffi() -> FFI:
    return _ffi(HEADER)


def ptr(tensor: torch.Tensor, kind: str = "void *"):
    # (called ~10 times a layer: the FFI is looked up without hashing the header's path)
    return _attention_ffi().cast(kind, tensor.data_ptr())


def _check_tensor(name: str, t: torch.Tensor, dtype: torch.dtype, device: torch.device, ndim: int) -> None:
    if t.dtype != dtype:
        raise ValueError(f"{name} must be {dtype}; got {t.dtype}")
    if t.device != device:
        raise ValueError(f"{name} must be on {device}; got {t.device}")
    if t.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions; got shape {tuple(t.shape)}")
    if not t.is_contiguous():
        raise ValueError(f"{name} must be contiguous")


# The checks below run for every layer of every step: each message is formatted only when
# its check fails.

def check_rows(name: str, rows: torch.Tensor, twin_name: str, twin: torch.Tensor, kv_cache: torch.Tensor,
               dtypes: tuple[torch.dtype, ...], kv_dtypes: tuple[str, ...]) -> kvc.KVCacheDtype:
    """``rows`` ([tokens, heads, head_size]) in a supported dtype; ``twin`` shaped like it; the
    5-d cache of a supported element type, its rows holding head_size values; all contiguous,
    on one device. Returns the cache's element type."""
    if rows.dtype not in dtypes:
        raise ValueError(f"{name} dtype {rows.dtype} is not supported here (supported: {dtypes})")
    _check_tensor(name, rows, rows.dtype, rows.device, 3)
    _check_tensor(twin_name, twin, rows.dtype, rows.device, 3)
    if twin.shape != rows.shape:
        raise ValueError(f"{twin_name} shape {tuple(twin.shape)} differs from {name} {tuple(rows.shape)}")
    return check_cache(kv_cache, rows.device, rows.shape[-1], kv_dtypes)


def check_cache(kv_cache: torch.Tensor, device: torch.device, head_size: int,
                kv_dtypes: tuple[str, ...]) -> kvc.KVCacheDtype:
    spec = kvc.dtype_of(kv_cache)
    if spec.name not in kv_dtypes:
        raise ValueError(f"a {spec.name} KV cache is not supported here (supported: {', '.join(kv_dtypes)})")
    _check_tensor("kv_cache", kv_cache, kv_cache.dtype, device, 5)
    if kv_cache.shape[0] != 2:
        raise ValueError("kv_cache must be [2, num_blocks, block_size, num_kv_heads, row]")
    if kv_cache.shape[4] != spec.row_elements(head_size):
        raise ValueError(f"kv_cache rows of {kv_cache.shape[4]} elements do not hold {spec.name} rows of "
                         f"head_size {head_size}")
    return spec


def scales_pointer(kv_scales: torch.Tensor | None, device: torch.device):
    """A layer's fp8 scales (float32 [2]) as the kernels take them, or NULL for 1.0."""
    if kv_scales is None:  # (every layer, every step: the FFI without hashing the header's path)
        return _attention_ffi().NULL
    _check_tensor("kv_scales", kv_scales, torch.float32, device, 1)
    if kv_scales.shape[0] != 2:
        raise ValueError("kv_scales must hold two values (K, V)")
    return ptr(kv_scales, "float *")


def attention_shape(query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, out: torch.Tensor,
                    dtypes: tuple[torch.dtype, ...], kv_dtypes: tuple[str, ...]):
    """Check everything ``*_attention`` assumes; return the filled ``pa_shape``."""
    spec = check_rows("query", query, "out", out, kv_cache, dtypes, kv_dtypes)
    num_tokens, num_heads, head_size = query.shape
    return _attention_shape(num_tokens, num_heads, head_size, kv_cache, spec, meta, DTYPE_CODES[query.dtype])


def stack_shape(num_tokens: int, num_heads: int, num_kv_heads: int, head_size: int, kv_cache: torch.Tensor,
                meta: AttentionMetadata, kv_dtypes: tuple[str, ...]):
    """Check a float32 layer stack's cache and metadata (``pa_cpu_decoder_layers``); return the
    filled ``pa_shape``."""
    spec = check_cache(kv_cache, meta.seq_lens.device, head_size, kv_dtypes)
    if kv_cache.shape[3] != num_kv_heads:
        raise ValueError(f"the cache holds {kv_cache.shape[3]} KV heads, the model {num_kv_heads}")
    return _attention_shape(num_tokens, num_heads, head_size, kv_cache, spec, meta, DTYPE_CODES[torch.float32])


def _attention_shape(num_tokens: int, num_heads: int, head_size: int, kv_cache: torch.Tensor,
                     spec: kvc.KVCacheDtype, meta: AttentionMetadata, dtype_code: int):
    device = kv_cache.device
    _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    if num_heads % num_kv_heads:
        raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    num_seqs = meta.seq_lens.shape[0]
    _check_tensor("query_start_loc", meta.query_start_loc, torch.int32, device, 1)
    _check_tensor("seq_lens", meta.seq_lens, torch.int32, device, 1)
    _check_tensor("block_tables", meta.block_tables, torch.int32, device, 2)
    if meta.query_start_loc.shape[0] != num_seqs + 1:
        raise ValueError("query_start_loc must have num_seqs + 1 entries")
    if meta.block_tables.shape[0] != num_seqs:
        raise ValueError("block_tables must have one row per sequence")
    if meta.max_seq_len > meta.block_tables.shape[1] * block_size:
        raise ValueError("max_seq_len exceeds what block_tables can address")
    return _shape(num_tokens, num_seqs, num_heads, num_kv_heads, head_size, block_size, num_blocks,
                  meta.block_tables.shape[1], meta.max_query_len, meta.max_seq_len, dtype_code, spec.code)


def write_kv_shape(key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                   dtypes: tuple[torch.dtype, ...], kv_dtypes: tuple[str, ...]):
    """Check everything ``*_write_kv`` assumes; return the filled ``pa_shape``."""
    device = key.device
    spec = check_rows("key", key, "value", value, kv_cache, dtypes, kv_dtypes)
    _check_tensor("slot_mapping", slot_mapping, torch.int64, device, 1)
    if slot_mapping.shape[0] != key.shape[0]:
        raise ValueError("slot_mapping needs one slot per token")
    _, num_blocks, block_size, num_kv_heads, _ = kv_cache.shape
    head_size = key.shape[2]
    if key.shape[1] != num_kv_heads:
        raise ValueError("key rows do not match the cache's num_kv_heads")
    return _shape(key.shape[0], 0, num_kv_heads, num_kv_heads, head_size, block_size, num_blocks, 0, 0, 0,
                  DTYPE_CODES[key.dtype], spec.code)


def rope_write_kv_shape(qkv: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                        num_heads: int, num_kv_heads: int, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                        kv_dtypes: tuple[str, ...]):
    """Check everything ``pa_cpu_rope_write_kv`` assumes (float32); return the filled ``pa_shape``."""
    device = qkv.device
    _check_tensor("qkv", qkv, torch.float32, device, 2)
    num_tokens, width = qkv.shape
    head_size = width // (num_heads + 2 * num_kv_heads)
    if width != (num_heads + 2 * num_kv_heads) * head_size or head_size % 2:
        raise ValueError(f"qkv rows of {width} values do not hold {num_heads} + 2 x {num_kv_heads} heads "
                         "of an even head_size")
    spec = check_cache(kv_cache, device, head_size, kv_dtypes)
    _, num_blocks, block_size, cache_kv_heads, _ = kv_cache.shape
    if cache_kv_heads != num_kv_heads:
        raise ValueError("qkv's heads do not match the cache's num_kv_heads")
    check_rope(num_tokens, head_size, positions, cos, sin, slot_mapping, device)
    return _shape(num_tokens, 0, num_heads, num_kv_heads, head_size, block_size, num_blocks, 0, 0, 0,
                  DTYPE_CODES[torch.float32], spec.code)


def check_rope(num_tokens: int, head_size: int, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
               slot_mapping: torch.Tensor, device: torch.device) -> None:
    """What ``pa_cpu_rope_write_kv`` assumes of the positions, the rotary tables and the slots
    (all on ``device``, the activations')."""
    for name, t in (("positions", positions), ("slot_mapping", slot_mapping)):
        _check_tensor(name, t, torch.int64, device, 1)
        if t.shape[0] != num_tokens:
            raise ValueError(f"{name} needs one entry per token")
    for name, t in (("cos", cos), ("sin", sin)):
        _check_tensor(name, t, torch.float32, device, 2)
        if t.shape != cos.shape or not 0 < t.shape[1] <= head_size // 2:
            raise ValueError(f"rotary table {name} must be [max_positions, rotary_dim / 2 <= {head_size // 2}]")


def _shape(*values: int):
    """A ``pa_shape`` from its fields in declaration order (num_tokens ... dtype, kv_dtype)."""
    return ffi().new("pa_shape *", values)


def check_rc(rc: int, lib, prefix: str, what: str) -> None:
    if rc != 0:
        message = ffi().string(getattr(lib, f"{prefix}_last_error")()).decode()
        raise NativeKernelError(f"{what} failed: {message}")
