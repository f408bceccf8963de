"""``open_engine(engine_process=True)``: the engine core in a process of its own, from a trio
program: the same tokens as in one process, aborts that free blocks in the engine, the
engine's own start-up errors, and no process left behind."""

from __future__ import annotations

import contextlib
import os
import socket
import struct

import attrs
import pytest
import trio
import trio.testing

from engine.errors import ConfigError, EngineDeadError, EngineOverloadedError, InvalidParameterError
from engine.frontend.async_engine import open_engine
from engine.frontend.beam_search import BeamSearchParams
from engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from tests.conftest import gated_manager, until

pytestmark = pytest.mark.slow

# These tests compare tokens and logprobs across layouts that batch a request differently: the
# requests cross a socket one message at a time, so an engine process's first step may hold any
# number of the prompts, and which data-parallel engine gets which is the router's. So batch
# invariance (every row summed in an order set by that row alone: the same bits in any batch),
# float32 (on a CPU with AMX, ``auto`` is bfloat16; ``auto`` activations round batches of 16+
# rows to bf16 on AVX512_BF16 CPUs) and a float32 cache (an int8 one rounds each K/V row).
CONFIG = dict(backend="cpu", num_kv_blocks=128, max_num_seqs=8, max_num_batched_tokens=64, dtype="float32",
              kv_cache_dtype="float32", activation_quantization="none", batch_invariant=True)
PROMPTS = ["Hello, my name is", "The capital of France is", "List three colors:", "1, 2, 3,", "Once upon a time"]


async def greedy(**fields) -> tuple[list[list[int]], object]:
    params = SamplingParams(temperature=0, max_tokens=24, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY,
                            logprobs=1)
    async with open_engine(**CONFIG, **fields) as client:
        results = {}
        async for index, output in client.generate_many(PROMPTS, params):
            results[index] = (output.outputs[0].token_ids, [next(iter(p.values())).logprob
                                                            for p in output.outputs[0].logprobs])
        return [results[i] for i in range(len(PROMPTS))], client.stats()


async def test_the_split_engine_gives_the_tokens_and_logprobs_of_one_process():
    split, split_stats = await greedy(engine_process=True)
    local, local_stats = await greedy()
    assert split == local  # tokens and logprobs, bit for bit (batch invariance: see CONFIG)
    # the stats ride on every step's output: the front sees the engine's counters
    assert split_stats.num_generation_tokens == local_stats.num_generation_tokens == 24 * len(PROMPTS)
    assert split_stats.kv_blocks_used == 0


@pytest.mark.parametrize("engine_process", [False, True])
async def test_an_error_of_the_callers_block_leaves_open_engine_as_itself(engine_process):
    """Not inside the engine nursery's ExceptionGroup: ``except KeyError`` around the block works.
    (A beam search on the way: the front knows the model's end tokens in either layout.)"""
    with pytest.raises(KeyError, match="mine"):
        async with open_engine(**CONFIG, engine_process=engine_process) as client:
            async for _ in client.generate("Hi", SamplingParams(max_tokens=2)):
                pass
            assert client.eos_token_ids == (client.tokenizer.eos_token_id,)
            beams = await client.beam_search("Hi", BeamSearchParams(beam_width=2, max_tokens=3))
            assert len(beams.outputs) == 2 and beams.outputs[0].token_ids != beams.outputs[1].token_ids
            raise KeyError("mine")


def test_ungrouped_gives_a_keyboard_interrupt_as_itself_and_keeps_a_group_of_cancellations():
    from engine.errors import ungrouped

    with pytest.raises(KeyboardInterrupt):
        with ungrouped():
            raise BaseExceptionGroup("nursery", [BaseExceptionGroup("inner", [KeyboardInterrupt()])])
    with pytest.raises(BaseExceptionGroup):
        with ungrouped():
            raise BaseExceptionGroup("nursery", [GeneratorExit()])


async def test_an_abandoned_stream_frees_its_blocks_in_the_engine_process():
    async with open_engine(**CONFIG, engine_process=True) as client:
        params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
        async for output in client.generate("Tell me a long story.", params):
            if len(output.outputs[0].token_ids) >= 3:
                assert client.stats().kv_blocks_used > 0
                break  # generate() aborts the request
        with trio.fail_after(10):
            while client.stats().kv_blocks_used or client.stats().num_running:
                await trio.sleep(0.02)  # each step's output carries the engine's stats
        # and the engine goes on serving
        async for output in client.generate("Hi", SamplingParams(max_tokens=2, ignore_eos=True)):
            pass
        assert output.finished


