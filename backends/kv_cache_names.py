"""The KV cache element types by name, without torch (the command line and the engine's
configuration read them before anything loads); ``backends.kv_cache`` says what each is."""

from __future__ import annotations

KV_CACHE_DTYPE_NAMES = ("float32", "bfloat16", "float16", "fp8_e4m3", "fp8_e5m2", "int8")
KV_CACHE_DTYPE_ALIASES = {"fp8": "fp8_e4m3"}  # vLLM's name for e4m3
# The ones each backend keeps (for some model dtype: the cuda backend's float caches are the
# model's own dtype), so that the command line refuses a wrong pair before anything loads.
# Each backend's kv_cache_dtypes_for is the full rule.
BACKEND_KV_CACHE_DTYPES = {"torch": KV_CACHE_DTYPE_NAMES, "cpu": KV_CACHE_DTYPE_NAMES,
                           "triton": KV_CACHE_DTYPE_NAMES, "cuda": KV_CACHE_DTYPE_NAMES[:5]}


def kv_cache_dtype_refusal(backend: str, kv_cache_dtype: str) -> str | None:
    """Why ``backend`` (a name; ``auto`` is decided later) cannot keep a ``kv_cache_dtype`` cache, or None."""
    name = KV_CACHE_DTYPE_ALIASES.get(kv_cache_dtype, kv_cache_dtype)
    supported = BACKEND_KV_CACHE_DTYPES.get(backend)
    if supported is None or name == "auto" or name in supported:
        return None
    return f"the {backend} backend cannot keep its KV cache in {name}; it can do {', '.join(supported)}"
