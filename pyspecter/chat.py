"""The chat REPL: a conversation over a Session, streamed to the terminal, stoppable with Ctrl-C."""

from __future__ import annotations

import signal
import sys
from collections.abc import Callable

from pyspecter.errors import SpecterError
from pyspecter.prompts import render_prompt
from pyspecter.session import Session


class Stopped(Exception):
    """Ctrl-C during an answer."""


class Streamer:
    """Prints tokens as they come, decoding the whole answer each time so multi-byte characters split across
    tokens come out whole."""

    def __init__(self, model) -> None:
        self.model, self.tokens, self.shown = model, [], 0

    def __call__(self, tok: int) -> None:
        self.tokens.append(tok)
        text = self.model.detokenize([t for t in self.tokens if not self.model.is_eog(t)])
        if text.endswith("\ufffd"):
            return
        sys.stdout.write(text[self.shown:])
        sys.stdout.flush()
        self.shown = len(text)


_interrupted = [False]


def stop_check(stream: Callable[[int], None]) -> Callable[[int], None]:
    """Wrap the token callback: it runs in plain Python between decodes, the one place a stop can be raised.
    (The routing hook runs inside llama_decode on this same thread, where a KeyboardInterrupt would only be
    printed and swallowed by ctypes.) A token decided after Ctrl-C is not shown: the answer ends where the user
    stopped it."""

    def on_token(tok: int) -> None:
        if _interrupted[0]:
            raise Stopped
        stream(tok)

    return on_token


def interruptible(fn, *args, **kwargs):
    """Run fn with Ctrl-C turned into a flag that stop_check honours."""
    _interrupted[0] = False

    def handler(_sig, _frame) -> None:
        _interrupted[0] = True

    old = signal.signal(signal.SIGINT, handler)
    try:
        return fn(*args, **kwargs)
    finally:
        signal.signal(signal.SIGINT, old)


def fit_history(s: Session, history: list[dict[str, str]], room: int) -> tuple[list[int], int]:
    """The rendered prompt for ``history`` with ``room`` tokens left for the answer: the oldest turns after the
    system prompt are dropped (in place) until it fits. Returns the prompt's tokens and how many turns went."""
    first = 1 if history and history[0]["role"] == "system" else 0
    dropped = 0
    while True:
        prompt = s.tokenize(render_prompt(s.target, history), add_special=False)
        if len(prompt) + room <= s.cfg.n_ctx:
            return prompt, dropped
        if len(history) - first <= 1:  # only the new message is left, and it alone does not fit
            raise SpecterError(f"message too long: {len(prompt)} tokens, the context holds {s.cfg.n_ctx} "
                               f"with {room} kept for the answer")
        del history[first]
        dropped += 1


COMMANDS = {
    "/help": "this list",
    "/stats": "speed and cache figures of the answers so far",
    "/reset": "forget the conversation (and the figures)",
    "/quit": "leave (also /exit, or Ctrl-D)",
}


def help_text() -> str:
    return "\n".join([*(f"{c:<8}{what}" for c, what in COMMANDS.items()),
                      "Ctrl-C stops the answer being written; a line starting with / is a command, never sent "
                      "to the model (//text sends /text)"])


def repl(s: Session, *, n: int, system: str | None, stats_line: Callable[[dict], str]) -> None:
    """Read lines until EOF or /quit. /help lists the commands; /stats shows speed and cache figures, /reset
    forgets the conversation. A line starting with "/" is a command: an unknown one is answered, not sent. When
    the context fills, the oldest turns are dropped with a notice; an error ends the turn, not the chat."""
    history: list[dict[str, str]] = [{"role": "system", "content": system}] if system else []
    room = min(n, s.cfg.n_ctx // 2)  # an answer may not take the whole context: the question needs some
    interactive = sys.stdin.isatty()
    print(f"pyspecter chat: {s.layout.name} — /help for commands, Ctrl-C stops an answer", file=sys.stderr)
    while True:
        try:
            line = input("> " if interactive else "")
        except EOFError:
            break
        except KeyboardInterrupt:
            print()
            break
        line = line.strip()
        if not line:
            continue
        if line in ("/quit", "/exit"):
            break
        if line == "/stats":
            print(stats_line(s.stats()))
            continue
        if line == "/reset":
            history = history[:1] if system else []
            s.reset_stats()
            print("(conversation cleared)")
            continue
        if line == "/help":
            print(help_text())
            continue
        if line.startswith("//"):
            line = line[1:]
        elif line.startswith("/"):
            print(f"unknown command {line.split()[0]} (/help lists them); nothing was sent to the model")
            continue
        turn = [*history, {"role": "user", "content": line}]
        stream = Streamer(s.target)
        try:
            prompt, dropped = fit_history(s, turn, room)
            if dropped:
                print(f"(context full: dropped the {dropped} oldest message(s))", file=sys.stderr)
            # the KV cache keeps the conversation: only the new turn (and whatever the template changed) is read
            out = interruptible(s.generate, prompt, room, on_token=stop_check(stream), reuse=True)
        except Stopped:  # nothing more is printed: the answer is what was shown when Ctrl-C came
            out = stream.tokens
        except Exception as e:  # noqa: BLE001 - the conversation so far is kept; only this turn is lost
            print(f"\npyspecter: error: {e if isinstance(e, SpecterError) else repr(e)}", file=sys.stderr)
            continue
        print()
        answer = s.target.detokenize([t for t in out if not s.target.is_eog(t)])
        history = [*turn, {"role": "assistant", "content": answer}]
