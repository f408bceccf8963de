"""The engine core in a process of its own, joined to the front by ``engine.transport.wire``.

The actor graph does not change: the front keeps the output actor and one output
channel per request; the core actor runs in the engine process (``engine.transport.engine_process``).
Only the channel between them becomes a link:

    front                                        engine process
    client --AddRequest/AbortRequest--> inbox ==link==> inlet --> core actor
    output actor <-- steps <--------------------==link== <-- StepOutput (one per step)

``RemoteCore`` stands in for the ``EngineCore`` in the front's ``Engine``: it answers what the
front asks of a core (limits for validation, the latest stats) from the engine's
``EngineReady`` and from the stats riding on every step, and its actor pumps the two
channels through the link.

Death: the engine process's ``EngineFailed`` message, its socket closing without a goodbye,
and the process exiting all end the front's actor with an error, which the ``Engine`` turns
into one ``EngineDeadError`` for every open stream (and ``/health`` 503). The engine process
exits when its front goes away: an orderly close of the link, or the link breaking (the
kernel closes a dead front's socket, whatever killed it). (Not PR_SET_PDEATHSIG: it fires
when the *thread* that forked exits, and trio starts processes from worker threads.)
"""

from __future__ import annotations

import logging
import math
import signal
import time

import attrs
import trio

from engine.config import EngineConfig
from engine.core.engine_core import validate_request
from engine.errors import EngineDeadError, InvalidParameterError, ungrouped
from engine.messages import AbortRequest, AddRequest, EngineStats, KVCacheInfo, RequestRejected, StepOutput
from engine.sampling_params import PARAM_STRUCTURED, SamplingParams
from engine.transport import protocol
from engine.transport.protocol import EngineFailed, EngineReady, Heartbeat, RequestOwners

log = logging.getLogger(__name__)

# How long a front waits for an engine process whose link broke to exit, to say how it ended.
EXIT_STATUS_WAIT_S = 2.0


# How fast two machines' monotonic clocks may drift apart (seconds per second): NTP slews a
# clock by at most 500 ppm, a few ppm in practice.
CLOCK_DRIFT = 1e-4


class RemoteCore:
    """The front's stand-in for an ``EngineCore`` running in an engine process."""

    def __init__(self, config: EngineConfig, ready: EngineReady, send, receive, process, rank: int = 0, *,
                 joined: bool = False) -> None:
        """``joined``: the engine joined over TCP (``--headless``, maybe on another machine, whose
        monotonic clock runs from another zero: its times are kept on this one's, ``on_our_clock``)."""
        self.config = config
        self.rank = rank  # which engine of a data-parallel group (the ``engine`` label of its metrics)
        self.joined = joined
        self._clock_heard = time.monotonic()
        self.clock_offset = self._clock_heard - ready.clock if joined else 0.0  # ours minus the engine's
        self.model = ready.model
        self.max_model_len = ready.max_model_len
        self.vocab_size = ready.vocab_size
        self.backend_name = ready.backend_name
        self.sampling_defaults = dict(ready.sampling_defaults)
        self.eos_token_ids = tuple(ready.eos_token_ids)
        self.kv_cache_info = ready.kv_cache_info
        self.pid = ready.pid
        self.fault: BaseException | None = None
        self._stats = ready.stats
        self._send = send
        self._receive = receive
        self._process = process

    def heard_clock(self, clock: float) -> None:
        """The engine's clock read ``clock`` as it sent a message that arrives now: the offset
        is the least such difference (each is late by the message's way here, which a message
        queued behind a step, or behind the front's start, makes long), allowed to grow as the
        two clocks drift apart (``CLOCK_DRIFT``)."""
        now = time.monotonic()
        self.clock_offset = min(now - clock, self.clock_offset + CLOCK_DRIFT * (now - self._clock_heard))
        self._clock_heard = now

    def on_our_clock(self, step: StepOutput) -> StepOutput:
        """``step`` with its times (when the engine first scheduled each request) on this
        process's clock: the front measures queue and prefill times against its own (a remote
        engine's read 200000 s of queueing)."""
        # (the offset is late by the quickest message's way here, up to a heartbeat's interval
        # after the start: never past now, when the step that says it has come)
        offset, now = self.clock_offset, time.monotonic()
        return attrs.evolve(step, deltas=tuple(
            d if d.first_scheduled_at is None else attrs.evolve(d, first_scheduled_at=min(d.first_scheduled_at + offset,
                                                                                          now))
            for d in step.deltas))

    def validate(self, prompt: list[int], params: SamplingParams, priority: int = 0) -> int:
        max_tokens = validate_request(prompt, params, priority, max_model_len=self.max_model_len,
                                      vocab_size=self.vocab_size, scheduling_policy=self.config.scheduling_policy,
                                      eos_token_ids=self.eos_token_ids)
        check_crossing(prompt, params, priority)
        return max_tokens

    def stats(self) -> EngineStats:
        """The engine's counters as of its latest step."""
        return self._stats

    def engine_stats(self) -> list[EngineStats]:
        return [self._stats]

    def engine_kv_caches(self) -> list[KVCacheInfo]:
        return [self.kv_cache_info]

    @property
    def num_running_requests(self) -> int:
        return self._stats.num_running

    def abort_all(self) -> list:
        """Nothing to do here: the engine process aborts its requests when its front goes away."""
        return []

    def actor(self, inbox: trio.MemoryReceiveChannel, outbox: trio.MemorySendChannel) -> RemoteCoreActor:
        return RemoteCoreActor(self, inbox, outbox)

    async def _wait_for_exit(self) -> None:
        """Give a process whose link broke a moment to exit, so that ``_died`` can say how it
        ended (a link breaks as its process dies: the exit status comes a little after)."""
        if self._process is not None:
            with trio.move_on_after(EXIT_STATUS_WAIT_S):
                await self._process.wait()

    def _died(self, cause: BaseException) -> EngineDeadError:
        code = self._process.poll() if self._process is not None else None
        how = (f"exited with status {code}" if code is not None and code >= 0 else
               f"was killed by {signal.Signals(-code).name}" if code is not None else "stopped answering")
        error = EngineDeadError(f"the engine process (engine {self.rank}, pid {self.pid}) {how}: {cause}")
        error.__cause__ = cause
        return error


