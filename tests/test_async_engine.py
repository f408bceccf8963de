"""The actor graph on the tiny random model: streaming forms, aborts, cancellation, faults, subscribers."""

from __future__ import annotations

import random
from contextlib import aclosing

import pytest
import trio
import trio.testing

from engine.async_engine import Engine
from engine.errors import EngineDeadError, InvalidParameterError
from engine.sampling_params import RequestOutputKind, SamplingParams

GREEDY = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True)


def prompt(i: int, length: int = 8) -> list[int]:
    return [10 + (i * 7 + j) % 400 for j in range(length)]


async def collect(client, p, params, **kw):
    return [o async for o in client.generate(p, params, **kw)]


async def test_output_kinds_agree(tiny_core, tokenizer):
    async with Engine(tiny_core, tokenizer).serve() as client:
        final = await collect(client, prompt(1), GREEDY)
        delta = await collect(client, prompt(1), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                              output_kind=RequestOutputKind.DELTA))
        only = await collect(client, prompt(1), SamplingParams(temperature=0, max_tokens=12, ignore_eos=True,
                                                             output_kind=RequestOutputKind.FINAL_ONLY))
    full = final[-1].outputs[0]
    assert final[-1].finished and len(full.token_ids) == 12
    assert [t for o in delta for t in o.outputs[0].token_ids] == full.token_ids
    assert "".join(o.outputs[0].text for o in delta) == full.text
    assert len(only) == 1 and only[0].outputs[0].token_ids == full.token_ids
    assert all(a.outputs[0].token_ids == b.outputs[0].token_ids[:len(a.outputs[0].token_ids)]
               for a, b in zip(final, final[1:]))


async def test_n_fans_out_and_merges(tiny_core, tokenizer):
    params = SamplingParams(n=3, temperature=1.0, seed=3, max_tokens=6, ignore_eos=True)
    async with Engine(tiny_core, tokenizer).serve() as client:
        outputs = await collect(client, prompt(2), params)
    assert [c.index for c in outputs[-1].outputs] == [0, 1, 2]
    assert all(len(c.token_ids) == 6 and c.finish_reason == "length" for c in outputs[-1].outputs)


async def test_client_abort_finishes_the_stream_as_abort(tiny_core, tokenizer):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    async with Engine(tiny_core, tokenizer).serve() as client:
        seen = []
        async for output in client.generate(prompt(3), params, request_id="victim"):
            seen.append(output)
            if len(seen) == 3:
                client.abort("victim")
        assert seen[-1].finished and seen[-1].outputs[0].finish_reason == "abort"
        assert client.stats().kv_blocks_used == 0


async def test_cancelled_consumer_frees_its_blocks_within_a_step(tiny_core, tokenizer):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    async with Engine(tiny_core, tokenizer).serve() as client:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(collect, client, prompt(9, 40), params)  # keeps the engine stepping
            steps = client.steps()
            async with aclosing(steps):
                with trio.CancelScope() as victim:
                    async for output in client.generate(prompt(4, 40), params):
                        if output.outputs[0].token_ids and client.stats().num_running == 2:
                            cancelled_after = client.stats().num_steps
                            victim.cancel()
                # Step cancelled_after + 1 may have been scheduled before the abort arrived;
                # the one after it is scheduled after the core drained the abort.
                async for step in steps:
                    if step.stats.num_steps >= cancelled_after + 2:
                        break
            nursery.cancel_scope.cancel()
        await wait_until_idle(client)
        assert client.stats().kv_blocks_used == 0
    assert victim.cancelled_caught
    assert step.stats.num_running == 1  # only the other request is left


async def test_break_out_of_the_loop_aborts(tiny_core, tokenizer):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    async with Engine(tiny_core, tokenizer).serve() as client:
        async with aclosing(client.generate(prompt(5), params)) as outputs:
            async for _ in outputs:
                break
        await wait_until_idle(client)
        assert client.stats().kv_blocks_used == 0


async def wait_until_idle(client, timeout: float = 10) -> None:
    with trio.fail_after(timeout):
        while client.stats().num_running or client.stats().num_waiting:
            await trio.sleep(0.001)


