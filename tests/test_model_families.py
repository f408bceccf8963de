"""Each model family against transformers, with no downloads: a tiny random-weight model built
by transformers from a config (its quirks switched on: rotary scaling with prompts past the
original context, per-head q/k norms, fused projections, sliding windows shorter than the
prompts, soft-capping, Gemma's norms and embeddings), saved as safetensors, loaded by our
loader; greedy tokens and logprobs must equal transformers' in fp32, under chunked prefill,
prefix caching and preemption, on the torch and cpu backends (and cuda and triton where a GPU is).
"""

from __future__ import annotations

import pytest
import torch

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.errors import ConfigError
from engine.sampling_params import SamplingParams
from tests.conftest import Reference, assert_matches_reference

pytestmark = pytest.mark.slow

SHAPE = dict(vocab_size=160, hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, max_position_embeddings=256, rms_norm_eps=1e-5,
             tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, pad_token_id=0)
# (model_type, config fields): the original contexts of the scaled rotaries (64) are shorter
# than the longest prompts, so the scaling changes the result.
FAMILIES = {
    "llama3-rope": ("llama", dict(rope_parameters=dict(rope_type="llama3", rope_theta=500000.0, factor=8.0,
                                                       low_freq_factor=1.0, high_freq_factor=4.0,
                                                       original_max_position_embeddings=64))),
    "llama-linear": ("llama", dict(rope_parameters=dict(rope_type="linear", rope_theta=10000.0, factor=2.0))),
    "llama-yarn": ("llama", dict(rope_parameters=dict(rope_type="yarn", rope_theta=10000.0, factor=4.0,
                                                      original_max_position_embeddings=64))),
    "llama-dynamic": ("llama", dict(rope_parameters=dict(rope_type="dynamic", rope_theta=10000.0, factor=2.0))),
    # Llama's attention_bias puts a bias on o as well as on q, k and v; mlp_bias on gate, up and down.
    "llama-biases": ("llama", dict(attention_bias=True, mlp_bias=True)),
    "mistral": ("mistral", dict(sliding_window=24)),
    "qwen2": ("qwen2", dict()),
    "qwen2-window": ("qwen2", dict(use_sliding_window=True, sliding_window=24, max_window_layers=1)),
    "qwen3": ("qwen3", dict()),
    "phi3": ("phi3", dict(sliding_window=None)),
    # Phi-4-mini's shape: a rotary over 3/4 of each head, sliding window on every layer.
    "phi3-partial-rotary": ("phi3", dict(sliding_window=40, partial_rotary_factor=0.75)),
    "gemma": ("gemma", dict(tie_word_embeddings=True)),
    # Gemma 2: soft-caps of its real config (50 on attention scores, 30 on logits) and every
    # other layer a window; the scale from query_pre_attn_scalar (256, not head_dim 16).
    "gemma2": ("gemma2", dict(sliding_window=24, num_hidden_layers=3, tie_word_embeddings=True)),
    "gemma2-small-caps": ("gemma2", dict(sliding_window=24, attn_logit_softcapping=1.0, final_logit_softcapping=2.0,
                                         query_pre_attn_scalar=16)),
    # Gemma 3: windowed layers with their own rotary base; the global layer's rotary scaled.
    "gemma3": ("gemma3_text", dict(sliding_window=24, num_hidden_layers=3, sliding_window_pattern=3,
                                   query_pre_attn_scalar=24, tie_word_embeddings=True,
                                   rope_parameters={"sliding_attention": dict(rope_type="default", rope_theta=10000.0),
                                                    "full_attention": dict(rope_type="linear", factor=2.0,
                                                                           rope_theta=1e6)})),
}
MAX_TOKENS = 10

# float32 throughout, the KV cache too: these tests hold the model's arithmetic to an oracle.
FP32 = dict(dtype="float32", kv_cache_dtype="float32", activation_quantization="none")


