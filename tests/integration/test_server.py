"""`pyspecter serve` as users run it: a real server process on a free localhost port, driven with the official
`openai` client (streamed and not) and with raw HTTP for what a client library would not send."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import socket
import statistics
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import openai
import pytest
from conftest import run_cli
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

pytestmark = pytest.mark.slow

SMOL_ARGS = ("smol-moe", "--budget", "50%", "-c", "1024")  # RAM tier, 8 of 16 slots: misses on the CPU
TINY_ARGS = ("tiny-qwen3moe", "--budget", "50%", "-c", "256")


@dataclass
class Reply:
    status_code: int
    headers: dict[str, str]
    text: str

    def json(self):
        return json.loads(self.text)


def http(method: str, url: str, body: str | bytes | None = None, headers: dict | None = None,
         timeout: float = 60) -> Reply:
    """Raw HTTP (stdlib): what a client library would not send, and the status of what it gets back."""
    data = body.encode() if isinstance(body, str) else body
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json",
                                                                        **(headers or {})})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return Reply(r.status, dict(r.headers), r.read().decode())
    except urllib.error.HTTPError as e:
        return Reply(e.code, dict(e.headers), e.read().decode())


@dataclass
class Server:
    url: str
    proc: subprocess.Popen
    log: Path

    def client(self, key: str = "none", **kw) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0, timeout=120, **kw)

    def metrics(self) -> dict:
        return http("GET", self.url + "/metrics?format=json").json()

    def get(self, path: str, **kw) -> Reply:
        return http("GET", self.url + path, **kw)

    def post(self, path: str, body, **kw) -> Reply:
        return http("POST", self.url + path, body if isinstance(body, str | bytes) else json.dumps(body), **kw)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(tmp: Path, *args: str) -> Iterator[Server]:
    """Start `python -m pyspecter serve ARGS` and wait for /health; always stopped (SIGTERM, then SIGKILL)."""
    port = _free_port()
    log = tmp / f"serve-{port}.log"
    with open(log, "w") as out:
        proc = subprocess.Popen([sys.executable, "-m", "pyspecter", "serve", *args, "--port", str(port)],
                                stdout=out, stderr=subprocess.STDOUT)
    srv = Server(f"http://127.0.0.1:{port}", proc, log)
    try:
        deadline = time.monotonic() + 900  # a cold cache builds smol-moe first
        while True:
            if proc.poll() is not None:
                raise AssertionError(f"server exited with {proc.returncode}:\n{log.read_text()}")
            with contextlib.suppress(OSError):
                if srv.get("/health", timeout=2).status_code == 200:
                    break
            assert time.monotonic() < deadline, "server did not come up:\n" + log.read_text()
            time.sleep(0.25)
        yield srv
    finally:
        if proc.poll() is None:
            proc.send_signal(signal.SIGTERM)
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(tmp_path_factory.mktemp("tiny"), *TINY_ARGS) as srv:
        yield srv


@pytest.fixture(scope="module")
def smol(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(tmp_path_factory.mktemp("smol"), *SMOL_ARGS, "--queue", "8") as srv:
        yield srv


def _chat_stream(client: openai.OpenAI, model: str, messages: list[dict], **kw) -> tuple[str, str, float]:
    """Streamed chat answer: (text, finish reason, seconds to the first content)."""
    t0 = time.perf_counter()
    ttft, parts, finish = None, [], None
    for chunk in client.chat.completions.create(model=model, messages=messages, stream=True, **kw):
        if not chunk.choices:
            continue
        c = chunk.choices[0]
        if c.delta.content:
            ttft = ttft or time.perf_counter() - t0
            parts.append(c.delta.content)
        finish = c.finish_reason or finish
    return "".join(parts), finish, ttft if ttft is not None else time.perf_counter() - t0


# --- the openai client, streamed and not ---------------------------------------------------------------------------

def test_tiny_openai_client(tiny: Server) -> None:
    client = tiny.client()
    assert [m.id for m in client.models.list().data] == ["tiny-qwen3moe"]
    msgs = [{"role": "user", "content": "hello there"}]
    r = client.chat.completions.create(model="tiny-qwen3moe", messages=msgs, max_tokens=10)
    assert r.object == "chat.completion" and r.choices[0].message.role == "assistant"
    assert r.usage.completion_tokens == 10 and r.choices[0].finish_reason == "length"
    text, finish, _ = _chat_stream(client, "tiny-qwen3moe", msgs, max_tokens=10)
    assert (text, finish) == (r.choices[0].message.content, "length")  # greedy: streamed = whole
    c = client.completions.create(model="tiny-qwen3moe", prompt="abc", max_tokens=6)
    parts = [ch.choices[0].text for ch in client.completions.create(model="tiny-qwen3moe", prompt="abc",
                                                                      max_tokens=6, stream=True) if ch.choices]
    assert "".join(parts) == c.choices[0].text and c.usage.completion_tokens == 6
    # stream_options.include_usage: the last chunk carries the usage
    last = list(client.chat.completions.create(model="tiny-qwen3moe", messages=msgs, max_tokens=3, stream=True,
                                               stream_options={"include_usage": True}))[-1]
    assert last.usage.completion_tokens == 3 and last.usage.prompt_tokens == r.usage.prompt_tokens


def test_tiny_sampling_is_per_request(tiny: Server) -> None:
    client = tiny.client()
    kw = dict(model="tiny-qwen3moe", prompt="sample", max_tokens=12, temperature=1.0, top_p=0.95)
    a, b = (client.completions.create(seed=7, **kw).choices[0].text for _ in range(2))
    assert a == b  # same seed, same sample
    assert len({client.completions.create(seed=s, **kw).choices[0].text for s in range(4)}) > 1
    greedy = client.completions.create(model="tiny-qwen3moe", prompt="sample", max_tokens=12)
    assert greedy.choices[0].text == client.completions.create(model="tiny-qwen3moe", prompt="sample",
                                                               max_tokens=12, temperature=0).choices[0].text


def _greedy_equals_generate(srv: Server, args: tuple[str, ...], model: str, prompt: str, n: int) -> dict:
    """The server's greedy answer is the command line's, token for token; returns generate's JSON."""
    g = run_cli("generate", *args, "-p", prompt, "-n", str(n), "--json", "--raw")  # completions continue text
    assert g.returncode == 0, g.stderr
    ref = json.loads(g.stdout)
    r = srv.client().completions.create(model=model, prompt=prompt, max_tokens=n)
    assert r.choices[0].text == ref["text"] and r.usage.completion_tokens == len(ref["tokens"])
    return ref


