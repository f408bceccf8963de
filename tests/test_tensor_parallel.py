"""Tensor parallelism (engine/models/parallel.py, engine/core/tensor_parallel.py) over gloo on this
CPU: ranks 1.. are real processes driven by the plans rank 0 broadcasts. The same greedy tokens
and logprobs within fp32 tolerance as one rank, on random-weight models (8 heads / 4 KV heads;
one KV head, copied to both ranks) through chunked prefill and preemption, and on the default
model split over 3 ranks; sizes that do not divide are refused before any rank starts; a hung
rank fails the step within the configured timeout."""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time

import attrs
import pytest
import torch
import trio

from engine.config import EngineConfig
from engine.core.engine_core import EngineCore
from engine.errors import ConfigError
from engine.sampling_params import SamplingParams
from tests.conftest import run_prompts

pytestmark = pytest.mark.slow

FP32 = dict(backend="cpu", dtype="float32", kv_cache_dtype="float32", activation_quantization="none")


def random_llama(directory, num_kv_heads: int, vocab_size: int = 250, max_positions: int = 512,
                 biases: bool = False) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=vocab_size, hidden_size=128, intermediate_size=192, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=num_kv_heads, head_dim=16,
                         max_position_embeddings=max_positions, tie_word_embeddings=False, bos_token_id=1,
                         eos_token_id=2, attention_bias=biases, mlp_bias=biases)
    torch.manual_seed(num_kv_heads)
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1 + 0.2 * torch.randn_like(param) if "norm" in name else 0.15 * torch.randn_like(param))
    model.save_pretrained(directory, safe_serialization=True)
    return str(directory)


def prompts(vocab: int, lengths=(3, 17, 60, 90)) -> list[list[int]]:
    rng = random.Random(0)
    return [[rng.randrange(3, vocab) for _ in range(n)] for n in lengths]


def run(size: int, model: str | None, batch, params, **fields) -> tuple[list, EngineCore]:
    core = EngineCore(EngineConfig(model=model, tensor_parallel_size=size, **{**FP32, **fields}))
    try:
        return run_prompts(core, batch, params), core
    finally:
        core.close()


@pytest.mark.parametrize("num_kv_heads, biases", [(4, False), (1, False), (4, True)])
def test_two_ranks_give_the_tokens_and_logprobs_of_one(tmp_path, num_kv_heads, biases):
    """32 greedy steps; 16-token steps cut the prompts (chunked prefill), and 24 blocks of 16
    tokens cannot hold every request at once (preemption). With biases on every product, the
    row-split ones (o, down) add theirs once."""
    model = random_llama(tmp_path, num_kv_heads, biases=biases)
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, logprobs=3)
    batch = prompts(250)
    fields = dict(max_num_batched_tokens=16, num_kv_blocks=14, max_num_seqs=4)
    one, _ = run(1, model, batch, params, **fields)
    two, core = run(2, model, batch, params, **fields)
    assert core.stats().num_preemptions > 0
    for (tokens, logprobs), (want, want_lps) in zip(two, one):
        assert tokens == want
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in logprobs]),
                                   torch.tensor([lp.logprob for lp in want_lps]), atol=1e-4, rtol=1e-4)


