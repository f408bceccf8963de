"""The actor graph on the tiny random model: streaming forms, aborts, cancellation, faults, subscribers."""

from __future__ import annotations

import random
import threading
import time
from contextlib import aclosing

import attrs
import pytest
import trio
import trio.testing

import engine.frontend.output_channel
from engine.core.core_actor import STEP_QUEUE_SIZE
from engine.errors import EngineDeadError, InvalidParameterError, RequestFailedError, StepTimeoutError
from engine.frontend.async_engine import Engine
from engine.frontend.output_channel import Wakeup
from engine.messages import AddRequest, TokenDelta
from engine.sampling_params import RequestOutputKind, SamplingParams
from tests.conftest import fail_logits_processing, tiny_engine_core, until

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
    assert len(only) == 1 and only[0].outputs[0].token_ids == full.token_ids and only[0].outputs[0].text == full.text
    assert all(a.outputs[0].token_ids == b.outputs[0].token_ids[:len(a.outputs[0].token_ids)]
               for a, b in zip(final, final[1:]))


async def test_a_list_of_strings_given_as_one_prompt_is_a_clear_error(tiny_core, tokenizer):
    async with Engine(tiny_core, tokenizer).serve() as client:
        with pytest.raises(InvalidParameterError, match="generate_many") as exc:
            async for _ in client.generate(["a", "b"], SamplingParams(max_tokens=2)):
                pass
        assert exc.value.param == "prompt" and tiny_core.block_manager.num_used_blocks == 0
        assert await client.get_tokenizer() is client.tokenizer  # (awaited, as vLLM's AsyncLLM)


async def test_one_actor_graph_drives_a_core_at_a_time(tiny_core, tokenizer):
    """A second Engine over a core that one already serves is refused (each graph's core actor
    stepped the core and dropped the other's outputs: requests ended short, as 'length', and
    the first to stop aborted the other's); once the first stops, a new one serves."""
    async with Engine(tiny_core, tokenizer).serve() as client:
        with pytest.raises(RuntimeError, match="already running under another Engine"):
            async with Engine(tiny_core, tokenizer).serve():
                pass
        assert len((await collect(client, prompt(1), GREEDY))[-1].outputs[0].token_ids) == 12
    async with Engine(tiny_core, tokenizer).serve() as client:
        assert len((await collect(client, prompt(1), GREEDY))[-1].outputs[0].token_ids) == 12


async def test_after_the_engine_stops_a_step_subscription_and_a_dict_of_fields_are_clear_errors(tiny_core,
                                                                                              tokenizer):
    """steps() after the engine stopped waited for ever (no step comes, nor the close that ends
    it); sampling parameters given as a dict were an AttributeError."""
    async with Engine(tiny_core, tokenizer).serve() as client:
        for bad in ({"max_tokens": 2}, "x"):
            with pytest.raises(InvalidParameterError, match="sampling_params must be a SamplingParams; got"):
                await collect(client, prompt(1), bad)
            with pytest.raises(InvalidParameterError, match="sampling_params must be a SamplingParams"):
                await client.add_requests([prompt(1)], bad)
    with trio.fail_after(5), pytest.raises(EngineDeadError, match="not running"):
        async for _ in client.steps():
            pass


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


async def test_abort_takes_vllms_forms_and_a_wrong_one_harms_nothing(tiny_core, tokenizer):
    """vLLM's ``abort`` takes an id or several, and is awaited; an id that is not a string is a
    TypeError at the call (it once reached the core, whose failure ended every request)."""
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    async with Engine(tiny_core, tokenizer).serve() as client:
        ends = {}

        async def run(request_id: str) -> None:
            async for output in client.generate(prompt(3), params, request_id=request_id):
                ends[request_id] = output.outputs[0].finish_reason

        async with trio.open_nursery() as nursery:
            for request_id in ("a", "b", "c", "d"):
                nursery.start_soon(run, request_id)
            await until(lambda: len(ends) == 4)
            with pytest.raises(TypeError, match="request ids are strings"):
                client.abort([["a"]])
            client.abort(["a", "b"])
            await client.abort(("c",))
            await client.abort("d")
        assert ends == {"a": "abort", "b": "abort", "c": "abort", "d": "abort"}
        assert not client.errored and client.stats().kv_blocks_used == 0


