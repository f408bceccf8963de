"""The remote channel over a real socket pair: messages round-trip equal, backpressure bounds a
sender, cancellation never corrupts the stream, and every way a link can go wrong gives the
documented error on the side that sees it."""

from __future__ import annotations

import struct

import attrs
import pytest
import trio
import trio.testing

from engine.errors import ConfigError, InvalidParameterError
from engine.messages import (
    WIRE_MESSAGES,
    AbortRequest,
    AddRequest,
    Decodes,
    EngineStats,
    KVCacheInfo,
    RequestRejected,
    StepOutput,
    StepTimings,
    StopRequest,
    TokenDelta,
)
from engine.outputs import TokenLogprobs
from engine.sampling_params import RequestOutputKind, SamplingParams, StructuredOutputsParams
from engine.transport.protocol import CODEC as PROTOCOL
from engine.transport.protocol import EngineReady
from engine.transport.wire import Codec, WireProtocolError, open_link

CODEC = Codec(WIRE_MESSAGES)


@attrs.frozen
class Blob:
    data: bytes


BLOBS = Codec([Blob])


async def stream_pair():
    a, b = trio.socket.socketpair()
    return trio.SocketStream(a), trio.SocketStream(b)


def samples():
    params = SamplingParams(n=2, temperature=0.7, top_k=5, stop=["\n\n"], stop_token_ids=[7], logit_bias={3: -1.5},
                            logprobs=2, seed=11, output_kind=RequestOutputKind.DELTA,
                            structured_outputs=StructuredOutputsParams(json={"type": "object"}))
    logprobs = (TokenLogprobs(5, -0.25, 1, (5, 9), (-0.25, -2.0)),)
    delta = TokenDelta("req-1", 1, (5, 6, 7), logprobs, logprobs, "stop", "\n\n", 16, 12.5, None)
    stats = EngineStats(3, 1, 40, 128, 900, 512, 2, 1000, 333, 77)
    return [
        AddRequest("req-1", (1, 2, 3), params, priority=2),
        AbortRequest(("a", "b")),
        StopRequest("req-1", 1, "###", 7),
        StepOutput((delta, TokenDelta("r2", 0, ())), (), stats, 64, 2, StepTimings(0.001, 0.02, 0.003)),
        StepOutput((), (), stats, 0, 0, None),
        StepOutput((delta,), (), stats, 4, 4, None, Decodes(("a", "b", "b"), (0, 0, 1), (11, 12, 13))),
    ]


def test_decodes_are_columns_of_one_token_deltas():
    decodes = Decodes(("a", "b", "c", "b"), (0, 0, 0, 1), (11, 12, 13, 14))
    assert decodes.select(lambda request_id: request_id == "b") == Decodes(("b", "b"), (0, 1), (12, 14))
    assert decodes.select(lambda request_id: True) is decodes and len(decodes) == 4
    step = StepOutput((TokenDelta("d", 0, (1, 2), finish_reason="length"),), (), samples()[3].stats, 5, 5, None,
                      decodes)
    assert [(d.request_id, d.index, d.new_token_ids, d.finished) for d in step.all_deltas()] == [
        ("d", 0, (1, 2), True), ("a", 0, (11,), False), ("b", 0, (12,), False), ("c", 0, (13,), False),
        ("b", 1, (14,), False)]


async def test_every_message_round_trips_equal():
    left, right = await stream_pair()
    async with open_link(left, CODEC, role="front") as (send, _), open_link(right, CODEC, role="engine") as (_, recv):
        for message in samples():
            await send.send(message)
            received = await recv.receive()
            assert received == message and repr(received) == repr(message)  # (repr: 20 is not 20.0)


@pytest.mark.parametrize("window", [None, 4096])
async def test_the_engine_processs_ready_message_round_trips_with_its_cache(window):
    ready = EngineReady("m", 8192, 49152, "cpu", {"temperature": 0.6, "top_k": 20}, (2, 7),
                        KVCacheInfo(16, 2048, "int8", 11520, True, window), samples()[3].stats, 1234, 1, 12.5)
    left, right = await stream_pair()
    async with open_link(left, PROTOCOL, role="engine") as (send, _), \
            open_link(right, PROTOCOL, role="front") as (_, recv):
        await send.send(ready)
        received = await recv.receive()
        assert received == ready and repr(received) == repr(ready)  # top_k stays an int (a float is refused)