async def test_bad_requests_are_refused_in_the_front_with_the_engines_limits():
    async with open_engine(**CONFIG, engine_process=True, max_model_len=64) as client:
        assert client.max_model_len == 64
        assert client._engine.structured_outputs.validate_only  # (the engine compiles its own grammars)
        with pytest.raises(InvalidParameterError, match="maximum context length is 64"):
            client.submit([5] * 80)
        with pytest.raises(InvalidParameterError, match="outside the vocabulary"):
            client.submit([10**7])
        # Values that cannot cross the wire (past 64 bits, or of the wrong type: the engine's
        # decoder refused them and the broken link failed every request of the engine)
        big = StructuredOutputsParams(json={"type": "integer", "maximum": 10**30})
        with pytest.raises(InvalidParameterError, match="cannot be sent to the engine process") as error:
            client.submit("Hi", SamplingParams(structured_outputs=big))
        assert error.value.param == "structured_outputs"
        with pytest.raises(InvalidParameterError, match="priority must be a 64-bit integer"):
            client.submit("Hi", priority=2**70)
        with pytest.raises(InvalidParameterError, match="request_id must be a string"):
            client.submit("Hi", request_id=7)
        with pytest.raises(InvalidParameterError, match="ignore_eos must be a boolean"):
            SamplingParams(ignore_eos="yes")
        with pytest.raises(InvalidParameterError, match="max_tokens must be an integer"):
            SamplingParams(max_tokens=2**70)
        with pytest.raises(InvalidParameterError, match="output_kind must be a RequestOutputKind"):
            SamplingParams(output_kind=1)
        import numpy as np

        # (the engine serves on; numpy's integers are integers)
        tokens = [o.outputs[0].token_ids
                  async for o in client.generate("Hi", SamplingParams(max_tokens=2), priority=np.int64(0))][-1]
        assert len(tokens) == 2 and client.stats().num_running == 0


async def test_the_engines_start_up_error_reaches_the_caller_unchanged():
    with pytest.raises(ConfigError) as error:
        async with open_engine(**{**CONFIG, "num_kv_blocks": 2}, engine_process=True, max_model_len=4096):
            pass
    assert error.value.param == "max_model_len" and "does not fit in the KV cache" in str(error.value)


@pytest.mark.parametrize("end", [trio.BrokenResourceError, trio.EndOfChannel])
async def test_a_lost_link_names_how_the_process_ended_even_when_its_exit_comes_late(end):
    """The link of a dying process breaks (or is closed) before its exit status is known: the
    front waits for it (bounded), so the error says the process was killed, not that it stopped
    answering; its counts are zero meanwhile."""
    from engine.messages import EngineStats
    from engine.transport.remote import RemoteCore, RemoteCoreActor

    class LateExit:  # killed, its status known 0.3 s after its link broke (a loaded machine)
        code = None

        def poll(self):
            return self.code

        async def wait(self):
            assert core.stats().kv_blocks_used == 0  # (zero already while the front waits)
            await trio.sleep(0.3)
            self.code = -9
            return self.code

    process = LateExit()

    class LostLink:
        async def receive(self):
            raise end

    core = object.__new__(RemoteCore)
    core.rank, core.pid, core._process, core._receive = 0, 4321, process, LostLink()
    core._stats = EngineStats(1, 0, 3, 10, 0, 0, 0, 0, 0, 0)
    inbox_send, inbox = trio.open_memory_channel(1)
    outbox, _ = trio.open_memory_channel(1)
    with trio.fail_after(5), pytest.raises(EngineDeadError, match=r"\(engine 0, pid 4321\) was killed by SIGKILL"):
        async with inbox_send:
            await RemoteCoreActor(core, inbox, outbox).run()
    assert core.stats().kv_blocks_used == 0