async def test_cancelled_consumer_frees_its_blocks_within_a_step(tiny_core, tokenizer):
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    with trio.fail_after(30):
        await _cancel_one_of_two(tiny_core, tokenizer, params)


async def _cancel_one_of_two(tiny_core, tokenizer, params) -> None:
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


async def test_requests_queued_then_dropped_unread_or_closed_are_aborted(tiny_core, tokenizer, monkeypatch):
    """``add_request(s)`` queue at once (a server's 503 comes before its status line); a caller
    that fails before reading them, or closes them, leaks no request (each would take 200
    steps of 50 ms, past the waits' 10 s, if it were not aborted)."""
    execute = tiny_core.runner.execute

    def slow(*args):
        time.sleep(0.05)
        return execute(*args)

    monkeypatch.setattr(tiny_core.runner, "execute", slow)
    params = SamplingParams(temperature=0, max_tokens=200, ignore_eos=True)
    async with Engine(tiny_core, tokenizer).serve() as client:
        one = await client.add_request(prompt(5), params)
        many = await client.add_requests([prompt(4), prompt(6)], params)
        assert client.num_unfinished == 3 and len(many.channels) == 2
        output = await one.__anext__()
        assert output.request_id == one.channels[0].state.request_id
        del one  # dropped unread (what a handler that fails after queueing leaves behind)
        await wait_until_idle_but(client, 2)
        async with many:
            index, output = await many.__anext__()
            assert index in (0, 1) and output.outputs[0].token_ids
        # (the front forgets a request when the step output that ends it arrives, a step after the
        # core has dropped it: wait on the front's registry, not the core's counts)
        await wait_until_idle_but(client, 0)
        await wait_until_idle(client)
        assert client.stats().kv_blocks_used == 0


async def wait_until_idle_but(client, left: int, timeout: float = 10) -> None:
    with trio.fail_after(timeout):
        while client.num_unfinished != left:
            await trio.sleep(0.001)


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


async def test_bad_input_raises_before_queueing(tiny_core, tokenizer, monkeypatch):
    engine = Engine(tiny_core, tokenizer)
    sent = []
    real_send = engine.send
    monkeypatch.setattr(engine, "send", lambda message: (sent.append(message), real_send(message)))
    async with engine.serve() as client:
        with pytest.raises(InvalidParameterError) as exc:
            await collect(client, [], GREEDY)
        assert exc.value.param == "prompt"
        with pytest.raises(InvalidParameterError):
            await collect(client, prompt(1), SamplingParams(max_tokens=10_000))
        with pytest.raises(InvalidParameterError):
            await collect(client, prompt(1), GREEDY, priority=3)  # fcfs engine
        assert sent == []  # nothing reached the core's inbox
        await collect(client, prompt(1), GREEDY)
        assert [type(m) for m in sent] == [AddRequest]  # (the spy itself works)


async def test_a_slow_consumer_does_not_stall_others(tiny_core, tokenizer):
    params = SamplingParams(temperature=0, max_tokens=30, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    with trio.fail_after(30):
        await _slow_and_fast(tiny_core, tokenizer, params)


async def _slow_and_fast(tiny_core, tokenizer, params) -> None:
    async with Engine(tiny_core, tokenizer).serve() as client:
        slow = client.generate(prompt(1), params)
        first = await slow.__anext__()  # then stop reading it for a while
        fast = await collect(client, prompt(2), params)
        assert sum(len(o.outputs[0].token_ids) for o in fast) == 30
        rest = [o async for o in slow]  # everything since, coalesced into few outputs
        assert len(first.outputs[0].token_ids) + sum(len(o.outputs[0].token_ids) for o in rest) == 30
        assert len(rest) < 29


async def test_steps_subscriber_sees_every_step(tiny_core, tokenizer):
    seen = []

    async def watch(client):
        async for step in client.steps():
            seen.append(step)

    with trio.fail_after(30):
        async with Engine(tiny_core, tokenizer).serve() as client:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch, client)
                await trio.testing.wait_all_tasks_blocked()
                await collect(client, prompt(1), GREEDY)
                await trio.testing.wait_all_tasks_blocked()  # let the watcher drain its queue
                nursery.cancel_scope.cancel()
    model_steps = [s for s in seen if s.num_scheduled_seqs]
    assert sum(len(d.new_token_ids) for s in seen for d in s.all_deltas()) == 12
    assert sum(len(s.decodes) for s in seen) == 10  # every token but the first and the last: columns
    assert len(model_steps) == 12  # one prefill step that samples, then 11 decode steps
    assert all(s.timings.execute_s > 0 for s in model_steps)
    assert [s.stats.num_steps for s in model_steps] == list(range(1, 13))


