"""serve (the OpenAI-compatible HTTP API) and rpc-server (this machine's CPU as a ggml RPC device)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from pyspecter.cli.app import app
from pyspecter.cli.options import (
    DEFAULT_MODEL,
    DEFAULT_THREADS,
    AutoTierOpt,
    BudgetOpt,
    DeviceOpt,
    DraftOpt,
    ForceOpt,
    LayerPlanOpt,
    MissOpt,
    ModelArg,
    ThreadsOpt,
    native_errors_exit,
)
from pyspecter.errors import SpecterError
from pyspecter.models.catalog import is_builtin, resolve_model


@app.command()
def serve(
    model: ModelArg = DEFAULT_MODEL,
    host: Annotated[str, typer.Option(help="address to listen on; anything but localhost exposes the model to "
                                           "the network (no TLS; unauthenticated unless --api-key)")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 8080,
    draft: DraftOpt = None,
    budget: BudgetOpt = None,
    tier: AutoTierOpt = None,
    device: DeviceOpt = None,
    layer_plan: LayerPlanOpt = None,
    miss: MissOpt = None,
    api_key: Annotated[str | None, typer.Option("--api-key", envvar="PYSPECTER_API_KEY",
                                                help="require 'Authorization: Bearer KEY' on every route but "
                                                     "/health (or set PYSPECTER_API_KEY)")] = None,
    queue: Annotated[int, typer.Option(help="requests that may wait for the one generating; more get 429")] = 8,
    max_connections: Annotated[int, typer.Option(help="open connections at most; one more closes the oldest "
                                                      "idle one, or gets 503 if none is idle (/health is always "
                                                      "answered)")] = 64,
    idle_timeout: Annotated[float, typer.Option(help="seconds a connection may stay open without sending a whole "
                                                     "request (after it opens or after its last answer)")] = 5.0,
    ctx_size: Annotated[int, typer.Option("--ctx-size", "-c", help="context length in tokens (prompt + answer; "
                                                                  "longer requests are refused with 400)")] = 2048,
    threads: ThreadsOpt = DEFAULT_THREADS,
    force: ForceOpt = False,
) -> None:
    """Serve a model over an OpenAI-compatible HTTP API: /v1/chat/completions (streamed or not), /v1/completions,
    /v1/models, /health, /metrics. One answer at a time (batch size 1), the others wait in a bounded queue.
    Needs the optional 'server' extra (FastAPI, uvicorn, sse-starlette)."""
    from pyspecter.cli.run import open_session
    from pyspecter.server import bind, require_deps
    from pyspecter.server import serve as run_server

    require_deps()
    if not 0 < port < 65536:
        raise SpecterError(f"--port must be in 1..65535, got {port}")
    if queue < 0:
        raise SpecterError(f"--queue must be >= 0, got {queue}")
    if max_connections < 1:
        raise SpecterError(f"--max-connections must be >= 1, got {max_connections}")
    if not 0 < idle_timeout <= 3600:
        raise SpecterError(f"--idle-timeout must be in (0, 3600] seconds, got {idle_timeout:g}")
    if api_key is not None and not api_key.strip():
        raise SpecterError("--api-key must not be empty")
    sock = bind(host, port)  # before the model loads: a port in use costs no load
    try:
        s = open_session(model, draft=draft, budget=budget, tier=tier, device=device, layer_plan=layer_plan,
                         miss=miss, n_threads=threads, n_ctx=ctx_size, force=force)
    except BaseException:
        sock.close()
        raise
    path = resolve_model(model)
    model_id = model if is_builtin(model) else path.name
    try:
        run_server(s, sock, model_id=model_id, aliases={model, path.name, path.stem, str(path)},
                   api_key=api_key.strip() if api_key else None, queue_size=queue, max_connections=max_connections,
                   idle_timeout=idle_timeout)
    finally:
        s.close()




@app.command("rpc-server")
def rpc_server(
    host: Annotated[str, typer.Option(help="address to listen on; the server has NO authentication: anyone who "
                                           "reaches the port can run code on this machine's memory, so keep "
                                           "127.0.0.1 unless the network is yours alone")] = "127.0.0.1",
    port: Annotated[int, typer.Option(help="TCP port")] = 50052,
    threads: ThreadsOpt = DEFAULT_THREADS,
    strict: Annotated[bool, typer.Option("--strict", help="hold clients to a GPU's contract: abort on an expert id "
                                         "outside the weights or repeated in a token, which a GPU kernel would "
                                         "not survive (for tests of the device path)")] = False,
) -> None:
    """Serve this machine's CPU as a ggml RPC device (llama.cpp's rpc-server, in-process), for --device
    rpc:HOST:PORT. It serves one client at a time and runs until stopped (Ctrl-C)."""
    import socket

    from pyspecter.native.devices import serve_rpc

    if not 0 < port < 65536:
        raise SpecterError(f"--port {port}: out of range")
    with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as probe:  # a clear error, not ggml's
        try:
            probe.bind((host, port))
        except OSError as e:
            raise SpecterError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None
    if host not in ("127.0.0.1", "localhost", "::1"):
        print(f"pyspecter: warning: listening on {host}: the RPC server has no authentication", file=sys.stderr)
    native_errors_exit()
    serve_rpc(host, port, threads, strict)


