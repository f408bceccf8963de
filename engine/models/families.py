"""The model families that run on the Llama skeleton, and what each one changes.

A family is registered under its Hugging Face ``model_type`` (and its GGUF
``general.architecture``). Everything it changes is stated here, as data the loader and the
forward read, so that the forward stays one readable function:

- ``llama``, ``mistral``: the skeleton itself (RMSNorm, rotary, GQA, SwiGLU).
- ``qwen2``: a bias on the q, k and v projections.
- ``qwen3``: an RMSNorm over each head of q and of k, before the rotary embedding.
- ``phi3``: q, k and v stored as one ``qkv_proj`` matrix, gate and up as one ``gate_up_proj``
  (the engine fuses them the same way for every family, so only the names differ).

Rotary scaling (``rope_scaling`` / ``rope_parameters``) comes from transformers' own
functions (``ROPE_INIT_FUNCTIONS``), so the frequencies are transformers' to the bit:
``linear``, ``llama3`` and ``yarn`` everywhere; ``dynamic`` and ``longrope``, whose frequencies
change with the length of the batch in transformers, only within the length where they are
the plain (or short) frequencies (``LlamaConfig.exact_context_length`` caps ``max_model_len``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs
import torch


@attrs.frozen
class Family:
    model_type: str
    qkv_bias: bool = False  # default of config.attention_bias
    qk_norm: bool = False
    fused_checkpoint: bool = False  # qkv_proj and gate_up_proj as stored matrices (Phi-3)
    # When transformers applies config.sliding_window: "always" (Mistral, Phi-3), "switched"
    # (Qwen: only with use_sliding_window), "never" (Llama ignores the field).
    sliding_window: str = "never"

    def window(self, hf: Mapping[str, Any]) -> int | None:
        """The attention window transformers applies for this config.json, or None."""
        if self.sliding_window == "always" or (self.sliding_window == "switched" and hf.get("use_sliding_window")):
            return hf.get("sliding_window")
        return None


FAMILIES = {family.model_type: family for family in (
    Family("llama"),
    Family("mistral", sliding_window="always"),
    Family("qwen2", qkv_bias=True, sliding_window="switched"),
    Family("qwen3", qk_norm=True, sliding_window="switched"),
    Family("phi3", fused_checkpoint=True, sliding_window="always"),
)}

# Rotary types whose frequencies transformers computes once (exact at every length), and the
# ones it recomputes from the batch's length (exact while they equal the unscaled ones).
STATIC_ROPE = ("default", "linear", "llama3", "yarn")
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def family(model_type: str) -> Family:
    if model_type not in FAMILIES:
        raise ValueError(f"unsupported model_type {model_type!r}: this engine runs {', '.join(FAMILIES)}")
    return FAMILIES[model_type]


def rope_parameters(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The rotary parameters of a ``config.json`` (old ``rope_scaling`` or new ``rope_parameters``),
    with ``rope_type`` and ``rope_theta`` always present."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope["rope_type"] = rope.get("rope_type") or rope.pop("type", None) or "default"
    rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if rope["rope_type"] not in STATIC_ROPE + LENGTH_DEPENDENT_ROPE:
        raise ValueError(f"unsupported rope scaling {rope['rope_type']!r} (supported: "
                         f"{', '.join(STATIC_ROPE + LENGTH_DEPENDENT_ROPE)})")
    if rope["rope_type"] in ("yarn", "longrope", "llama3"):
        rope.setdefault("original_max_position_embeddings", hf.get("original_max_position_embeddings")
                        or hf.get("max_position_embeddings", 2048))
    return rope


def rope_frequencies(rope: Mapping[str, Any], head_dim: int, max_position_embeddings: int,
                     hidden_size: int, num_heads: int) -> tuple[torch.Tensor, float]:
    """``(inv_freq [head_dim / 2], attention_scaling)``: transformers' computation for the type."""
    rope_type = rope.get("rope_type", "default")
    if rope_type in ("default", "dynamic", "freq_factors"):
        # dynamic: the plain frequencies up to max_position_embeddings, as in transformers;
        # freq_factors (a GGUF's rope_freqs tensor): the plain ones divided by its factors.
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
        inv_freq = 1.0 / (rope["rope_theta"] ** exponents)
        if rope_type == "freq_factors":
            if len(rope["factors"]) != head_dim // 2:
                raise ValueError(f"rope_freqs holds {len(rope['factors'])} factors, not head_dim / 2 = {head_dim // 2}")
            inv_freq = inv_freq / torch.tensor(rope["factors"], dtype=torch.float32)
        return inv_freq, 1.0
    from transformers import LlamaConfig as HFConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    carrier = HFConfig(hidden_size=hidden_size, num_attention_heads=num_heads, head_dim=head_dim,
                       max_position_embeddings=max_position_embeddings, rope_parameters=dict(rope))
    # longrope below its original length: the short factors (what transformers uses there).
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](carrier, "cpu", seq_len=None)
    return inv_freq.float(), float(scaling)
