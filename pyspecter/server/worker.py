"""Serving at batch size 1: one worker thread owns the Session and generates one answer at a time, from a
bounded queue of jobs; every job brings its own sampling settings and can be cancelled between tokens. The HTTP
side (``app``) only submits jobs and reads their events. No web framework here.
"""

from __future__ import annotations

import math
import random
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import pyspecter.server.wire as oa
from pyspecter.errors import SpecterError
from pyspecter.sampling import Sampler
from pyspecter.server.wire import ApiError
from pyspecter.session import Session


class _Finish(Exception):
    def __init__(self, reason: str) -> None:
        self.reason = reason


@dataclass
class Job:
    """One answer to generate. ``emit`` hands events to the request's event loop (thread-safe):
    ("text", str) as the answer grows, then ("done", finish_reason, n_prompt, n_completion),
    ("error", message, status): 500 for a failed answer, 503 when the server shuts down, or ("cancelled",) once
    an abandoned answer has stopped."""

    prompt: list[int]
    max_tokens: int
    req: oa.GenRequest
    emit: Callable[[tuple], None] = lambda ev: None
    cancel: threading.Event = field(default_factory=threading.Event)
    t_submit: float = field(default_factory=time.perf_counter)
    n_out: int = 0  # tokens generated so far (the access log reads it)
    outcome: str | None = None  # once it ends: "completed", "cancelled", "failed" (or "aborted" on shutdown)
    _on_abandon: Callable[[Job], None] | None = field(default=None, repr=False)  # set by Worker.submit

    def abandon(self) -> None:
        """Its client went away: stop at the next token if it generates, and give its queue place back now if it
        waits. Safe to call more than once, and after the answer is done."""
        self.cancel.set()
        if self._on_abandon is not None:
            self._on_abandon(self)


