"""Model files as users hand them over, damaged or not what their config says: every case is one
clear ConfigError at load naming what is wrong (the server's one line and exit 2), never a
server that reports healthy and then fails its first request, never output computed from
weights it silently left out or made up. Tiny random models, written here (no downloads)."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pytest
import torch

from engine.errors import ConfigError
from engine.models.loader import ModelSource, load_model, read_config

pytestmark = pytest.mark.slow

HF_SHAPE = dict(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=8, max_position_embeddings=128, tie_word_embeddings=False)


def load(path, **fields):
    source = ModelSource(path, path.name)
    return load_model(source, fields.pop("load_format", "auto"), torch.float32, "cpu", seed=0, **fields)


@pytest.fixture(scope="module")
def hf_state():
    """A tiny Llama's config.json fields and its tensors, as transformers saves them."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(**HF_SHAPE))
    return {"model_type": "llama", **HF_SHAPE}, {k: v.contiguous() for k, v in model.state_dict().items()}


def write_hf(directory, config: dict, tensors: dict, file: str = "model.safetensors"):
    from safetensors.torch import save_file

    directory.mkdir(exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config))
    save_file(tensors, str(directory / file))
    return directory


def without(tensors: dict, name: str) -> dict:
    return {k: v for k, v in tensors.items() if k != name}


@pytest.mark.parametrize("change, words", [
    # a tensor of another shape: named, with both shapes (it used to fail the first request)
    (lambda c, t: (c, {**t, "model.layers.0.self_attn.k_proj.weight": t["model.layers.0.self_attn.k_proj.weight"][:8]}),
     r"another shape .*model\.layers\.0\.self_attn\.k_proj\.weight is \[8, 32\], not \[16, 32\]"),
    (lambda c, t: ({**c, "num_attention_heads": 8}, t), r"q_proj\.weight is \[32, 32\], not \[64, 32\]"),
    # a vocabulary larger than the embedding: ids past its rows would have failed a step
    (lambda c, t: ({**c, "vocab_size": 120}, t), r"model\.embed_tokens\.weight is \[96, 32\], not \[120, 32\]"),
    (lambda c, t: (c, without(t, "model.layers.1.mlp.up_proj.weight")), r"no tensor: model\.layers\.1\.mlp\.up_proj"),
    # untied embeddings without an LM head: refused (it was tied to the embedding in silence)
    (lambda c, t: (c, without(t, "lm_head.weight")), r"no tensor: lm_head\.weight"),
    # a config of fewer layers than the checkpoint holds: the rest would be left out
    (lambda c, t: ({**c, "num_hidden_layers": 1}, t), r"no place for: model\.layers\.1\."),
    # biases the config does not switch on (transformers would drop them)
    (lambda c, t: (c, {**t, "model.layers.0.mlp.down_proj.bias": torch.zeros(32)}),
     r"no place for: model\.layers\.0\.mlp\.down_proj\.bias"),
    (lambda c, t: (c, {**t, "model.layers.0.self_attn.q_proj.weight": torch.zeros(32, 32, dtype=torch.int8)}),
     r"integer weights, .*: model\.layers\.0\.self_attn\.q_proj\.weight \(torch\.int8\)"),
    (lambda c, t: ({**c, "quantization_config": {"quant_method": "awq", "bits": 4}}, t),
     r"quantized with awq \(config\.json's quantization_config\)"),
    (lambda c, t: (without(c, "hidden_size"), t), r"config\.json has no hidden_size"),
    (lambda c, t: ({**c, "num_hidden_layers": "2"}, t), r"config\.json's num_hidden_layers is '2'"),
    (lambda c, t: ({**c, "hidden_act": "relu"}, t), r"unsupported activation 'relu'"),
    (lambda c, t: ({**c, "model_type": "gpt2"}, t), r"unsupported model_type 'gpt2'"),
], ids=["k-rows", "heads", "vocab", "missing", "untied-no-head", "fewer-layers", "stray-bias", "int8", "awq",
        "no-hidden-size", "string-layers", "relu", "gpt2"])
def test_a_checkpoint_that_is_not_what_its_config_says_is_refused_at_load(hf_state, tmp_path, change, words):
    config, tensors = change(*hf_state)
    write_hf(tmp_path / "m", config, tensors)
    with pytest.raises(ConfigError, match=words):
        load(tmp_path / "m")


def test_unused_rotary_frequencies_and_a_tied_models_head_are_ignored(hf_state, tmp_path):
    config, tensors = hf_state
    extra = {"model.layers.0.self_attn.rotary_emb.inv_freq": torch.ones(4)}
    assert len(load(write_hf(tmp_path / "a", config, {**tensors, **extra})).layers) == 2
    tied = write_hf(tmp_path / "b", {**config, "tie_word_embeddings": True}, tensors)
    model = load(tied)
    assert model.lm_head is model.embed


def test_files_that_are_not_json_or_safetensors_are_named(hf_state, tmp_path):
    config, tensors = hf_state
    directory = write_hf(tmp_path / "m", config, tensors)
    (directory / "config.json").write_text('{"model_type": "llama", "hidden')
    with pytest.raises(ConfigError, match=r"config\.json is not readable JSON"):
        read_config(ModelSource(directory, "m"))
    (directory / "config.json").write_text(json.dumps(config))
    data = (directory / "model.safetensors").read_bytes()
    (directory / "model.safetensors").write_bytes(data[:100])
    with pytest.raises(ConfigError, match=r"model\.safetensors is not a readable safetensors file"):
        load(directory)