def test_tiny_greedy_equals_generate(tiny: Server) -> None:
    _greedy_equals_generate(tiny, TINY_ARGS, "tiny-qwen3moe", "compare me with the command line", 12)


def test_smol_chat_uses_the_model_template(smol: Server) -> None:
    client = smol.client()
    msgs = [{"role": "user", "content": "What is the capital of Japan?"}]
    r = client.chat.completions.create(model="smol-moe", messages=msgs, max_tokens=32)
    assert r.choices[0].message.content.strip() == "The capital of Japan is Tokyo."  # as the dense model answers
    assert r.choices[0].finish_reason == "stop"  # the template's end-of-turn token ended it
    text, finish, _ = _chat_stream(client, "smol-moe", msgs, max_tokens=32)
    assert (text, finish) == (r.choices[0].message.content, "stop")
    # a stop sequence ends the answer before it, in both modes
    r = client.chat.completions.create(model="smol-moe", messages=msgs, max_tokens=32, stop=["Tokyo"])
    assert r.choices[0].message.content.strip() == "The capital of Japan is" and r.choices[0].finish_reason == "stop"
    text, finish, _ = _chat_stream(client, "smol-moe", msgs, max_tokens=32, stop=["of Japan"])
    assert text.strip() == "The capital" and finish == "stop"


def test_smol_greedy_equals_generate(smol: Server) -> None:
    prompt = "The three primary colors are"
    ref = _greedy_equals_generate(smol, SMOL_ARGS, "smol-moe", prompt, 24)
    parts = [c.choices[0].text for c in smol.client().completions.create(model="smol-moe", prompt=prompt,
                                                                         max_tokens=24, stream=True) if c.choices]
    assert "".join(parts) == ref["text"]


