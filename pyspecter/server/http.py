"""The server's connection-level rules, below the routes: an access log line for every response (the app's and
the ones this level writes itself), responses counted by status, a cap on open connections that closes the
oldest idle one before it refuses anyone, an idle timeout that closes connections that send no request, the
loss of a client's connection reported to the app at once, and a shutdown that ends every stream with an error
event instead of cutting it.

uvicorn (the ``server`` extra) is imported inside the functions that need it, so this imports without it.
"""

from __future__ import annotations

import json
import sys
import time
from collections import Counter
from collections.abc import Callable
from typing import Any

JOB_KEY = "pyspecter_job"  # the request's Job, in the ASGI scope's state: put by the app, read by the log
GONE_KEY = "pyspecter_gone"  # set in the scope's state when the client's connection is lost mid-request


class HttpStats:
    """Responses by status, and what happened to connections (read by /metrics). ``record`` is the access log:
    every response goes through it, so the log and the counts cannot disagree."""

    def __init__(self, out=None) -> None:
        self.by_status: Counter[int] = Counter()
        self.refused = 0  # over --max-connections with none idle to close: answered 503 at the protocol level
        self.evicted = 0  # idle connections closed to make room for a new one (oldest first)
        self.timed_out = 0  # no complete request within --idle-timeout
        self.open: Callable[[], int] = lambda: 0
        self.out = out  # the access log's stream (stderr when None)

    def record(self, client: tuple | None, method: str, raw_path: bytes, status: int, ms: float,
               extra: str = "") -> None:
        """One response: counted by status and logged as `client method path status[ extra] ms`."""
        self.by_status[status] += 1
        who = f"{client[0]}:{client[1]}" if client else "-"
        print(f"pyspecter serve: {who} {method} {_printable(raw_path)} {status}{extra} {ms:.0f} ms",
              file=self.out or sys.stderr, flush=True)

    def figures(self) -> dict:
        return {"client_errors": {str(k): v for k, v in sorted(self.by_status.items()) if 400 <= k < 500},
                "server_errors": {str(k): v for k, v in sorted(self.by_status.items()) if k >= 500},
                "connections": {"open": self.open(), "refused": self.refused, "evicted": self.evicted,
                                "timed_out": self.timed_out}}


def _printable(raw: bytes, limit: int = 200) -> str:
    """A request path as it came (still %-escaped, so no newline can forge a log line), control bytes escaped."""
    s = raw[:limit].decode("latin-1")
    s = "".join(c if " " < c < "\x7f" else f"\\x{ord(c):02x}" for c in s)
    return s + ("..." if len(raw) > limit else "")


class AccessLog:
    """ASGI middleware, outermost: one line per request when its response ends (for a stream, when the stream
    ends): client, method, path, status, tokens in and out (" cancelled" when its client left first),
    milliseconds. Counts every status."""

    def __init__(self, app, stats: HttpStats) -> None:
        self.app, self.stats = app, stats

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
            job = state.get(JOB_KEY)
            extra = "" if job is None else \
                f" tokens {len(job.prompt)}+{job.n_out}" + (" cancelled" if job.outcome == "cancelled" else "")
            raw = scope.get("raw_path") or scope["path"].encode("utf-8", "backslashreplace")
            self.stats.record(scope.get("client"), scope["method"], raw, status,
                              (time.perf_counter() - t0) * 1e3, extra)


_HEAD_LIMIT = 16 << 10  # bytes of a refused connection's request head read to see whether it asks for /health
_REFUSED_WAIT = 1.0  # seconds a refused connection has to send its request head, then to read the answer


def _response(status: int, reason: bytes, body: bytes, extra: bytes = b"") -> bytes:
    return (b"HTTP/1.1 %d %s\r\ncontent-type: application/json\r\nconnection: close\r\n%scontent-length: %d"
            b"\r\n\r\n%s" % (status, reason, extra, len(body), body))