async def test_a_killed_engine_process_fails_every_stream_and_nothing_is_left():
    import signal

    async with open_engine(**CONFIG, engine_process=True) as client:
        pid = client._engine.core.pid
        params = SamplingParams(max_tokens=2000, ignore_eos=True)
        ended = []

        async def stream():
            dead = rf"^the engine process \(engine 0, pid {pid}\) was killed by SIGKILL"  # (not wrapped)
            with pytest.raises(EngineDeadError, match=dead):
                async for _ in client.generate("Tell me a long story.", params):
                    pass
            ended.append(trio.current_time())

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                for _ in range(4):
                    nursery.start_soon(stream)
                while client.stats().num_running < 4:
                    await trio.sleep(0.02)
                os.kill(pid, signal.SIGKILL)
        assert len(ended) == 4 and client.errored
        assert "engine process" in str(await client.wait_failed())
    assert not os.path.exists(f"/proc/{pid}")  # reaped


async def test_when_one_engine_of_a_group_dies_the_others_end_at_once():
    """One engine's death is the group's: the others exit then (their model and KV cache
    freed), not when the front does (under --on-engine-failure refuse, never)."""
    import signal

    async with open_engine(**CONFIG, data_parallel_size=2) as client:
        pids = [engine.pid for engine in client._engine.core.engines]
        os.kill(pids[0], signal.SIGKILL)
        with trio.fail_after(30):
            await client.wait_failed()
            while os.path.exists(f"/proc/{pids[1]}") and _state(pids[1]) != "Z":  # (exited: a zombie till reaped)
                await trio.sleep(0.05)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


async def test_an_engine_process_that_stops_answering_is_declared_dead(monkeypatch):
    """A stopped engine process (SIGSTOP; a wedged interpreter) can report nothing: its
    heartbeats stop, and the front declares it dead after the silence limit (requests waited
    for ever, /health said 200)."""
    import signal

    from engine.transport import protocol

    monkeypatch.setattr(protocol, "SILENCE_LIMIT_S", 5.0)
    async with open_engine(**CONFIG, engine_process=True) as client:
        pid = client._engine.core.pid
        await trio.sleep(6.0)  # past the limit: heartbeats alone keep an idle engine alive
        assert not client.errored
        os.kill(pid, signal.SIGSTOP)
        try:
            with trio.fail_after(30), pytest.raises(EngineDeadError, match=r"stopped answering: no word from it"):
                async for _ in client.generate("Hi", SamplingParams(max_tokens=50)):
                    pass
            assert client.errored
        finally:
            os.kill(pid, signal.SIGCONT)
    assert not os.path.exists(f"/proc/{pid}")  # reaped


async def test_two_data_parallel_engines_share_the_requests_and_give_the_same_tokens():
    dp, dp_stats = await greedy(data_parallel_size=2)
    local, _ = await greedy()
    assert dp == local
    assert dp_stats.num_generation_tokens == 24 * len(PROMPTS)  # the engines' counters, added up


async def test_data_parallel_routes_to_the_least_loaded_engine_and_aborts_follow():
    async with open_engine(**CONFIG, data_parallel_size=2) as client:
        params = SamplingParams(temperature=0, max_tokens=1000, ignore_eos=True)
        streams = [client.submit(f"Story number {i}:", params) for i in range(4)]
        with trio.fail_after(30):
            while sum(s.num_running for s in client.engine_stats()) < 4:
                await trio.sleep(0.02)
        assert [s.num_running for s in client.engine_stats()] == [2, 2]  # least loaded first
        for stream in streams:
            client.abort(stream.state.request_id)  # each abort must reach the engine that has it
        with trio.fail_after(10):
            while any(s.kv_blocks_used or s.num_running for s in client.engine_stats()):
                await trio.sleep(0.02)


async def test_data_parallel_engines_draw_their_own_numbers_for_requests_without_a_seed():
    """Each engine draws from seed + its rank: two unseeded requests on two engines came out
    the same, token for token, and a seeded request is still the same on either engine."""
    async with open_engine(**CONFIG, data_parallel_size=2) as client:
        async def run(prompt: str, params: SamplingParams) -> list[list[int]]:
            outputs = {}

            async def one(i: int) -> None:
                async for output in client.generate(prompt, params, request_id=f"{prompt}-{i}"):
                    outputs[i] = output.outputs[0].token_ids

            async with trio.open_nursery() as nursery:
                for i in range(2):  # (one on each engine: the least loaded)
                    nursery.start_soon(one, i)
            return [outputs[0], outputs[1]]

        with trio.fail_after(120):
            before = [s.num_generation_tokens for s in client.engine_stats()]
            unseeded = await run("My favourite animal is", SamplingParams(temperature=1.0, max_tokens=16,
                                                                          ignore_eos=True))
            assert [s.num_generation_tokens - b for s, b in zip(client.engine_stats(), before)] == [16, 16]
            assert unseeded[0] != unseeded[1]
            seeded = await run("My favourite animal is", SamplingParams(temperature=1.0, max_tokens=16,
                                                                        ignore_eos=True, seed=7))
            assert seeded[0] == seeded[1]