@pytest.fixture(scope="module", params=list(FAMILIES))
def family_model(request, tmp_path_factory):
    """(directory of the saved model, the transformers model): random weights, every norm
    weight away from 1 so that a norm applied wrongly (or not at all) shows."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, fields = FAMILIES[request.param]
    config = AutoConfig.for_model(model_type, **{**SHAPE, **fields})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, param in model.named_parameters():
            if "norm" in name:
                param.copy_(1 + 0.3 * torch.randn_like(param))
            else:
                param.normal_(0, 0.15)
    directory = tmp_path_factory.mktemp(request.param)
    model.save_pretrained(directory, safe_serialization=True)
    return directory, model


@torch.inference_mode()
def transformers_greedy(model, prompt: list[int]) -> Reference:
    model.generation_config.eos_token_id = None  # as ignore_eos: EOS is a token like any other
    out = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)), do_sample=False,
                         max_new_tokens=MAX_TOKENS, output_logits=True,
                         return_dict_in_generate=True, pad_token_id=0, top_k=None, top_p=None, temperature=None)
    return Reference(out.sequences[0, len(prompt):].tolist(), [step[0].float() for step in out.logits])


def prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(1)
    shared = torch.randint(3, 160, (40,), generator=gen).tolist()
    lengths = (3, 17, 90, 150)  # 90 and 150: past the scaled rotaries' original context of 64
    return [torch.randint(3, 160, (n,), generator=gen).tolist() for n in lengths] + [shared + [5, 6], shared + [7]]


# On a machine with a GPU the CUDA library and the Triton kernels run the same models there.
BACKENDS = ["torch", "cpu"] + (["cuda", "triton"] if torch.cuda.is_available() else [])


def run(directory, backend: str, **fields) -> tuple[dict[str, list[int]], dict[str, list[float]], EngineCore]:
    device = "cuda" if backend in ("cuda", "triton") else "cpu"
    core = EngineCore(EngineConfig(model=str(directory), backend=backend, **FP32, device=device,
                                   **{"num_kv_blocks": 64, "max_num_batched_tokens": 32, "max_num_seqs": 4,
                                      **fields}))
    params = SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True, logprobs=0)
    for i, prompt in enumerate(prompts()):
        core.add_request(str(i), prompt, params)
    tokens = {str(i): [] for i in range(len(prompts()))}
    logprobs = {str(i): [] for i in range(len(prompts()))}
    while core.has_unfinished_requests:
        for delta in core.step():
            tokens[delta.request_id] += delta.new_token_ids
            logprobs[delta.request_id] += [p.logprob for p in delta.new_logprobs]
    return tokens, logprobs, core


@pytest.mark.parametrize("backend", BACKENDS)
def test_greedy_tokens_and_logprobs_match_transformers(family_model, backend):
    directory, hf = family_model
    # 32-token steps split the long prompts (chunked prefill); the shared 40-token prefix hits
    # the cache for the second prompt that has it.
    tokens, logprobs, core = run(directory, backend)
    assert core.stats().prefix_cache_hits > 0
    for i, prompt in enumerate(prompts()):
        reference = transformers_greedy(hf, prompt)
        assert_matches_reference(tokens[str(i)], reference, label=f"prompt {i} ({len(prompt)} tokens)")
        if tokens[str(i)] == reference.token_ids:  # logprobs where the tokens agree
            expected = [torch.log_softmax(step, -1)[t].item() for step, t in zip(reference.logits, tokens[str(i)])]
            torch.testing.assert_close(torch.tensor(logprobs[str(i)]), torch.tensor(expected), atol=2e-4, rtol=2e-4)


def test_preemption_keeps_the_tokens(family_model):
    """With too few KV blocks for every request at once, requests are preempted and recomputed;
    the tokens stay those of an engine with room for all."""
    directory, _ = family_model
    roomy, _, core = run(directory, "cpu")
    groups = core.kv_groups.num_groups  # (a block is one layer group's: as many for the same bytes)
    tight, _, core = run(directory, "cpu", num_kv_blocks=18 * groups, enable_prefix_caching=False)
    assert tight == roomy
    if core.block_manager.sliding_window is None:
        assert core.stats().num_preemptions > 0
    else:
        if None not in core.block_manager.windows:  # every layer windowed: the blocks the windows
            assert core.stats().num_preemptions == 0  # passed went back, and were enough
        if core.stats().num_preemptions == 0:  # fewer blocks still, so that some request is preempted
            tighter, _, core = run(directory, "cpu", num_kv_blocks=8 * groups, enable_prefix_caching=False)
            assert core.stats().num_preemptions > 0 and tighter == roomy


# transformers' names -> GGUF's (llama.cpp's conversion), per layer and for the whole model.
GGUF_LAYER_NAMES = {"input_layernorm": "attn_norm", "post_attention_layernorm": "ffn_norm",
                    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
                    "self_attn.o_proj": "attn_output", "self_attn.q_norm": "attn_q_norm",
                    "self_attn.k_norm": "attn_k_norm", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
                    "mlp.down_proj": "ffn_down"}
GGUF_TOP_NAMES = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def write_gguf(model, arch: str, path, packed: bool) -> None:
    """The transformers model as llama.cpp's conversion writes it: its metadata, its tensor names,
    llama's q/k rows permuted into interleaved rotary pairs; the matrices as Q8_0 if ``packed``."""
    import numpy as np
    from gguf import GGMLQuantizationType, GGUFWriter
    from gguf.quants import quantize

    config = model.config
    writer = GGUFWriter(str(path), arch)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_block_count(config.num_hidden_layers)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_key_length(config.head_dim)
    writer.add_value_length(config.head_dim)
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_rope_freq_base(config.rope_parameters["rope_theta"])
    writer.add_vocab_size(config.vocab_size)
    for name, tensor in model.state_dict().items():
        stem, kind = name.rsplit(".", 1)
        if stem.startswith("model.layers."):
            _, _, layer, part = stem.split(".", 3)
            gguf_name = f"blk.{layer}.{GGUF_LAYER_NAMES[part]}.{kind}"
        else:
            gguf_name = f"{GGUF_TOP_NAMES[stem]}.{kind}"
        w = tensor.float().numpy()
        heads = {"q_proj": config.num_attention_heads, "k_proj": config.num_key_value_heads}
        for proj, n in heads.items():
            if arch == "llama" and stem.endswith(proj):  # llama.cpp's permute: halves -> interleaved pairs
                w = w.reshape(n, 2, w.shape[0] // n // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)
        if packed and w.ndim == 2:
            writer.add_tensor(gguf_name, quantize(np.ascontiguousarray(w), GGMLQuantizationType.Q8_0),
                              raw_dtype=GGMLQuantizationType.Q8_0)
        else:
            writer.add_tensor(gguf_name, np.ascontiguousarray(w))
    for step in (writer.write_header_to_file, writer.write_kv_data_to_file, writer.write_tensors_to_file, writer.close):
        step()


@pytest.mark.parametrize("family", ["llama-linear", "llama-biases", "qwen2", "qwen3"])
def test_gguf_files_of_these_families_give_the_safetensors_tokens(family, tmp_path):
    """The same random weights written as GGUF (f32, and Q8_0 kept packed) load to the same model:
    llama's permuted q/k rows come back, qwen3's q/k norms are found."""
    from transformers import AutoConfig, AutoModelForCausalLM

    model_type, fields = FAMILIES[family]
    fields = {k: v for k, v in fields.items() if k != "rope_parameters"}  # default rotary in GGUF
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**SHAPE, **fields}))
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1 + 0.3 * torch.randn_like(param)) if "norm" in name else param.normal_(0, 0.15)
    model.save_pretrained(tmp_path / "hf")
    expected, _, _ = run(tmp_path / "hf", "cpu")
    write_gguf(model, model_type, tmp_path / "model.gguf", packed=False)
    assert run(tmp_path / "model.gguf", "cpu")[0] == expected
    write_gguf(model, model_type, tmp_path / "packed.gguf", packed=True)
    core = EngineCore(EngineConfig(model=str(tmp_path / "packed.gguf"), backend="cpu", **FP32, device="cpu",
                                   num_kv_blocks=64))
    assert core.model.layers[0].qkv_proj.kind == "Q8_0"  # kept packed
    # The packed kernels give the tokens of the same Q8_0 values dequantized to fp32.
    assert run(tmp_path / "packed.gguf", "cpu")[0] == run(tmp_path / "packed.gguf", "cpu", quantization="none")[0]