def test_phi3s_fused_products_split_over_two_ranks_as_their_parts_do(tmp_path):
    """Phi-3's checkpoint fuses q, k, v (qkv_proj) and gate, up (gate_up_proj): each rank takes
    its heads' rows of each part (a name ending in "v_proj.weight" is not a v matrix)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.test_model_families import FAMILIES, SHAPE

    model_type, fields = FAMILIES["phi3-partial-rotary"]
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(model_type, **{**SHAPE, **fields}), dtype=torch.float32)
    with torch.no_grad():
        for name, param in model.named_parameters():
            param.copy_(1 + 0.3 * torch.randn_like(param) if "norm" in name else 0.15 * torch.randn_like(param))
    model.save_pretrained(tmp_path, safe_serialization=True)
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, logprobs=1)
    batch = prompts(SHAPE["vocab_size"], (5, 30, 50))
    one, _ = run(1, str(tmp_path), batch, params, num_kv_blocks=64, max_num_batched_tokens=16)
    two, _ = run(2, str(tmp_path), batch, params, num_kv_blocks=64, max_num_batched_tokens=16)
    for (tokens, logprobs), (want, want_lps) in zip(two, one):
        assert tokens == want
        torch.testing.assert_close(torch.tensor([lp.logprob for lp in logprobs]),
                                   torch.tensor([lp.logprob for lp in want_lps]), atol=1e-4, rtol=1e-4)


def test_the_default_model_over_three_ranks_writes_the_text_of_one(tokenizer):
    """9 heads and 3 KV heads: 3 of each per rank; the packed matrices split on their blocks."""
    texts = ["The capital of France is", "Write a haiku about the sea.", "1, 2, 3, 4,"]
    batch = [tokenizer.encode(t) for t in texts]
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True)
    one, _ = run(1, None, batch, params, num_kv_blocks=128)
    three, _ = run(3, None, batch, params, num_kv_blocks=128)
    assert [tokenizer.decode(t) for t, _ in three] == [tokenizer.decode(t) for t, _ in one]


@pytest.mark.parametrize("size, words", [(2, "does not divide the model's 9 attention heads"),
                                         (4, "does not divide the model's 9 attention heads")])
def test_sizes_that_do_not_divide_are_refused_before_any_rank_starts(size, words, monkeypatch):
    import engine.core.engine_core as engine_core

    started = []
    monkeypatch.setattr(engine_core, "TensorParallelDriver", lambda *a: started.append(a))
    with pytest.raises(ConfigError, match=words):
        EngineCore(EngineConfig(tensor_parallel_size=size, **FP32))
    assert not started


def test_a_hung_rank_fails_the_step_within_the_timeout(tmp_path):
    model = random_llama(tmp_path, 4)
    core = EngineCore(EngineConfig(model=model, tensor_parallel_size=2, distributed_timeout=10.0,
                                   num_kv_blocks=32, **FP32))
    rank = core.tensor_parallel.processes[0]
    try:
        run_prompts(core, prompts(250)[:1], SamplingParams(temperature=0, max_tokens=2))  # (the ranks work)
        os.kill(rank.pid, signal.SIGSTOP)  # hung: alive, answering nothing
        core.add_request("x", prompts(250)[0], SamplingParams(temperature=0, max_tokens=4))
        # distributed_timeout is what ends the wait (gloo's words; NCCL's watchdog names the timeout)
        with pytest.raises(RuntimeError, match=r"Timed out waiting 10000ms|Timeout\(ms\)=10000\b"):
            while core.has_unfinished_requests:
                core.step()
    finally:
        os.kill(rank.pid, signal.SIGKILL)
        core.close()
    assert rank.wait(10) is not None


def test_a_master_port_in_use_ends_the_start_with_one_line(tmp_path):
    """Node 0 of two listens at --master-port for the other node's ranks: a port another process
    holds is a usage error (exit 2, one line naming the flag), not a traceback from torch."""
    import socket

    model = random_llama(tmp_path, 4)
    # (held on IPv6 and IPv4 alike where the host can: torch's store tries an IPv6 socket first,
    # which an IPv4-only holder leaves free on a host with net.ipv6.bindv6only=1)
    dual = socket.has_dualstack_ipv6()
    with socket.create_server(("", 0), family=socket.AF_INET6 if dual else socket.AF_INET, dualstack_ipv6=dual) as holder:
        port = holder.getsockname()[1]
        done = subprocess.run([sys.executable, "-m", "engine.api", "--model", model, "--tensor-parallel-size", "2",
                               "--nnodes", "2", "--node-rank", "0", "--master-addr", "127.0.0.1", "--master-port",
                               str(port), "--port", "0", *(f"--{k.replace('_', '-')}={v}" for k, v in FP32.items())],
                              capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    last = done.stderr.strip().splitlines()[-1]
    assert last.startswith(f"error: --master-port {port}: rank 0 cannot listen there") and "in use" in last, last
    assert "Traceback" not in done.stderr


def _node(model: str, port: int, *flags: str) -> subprocess.Popen:
    """Node 1 of two (``--headless``) on this machine, meeting node 0 at 127.0.0.1:``port``."""
    return subprocess.Popen([sys.executable, "-m", "engine.api", "--headless", "--nnodes", "2", "--node-rank", "1",
                             "--tensor-parallel-size", "2", "--master-addr", "127.0.0.1", "--master-port", str(port),
                             "--model", model, "--distributed-timeout", "5", "--num-kv-blocks", "32",
                             *(f"--{k.replace('_', '-')}={v}" for k, v in {**FP32, **dict(flags)}.items())],
                            stderr=subprocess.PIPE, text=True)


def test_node_0_may_take_longer_to_load_than_the_distributed_timeout(tmp_path, monkeypatch):
    """Both nodes start at once (as a LeaderWorkerSet, Slurm): node 0 serves the group's store
    before it loads its shard, so node 1's ranks wait through loading, not distributed_timeout
    (5 s here; node 0's load takes 20). Node 1 ran out of time connecting before."""
    import engine.core.engine_core as engine_core
    from tests.test_server import free_port

    model, port = random_llama(tmp_path, 4), free_port()
    real = engine_core.load_model
    monkeypatch.setattr(engine_core, "load_model", lambda *a: (time.sleep(20), real(*a))[1])
    node = _node(model, port)
    try:
        core = EngineCore(EngineConfig(model=model, tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1",
                                       master_port=port, distributed_timeout=5.0, num_kv_blocks=32, **FP32))
        try:
            [(tokens, _)] = run_prompts(core, prompts(250)[:1], SamplingParams(temperature=0, max_tokens=4))
            assert len(tokens) == 4
        finally:
            core.close()
        assert node.wait(30) == 0
    finally:
        node.kill()
        node.wait()


@pytest.mark.parametrize("flags, words", [
    ((("model", "/nowhere/model"),), "rank 1 failed to start: ConfigError: model '/nowhere/model' not found"),
    ((("dtype", "bfloat16"),), "rank 1 failed to start: ConfigError: node 1's settings are not node 0's: "
                               "--dtype 'bfloat16' here, 'float32' on node 0"),
])
def test_a_rank_of_another_node_that_cannot_start_ends_the_start_at_once_saying_why(tmp_path, flags, words):
    """Node 1's model missing on that machine, or settings that would fail the first collective
    (the model's dtype): node 0 stops at once with the rank's reason, not after 15 minutes of
    waiting (or a server that fails its first request); node 1 exits with one line."""
    from engine.errors import EngineDeadError
    from tests.test_server import free_port

    model, port = random_llama(tmp_path, 4), free_port()
    node = _node(model, port, *flags)
    try:
        started = time.monotonic()
        with pytest.raises(EngineDeadError, match=words):
            EngineCore(EngineConfig(model=model, tensor_parallel_size=2, nnodes=2, master_addr="127.0.0.1",
                                    master_port=port, distributed_timeout=5.0, num_kv_blocks=32, **FP32))
        assert time.monotonic() - started < 60
        assert node.wait(30) != 0 and "Traceback" not in node.stderr.read()
    finally:
        node.kill()
        node.wait()


def test_a_start_that_fails_frees_the_master_port_and_one_abandoned_stops_waiting():
    """Node 0 serves the group's store before it loads: a start that fails after (here the KV
    cache refused) gives the port back, for the next try; a start waiting for another node's
    ranks gives up when abandoned (Ctrl-C: close() while join holds the device thread)."""
    import threading

    from engine.core.tensor_parallel import TensorParallelDriver, _serve_store
    from engine.errors import EngineDeadError
    from tests.test_server import free_port

    port = free_port()
    two_nodes = dict(tensor_parallel_size=3, nnodes=3, master_addr="127.0.0.1", master_port=port, **FP32)
    with pytest.raises(ConfigError, match="num_kv_blocks"):
        EngineCore(EngineConfig(num_kv_blocks=10**9, **two_nodes))
    _serve_store("127.0.0.1", port, 2, 5.0)  # (free again: it raised "cannot listen there")
    driver = TensorParallelDriver(EngineConfig(**two_nodes), "cpu", {})
    failures = []

    def join():
        try:
            driver.join(8)
        except EngineDeadError as exc:
            failures.append(exc)

    waiting = threading.Thread(target=join)
    waiting.start()
    time.sleep(1)
    assert waiting.is_alive()  # (no other node: it waits)
    driver.abandon()
    waiting.join(5)
    assert not waiting.is_alive() and "abandoned" in str(failures[0])
    driver.stop()


@pytest.mark.parametrize("omp, affinity, fields, threads", [
    (None, 8, dict(tensor_parallel_size=2), 4),
    ("2", 8, dict(tensor_parallel_size=2), 1),  # (a data-parallel engine's share: 2 of the 8 cores)
    (None, 2, dict(tensor_parallel_size=4), 1),
    (None, 8, dict(tensor_parallel_size=4, nnodes=2), 4),  # (2 ranks here, 2 on the other machine)
    ("", 6, dict(tensor_parallel_size=3), 2),
])
def test_each_rank_takes_its_share_of_the_engines_cores(monkeypatch, omp, affinity, fields, threads):
    """Ranks divide the engine's threads (OMP_NUM_THREADS: with data parallel, its share of the
    machine) among this machine's ranks: the machine's whole count ran data parallel x tensor
    parallel at dp times too many threads, and a node's ranks at a share of all the nodes'."""
    from engine.config import EngineConfig
    from engine.core.tensor_parallel import threads_per_rank

    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(affinity)))
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert threads_per_rank(EngineConfig(**fields)) == threads