def test_two_copies_of_a_tensor_without_an_index_are_refused(hf_state, tmp_path):
    config, tensors = hf_state
    directory = write_hf(tmp_path / "m", config, {k: v for k, v in tensors.items() if "layers.1." not in k},
                         file="part-a.safetensors")
    write_hf(directory, config, {k: v for k, v in tensors.items() if "layers.0." not in k}, file="part-b.safetensors")
    with pytest.raises(ConfigError, match=r"lm_head\.weight is in both part-a\.safetensors and part-b"):
        load(directory)


def test_without_an_index_the_models_own_files_are_read_not_a_copy_beside_them(hf_state, tmp_path):
    """Mistral's repositories keep consolidated.safetensors (other names) beside transformers'
    model.safetensors; an adapter's file may sit there too: only model*.safetensors are read."""
    config, tensors = hf_state
    directory = write_hf(tmp_path / "m", config, tensors)
    write_hf(directory, config, {"layers.0.attention.wq.weight": torch.zeros(32, 32)}, file="consolidated.safetensors")
    assert len(load(directory).layers) == 2


# ---- GGUF ----

def write_gguf(path, *, skip=(), block_count: int = 2, extra: str | None = None, tokenizer: bool = False) -> None:
    """A tiny llama GGUF (f32, random), its metadata keys in ``skip`` left out; ``extra``: one
    more tensor of that name."""
    from gguf import GGUFWriter

    rng = np.random.default_rng(0)
    hidden, inter, heads, kv_heads, d, vocab = 32, 48, 4, 2, 8, 96
    writer = GGUFWriter(str(path), "llama")
    keys = {"context_length": 128, "embedding_length": hidden, "block_count": block_count,
            "feed_forward_length": inter, "head_count": heads, "head_count_kv": kv_heads}
    for key, value in keys.items():
        if key not in skip:
            getattr(writer, f"add_{key}")(value)
    writer.add_vocab_size(vocab)
    if tokenizer:
        writer.add_tokenizer_model("gpt2")
        writer.add_token_list([f"t{i}" for i in range(vocab)])
    shapes = {"token_embd.weight": (vocab, hidden), "output_norm.weight": (hidden,), "output.weight": (vocab, hidden)}
    for i in range(2):
        shapes.update({f"blk.{i}.attn_norm.weight": (hidden,), f"blk.{i}.ffn_norm.weight": (hidden,),
                       f"blk.{i}.attn_q.weight": (heads * d, hidden), f"blk.{i}.attn_k.weight": (kv_heads * d, hidden),
                       f"blk.{i}.attn_v.weight": (kv_heads * d, hidden),
                       f"blk.{i}.attn_output.weight": (hidden, heads * d), f"blk.{i}.ffn_gate.weight": (inter, hidden),
                       f"blk.{i}.ffn_up.weight": (inter, hidden), f"blk.{i}.ffn_down.weight": (hidden, inter)})
    if extra:
        shapes[extra] = (hidden,)
    for name, shape in shapes.items():
        writer.add_tensor(name, rng.standard_normal(shape, dtype=np.float32))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file, writer.close):
        step()


@pytest.mark.parametrize("fields, words", [
    (dict(skip=("head_count",)), r"the GGUF file has no llama\.attention\.head_count"),
    (dict(skip=("block_count",)), r"the GGUF file has no llama\.block_count"),
    (dict(block_count=1), r"no place for: model\.layers\.1\."),  # llama.cpp: "wrong number of tensors"
    (dict(extra="blk.0.attn_sinks.weight"), r"a tensor this engine does not read: blk\.0\.attn_sinks\.weight"),
    (dict(extra="mm.projector.weight"), r"a tensor this engine does not read: mm\.projector\.weight"),
])
def test_a_gguf_file_that_is_not_what_its_metadata_says_is_refused_at_load(tmp_path, fields, words):
    write_gguf(tmp_path / "m.gguf", **fields)
    with pytest.raises(ConfigError, match=words):
        load(tmp_path / "m.gguf")


def test_a_gguf_file_is_known_by_its_first_bytes_and_a_directory_of_one_names_it(tmp_path):
    """An ollama blob (``sha256-...``) has no suffix: still GGUF; a directory holding only a
    .gguf file gets the file's name in its error."""
    blob = tmp_path / "sha256-0123abcd"
    write_gguf(blob)
    assert ModelSource(blob, blob.name).is_gguf
    assert len(load(blob).layers) == 2
    (tmp_path / "dir").mkdir()
    write_gguf(tmp_path / "dir" / "model.gguf")
    with pytest.raises(ConfigError, match=r"has no config\.json \(for its GGUF file, give the file: .*model\.gguf\)"):
        read_config(ModelSource(tmp_path / "dir", "dir"))


def test_a_gguf_vocabulary_transformers_cannot_build_is_one_error(tmp_path, monkeypatch):
    from engine.tokenizer import load_tokenizer

    monkeypatch.setenv("ENGINE_CACHE_DIR", str(tmp_path / "cache"))
    write_gguf(tmp_path / "m.gguf")  # no tokenizer metadata at all
    with pytest.raises(ConfigError, match=r"m\.gguf: no tokenizer built from its vocabulary"):
        load_tokenizer(ModelSource(tmp_path / "m.gguf", "m"))


def test_the_server_refuses_a_mismatched_checkpoint_in_one_line_and_exit_2(hf_state, tmp_path):
    config, tensors = hf_state
    directory = write_hf(tmp_path / "m", {**config, "num_key_value_heads": 4}, tensors)
    done = subprocess.run([sys.executable, "-m", "engine.api", "--model", str(directory), "--port", "0",
                           "--tokenizer", str(directory)], capture_output=True, text=True, timeout=120)
    assert done.returncode == 2, done.stderr[-2000:]
    assert "Traceback" not in done.stderr
    assert "k_proj.weight is [16, 32], not [32, 32]" in done.stderr.strip().splitlines()[-1]
