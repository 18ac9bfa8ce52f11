"""`pyspecter serve`: an OpenAI-compatible HTTP server over one Session, by role, down the data path:

- ``app``: HTTP (FastAPI + uvicorn + sse-starlette, the optional ``server`` extra, imported only when a server is
  made): routes, the access log, connection limits and timeouts, streams;
- ``worker``: the one thread that owns the session and generates one answer at a time from a bounded queue;
- ``wire``: the OpenAI wire format (request validation, stop sequences, response objects), no web framework.

``pyspecter.api`` is the Python API; this package is only the server.
"""

from pyspecter.server.app import bind, require_deps, serve

__all__ = ["bind", "require_deps", "serve"]
