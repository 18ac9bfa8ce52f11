"""The HTTP app of `pyspecter serve`: routes over one Session (FastAPI + uvicorn + sse-starlette, the optional
``server`` extra, imported only when a server is made).

Batch size 1: llama.cpp's context here holds one sequence, so one worker thread generates one answer at a time
(``worker.Worker``); requests wait in a bounded queue in front of it, and a request that finds it full is refused
with 429 and a Retry-After header. Every request carries its own sampling settings. A client that goes away
cancels its answer: the connection's loss (seen by ``http``'s protocol, not polled) stops a generating answer at
its next token and takes a waiting one out of the queue at once, as llama-server does. Wire format and
validation: ``wire``; connection limits, timeouts and the access log: ``http``.
"""

# no `from __future__ import annotations` here: FastAPI reads the handlers' annotations (``request: Request``,
# imported inside create_app) at definition time
import asyncio
import contextlib
import hmac
import json
import socket
import sys
from dataclasses import replace

import pyspecter.server.http as http
import pyspecter.server.wire as oa
from pyspecter.errors import SpecterError
from pyspecter.server.wire import ApiError
from pyspecter.server.worker import Job, Worker, metrics, prometheus
from pyspecter.session import Session

MAX_BODY = 8 * 2**20
CLIENT_CLOSED = 499  # nginx's "client closed request": logged and counted for answers nobody was left to read
_DEPS = ("fastapi", "uvicorn", "sse_starlette")


def require_deps() -> None:
    """A clear one-line error (exit 2 through the CLI) when the ``server`` extra is not installed."""
    import importlib.util

    missing = [m for m in _DEPS if importlib.util.find_spec(m) is None]
    if missing:
        raise SpecterError(f"`pyspecter serve` needs the server extra ({', '.join(missing)} missing): "
                           f"pip install 'pyspecter[server]'")


# --- HTTP -----------------------------------------------------------------------------------------------------------

def client_gone(scope: dict) -> None:
    """The connection of the request ``scope`` was lost before its response ended (http's protocol calls this):
    its answer, if it has one, is abandoned now; one not yet submitted is abandoned as it is (``start``)."""
    state = scope.setdefault("state", {})
    state[http.GONE_KEY] = True
    job = state.get(http.JOB_KEY)
    if job is not None:
        job.abandon()


def health(w: Worker, model_id: str) -> tuple[int, dict]:
    """/health's status and body: cheap, no lock, so it answers while an answer generates and the queue is full
    (also used by ``http`` for a connection over the cap)."""
    if not w.alive:
        return 503, {"status": "error", "message": "the generation thread stopped"}
    return 200, {"status": "ok", "model": model_id, "busy": w.busy, "queue_depth": w.queue_depth}


class _Auth:
    """ASGI middleware: every route but /health needs ``Authorization: Bearer KEY`` when a key is set."""

    def __init__(self, app, key: str) -> None:
        self.app, self.key = app, key.encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"] != "/health":
            got = dict(scope["headers"]).get(b"authorization", b"")
            scheme, _, token = got.partition(b" ")
            if scheme.lower() != b"bearer" or not hmac.compare_digest(token.strip(), self.key):
                from starlette.responses import JSONResponse

                body = oa.error_body("Incorrect or missing API key: send 'Authorization: Bearer KEY'",
                                     code="invalid_api_key")
                await JSONResponse(body, 401, headers={"WWW-Authenticate": "Bearer"})(scope, receive, send)
                return
        await self.app(scope, receive, send)