def check_crossing(prompt: list[int], params: SamplingParams, priority: int) -> None:
    """Refuse a request that cannot be sent to an engine process (a value msgpack cannot hold,
    such as an integer past 64 bits in a JSON schema): it would otherwise fail the link, and
    with it every request of the engine."""
    try:
        protocol.CODEC.encode(AddRequest("", tuple(prompt), params, priority))
    except (OverflowError, TypeError, ValueError) as exc:
        param = PARAM_STRUCTURED if params.structured_outputs is not None else "sampling_params"
        raise InvalidParameterError(param, f"the request holds a value that cannot be sent to the engine "
                                           f"process: {exc}") from None


class RemoteCoreActor:
    """The core actor's place in the front: messages from the inbox go down the link; the
    engine's step outputs come up it to the output actor."""

    def __init__(self, core: RemoteCore, inbox: trio.MemoryReceiveChannel, outbox: trio.MemorySendChannel) -> None:
        self._core = core
        self._inbox = inbox
        self._outbox = outbox

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        with ungrouped():  # the engine's death as itself, not in the nursery's group
            async with self._outbox, trio.open_nursery() as nursery:
                nursery.start_soon(self._forward)
                await self._receive()

    async def _receive(self) -> None:
        core = self._core
        try:
            while True:
                message = await self._next_message()
                if message is None:
                    break
                if isinstance(message, Heartbeat):
                    if core.joined:
                        core.heard_clock(message.clock)
                    continue
                if isinstance(message, EngineFailed):
                    raise EngineDeadError(f"the engine failed: {message.error!r}") from message.error
                core._stats = message.stats
                await self._outbox.send(core.on_our_clock(message) if core.joined and message.deltas else message)
        except trio.BrokenResourceError as exc:
            cause: BaseException = exc
        else:  # only the front ends the link in order; an engine that ends it has stopped
            cause = EngineDeadError("the engine process closed the link")
        finally:  # a gone engine runs nothing and holds no block (/metrics, the activity line)
            core._stats = attrs.evolve(core._stats, num_running=0, num_waiting=0, kv_blocks_used=0)
        await core._wait_for_exit()
        raise core._died(cause) from None

    async def _next_message(self):
        """The engine's next message, or None at the end of the link.

        Raises:
            EngineDeadError: nothing came for ``SILENCE_LIMIT_S`` and a short grace after it
                (a front that was itself paused finds the heartbeats waiting in its socket).
        """
        receive = self._core._receive.receive
        for limit in (protocol.SILENCE_LIMIT_S, 3 * protocol.HEARTBEAT_S):
            with trio.move_on_after(limit):  # (only the wait for the engine: not a full outbox)
                try:
                    return await receive()
                except trio.EndOfChannel:
                    return None
        raise self._core._died(EngineDeadError(f"no word from it for {protocol.SILENCE_LIMIT_S:g} s (it sends one "
                                               f"every {protocol.HEARTBEAT_S:g} s)"))

    async def _forward(self) -> None:
        async for message in self._inbox:
            if isinstance(message, AddRequest) and message.grammar is not None:
                # A compiled grammar stays in this process; the engine compiles its own (cached).
                message = attrs.evolve(message, grammar=None)
            try:
                await self._core._send.send(message)
            except trio.BrokenResourceError:
                return  # the receiving side reports how the engine died
            except (OverflowError, TypeError, ValueError) as exc:
                if not isinstance(message, AddRequest):
                    raise
                # (validate refuses such a request first: this one alone fails, not the link)
                error = InvalidParameterError("sampling_params",
                                              f"the request cannot be sent to the engine process: {exc}")
                await self._outbox.send(StepOutput((), (RequestRejected(message.request_id, error),),
                                                   self._core._stats, 0, 0, None))