class Worker:
    """The one thread that touches the session after startup: it takes jobs from a bounded queue, one at a time.

    The queue is a deque under a condition rather than a ``queue.Queue`` so that an abandoned job leaves it at
    once: a client that went away must not hold a place that the next client would get a 429 for."""

    def __init__(self, session: Session, queue_size: int) -> None:
        self.s = session
        self.queue_size = queue_size  # jobs that may wait for the one generating (0: none may wait)
        self._waiting: deque[Job] = deque()  # under _cv
        self._running: Job | None = None  # taken from _waiting, not yet finished (under _cv)
        self._stop = False  # under _cv: the thread ends
        self._cv = threading.Condition(threading.Lock())
        self.lock = threading.Lock()  # held while the session generates (and while it is closed)
        self.base = session.sampler.params  # the server's defaults: what a request does not set
        self._pinned: int | None = None  # the governor's K to restore after a seeded sampled request
        self.counts = {"completed": 0, "cancelled": 0, "failed": 0, "refused": 0}
        self.ttft: deque[float] = deque(maxlen=512)  # seconds from arrival (queue wait included) to first token
        self.durations: deque[float] = deque(maxlen=32)
        self.prompt_tokens = 0
        self.busy = False
        self.closing = False  # set on shutdown: no new job is taken
        self.stats = self._session_stats()  # refreshed by the worker itself, between tokens
        self._thread = threading.Thread(target=self._loop, name="pyspecter-generate", daemon=True)
        self._thread.start()

    @property
    def queue_depth(self) -> int:
        """Jobs waiting for the one generating (abandoned ones are gone from the queue already)."""
        return len(self._waiting)

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    # --- the request side (event loop thread) ---

    def submit(self, job: Job) -> None:
        if self.closing:
            raise ApiError(503, "the server is shutting down", type="server_error", code="server_shutting_down")
        with self._cv:
            inflight = len(self._waiting) + (self._running is not None)
            full = inflight > self.queue_size
            if not full:
                job._on_abandon = self._abandoned
                self._waiting.append(job)
                self._cv.notify()
        if full:
            self.counts["refused"] += 1
            per = sum(self.durations) / len(self.durations) if self.durations else 1.0
            wait = min(60, max(1, math.ceil(per * inflight)))
            raise ApiError(429, f"the server is busy: {self.queue_size} requests already wait for the one "
                                f"generating (batch size 1); retry after {wait} s", type="requests",
                           code="rate_limit_exceeded", headers={"Retry-After": str(wait)})

    def _abandoned(self, job: Job) -> None:
        """A waiting job leaves the queue now (its place is free for the next request); the one generating stops
        at its next token, in the worker thread, which then frees its place."""
        with self._cv:
            try:
                self._waiting.remove(job)
            except ValueError:  # generating, done, or removed already
                return
            self.counts["cancelled"] += 1
        job.outcome = "cancelled"
        job.emit(("cancelled",))

    def abort(self, message: str = "the server is shutting down") -> None:
        """End every answer now, waiting or generating: each gets an error event (its stream then ends properly)
        and is cancelled. Takes no new job after this."""
        self.closing = True
        with self._cv:
            waiting, self._waiting = list(self._waiting), deque()
            current = self._running
        for job in waiting:
            job.cancel.set()
            job.outcome = "aborted"
            job.emit(("error", message, 503))
        if current is not None:
            current.outcome = "aborted"  # before the cancel the worker acts on: it then leaves the outcome be
            current.emit(("error", message, 503))
            current.cancel.set()

    def close(self) -> None:
        """Cancel what waits and what runs, stop the thread, then free the session."""
        self.abort()
        with self._cv:
            self._stop = True
            self._cv.notify()
        self._thread.join(timeout=30)
        with self.lock:
            self.s.close()

    # --- the worker thread ---

    def _session_stats(self) -> dict:
        try:
            return self.s.stats()
        except Exception:  # noqa: BLE001 - figures are best effort, never a reason to fail an answer
            return getattr(self, "stats", {})

    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._waiting and not self._stop:
                    self._cv.wait()
                if self._stop:
                    return
                job = self._running = self._waiting.popleft()
                if job.cancel.is_set():  # cancelled but not through abandon(): nothing to generate
                    self.counts["cancelled"] += 1
                    self._running = None
                    job.outcome = "cancelled"
                    job.emit(("cancelled",))
                    continue
            try:
                with self.lock:
                    self.busy = True
                    try:
                        self._generate(job)
                    finally:
                        self.busy = False
                        self.stats = self._session_stats()
            finally:
                with self._cv:
                    self._running = None

    def _samplers(self, req: oa.GenRequest) -> None:
        params = replace(self.base, **req.sampling()).check()
        seed = req.seed if req.seed is not None else random.SystemRandom().randrange(2**63)
        seed %= 2**64
        self.s.sampler = Sampler(params, seed)
        self._pinned = None
        if self.s.decoder is not None:
            self.s.decoder.sampler = Sampler(params, seed)
            gov = self.s.decoder.governor
            if req.seed is not None and params.temperature > 0 and gov.pinned is None:
                # A speculative sample depends on how many tokens each step drafts, which the governor picks
                # from measured speed: a seeded request runs at the decoder's starting K throughout, so the same
                # seed gives the same sample (the distribution is the target's either way)
                self._pinned = gov.k
                gov.pin(self.s.decoder.k)

    def _generate(self, job: Job) -> None:
        s, model = self.s, self.s.target
        text = oa.StopText(model.detokenize, model.is_eog, job.req.stop)
        n_out = 0
        t0 = time.perf_counter()

        def on_token(tok: int) -> None:
            nonlocal n_out
            n_out += 1
            job.n_out = n_out
            if n_out == 1:
                self.ttft.append(time.perf_counter() - job.t_submit)
            delta = text.push(tok)
            if delta:
                job.emit(("text", delta))
            if text.stopped:
                raise _Finish("stop")
            if job.cancel.is_set():
                raise _Finish("cancelled")
            if n_out % 16 == 0:
                self.stats = self._session_stats()

        try:
            self._samplers(job.req)
            out = s.generate(job.prompt, job.max_tokens, on_token=on_token)
            reason = "stop" if out and model.is_eog(out[-1]) else "length"
        except _Finish as f:
            reason = f.reason
        except Exception as e:  # noqa: BLE001 - one answer fails, the server goes on
            self.counts["failed"] += 1
            job.outcome = "failed"
            job.emit(("error", str(e) if isinstance(e, SpecterError) else repr(e), 500))
            return
        finally:
            if self._pinned is not None and s.decoder is not None:  # back to adapting K
                s.decoder.governor.pinned, s.decoder.governor.k = None, self._pinned
        if reason == "cancelled" and job.outcome == "aborted":  # shutdown: abort() has told its client
            return
        if reason == "cancelled":
            with self._cv:  # counts are bumped from the event loop too
                self.counts["cancelled"] += 1
            job.outcome = "cancelled"
            job.emit(("cancelled",))
            return
        rest = text.flush()
        if rest:
            job.emit(("text", rest))
        self.counts["completed"] += 1
        job.outcome = "completed"
        self.prompt_tokens += len(job.prompt)
        self.durations.append(time.perf_counter() - t0)
        job.emit(("done", reason, len(job.prompt), n_out))


def _pct(xs, q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))] if xs else 0.0