def test_with_a_draft(tmp_path: Path) -> None:
    """Speculative decoding behind the server: greedy answers equal plain decoding's, and a request's own
    sampler reaches the decoder (same seed, same sample)."""
    import ctypes

    import llama_cpp

    from pyspecter import native
    from pyspecter.models.tiny import build_tiny

    native.quiet_logs()
    draft = tmp_path / "tiny-mixtral-q4_0.gguf"
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = llama_cpp.LLAMA_FTYPE_MOSTLY_Q4_0
    params.allow_requantize = True
    assert llama_cpp.llama_model_quantize(str(build_tiny("tiny-mixtral")).encode(), str(draft).encode(),
                                          ctypes.byref(params)) == 0
    g = run_cli("generate", "tiny-mixtral", "-p", "speculate on this", "-n", "16", "--json", "--raw")
    assert g.returncode == 0, g.stderr
    with serving(tmp_path, "tiny-mixtral", "--draft", str(draft), "--budget", "100%") as srv:
        client = srv.client()
        r = client.completions.create(model="tiny-mixtral", prompt="speculate on this", max_tokens=16)
        assert r.choices[0].text == json.loads(g.stdout)["text"]
        kw = dict(model="tiny-mixtral", prompt="sample", max_tokens=12, temperature=0.9, seed=3)
        assert client.completions.create(**kw).choices[0].text == client.completions.create(**kw).choices[0].text
        m = srv.metrics()
        assert m["draft"] in ("active", "dropped") and "acceptance" in m["session"]


# --- refusals: the right 4xx, OpenAI's error shape ----------------------------------------------------------------

def _error(r: Reply, status: int) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert {"message", "type", "code"} <= set(err) and err["message"]
    return err


def test_bad_requests(tiny: Server) -> None:
    chat = "/v1/chat/completions"
    msgs = [{"role": "user", "content": "x"}]
    assert _error(tiny.post(chat, "{not json"), 400)["code"] == "invalid_json"
    assert _error(tiny.post(chat, "[1, 2]"), 400)
    for body, param in (({"messages": msgs, "max_tokens": "5"}, "max_tokens"),
                        ({"messages": msgs, "temperature": "warm"}, "temperature"),
                        ({"messages": "x"}, "messages"), ({"messages": msgs, "stop": 3}, "stop"),
                        ({"messages": msgs, "n": 2}, "n"), ({"messages": msgs, "top_p": 1.5}, "top_p")):
        assert _error(tiny.post(chat, body), 400)["param"] == param
    assert _error(tiny.post(chat, {"model": "gpt-4o", "messages": msgs}), 404)["code"] == "model_not_found"
    assert _error(tiny.post("/v1/completions", {"prompt": [1] * 300, "max_tokens": 4}), 400)["code"] \
        == "context_length_exceeded"  # the server runs with -c 256
    assert _error(tiny.post("/v1/completions", {"prompt": [1] * 200, "max_tokens": 100}), 400)["code"] \
        == "context_length_exceeded"
    assert _error(tiny.post("/v1/completions", {"prompt": [10**9]}), 400)["param"] == "prompt"
    _error(tiny.get("/v1/nothing-here"), 404)
    with pytest.raises(openai.NotFoundError):
        tiny.client().chat.completions.create(model="unknown", messages=msgs)
    with pytest.raises(openai.BadRequestError, match="context"):
        tiny.client().chat.completions.create(model="tiny-qwen3moe", messages=[
            {"role": "user", "content": "lorem ipsum " * 400}])
    assert tiny.get("/health").json()["status"] == "ok"


def test_api_key_and_clean_shutdown(tmp_path: Path) -> None:
    with serving(tmp_path, *TINY_ARGS, "--api-key", "s3cret") as srv:
        msgs = [{"role": "user", "content": "x"}]
        assert srv.get("/health").status_code == 200  # the one open route
        assert _error(srv.get("/v1/models"), 401)["code"] == "invalid_api_key"
        assert _error(srv.get("/metrics", headers={"Authorization": "Bearer nope"}), 401)
        with pytest.raises(openai.AuthenticationError):
            srv.client("wrong").chat.completions.create(model="tiny-qwen3moe", messages=msgs, max_tokens=2)
        r = srv.client("s3cret").chat.completions.create(model="tiny-qwen3moe", messages=msgs, max_tokens=2)
        assert r.usage.completion_tokens == 2
        srv.proc.send_signal(signal.SIGTERM)
        assert srv.proc.wait(timeout=30) == 0
    log = srv.log.read_text()
    assert "Traceback" not in log and "API key required" in log


# --- batch 1 under load, cancellation ------------------------------------------------------------------------------

QUESTIONS = ["What is the capital of France?", "Name a fruit that is yellow.", "What is 2 plus 2?",
             "Say hello in Spanish.", "What color is the sky?", "Name a large animal.", "What do bees make?",
             "Name a planet."]