async def test_two_engines_of_one_data_parallel_rank_are_refused_at_start():
    """Two --headless machines left at the default start rank would give two engines one rank
    (and so the same random numbers): the start ends naming --data-parallel-start-rank."""
    from engine.config import EngineConfig
    from engine.messages import EngineStats, KVCacheInfo
    from engine.transport.processes import engine_processes
    from engine.transport.protocol import CODEC, EngineReady
    from engine.transport.wire import open_link

    port = _free_port()
    config = EngineConfig(data_parallel_size=2, data_parallel_size_local=0, data_parallel_rpc_port=port)

    async def engine(pid: int) -> None:
        async with open_link(await _connected(port), CODEC, role="engine") as (send, receive):
            cache, stats = KVCacheInfo(16, 64, "float32", 1, True, None), EngineStats(0, 0, 0, 64, 0, 0, 0, 0, 0, 0)
            await send.send(EngineReady("m", 4096, 49152, "cpu", {}, (2,), cache, stats, pid, 1, 0.0))
            try:
                async for _ in receive:  # until the front ends the link
                    pass
            except trio.BrokenResourceError:
                pass

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine, 101)
            nursery.start_soon(engine, 102)
            with pytest.raises(ConfigError, match=r"two engines \(pids 10[12] and 10[12]\) both have data-parallel "
                                                  r"rank 1") as error:
                async with engine_processes(config, 2):
                    pass
    assert error.value.param == "data_parallel_start_rank"


async def test_a_front_with_no_engine_of_its_own_loads_no_model_and_waits_for_one_to_join(monkeypatch):
    """``data_parallel_size_local=0`` with one engine (a front on a machine without the
    accelerator): the front listens for the engine, instead of loading the model itself."""
    import engine.frontend.async_engine as async_engine

    monkeypatch.setattr(async_engine, "EngineCore", lambda config: pytest.fail("the front loaded the model"))
    port = _free_port()
    listening = trio.Event()

    async def knock() -> None:
        (await _connected(port)).socket.close()  # (a stranger: dropped)
        listening.set()

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(knock)

            async def front() -> None:
                async with open_engine(data_parallel_size=1, data_parallel_size_local=0, data_parallel_rpc_port=port):
                    pytest.fail("the front started without its engine")

            nursery.start_soon(front)
            await listening.wait()
            nursery.cancel_scope.cancel()


async def test_an_engine_of_another_machine_has_its_times_read_on_the_fronts_clock():
    """A headless engine's monotonic clock runs from its machine's zero: when it first
    scheduled a request (queue and prefill times, ``first_scheduled_at``) is kept on the front's
    clock, by the offset its ready message and heartbeats show (queue times read 200000 s)."""
    import time

    from engine.messages import AddRequest, EngineStats, KVCacheInfo, StepOutput, TokenDelta
    from engine.transport.protocol import CODEC, EngineReady, Heartbeat
    from engine.transport.wire import open_link

    port = _free_port()
    elsewhere = 100_000.0  # the engine's clock, ahead of the front's by this

    async def engine() -> None:
        async with open_link(await _connected(port), CODEC, role="engine") as (send, receive):
            cache, stats = KVCacheInfo(16, 64, "float32", 1, True, None), EngineStats(0, 0, 0, 64, 0, 0, 0, 0, 0, 0)
            await send.send(EngineReady("m", 4096, 49152, "cpu", {}, (2,), cache, stats, 101, 0,
                                        time.monotonic() + elsewhere))
            with contextlib.suppress(trio.BrokenResourceError):
                async for message in receive:
                    if isinstance(message, AddRequest):
                        # (its ready message waited for the front's start: a heartbeat, read at once, corrects it)
                        await send.send(Heartbeat(time.monotonic() + elsewhere))
                        await trio.sleep(0.2)  # (it waited 0.2 s in the queue)
                        scheduled = time.monotonic() + elsewhere
                        await send.send(StepOutput((TokenDelta(message.request_id, 0, (5,), finish_reason="length",
                                                               first_scheduled_at=scheduled),), (), stats, 1, 1, None))

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(engine)
            async with open_engine(data_parallel_size=1, data_parallel_size_local=0,
                                   data_parallel_rpc_port=port) as client:
                sent = time.monotonic()
                async for output in client.generate([1, 2, 3], SamplingParams(max_tokens=1)):
                    pass
                assert sent + 0.15 < output.first_scheduled_at < time.monotonic()
            nursery.cancel_scope.cancel()


