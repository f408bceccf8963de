"""Llama-skeleton decoders (Llama, SmolLM2, Mistral, Qwen2/3, Phi-3, Gemma 1-3; what each family
changes is stated in ``engine.models.families``) over flat token batches.

There is no padding and no batch dimension: ``input_ids`` holds the new tokens of every
scheduled sequence back to back, and the attention backend uses ``AttentionMetadata`` to
keep the sequences apart and to reach their cached prefixes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from functools import partial
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from backends import packed as packed_kernels
from backends.base import AttentionBackend, AttentionMetadata
from backends.kv_cache import dtype_of as kv_dtype_of
from backends.layer_ops import LayerStack, Rope, StackLayer, TorchLayerOps, rms_norm
from engine.errors import ConfigError
from engine.models import families
from engine.models.linear import CudaPackedLinear, DenseLinear, Linear, PackedLinear, PackedWeight

log = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class LlamaConfig:
    """The shape of a model of the Llama skeleton; ``model_type`` names its family
    (``engine.models.families``: what the family changes)."""

    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float
    rope_theta: float
    max_position_embeddings: int
    tie_word_embeddings: bool
    attention_bias: bool = False  # biases on the q, k and v projections
    o_proj_bias: bool = False  # and on o (Llama, Qwen3, Gemma with attention_bias; not Qwen2)
    mlp_bias: bool = False  # on gate, up and down (Llama's mlp_bias)
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    model_type: str = "llama"
    # Rotary scaling as transformers reads it (rope_type, factor, ...); empty: none.
    rope_scaling: Mapping[str, Any] = attrs.field(factory=dict, eq=False, hash=False)
    # How far back each layer's attention reaches (Mistral v0.1, Phi-3: every layer; Gemma 2/3:
    # the sliding layers between global ones); None: the whole context. Empty: no windows.
    layer_windows: tuple[int | None, ...] = ()
    hidden_act: str = "silu"  # the MLP's gate activation: silu (SwiGLU) or gelu_pytorch_tanh (GeGLU)
    # Attention scores scaled by query_pre_attn_scalar ** -0.5 (Gemma), else head_dim ** -0.5.
    query_pre_attn_scalar: float | None = None
    attn_logit_softcapping: float | None = None  # Gemma 2: cap * tanh(score / cap) before the softmax
    final_logit_softcapping: float | None = None  # Gemma 2: the same on the logits
    # The sliding layers' rotary where it differs from the others' (Gemma 3); empty: the same.
    local_rope: Mapping[str, Any] = attrs.field(factory=dict, eq=False, hash=False)
    partial_rotary_factor: float = 1.0  # the share of each head the rotary turns (Phi-4-mini: 0.75)
    # More end-of-sequence tokens (Llama 3.x Instruct: <|eom_id|>, <|eot_id|>), from the
    # config's eos_token_id list and generation_config.json; they stop a request as EOS does.
    extra_eos_token_ids: tuple[int, ...] = ()
    # generation_config.json's sampling values (temperature, top_p, top_k, min_p,
    # repetition_penalty): the API's defaults under --generation-config auto.
    sampling_defaults: Mapping[str, int | float] = attrs.field(factory=dict, eq=False, hash=False)

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any], generation: Mapping[str, Any] | None = None) -> LlamaConfig:
        """From a Hugging Face ``config.json`` dict (see ``engine.models.families`` for the
        families), and ``generation_config.json``'s if there is one."""
        model_type = hf.get("model_type", "llama")
        fam = families.family(model_type)
        hf = {**hf, "model_type": model_type}
        _check_fields(hf)
        resolved = families.transformers_config(hf)  # transformers' defaults for what hf leaves out
        per_layer_type = getattr(resolved, "rope_parameters", None) or {}
        if "full_attention" in per_layer_type:  # Gemma 3: one rotary per kind of layer
            rope = families.rope_parameters({"rope_parameters": per_layer_type["full_attention"]})
            local_rope = families.rope_parameters({"rope_parameters": per_layer_type["sliding_attention"]})
        else:
            rope, local_rope = families.rope_parameters(hf), {}
        if getattr(resolved, "use_bidirectional_attention", False):
            raise ConfigError("model", "use_bidirectional_attention (an embedding model's attention) is not supported")
        hidden_act = getattr(resolved, "hidden_activation", None) or getattr(resolved, "hidden_act", "silu")
        if hidden_act not in families.ACTIVATIONS:
            raise ConfigError("model", f"unsupported activation {hidden_act!r} (supported: "
                                       f"{', '.join(families.ACTIVATIONS)})")
        eos = _ids(hf.get("eos_token_id"))
        more = [t for t in eos[1:] + _ids((generation or {}).get("eos_token_id")) if t not in eos[:1]]
        attention_bias = {"qkv": True, "none": False}.get(fam.attention_bias, bool(hf.get("attention_bias")))
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope["rope_theta"],
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=bool(getattr(resolved, "tie_word_embeddings", hf.get("tie_word_embeddings", False))),
            attention_bias=attention_bias,
            o_proj_bias=attention_bias and fam.attention_bias == "config",
            mlp_bias=fam.mlp_bias and bool(hf.get("mlp_bias")),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos[0] if eos else None,
            extra_eos_token_ids=tuple(dict.fromkeys(more)),
            sampling_defaults={k: generation[k] for k in SAMPLING_DEFAULTS if (generation or {}).get(k) is not None},
            model_type=model_type,
            rope_scaling={} if rope["rope_type"] == "default" else rope,
            local_rope=local_rope if local_rope and local_rope != rope else {},
            layer_windows=tuple(fam.layer_windows(hf, hf["num_hidden_layers"])),
            hidden_act=hidden_act,
            query_pre_attn_scalar=getattr(resolved, "query_pre_attn_scalar", None),
            attn_logit_softcapping=getattr(resolved, "attn_logit_softcapping", None),
            final_logit_softcapping=getattr(resolved, "final_logit_softcapping", None),
            partial_rotary_factor=hf.get("partial_rotary_factor", rope.get("partial_rotary_factor", 1.0)),
        )

    @property
    def family(self) -> families.Family:
        return families.family(self.model_type)

    def window(self, layer: int) -> int | None:
        return self.layer_windows[layer] if self.layer_windows else None

    @property
    def attention_scale(self) -> float:
        return (self.query_pre_attn_scalar or self.head_dim) ** -0.5

    @property
    def exact_context_length(self) -> int:
        """The longest sequence this engine runs as transformers does: the model's context,
        or less where transformers would change what it computes past a length this engine
        does not follow (dynamic or longrope frequencies)."""
        limit = self.max_position_embeddings
        if self.rope_scaling.get("rope_type") == "longrope":
            limit = min(limit, self.rope_scaling["original_max_position_embeddings"])
        return limit


