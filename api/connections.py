"""A workaround for hypercorn's trio worker under quart-trio: connections it should close stay open.

quart-trio ends a request by cancelling the task that then tells hypercorn the connection's
state (``TCPServer.protocol_send``), so what hypercorn does there is cancelled at its first
checkpoint (pgjones/hypercorn#330, hypercorn 0.18.0 with quart-trio 0.12.0):

- ``Connection: close`` and HTTP/1.0 responses never close the socket: an HTTP/1.0 stream
  (nginx proxies with HTTP/1.0 unless told otherwise) has no end but the close, so the
  client waits for its read timeout after ``[DONE]``; the 4xx answers this server marks
  ``Connection: close`` leave the connection open all the same;
- the keep-alive timer of an idle connection is cancelled as it starts, so idle
  connections are never closed and their file descriptors add up.

Each of those steps is short (close a socket, restart a timer; sends were shielded already),
so shielding them from that cancellation gives the behaviour hypercorn means to have.
"""

from __future__ import annotations

import functools

import trio
from hypercorn.trio.tcp_server import TCPServer


def close_connections_as_asked() -> None:
    """Shield ``TCPServer.protocol_send`` and ``TCPServer._close`` from a cancelled caller (once per process)."""
    for name in ("protocol_send", "_close"):
        method = getattr(TCPServer, name)
        if getattr(method, "_shielded", False):
            continue

        @functools.wraps(method)
        async def shielded(self, *args, _method=method):
            with trio.CancelScope(shield=True):
                return await _method(self, *args)

        shielded._shielded = True
        setattr(TCPServer, name, shielded)