@pytest.mark.parametrize("fields", [dict(engine_process=True), dict(data_parallel_size=2),
                                    dict(data_parallel_size=2, data_parallel_size_local=1)])
def test_the_offline_llm_refuses_a_process_layout_it_would_not_run(fields):
    from engine.api import LLM

    with pytest.raises(ConfigError, match="LLM runs the engine in this process") as error:
        LLM(**fields)
    assert error.value.param == next(iter(fields))


def test_requests_without_a_seed_draw_from_the_seed_offset_by_the_engines_rank():
    from engine.config import EngineConfig
    from engine.sampling_params import MAX_SEED, MIN_SEED

    assert EngineConfig(seed=5).sampling_seed == 5
    assert EngineConfig(seed=5, data_parallel_size=3, data_parallel_rank=2).sampling_seed == 7
    assert EngineConfig(seed=MAX_SEED, data_parallel_size=2, data_parallel_rank=1).sampling_seed == MIN_SEED


@pytest.mark.parametrize("fields, param", [
    (dict(data_parallel_size=2, data_parallel_rank=2), "data_parallel_rank"),
    (dict(data_parallel_size=3, data_parallel_size_local=2, data_parallel_start_rank=2), "data_parallel_start_rank"),
    (dict(data_parallel_size=2, nnodes=2, tensor_parallel_size=2), "nnodes"),
    (dict(data_parallel_size=0), "data_parallel_size"),
    (dict(data_parallel_size=2, data_parallel_size_local=3), "data_parallel_size_local"),
    (dict(data_parallel_size_local=-1), "data_parallel_size_local"),
    (dict(data_parallel_rpc_port=70000), "data_parallel_rpc_port"),
])
def test_wrong_sizes_are_refused_at_start_naming_the_setting(fields, param):
    from engine.config import EngineConfig

    with pytest.raises(ConfigError) as error:
        EngineConfig(**fields)
    assert error.value.param == param


def test_engine_processes_on_one_machine_share_its_cores_or_take_a_gpu_each(monkeypatch):
    """Two CPU engines with 2 threads each on 2 cores ran 4x slower than one engine (OpenMP
    pools spinning against each other): each gets its share of the cores, or a GPU of its own."""
    from engine.config import EngineConfig
    from engine.transport.processes import device_shares

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(5)))
    cpu = EngineConfig(device="cpu")
    assert device_shares(cpu, 1) == [{}]  # one engine takes the machine as it is
    assert device_shares(cpu, 2) == [{"OMP_NUM_THREADS": "2"}] * 2
    assert device_shares(cpu, 8) == [{"OMP_NUM_THREADS": "1"}] * 8
    monkeypatch.setenv("OMP_NUM_THREADS", "3")  # the user's choice stands
    assert device_shares(cpu, 2) == [{}, {}]

    gpu = EngineConfig(device="cuda")
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "3, 5,6")
    assert device_shares(gpu, 2) == [{"CUDA_VISIBLE_DEVICES": "3"}, {"CUDA_VISIBLE_DEVICES": "5"}]
    assert device_shares(gpu, 1) == [{}]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")
    with pytest.raises(ConfigError, match="2 engine processes on this machine need a GPU each; 1 visible") as error:
        device_shares(gpu, 2)
    assert error.value.param == "data_parallel_size"
    # with tensor parallel, an engine takes a GPU per rank (its ranks each took the same one)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1,2,3,4")
    assert device_shares(EngineConfig(device="cuda", tensor_parallel_size=2), 2) == [
        {"CUDA_VISIBLE_DEVICES": "0,1"}, {"CUDA_VISIBLE_DEVICES": "2,3"}]
    with pytest.raises(ConfigError, match="3 engine processes on this machine need 2 GPUs each .*; 5 visible"):
        device_shares(EngineConfig(device="cuda", tensor_parallel_size=2), 3)


