"""The server's wire format without a server: request validation, stop sequences over an incremental detokenizer,
and `serve` without the server extra."""

from __future__ import annotations

import subprocess
import sys

import pytest

from pyspecter.openai_api import ApiError, StopText, parse_chat, parse_completion

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
