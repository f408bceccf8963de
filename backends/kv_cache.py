"""The KV cache's element types: names, storage, bytes, and their conversions in torch.

One layer's cache is a tensor ``[2 (K, V), num_blocks, block_size, num_kv_heads, row]`` whose
torch dtype says its element type (every backend reads it from there). A row is one token's
K (or V) of one KV head: ``head_size`` elements, and for ``int8`` a float16 scale after them
(two more int8 elements' worth): x = q * scale, scale = max|x| / 127 per row, set when the row
is written (like llama.cpp's q8_0, one scale per row of a head). ``fp8_e4m3`` / ``fp8_e5m2``
rows hold x / the layer's scale, saturated at the format's largest value; the layer's K and V
scales (``kv_scales``, float32 ``[2]``) are 1.0 unless calibrated (``--calculate-kv-scales``),
as in vLLM. ``native/include/kv_dtype.h`` converts the same way in C++, bit for bit.
"""

from __future__ import annotations

import attrs
import torch

from backends.kv_cache_names import KV_CACHE_DTYPE_ALIASES

KEY, VALUE = 0, 1
INT8_SCALE_ELEMENTS = 2  # an int8 row's float16 scale, in int8 elements
INT8_MIN_SCALE = 2.0 ** -14  # scales stay normal float16s


@attrs.frozen
class KVCacheDtype:
    name: str
    storage: torch.dtype  # the cache tensor's element type
    code: int  # enum pa_dtype of native/include/paged_attention.h
    max_value: float | None = None  # fp8: the largest finite value (stores saturate there)

    @property
    def is_fp8(self) -> bool:
        return self.max_value is not None

    def row_elements(self, head_size: int) -> int:
        return head_size + (INT8_SCALE_ELEMENTS if self.storage == torch.int8 else 0)

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_size: int) -> int:
        """K and V of one token over every layer."""
        element = torch.empty((), dtype=self.storage).element_size()
        return 2 * num_layers * num_kv_heads * self.row_elements(head_size) * element


KV_CACHE_DTYPES = {spec.name: spec for spec in (
    KVCacheDtype("float32", torch.float32, 0),
    KVCacheDtype("bfloat16", torch.bfloat16, 1),
    KVCacheDtype("float16", torch.float16, 2),
    KVCacheDtype("fp8_e4m3", torch.float8_e4m3fn, 3, 448.0),
    KVCacheDtype("fp8_e5m2", torch.float8_e5m2, 4, 57344.0),
    KVCacheDtype("int8", torch.int8, 5),
)}
ALIASES = KV_CACHE_DTYPE_ALIASES
CHOICES = ("auto", *KV_CACHE_DTYPES, *ALIASES)
_BY_STORAGE = {spec.storage: spec for spec in KV_CACHE_DTYPES.values()}


def kv_cache_dtype(name: str) -> KVCacheDtype:
    """The element type called ``name`` (not ``auto``: a backend resolves that)."""
    spec = KV_CACHE_DTYPES.get(ALIASES.get(name, name))
    if spec is None:
        raise ValueError(f"unknown KV cache dtype {name!r}; choose from {', '.join(CHOICES)}")
    return spec


def same_as(model_dtype: torch.dtype) -> KVCacheDtype:
    """The element type that keeps a model's own dtype (what ``auto`` is on most backends)."""
    return _BY_STORAGE[model_dtype]


def dtype_of(kv_cache: torch.Tensor) -> KVCacheDtype:
    """The element type of a cache tensor, from its torch dtype."""
    spec = _BY_STORAGE.get(kv_cache.dtype)
    if spec is None:
        raise ValueError(f"a KV cache of {kv_cache.dtype} is not one of {', '.join(KV_CACHE_DTYPES)}")
    return spec


def to_rows(x: torch.Tensor, spec: KVCacheDtype, scale: torch.Tensor | None = None) -> torch.Tensor:
    """``x`` (``[..., head_size]``, any float dtype) as cache rows of ``spec`` (``[..., row]``).
    ``scale``: the layer's fp8 scale for this half (a 0-d float32 tensor), or None for 1.0."""
    if spec.storage == torch.int8:
        x = x.float()
        amax = x.abs().amax(-1, keepdim=True)
        row_scale = (amax / 127).clamp_min(INT8_MIN_SCALE).to(torch.float16)
        q = torch.round(x / row_scale.float()).clamp(-127, 127).to(torch.int8)
        return torch.cat([q, row_scale.view(torch.int8)], dim=-1)
    if spec.is_fp8:
        x = x.float()
        if scale is not None:
            x = x * (1 / scale)  # (the reciprocal first, as the kernels compute it)
        return x.clamp(-spec.max_value, spec.max_value).to(spec.storage)
    return x.to(spec.storage)


def from_rows(rows: torch.Tensor, dtype: torch.dtype, scale: torch.Tensor | None = None) -> torch.Tensor:
    """Cache rows (``[..., row]``) back as ``[..., head_size]`` values of ``dtype``."""
    spec = dtype_of(rows)
    if spec.storage == torch.int8:
        head_size = rows.shape[-1] - INT8_SCALE_ELEMENTS
        row_scale = rows[..., head_size:].contiguous().view(torch.float16).float()
        return (rows[..., :head_size].float() * row_scale).to(dtype)
    if spec.is_fp8:
        values = rows.float()
        return (values if scale is None else values * scale).to(dtype)
    return rows.to(dtype)


def resolve_kv_cache_dtype(name: str, backend, model_dtype: torch.dtype) -> KVCacheDtype:
    """The element type ``name`` (``auto``: the backend's choice for ``model_dtype``), checked
    against what ``backend`` can keep; ``ValueError`` names the ones it can."""
    spec = kv_cache_dtype(backend.auto_kv_cache_dtype(model_dtype) if name == "auto" else name)
    supported = backend.kv_cache_dtypes_for(model_dtype)
    if spec.name not in supported:
        raise ValueError(f"the {backend.name} backend cannot keep this model's KV cache in {spec.name}; "
                         f"it can do {', '.join(supported)}")
    return spec