# What generation_config.json may set for every request, as vLLM reads it.
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


# config.json fields a model of the skeleton cannot go without (transformers would fill in its
# own defaults, a hidden size of 4096 and the like, which the weights would then not fit).
REQUIRED_FIELDS = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _check_fields(hf: Mapping[str, Any]) -> None:
    """Refuse a config.json this engine would read wrongly: a required field missing or not a
    positive integer, or weights quantized by a method it does not read (vLLM's AWQ, GPTQ...)."""
    for name in REQUIRED_FIELDS:
        value = hf.get(name)
        if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
            raise ConfigError("model", f"config.json's {name} is {value!r}; a positive integer is needed"
                              if name in hf else f"config.json has no {name}")
    quantization = hf.get("quantization_config")
    if quantization:
        method = quantization.get("quant_method", "?") if isinstance(quantization, Mapping) else "?"
        raise ConfigError("model", f"the weights are quantized with {method} (config.json's quantization_config), "
                                   "which this engine does not read: give fp32/fp16/bf16 weights (--quantization "
                                   "int8 quantizes them at load) or a GGUF file")


def checkpoint_shapes(config: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor the model reads, under its Hugging Face name, with the shape ``config`` gives it."""
    fam, hidden, inter, d = config.family, config.hidden_size, config.intermediate_size, config.head_dim
    q, kv = config.num_heads * d, config.num_kv_heads * d
    shapes: dict[str, tuple[int, ...]] = {"model.embed_tokens.weight": (config.vocab_size, hidden),
                                          "model.norm.weight": (hidden,)}
    if not config.tie_word_embeddings:
        shapes["lm_head.weight"] = (config.vocab_size, hidden)

    def product(name: str, rows: int, columns: int, bias: bool) -> None:
        shapes[name + ".weight"] = (rows, columns)
        if bias:
            shapes[name + ".bias"] = (rows,)

    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        shapes.update({f"{p}{name}.weight": (hidden,) for name in fam.layer_norms.values()})
        if fam.qk_norm:
            shapes.update({f"{p}self_attn.{x}_norm.weight": (d,) for x in "qk"})
        attn = {"qkv_proj": q + 2 * kv} if fam.fused_checkpoint else {"q_proj": q, "k_proj": kv, "v_proj": kv}
        for name, rows in attn.items():
            product(f"{p}self_attn.{name}", rows, hidden, config.attention_bias)
        product(p + "self_attn.o_proj", hidden, q, config.o_proj_bias)
        mlp = {"gate_up_proj": 2 * inter} if fam.fused_checkpoint else {"gate_proj": inter, "up_proj": inter}
        for name, rows in mlp.items():
            product(f"{p}mlp.{name}", rows, hidden, config.mlp_bias)
        product(p + "mlp.down_proj", hidden, inter, config.mlp_bias)
    return shapes


# Tensors a checkpoint may hold that the model does not read: older transformers' saved rotary
# frequencies (recomputed here), and an LM head beside tied embeddings (as vLLM, ignored).
_IGNORED_TENSORS = ("rotary_emb.inv_freq",)


def check_checkpoint(config: LlamaConfig, shapes: Mapping[str, tuple[int, ...]], where: str) -> None:
    """Refuse a checkpoint whose tensors (``shapes``: name -> shape) are not the ones ``config``
    says: missing, of another shape, or more (more layers, biases it does not have), naming them.

    Raises:
        ConfigError: naming the first tensors that differ, with both shapes.
    """
    expected = checkpoint_shapes(config)
    missing = [name for name in expected if name not in shapes]
    wrong = [f"{name} is {list(shapes[name])}, not {list(want)}" for name, want in expected.items()
             if name in shapes and tuple(shapes[name]) != want]
    extra = [name for name in shapes if name not in expected and not name.endswith(_IGNORED_TENSORS)
             and not (name == "lm_head.weight" and config.tie_word_embeddings)]
    shape = (f"{config.num_layers} layers, hidden size {config.hidden_size}, {config.num_heads} heads and "
             f"{config.num_kv_heads} KV heads of {config.head_dim}, MLP {config.intermediate_size}, "
             f"vocabulary {config.vocab_size}")
    for problems, what in ((wrong, "tensors of another shape than its config gives them"),
                           (missing, "no tensor"), (extra, "tensors its config has no place for")):
        if problems:
            more = f" and {len(problems) - 3} more" if len(problems) > 3 else ""
            raise ConfigError("model", f"{where} has {what}: {'; '.join(problems[:3])}{more} (the config: {shape})")


def _ids(value: int | list[int] | None) -> list[int]:
    return [] if value is None else list(value) if isinstance(value, list) else [value]


class RotaryEmbedding:
    """Rotary position embedding tables (non-interleaved halves, as in transformers' Llama), for
    the model's rotary or, with ``rope``, another one (Gemma 3's sliding layers)."""

    def __init__(self, config: LlamaConfig, dtype: torch.dtype, device: str,
                 rope: Mapping[str, Any] | None = None) -> None:
        rope = rope or config.rope_scaling or {"rope_type": "default", "rope_theta": config.rope_theta}
        inv_freq, scaling = families.rope_frequencies(rope, config.head_dim, config.max_position_embeddings,
                                                      config.hidden_size, config.num_heads,
                                                      config.partial_rotary_factor)
        freqs = torch.arange(config.max_position_embeddings, dtype=torch.float32)[:, None] * inv_freq[None, :]
        cos, sin = freqs.cos(), freqs.sin()
        if scaling != 1.0:  # (yarn, longrope: transformers scales cos and sin in fp32)
            cos, sin = cos * scaling, sin * scaling
        self.cos = cos.to(dtype=dtype, device=device)  # [max_positions, rotary_dim / 2]
        self.sin = sin.to(dtype=dtype, device=device)

    def at(self, positions: torch.Tensor) -> Rope:
        """The angles of a flat batch's positions, shared by every layer."""
        return Rope(positions, self.cos, self.sin)


@attrs.define(eq=False)
class LlamaLayer:
    input_norm: torch.Tensor  # [hidden], before attention
    qkv_proj: Linear  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden], with the qkv bias if any
    o_proj: Linear  # [hidden, num_heads * head_dim]
    mlp_norm: torch.Tensor  # [hidden], before the MLP
    gate_up_proj: Linear  # [2 * intermediate, hidden]
    down_proj: Linear  # [hidden, intermediate]
    q_norm: torch.Tensor | None = None  # [head_dim], Qwen3, Gemma 3: RMSNorm of each query head before rotary
    k_norm: torch.Tensor | None = None  # [head_dim], the same for key heads
    attn_out_norm: torch.Tensor | None = None  # [hidden], Gemma 2/3: on the attention's output
    mlp_out_norm: torch.Tensor | None = None  # [hidden], Gemma 2/3: on the MLP's output
    window: int | None = None  # a sliding-window layer's reach
    local_rope: bool = False  # turns q and k by the model's local rotary (Gemma 3's sliding layers)