@pytest.mark.parametrize("engine_process", [False, True], ids=["one process", "engine process"])
async def test_the_waiting_limit_counts_sequences_the_same_in_every_layout(engine_process):
    # Four sequences of one request run (max_num_seqs 4); six requests come: four wait, two are refused.
    async with open_engine(**{**CONFIG, "max_num_seqs": 4}, max_waiting_requests=4,
                           engine_process=engine_process) as client:
        long = SamplingParams(max_tokens=2000, ignore_eos=True)
        outcomes = []

        async def run(params):
            try:
                async for _ in client.generate("Tell me a long story.", params):
                    pass
            except EngineOverloadedError:
                outcomes.append("refused")

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run, attrs.evolve(long, n=4))
            await until(lambda: client.num_unfinished == 1 and client.num_waiting_sequences == 0, timeout=60)
            for _ in range(6):
                nursery.start_soon(run, long)
            await until(lambda: len(outcomes) == 2)
            await trio.testing.wait_all_tasks_blocked()
            assert outcomes == ["refused"] * 2 and client.num_waiting_sequences == 4
            assert client.num_unfinished == 5
            with pytest.raises(EngineOverloadedError):  # several prompts: all or none
                async for _ in client.generate_many(["a", "b"], long):
                    pass
            assert client.num_unfinished == 5
            with pytest.raises(InvalidParameterError, match="5 sequences"):  # never fits
                async for _ in client.generate("Hi", attrs.evolve(long, n=5)):
                    pass
            nursery.cancel_scope.cancel()


async def test_a_grammar_compiling_in_the_engine_process_holds_back_only_its_own_request(tokenizer):
    """The engine process compiles each grammar again (the front's stays in the front): off
    its message loop, so adds and aborts of other requests pass while it compiles; what comes
    for that request (a stop, an abort) waits behind its add; a refusal is a rejection."""
    import math

    from engine.messages import AbortRequest, AddRequest, RequestRejected, StopRequest
    from engine.transport.engine_process import Fronts

    manager, backend = gated_manager(tokenizer)
    fronts = Fronts(core=None, sends=[None])
    fronts._structured = manager
    link_send, link_receive = trio.open_memory_channel(math.inf)
    inbox_send, inbox_receive = trio.open_memory_channel(math.inf)
    constrained = SamplingParams(structured_outputs=StructuredOutputsParams(regex="slow"))
    refused = SamplingParams(structured_outputs=StructuredOutputsParams(regex="bad"))
    received = []

    async def core():
        async for message in inbox_receive:
            received.append(message)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(core)
        nursery.start_soon(fronts.inlet, 0, link_receive, inbox_send)
        for message in [AddRequest("x", (1,), constrained), AddRequest("y", (1,), SamplingParams()),
                        StopRequest("x", 0, "stop", 1), AbortRequest(("x", "z")), AddRequest("b", (1,), refused),
                        AbortRequest(("y",))]:
            link_send.send_nowait(message)
        await until(lambda: len(received) == 4)
        assert received[:2] == [AddRequest("y", (1,), SamplingParams()), AbortRequest(("z",))]
        assert set(map(type, received[2:])) == {RequestRejected, AbortRequest}  # (b's compile is its own)
        rejection = next(m for m in received if isinstance(m, RequestRejected))
        assert rejection.request_id == "b" and "invalid regex: bad" in str(rejection.error)
        backend.gate("slow").set()
        await until(lambda: len(received) == 7)
        add, stop, abort = received[4:]
        assert add.request_id == "x" and add.grammar == ("compiled", "slow")
        assert (stop, abort) == (StopRequest("x", 0, "stop", 1), AbortRequest(("x",)))
        link_send.close()  # the front goes: its requests are aborted
        await until(lambda: len(received) == 8)
        assert isinstance(received[-1], AbortRequest) and "x" in received[-1].request_ids
        nursery.cancel_scope.cancel()