async def test_abort_storm_leaves_nothing_behind(tiny_core, tokenizer):
    rng = random.Random(0)
    finished = aborted = 0

    async def one(client, i):
        nonlocal finished, aborted
        params = SamplingParams(temperature=0.8, max_tokens=rng.randint(1, 40), ignore_eos=True,
                                output_kind=RequestOutputKind.DELTA)
        with trio.CancelScope() as scope:
            if rng.random() < 0.5:
                scope.deadline = trio.current_time() + rng.uniform(0, 0.3)
            count = rng.randint(0, 10) if rng.random() < 0.2 else None
            async for _ in client.generate(prompt(i, rng.randint(1, 60)), params):
                if count is not None:
                    count -= 1
                    if count <= 0:
                        break
            finished += 1
        aborted += scope.cancelled_caught

    async with Engine(tiny_core, tokenizer).serve() as client:
        async with trio.open_nursery() as nursery:
            for i in range(1000):
                nursery.start_soon(one, client, i)
                if i % 50 == 0:
                    await trio.sleep(0.01)
        await wait_until_idle(client)
        stats = client.stats()
    assert finished + aborted == 1000 and aborted > 0
    assert stats.num_running == 0 and stats.num_waiting == 0 and stats.kv_blocks_used == 0
    tiny_core.block_manager.check_invariants()


async def test_fault_in_forward_pass_fails_every_consumer(tiny_core, tokenizer, monkeypatch):
    real_execute = tiny_core.runner.execute
    calls = 0

    def flaky(*args):
        nonlocal calls
        calls += 1
        if calls == 5:
            raise RuntimeError("injected device fault")
        return real_execute(*args)

    monkeypatch.setattr(tiny_core.runner, "execute", flaky)
    errors = []

    async def consume(client, i):
        try:
            await collect(client, prompt(i), SamplingParams(max_tokens=100, ignore_eos=True))
        except EngineDeadError as exc:
            errors.append(exc)

    with trio.fail_after(30):
        async with Engine(tiny_core, tokenizer).serve() as client:
            async with trio.open_nursery() as nursery:
                for i in range(8):
                    nursery.start_soon(consume, client, i)
            assert client.errored
            with pytest.raises(EngineDeadError):
                await collect(client, prompt(0), GREEDY)
    assert len(errors) == 8
    assert isinstance(errors[0].__cause__, RuntimeError) and "injected" in str(errors[0])
    assert tiny_core.stats().kv_blocks_used == 0


async def test_bad_input_raises_before_queueing(tiny_core, tokenizer):
    async with Engine(tiny_core, tokenizer).serve() as client:
        with pytest.raises(InvalidParameterError) as exc:
            await collect(client, [], GREEDY)
        assert exc.value.param == "prompt"
        with pytest.raises(InvalidParameterError):
            await collect(client, prompt(1), SamplingParams(max_tokens=10_000))
        assert client.stats().num_waiting == 0


async def test_a_slow_consumer_does_not_stall_others(tiny_core, tokenizer):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    async with Engine(tiny_core, tokenizer).serve() as client:
        slow = client.generate(prompt(1), params)
        first = await slow.__anext__()  # then stop reading it for a while
        fast = await collect(client, prompt(2), params)
        assert sum(len(o.outputs[0].token_ids) for o in fast) == 30
        rest = [o async for o in slow]  # everything since, coalesced into few outputs
        assert len(first.outputs[0].token_ids) + sum(len(o.outputs[0].token_ids) for o in rest) == 30
        assert len(rest) < 29


async def test_steps_subscriber_sees_every_step(tiny_core, tokenizer):
    async with Engine(tiny_core, tokenizer).serve() as client:
        seen = []

        async def watch():
            async for step in client.steps():
                seen.append(step)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch)
            await trio.testing.wait_all_tasks_blocked()
            await collect(client, prompt(1), GREEDY)
            await trio.testing.wait_all_tasks_blocked()  # let the watcher drain its queue
            nursery.cancel_scope.cancel()
    generated = sum(len(d.new_token_ids) for s in seen for d in s.deltas)
    assert generated == 12 and all(s.timings is None or s.timings.execute_s >= 0 for s in seen)
    assert seen[-1].stats.num_generation_tokens >= 12


async def test_leaving_the_engine_fails_streams_that_outlive_it(tiny_core, tokenizer):
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    engine = Engine(tiny_core, tokenizer)
    async with engine.serve() as client:
        stream = client.generate(prompt(1), params)
        await stream.__anext__()
    with pytest.raises(EngineDeadError):
        await stream.__anext__()
    assert tiny_core.stats().kv_blocks_used == 0


async def test_timeouts_in_virtual_time_abort_cleanly(tiny_core, tokenizer, autojump_clock):
    async with Engine(tiny_core, tokenizer).serve() as client:
        with trio.move_on_after(3600) as scope:
            await collect(client, prompt(1), SamplingParams(max_tokens=200, ignore_eos=True))
        await wait_until_idle(client, timeout=10**6)
        assert client.stats().kv_blocks_used == 0
    assert scope.cancelled_caught  # the virtual hour passed while the step ran in its thread
