"""The ``cpu`` backend: the C++ paged-attention library (AVX2/FMA/F16C or portable, OpenMP) through cffi.

It keeps a KV cache in any of ``backends.kv_cache``'s element types, converting rows in
registers as it reads them. ``auto`` is int8 (see ``auto_kv_cache_dtype``).
"""

from __future__ import annotations

import torch

from backends import kv_cache as kvc
from backends import native
from backends import packed as packed_kernels
from backends.base import AttentionMetadata, cache_shape
from backends.layer_ops import LayerStack, Rope, TorchLayerOps

DTYPES = (torch.float32, torch.bfloat16)
KV_CACHE_DTYPES = tuple(kvc.KV_CACHE_DTYPES)


class CpuAttentionBackend:
    name = "cpu"
    model_dtypes = DTYPES
    # Whether each output row is summed in an order set by its own sequence and position alone
    # (--batch-invariant): no split key ranges, one way of dotting keys (pa_cpu_attention's fixed_order)
    batch_invariant = False

    def __init__(self, lib=None) -> None:
        self._lib = lib if lib is not None else native.load_library("pa_cpu", "cpu")
        native.check_abi(self._lib, "pa_cpu")
        self.layer_ops = CpuLayerOps(self._lib)

    @property
    def isa(self) -> str:
        """The vector path the library chose for this CPU ("avx2+fma+f16c" or "portable")."""
        return native.ffi().string(self._lib.pa_cpu_isa()).decode()

    def kv_cache_dtypes_for(self, model_dtype: torch.dtype) -> tuple[str, ...]:
        return KV_CACHE_DTYPES

    def auto_kv_cache_dtype(self, model_dtype: torch.dtype) -> str:
        # int8 rows (a float16 scale per row of a head): 3.9x the tokens of float32 in the same
        # memory, 1.9x float16's, and decode attention reads a quarter of float32's bytes. On
        # the default model over 2,400 greedy positions against a float32 cache: top-1 98.9%,
        # mean KL 5.7e-4 (float16: 100%, 3.6e-7; bfloat16: 99.75%; fp8_e4m3 96.7%, so not
        # the default: bench/kv_cache_accuracy.py, bench/README.md). float16 is the choice for
        # exactness at twice the memory.
        return "int8"

    kv_cache_shape = staticmethod(cache_shape)

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                 kv_scales: torch.Tensor | None = None) -> None:
        key, value = key.contiguous(), value.contiguous()
        shape = native.write_kv_shape(key, value, kv_cache, slot_mapping, DTYPES, KV_CACHE_DTYPES)
        rc = self._lib.pa_cpu_write_kv(shape, native.ptr(key), native.ptr(value), native.ptr(kv_cache),
                                       native.ptr(slot_mapping, "int64_t *"),
                                       native.scales_pointer(kv_scales, key.device))
        native.check_rc(rc, self._lib, "pa_cpu", "write_kv")

    def attend(self, query: torch.Tensor, kv_cache: torch.Tensor, meta: AttentionMetadata, scale: float,
               out: torch.Tensor, window: int | None = None, softcap: float | None = None,
               kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        query = query.contiguous()
        # Every layer of a step passes the same metadata and shapes: the checks of the metadata
        # and its pointers are made once per step (kept in meta.scratch); each call still checks
        # its own tensors.
        key = (query.shape, query.dtype, kv_cache.shape, kv_cache.dtype)
        plan = meta.scratch.get("cpu_attention")
        if plan is None or plan[0] != key:
            plan = (key, native.attention_shape(query, kv_cache, meta, out, DTYPES, KV_CACHE_DTYPES),
                    native.ptr(meta.query_start_loc, "int32_t *"), native.ptr(meta.seq_lens, "int32_t *"),
                    native.ptr(meta.block_tables, "int32_t *"))
            meta.scratch["cpu_attention"] = plan
        else:
            native.check_rows("query", query, "out", out, kv_cache, DTYPES, KV_CACHE_DTYPES)
        _, shape, query_start_loc, seq_lens, block_tables = plan
        rc = self._lib.pa_cpu_attention(shape, native.ptr(out), native.ptr(query), native.ptr(kv_cache),
                                        native.scales_pointer(kv_scales, query.device), query_start_loc, seq_lens,
                                        block_tables, scale, window or 0, softcap or 0.0, self.batch_invariant)
        native.check_rc(rc, self._lib, "pa_cpu", "attention")
        return out


class CpuLayerOps(TorchLayerOps):
    """RMSNorm (+ residual) and rotary (+ K/V write) as one native call each, for float32;
    other dtypes take the torch versions. The rotary embedding is bit-equal to torch's; the
    RMSNorm sums its squares in another order (last-bit differences)."""

    def __init__(self, lib) -> None:
        self._lib = lib

    def add_rms_norm(self, x: torch.Tensor, residual: torch.Tensor | None, weight: torch.Tensor,
                     eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = x.shape[-1]
        if not (_fp32_rows(x, hidden) and _fp32_rows(weight, hidden) and weight.numel() == hidden
                and (residual is None or (_fp32_rows(residual, hidden) and residual.shape == x.shape))):
            return super().add_rms_norm(x, residual, weight, eps)
        out = torch.empty_like(x)
        rc = self._lib.pa_cpu_rms_norm(native.ptr(out, "float *"),
                                       native.ffi().NULL if residual is None else native.ptr(residual, "float *"),
                                       native.ptr(x, "float *"), native.ptr(weight, "float *"), x.numel() // hidden,
                                       hidden, eps)
        native.check_rc(rc, self._lib, "pa_cpu", "rms_norm")
        return out, x if residual is None else residual

    def rope_write_kv(self, backend, qkv: torch.Tensor, rope: Rope, num_heads: int, num_kv_heads: int,
                      kv_cache: torch.Tensor, slot_mapping: torch.Tensor,
                      kv_scales: torch.Tensor | None = None) -> torch.Tensor:
        if qkv.dtype != torch.float32:
            return super().rope_write_kv(backend, qkv, rope, num_heads, num_kv_heads, kv_cache, slot_mapping,
                                         kv_scales)
        shape = native.rope_write_kv_shape(qkv, rope.positions, rope.cos_table, rope.sin_table, num_heads,
                                           num_kv_heads, kv_cache, slot_mapping, KV_CACHE_DTYPES)
        q = torch.empty(shape.num_tokens, num_heads, shape.head_size)
        rc = self._lib.pa_cpu_rope_write_kv(shape, native.ptr(qkv, "float *"), native.ptr(rope.positions, "int64_t *"),
                                            native.ptr(rope.cos_table, "float *"), native.ptr(rope.sin_table, "float *"),
                                            rope.cos_table.shape[0], 2 * rope.cos_table.shape[1],
                                            native.ptr(q, "float *"), native.ptr(kv_cache),
                                            native.ptr(slot_mapping, "int64_t *"),
                                            native.scales_pointer(kv_scales, qkv.device))
        native.check_rc(rc, self._lib, "pa_cpu", "rope_write_kv")
        return q

    def silu_mul(self, gate_up: torch.Tensor) -> torch.Tensor:
        if gate_up.dtype != torch.float32 or gate_up.dim() != 2 or not gate_up.is_contiguous() or gate_up.shape[1] % 2:
            return super().silu_mul(gate_up)
        rows, inter = gate_up.shape[0], gate_up.shape[1] // 2
        out = torch.empty(rows, inter)
        rc = self._lib.pa_cpu_silu_mul(native.ptr(out, "float *"), native.ptr(gate_up, "float *"), rows, inter)
        native.check_rc(rc, self._lib, "pa_cpu", "silu_mul")
        return out

    def decoder_layers(self, backend: CpuAttentionBackend, stack: LayerStack, activations: str, x: torch.Tensor,
                       rope: Rope, kv_caches: list[torch.Tensor], meta: AttentionMetadata,
                       kv_scales: list[torch.Tensor] | None = None) -> torch.Tensor:
        """The hidden states after ``stack``'s layers and final norm, ``[T, hidden]``, in one native
        call (``pa_cpu_decoder_layers``): the same ops in the same order as ``add_rms_norm``,
        ``rope_write_kv``, ``backend.attend``, ``silu_mul`` and the products one by one, so the same
        bits, without returning to Python between them (bench/README.md has what that saves). The
        products take x as ``activations`` says (``packed.ACTIVATIONS`` or ``fixed_order``).
        ``x`` (float32 ``[T, hidden]``, contiguous) is overwritten."""
        if x.dtype != torch.float32 or x.dim() != 2 or not x.is_contiguous() or x.shape[1] != stack.hidden:
            raise ValueError(f"x must be a contiguous float32 [T, {stack.hidden}] tensor; got {x.dtype} "
                             f"{tuple(x.shape)}")
        layers = self._layer_array(stack, kv_caches, kv_scales)
        num_tokens = x.shape[0]
        shape = native.stack_shape(num_tokens, stack.num_heads, stack.num_kv_heads, stack.head_size, kv_caches[0],
                                   meta, KV_CACHE_DTYPES)
        native.check_rope(num_tokens, stack.head_size, rope.positions, rope.cos_table, rope.sin_table,
                          meta.slot_mapping, x.device)
        ffi = native.ffi()
        step = ffi.new("pa_decoder_step *", {
            "positions": native.ptr(rope.positions, "int64_t *"), "cos": native.ptr(rope.cos_table, "float *"),
            "sin": native.ptr(rope.sin_table, "float *"), "max_positions": rope.cos_table.shape[0],
            "rotary_dim": 2 * rope.cos_table.shape[1], "slot_mapping": native.ptr(meta.slot_mapping, "int64_t *"),
            "query_start_loc": native.ptr(meta.query_start_loc, "int32_t *"),
            "seq_lens": native.ptr(meta.seq_lens, "int32_t *"),
            "block_tables": native.ptr(meta.block_tables, "int32_t *"), "scale": stack.scale,
            "softcap": stack.softcap or 0.0, "eps": stack.eps, "fixed_order": backend.batch_invariant,
            "linear": ffi.cast("pa_linear_fn", packed_kernels.kernel_address(activations)),
            "isa": packed_kernels.ISAS["best"]})
        residual, out = torch.empty_like(x), torch.empty_like(x)
        rc = self._lib.pa_cpu_decoder_layers(shape, step, layers, len(stack.layers), stack.hidden,
                                             native.ptr(stack.final_norm, "float *"), native.ptr(x, "float *"),
                                             native.ptr(residual, "float *"), native.ptr(out, "float *"))
        if rc == 2:
            raise native.NativeKernelError(f"decoder layers: a matrix product failed: {packed_kernels.last_error()}")
        native.check_rc(rc, self._lib, "pa_cpu", "decoder_layers")
        return out

    def _layer_array(self, stack: LayerStack, kv_caches: list[torch.Tensor],
                     kv_scales: list[torch.Tensor] | None) -> object:
        """``stack``'s layers as a ``pa_decoder_layer`` array over these caches, built (and checked)
        once and kept by the stack with the lists it points into (the next caches replace them)."""
        held = stack.native
        if held and held[0] is kv_caches and held[1] is kv_scales:
            return held[2]
        if len(kv_caches) != len(stack.layers) or (kv_scales is not None and len(kv_scales) != len(stack.layers)):
            raise ValueError("one KV cache (and scales) per layer")
        ffi = native.ffi()
        layers = ffi.new("pa_decoder_layer[]", len(stack.layers))
        q_size, kv_size = stack.num_heads * stack.head_size, stack.num_kv_heads * stack.head_size
        for i, (layer, kv_cache) in enumerate(zip(stack.layers, kv_caches)):
            if kv_cache.shape != kv_caches[0].shape or kv_cache.dtype != kv_caches[0].dtype:
                raise ValueError("every layer's KV cache must have one shape and element type")
            native.check_cache(kv_cache, kv_cache.device, stack.head_size, KV_CACHE_DTYPES)
            inter = layer.down[0].k
            for name, (n, k) in (("qkv", (q_size + 2 * kv_size, stack.hidden)), ("o", (stack.hidden, q_size)),
                                 ("gate_up", (2 * inter, stack.hidden)), ("down", (stack.hidden, inter))):
                matrix, bias = getattr(layer, name)
                if (matrix.n, matrix.k) != (n, k):
                    raise ValueError(f"layer {i} {name}: a [{matrix.n}, {matrix.k}] weight where the stack "
                                     f"needs [{n}, {k}]")
                if bias is not None and (bias.dtype != torch.float32 or bias.shape != (n,) or not bias.is_contiguous()):
                    raise ValueError(f"layer {i} {name}: a bias must be a float32 [{n}] tensor")
                target = getattr(layers[i], name)
                target.weight = ffi.cast("void *", matrix.data.data_ptr())
                target.bias = ffi.NULL if bias is None else native.ptr(bias, "float *")
                target.n, target.k, target.type = n, k, matrix.type_id
            for norm in (layer.input_norm, layer.mlp_norm):
                if not _fp32_rows(norm, stack.hidden) or norm.dim() != 1:
                    raise ValueError(f"layer {i}: norm weights must be float32 [{stack.hidden}]")
            layers[i].input_norm = native.ptr(layer.input_norm, "float *")
            layers[i].mlp_norm = native.ptr(layer.mlp_norm, "float *")
            layers[i].kv_cache = native.ptr(kv_cache)
            layers[i].kv_scales = native.scales_pointer(None if kv_scales is None else kv_scales[i], kv_cache.device)
            layers[i].window = layer.window or 0
        stack.native[:] = [kv_caches, kv_scales, layers]
        return layers


def _fp32_rows(t: torch.Tensor, hidden: int) -> bool:
    return t.dtype == torch.float32 and t.device.type == "cpu" and t.is_contiguous() and t.shape[-1] == hidden
