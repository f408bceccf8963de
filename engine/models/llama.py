"""Llama-family decoder (Llama, SmolLM2, Mistral, Qwen2 with its qkv bias) over flat token batches.

There is no padding and no batch dimension: ``input_ids`` holds the new tokens of every
scheduled sequence back to back, and the attention backend uses ``AttentionMetadata`` to
keep the sequences apart and to reach their cached prefixes.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from backends.base import AttentionBackend, AttentionMetadata
from backends.layer_ops import Rope
from backends import packed as packed_kernels
from engine.models.linear import CudaPackedLinear, DenseLinear, Linear, PackedLinear, PackedWeight

log = logging.getLogger(__name__)


@attrs.frozen(kw_only=True)
class LlamaConfig:
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
    attention_bias: bool = False
    bos_token_id: int | None = None
    eos_token_id: int | None = None

    @classmethod
    def from_hf(cls, hf: Mapping[str, Any]) -> LlamaConfig:
        """From a Hugging Face ``config.json`` dict (llama, mistral, qwen2)."""
        model_type = hf.get("model_type", "llama")
        if model_type not in ("llama", "mistral", "qwen2"):
            raise ValueError(f"unsupported model_type {model_type!r}: this engine runs llama, mistral and qwen2")
        rope = hf.get("rope_parameters") or hf.get("rope_scaling") or {}
        if rope.get("rope_type", "default") not in ("default", None):
            raise ValueError(f"unsupported rope scaling {rope.get('rope_type')!r}")
        eos = hf.get("eos_token_id")
        return cls(
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-6),
            rope_theta=rope.get("rope_theta") or hf.get("rope_theta", 10000.0),
            max_position_embeddings=hf.get("max_position_embeddings", 2048),
            tie_word_embeddings=hf.get("tie_word_embeddings", False),
            attention_bias=hf.get("attention_bias", model_type == "qwen2"),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_id=eos[0] if isinstance(eos, list) else eos,
        )


class RotaryEmbedding:
    """Rotary position embedding tables (non-interleaved halves, as in transformers' Llama)."""

    def __init__(self, head_dim: int, theta: float, max_positions: int, dtype: torch.dtype, device: str) -> None:
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (theta**exponents)  # [head_dim / 2]
        freqs = torch.arange(max_positions, dtype=torch.float32)[:, None] * inv_freq[None, :]
        self.cos = freqs.cos().to(dtype=dtype, device=device)  # [max_positions, head_dim / 2]
        self.sin = freqs.sin().to(dtype=dtype, device=device)

    def at(self, positions: torch.Tensor) -> Rope:
        """The angles of a flat batch's positions, shared by every layer."""
        return Rope(positions, self.cos, self.sin)


@attrs.define(eq=False)
class LlamaLayer:
    input_norm: torch.Tensor  # [hidden]
    qkv_proj: Linear  # [(num_heads + 2 * num_kv_heads) * head_dim, hidden], with the qkv bias if any
    o_proj: Linear  # [hidden, num_heads * head_dim]
    post_norm: torch.Tensor  # [hidden]
    gate_up_proj: Linear  # [2 * intermediate, hidden]
    down_proj: Linear  # [hidden, intermediate]


class LlamaModel:
    """Weights and forward pass. Build with ``from_state_dict`` (Hugging Face parameter names)."""

    def __init__(self, config: LlamaConfig, embed: DenseLinear | PackedLinear | CudaPackedLinear, layers: list[LlamaLayer],
                 norm: torch.Tensor, lm_head: Linear) -> None:
        self.config = config
        self.embed = embed  # [vocab, hidden]; rows() looks tokens up
        self.layers = layers
        self.norm = norm
        self.lm_head = lm_head  # [vocab, hidden]; the same object as embed when tied
        self.rotary = RotaryEmbedding(config.head_dim, config.rope_theta, config.max_position_embeddings,
                                      norm.dtype, str(norm.device))
        self.q_size = config.num_heads * config.head_dim
        self.kv_size = config.num_kv_heads * config.head_dim
        self.scale = config.head_dim**-0.5

    @classmethod
    def from_state_dict(cls, config: LlamaConfig, weights: Mapping[str, torch.Tensor],
                        dtype: torch.dtype, device: str) -> LlamaModel:
        """Weights are tensors, or ``PackedWeight`` (kept packed on CPU; dequantized elsewhere)."""

        def w(name: str) -> torch.Tensor:
            value = weights[name]
            return (value.dequantize() if isinstance(value, PackedWeight) else value).to(dtype=dtype, device=device)

        def linear(names: list[str], bias: list[str] | None = None) -> Linear:
            """One product for the weights ``names`` stacked by rows: packed if they all are, of one type."""
            parts = [weights[n] for n in names]
            kinds = {p.kind if isinstance(p, PackedWeight) else None for p in parts}
            b = torch.cat([w(n) for n in bias]) if bias else None
            packed_here = device == "cpu" or (device == "cuda" and packed_kernels.cuda_unavailable_reason() is None)
            if packed_here and len(kinds) == 1 and None not in kinds:
                packed = torch.cat([p.data for p in parts]) if len(parts) > 1 else parts[0].data
                if device == "cuda":
                    return CudaPackedLinear(packed.to(device), parts[0].kind, parts[0].shape[1], b)
                return PackedLinear(packed, parts[0].kind, parts[0].shape[1],
                                    None if b is None else b.to(torch.float32))
            if kinds != {None}:
                reason = "mixed types" if packed_here else "no packed kernels on " + device
                if device == "cuda":
                    reason = packed_kernels.cuda_unavailable_reason() or reason
                log.warning("%s: %s weights dequantized to %s (%s)", names[0],
                            "/".join(sorted(k or "dense" for k in kinds)), dtype, reason)
            return DenseLinear(torch.cat([w(n) for n in names]) if len(names) > 1 else w(names[0]), b)

        layers = []
        for i in range(config.num_layers):
            p = f"model.layers.{i}."
            attn = [f"{p}self_attn.{x}_proj" for x in "qkv"]
            layers.append(LlamaLayer(
                input_norm=w(p + "input_layernorm.weight"),
                qkv_proj=linear([a + ".weight" for a in attn], [a + ".bias" for a in attn] if config.attention_bias
                                else None),
                o_proj=linear([p + "self_attn.o_proj.weight"]),
                post_norm=w(p + "post_attention_layernorm.weight"),
                gate_up_proj=linear([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]),
                down_proj=linear([p + "mlp.down_proj.weight"]),
            ))
        embed = linear(["model.embed_tokens.weight"])
        tied = config.tie_word_embeddings or "lm_head.weight" not in weights
        lm_head = embed if tied else linear(["lm_head.weight"])
        return cls(config, embed, layers, w("model.norm.weight"), lm_head)

    @property
    def dtype(self) -> torch.dtype:
        return self.norm.dtype

    def weight_summary(self) -> tuple[dict[str, int], int]:
        """How the weights are held: tensors per kind (``Q4_1``, ``float32``...), and resident bytes."""
        kinds: dict[str, int] = {}
        seen: set[int] = set()
        total = 0
        linears = [self.embed, self.lm_head] + [m for layer in self.layers for m in
                                                (layer.qkv_proj, layer.o_proj, layer.gate_up_proj, layer.down_proj)]
        for linear in linears:
            if id(linear) in seen:
                continue
            seen.add(id(linear))
            kinds[linear.kind] = kinds.get(linear.kind, 0) + 1
            total += linear.nbytes
        total += sum(t.numel() * t.element_size() for layer in self.layers for t in (layer.input_norm, layer.post_norm))
        return kinds, total + self.norm.numel() * self.norm.element_size()

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, kv_caches: list[torch.Tensor],
                meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        """Hidden states after the final norm, ``[T, hidden]``, for the flat batch ``input_ids`` ``[T]``."""
        x = self.embed.rows(input_ids).to(self.dtype)  # [T, hidden]
        rope = self.rotary.at(positions)
        ops, eps = backend.layer_ops, self.config.rms_norm_eps
        residual = None  # the residual stream: x + every layer's outputs so far
        for layer, kv_cache in zip(self.layers, kv_caches):
            h, residual = ops.add_rms_norm(x, residual, layer.input_norm, eps)
            x = self._attention(layer, h, rope, kv_cache, meta, backend)
            h, residual = ops.add_rms_norm(x, residual, layer.post_norm, eps)
            x = self._mlp(layer, h)
        return ops.add_rms_norm(x, residual, self.norm, eps)[0]

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """``[N, vocab]`` float32 logits for ``[N, hidden]`` hidden states."""
        return self.lm_head(hidden).float()

    def _attention(self, layer: LlamaLayer, h: torch.Tensor, rope: Rope, kv_cache: torch.Tensor,
                   meta: AttentionMetadata, backend: AttentionBackend) -> torch.Tensor:
        cfg = self.config
        q = backend.layer_ops.rope_write_kv(backend, layer.qkv_proj(h), rope, cfg.num_heads, cfg.num_kv_heads,
                                            kv_cache, meta.slot_mapping)
        out = torch.empty(q.shape, dtype=q.dtype, device=q.device)
        backend.attend(q, kv_cache, meta, self.scale, out)
        return layer.o_proj(out.view(q.shape[0], self.q_size))

    def _mlp(self, layer: LlamaLayer, h: torch.Tensor) -> torch.Tensor:
        gate, up = layer.gate_up_proj(h).chunk(2, dim=-1)
        return layer.down_proj(F.silu(gate) * up)