class DataParallelCore:
    """``--data-parallel-size N``: N engine processes, each with its own KV cache, behind one
    front. A new request goes to the least-loaded engine (waiting + running as of its latest
    step, plus what was sent to it since); its aborts and stops follow it there. ``stats()``
    adds the engines' counters up; ``engine_stats()`` has each one's (the ``engine`` label of
    the metrics). One engine's death is the group's: every open stream fails."""

    def __init__(self, engines: list[RemoteCore]) -> None:
        first = engines[0]
        self.engines = engines
        self.config = first.config
        self.max_model_len = min(e.max_model_len for e in engines)
        self.vocab_size = first.vocab_size
        self.backend_name = first.backend_name
        self.sampling_defaults = first.sampling_defaults
        self.eos_token_ids = first.eos_token_ids
        self.fault: BaseException | None = None

    validate = RemoteCore.validate  # (the group's limits: the smallest max_model_len)

    def engine_stats(self) -> list[EngineStats]:
        return [e.stats() for e in self.engines]

    def engine_kv_caches(self) -> list[KVCacheInfo]:
        return [e.kv_cache_info for e in self.engines]

    def stats(self) -> EngineStats:
        each = self.engine_stats()
        return EngineStats.total(each)

    @property
    def num_running_requests(self) -> int:
        return sum(e.num_running_requests for e in self.engines)

    def abort_all(self) -> list:
        return []

    def actor(self, inbox: trio.MemoryReceiveChannel, outbox: trio.MemorySendChannel) -> DataParallelActor:
        return DataParallelActor(self, inbox, outbox)


class DataParallelActor:
    """The core actor's place in a data-parallel front: routes the inbox's messages to the
    engines, and merges their step outputs into the one outbox."""

    def __init__(self, group: DataParallelCore, inbox: trio.MemoryReceiveChannel,
                 outbox: trio.MemorySendChannel) -> None:
        self._group = group
        self._inbox = inbox
        self._outbox = outbox
        self._owners = RequestOwners()  # request id -> engine
        self._sent_since_step = [0] * len(group.engines)  # requests sent to an engine since its last step

    async def run(self, *, task_status=trio.TASK_STATUS_IGNORED) -> None:
        task_status.started()
        engines = self._group.engines
        inboxes = [trio.open_memory_channel(math.inf) for _ in engines]
        relays = [trio.open_memory_channel(0) for _ in engines]
        try:
            with ungrouped():  # one engine's death: its EngineDeadError, not a group of it
                async with self._outbox, trio.open_nursery() as nursery:
                    for engine, (send, receive), (relay_send, relay_receive) in zip(engines, inboxes, relays):
                        nursery.start_soon(RemoteCoreActor(engine, receive, relay_send).run)
                        nursery.start_soon(self._merge, engine.rank, relay_receive)
                    await self._route([send for send, _ in inboxes])
                    nursery.cancel_scope.cancel()
        except EngineDeadError:
            # The group is dead: the others end now (each aborts what it holds and exits), not
            # when the server does (under --on-engine-failure refuse they held their model and
            # KV cache, a GPU each, for a server that serves no more).
            with trio.CancelScope(shield=True):
                for engine in engines:
                    await engine._send.aclose()
            raise

    async def _route(self, inboxes: list[trio.MemorySendChannel]) -> None:
        async for message in self._inbox:
            if isinstance(message, AddRequest):
                rank = min(range(len(inboxes)), key=self._load)
                self._owners.add(message, rank)
                self._sent_since_step[rank] += 1
                inboxes[rank].send_nowait(message)
            elif isinstance(message, AbortRequest):
                by_engine: dict[int, list[str]] = {}
                for request_id in message.request_ids:
                    if (rank := self._owners.get(request_id)) is not None:
                        by_engine.setdefault(rank, []).append(request_id)
                for rank, ids in by_engine.items():
                    inboxes[rank].send_nowait(AbortRequest(tuple(ids)))
            elif (rank := self._owners.get(message.request_id)) is not None:  # StopRequest
                inboxes[rank].send_nowait(message)

    def _load(self, rank: int) -> int:
        stats = self._group.engines[rank].stats()
        return stats.num_waiting + stats.num_running + self._sent_since_step[rank]

    async def _merge(self, rank: int, steps: trio.MemoryReceiveChannel) -> None:
        async for step in steps:
            self._sent_since_step[rank] = 0
            self._owners.forget_finished(step)
            await self._outbox.send(step)