def test_an_unsupported_family_is_a_clear_error(tmp_path):
    (tmp_path / "config.json").write_text('{"model_type": "gpt2", "vocab_size": 10}')
    with pytest.raises((ConfigError, ValueError), match="unsupported model_type 'gpt2'.*llama.*qwen3.*phi3"):
        EngineCore(EngineConfig(model=str(tmp_path), backend="torch", **FP32, device="cpu"))


def hf_config(model_type: str, **fields) -> dict:
    return {"model_type": model_type, **SHAPE, **fields}


def test_the_context_stops_where_transformers_would_change_its_computation(tmp_path):
    from engine.models.llama import LlamaConfig

    assert LlamaConfig.from_hf(hf_config("llama")).exact_context_length == 256
    # A sliding window is followed (Phi-3 mini: 2047); longrope past its original context (then
    # long factors for every position) is not: the context stops there.
    assert LlamaConfig.from_hf(hf_config("phi3", sliding_window=100)).exact_context_length == 256
    longrope = dict(rope_type="longrope", rope_theta=10000.0, short_factor=[1.0] * 8, long_factor=[2.0] * 8,
                    original_max_position_embeddings=100)
    phi3 = hf_config("phi3", rope_parameters=longrope, original_max_position_embeddings=100)
    assert LlamaConfig.from_hf(phi3).exact_context_length == 100
    # Asking for more is a clear error naming the setting.
    (tmp_path / "config.json").write_text(__import__("json").dumps(phi3))
    with pytest.raises(ConfigError, match="max_model_len 200 exceeds .* 100 as this engine runs it"):
        EngineCore(EngineConfig(model=str(tmp_path), backend="torch", **FP32, device="cpu",
                                load_format="dummy", max_model_len=200))


