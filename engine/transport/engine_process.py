"""The engine process: an ``EngineCore`` and its core actor, joined to a front by ``engine.transport.wire``.

Started by ``engine.transport.processes`` (never by hand): ``python -m engine.transport.engine_process --fd N
[--fd M ...] --config JSON``, each fd its end of a connected socket to a front (several with
``--api-server-count``). It sends each front ``EngineReady`` (or ``EngineFailed`` if the core
cannot start), then runs:

    links --> inlets (compile structured-output grammars, off the loop) --> inbox --> core actor
    core actor --> outlet (each front its own requests' deltas, and the stats) --> links

A front that goes away (the link's orderly end, or its breaking: a dead front's socket is
closed by the kernel) has its requests aborted; the engine exits when every front has
gone. A failed step sends ``EngineFailed`` to every front and exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import socket
import sys
import time
from contextlib import AsyncExitStack

import attrs
import trio

from engine.config import EngineConfig
from engine.core.core_actor import STEP_QUEUE_SIZE, CoreActor
from engine.core.engine_core import EngineCore
from engine.errors import BackendUnavailableError, InvalidParameterError, RequestFailedError
from engine.messages import AbortRequest, AddRequest, RequestRejected, StopRequest
from engine.models.loader import resolve_model
from engine.transport.protocol import (CODEC, ENGINE_HANDSHAKE_TIMEOUT_S, HEARTBEAT_S, SILENCE_LIMIT_S, EngineFailed,
                                       EngineReady, Heartbeat, RequestOwners)
from engine.transport.wire import open_link

log = logging.getLogger("engine.transport.engine_process")


async def serve(fds: list[int], config: EngineConfig) -> int:
    """Run the engine for the fronts at the sockets ``fds`` until they have all gone away;
    the exit status."""
    async with AsyncExitStack() as stack:
        links = []
        for fd in fds:
            stream = trio.SocketStream(trio.socket.from_stdlib_socket(socket.socket(fileno=fd)))
            links.append(await stack.enter_async_context(
                open_link(stream, CODEC, role="engine", handshake_timeout=ENGINE_HANDSHAKE_TIMEOUT_S)))
        try:
            core = await trio.to_thread.run_sync(EngineCore, config)
        except Exception as exc:
            if isinstance(exc, (InvalidParameterError, BackendUnavailableError)):  # (the front says it in one line)
                log.error("the engine could not start: %s", exc)
            else:
                log.exception("the engine could not start")
            for send, _ in links:
                await _send_last(send, EngineFailed(exc))
            return 1
        ready = EngineReady(resolve_model(config.model).name, core.max_model_len, core.vocab_size, core.backend_name,
                            core.sampling_defaults, core.eos_token_ids, core.kv_cache_info, core.stats(),
                            os.getpid(), config.data_parallel_rank, time.monotonic())
        fronts = Fronts(core, [send for send, _ in links])
        for front, (send, _) in enumerate(links):
            try:
                await send.send(ready)
            except trio.BrokenResourceError:  # that front went away while the model loaded
                fronts.gone(front)
        inbox_send, inbox_recv = trio.open_memory_channel(math.inf)
        steps_send, steps_recv = trio.open_memory_channel(STEP_QUEUE_SIZE)
        actor = CoreActor(core, inbox_recv, steps_send)
        failure = None
        async with trio.open_nursery() as nursery:
            for front, (_, receive) in enumerate(links):
                nursery.start_soon(fronts.inlet, front, receive, inbox_send.clone())
            inbox_send.close()  # the core's inbox ends when every front's inlet has
            sent = trio.Event()
            nursery.start_soon(fronts.outlet, steps_recv, sent)
            nursery.start_soon(fronts.heartbeats)
            try:
                await actor.run()
            except Exception as exc:
                log.exception("engine step failed; the engine is dead")
                failure = exc
            else:
                await sent.wait()
            nursery.cancel_scope.cancel()
        core.abort_all()
        for front, (send, _) in enumerate(links):
            await _send_last(send, None if failure is None else EngineFailed(failure))
    return 0 if failure is None else 1


# How long the step outputs wait for a front whose link is full (a wedged or stopped front
# process) before its link is dropped: meanwhile every other front waits too. (A front gives
# an engine that says nothing as long before it declares it dead.)
FRONT_STALL_LIMIT_S = SILENCE_LIMIT_S


class Fronts:
    """The engine's fronts (one, or ``--api-server-count`` of them): whose request is whose,
    and each front's share of a step's output."""

    def __init__(self, core: EngineCore, sends: list) -> None:
        self._core = core
        self._sends = sends
        self._live = [True] * len(sends)
        self._owners = RequestOwners()  # request id -> front
        self._structured = None
        self._structured_lock = trio.Lock()

    def gone(self, front: int) -> None:
        self._live[front] = False

    async def inlet(self, front: int, receive, inbox: trio.MemorySendChannel) -> None:
        """One front's messages to the core actor. A request with structured outputs gets its
        grammar compiled here (the front's compiled grammar stays in the front), in a task of
        its own: what comes after it for other requests goes on at once, what comes for it
        (an abort, a stop) waits behind it."""
        held: dict[str, list[AbortRequest | StopRequest]] = {}  # request id -> behind its compile
        async with inbox, trio.open_nursery() as compiles:
            try:
                async for message in receive:
                    if isinstance(message, AddRequest):
                        self._owners.add(message, front)
                    self._forward(message, inbox, held, compiles)
            except trio.BrokenResourceError as exc:
                log.warning("the link to front %d broke (%s)", front, exc.__cause__ or exc)
            # This front is gone: nothing will read what its requests produce.
            self.gone(front)
            self._forward(AbortRequest(self._owners.of(front)), inbox, held, compiles)

    def _forward(self, message, inbox: trio.MemorySendChannel, held: dict, compiles: trio.Nursery) -> None:
        if isinstance(message, AddRequest) and message.params.structured_outputs is not None:
            held[message.request_id] = []
            compiles.start_soon(self._add_compiled, message, inbox, held)
            return
        if isinstance(message, AbortRequest) and any(r in held for r in message.request_ids):
            for request_id in message.request_ids:
                if request_id in held:
                    held[request_id].append(AbortRequest((request_id,)))
            message = AbortRequest(tuple(r for r in message.request_ids if r not in held))
        elif isinstance(message, StopRequest) and message.request_id in held:
            held[message.request_id].append(message)
            return
        inbox.send_nowait(message)

    async def _add_compiled(self, message: AddRequest, inbox: trio.MemorySendChannel, held: dict) -> None:
        """The request with its grammar (or its rejection), then what waited behind it."""
        try:
            grammar = await (await self._structured_outputs()).compile_async(message.params.structured_outputs)
            ready: AddRequest | RequestRejected = attrs.evolve(message, grammar=grammar)
        except InvalidParameterError as exc:  # the front compiled it: a time-out here, or a bug
            log.warning("request %s: its grammar did not compile in the engine: %s", message.request_id, exc)
            ready = RequestRejected(message.request_id, exc)
        except Exception as exc:
            log.exception("request %s: compiling its grammar failed", message.request_id)
            ready = RequestRejected(message.request_id, RequestFailedError(f"compiling its grammar failed: {exc!r}"))
        inbox.send_nowait(ready)
        for later in held.pop(message.request_id):
            inbox.send_nowait(later)

    async def _structured_outputs(self):
        async with self._structured_lock:  # (built once, by the first request that needs it)
            if self._structured is None:
                self._structured = await trio.to_thread.run_sync(_structured_outputs, self._core)
        return self._structured

    async def heartbeats(self) -> None:
        """A ``Heartbeat`` to every front every ``HEARTBEAT_S``, until cancelled. Never waiting on
        one: a front whose link is full has not stopped hearing from this process, and one front
        that stopped reading must not silence the others."""
        while True:
            await trio.sleep(HEARTBEAT_S)
            for front, send in enumerate(self._sends):
                if self._live[front]:
                    try:
                        send.send_nowait(Heartbeat(time.monotonic()))
                    except trio.WouldBlock:
                        pass
                    except (trio.BrokenResourceError, trio.ClosedResourceError):
                        self.gone(front)

    async def outlet(self, steps: trio.MemoryReceiveChannel, sent: trio.Event) -> None:
        """Each step output up the links: to every front its own requests' deltas and
        rejections, and the engine's stats. A front that is gone gets nothing (the core
        must not block on it while it finishes the aborts)."""
        try:
            async for step in steps:
                for front, send in enumerate(self._sends):
                    if not self._live[front]:
                        continue
                    share = step if len(self._sends) == 1 else attrs.evolve(
                        step, deltas=tuple(d for d in step.deltas if self._owners.get(d.request_id) == front),
                        rejected=tuple(r for r in step.rejected if self._owners.get(r.request_id) == front),
                        decodes=step.decodes.select(lambda request_id: self._owners.get(request_id) == front))
                    try:
                        with trio.move_on_after(FRONT_STALL_LIMIT_S) as waiting:
                            await send.send(share)
                    except trio.BrokenResourceError:
                        self.gone(front)
                    if waiting.cancelled_caught:  # (it stopped reading: the others must not wait on it)
                        log.warning("front %d read nothing for %g s: dropping its link (its requests are aborted)",
                                    front, FRONT_STALL_LIMIT_S)
                        self.gone(front)
                        await send.abandon(f"the front read nothing for {FRONT_STALL_LIMIT_S:g} s")
                self._owners.forget_finished(step)
        finally:
            sent.set()


async def _send_last(send, message) -> None:
    """The last message if any, then an orderly close (the front reads it before the end)."""
    try:
        if message is not None:
            await send.send(message)
        await send.aclose()
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


def _structured_outputs(core: EngineCore):
    from engine.structured_outputs import StructuredOutputManager
    from engine.tokenizer import tokenizer_for

    return StructuredOutputManager.for_engine(tokenizer_for(core.config), core.vocab_size, core.config)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fd", type=int, action="append", required=True,
                        help="this process's end of a connected socket to a front (once per front)")
    parser.add_argument("--config", required=True, help="the EngineConfig's fields as JSON")
    parser.add_argument("--log-level", default="INFO", help="the front's (its logging level's name)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s engine[%(process)d] %(name)s: %(message)s")
    config = EngineConfig.from_kwargs(**json.loads(args.config))
    sys.exit(trio.run(serve, args.fd, config))


if __name__ == "__main__":
    main()