def test_the_kv_cache_is_held_to_the_memory_this_machines_ranks_share(monkeypatch):
    """On a CPU, a machine's ranks each allocate their cache from one memory: a cache that fits
    once but not twice is refused at two ranks (it was allowed, past the free memory)."""
    import engine.core.engine_core as engine_core
    from engine.runner.model_runner import ModelRunner

    stopped = []

    class Ranks:  # (the other ranks are not started: the refusal comes before they join)
        def __init__(self, *args):
            pass

        def join(self, num_blocks):
            pass

        def abandon(self):
            pass

        def stop(self):
            stopped.append(True)

    monkeypatch.setattr(engine_core, "TensorParallelDriver", Ranks)
    config = EngineConfig(tensor_parallel_size=3, num_kv_blocks=100, **FP32)
    one = EngineCore(EngineConfig(num_kv_blocks=100, **FP32))
    per_block = ModelRunner.kv_bytes_per_block(one.model, 16, one.kv_dtype, True) // 3  # (a rank's heads: a third)
    monkeypatch.setattr(engine_core, "device_free_memory", lambda device: 200 * per_block)
    with pytest.raises(ConfigError, match="for each of this machine's 3 tensor-parallel ranks"):
        EngineCore(config)
    assert stopped == [True]
    EngineCore(attrs.evolve(config, num_kv_blocks=60)).close()
    assert stopped == [True, True]