def test_load_every_request_answered_or_refused(smol: Server) -> None:
    client = smol.client()
    ask = {q: [{"role": "user", "content": q}] for q in QUESTIONS}
    ref = {q: client.chat.completions.create(model="smol-moe", messages=m, max_tokens=8).choices[0].message.content
           for q, m in ask.items()}
    assert len(set(ref.values())) == len(QUESTIONS)  # distinct answers: a mix-up would show
    before = smol.metrics()["requests"]
    results: list[tuple] = []
    lock = threading.Lock()

    def run(i: int) -> None:
        for j in range(4):
            q = QUESTIONS[(4 * i + j) % len(QUESTIONS)]
            try:
                if i % 2:  # half the clients stream
                    text, _, ttft = _chat_stream(client, "smol-moe", ask[q], max_tokens=8)
                    out = ("ok", q, text, ttft)
                else:
                    r = client.chat.completions.create(model="smol-moe", messages=ask[q], max_tokens=8)
                    out = ("ok", q, r.choices[0].message.content, None)
            except openai.RateLimitError as e:
                out = ("429", q, e.response.headers.get("retry-after"), None)
            except Exception as e:  # noqa: BLE001 - counted as lost below
                out = ("lost", q, repr(e), None)
            with lock:
                results.append(out)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(16)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=600)
    answered = [r for r in results if r[0] == "ok"]
    refused = [r for r in results if r[0] == "429"]
    ttfts = sorted(r[3] for r in answered if r[3] is not None)
    p95 = ttfts[min(len(ttfts) - 1, int(0.95 * len(ttfts)))] if ttfts else float("nan")
    print(f"\nload: 16 clients x 4 requests: {len(answered)} answered, {len(refused)} refused (429); streamed "
          f"TTFT p50 {statistics.median(ttfts) if ttfts else float('nan'):.3f} s, p95 {p95:.3f} s")
    assert len(results) == 64 and not [r for r in results if r[0] == "lost"], results
    assert answered, "nothing was answered"
    assert all(r[2] == ref[r[1]] for r in answered), [r for r in answered if r[2] != ref[r[1]]]
    assert all(r[2] and int(r[2]) >= 1 for r in refused)  # Retry-After on every 429
    after = smol.metrics()
    assert after["requests"]["refused"] - before["refused"] == len(refused)
    assert after["requests"]["completed"] - before["completed"] == len(answered)
    assert smol.get("/health").json() == {"status": "ok", "model": "smol-moe", "busy": False,
                                                      "queue_depth": 0}


def test_disconnect_cancels_the_answer(smol: Server) -> None:
    client = smol.client()
    before = smol.metrics()["requests"]["cancelled"]
    stream = client.chat.completions.create(model="smol-moe", stream=True, max_tokens=500, messages=[
        {"role": "user", "content": "Write a long story about a dragon."}])
    for n, _ in enumerate(stream):
        if n == 3:
            break
    stream.close()
    deadline = time.monotonic() + 20
    while smol.metrics()["requests"]["cancelled"] == before:
        assert time.monotonic() < deadline, "the disconnected client's answer was not cancelled"
        time.sleep(0.1)
    m = smol.metrics()
    assert m["session"]["tokens"] > 0 and 0 <= m["session"]["hit_rate"] <= 1
    for key in ("bytes_read_per_token", "ttft_p50_s", "draft", "queue_depth"):
        assert key in m
    text = smol.get("/metrics").text  # Prometheus text format by default
    assert "pyspecter_expert_hit_rate" in text and 'pyspecter_requests_total{outcome="cancelled"}' in text


def test_serve_refuses_a_port_in_use() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        r = run_cli("serve", "tiny-qwen3moe", "--port", str(s.getsockname()[1]), timeout=120)
    assert r.returncode == 2 and "cannot listen" in r.stderr and "Traceback" not in r.stderr



# --- hostile clients: 4xx (never 500), no traceback, connections that end, streams that end ------------------------

def _raw(srv: Server, data: bytes, timeout: float = 30) -> bytes:
    """Send raw bytes on a fresh connection and read until the server closes it."""
    host, port = srv.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=timeout) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
        return out


def _closed_within(socks: list[socket.socket], seconds: float) -> int:
    """How many of ``socks`` the server closed within ``seconds`` (each read sees EOF or a reset)."""
    deadline = time.monotonic() + seconds
    closed = 0
    for s in socks:
        s.settimeout(max(0.01, deadline - time.monotonic()))
        try:
            while s.recv(4096):
                pass
            closed += 1
        except ConnectionResetError:
            closed += 1
        except TimeoutError:
            pass
    return closed


