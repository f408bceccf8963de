"""A remote channel: the actor graph's messages between processes, over a trio byte stream.

``open_link(stream, codec)`` gives a ``(RemoteSendChannel, RemoteReceiveChannel)`` pair with
the interface of trio's memory channels (``send`` / ``receive`` / ``aclose``, ``EndOfChannel``
when the peer closed its side, ``BrokenResourceError`` when the link broke), so an actor does
not change when the channel between it and its peer becomes a socket (a Unix socket on one
machine, TCP across machines).

On the stream:
- each message is one frame: a 4-byte big-endian length, then msgpack ``[tag, fields]``, the
  tag naming the message's class (``Codec``: frozen attrs classes, encoded by msgspec; token
  ids and logprobs travel as msgpack arrays of numbers, never as JSON text, never pickle);
- the first frame each way is a ``Hello`` with the protocol version and a digest of the message
  definitions: a peer built from other definitions is refused before anything else is read;
- frames over ``max_frame_bytes`` are refused (the reader never allocates for them).

One writer task and one reader task own the stream. ``send`` encodes in the caller's task
(an unencodable message raises there) and queues the bytes in a bounded buffer, so a
cancelled ``send`` either queued a whole frame or nothing; only the writer writes, and a
write that fails or is cancelled closes the stream (a frame cut in half is never followed
by another). Bounded buffers on both sides carry backpressure end to end: a slow receiver
stops the reader, the peer's writer blocks on the socket, and the peer's ``send`` waits.

A side that closes its send channel ends with a ``Goodbye`` frame: the peer's receiver then
ends with ``EndOfChannel``. A stream that just stops (the peer died), a frame that fails to
decode, a frame over the limit, or a stream cut mid-frame breaks the link with a logged reason: the receiver gets ``BrokenResourceError`` (the reason as its
``__cause__``), the sender too from then on.
"""

from __future__ import annotations

import hashlib
import logging
import struct
from collections.abc import AsyncIterator, Sequence
from contextlib import asynccontextmanager
from typing import Any

import attrs
import msgspec
import trio

log = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
DEFAULT_MAX_FRAME_BYTES = 64 << 20
DEFAULT_BUFFER = 64  # messages queued on each side of a link
_LENGTH = struct.Struct(">I")


class WireProtocolError(Exception):
    """The peer broke the protocol: a bad handshake, an undecodable or oversized frame, a
    stream cut mid-frame. The link is closed; the message says what happened."""


@attrs.frozen
class Hello:
    """The first frame each way."""

    protocol_version: int
    digest: str  # of the message definitions (Codec.digest)
    role: str  # who is speaking, for the logs ("front", "engine")


@attrs.frozen
class Goodbye:
    """The last frame of a side that closed its send channel: what tells an orderly end from a
    peer that died (a stream that just stops is a broken link)."""


class Codec:
    """Encodes and decodes the frozen attrs classes ``types`` (and what their fields hold) as
    msgpack ``[class name, fields]``.

    ``Exception`` fields travel as ``[class name, param, message]`` and come back as the
    engine's error of that name (``InvalidParameterError`` keeps its ``param``), or a
    ``RuntimeError`` carrying the text.
    """

    def __init__(self, types: Sequence[type]) -> None:
        self.types = {cls.__name__: cls for cls in [Hello, Goodbye, *types]}
        self._encoder = msgspec.msgpack.Encoder(enc_hook=_encode_extra)
        self._envelope = msgspec.msgpack.Decoder(tuple[str, msgspec.Raw])
        self._decoders = {name: msgspec.msgpack.Decoder(cls, dec_hook=_decode_extra)
                          for name, cls in self.types.items()}
        self.digest = _digest(self.types.values())

    def encode(self, message: Any) -> bytes:
        name = type(message).__name__
        if self.types.get(name) is not type(message):
            raise TypeError(f"{type(message).__qualname__} is not a message of this wire")
        return self._encoder.encode((name, message))

    def decode(self, frame: bytes | memoryview) -> Any:
        try:
            name, raw = self._envelope.decode(frame)
            decoder = self._decoders.get(name)
            if decoder is None:
                raise WireProtocolError(f"a frame holds an unknown message type {name!r}")
            return decoder.decode(raw)
        except (msgspec.DecodeError, msgspec.ValidationError) as exc:
            raise WireProtocolError(f"a frame does not decode: {exc}") from None


def _digest(types) -> str:
    """What both ends must agree on: each class's name, field names and annotations, in order."""
    text = ";".join(f"{cls.__name__}({','.join(f'{f.name}:{f.type}' for f in attrs.fields(cls))})" for cls in types)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _encode_extra(value: Any) -> Any:
    if isinstance(value, BaseException):
        return (type(value).__name__, getattr(value, "param", None), str(value))
    raise TypeError(f"{type(value).__qualname__} cannot cross the wire")