def create_app(w: Worker, model_id: str, aliases: set[str], api_key: str | None = None,
               stats: http.HttpStats | None = None):
    from fastapi import FastAPI, Request
    from fastapi.exceptions import RequestValidationError
    from fastapi.responses import JSONResponse, PlainTextResponse
    from sse_starlette.sse import EventSourceResponse
    from starlette.background import BackgroundTask
    from starlette.exceptions import HTTPException
    from starlette.requests import ClientDisconnect

    from pyspecter.prompts import render_prompt

    s = w.s
    stats = stats or http.HttpStats()
    app = FastAPI(title="pyspecter", docs_url=None, redoc_url=None, openapi_url=None)

    @app.exception_handler(ApiError)
    async def _api_error(_req, e: ApiError):
        return JSONResponse(e.body(), e.status, headers=e.headers)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_req, e: RequestValidationError):
        return JSONResponse(oa.error_body(f"invalid request: {e.errors()}"), 400)

    @app.exception_handler(HTTPException)
    async def _http_error(_req, e: HTTPException):
        return JSONResponse(oa.error_body(str(e.detail), code="not_found" if e.status_code == 404 else None),
                            e.status_code, headers=getattr(e, "headers", None))

    @app.exception_handler(ClientDisconnect)
    async def _gone(_req, _e: ClientDisconnect):  # left while sending its body: nobody reads this, the log does
        return JSONResponse(oa.error_body("client closed the connection", code="client_closed_request"),
                            CLIENT_CLOSED)

    @app.exception_handler(Exception)
    async def _internal(_req, e: Exception):
        return JSONResponse(oa.error_body(f"internal error: {e!r}", "server_error"), 500)

    async def read_json(request: Request):
        body = bytearray()
        async for chunk in request.stream():
            body += chunk
            if len(body) > MAX_BODY:
                raise ApiError(413, f"request body over {MAX_BODY // 2**20} MiB", code="request_too_large")
        return await asyncio.to_thread(oa.decode_json, bytes(body))  # up to 8 MiB: off the event loop

    def prompt_tokens(req: oa.GenRequest) -> list[int]:
        try:
            if req.messages is not None:  # the model's own chat template (ChatML if it has none llama.cpp knows)
                return s.tokenize(render_prompt(s.target, req.messages), add_special=False)
            if isinstance(req.prompt, str):
                return s.tokenize(req.prompt)  # as `pyspecter generate -p`
        except UnicodeEncodeError as e:  # decode_json refuses lone surrogates; this is the last line
            raise ApiError(400, f"the text cannot be encoded as UTF-8: {e.reason} at character {e.start}",
                           code="invalid_value", param="messages" if req.messages is not None else "prompt") from None
        bad = [t for t in req.prompt if not 0 <= t < s.target.n_vocab]
        if bad:
            raise ApiError(400, f"'prompt': token id {bad[0]} is not in the vocabulary (0..{s.target.n_vocab - 1})",
                           code="invalid_value", param="prompt")
        return req.prompt

    async def start(request: Request, chat: bool) -> tuple[Job, asyncio.Queue, oa.GenRequest]:
        body = await read_json(request)
        req = oa.parse_chat(body) if chat else oa.parse_completion(body)
        if req.model is not None and req.model not in aliases:
            raise ApiError(404, f"The model `{req.model}` does not exist: this server serves `{model_id}`",
                           code="model_not_found", param="model")
        try:
            replace(w.base, **req.sampling()).check()
        except SpecterError as e:
            raise ApiError(400, str(e), code="invalid_value") from None
        prompt = await asyncio.to_thread(prompt_tokens, req)
        n_ctx, where = s.cfg.n_ctx, "messages" if chat else "prompt"
        if not prompt:
            raise ApiError(400, "empty prompt: nothing to continue from (this model adds no BOS token)",
                           code="invalid_value", param="prompt")
        if req.max_tokens is None:  # chat: as much as the context leaves
            if len(prompt) >= n_ctx:
                raise oa.context_error(n_ctx, len(prompt), None, where)
            n = n_ctx - len(prompt)
        elif len(prompt) + req.max_tokens > n_ctx:
            raise oa.context_error(n_ctx, len(prompt), req.max_tokens, where)
        else:
            n = req.max_tokens
        loop = asyncio.get_running_loop()
        q: asyncio.Queue = asyncio.Queue()

        def emit(ev: tuple) -> None:
            with contextlib.suppress(RuntimeError):  # the loop is gone (shutdown)
                loop.call_soon_threadsafe(q.put_nowait, ev)

        job = Job(prompt, n, req, emit=emit)
        w.submit(job)
        state = request.scope.setdefault("state", {})
        state[http.JOB_KEY] = job
        if state.get(http.GONE_KEY):  # the client left while its prompt was read and tokenized
            job.abandon()
        return job, q, req

    async def collect(job: Job, q: asyncio.Queue) -> tuple | None:
        """The whole answer, or None if the client went away (``client_gone`` has abandoned it)."""
        parts: list[str] = []
        try:
            while True:
                ev = await q.get()
                if ev[0] == "text":
                    parts.append(ev[1])
                elif ev[0] == "done":
                    return "".join(parts), *ev[1:]
                elif ev[0] == "cancelled":
                    return None
                else:
                    raise ApiError(ev[2], ev[1], type="server_error",
                                   code="server_shutting_down" if ev[2] == 503 else "generation_failed")
        finally:
            job.abandon()  # nothing if it finished; stops it if this handler was cancelled

    def stream(job: Job, q: asyncio.Queue, req: oa.GenRequest, chat: bool):
        # the background task covers a stream whose generator never started (the client left first)
        return EventSourceResponse(stream_events(job, q, req, chat, model_id), ping=15, sep="\n",
                                   background=BackgroundTask(job.abandon))

    async def complete(request: Request, chat: bool):
        job, q, req = await start(request, chat)
        if req.stream:
            return stream(job, q, req, chat)
        r = await collect(job, q)
        if r is None:  # sent to nobody: the status is for the access log and /metrics
            return JSONResponse(oa.error_body("client closed the connection", code="client_closed_request"),
                                CLIENT_CLOSED)
        text, finish, n_prompt, n_completion = r
        make = oa.chat_response if chat else oa.completion_response
        return make(oa.new_id("chatcmpl" if chat else "cmpl"), model_id, text, finish, n_prompt, n_completion)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await complete(request, chat=True)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await complete(request, chat=False)

    def model_card() -> dict:
        return {"id": model_id, "object": "model", "created": int(s.cfg.model.stat().st_mtime),
                "owned_by": "pyspecter", "n_ctx": s.cfg.n_ctx, "tier": s.tier.name,
                "n_expert": s.layout.n_expert, **{k: w.stats[k] for k in (
                    "slots_per_layer", "slots_min", "slots_mean", "slots_max", "slots_text") if k in w.stats}}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card()]}

    @app.get("/v1/models/{name:path}")
    async def model(name: str):
        if name not in aliases:
            raise ApiError(404, f"The model `{name}` does not exist: this server serves `{model_id}`",
                           code="model_not_found", param="model")
        return model_card()

    @app.get("/health")
    async def get_health():
        status, body = health(w, model_id)
        return JSONResponse(body, status)

    @app.get("/metrics")
    async def get_metrics(request: Request):
        m = metrics(w) | stats.figures()
        if request.query_params.get("format") == "json" or "application/json" in request.headers.get("accept", ""):
            return m
        return PlainTextResponse(prometheus(m), media_type="text/plain; version=0.0.4")

    return http.AccessLog(_Auth(app, api_key) if api_key else app, stats)