async def test_leaving_the_engine_fails_streams_that_outlive_it(tiny_core, tokenizer):
    params = SamplingParams(max_tokens=200, ignore_eos=True)
    engine = Engine(tiny_core, tokenizer)
    async with engine.serve() as client:
        stream = client.generate(prompt(1), params)
        await stream.__anext__()
    with pytest.raises(EngineDeadError):
        await stream.__anext__()
    assert tiny_core.stats().kv_blocks_used == 0


async def test_timeouts_in_virtual_time_abort_cleanly(tiny_model, tokenizer, autojump_clock):
    core = tiny_engine_core(tiny_model, step_timeout=None)  # the watchdog would see the virtual hour too
    async with Engine(core, tokenizer).serve() as client:
        with trio.move_on_after(3600) as scope:
            await collect(client, prompt(1), SamplingParams(max_tokens=200, ignore_eos=True))
        await wait_until_idle(client, timeout=10**6)
        assert client.stats().kv_blocks_used == 0
    assert scope.cancelled_caught  # the virtual hour passed while the step ran in its thread


async def test_the_watchdog_declares_a_hung_step_dead(tiny_model, tokenizer, monkeypatch, autojump_clock):
    core = tiny_engine_core(tiny_model, step_timeout=60)
    release = threading.Event()
    real, calls = core.runner.execute, 0

    def hangs_on_the_third_step(*args):
        nonlocal calls
        calls += 1
        if calls == 3:
            release.wait(30)  # a kernel that never returns (until the test lets it go)
        return real(*args)

    monkeypatch.setattr(core.runner, "execute", hangs_on_the_third_step)
    try:
        engine = Engine(core, tokenizer)
        async with engine.serve() as client:
            with pytest.raises(EngineDeadError) as exc:
                await collect(client, prompt(1), SamplingParams(max_tokens=10, ignore_eos=True))
            assert isinstance(exc.value.__cause__, StepTimeoutError) and "60" in str(exc.value)
            assert client.errored and trio.current_time() >= 60
            assert await client.wait_failed() is exc.value
    finally:
        release.set()
    with pytest.raises(EngineDeadError):  # its state is unknown: the core never runs again
        async with Engine(core, tokenizer).serve():
            pass


async def test_a_request_failing_alone_leaves_the_others_running(tiny_core, tokenizer, monkeypatch):
    fail_logits_processing(monkeypatch, lambda r: r.request_id.endswith("_bad"))
    outcomes = {}

    async def one(client, request_id, params):
        try:
            outcomes[request_id] = (await collect(client, prompt(len(outcomes)), params, request_id=request_id))[-1]
        except RequestFailedError as exc:
            outcomes[request_id] = exc

    biased = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, logit_bias={5: 1.0})
    with trio.fail_after(30):
        async with Engine(tiny_core, tokenizer).serve() as client:
            async with trio.open_nursery() as nursery:
                for i in range(6):
                    nursery.start_soon(one, client, f"good-{i}", biased if i % 2 else GREEDY)
                nursery.start_soon(one, client, "bad", biased)
            assert not client.errored
            after = await collect(client, prompt(9), GREEDY)  # the engine still serves
            assert len(after[-1].outputs[0].token_ids) == 12
            await wait_until_idle(client)
            assert client.stats().kv_blocks_used == 0
    assert isinstance(outcomes.pop("bad"), RequestFailedError)
    assert all(len(o.outputs[0].token_ids) == 12 for o in outcomes.values())