@pytest.mark.parametrize("fields, words", [
    (dict(rope_parameters=dict(rope_type="mrope", rope_theta=1e4)), "unsupported rope scaling 'mrope'"),
    (dict(hidden_act="relu"), "unsupported activation 'relu'"),
    (dict(model_type="gemma3_text", use_bidirectional_attention=True), "use_bidirectional_attention"),
])
def test_what_the_engine_does_not_run_is_refused_at_load(fields, words):
    from engine.models.llama import LlamaConfig

    with pytest.raises(ValueError, match=words):
        LlamaConfig.from_hf({**hf_config("llama"), **fields})


def test_longrope_uses_transformers_short_factors_and_attention_scaling():
    """Phi-3's longrope below its original context: transformers' short factors, and cos/sin
    scaled by sqrt(1 + ln(max / original) / ln(original))."""
    import math

    from engine.models.llama import LlamaConfig, RotaryEmbedding

    short = [1.0 + i / 10 for i in range(8)]
    rope = dict(rope_type="longrope", rope_theta=10000.0, short_factor=short, long_factor=[4.0] * 8,
                original_max_position_embeddings=64)
    config = LlamaConfig.from_hf(hf_config("phi3", rope_parameters=rope))
    tables = RotaryEmbedding(config, torch.float32, "cpu")
    inv_freq = 1.0 / (torch.tensor(short) * 10000.0 ** (torch.arange(0, 16, 2).float() / 16))
    scale = math.sqrt(1 + math.log(256 / 64) / math.log(64))
    torch.testing.assert_close(tables.cos[5], torch.cos(5 * inv_freq) * scale)


