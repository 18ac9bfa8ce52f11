"""The server's connection-level rules, below the routes: an access log line per request, responses counted by
status, a cap on open connections, an idle timeout that closes connections that send no request, and a shutdown
that ends every stream with an error event instead of cutting it.

uvicorn (the ``server`` extra) is imported inside the functions that need it, so this imports without it.
"""

from __future__ import annotations

import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any


class HttpStats:
    """Responses by status, and what happened to connections (read by /metrics)."""

    def __init__(self) -> None:
        self.by_status: Counter[int] = Counter()
        self.refused = 0  # over --max-connections
        self.timed_out = 0  # no complete request within --idle-timeout
        self.open: Callable[[], int] = lambda: 0

    def figures(self) -> dict:
        return {"client_errors": {str(k): v for k, v in sorted(self.by_status.items()) if 400 <= k < 500},
                "server_errors": {str(k): v for k, v in sorted(self.by_status.items()) if k >= 500},
                "connections": {"open": self.open(), "refused": self.refused, "timed_out": self.timed_out}}


def _printable(raw: bytes, limit: int = 200) -> str:
    """A request path as it came (still %-escaped, so no newline can forge a log line), control bytes escaped."""
    s = raw[:limit].decode("latin-1")
    s = "".join(c if " " < c < "\x7f" else f"\\x{ord(c):02x}" for c in s)
    return s + ("..." if len(raw) > limit else "")


class AccessLog:
    """ASGI middleware, outermost: one line per request on stderr when its response ends (for a stream, when the
    stream ends): client, method, path, status, tokens in and out, milliseconds. Counts every status."""

    def __init__(self, app, stats: HttpStats, out=None) -> None:
        self.app, self.stats, self.out = app, stats, out

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        t0 = time.perf_counter()
        status = 0
        state = scope.setdefault("state", {})

        async def send_logged(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_logged)
        finally:
            status = status or 500  # nothing was sent: the app failed (uvicorn answers 500) or was cancelled
            self.stats.by_status[status] += 1
            job = state.get("pyspecter_job")
            tokens = f" tokens {len(job.prompt)}+{job.n_out}" if job is not None else ""
            client = scope.get("client")
            who = f"{client[0]}:{client[1]}" if client else "-"
            raw = scope.get("raw_path") or scope["path"].encode("utf-8", "backslashreplace")
            print(f"pyspecter serve: {who} {scope['method']} {_printable(raw)} {status}{tokens} "
                  f"{(time.perf_counter() - t0) * 1e3:.0f} ms", file=self.out or sys.stderr, flush=True)


_FULL = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\nconnection: close\r\n"
         b"retry-after: 1\r\ncontent-length: %d\r\n\r\n%s")


def protocol(max_connections: int, idle_timeout: float, stats: HttpStats) -> type:
    """uvicorn's h11 protocol with two rules of ours:
    - a connection over ``max_connections`` gets a 503 and is closed as it opens;
    - a connection that has not sent a whole request head within ``idle_timeout`` seconds of opening, or of its
      last response, is closed: idle and half-sent connections no longer hold a descriptor forever (uvicorn's own
      keep-alive timer starts only after a first response, and any byte restarts it)."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from pyspecter.server.wire import error_body

    body = __import__("json").dumps(error_body(f"too many connections (at most {max_connections}); retry",
                                               "server_error", "too_many_connections")).encode()

    class Protocol(H11Protocol):
        _head_timer: Any = None
        _refused = False

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            stats.open = lambda: len(self.connections)
            if len(self.connections) > max_connections:
                # answered, then closed once the client has read it: a close with its request still unread
                # would reset the connection and lose the 503
                self._refused = True
                stats.refused += 1
                transport.write(_FULL % (len(body), body))
                if transport.can_write_eof():
                    transport.write_eof()
                self._head_timer = self.loop.call_later(1.0, transport.close)
                return
            self._arm()

        def data_received(self, data: bytes) -> None:
            if not self._refused:  # a refused connection's request is read and dropped
                super().data_received(data)

        def eof_received(self) -> None:
            if self._refused:
                self.transport.close()

        def _arm(self) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(idle_timeout, self._head_timeout)

        def _head_timeout(self) -> None:
            self._head_timer = None
            if self.conn.their_state is h11.IDLE and not self.transport.is_closing():  # no request under way
                stats.timed_out += 1
                self.transport.close()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request's head has idle_timeout seconds too

        def connection_lost(self, exc) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            super().connection_lost(exc)

    return Protocol


def server(config, abort: Callable[[], None], grace: float) -> Any:
    """A uvicorn.Server whose shutdown lets answers in flight run ``grace`` seconds, then calls ``abort`` (every
    answer gets an error event and its stream ends with ``data: [DONE]``) and waits for the streams to end,
    instead of cancelling them mid-stream."""
    import asyncio

    import uvicorn

    class Server(uvicorn.Server):
        async def shutdown(self, sockets=None) -> None:
            async def end_streams() -> None:
                await asyncio.sleep(grace)
                abort()

            t = asyncio.ensure_future(end_streams())
            try:
                await super().shutdown(sockets)
            finally:
                t.cancel()
                abort()

    config.timeout_graceful_shutdown = grace + 5  # after abort(): time for the streams to write their end
    return Server(config)