def protocol(max_connections: int, idle_timeout: float, stats: HttpStats,
             health: Callable[[], tuple[int, dict]] = lambda: (200, {"status": "ok"}),
             client_gone: Callable[[dict], None] = lambda scope: None) -> type:
    """uvicorn's h11 protocol with rules of ours:
    - a connection over ``max_connections`` closes the oldest idle connection (no request under way, oldest by
      when it opened or last answered): a client that holds sockets it does not use cannot lock others out;
    - only when every connection has a request under way is a new one refused: it gets a 503 (logged and
      counted), except a ``GET /health``, which is answered (``health()``) so a monitor always gets its answer;
    - a connection that has not sent a whole request head within ``idle_timeout`` seconds of opening, or of its
      last response, is closed: idle and half-sent connections no longer hold a descriptor forever (uvicorn's own
      keep-alive timer starts only after a first response, and any byte restarts it);
    - a connection lost mid-request calls ``client_gone(scope)`` at once, so the app cancels that request's
      answer within a token rather than when it next tries to write or polls;
    - uvicorn's own 400 for a malformed request is logged and counted like any other response."""
    import h11
    from uvicorn.protocols.http.h11_impl import H11Protocol

    from pyspecter.server.wire import error_body

    full_body = json.dumps(error_body(f"too many connections (at most {max_connections}), each with a request "
                                      "under way; retry", "server_error", "too_many_connections")).encode()

    class Protocol(H11Protocol):
        _head_timer: Any = None
        _refused = False  # over the cap with none idle: read the head, answer, close
        _answered = False
        _head: bytes = b""
        _idle_since = 0.0  # time.monotonic() when it opened or last answered

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            stats.open = lambda: len(self.connections)
            self._idle_since = self._t_open = time.monotonic()
            live = [c for c in self.connections if c is not self and c._counts()]
            if len(live) >= max_connections and not self._evict(live):
                self._refused = True
                self._head_timer = self.loop.call_later(_REFUSED_WAIT, self._answer_refused)
                return
            self._arm()

        def _counts(self) -> bool:
            """Whether it holds a place under the cap: refused and closing connections do not."""
            return not self._refused and not self.transport.is_closing()

        def _idle(self) -> bool:
            return self.conn.our_state is h11.IDLE and self.conn.their_state is h11.IDLE and self._counts()

        def _evict(self, live: list) -> bool:
            idle = [c for c in live if c._idle()]
            if not idle:
                return False
            oldest = min(idle, key=lambda c: c._idle_since)
            stats.evicted += 1
            oldest.transport.close()  # between requests: HTTP lets a server close a keep-alive connection
            return True

        def _answer_refused(self) -> None:
            """The refused connection's answer, once its head is in (or after _REFUSED_WAIT without one)."""
            if self._answered or self.transport.is_closing():
                return
            self._answered = True
            line = self._head.split(b"\r\n", 1)[0].split(b" ")
            method = line[0].decode("latin-1") if len(line) == 3 else "-"
            target = line[1] if len(line) == 3 else b"-"
            if method == "GET" and target.split(b"?", 1)[0] == b"/health":
                status, body = health()
                out = _response(status, b"OK" if status == 200 else b"Service Unavailable",
                                json.dumps(body).encode())
            else:
                status, out = 503, _response(503, b"Service Unavailable", full_body, b"retry-after: 1\r\n")
                stats.refused += 1
            self.transport.write(out)
            # closed once the client has read it: a close with its request still unread would reset the
            # connection and lose the answer
            if self.transport.can_write_eof():
                self.transport.write_eof()
            if self._head_timer is not None:
                self._head_timer.cancel()
            self._head_timer = self.loop.call_later(_REFUSED_WAIT, self.transport.close)
            stats.record(self.client, method, target, status, (time.monotonic() - self._t_open) * 1e3)

        def data_received(self, data: bytes) -> None:
            if self._refused:  # its head is read for the answer; anything after it is dropped
                if not self._answered:
                    self._head += data[:_HEAD_LIMIT - len(self._head)]
                    if b"\r\n\r\n" in self._head or len(self._head) >= _HEAD_LIMIT:
                        self._answer_refused()
                return
            super().data_received(data)

        def eof_received(self) -> None:
            if self._refused:
                self._answer_refused()  # a client that sent its request and shut its side still gets the answer
                self.transport.close()

        def send_400_response(self, msg: str) -> None:
            if self.cycle is None or self.cycle.response_complete:  # else the app's response is logged
                stats.record(self.client, "-", b"-", 400, (time.monotonic() - self._idle_since) * 1e3,
                             " malformed request")
            super().send_400_response(msg)

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
            self._idle_since = time.monotonic()
            if not self.transport.is_closing():
                self._arm()  # the next request's head has idle_timeout seconds too

        def connection_lost(self, exc) -> None:
            if self._head_timer is not None:
                self._head_timer.cancel()
                self._head_timer = None
            if self.cycle is not None and not self.cycle.response_complete:
                client_gone(self.scope)  # before uvicorn wakes the app: the answer stops first
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