def test_the_models_other_end_tokens_stop_a_request(family_model, tmp_path):
    """Llama 3.x Instruct lists several end tokens (config.json's eos_token_id list and
    generation_config.json): each stops a request, as EOS does, unless ignore_eos."""
    import json
    import shutil

    directory, _ = family_model
    model_dir = tmp_path / "model"
    shutil.copytree(directory, model_dir)
    (model_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    core = EngineCore(EngineConfig(model=str(model_dir), backend="torch", **FP32, device="cpu",
                                   num_kv_blocks=64))
    assert core.model.config.extra_eos_token_ids == (7,)
    forced = {7: 100.0}  # the model's first choice becomes token 7
    core.add_request("stops", [5, 6, 8], SamplingParams(temperature=0, max_tokens=5, logit_bias=forced))
    core.add_request("goes on", [5, 6, 8], SamplingParams(temperature=0, max_tokens=5, logit_bias=forced,
                                                          ignore_eos=True))
    finished = {}
    while core.has_unfinished_requests:
        for delta in core.step():
            if delta.finished:
                finished[delta.request_id] = delta
    assert finished["stops"].finish_reason == "stop" and finished["stops"].stop_reason == 7
    assert finished["goes on"].finish_reason == "length"


def test_a_sliding_window_counts_where_transformers_applies_it():
    from engine.models.llama import LlamaConfig

    def windows(model_type, **fields):
        return LlamaConfig.from_hf(hf_config(model_type, **fields)).layer_windows

    assert windows("mistral", sliding_window=64) == (64, 64)
    assert windows("qwen2", sliding_window=64) == (None, None)  # switched off
    # Qwen: the layers from max_window_layers on
    assert windows("qwen3", sliding_window=64, use_sliding_window=True, max_window_layers=1) == (None, 64)
    assert windows("llama", sliding_window=64) == (None, None)  # llama ignores it
    assert windows("gemma2", sliding_window=64, num_hidden_layers=4) == (64, None, 64, None)  # every other layer
    assert windows("gemma3_text", sliding_window=64, num_hidden_layers=7) == (64,) * 5 + (None, 64)  # 5 in 6


def test_gemma3_reads_an_old_style_config_as_transformers_does():
    """Gemma 3's published config.json: rope_theta and rope_scaling for the global layers,
    rope_local_base_freq for the sliding ones; transformers' defaults for the rest."""
    from engine.models.llama import LlamaConfig

    config = LlamaConfig.from_hf(hf_config("gemma3_text", rope_theta=1e6, rope_local_base_freq=10000.0,
                                           rope_scaling=dict(rope_type="linear", factor=8.0)))
    assert (config.rope_scaling["rope_type"], config.rope_scaling["factor"], config.rope_theta) == ("linear", 8.0, 1e6)
    assert (config.local_rope["rope_type"], config.local_rope["rope_theta"]) == ("default", 10000.0)
    assert config.query_pre_attn_scalar == 256 and config.hidden_act == "gelu_pytorch_tanh"
    assert config.attn_logit_softcapping is None and config.final_logit_softcapping is None
    gemma2 = LlamaConfig.from_hf(hf_config("gemma2"))  # Gemma 2's defaults: both caps on
    assert (gemma2.attn_logit_softcapping, gemma2.final_logit_softcapping) == (50.0, 30.0)


def test_a_model_directory_can_take_its_tokenizer_from_a_gguf_file(family_model, tokenizer):
    """``tokenizer=`` accepts a .gguf file (its vocabulary built and cached as a GGUF model's
    is): how bench/offline.py runs random-weight directories that have no tokenizer."""
    from engine.api import LLM
    from engine.models.loader import default_model_path

    directory, _ = family_model
    llm = LLM(str(directory), tokenizer=str(default_model_path()), backend="cpu", **FP32, num_kv_blocks=64)
    assert llm.get_tokenizer().get_vocab() == tokenizer.get_vocab()
    out = llm.generate([{"prompt_token_ids": [5, 6, 7]}], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


def test_generation_config_sampling_values_are_the_defaults_of_api_requests():
    from api.protocol import CompletionRequest, sampling_params
    from engine.models.llama import LlamaConfig

    generation = {"do_sample": True, "temperature": 0.6, "top_p": 0.9, "top_k": None, "eos_token_id": [2, 9]}
    config = LlamaConfig.from_hf(hf_config("llama"), generation)
    assert config.sampling_defaults == {"temperature": 0.6, "top_p": 0.9}
    assert config.extra_eos_token_ids == (9,)
    unset = sampling_params(CompletionRequest(prompt="hi"), chat=False, defaults=config.sampling_defaults)
    assert (unset.temperature, unset.top_p, unset.top_k) == (0.6, 0.9, 0)
    given = sampling_params(CompletionRequest(prompt="hi", temperature=0.0), chat=False,
                            defaults=config.sampling_defaults)
    assert (given.temperature, given.top_p) == (0.0, 0.9)  # what the request sets wins
    plain = sampling_params(CompletionRequest(prompt="hi"), chat=False)  # --generation-config vllm
    assert (plain.temperature, plain.top_p) == (1.0, 1.0)


def test_a_sharded_bf16_checkpoint_loads_the_shards_its_index_names(family_model, tmp_path):
    """save_pretrained's shards and index, in bfloat16 (the checkpoint's dtype, cast to the
    engine's at load), beside a stray copy the index does not name (as Mistral repositories
    keep consolidated.safetensors): the stray file is not read."""
    from safetensors.torch import save_file

    from engine.models.loader import SAFETENSORS_INDEX

    _, hf = family_model
    hf.to(torch.bfloat16).save_pretrained(tmp_path, max_shard_size="40KB")
    hf.to(torch.float32)
    assert len(list(tmp_path.glob("*.safetensors"))) > 1 and (tmp_path / SAFETENSORS_INDEX).exists()
    save_file({"model.embed_tokens.weight": torch.zeros(3, 3)}, tmp_path / "single-file-copy.safetensors")
    tokens, _, _ = run(tmp_path, "cpu")
    # the same weights rounded to bf16, unsharded
    bf16 = tmp_path / "unsharded"
    hf.to(torch.bfloat16).save_pretrained(bf16)
    hf.to(torch.float32)
    assert tokens == run(bf16, "cpu")[0]
    (tmp_path / next(iter(sorted(tmp_path.glob("model-*.safetensors")))).name).unlink()
    with pytest.raises(ConfigError, match=f"lacks model-.*named by {SAFETENSORS_INDEX}"):
        run(tmp_path, "cpu")