async def stream_events(job: Job, q: asyncio.Queue, req: oa.GenRequest, chat: bool, model_id: str):
    """The data of a streamed answer's events, from the job's events: chunks as the text grows, then the finish
    reason (and the usage when asked) and ``[DONE]``. A failed answer, or one cut by shutdown, ends with an error
    event and ``[DONE]`` too: a stream never just stops."""
    rid = oa.new_id("chatcmpl" if chat else "cmpl")
    obj = "chat.completion.chunk" if chat else "text_completion"

    def chunk(text: str | None, finish: str | None = None) -> str:
        if chat:
            return json.dumps(oa.chat_chunk(rid, model_id, {} if text is None else {"content": text}, finish))
        return json.dumps(oa.completion_chunk(rid, model_id, text or "", finish))

    try:
        if chat:
            yield json.dumps(oa.chat_chunk(rid, model_id, {"role": "assistant", "content": ""}))
        while True:
            ev = await q.get()
            if ev[0] == "text":
                yield chunk(ev[1])
            elif ev[0] == "done":
                yield chunk(None, ev[1])
                if req.include_usage:
                    yield json.dumps(oa.usage_chunk(rid, model_id, obj, ev[2], ev[3]))
                yield "[DONE]"
                return
            elif ev[0] == "cancelled":  # the client is gone: nothing more to send, nobody to read it
                return
            else:
                code = "server_shutting_down" if ev[2] == 503 else "generation_failed"
                yield json.dumps(oa.error_body(ev[1], "server_error", code))
                yield "[DONE]"
                return
    finally:
        job.abandon()  # a stream that ends early (the client left, sse-starlette cancelled it) frees its place


