"""The engine process: an ``EngineCore`` and its core actor, joined to a front by ``engine.wire``.

Started by ``engine.remote.engine_process`` (never by hand): ``python -m engine.core_process
--fd N --config JSON``, where N is its end of a connected socket. It sends ``EngineReady``
(or ``EngineFailed`` if the core cannot start), then runs:

    link --> inlet (compiles structured-output grammars) --> inbox --> core actor --> link

It exits when its front goes away: the link's orderly end (the core aborts what is left and
stops), or the link breaking (a dead front's socket is closed by the kernel). A failed step sends
``EngineFailed`` and exits with status 1.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import socket
import sys

import trio

from engine.config import EngineConfig
from engine.core_actor import CoreActor
from engine.engine_core import EngineCore
from engine.async_engine import STEP_QUEUE_SIZE
from engine.messages import AbortRequest, AddRequest
from engine.models.loader import resolve_model
from engine.remote import CODEC, EngineFailed, EngineReady
from engine.wire import open_link

log = logging.getLogger("engine.core_process")


async def serve(fd: int, config: EngineConfig) -> int:
    """Run the engine over the socket ``fd`` until its front goes away; the exit status."""
    stream = trio.SocketStream(trio.socket.from_stdlib_socket(socket.socket(fileno=fd)))
    async with open_link(stream, CODEC, role="engine") as (send, receive):
        try:
            core = await trio.to_thread.run_sync(EngineCore, config)
        except Exception as exc:
            log.exception("the engine could not start")
            await _send_last(send, EngineFailed(exc))
            return 1
        try:
            await send.send(EngineReady(resolve_model(config.model).name, core.max_model_len, core.vocab_size,
                                        core.backend_name, core.sampling_defaults, core.stats(), os.getpid()))
        except trio.BrokenResourceError:  # the front went away while the model loaded
            return 1
        inbox_send, inbox_recv = trio.open_memory_channel(math.inf)
        steps_send, steps_recv = trio.open_memory_channel(STEP_QUEUE_SIZE)
        actor = CoreActor(core, inbox_recv, steps_send)
        failure = None
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_inlet, receive, inbox_send, core)
            sent = trio.Event()
            nursery.start_soon(_outlet, steps_recv, send, sent)
            try:
                await actor.run()
            except Exception as exc:
                log.exception("engine step failed; the engine is dead")
                failure = exc
            else:
                await sent.wait()
            nursery.cancel_scope.cancel()
        core.abort_all()
        await _send_last(send, None if failure is None else EngineFailed(failure))
    return 0 if failure is None else 1


async def _send_last(send, message) -> None:
    """The last message if any, then an orderly close (the front reads it before the end)."""
    try:
        if message is not None:
            await send.send(message)
        await send.aclose()
    except (trio.BrokenResourceError, trio.ClosedResourceError):
        pass


async def _outlet(steps: trio.MemoryReceiveChannel, send, sent: trio.Event) -> None:
    """Step outputs up the link. Once the link is broken they are dropped (the core must not
    block on a front that is gone while it finishes the aborts)."""
    try:
        async for step in steps:
            await send.send(step)
    except trio.BrokenResourceError:
        async for _ in steps:
            pass
    finally:
        sent.set()


async def _inlet(receive, inbox: trio.MemorySendChannel, core: EngineCore) -> None:
    """Messages from the front to the core actor, in order. A request with structured outputs
    gets its grammar compiled here (the front's compiled grammar stays in the front)."""
    structured = None
    async with inbox:
        try:
            async for message in receive:
                if isinstance(message, AddRequest) and message.params.structured_outputs is not None:
                    if structured is None:
                        structured = await trio.to_thread.run_sync(_structured_outputs, core)
                    try:
                        grammar = await structured.compile_async(message.params.structured_outputs)
                    except Exception as exc:  # the front compiled it: only a bug or a time-out gets here
                        log.warning("request %s: its grammar did not compile here: %s", message.request_id, exc)
                        grammar = None
                    message = AddRequest(message.request_id, message.prompt_token_ids, message.params,
                                         message.priority, grammar)
                inbox.send_nowait(message)
        except trio.BrokenResourceError as exc:
            log.warning("the link to the front broke (%s): stopping", exc.__cause__ or exc)
        # The front is gone: nothing will read what its requests produce.
        inbox.send_nowait(AbortRequest(core.live_request_ids))


def _structured_outputs(core: EngineCore):
    from engine.structured_outputs import StructuredOutputManager, StructuredOutputsConfig
    from engine.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(resolve_model(core.config.model), core.config.tokenizer)
    return StructuredOutputManager(tokenizer, core.vocab_size,
                                   StructuredOutputsConfig.from_json(core.config.structured_outputs_config))


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--fd", type=int, required=True, help="this process's end of a connected socket")
    parser.add_argument("--config", required=True, help="the EngineConfig's fields as JSON")
    parser.add_argument("--log-level", default="INFO", help="the front's (its logging level's name)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level,
                        format="%(asctime)s %(levelname)s engine[%(process)d] %(name)s: %(message)s")
    config = EngineConfig.from_kwargs(**json.loads(args.config))
    sys.exit(trio.run(serve, args.fd, config))


if __name__ == "__main__":
    main()