@pytest.mark.parametrize("failing_token", [1, 5])  # the first token comes as a delta, later ones as Decodes
async def test_a_request_whose_output_processing_fails_fails_alone(tiny_core, tokenizer, monkeypatch, failing_token):
    from engine.frontend.detokenizer import IncrementalDetokenizer

    add_token = IncrementalDetokenizer.add_token
    marker = "a stop string no output has"

    def breaks_for_bad(detokenizer, token_id):
        detokenizer.num_seen = getattr(detokenizer, "num_seen", 0) + 1
        if marker in detokenizer._stops and detokenizer.num_seen == failing_token:
            raise ValueError("broken detokenizer")
        return add_token(detokenizer, token_id)

    monkeypatch.setattr(IncrementalDetokenizer, "add_token", breaks_for_bad)
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    outcomes = {}

    async def one(client, request_id):
        this = attrs.evolve(params, stop=[marker]) if request_id == "bad" else params
        try:
            outcomes[request_id] = await collect(client, prompt(len(outcomes)), this, request_id=request_id)
        except RequestFailedError as exc:
            outcomes[request_id] = exc

    with trio.fail_after(30):
        async with Engine(tiny_core, tokenizer).serve() as client:
            async with trio.open_nursery() as nursery:
                for request_id in ("a", "bad", "b"):
                    nursery.start_soon(one, client, request_id)
            await wait_until_idle_but(client, 0)  # (the front's registry: it empties after the core's counts)
            await wait_until_idle(client)
            assert client.stats().kv_blocks_used == 0
            assert len((await collect(client, prompt(9), GREEDY))[-1].outputs[0].token_ids) == 12
    assert "broken detokenizer" in str(outcomes.pop("bad"))
    assert all(sum(len(o.outputs[0].token_ids) for o in outputs) == 12 for outputs in outcomes.values())


@pytest.mark.parametrize("kind", [RequestOutputKind.DELTA, RequestOutputKind.CUMULATIVE])
async def test_a_stream_interval_sends_the_first_token_then_every_few(tiny_model, tokenizer, kind):
    params = SamplingParams(temperature=0, max_tokens=13, ignore_eos=True, output_kind=kind)
    async with Engine(tiny_engine_core(tiny_model), tokenizer).serve() as client:
        every = await collect(client, prompt(4), params)
    async with Engine(tiny_engine_core(tiny_model, stream_interval=4), tokenizer).serve() as client:
        chunked = await collect(client, prompt(4), params)
        await wait_until_idle(client)
        assert client.stats().kv_blocks_used == 0

    def tokens(outputs):
        if kind is RequestOutputKind.DELTA:
            return [t for o in outputs for t in o.outputs[0].token_ids]
        return outputs[-1].outputs[0].token_ids

    assert len(every) == 13 and tokens(chunked) == tokens(every)
    assert len(chunked[0].outputs[0].token_ids) == 1  # the first token at once (time to first token)
    # Then 4 at a time, the last with the end: 4 outputs (fewer if the event loop ran late and
    # a wake-up took more than 4; never a partial one, however late the reader comes back).
    assert 2 <= len(chunked) <= 4 and chunked[-1].finished and not any(o.finished for o in chunked[:-1])
    if kind is RequestOutputKind.DELTA:
        assert "".join(o.outputs[0].text for o in chunked) == "".join(o.outputs[0].text for o in every)