def _decode_extra(kind: type, value: Any) -> Any:
    if kind is Exception:
        from engine import errors

        name, param, message = value
        cls = getattr(errors, name, None)
        if isinstance(cls, type) and issubclass(cls, errors.InvalidParameterError):
            return cls(param, message)
        if isinstance(cls, type) and issubclass(cls, Exception):
            return cls(message)
        return RuntimeError(f"{name}: {message}")
    raise TypeError(f"cannot decode {kind}")


class _Link:
    """The shared state of one link: its stream and why it broke, if it did."""

    def __init__(self, stream: trio.abc.Stream, codec: Codec, max_frame_bytes: int) -> None:
        self.stream = stream
        self.codec = codec
        self.max_frame_bytes = max_frame_bytes
        self.error: BaseException | None = None
        self.peer_checked = trio.Event()  # the peer's Hello is read (and the link broken if it was wrong)

    def broken(self, reason: BaseException) -> None:
        if self.error is None:
            self.error = reason
            log.warning("wire link closed: %s", reason)

    def check(self) -> None:
        if self.error is not None:
            raise trio.BrokenResourceError(f"the link is broken: {self.error}") from self.error


class RemoteSendChannel(trio.abc.SendChannel):
    """The sending half of a link (a trio ``SendChannel``)."""

    def __init__(self, link: _Link, frames: trio.MemorySendChannel) -> None:
        self._link = link
        self._frames = frames
        self.closed = False

    async def send(self, value: Any) -> None:
        self._link.check()
        frame = self._link.codec.encode(value)
        try:
            await self._frames.send(frame)
        except trio.BrokenResourceError:  # the writer is gone
            self._link.check()
            raise

    def send_nowait(self, value: Any) -> None:
        """Queue a message now or raise ``trio.WouldBlock`` (the buffer is full)."""
        self._link.check()
        self._frames.send_nowait(self._link.codec.encode(value))

    async def aclose(self) -> None:
        """No more messages: the peer's receiver ends with ``EndOfChannel`` after the queued ones."""
        self.close()
        await trio.lowlevel.checkpoint()

    async def abandon(self, reason: str) -> None:
        """End the link now, as if it had broken (the peer stopped reading, say): both halves
        raise ``BrokenResourceError`` from here on, and the peer sees its stream cut."""
        self._link.broken(trio.BrokenResourceError(reason))
        self._frames.close()
        await trio.aclose_forcefully(self._link.stream)

    def close(self) -> None:
        self.closed = True
        self._frames.close()


class RemoteReceiveChannel(trio.abc.ReceiveChannel):
    """The receiving half of a link (a trio ``ReceiveChannel``)."""

    def __init__(self, link: _Link, messages: trio.MemoryReceiveChannel) -> None:
        self._link = link
        self._messages = messages

    async def handshake(self) -> None:
        """Wait until the peer's Hello has been checked: ``BrokenResourceError`` if the link broke
        first (a peer of another version, or not speaking this protocol at all)."""
        await self._link.peer_checked.wait()
        self._link.check()

    async def receive(self) -> Any:
        try:
            return await self._messages.receive()
        except trio.EndOfChannel:
            self._link.check()  # a broken link is not a clean end
            raise

    def receive_nowait(self) -> Any:
        try:
            return self._messages.receive_nowait()
        except trio.EndOfChannel:
            self._link.check()
            raise

    async def aclose(self) -> None:
        await self._messages.aclose()

    def close(self) -> None:
        self._messages.close()


@asynccontextmanager
async def open_link(stream: trio.abc.Stream, codec: Codec, *, role: str, buffer: int = DEFAULT_BUFFER,
                    max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES, handshake_timeout: float = 30.0,
                    drain_timeout: float = 5.0) -> AsyncIterator[tuple[RemoteSendChannel, RemoteReceiveChannel]]:
    """Run a link over ``stream`` for the duration of the block.

    The handshake runs in the link's tasks: this side's ``Hello`` goes out first, and nothing
    else is written or delivered until the peer's has been checked. A peer that speaks another
    protocol version or other definitions, or says nothing for ``handshake_timeout``, breaks
    the link (``BrokenResourceError`` whose cause is a ``WireProtocolError`` saying which).

    Leaving the block closes the stream. If the send channel was closed in the block, the
    messages queued on it and the EOF are written first (for up to ``drain_timeout``);
    otherwise they are dropped.
    """
    link = _Link(stream, codec, max_frame_bytes)
    out_send, out_recv = trio.open_memory_channel(buffer)
    in_send, in_recv = trio.open_memory_channel(buffer)
    written = trio.Event()
    try:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(_write, link, out_recv, written, role)
            nursery.start_soon(_read, link, in_send, role, handshake_timeout)
            sender = RemoteSendChannel(link, out_send)
            try:
                yield sender, RemoteReceiveChannel(link, in_recv)
                if sender.closed:  # an orderly end: the queued frames and the EOF go out first
                    with trio.move_on_after(drain_timeout):
                        await written.wait()
            finally:
                nursery.cancel_scope.cancel()
    finally:
        await trio.aclose_forcefully(stream)