@pytest.mark.parametrize("method", ["ngram", "draft_model"])
async def test_speculative_decoding_in_engine_processes_gives_the_tokens_of_one_process_without(method):
    """n-gram proposals, and a draft model's (the default model's own), in the engine process and
    in two data-parallel engines: the tokens of one process without proposals (the prompts repeat
    themselves, so proposals are kept), streamed as deltas of several tokens, and the speculative
    counters reach the front, added up."""
    from engine.models.loader import default_model_path

    spec = ({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_min": 2, "disable_by_batch_size": 8}
            if method == "ngram" else {"model": str(default_model_path()), "num_speculative_tokens": 3,
                                       "disable_by_batch_size": 8})
    prompts = ["one two three four, one two three four, one two three four,",
               "red green blue, red green blue, red green blue, red green blue,", "a b c a b c a b c a b c"]
    params = SamplingParams(temperature=0, max_tokens=32, ignore_eos=True, output_kind=RequestOutputKind.DELTA)

    async def run(**fields):
        async with open_engine(**CONFIG, **fields) as client:
            tokens, sizes = {}, []
            async for index, output in client.generate_many(prompts, params):
                tokens.setdefault(index, []).extend(output.outputs[0].token_ids)
                sizes.append(len(output.outputs[0].token_ids))
            return [tokens[i] for i in range(len(prompts))], max(sizes), client.stats()

    plain, _, _ = await run()
    for layout in (dict(engine_process=True), dict(data_parallel_size=2)):
        tokens, largest_delta, stats = await run(speculative_config=spec, **layout)
        assert tokens == plain, layout
        assert largest_delta > 1 and stats.spec_num_accepted_tokens > 0 and stats.kv_blocks_used == 0
        assert sum(stats.spec_accepted_per_pos) == stats.spec_num_accepted_tokens


def test_a_configuration_error_in_the_engine_process_is_one_line_and_exit_2():
    """A mistake the engine process finds while it starts (here an environment variable the
    packed kernels read at load) reaches the server as the one line a flag mistake gets: no
    traceback from either process."""
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-m", "engine.api", "--engine-process", "--port", "0"],
                          capture_output=True, text=True, timeout=180, cwd=Path(__file__).resolve().parent.parent,
                          env={**os.environ, "QM_PACKED_MAX_ROWS": "abc"})
    said = "QM_PACKED_MAX_ROWS='abc': expected a number of rows"
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines()[-1].startswith(f"error: {said}")
    assert "Traceback" not in done.stderr and f"the engine could not start: {said}" in done.stderr