async def test_a_request_of_several_completions_counts_one_gap_a_step_for_each(tiny_core, tokenizer):
    """n completions decode in the same steps: each has its first token and its gaps between
    steps with tokens (vLLM's child requests), not one gap per token."""
    seen: list = []
    params = SamplingParams(n=2, temperature=0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    async with Engine(tiny_core, tokenizer).serve() as client:
        client.add_stat_logger(seen.append)
        outputs = await collect(client, prompt(1), params)
    assert [len(c.token_ids) for c in outputs[-1].outputs] == [12, 12]
    itls = [t for s in seen for t in s.inter_token_latencies]
    assert len([t for s in seen for t in s.time_to_first_tokens]) == 2 and len(itls) == 22
    finished = [f for s in seen for f in s.finished]
    assert [(f.finish_reason, f.num_generation_tokens) for f in finished] == [("length", 12)] * 2
    assert [(n, m) for s in seen for n, m in zip(s.params_n, s.max_num_generation_tokens)] == [(2, 12)]


def test_a_completion_that_starts_late_waits_for_its_first_token_not_between_tokens(tokenizer):
    """The second of n completions may be scheduled steps after the first ended: that wait is
    its queue time and part of its time to first token, not a gap between tokens; each
    completion ends as a sequence of its own, the request's n and longest completion once."""
    from engine.frontend.request_state import RequestState
    from engine.frontend.stats import IterationStats

    state = RequestState("x", None, [1, 2], SamplingParams(n=2, max_tokens=2), tokenizer, arrival=0.0)
    steps = [IterationStats(now) for now in (1.0, 2.0, 5.0, 6.0)]
    state.apply(TokenDelta("x", 0, (300,), first_scheduled_at=0.5), steps[0])
    state.apply(TokenDelta("x", 0, (301,), finish_reason="length"), steps[1])
    state.apply(TokenDelta("x", 1, (302,), first_scheduled_at=3.0), steps[2])
    state.apply(TokenDelta("x", 1, (303,), finish_reason="length"), steps[3])
    assert [s.time_to_first_tokens for s in steps] == [[1.0], [], [5.0], []]
    assert [s.inter_token_latencies for s in steps] == [[], [1.0], [], [1.0]]
    [first], [second] = steps[1].finished, steps[3].finished
    assert (first.e2e_latency, first.prefill_time, first.decode_time, first.num_generation_tokens) == (2.0, 0.5, 1.0, 2)
    assert (first.queue_time, second.queue_time) == (0.5, 3.0)  # (each its own scheduling)
    assert (second.e2e_latency, second.prefill_time, second.decode_time) == (6.0, 2.0, 1.0)
    assert first.finish_reason == second.finish_reason == "length" and first.num_prompt_tokens == 2
    assert (steps[1].params_n, steps[3].params_n, steps[3].max_num_generation_tokens) == ([], [2], [2])


async def test_stat_loggers_see_engine_timings_of_every_request(tiny_core, tokenizer):
    seen: list = []
    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    async with Engine(tiny_core, tokenizer).serve() as client:
        client.add_stat_logger(seen.append)
        await collect(client, prompt(1), params)
        ttfts = [t for s in seen for t in s.time_to_first_tokens]
        itls = [t for s in seen for t in s.inter_token_latencies]
        finished = [f for s in seen for f in s.finished]
        # One final output, but the engine's own clock: a first token, then 11 gaps.
        assert len(ttfts) == 1 and len(itls) == 11 and len(finished) == 1
        assert finished[0].finish_reason == "length" and finished[0].num_generation_tokens == 12
        assert ttfts[0] + sum(itls) == pytest.approx(finished[0].e2e_latency, abs=1e-6)
        assert 0 <= finished[0].queue_time <= ttfts[0]
        seen.clear()
        long = SamplingParams(max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        async with aclosing(client.generate(prompt(2), long)) as outputs:
            async for _ in outputs:
                break  # a request abandoned by its consumer still counts, as 'abort'
        await wait_until_idle(client)
        await trio.testing.wait_all_tasks_blocked()
        assert [f.finish_reason for s in seen for f in s.finished] == ["abort"]


async def test_an_id_is_reusable_once_a_stopped_request_is_finished(tiny_core, tokenizer):
    params = SamplingParams(temperature=0, max_tokens=40, ignore_eos=True)
    async with Engine(tiny_core, tokenizer).serve() as client:
        full = (await collect(client, prompt(1), params))[-1].outputs[0]
        stop = full.text[len(full.text) // 3:len(full.text) // 3 + 2]
        cut = (await collect(client, prompt(1), attrs.evolve(params, stop=[stop]), request_id="x"))[-1].outputs[0]
        assert cut.finish_reason == "stop" and len(cut.token_ids) < 40
        await wait_until_idle(client)
        await trio.testing.wait_all_tasks_blocked()
        again = (await collect(client, prompt(2), params, request_id="x"))[-1].outputs[0]
        alone = (await collect(client, prompt(2), params))[-1].outputs[0]
        assert again.token_ids == alone.token_ids  # no late token of the old "x" leaked in


@pytest.mark.parametrize("request_ids", [["x"], "xy", ["x", 2]])
async def test_generate_many_refuses_request_ids_that_are_not_one_per_prompt(tiny_core, tokenizer, request_ids):
    """Fewer ids than prompts queued only the first ones (zip), a string gave each prompt a
    letter: nothing is queued, and the error names request_ids."""
    async with Engine(tiny_core, tokenizer).serve() as client:
        with pytest.raises(InvalidParameterError, match="one id per prompt") as exc:
            async for _ in client.generate_many(["a", "b"], SamplingParams(max_tokens=2), request_ids=request_ids):
                pass
        assert exc.value.param == "request_ids" and tiny_core.num_running_requests == 0 and not client._engine.registry


async def test_generate_many_merges_without_a_task_per_request(tiny_core, tokenizer):
    params = SamplingParams(temperature=0, max_tokens=10, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    async with Engine(tiny_core, tokenizer).serve() as client:
        singles = [[t for o in await collect(client, prompt(i), params) for t in o.outputs[0].token_ids]
                   for i in range(3)]
        merged: dict[int, list[int]] = {0: [], 1: [], 2: []}
        async for index, output in client.generate_many([prompt(i) for i in range(3)], params):
            merged[index] += output.outputs[0].token_ids
        assert [merged[i] for i in range(3)] == singles
        long = SamplingParams(max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
        async with aclosing(client.generate_many([prompt(i) for i in range(3)], long)) as outputs:
            async for _ in outputs:
                break  # leaving early aborts all three
        with trio.fail_after(10):
            await client.wait_idle()  # every request finished, as far as the front knows
        assert client.stats().kv_blocks_used == 0
        with pytest.raises(InvalidParameterError):  # one bad prompt: nothing is queued
            async for _ in client.generate_many([prompt(1), []], params):
                pass
        assert client.num_unfinished == 0


async def test_a_stop_string_finishes_every_completion_in_the_core(tiny_core, tokenizer):
    params = SamplingParams(n=2, temperature=0, max_tokens=60, ignore_eos=True)
    core_tokens: dict[int, int] = {0: 0, 1: 0}

    async def watch(client):
        async for step in client.steps():
            for d in step.all_deltas():
                if d.request_id == "s":
                    core_tokens[d.index] += len(d.new_token_ids)

    with trio.fail_after(30):
        async with Engine(tiny_core, tokenizer).serve() as client:
            full = (await collect(client, prompt(1), params))[-1].outputs[0]
            stop = full.text[len(full.text) // 3:len(full.text) // 3 + 2]
            async with trio.open_nursery() as nursery:
                nursery.start_soon(watch, client)
                await trio.testing.wait_all_tasks_blocked()
                cut = (await collect(client, prompt(1), attrs.evolve(params, stop=[stop]), request_id="s"))[-1]
                await wait_until_idle(client)
                await trio.testing.wait_all_tasks_blocked()
                nursery.cancel_scope.cancel()
            assert client.stats().kv_blocks_used == 0
    for completion in cut.outputs:  # greedy: both completions are the same text, cut at the same place
        assert completion.finish_reason == "stop" and completion.text == full.text[:full.text.index(stop)]
        hit_at = len(completion.token_ids)
        assert completion.token_ids == full.token_ids[:hit_at] and hit_at < 60
        # The core may run ahead of the detokenizer by the step queue; it freed the sequence once
        # it read the StopRequest, within that many steps.
        assert hit_at <= core_tokens[completion.index] <= hit_at + STEP_QUEUE_SIZE + 1


async def test_generate_many_can_be_closed_from_another_task(tiny_core, tokenizer):
    """A server abandons a response body at a yield (the client left while it was sending) and
    finalizes it later in another task. A generator holding a nursery cannot survive that (the
    old per-prompt-task merge broke trio's run); generate_many holds none and aborts all."""
    long = SamplingParams(max_tokens=200, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    with trio.fail_after(30):
        async with Engine(tiny_core, tokenizer).serve() as client:
            outputs = client.generate_many([prompt(i) for i in range(3)], long)
            await outputs.__anext__()
            assert client.stats().num_running + client.stats().num_waiting == 3
            async with trio.open_nursery() as nursery:
                nursery.start_soon(outputs.aclose)
            await wait_until_idle(client)
            assert client.stats().kv_blocks_used == 0


@pytest.fixture(params=["trio's trap, kept", "wait_task_rescheduled"])
def wakeup(request, monkeypatch):
    """A Wakeup parking with a kept trio message, and one parking through trio's public
    function (what it falls back to with a trio whose wait works otherwise)."""
    if request.param == "wait_task_rescheduled":
        monkeypatch.setattr(engine.frontend.output_channel, "_WAIT_TRAP", None)
    elif engine.frontend.output_channel._WAIT_TRAP is None:
        pytest.skip("this trio's wait_task_rescheduled is not a yield of WaitTaskRescheduled")
    wakeup = Wakeup()
    assert (wakeup._trap is None) == (request.param == "wait_task_rescheduled")
    return wakeup


async def test_a_wakeup_keeps_a_set_that_came_while_nobody_waited(wakeup):
    wakeup.set()
    wakeup.set()  # sets do not count up: one wait takes them all
    with trio.fail_after(5):
        await wakeup.wait()
    woken = []

    async def waiter():
        await wakeup.wait()
        woken.append(True)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(waiter)
        await trio.testing.wait_all_tasks_blocked()
        assert not woken  # the earlier sets were used up
        wakeup.set()
    assert woken


async def test_a_cancelled_wait_leaves_the_wakeup_usable_and_it_has_one_waiter(wakeup):
    with trio.move_on_after(0.01):
        await wakeup.wait()
    wakeup.set()
    with trio.fail_after(5):
        await wakeup.wait()
    async with trio.open_nursery() as nursery:
        nursery.start_soon(wakeup.wait)
        await trio.testing.wait_all_tasks_blocked()
        with pytest.raises(RuntimeError, match="one consumer"):
            await wakeup.wait()
        wakeup.set()  # the first waiter is still parked, and still woken


async def test_a_final_only_stream_is_woken_once_at_the_end(tiny_core, tokenizer):
    sets = []

    class CountingWakeup(Wakeup):
        def set(self) -> None:
            sets.append(True)
            super().set()

    params = SamplingParams(temperature=0, max_tokens=12, ignore_eos=True, output_kind=RequestOutputKind.FINAL_ONLY)
    async with Engine(tiny_core, tokenizer).serve() as client:
        channel = client.submit(prompt(1), params, wakeup=CountingWakeup())
        outputs = [o async for o in channel]
    assert len(outputs) == 1 and len(outputs[0].outputs[0].token_ids) == 12
    assert len(sets) == 1  # not once per step: there is nothing to read before the end


async def test_a_prompt_past_the_context_is_served_truncated_by_every_entry(tiny_core, tokenizer):
    """truncate_prompt_tokens applies before the length check, whether one prompt is queued or
    several (the tiny engine's max_model_len is 256)."""
    params = SamplingParams(temperature=0, max_tokens=2, ignore_eos=True, truncate_prompt_tokens=100,
                            output_kind=RequestOutputKind.FINAL_ONLY)
    long = prompt(1, length=400)
    async with Engine(tiny_core, tokenizer).serve() as client:
        (one,) = [o async for o in client.generate(long, params)]
        many = [o async for _, o in client.generate_many([long, long], params)]
    assert one.prompt_token_ids == long[-100:] and len(one.outputs[0].token_ids) == 2
    assert [o.prompt_token_ids for o in many] == [long[-100:]] * 2


async def test_a_change_to_sampling_params_never_reaches_a_queued_request(tiny_core, tokenizer):
    """SamplingParams are mutable, as vLLM's; the engine queues its own copy (vLLM clones too),
    front and core alike: a caller that changes its object, even a list in place, changes no
    request already queued."""
    params = SamplingParams(temperature=0, max_tokens=16, ignore_eos=True, output_kind=RequestOutputKind.DELTA)
    async with Engine(tiny_core, tokenizer).serve() as client:
        greedy = [t for o in await collect(client, prompt(4), params) for t in o.outputs[0].token_ids]
        async with await client.add_request(prompt(4), params) as queued:
            (channel,) = queued.channels
            assert channel.state.params is not params and channel.state.params == params
            params.temperature = 5.0  # (before the engine has read the request)
            params.stop_token_ids.append(greedy[3])
            changed_after = [t async for o in queued for t in o.outputs[0].token_ids]
    assert changed_after == greedy
