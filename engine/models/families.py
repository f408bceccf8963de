"""The model families that run on the Llama skeleton, and what each one changes.

A family is registered under its Hugging Face ``model_type`` (and its GGUF
``general.architecture``). Everything it changes is stated here, as data the loader and the
forward read, so that the forward stays one readable function:

- ``llama``, ``mistral``: the skeleton itself (RMSNorm, rotary, GQA, SwiGLU).
- ``qwen2``: a bias on the q, k and v projections (not o).
- ``qwen3``: an RMSNorm over each head of q and of k, before the rotary embedding.
- ``phi3``: q, k and v stored as one ``qkv_proj`` matrix, gate and up as one ``gate_up_proj``
  (the engine fuses them the same way for every family, so only the names differ), and a
  rotary embedding over part of each head where ``partial_rotary_factor`` says so (Phi-4-mini).
- ``gemma``: RMSNorm by ``1 + weight``, embeddings scaled by sqrt(hidden_size), GeGLU
  (``gelu_pytorch_tanh``).
- ``gemma2``: Gemma's, plus norms on the attention and MLP outputs ("sandwich" norms),
  attention scaled by ``query_pre_attn_scalar``, tanh soft-capping of attention scores and
  of the final logits, and sliding-window layers interleaved with global ones.
- ``gemma3_text``: Gemma 2's without the soft-caps, plus per-head q/k norms, and its own
  rotary base (``rope_local_base_freq``) on the sliding-window layers.

Which layers attend through a sliding window is transformers' answer (``config.layer_types``
from its own config class, for the families that have one); so are the defaults a Gemma
``config.json`` leaves out.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from engine.errors import ConfigError


@attrs.frozen
class Family:
    model_type: str
    # The attention's biases as transformers builds them: "config" (q, k, v and o where
    # config.attention_bias says so), "qkv" (always q, k and v; never o), "none".
    attention_bias: str = "config"
    mlp_bias: bool = False  # gate, up and down where config.mlp_bias says so (Llama)
    qk_norm: bool = False
    fused_checkpoint: bool = False  # qkv_proj and gate_up_proj as stored matrices (Phi-3)
    # Which layers transformers gives config.sliding_window: "always" (Mistral, Phi-3: every
    # layer), "per_layer" (those config.layer_types calls sliding_attention: Qwen with
    # use_sliding_window, Gemma 2/3), "never" (Llama ignores the field).
    sliding_window: str = "never"
    norm_plus_one: bool = False  # RMSNorm multiplies by (1 + weight) (Gemma)
    scaled_embeddings: bool = False  # token embeddings times sqrt(hidden_size) (Gemma)
    sandwich_norms: bool = False  # attention and MLP outputs normalized before the residual add (Gemma 2/3)

    def layer_windows(self, hf: Mapping[str, Any], num_layers: int) -> tuple[int | None, ...]:
        """Each layer's attention window as transformers applies it for this config.json (None: global)."""
        if self.sliding_window == "always":
            return (hf.get("sliding_window"),) * num_layers
        if self.sliding_window == "per_layer":
            config = transformers_config(hf)
            return tuple(config.sliding_window if kind == "sliding_attention" else None for kind in config.layer_types)
        return (None,) * num_layers

    @property
    def layer_norms(self) -> dict[str, str]:
        """``LlamaLayer`` field -> checkpoint name (under ``model.layers.N.``) of a layer's RMSNorms."""
        if self.sandwich_norms:
            return {"input_norm": "input_layernorm", "attn_out_norm": "post_attention_layernorm",
                    "mlp_norm": "pre_feedforward_layernorm", "mlp_out_norm": "post_feedforward_layernorm"}
        return {"input_norm": "input_layernorm", "mlp_norm": "post_attention_layernorm"}


GEMMA = dict(norm_plus_one=True, scaled_embeddings=True)
FAMILIES = {family.model_type: family for family in (
    Family("llama", mlp_bias=True),
    Family("mistral", attention_bias="none", sliding_window="always"),
    Family("qwen2", attention_bias="qkv", sliding_window="per_layer"),
    Family("qwen3", qk_norm=True, sliding_window="per_layer"),
    Family("phi3", attention_bias="none", fused_checkpoint=True, sliding_window="always"),
    Family("gemma", **GEMMA),
    Family("gemma2", sliding_window="per_layer", sandwich_norms=True, **GEMMA),
    Family("gemma3_text", qk_norm=True, sliding_window="per_layer", sandwich_norms=True, **GEMMA),
)}