class _TwoFamilies(trio.abc.HostnameResolver):
    """``dualhost`` resolves to 127.0.0.1 and ::1 (a name with an A and an AAAA record)."""

    async def getaddrinfo(self, host, port, family=0, type=0, proto=0, flags=0):
        if host in (b"dualhost", "dualhost"):
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.0.1", int(port))),
                    (socket.AF_INET6, socket.SOCK_STREAM, 6, "", ("::1", int(port), 0, 0))]
        return await trio.to_thread.run_sync(socket.getaddrinfo, host, port, family, type, proto, flags)

    async def getnameinfo(self, sockaddr, flags):
        return socket.getnameinfo(sockaddr, flags)


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def _free_port() -> int:
    """A port of 127.0.0.1 free a moment ago."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


async def _connected(port: int) -> trio.SocketStream:
    """A connection to 127.0.0.1:``port`` once something listens there."""
    while True:
        try:
            return await trio.open_tcp_stream("127.0.0.1", port)
        except OSError:
            await trio.sleep(0.05)


def _free_on_both_loopbacks() -> int:
    """A port free a moment ago on 127.0.0.1 and on ::1 (the front listens on both)."""
    while True:
        with socket.socket() as four, socket.socket(socket.AF_INET6) as six:
            four.bind(("127.0.0.1", 0))
            try:
                six.bind(("::1", four.getsockname()[1]))
            except OSError:
                continue
            return four.getsockname()[1]


@pytest.mark.skipif(not _ipv6_loopback(), reason="no IPv6 loopback here")
async def test_headless_engines_join_past_strangers_on_every_address_and_hear_the_front_at_once():
    """The front's data-parallel port (``--data-parallel-size-local`` below the size): a port
    scan's connection and another program's bytes are dropped and the wait goes on (they ended
    the start); an engine reaching the front over the name's second address (IPv6) joins (only
    the first was accepted); and an engine that joined hears the front's Hello at once, not when
    the last one joins (local engines' 30 s handshake ran out while a node was late)."""
    from engine.config import EngineConfig
    from engine.messages import EngineStats, KVCacheInfo
    from engine.transport.processes import engine_processes
    from engine.transport.protocol import CODEC, EngineReady
    from engine.transport.wire import open_link

    trio.socket.set_custom_hostname_resolver(_TwoFamilies())
    port = _free_on_both_loopbacks()
    config = EngineConfig(data_parallel_size=2, data_parallel_size_local=0, data_parallel_address="dualhost",
                          data_parallel_rpc_port=port)
    heard = {}

    async def engine(host: str, pid: int, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        async with open_link(await until_connected(host), CODEC, role="engine") as (send, receive):
            with trio.fail_after(10):
                await receive.handshake()
            heard[pid] = True
            task_status.started()
            cache, stats = KVCacheInfo(16, 64, "float32", 1, True, None), EngineStats(0, 0, 0, 64, 0, 0, 0, 0, 0, 0)
            await send.send(EngineReady("m", 4096, 49152, "cpu", {}, (2,), cache, stats, pid, pid - 101, 0.0))
            async for _ in receive:  # until the front ends the link
                pass
            await send.aclose()

    async def until_connected(host: str) -> trio.SocketStream:
        while True:
            try:
                return await trio.open_tcp_stream(host, port)
            except OSError:
                await trio.sleep(0.05)

    async def strangers() -> None:
        (await until_connected("127.0.0.1")).socket.close()  # connects and goes (a port scan)
        reset = await until_connected("127.0.0.1")  # goes with a reset (nmap -sT), before or after the accept
        reset.socket.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        reset.socket.close()
        garbage = await until_connected("127.0.0.1")
        await garbage.send_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        await trio.sleep(0.5)
        await nursery.start(engine, "127.0.0.1", 101)  # (it hears the front before the second joins)
        await nursery.start(engine, "::1", 102)

    with trio.fail_after(60):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(strangers)
            async with engine_processes(config, 2) as cores:
                assert sorted(core.pid for core in cores) == [101, 102] and heard == {101: True, 102: True}


async def test_a_front_that_stops_reading_is_dropped_and_the_others_go_on(monkeypatch):
    """--api-server-count: the step outputs went to each front in turn, so one front that read
    nothing (wedged, stopped) held every other front's streams, for good (its heartbeats still
    came, so no front saw the engine as dead). After FRONT_STALL_LIMIT_S of waiting its link is
    cut, its inlet aborts its requests, and the other fronts get every step."""
    import engine.transport.engine_process as engine_process
    from engine.messages import AbortRequest, EngineStats, StepOutput
    from engine.transport.protocol import CODEC
    from engine.transport.wire import open_link

    monkeypatch.setattr(engine_process, "FRONT_STALL_LIMIT_S", 0.5)
    stats = EngineStats(0, 0, 0, 64, 0, 0, 0, 0, 0, 0)
    steps = 500  # (more than a link and its socket hold)

    async def pair():
        a, b = trio.socket.socketpair()
        a.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4096)
        b.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        return trio.SocketStream(a), trio.SocketStream(b)

    (engine_a, front_a), (engine_b, front_b) = await pair(), await pair()
    with trio.fail_after(30):
        async with open_link(engine_a, CODEC, role="engine") as (send_a, receive_a), \
                open_link(engine_b, CODEC, role="engine") as (send_b, receive_b), \
                open_link(front_a, CODEC, role="front") as (_, from_engine_a), \
                open_link(front_b, CODEC, role="front") as (_, from_engine_b):
            fronts = engine_process.Fronts(None, [send_a, send_b])
            steps_send, steps_receive = trio.open_memory_channel(0)
            sent = trio.Event()
            async with trio.open_nursery() as nursery:
                nursery.start_soon(fronts.outlet, steps_receive, sent)
                inbox_send, inbox_receive = trio.open_memory_channel(100)
                nursery.start_soon(fronts.inlet, 1, receive_b, inbox_send)
                received = []

                async def front_a() -> None:  # reads everything; front B never reads
                    async for step in from_engine_a:
                        received.append(step)
                        if len(received) == steps:
                            return

                nursery.start_soon(front_a)
                async with steps_send:
                    for _ in range(steps):
                        await steps_send.send(StepOutput((), (), stats, 0, 0, None))
                await sent.wait()
            assert len(received) == steps
            assert fronts._live == [True, False]
            with pytest.raises(trio.BrokenResourceError):
                await send_b.send(StepOutput((), (), stats, 0, 0, None))
            assert inbox_receive.receive_nowait() == AbortRequest(())  # (B's inlet: its requests, none here)