def _frame(payload: bytes) -> bytes:
    return _LENGTH.pack(len(payload)) + payload


async def _write(link: _Link, frames: trio.MemoryReceiveChannel, done: trio.Event, role: str) -> None:
    """The only task that writes to the stream: the Hello, then (once the peer's is checked)
    the queued frames. A failed or cancelled write closes the stream, since the peer may have
    half a frame; the end of ``frames`` becomes the stream's EOF."""
    try:
        async with frames:
            await link.stream.send_all(_frame(link.codec.encode(Hello(PROTOCOL_VERSION, link.codec.digest, role))))
            await link.peer_checked.wait()
            if link.error is not None:
                return
            async for payload in frames:
                if len(payload) > link.max_frame_bytes:
                    raise WireProtocolError(f"a message of {len(payload)} bytes exceeds the frame limit of "
                                            f"{link.max_frame_bytes}")
                try:
                    await link.stream.send_all(_frame(payload))
                except trio.Cancelled:
                    link.broken(trio.BrokenResourceError("a write was cancelled part way"))
                    await trio.aclose_forcefully(link.stream)
                    raise
            await link.stream.send_all(_frame(link.codec.encode(Goodbye())))
            if isinstance(link.stream, trio.abc.HalfCloseableStream):
                await link.stream.send_eof()
    except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, WireProtocolError) as exc:
        link.broken(exc)
        await trio.aclose_forcefully(link.stream)
    finally:
        done.set()


async def _read(link: _Link, messages: trio.MemorySendChannel, role: str, handshake_timeout: float) -> None:
    """The only task that reads the stream: the peer's Hello (checked), then frames ->
    messages, until EOF or a broken frame."""
    reader = _FrameReader(link)
    async with messages:
        try:
            try:
                with trio.fail_after(handshake_timeout):
                    hello = await reader.next_frame()
                    if hello is None:
                        raise WireProtocolError("the peer closed the stream before its handshake")
                    _check_hello(link.codec.decode(hello), link.codec, role)
            except trio.TooSlowError:
                raise WireProtocolError(f"the peer sent no handshake within {handshake_timeout} s") from None
            finally:
                link.peer_checked.set()
            while (frame := await reader.next_frame()) is not None:
                message = link.codec.decode(frame)
                if isinstance(message, Goodbye):
                    return
                await messages.send(message)
            raise WireProtocolError("the peer's stream ended without a goodbye (did it die?)")
        except (trio.BrokenResourceError, trio.ClosedResourceError, OSError, WireProtocolError) as exc:
            link.broken(exc)
            await trio.aclose_forcefully(link.stream)


def _check_hello(hello: Any, codec: Codec, role: str) -> None:
    if not isinstance(hello, Hello):
        raise WireProtocolError(f"the peer's first frame is a {type(hello).__name__}, not a Hello")
    if (hello.protocol_version, hello.digest) != (PROTOCOL_VERSION, codec.digest):
        raise WireProtocolError(
            f"the peer ({hello.role}) speaks protocol {hello.protocol_version} with message definitions "
            f"{hello.digest}; this side ({role}) speaks {PROTOCOL_VERSION} with {codec.digest}: "
            "run the same version of the engine on both sides")


class _FrameReader:
    """Length-prefixed frames from a stream, checked against the link's limit."""

    def __init__(self, link: _Link) -> None:
        self._link = link
        self._buffer = bytearray()

    async def _fill(self, size: int) -> bool:
        """Read until ``size`` bytes are buffered; False on EOF before any byte of them arrived."""
        while len(self._buffer) < size:
            chunk = await self._link.stream.receive_some(max(65536, size - len(self._buffer)))
            if not chunk:
                if not self._buffer:
                    return False
                raise WireProtocolError(f"the stream ended inside a frame ({len(self._buffer)} of {size} bytes)")
            self._buffer += chunk
        return True

    async def next_frame(self) -> bytes | None:
        """The next frame's payload, or None at a clean end of the stream."""
        if not await self._fill(_LENGTH.size):
            return None
        (size,) = _LENGTH.unpack_from(self._buffer)
        if size > self._link.max_frame_bytes:
            raise WireProtocolError(f"a frame of {size} bytes exceeds the limit of {self._link.max_frame_bytes}")
        await self._fill(_LENGTH.size + size)
        payload = bytes(self._buffer[_LENGTH.size:_LENGTH.size + size])
        del self._buffer[:_LENGTH.size + size]
        return payload