@pytest.mark.parametrize("where", ["this machine", "another node"])
async def test_a_rank_lost_while_the_engine_idles_fails_the_engine_at_once(tmp_path, tokenizer, where):
    """A rank that dies between requests ends the engine within seconds (/health turns 503, the
    server exits) rather than at the next request, after a load balancer kept sending it work:
    this machine's ranks are its children; another node's tells node 0 through the store."""
    from engine.frontend.async_engine import Engine
    from tests.test_server import child_pids, free_port

    model, port = random_llama(tmp_path, 4), free_port()
    node = _node(model, port) if where == "another node" else None
    core = EngineCore(EngineConfig(model=model, tensor_parallel_size=2, nnodes=2 if node else 1,
                                   master_addr="127.0.0.1", master_port=port, distributed_timeout=60.0,
                                   num_kv_blocks=32, **FP32))
    try:
        async with Engine(core, tokenizer).serve() as client:
            await trio.sleep(2)  # (idle, and well)
            assert not client.errored
            os.kill(child_pids(node.pid)[0] if node else core.tensor_parallel.processes[0].pid, signal.SIGKILL)
            with trio.fail_after(20):
                error = await client.wait_failed()
            assert "tensor-parallel rank 1" in str(error), error
    finally:
        core.close()
        if node:
            node.kill()
            node.wait()


def test_two_nodes_serve_and_the_loss_of_one_ends_every_stream(tmp_path):
    """Two launches on this machine, as on two (``--nnodes 2``, node ranks 0 and 1, meeting at
    127.0.0.1): the server answers; SIGKILL of the second node ends the open streams with an
    error and the server exits 1; no rank is left."""
    import threading
    from concurrent.futures import ThreadPoolExecutor

    import httpx

    from engine.models.loader import default_model_path
    from tests.test_server import child_pids, free_port, gone, start_server, stream_until_it_ends

    # (the default tokenizer's ids; room for streams long enough to outlast the kill)
    model = random_llama(tmp_path, 4, vocab_size=49152, max_positions=1024)
    flags = ["--model", model, "--tokenizer", str(default_model_path()), "--tensor-parallel-size", "2",
             "--nnodes", "2", "--master-addr", "127.0.0.1", "--master-port", str(free_port()), "--backend", "cpu",
             "--dtype", "float32", "--kv-cache-dtype", "float32", "--num-kv-blocks", "256",
             "--distributed-timeout", "60"]
    node = subprocess.Popen([sys.executable, "-m", "engine.api", "--headless", "--node-rank", "1", *flags])
    try:
        base, proc, _ = start_server("--node-rank", "0", *flags)
        ranks = child_pids(node.pid)
        try:
            answer = httpx.post(base + "/v1/completions", json={"prompt": "Hello", "max_tokens": 8,
                                                               "ignore_eos": True}, timeout=60)
            assert answer.status_code == 200 and answer.json()["usage"]["completion_tokens"] == 8
            started = threading.Semaphore(0)
            with ThreadPoolExecutor(max_workers=4) as pool:
                # (4 x 900 tokens fit the 256 blocks of 16: no stream waits for another's blocks)
                futures = [pool.submit(stream_until_it_ends, base, started, 900) for _ in range(4)]
                for _ in range(4):
                    assert started.acquire(timeout=60)
                node.kill()
                results = [f.result(timeout=60) for f in futures]
            for events, _ in results:
                assert events[-1].startswith("transport error") or json.loads(events[-2])["error"]["code"] == \
                    "engine_dead"
            assert proc.wait(timeout=60) == 1
        finally:
            proc.kill()
        node.wait(timeout=10)
        deadline = time.monotonic() + 15
        while not all(gone(pid) for pid in ranks) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert ranks and all(gone(pid) for pid in ranks)
    finally:
        node.kill()