def _which_closed(socks: list[socket.socket]) -> list[bool]:
    """Whether the server has closed each of ``socks`` (EOF or reset waiting to be read), without waiting."""
    out = []
    for s in socks:
        s.setblocking(False)  # else recv waits out the socket's timeout first
        try:
            out.append(s.recv(4096, socket.MSG_PEEK) == b"")
        except ConnectionResetError:
            out.append(True)
        except BlockingIOError:
            out.append(False)
    return out


def _open_idle(srv: Server, n: int, partial: bool = False) -> list[socket.socket]:
    host, port = srv.url.removeprefix("http://").split(":")
    socks = [socket.create_connection((host, int(port)), timeout=10) for _ in range(n)]
    if partial:  # a request head that never ends (slowloris)
        for s in socks:
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\n")
    return socks


def _open_busy(srv: Server, n: int) -> list[socket.socket]:
    """Connections each with a request under way: its head sent, its body never finished (not idle, so never
    closed to make room)."""
    host, port = srv.url.removeprefix("http://").split(":")
    socks = [socket.create_connection((host, int(port)), timeout=10) for _ in range(n)]
    for s in socks:
        s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                  b"Content-Length: 100\r\n\r\n{")
    time.sleep(0.3)  # the server has read every head
    return socks


def _hostile_probes(srv: Server) -> dict[int, int]:
    """The tester's probes, once each. Returns the statuses seen, by count."""
    chat, comp = "/v1/chat/completions", "/v1/completions"
    seen: dict[int, int] = {}

    def note(r: Reply) -> Reply:
        seen[r.status_code] = seen.get(r.status_code, 0) + 1
        return r

    for body, code in (("[" * 10000, "invalid_json"), ('{"messages": [{"role": "user", "content": "\\ud800x"}]}',
                                                        "invalid_json"),
                       ('{"prompt": "\\udfff"}', "invalid_json"), (b"\xff\xfe{", "invalid_json"),
                       ('{"messages": [{"role": "user", "content": "x"}], "max_tokens": 99999999999}',
                        "invalid_value"),
                       ('{"messages": [{"role": "user", "content": "x"}], "max_tokens": 2000000000}',
                        "context_length_exceeded")):
        r = note(srv.post(chat if b"messages" in (body.encode() if isinstance(body, str) else body) else comp,
                          body))
        assert _error(r, 400)["code"] == code, r.text
    assert _error(note(srv.post(comp, b'{"prompt": "' + b"a" * (9 << 20) + b'"}')), 413)
    r = note(srv.post(comp, {"prompt": "word " * 40000, "max_tokens": 4}))  # 200,000 characters
    assert _error(r, 400)["code"] == "context_length_exceeded"
    for _ in range(3):  # abandoned streams
        with socket.create_connection(tuple(srv.url.removeprefix("http://").rsplit(":", 1)), timeout=10) as s:
            body = json.dumps({"prompt": "go on", "max_tokens": 200, "stream": True}).encode()
            s.sendall(b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
            s.recv(1024)
    results: list[int] = []

    def client() -> None:
        results.append(srv.post(comp, {"prompt": "many at once", "max_tokens": 8}).status_code)

    threads = [threading.Thread(target=client) for _ in range(40)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert len(results) == 40 and set(results) <= {200, 429}, results
    for code in results:
        seen[code] = seen.get(code, 0) + 1
    socks = _open_idle(srv, 150 - 100) + _open_idle(srv, 100, partial=True)  # more than --max-connections
    try:
        assert _closed_within(socks, 10) == len(socks)  # closed oldest-first over the cap, or timed out idle
    finally:
        for s in socks:
            s.close()
    return seen


def test_hostile_input_gets_4xx_and_leaves_rss_flat(tmp_path: Path) -> None:
    """Every probe is answered with the right 4xx and OpenAI's error shape; /metrics counts the client errors by
    status; the log holds an access line per request and no traceback; the server's RSS stays flat across a
    second run of the probes (the first run warms allocator pools and caches)."""
    import psutil

    with serving(tmp_path, *TINY_ARGS, "--queue", "2") as srv:
        proc = psutil.Process(srv.proc.pid)
        rss0 = proc.memory_info().rss
        seen1 = _hostile_probes(srv)
        rss1 = proc.memory_info().rss
        seen2 = _hostile_probes(srv)
        rss2 = proc.memory_info().rss
        print(f"\nserver RSS: {rss0 / 2**20:.1f} MiB at start, {rss1 / 2**20:.1f} MiB after one abuse run, "
              f"{rss2 / 2**20:.1f} MiB after a second")
        m = srv.metrics()
        for code in seen1 | seen2:
            if 400 <= code < 500:
                assert m["client_errors"][str(code)] >= seen1.get(code, 0) + seen2.get(code, 0)
        assert m["client_errors"]["400"] >= 12 and m["client_errors"]["413"] >= 2
        assert m["connections"]["evicted"] > 0 and m["connections"]["timed_out"] > 0
        assert "server_errors" not in m or not m["server_errors"], m["server_errors"]
        assert 'pyspecter_http_client_errors_total{status="400"}' in srv.get("/metrics").text
        assert srv.get("/health").json()["status"] == "ok"
        assert rss2 - rss1 < 48 << 20, (rss1, rss2)
    log = srv.log.read_text()
    assert "Traceback" not in log and "Exception in ASGI" not in log, log[-4000:]
    lines = [ln for ln in log.splitlines() if ln.startswith("pyspecter serve: 127.0.0.1:")]
    assert any(" POST /v1/chat/completions 400 " in ln for ln in lines)
    assert any(" POST /v1/completions 413 " in ln for ln in lines)
    assert any(re.search(r" POST /v1/completions 200 tokens \d+\+8 \d+ ms$", ln) for ln in lines), lines[-20:]
    assert any(" GET /health 200 " in ln for ln in lines)


def test_idle_connections_close_and_the_cap_holds(tmp_path: Path) -> None:
    with serving(tmp_path, *TINY_ARGS, "--max-connections", "24", "--idle-timeout", "2") as srv:
        idle = _open_idle(srv, 10) + _open_idle(srv, 10, partial=True)
        try:
            t0 = time.monotonic()
            assert _closed_within(idle, 10) == 20  # none sent a whole request: all closed
            assert time.monotonic() - t0 < 10
        finally:
            for s in idle:
                s.close()
        held = _open_idle(srv, 24)
        try:  # at the cap with idle connections: the oldest idle one makes room
            assert _raw(srv, b"GET /v1/models HTTP/1.1\r\nHost: x\r\nConnection: close\r\n\r\n") \
                .startswith(b"HTTP/1.1 200")
            assert _closed_within(held[:1], 5) == 1
        finally:
            for s in held:
                s.close()
        time.sleep(0.5)
        held = _open_busy(srv, 24)
        try:  # at the cap with a request under way on each: refused, but /health is answered
            over = _raw(srv, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
            assert over.startswith(b"HTTP/1.1 503") and b"too_many_connections" in over
            assert _raw(srv, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n").startswith(b"HTTP/1.1 200")
        finally:
            for s in held:
                s.close()
        time.sleep(0.5)
        assert srv.get("/health").status_code == 200  # below the cap again
        r = _raw(srv, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")  # keep-alive: closed once idle after the answer
        assert r.startswith(b"HTTP/1.1 200")


def test_a_stream_cut_by_shutdown_ends_with_an_error_and_done(tmp_path: Path) -> None:
    with serving(tmp_path, *SMOL_ARGS) as srv:
        host, port = srv.url.removeprefix("http://").split(":")
        body = json.dumps({"model": "smol-moe", "stream": True, "max_tokens": 900,
                           "messages": [{"role": "user", "content": "Write a very long story about a dragon."}]})
        with socket.create_connection((host, int(port)), timeout=60) as s:
            s.sendall(f"POST /v1/chat/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                      f"Content-Length: {len(body)}\r\n\r\n{body}".encode())
            got = b""
            while got.count(b"data: ") < 5:
                got += s.recv(65536)
            srv.proc.send_signal(signal.SIGTERM)
            while chunk := s.recv(65536):
                got += chunk
        assert srv.proc.wait(timeout=60) == 0
    data = [ln[6:] for ln in got.decode().splitlines() if ln.startswith("data: ")]
    assert data[-1] == "[DONE]", data[-3:]
    assert json.loads(data[-2])["error"]["code"] == "server_shutting_down", data[-3:]
    log = srv.log.read_text()
    assert "Traceback" not in log and "without completing response" not in log, log[-3000:]
    assert re.search(r"POST /v1/chat/completions 200 tokens \d+\+\d+ \d+ ms", log)


_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=8)  # lone surrogates included
_json = st.recursive(st.none() | st.booleans() | st.integers(-5, 40) | st.floats() | _text,
                     lambda kids: st.lists(kids, max_size=3) | st.dictionaries(_text, kids, max_size=3), max_leaves=8)
_message = st.fixed_dictionaries({}, optional={"role": st.sampled_from(["user", "system", "assistant"]) | _json,
                                               "content": _text | _json})
_FIELDS = ("model", "max_tokens", "temperature", "top_p", "top_k", "min_p", "repeat_penalty", "seed", "stop",
           "stream", "stream_options", "n", "presence_penalty", "logit_bias", "response_format", "echo", "best_of")


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.fixed_dictionaries({}, optional={name: _json for name in _FIELDS} | {
    "messages": st.lists(_message, min_size=1, max_size=2) | _json,
    "prompt": _text | st.lists(st.integers(-2, 400), max_size=4) | _json}), st.booleans())
def test_fuzz_the_live_server_never_answers_5xx(tiny: Server, body: dict, chat: bool) -> None:
    """Random JSON in every field, sent to the running server: always a 2xx or a 4xx with OpenAI's error shape."""
    r = tiny.post("/v1/chat/completions" if chat else "/v1/completions", body, timeout=120)
    assert r.status_code < 500, (body, r.text)
    if r.status_code >= 400:
        assert r.json()["error"]["message"]


# --- clients that go away, idle sockets: the server lets go -----------------------------------------------------

ROOMY_ARGS = ("tiny-qwen3moe", "--budget", "50%", "-c", "2048")  # an answer of 2000 tokens takes seconds here


@pytest.fixture(scope="module")
def roomy(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(tmp_path_factory.mktemp("roomy"), *ROOMY_ARGS) as srv:  # --queue 8, --max-connections 64
        yield srv


def _request(path: str, body: dict) -> bytes:
    data = json.dumps(body).encode()
    return (b"POST %s HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: %d\r\n\r\n%s"
            % (path.encode(), len(data), data))


def _abandon(srv: Server, n: int, stream: bool, read: bool = False) -> None:
    """``n`` clients each ask for a long answer and go away: all send at once, then all close (``read``: after
    the first bytes of the answer, as a user who gives up on a stream; else without reading anything)."""
    host, port = srv.url.removeprefix("http://").split(":")
    socks = [socket.create_connection((host, int(port)), timeout=10) for _ in range(n)]
    for i, s in enumerate(socks):
        s.sendall(_request("/v1/completions", {"prompt": f"go on {i}", "max_tokens": 2000, "stream": stream}))
    if read:
        for s in socks:
            assert s.recv(64).startswith(b"HTTP/1.1 ")  # answered 200 (admitted) or 429 (the queue is full)
    else:
        time.sleep(0.2)  # admitted or refused, not yet done
    for s in socks:
        s.close()


def _idle_quickly(srv: Server, seconds: float = 3) -> dict:
    """/health once nothing generates or waits: an abandoned answer must stop at once, not run its 2000 tokens."""
    deadline = time.monotonic() + seconds
    while True:
        h = srv.get("/health", timeout=5).json()
        if not h["busy"] and h["queue_depth"] == 0:
            return h
        assert time.monotonic() < deadline, f"abandoned answers still hold the server: {h}"
        time.sleep(0.05)


def test_abandoned_answers_free_their_places(roomy: Server) -> None:
    """20 clients ask for long answers (9 admitted: one generating and --queue 8 waiting, 11 refused with 429)
    and go away; their answers stop (the generating one within a token of the loss being seen) and their places
    are free at once, so the next client is answered. Streamed and not, reading the first bytes or not."""
    client = roomy.client()
    before = roomy.metrics()
    for stream, read in ((True, True), (True, False), (False, False)):
        _abandon(roomy, 20, stream, read)
        r = client.chat.completions.create(model="tiny-qwen3moe", max_tokens=4,  # no 429, no waiting it out
                                           messages=[{"role": "user", "content": "still there?"}])
        assert r.usage.completion_tokens == 4
        _idle_quickly(roomy)
    after = roomy.metrics()
    n_abandoned = after["requests"]["cancelled"] - before["requests"]["cancelled"]
    assert n_abandoned >= 20, (before["requests"], after["requests"])
    tokens = after["session"]["tokens"] - before["session"]["tokens"]
    assert tokens < 2000, f"{tokens} tokens generated for clients that had gone"
    refused = after["requests"]["refused"] - before["requests"]["refused"]
    assert refused > 0 and after["client_errors"].get("429", 0) - before["client_errors"].get("429", 0) == refused
    text = roomy.get("/metrics").text
    assert 'pyspecter_http_client_errors_total{status="429"}' in text
    log = roomy.log.read_text()
    assert re.search(r" POST /v1/completions 429 \d+ ms$", log, re.M)  # refusals are in the access log
    assert re.search(r" POST /v1/completions 499 tokens \d+\+\d+ cancelled \d+ ms$", log, re.M), log[-3000:]
    assert re.search(r" POST /v1/completions 200 tokens \d+\+\d+ cancelled \d+ ms$", log, re.M)  # a stream's
    assert "Traceback" not in log and "Exception in ASGI" not in log


def test_idle_sockets_are_closed_oldest_first(roomy: Server) -> None:
    """64 idle sockets (the cap): a request is answered, and so is /health with the queue full too, by closing
    the oldest idle sockets rather than refusing the newcomers."""
    before = roomy.metrics()["connections"]
    idle = _open_idle(roomy, 64)
    streams = []
    try:
        time.sleep(0.3)
        r = roomy.client().completions.create(model="tiny-qwen3moe", prompt="my turn", max_tokens=4)
        assert r.usage.completion_tokens == 4
        host, port = roomy.url.removeprefix("http://").split(":")
        for i in range(9):  # one generating, eight waiting: the queue is full
            s = socket.create_connection((host, int(port)), timeout=10)
            s.sendall(_request("/v1/completions", {"prompt": f"busy {i}", "max_tokens": 2000, "stream": True}))
            streams.append(s)
        time.sleep(0.3)
        h = roomy.get("/health", timeout=5)
        assert h.status_code == 200 and h.json()["busy"] and h.json()["queue_depth"] == 8, h.text
        time.sleep(0.2)
        closed = _which_closed(idle)  # the oldest made room for the request, the 9 streams and /health
        k = closed.count(True)  # (connections left idle by the tests before, older still, may have gone first)
        assert 8 <= k <= 11 and closed == [True] * k + [False] * (64 - k), closed
    finally:
        for s in idle + streams:
            s.close()
    after = roomy.metrics()["connections"]
    assert after["evicted"] - before["evicted"] >= 11 and after["refused"] == before["refused"]
    _idle_quickly(roomy)


def test_over_the_cap_health_is_answered_and_refusals_counted(roomy: Server) -> None:
    """64 connections with a request under way each (none idle to close): a new request gets 503, logged and
    counted, and /health is still answered."""
    before = roomy.metrics()
    held = _open_busy(roomy, 64)
    try:
        over = _raw(roomy, b"GET /v1/models HTTP/1.1\r\nHost: x\r\n\r\n")
        assert over.startswith(b"HTTP/1.1 503") and b"too_many_connections" in over
        health = _raw(roomy, b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
        assert health.startswith(b"HTTP/1.1 200") and json.loads(health.split(b"\r\n\r\n", 1)[1])["status"] == "ok"
    finally:
        for s in held:
            s.close()
    time.sleep(0.3)
    after = roomy.metrics()
    assert after["connections"]["refused"] - before["connections"]["refused"] == 1
    assert after["server_errors"].get("503", 0) - before["server_errors"].get("503", 0) == 1
    log = roomy.log.read_text()
    assert re.search(r" GET /v1/models 503 \d+ ms$", log, re.M) and re.search(r" GET /health 200 \d+ ms$", log,
                                                                               re.M)


def test_rss_stays_flat_over_abuse_rounds(roomy: Server) -> None:
    """The server's memory after rounds of abandoned answers, idle sockets and connections over the cap: the
    first round warms pools and caches, the next ones must not grow it."""
    import psutil

    proc = psutil.Process(roomy.proc.pid)

    def abuse() -> None:
        _abandon(roomy, 20, stream=True)
        _abandon(roomy, 20, stream=False)
        idle = _open_idle(roomy, 80)  # over the cap: the oldest are closed
        busy = _open_busy(roomy, 8)
        for s in idle + busy:
            s.close()
        _idle_quickly(roomy)

    abuse()
    rss1 = proc.memory_info().rss
    for _ in range(4):
        abuse()
    rss2 = proc.memory_info().rss
    print(f"\nserver RSS: {rss1 / 2**20:.1f} MiB after one abuse round, {rss2 / 2**20:.1f} MiB after four more")
    assert rss2 - rss1 < 50 << 20, (rss1, rss2)
    assert roomy.get("/health").json()["status"] == "ok"