# The MLP activations the forward runs (config.hidden_activation, or hidden_act).
ACTIVATIONS = ("silu", "gelu_pytorch_tanh", "gelu")


def transformers_config(hf: Mapping[str, Any]):
    """transformers' own reading of a config.json (its class's defaults, derived fields such as
    ``layer_types``)."""
    from transformers import CONFIG_MAPPING

    return CONFIG_MAPPING[hf["model_type"]].from_dict(copy.deepcopy(dict(hf)))  # (it edits nested dicts)

# Rotary types whose frequencies transformers computes once (exact at every length), and the
# ones it recomputes from the batch's length (exact while they equal the unscaled ones).
STATIC_ROPE = ("default", "linear", "llama3", "yarn")
LENGTH_DEPENDENT_ROPE = ("dynamic", "longrope")


def family(model_type: str) -> Family:
    if model_type not in FAMILIES:
        raise ConfigError("model", f"unsupported model_type {model_type!r}: this engine runs {', '.join(FAMILIES)}")
    return FAMILIES[model_type]


def rope_parameters(hf: Mapping[str, Any]) -> dict[str, Any]:
    """The rotary parameters of a ``config.json`` (old ``rope_scaling`` or new ``rope_parameters``),
    with ``rope_type`` and ``rope_theta`` always present."""
    rope = dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {})
    rope["rope_type"] = rope.get("rope_type") or rope.pop("type", None) or "default"
    rope.setdefault("rope_theta", hf.get("rope_theta", 10000.0))
    if rope["rope_type"] not in STATIC_ROPE + LENGTH_DEPENDENT_ROPE:
        raise ConfigError("model", f"unsupported rope scaling {rope['rope_type']!r} (supported: "
                         f"{', '.join(STATIC_ROPE + LENGTH_DEPENDENT_ROPE)})")
    if rope["rope_type"] in ("yarn", "longrope", "llama3"):
        rope.setdefault("original_max_position_embeddings", hf.get("original_max_position_embeddings")
                        or hf.get("max_position_embeddings", 2048))
    return rope


def rope_frequencies(rope: Mapping[str, Any], head_dim: int, max_position_embeddings: int,
                     hidden_size: int, num_heads: int,
                     partial_rotary_factor: float = 1.0) -> tuple[torch.Tensor, float]:
    """``(inv_freq [rotary_dim / 2], attention_scaling)``: transformers' computation for the type;
    the rotary turns the first ``head_dim * partial_rotary_factor`` dimensions of each head."""
    rope_type = rope.get("rope_type", "default")
    if rope_type in ("default", "dynamic", "freq_factors"):
        # dynamic: the plain frequencies up to max_position_embeddings, as in transformers;
        # freq_factors (a GGUF's rope_freqs tensor): the plain ones divided by its factors.
        dim = int(head_dim * partial_rotary_factor)
        exponents = torch.arange(0, dim, 2, dtype=torch.int64).float() / dim
        inv_freq = 1.0 / (rope["rope_theta"] ** exponents)
        if rope_type == "freq_factors":
            if len(rope["factors"]) != dim // 2:
                raise ConfigError("model", f"rope_freqs holds {len(rope['factors'])} factors, not rotary_dim / 2 = "
                                           f"{dim // 2}")
            inv_freq = inv_freq / torch.tensor(rope["factors"], dtype=torch.float32)
        return inv_freq, 1.0
    from transformers import LlamaConfig as HFConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    carrier = HFConfig(hidden_size=hidden_size, num_attention_heads=num_heads, head_dim=head_dim,
                       max_position_embeddings=max_position_embeddings,
                       rope_parameters={**rope, "partial_rotary_factor": partial_rotary_factor})
    # longrope below its original length: the short factors (what transformers uses there).
    inv_freq, scaling = ROPE_INIT_FUNCTIONS[rope_type](carrier, "cpu", seq_len=None)
    return inv_freq.float(), float(scaling)