def metrics(w: Worker) -> dict:
    """The engine's live figures: the session's counters (refreshed between tokens) and the server's own."""
    st = dict(w.stats)
    tokens = st.get("tokens", 0)
    out = {"requests": dict(w.counts), "queue_depth": w.queue_depth, "queue_capacity": w.queue_size,
           "busy": w.busy, "prompt_tokens": w.prompt_tokens,
           "ttft_p50_s": _pct(w.ttft, 0.5), "ttft_p95_s": _pct(w.ttft, 0.95),
           "bytes_read_per_token": st.get("upload_mib", 0.0) * 2**20 / tokens if tokens else 0.0,
           "draft": "none" if "acceptance" not in st else
           ("dropped" if st.get("draft_dropped_at") is not None else "active"),
           "session": st}
    return out


def prometheus(m: dict) -> str:
    """The same figures in Prometheus' text format (what llama.cpp's own server serves at /metrics)."""
    st = m["session"]
    gauges = [
        ("queue_depth", "gauge", "requests waiting", m["queue_depth"]),
        ("busy", "gauge", "1 while an answer is generated", int(m["busy"])),
        ("prompt_tokens_total", "counter", "prompt tokens processed", m["prompt_tokens"]),
        ("tokens_total", "counter", "tokens generated", st.get("tokens", 0)),
        ("tokens_per_second", "gauge", "decode tokens per second of decode time, prefill apart",
         st.get("tok_s", 0.0)),
        ("prompt_tokens_per_second", "gauge", "prompt tokens per second of prefill time", st.get("prefill_tok_s", 0.0)),
        ("ttft_p50_seconds", "gauge", "time to first token (queue wait included), median", m["ttft_p50_s"]),
        ("ttft_p95_seconds", "gauge", "time to first token (queue wait included), p95", m["ttft_p95_s"]),
        ("expert_hit_rate", "gauge", "experts resident when their layer needed them", st.get("hit_rate", 0.0)),
        ("expert_slot_row_rate", "gauge", "expert rows computed from slots", st.get("coverage", 0.0)),
        ("expert_slots_per_layer", "gauge", "expert slots per MoE layer, mean (0: no slots)", st.get("slots_mean", 0)),
        ("expert_slots_per_layer_min", "gauge", "expert slots of the MoE layer with fewest", st.get("slots_min", 0)),
        ("expert_slots_per_layer_max", "gauge", "expert slots of the MoE layer with most", st.get("slots_max", 0)),
        ("expert_uploads_total", "counter", "experts read from the slow tier", st.get("uploads", 0)),
        ("upload_bytes_total", "counter", "bytes read from the slow tier", st.get("upload_mib", 0.0) * 2**20),
        ("upload_bytes_per_token", "gauge", "bytes read from the slow tier per token", m["bytes_read_per_token"]),
        ("stall_seconds_total", "counter", "time in the routing hook (waiting for experts)",
         st.get("stall_ms", 0.0) / 1e3),
        ("failed_uploads_total", "counter", "failed uploads (served exactly on the host)",
         st.get("failed_uploads", 0)),
        ("draft_active", "gauge", "1 while a draft model runs", int(m["draft"] == "active")),
        ("draft_acceptance", "gauge", "accepted / drafted tokens", st.get("acceptance", 0.0)),
        ("draft_mean_k", "gauge", "mean draft tokens per step", st.get("mean_k", 0.0)),
    ]
    lines = ["# HELP pyspecter_requests_total requests by outcome", "# TYPE pyspecter_requests_total counter"]
    lines += [f'pyspecter_requests_total{{outcome="{k}"}} {v}' for k, v in m["requests"].items()]
    for key, help_ in (("client_errors", "HTTP responses 4xx by status"),
                       ("server_errors", "HTTP responses 5xx by status")):
        if key in m:
            lines += [f"# HELP pyspecter_http_{key}_total {help_}", f"# TYPE pyspecter_http_{key}_total counter"]
            lines += [f'pyspecter_http_{key}_total{{status="{k}"}} {v}' for k, v in sorted(m[key].items())]
    for k, v in m.get("connections", {}).items():
        kind = "gauge" if k == "open" else "counter"
        name = f"connections_{k}" + ("" if kind == "gauge" else "_total")
        lines += [f"# HELP pyspecter_{name} HTTP connections {k.replace('_', ' ')}", f"# TYPE pyspecter_{name} {kind}",
                  f"pyspecter_{name} {v}"]
    for name, kind, help_, value in gauges:
        lines += [f"# HELP pyspecter_{name} {help_}", f"# TYPE pyspecter_{name} {kind}",
                  f"pyspecter_{name} {float(value):g}"]
    return "\n".join(lines) + "\n"