class LlamaModel:
    """Weights and forward pass. Build with ``from_state_dict`` (Hugging Face parameter names)."""

    def __init__(self, config: LlamaConfig, embed: DenseLinear | PackedLinear | CudaPackedLinear, layers: list[LlamaLayer],
                 norm: torch.Tensor, lm_head: Linear) -> None:
        self.config = config
        self.embed = embed  # [vocab, hidden]; rows() looks tokens up
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head  # [vocab, hidden]; the same object as embed when tied
        self.rotary = RotaryEmbedding(config, norm.dtype, str(norm.device))
        self.local_rotary = (RotaryEmbedding(config, norm.dtype, str(norm.device), config.local_rope)
                             if config.local_rope else None)
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.attention_scale
        # Gemma: embeddings times sqrt(hidden_size), rounded to the model's dtype as transformers does.
        self.embed_scale = (torch.tensor(config.hidden_size**0.5).to(norm.dtype)
                            if config.family.scaled_embeddings else None)
        # GeGLU's gate activation (SwiGLU's is the layer ops' silu_mul)
        self.act = {"gelu_pytorch_tanh": partial(F.gelu, approximate="tanh"), "gelu": F.gelu}.get(config.hidden_act)
        self._stack: LayerStack | None = None  # _layer_stack's, built on first use
        self._stack_activations: dict[int, str | None] = {}  # rows -> how the stack's products take x

    @classmethod
    def from_state_dict(cls, config: LlamaConfig, weights: Mapping[str, torch.Tensor],
                        dtype: torch.dtype, device: str) -> LlamaModel:
        """Weights are tensors, or ``PackedWeight`` (kept packed on CPU; dequantized elsewhere)."""

        def w(name: str) -> torch.Tensor:
            value = weights[name]
            return (value.dequantize() if isinstance(value, PackedWeight) else value).to(dtype=dtype, device=device)

        fam = config.family

        def norm(name: str) -> torch.Tensor:
            """An RMSNorm's weight as the forward multiplies by it: Gemma's 1 + w, added in fp32."""
            value = weights[name]
            value = value.dequantize() if isinstance(value, PackedWeight) else value
            return (value.float() + 1.0 if fam.norm_plus_one else value).to(dtype=dtype, device=device)

        unpacked_reason = packed_kernels.unavailable_reason(device)  # once, not per matrix

        def linear(names: list[str], bias: list[str] | None = None) -> Linear:
            """One product for the weights ``names`` stacked by rows: packed if they all are, of one type."""
            parts = [weights[n] for n in names]
            kinds = {p.kind if isinstance(p, PackedWeight) else None for p in parts}
            b = torch.cat([w(n) for n in bias]) if bias else None
            if unpacked_reason is None and len(kinds) == 1 and None not in kinds:
                packed = torch.cat([p.data for p in parts]) if len(parts) > 1 else parts[0].data
                if device == "cuda":
                    return CudaPackedLinear(packed.to(device), parts[0].kind, parts[0].shape[1], b)
                return PackedLinear(packed, parts[0].kind, parts[0].shape[1],
                                    None if b is None else b.to(torch.float32))
            if kinds != {None}:
                log.warning("%s: %s weights dequantized to %s (%s)", names[0],
                            "/".join(sorted(k or "dense" for k in kinds)), dtype, unpacked_reason or "mixed types")
            return DenseLinear(torch.cat([w(n) for n in names]) if len(names) > 1 else w(names[0]), b)

        layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            # Phi-3 stores q, k, v and gate, up as single matrices; the others, one per projection.
            attn = [p + "self_attn.qkv_proj"] if fam.fused_checkpoint else [f"{p}self_attn.{x}_proj" for x in "qkv"]
            mlp = [p + "mlp.gate_up_proj"] if fam.fused_checkpoint else [p + "mlp.gate_proj", p + "mlp.up_proj"]
            o_proj, down = p + "self_attn.o_proj", p + "mlp.down_proj"
            layers.append(LlamaLayer(
                qkv_proj=linear([a + ".weight" for a in attn], [a + ".bias" for a in attn] if config.attention_bias
                                else None),
                o_proj=linear([o_proj + ".weight"], [o_proj + ".bias"] if config.o_proj_bias else None),
                gate_up_proj=linear([m + ".weight" for m in mlp], [m + ".bias" for m in mlp] if config.mlp_bias
                                    else None),
                down_proj=linear([down + ".weight"], [down + ".bias"] if config.mlp_bias else None),
                q_norm=norm(p + "self_attn.q_norm.weight") if fam.qk_norm else None,
                k_norm=norm(p + "self_attn.k_norm.weight") if fam.qk_norm else None,
                window=config.window(i),
                local_rope=config.window(i) is not None and bool(config.local_rope),
                **{field: norm(f"{p}{name}.weight") for field, name in fam.layer_norms.items()},
            ))
        embed = linear(["model.embed_tokens.weight"])
        lm_head = embed if config.tie_word_embeddings else linear(["lm_head.weight"])
        return cls(config, embed, layers, norm("model.norm.weight"), lm_head)

    def within_window(self, window: int) -> LlamaModel:
        """This model, its weights shared, with no layer attending further back than ``window``
        positions (a draft model over a sliding table: engine/runner/drafter.py)."""
        layers = [attrs.evolve(layer, window=min(layer.window or window, window)) for layer in self.layers]
        return LlamaModel(self.config, self.embed, layers, self.norm, self.lm_head)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype

    def linears(self) -> list[Linear]:
        """Every matrix product of the model once (a tied LM head is the embedding)."""
        linears = [self.embed, self.lm_head] + [m for layer in self.layers for m in
                                                (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]
        return list({id(linear): linear for linear in linears}.values())

    def quantize_activations(self, kind: str, rows: int) -> int:
        """Round the activations of the packed products (``--activation-quantization``): ``int16``
        (a scale per 32 values) for batches of up to ``rows`` rows, ``bf16`` for batches of at
        least ``rows`` rows (``none``: neither). Returns how many products do."""
        packed = [getattr(linear, "inner", linear) for linear in self.linears()]
        packed = [linear for linear in packed if isinstance(linear, PackedLinear)]
        for linear in packed:
            linear.int16_activation_rows = rows if kind == "int16" else 0
            linear.bf16_activation_rows = rows if kind == "bf16" else None
        self._stack_activations.clear()
        return len(packed)

    def fix_summation_order(self, fixed: bool = True) -> None:
        """Batch invariance (``--batch-invariant``): every matrix product sums each row in one
        order whatever else the batch holds (``PackedLinear.fix_order``, ``DenseLinear.fix_order``).
        The other per-row work (norms, rotary, activations) already depends on the row alone.

        Raises:
            ValueError: a product that cannot (weights on a GPU, a dtype the row tiles do not take).
        """
        for linear in self.linears():
            linear = getattr(linear, "inner", linear)  # (a tensor-parallel wrapper's own product)
            if isinstance(linear, (PackedLinear, DenseLinear)):
                linear.fix_order(fixed)
            elif fixed:
                raise ValueError(f"{type(linear).__name__} products have no fixed summation order")
        self._stack, self._stack_activations = None, {}  # (a dense product's matrix is new)

    def weight_summary(self) -> tuple[dict[str, int], int]:
        """How the weights are held: tensors per kind (``Q4_1``, ``float32``...), and resident bytes."""
        kinds: dict[str, int] = {}
        total = 0
        for linear in self.linears():
            kinds[linear.kind] = kinds.get(linear.kind, 0) + 1
            total += linear.nbytes
        norms = [t for layer in self.layers for t in (layer.input_norm, layer.mlp_norm, layer.q_norm, layer.k_norm,
                                                      layer.attn_out_norm, layer.mlp_out_norm) if t is not None]
        return kinds, total + sum(t.numel() * t.element_size() for t in norms + [self.norm])

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, backend: AttentionBackend, kv_scales: list[torch.Tensor] | None = None,
                calibrate: bool = False, layer_metas: list[AttentionMetadata] | None = None) -> torch.Tensor:
        """Hidden states after the final norm, ``[T, hidden]``, for the flat batch ``input_ids`` ``[T]``.

        ``kv_scales``: each layer's K and V scales of an fp8 cache (None: none); ``calibrate``
        sets them from this pass's K and V first (``calibrate_kv_scales``). ``layer_metas``:
        each layer's metadata where the layer groups have their own block tables
        (engine/kv_groups.py); None: ``meta`` for every layer."""
        x = self.embed.rows(input_ids).to(self.dtype)  # [T, hidden]
        if self.embed_scale is not None:
            x = x * self.embed_scale
        rope = self.rotary.at(positions)
        local_rope = self.local_rotary.at(positions) if self.local_rotary is not None else rope
        ops, eps = backend.layer_ops, self.config.rms_norm_eps
        stack = None if calibrate or layer_metas is not None else self._layer_stack(ops, x.shape[0])
        if stack is not None:  # every layer and the final norm in one native call
            return ops.decoder_layers(backend, *stack, x.contiguous(), rope, kv_caches, meta, kv_scales)
        residual = None  # the residual stream: x + every layer's outputs so far
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches)):
            h, residual = ops.add_rms_norm(x, residual, layer.input_norm, eps)
            scales = None if kv_scales is None else kv_scales[i]
            x = self._attention(layer, h, local_rope if layer.local_rope else rope, kv_cache,
                                meta if layer_metas is None else layer_metas[i], backend, scales, calibrate)
            if layer.attn_out_norm is not None:
                x = ops.add_rms_norm(x, None, layer.attn_out_norm, eps)[0]
            h, residual = ops.add_rms_norm(x, residual, layer.mlp_norm, eps)
            x = self._mlp(layer, h, ops)
            if layer.mlp_out_norm is not None:
                x = ops.add_rms_norm(x, None, layer.mlp_out_norm, eps)[0]
        return ops.add_rms_norm(x, residual, self.norm, eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, vocab]`` float32 logits for ``[N, hidden]`` hidden states (soft-capped where the
        model says so, as transformers does: cap * tanh(logits / cap))."""
        logits = self.lm_head(hidden).float()
        cap = self.config.final_logit_softcapping
        return logits if cap is None else torch.tanh(logits / cap) * cap

    def _attention(self, layer: LlamaLayer, h: torch.Tensor, rope: Rope, kv_cache: torch.Tensor,
                   meta: AttentionMetadata, backend: AttentionBackend, kv_scales: torch.Tensor | None = None,
                   calibrate: bool = False) -> torch.Tensor:
        cfg = self.config
        qkv = layer.qkv_proj(h)
        if layer.q_norm is not None:
            qkv = self._qk_norm(layer, qkv)
        if calibrate and kv_scales is not None:
            calibrate_kv_scales(qkv, self.q_size, self.kv_size, kv_cache, kv_scales)
        q = backend.layer_ops.rope_write_kv(backend, qkv, rope, cfg.num_heads, cfg.num_kv_heads, kv_cache,
                                            meta.slot_mapping, kv_scales)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        backend.attend(q, kv_cache, meta, self.scale, out, window=layer.window, softcap=cfg.attn_logit_softcapping,
                       kv_scales=kv_scales)
        return layer.o_proj(out.view(q.shape[0], self.q_size))

    def _qk_norm(self, layer: LlamaLayer, qkv: torch.Tensor) -> torch.Tensor:
        """Qwen3, Gemma 3: each head of q and of k RMS-normalized (transformers' order of operations)."""
        cfg, tokens = self.config, qkv.shape[0]
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        q = rms_norm(q.reshape(tokens, cfg.num_heads, cfg.head_dim), layer.q_norm, cfg.rms_norm_eps)
        k = rms_norm(k.reshape(tokens, cfg.num_kv_heads, cfg.head_dim), layer.k_norm, cfg.rms_norm_eps)
        return torch.cat([q.reshape(tokens, -1), k.reshape(tokens, -1), v], dim=-1)

    def _mlp(self, layer: LlamaLayer, h: torch.Tensor, ops: TorchLayerOps) -> torch.Tensor:
        gate_up = layer.gate_up_proj(h)
        if self.config.hidden_act == "silu":
            return layer.down_proj(ops.silu_mul(gate_up))
        gate, up = gate_up.chunk(2, dim=-1)
        return layer.down_proj(self.act(gate) * up)

    def _layer_stack(self, ops: TorchLayerOps, rows: int) -> tuple[LayerStack, str] | None:
        """The decoder layers as the backend's one-call stack takes them (``decoder_layers`` of
        its layer ops: the cpu backend's), and how the products take x at ``rows`` rows; None where
        the backend has no such call, the model is not Llama-shaped in float32 (norms around the
        attention or the MLP, q/k norms, another activation, a local rotary), or a product does not
        go through the packed library at ``rows`` rows (dense weights outside batch invariance,
        tensor-parallel shards, a batch large enough for dequantized tiles and torch's GEMM). The
        stack computes what the layer-by-layer loop computes, bit for bit."""
        if not hasattr(ops, "decoder_layers") or rows == 0:
            return None
        if rows not in self._stack_activations:
            products = [linear for layer in self.layers for linear in
                        (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]
            kinds = {linear.activations_for(rows) if isinstance(linear, (PackedLinear, DenseLinear)) else None
                     for linear in products}
            self._stack_activations[rows] = kinds.pop() if len(kinds) == 1 and self._stackable() else None
        activations = self._stack_activations[rows]
        if activations is None:
            return None
        if self._stack is None:
            cfg = self.config

            def product(linear: PackedLinear | DenseLinear) -> tuple[packed_kernels.PackedMatrix, torch.Tensor | None]:
                return linear.matrix, linear.bias

            self._stack = LayerStack(
                layers=tuple(StackLayer(qkv=product(layer.qkv_proj), o=product(layer.o_proj),
                                        gate_up=product(layer.gate_up_proj), down=product(layer.down_proj),
                                        input_norm=layer.input_norm, mlp_norm=layer.mlp_norm, window=layer.window)
                             for layer in self.layers),
                final_norm=self.norm, hidden=cfg.hidden_size, num_heads=cfg.num_heads, num_kv_heads=cfg.num_kv_heads,
                head_size=cfg.head_dim, scale=self.scale, softcap=cfg.attn_logit_softcapping, eps=cfg.rms_norm_eps)
        return self._stack, activations

    def _stackable(self) -> bool:
        """Whether every layer is what a one-call stack runs: float32, SwiGLU, one rotary, no norms
        but the two before attention and MLP."""
        return (self.dtype == torch.float32 and self.config.hidden_act == "silu" and self.local_rotary is None
                and all(layer.q_norm is None and layer.k_norm is None and layer.attn_out_norm is None
                        and layer.mlp_out_norm is None for layer in self.layers))


def calibrate_kv_scales(qkv: torch.Tensor, q_size: int, kv_size: int, kv_cache: torch.Tensor,
                        kv_scales: torch.Tensor) -> None:
    """A layer's fp8 K and V scales from one pass's qkv (before the rotary embedding, which
    turns pairs of values: a rotated value is at most sqrt(2) times the pair's largest), so
    that twice the largest value seen maps to the format's largest (``--calculate-kv-scales``)."""
    k, v = qkv[:, q_size:q_size + kv_size], qkv[:, q_size + kv_size:]
    largest = kv_dtype_of(kv_cache).max_value
    amax = torch.stack([k.abs().amax() * 2 ** 0.5, v.abs().amax()]).float()
    kv_scales.copy_(torch.where(amax > 0, 2 * amax / largest, torch.ones_like(amax)))


def fix_summation_order(model: LlamaModel, backend: AttentionBackend, device: str) -> bool:
    """Batch invariance for ``model`` on ``backend`` (its products and attention in an order set by
    each row alone); False, changing nothing, where the backend has no such order (other
    backends, and any on a GPU).

    Raises:
        ConfigError: a product of the model that cannot take a fixed order.
    """
    if not hasattr(backend, "batch_invariant") or device != "cpu":
        return False
    try:
        model.fix_summation_order()
    except ValueError as exc:
        raise ConfigError("batch_invariant", f"batch invariance cannot run this model here: {exc}") from None
    backend.batch_invariant = True
    return True