async def test_a_rejection_keeps_its_error_class_param_and_text():
    left, right = await stream_pair()
    async with open_link(left, CODEC, role="engine") as (send, _), open_link(right, CODEC, role="front") as (_, recv):
        stats = EngineStats(0, 0, 0, 1, 0, 0, 0, 0, 0, 0)
        errors = (InvalidParameterError("max_tokens", "too many"), ConfigError("x", "bad"), KeyError("odd"))
        await send.send(StepOutput((), tuple(RequestRejected(f"r{i}", e) for i, e in enumerate(errors)), stats, 0, 0,
                                   None))
        got = [r.error for r in (await recv.receive()).rejected]
    assert type(got[0]) is InvalidParameterError and (got[0].param, str(got[0])) == ("max_tokens", "too many")
    assert type(got[1]) is ConfigError and got[1].param == "x"
    assert type(got[2]) is RuntimeError and "KeyError" in str(got[2])  # not an engine error: its text


async def test_closing_the_sender_ends_the_receiver_after_every_queued_message():
    left, right = await stream_pair()
    async with open_link(right, CODEC, role="engine") as (_, recv):
        async with open_link(left, CODEC, role="front") as (send, _):
            for i in range(100):
                send.send_nowait(AbortRequest((str(i),))) if i < 50 else await send.send(AbortRequest((str(i),)))
            await send.aclose()
        received = [m.request_ids[0] async for m in recv]  # ends with EndOfChannel, not an error
    assert received == [str(i) for i in range(100)]


async def test_a_slow_receiver_bounds_what_the_sender_holds():
    """The receiver reads nothing: the sender blocks once its buffer, the socket's buffers and
    the peer's buffer are full, long before it has sent 10,000 messages of 64 KiB (640 MB)."""
    left, right = await stream_pair()
    payload = b"x" * 65536
    sent = 0
    async with open_link(left, BLOBS, role="front", buffer=4) as (send, _), \
            open_link(right, BLOBS, role="engine", buffer=4) as (_, recv):
        with trio.move_on_after(1.0):
            for _ in range(10_000):
                await send.send(Blob(payload))
                sent += 1
        assert 8 <= sent < 200
        for _ in range(sent):  # every frame sent arrives whole
            assert (await recv.receive()).data == payload


async def test_a_cancelled_send_leaves_the_later_frames_intact():
    left, right = await stream_pair()
    async with open_link(left, BLOBS, role="front", buffer=1) as (send, _), \
            open_link(right, BLOBS, role="engine", buffer=1) as (_, recv):
        big = b"y" * (1 << 20)
        cancelled = 0
        for i in range(40):  # the buffers fill; sends that cannot queue are cancelled
            with trio.move_on_after(0.01) as scope:
                await send.send(Blob(big + bytes([i])))
            cancelled += scope.cancelled_caught
        assert cancelled > 0
        got = []
        async with trio.open_nursery() as nursery:
            nursery.start_soon(send.send, Blob(b"after"))
            while (blob := await recv.receive()).data != b"after":
                assert len(blob.data) == len(big) + 1
                got.append(blob.data[-1])
        assert got == sorted(got) and len(got) == 40 - cancelled  # whole frames, in order, none torn