def bind(host: str, port: int) -> socket.socket:
    """The listening socket, made before the model loads: a port in use is a one-line error, not a wasted load."""
    try:
        family, kind, proto, _, addr = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM,
                                                          flags=socket.AI_PASSIVE)[0]
        sock = socket.socket(family, kind, proto)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(addr)
    except OSError as e:
        raise SpecterError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    sock.set_inheritable(True)
    return sock


def is_loopback(host: str) -> bool:
    import ipaddress

    try:
        return all(ipaddress.ip_address(info[4][0]).is_loopback for info in socket.getaddrinfo(host, None))
    except (OSError, ValueError):
        return False


GRACE_S = 3  # on SIGINT/SIGTERM, answers in flight may finish for this long


def serve(session: Session, sock: socket.socket, *, model_id: str, aliases: set[str], api_key: str | None,
          queue_size: int, max_connections: int = 64, idle_timeout: float = 5.0) -> None:
    """Serve until SIGINT/SIGTERM (graceful: answers in flight get GRACE_S, then every stream still open ends
    with an error event and ``data: [DONE]``), then free the session."""
    import signal

    import uvicorn
    from sse_starlette.sse import AppStatus

    AppStatus.disable_automatic_graceful_drain()  # its drain cuts streams mid-answer; http.server ends them
    w = Worker(session, queue_size)
    try:
        stats = http.HttpStats()
        app = create_app(w, model_id, aliases | {model_id}, api_key, stats)
        config = uvicorn.Config(app, log_level="warning", access_log=False, lifespan="off",
                                http=http.protocol(max_connections, idle_timeout, stats,
                                                   health=lambda: health(w, model_id), client_gone=client_gone),
                                timeout_keep_alive=max(1, round(idle_timeout)))
        host, port = sock.getsockname()[:2]
        where = f"http://{f'[{host}]' if ':' in host else host}:{port}"
        print(f"pyspecter serve: {model_id} at {where}/v1 (OpenAI-compatible; /health, /metrics), "
              f"{session.stats()['slots_text']}, tier {session.tier.name}, "
              f"context {session.cfg.n_ctx}, queue {queue_size}, at most {max_connections} connections, idle "
              f"ones closed after {idle_timeout:g} s" + (", API key required" if api_key else ""),
              file=sys.stderr, flush=True)
        if not is_loopback(host) and not api_key:
            print(f"pyspecter serve: WARNING: listening on {host} without --api-key: anyone who can reach this "
                  f"port can use the model (and there is no TLS)", file=sys.stderr, flush=True)
        # uvicorn re-raises the signal that stopped it once it is done; a no-op handler lets us free the model
        # and exit 0 instead of dying mid-cleanup (SIGTERM) or printing a traceback (SIGINT)
        old = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            http.server(config, w.abort, GRACE_S).run(sockets=[sock])
        finally:
            for sig, h in old.items():
                signal.signal(sig, h)
    finally:
        w.close()
        sock.close()
