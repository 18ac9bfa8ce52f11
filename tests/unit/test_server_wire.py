"""The server's wire format without a server: request validation (and a property-based fuzz of it), hostile JSON,
stop sequences over an incremental detokenizer, how a stream ends, and `serve` without the server extra."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pyspecter.errors import SpecterError
from pyspecter.server.wire import (
    MAX_DEPTH,
    ApiError,
    StopText,
    decode_json,
    nesting_depth,
    parse_chat,
    parse_completion,
)

USER = [{"role": "user", "content": "hi"}]


def _refused(fn, body) -> ApiError:
    with pytest.raises(ApiError) as e:
        fn(body)
    err = e.value
    assert 400 <= err.status < 500
    assert set(err.body()["error"]) >= {"message", "type", "code"}
    return err


def test_chat_request_fields() -> None:
    r = parse_chat({"model": "m", "messages": [{"role": "developer", "content": [{"type": "text", "text": "be"},
                                                                                 {"type": "text", "text": " brief"}]},
                                               {"role": "user", "content": "hi"},
                                               {"role": "assistant", "content": None}],
                    "temperature": 0.7, "top_p": 0.9, "max_completion_tokens": 12, "stop": "\n", "seed": -3,
                    "stream": True, "stream_options": {"include_usage": True}, "presence_penalty": 0, "user": "x"})
    assert r.messages == [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                          {"role": "assistant", "content": ""}]
    assert (r.max_tokens, r.stop, r.seed, r.stream, r.include_usage) == (12, ["\n"], -3, True, True)
    assert r.sampling() == {"temperature": 0.7, "top_p": 0.9}
    assert parse_chat({"messages": USER}).max_tokens is None  # chat: what the context leaves


@pytest.mark.parametrize("body, param", [
    ({"messages": USER, "max_tokens": "5"}, "max_tokens"),
    ({"messages": USER, "max_tokens": 5.0}, "max_tokens"),
    ({"messages": USER, "max_tokens": True}, "max_tokens"),
    ({"messages": USER, "max_tokens": 0}, "max_tokens"),
    ({"messages": USER, "temperature": "hot"}, "temperature"),
    ({"messages": USER, "temperature": 2.5}, "temperature"),
    ({"messages": USER, "top_p": 0}, "top_p"),
    ({"messages": USER, "stop": 5}, "stop"),
    ({"messages": USER, "stop": ["a", "b", "c", "d", "e"]}, "stop"),
    ({"messages": USER, "stop": [""]}, "stop"),
    ({"messages": USER, "seed": "1"}, "seed"),
    ({"messages": USER, "stream": "yes"}, "stream"),
    ({"messages": USER, "stream_options": {"include_usage": True}}, "stream_options"),
    ({"messages": USER, "n": 2}, "n"),
    ({"messages": USER, "frequency_penalty": 0.5}, "frequency_penalty"),
    ({"messages": USER, "logprobs": True}, "logprobs"),
    ({"messages": USER, "tools": [{"type": "function"}]}, "tools"),
    ({"messages": USER, "model": 3}, "model"),
    ({"messages": "hi"}, "messages"),
    ({"messages": []}, "messages"),
    ({"messages": [{"role": "tool", "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": [], "content": "x"}]}, "messages[0].role"),  # found by the fuzz: was a TypeError
    ({"messages": [{"role": {"a": 1}, "content": "x"}]}, "messages[0].role"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url"}]}]}, "messages[0].content"),
    ({"messages": [{"role": "user", "content": 7}]}, "messages[0].content"),
    ({}, "messages"),
])
def test_chat_refusals(body: dict, param: str) -> None:
    assert _refused(parse_chat, body).param == param


def test_completion_request() -> None:
    assert parse_completion({"prompt": "x"}).max_tokens == 16  # OpenAI's default
    assert parse_completion({"prompt": ["x"]}).prompt == "x"
    assert parse_completion({"prompt": [1, 2, 3], "max_tokens": 4}).prompt == [1, 2, 3]
    assert parse_completion({"prompt": [[5, 6]]}).prompt == [5, 6]
    for body in ({"prompt": ["a", "b"]}, {"prompt": 3}, {"prompt": [1, "a"]}, {"prompt": "x", "echo": True},
                 {"prompt": "x", "best_of": 2}, {"prompt": "x", "suffix": "y"}, {}, [1, 2], "text"):
        _refused(parse_completion, body)


class FakeVocab:
    """Tokens are pieces of text; 0 is end-of-generation; 9 and 10 are the two bytes of 'é' split in half."""

    PIECES = {1: b"Hello", 2: b",", 3: b" wor", 4: b"ld", 5: b"!", 6: b"\n", 7: b"##", 8: b"#", 9: b"\xc3",
              10: b"\xa9", 0: b""}

    def detokenize(self, toks: list[int]) -> str:
        return b"".join(self.PIECES[t] for t in toks).decode("utf-8", errors="replace")

    @staticmethod
    def is_eog(t: int) -> bool:
        return t == 0


def _run(tokens: list[int], stops: list[str]) -> tuple[list[str], str, bool]:
    v = FakeVocab()
    st = StopText(v.detokenize, v.is_eog, stops)
    deltas = []
    for t in tokens:
        deltas.append(st.push(t))
        if st.stopped:
            break
    deltas.append(st.flush())
    return deltas, "".join(deltas), st.stopped


def test_stop_text_streams_and_stops() -> None:
    deltas, text, stopped = _run([1, 2, 3, 4, 5, 0], [])
    assert text == "Hello, world!" and deltas[:3] == ["Hello", ",", " wor"] and not stopped
    _, text, stopped = _run([1, 2, 3, 4, 5], ["world"])
    assert text == "Hello, " and stopped  # the stop sequence spans two tokens and is not emitted
    deltas, text, stopped = _run([1, 3, 7, 8, 6, 1], ["###"])
    assert text == "Hello wor" and stopped and "#" not in "".join(deltas)
    _, text, stopped = _run([1, 7, 6, 1], ["###"])  # a held-back partial match that turns out not to be one
    assert text == "Hello##\nHello" and not stopped
    _, text, stopped = _run([1, 7], ["###"])  # ends (max tokens) while held back: the text is still released
    assert text == "Hello##" and not stopped


def test_stop_text_keeps_characters_whole() -> None:
    deltas, text, _ = _run([1, 9, 10, 5], [])
    assert "\ufffd" not in "".join(deltas) and text == "Helloé!"
    assert deltas[1] == ""  # half a character is held until its second byte arrives


def test_serve_without_the_extra_is_a_one_line_error() -> None:
    code = ("import sys; sys.modules['fastapi'] = None; sys.argv = ['pyspecter', 'serve', 'x.gguf']\n"
            "from pyspecter.cli import main; main()")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 2
    assert r.stderr.startswith("pyspecter: error:") and "pyspecter[server]" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


# --- hostile bodies: every malformed one is a 400 invalid_json, decided before or instead of a traceback ----------

@pytest.mark.parametrize("body, why", [
    (b"[" * 10000, "nested 10000 levels"),  # was a RecursionError (HTTP 500)
    (b'{"a": ' * 70 + b"1" + b"}" * 70, "nested 70 levels"),
    (b'{"messages": [{"role": "user", "content": "\\ud800x"}]}', "messages[0].content: a lone surrogate"),
    (b'{"prompt": "\\udfff"}', "prompt: a lone surrogate"),
    (b'{"stop": ["ok", "\\udc00"]}', "stop[1]: a lone surrogate"),
    (b'{"\\ud800": 1}', "key"),
    (b"{not json", "Expecting property name"),
    (b"\xff\xfe\x00", "could not parse"),
    (b"", "Expecting value"),
])
def test_malformed_json_is_invalid_json(body: bytes, why: str) -> None:
    with pytest.raises(ApiError) as e:
        decode_json(body)
    assert (e.value.status, e.value.code) == (400, "invalid_json") and why in e.value.message


def test_well_formed_json_passes() -> None:
    assert decode_json(b'{"prompt": "\\ud83d\\ude00 [[[[{{{{", "x": [[[[1]]]]}') == {"prompt": "😀 [[[[{{{{",
                                                                                     "x": [[[[1]]]]}
    deep_ok = b"[" * MAX_DEPTH + b"]" * MAX_DEPTH
    assert decode_json(deep_ok) is not None
    assert nesting_depth(b'["\\\\", [[]], "]]]]\\"[[[["]') == 3  # escapes and brackets inside strings
    assert nesting_depth(b'"' + b"[" * 100 + b'"') == 0


def test_depth_is_counted_across_pieces(monkeypatch: pytest.MonkeyPatch) -> None:
    import pyspecter.server.wire as wire

    bodies = [json.dumps(v).encode() for v in ([["\\\"[", [{"a\\": [1]}]]], {"k[": ["]", "\\\\", [[[]]]]})]
    want = [nesting_depth(b) for b in bodies]
    monkeypatch.setattr(wire, "_PIECE", 3)
    assert [nesting_depth(b) for b in bodies] == want == [5, 5]


_text = st.text(st.characters(codec=None, exclude_categories=()), max_size=12)  # lone surrogates included
_json = st.recursive(st.none() | st.booleans() | st.integers() | st.floats() | _text,
                     lambda kids: st.lists(kids, max_size=4) | st.dictionaries(_text, kids, max_size=4),
                     max_leaves=12)
FIELDS = ("model", "messages", "prompt", "max_tokens", "max_completion_tokens", "temperature", "top_p", "top_k",
          "min_p", "repeat_penalty", "seed", "stop", "stream", "stream_options", "n", "presence_penalty",
          "frequency_penalty", "logit_bias", "tools", "functions", "response_format", "logprobs", "top_logprobs",
          "echo", "suffix", "best_of", "user")
_message = st.fixed_dictionaries({}, optional={"role": st.sampled_from(["user", "system", "assistant", "tool"])
                                               | _json, "content": _text | _json})
_body = st.fixed_dictionaries({}, optional={name: _json for name in FIELDS} | {
    "messages": st.lists(_message, max_size=3) | _json, "prompt": _text | st.lists(st.integers(), max_size=4)})


def _validate(body: bytes, chat: bool) -> None:
    """What the server does with a body before it tokenizes: a request, or a 4xx. Never anything else."""
    from pyspecter.sampling import SamplingParams

    try:
        req = (parse_chat if chat else parse_completion)(decode_json(body))
        SamplingParams(**req.sampling()).check()
    except ApiError as e:
        assert 400 <= e.status < 500 and e.body()["error"]["message"]
        return
    except SpecterError:  # sampling settings out of range: the server answers 400
        return
    for m in req.messages or []:
        m["content"].encode("utf-8")  # tokenizable: no lone surrogate got through
    if isinstance(req.prompt, str):
        req.prompt.encode("utf-8")
    assert all(s.encode("utf-8") for s in req.stop)


@settings(max_examples=250, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(_body, st.booleans())
def test_fuzz_random_json_in_every_field(body: dict, chat: bool) -> None:
    _validate(json.dumps(body).encode(), chat)


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=64) | _json.map(lambda v: json.dumps(v).encode()), st.booleans())
def test_fuzz_any_bytes(body: bytes, chat: bool) -> None:
    _validate(body, chat)


def test_a_stream_that_fails_ends_with_an_error_then_done() -> None:
    """The stream's events when the engine fails mid-answer (500) or the server shuts down (503): what was
    generated, an error event, then [DONE] — not a stream that just stops."""
    import asyncio

    from pyspecter.server.app import stream_events
    from pyspecter.server.worker import Job

    async def run(events: list[tuple]) -> list[str]:
        q: asyncio.Queue = asyncio.Queue()
        for ev in events:
            q.put_nowait(ev)
        job = Job([1, 2], 8, parse_chat({"messages": USER, "stream": True}))
        out = [data async for data in stream_events(job, q, job.req, True, "m")]
        assert job.cancel.is_set()
        return out

    for status, code in ((500, "generation_failed"), (503, "server_shutting_down")):
        out = asyncio.run(run([("text", "Hel"), ("text", "lo"), ("error", "it broke", status)]))
        assert [json.loads(d)["choices"][0]["delta"].get("content") for d in out[:3]] == ["", "Hel", "lo"]
        assert json.loads(out[3])["error"]["code"] == code and out[4:] == ["[DONE]"]
    out = asyncio.run(run([("text", "ok"), ("done", "length", 2, 1)]))
    assert json.loads(out[-2])["choices"][0]["finish_reason"] == "length" and out[-1] == "[DONE]"


def test_prometheus_counts_client_errors_by_status() -> None:
    from pyspecter.server.http import HttpStats
    from pyspecter.server.worker import prometheus

    stats = HttpStats()
    stats.by_status.update({200: 5, 400: 3, 404: 1, 503: 2})
    m = {"requests": {"completed": 5}, "queue_depth": 0, "busy": False, "prompt_tokens": 0, "ttft_p50_s": 0,
         "ttft_p95_s": 0, "bytes_read_per_token": 0, "draft": "none", "session": {}} | stats.figures()
    assert m["client_errors"] == {"400": 3, "404": 1} and m["server_errors"] == {"503": 2}
    text = prometheus(m)
    assert 'pyspecter_http_client_errors_total{status="400"} 3' in text
    assert 'pyspecter_http_client_errors_total{status="404"} 1' in text
    assert "pyspecter_connections_open 0" in text and "pyspecter_connections_refused_total 0" in text


class _FakeSession:
    """What the worker needs of a Session, generating on command: each token waits for ``step`` (a semaphore
    the test releases), so the test knows exactly how many tokens a job made."""

    def __init__(self) -> None:
        import threading
        from types import SimpleNamespace

        from pyspecter.sampling import Sampler, SamplingParams

        self.sampler = Sampler(SamplingParams())
        self.decoder = None
        self.target = SimpleNamespace(detokenize=lambda toks: "x" * len(toks), is_eog=lambda t: False)
        self.step = threading.Semaphore(0)
        self.started = threading.Event()

    def stats(self) -> dict:
        return {}

    def generate(self, prompt, n, on_token):
        self.started.set()
        out = []
        for _ in range(n):
            self.step.acquire()
            out.append(1)
            on_token(1)
        return out

    def close(self) -> None:
        pass


def test_an_abandoned_job_frees_its_place_and_stops_within_a_token() -> None:
    """The worker without a model: a waiting job that is abandoned leaves the queue at once (the next submit is
    admitted, not refused with 429); the generating one stops at its next token."""
    import time

    from pyspecter.server.worker import Job, Worker

    s = _FakeSession()
    w = Worker(s, queue_size=2)
    events: dict[int, list] = {}

    def job(i: int) -> Job:
        events[i] = []
        return Job([1], 1000, parse_completion({"prompt": "x"}), emit=events[i].append)

    try:
        running, a, b = job(0), job(1), job(2)
        for j in (running, a, b):
            w.submit(j)
        assert s.started.wait(10)
        with pytest.raises(ApiError) as e:
            w.submit(job(3))
        assert e.value.status == 429
        a.abandon()
        assert w.queue_depth == 1 and events[1] == [("cancelled",)] and a.outcome == "cancelled"
        w.submit(job(4))  # a's place is free: admitted
        s.step.release(3)
        deadline = time.monotonic() + 10
        while running.n_out < 3:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        running.abandon()
        s.step.release(50)  # the worker may make one more token, never more
        while running.outcome is None:
            assert time.monotonic() < deadline
            time.sleep(0.001)
        assert running.outcome == "cancelled" and running.n_out == 4 and events[0][-1] == ("cancelled",)
        running.abandon()  # again, and after the end: nothing happens
        assert w.counts["cancelled"] == 2 and w.counts["refused"] == 1
    finally:
        w.abort()
        s.step.release(10_000)
        w.close()


def test_a_fitting_model_reports_no_slots() -> None:
    """A model that fits runs stock: /metrics says 0 slots (the session's slot count, the one definition
    placement.SlotCount gives), not a nominal count; a slotted one reports its mean, min and max per layer."""
    from pyspecter.server.worker import prometheus

    stock = {"stock": True, "has_slots": False, "slots_text": "no slots (every expert resident)",
             "slots_per_layer": 0, "slots_min": 0, "slots_mean": 0, "slots_max": 0, "n_expert": 32}
    slotted = {"stock": False, "has_slots": True, "slots_text": "4/32 slots per layer", "slots_per_layer": 4,
               "slots_min": 4, "slots_mean": 4, "slots_max": 4, "n_expert": 32}
    m = {"requests": {}, "queue_depth": 0, "busy": False, "prompt_tokens": 0, "ttft_p50_s": 0, "ttft_p95_s": 0,
         "bytes_read_per_token": 0, "draft": "none"}
    assert "pyspecter_expert_slots_per_layer 0\n" in prometheus(m | {"session": stock})
    assert "pyspecter_expert_slots_per_layer 4\n" in prometheus(m | {"session": slotted})