async def test_a_stream_cut_mid_frame_breaks_the_link_cleanly():
    """A peer that dies half way through writing a frame: the receiver gets BrokenResourceError
    (the reason as its cause), never a garbled message."""
    left, right = await stream_pair()
    async with open_link(right, CODEC, role="front") as (send, recv):
        hello_seen = trio.Event()

        async def half_a_peer():
            from engine.transport.wire import PROTOCOL_VERSION, Hello, _frame

            await left.send_all(_frame(CODEC.encode(Hello(PROTOCOL_VERSION, CODEC.digest, "engine"))))
            await left.receive_some()  # the link's Hello (unread data would make the close a reset)
            hello_seen.set()
            frame = _frame(CODEC.encode(AbortRequest(("x",))))
            await left.send_all(frame[:len(frame) // 2])
            await left.aclose()

        async with trio.open_nursery() as nursery:
            nursery.start_soon(half_a_peer)
        with pytest.raises(trio.BrokenResourceError) as error:
            await recv.receive()
        assert isinstance(error.value.__cause__, WireProtocolError) and "inside a frame" in str(error.value.__cause__)
        with pytest.raises(trio.BrokenResourceError):
            await send.send(AbortRequest(("y",)))


@pytest.mark.parametrize("garbage, words", [
    (struct.pack(">I", 5) + b"\xff\xfe\x00\x01\x02", "does not decode"),
    (struct.pack(">I", 1 << 30), "exceeds the limit"),
    (lambda: struct.pack(">I", 6) + CODEC._encoder.encode(("NoSuchMessage", 1))[:6], "does not decode|unknown"),
])
async def test_garbage_and_oversized_frames_break_the_link_with_the_reason(garbage, words):
    from engine.transport.wire import PROTOCOL_VERSION, Hello, _frame

    garbage = garbage() if callable(garbage) else garbage
    left, right = await stream_pair()
    await left.send_all(_frame(CODEC.encode(Hello(PROTOCOL_VERSION, CODEC.digest, "engine"))))
    async with open_link(right, CODEC, role="front", max_frame_bytes=1 << 20) as (_, recv):
        await left.send_all(garbage)
        with pytest.raises(trio.BrokenResourceError) as error:
            await recv.receive()
    assert isinstance(error.value.__cause__, WireProtocolError)
    assert __import__("re").search(words, str(error.value.__cause__))


async def test_a_message_over_the_frame_limit_is_refused_and_breaks_the_senders_link():
    left, right = await stream_pair()
    async with open_link(left, BLOBS, role="front", max_frame_bytes=1000) as (send, _), \
            open_link(right, BLOBS, role="engine") as (_, recv):
        await send.send(Blob(b"z" * 2000))
        with pytest.raises(trio.BrokenResourceError):
            await recv.receive()  # the writer closed the stream instead of writing it


async def test_a_peer_with_other_message_definitions_is_refused_at_the_handshake():
    """Nothing is delivered either way; each side's channels say why."""
    left, right = await stream_pair()
    async with open_link(left, CODEC, role="front") as (send, recv), \
            open_link(right, BLOBS, role="engine") as (peer_send, peer_recv):
        await peer_send.send(Blob(b"never delivered"))
        for channel in (recv, peer_recv):
            with pytest.raises(trio.BrokenResourceError) as error:
                await channel.receive()
            assert "run the same version" in str(error.value.__cause__)
        with pytest.raises(trio.BrokenResourceError):
            await send.send(AbortRequest(("x",)))


async def test_a_silent_peer_fails_the_handshake_after_the_timeout():
    left, right = await stream_pair()
    async with open_link(left, CODEC, role="front", handshake_timeout=0.2) as (_, recv):
        with pytest.raises(trio.BrokenResourceError) as error:
            await recv.receive()
    assert "no handshake within 0.2 s" in str(error.value.__cause__)
    right.socket.close()


async def test_an_unencodable_message_raises_in_the_sender_and_the_link_goes_on():
    left, right = await stream_pair()
    async with open_link(left, CODEC, role="front") as (send, _), open_link(right, CODEC, role="engine") as (_, recv):
        with pytest.raises(TypeError, match="not a message of this wire"):
            await send.send(Blob(b"x"))
        with pytest.raises(TypeError):  # a field that cannot cross (a compiled grammar, say)
            await send.send(AddRequest("r", (1,), SamplingParams(), grammar=object()))
        await send.send(AbortRequest(("ok",)))
        assert await recv.receive() == AbortRequest(("ok",))


async def test_a_peer_that_stops_without_a_goodbye_is_a_broken_link_not_an_end():
    """What a killed process looks like from the other end: the stream just stops."""
    left, right = await stream_pair()
    async with open_link(right, CODEC, role="front") as (_, recv):
        async with open_link(left, CODEC, role="engine") as (send, _):
            await send.send(AbortRequest(("last",)))
            await trio.testing.wait_all_tasks_blocked()  # written; then the block ends without closing the channel
        assert await recv.receive() == AbortRequest(("last",))
        with pytest.raises(trio.BrokenResourceError) as error:
            await recv.receive()
    assert "without a goodbye" in str(error.value.__cause__)
