"""Fuzz the CLI with corrupted fixtures: every run must end in a clean result or a one-line error, never a signal.

Each fixture arch gets truncations, bit flips in the header and metadata, and absurd values patched over known
keys and tensor infos. Every variant goes through `pyspecter inspect`; the ones it accepts (the files llama.cpp
would be handed) are loaded and decoded with `pyspecter generate`, a seeded subset also with `pyspecter verify`.
A variant that passes inspect but makes llama.cpp abort means gguf_check.py is missing a rule.

`inspect` and `generate` runs share one child process per command: the CLI's own entry point (``cli.main``) once
per variant, in a loop, its exit code and stderr kept per variant. A process per run cost about 0.45 s of startup
each, most of the test's time. A child that dies (llama.cpp aborting on a variant) or hangs has the variant it was
on, and the ones after, run a process each, so the signal is still seen and named. A seeded sample of each loop is
also run a process each, and must end the same way. `verify` runs keep a process each.

PYSPECTER_TEST_SEED picks the random variants (default below); the seed is printed and named in failures.
"""

from __future__ import annotations

import json
import math
import os
import random
import shutil
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import gguf
import numpy as np
import pytest

from pyspecter.models.tiny import TINY_MODELS, TinySpec, build_tiny


def cli_args(command: str, model: Path, spec: TinySpec) -> list[str]:
    """The one place that spells the CLI invocations (flags may be renamed): the arguments after `pyspecter`."""
    return {
        "inspect": ["inspect", str(model)],
        "verify": ["verify", str(model), "--slots", str(2 * spec.n_expert_used), "-n", "2"],
        # one thread: two runs side by side on two cores, and ggml's spinning barrier hates sharing a core
        "generate": ["generate", str(model), "-p", "hi", "-n", "2", "--threads", "1"],
    }[command]


SEED = int(os.environ.get("PYSPECTER_TEST_SEED", "1729"))
ARCHS = ["tiny-qwen3moe", "tiny-qwen2moe", "tiny-mixtral", "tiny-gptoss"]
N_TRUNCATE, N_HEADER_FLIPS, N_VALUE_FLIPS = 4, 6, 3  # random variants per arch, on top of the fixed patches
N_VERIFY = 8  # variants accepted by inspect that also go through verify (seeded choice)
N_ALONE = {"inspect": 12, "generate": 6}  # loop runs repeated as a process of their own (seeded choice)
WORKERS = 2
TIMEOUT_S = 120
# ggml's abort handler runs gdb for a backtrace; skip it (slow, and the signal is what the test looks at)
ENV = {**os.environ, "GGML_NO_BACKTRACE": "1"}

BIG = 2**32 - 1
NAN, INF = math.nan, math.inf


@dataclass
class Variant:
    arch: str
    what: str
    path: Path


@dataclass
class Outcome:
    variant: Variant
    command: str
    returncode: int
    stderr: str

    def problem(self) -> str | None:
        if self.returncode < 0:
            return f"killed by signal {-self.returncode}"
        if "Traceback" in self.stderr:
            return "traceback"
        if self.returncode not in (0, 2):
            return f"exit code {self.returncode}"
        return None

    def describe(self) -> str:
        tail = " | ".join(self.stderr.strip().splitlines()[-3:])[:300]
        return f"{self.command} {self.variant.arch} [{self.variant.what}]: {self.problem()}: {tail}"


# --- variants ------------------------------------------------------------------------------------------------

def _kv_patches(spec: TinySpec) -> list[tuple[str, Any]]:
    """Absurd values over keys the fixtures have (same GGUF type, written in place)."""
    a = spec.arch + "."
    return [
        *((a + "expert_count", v) for v in (0, 1, spec.n_expert + 1, 1025)),
        *((a + "expert_used_count", v) for v in (0, spec.n_expert + 1)),
        *((a + "block_count", v) for v in (0, spec.n_layer - 1, spec.n_layer + 1, 513)),
        *((a + "attention.head_count", v) for v in (0, 3, spec.n_head * 2)),
        *((a + "attention.head_count_kv", v) for v in (0, 3)),
        *((a + "embedding_length", v) for v in (0, spec.n_embd + 1)),
        *((a + "context_length", v) for v in (0, 1, BIG)),
        *((a + "feed_forward_length", v) for v in (0, BIG)),
        *((a + "expert_feed_forward_length", v) for v in (0, 1)),
        *((a + "expert_shared_feed_forward_length", v) for v in (0,)),
        *((a + "attention.key_length", v) for v in (0, spec.head_dim + 2)),
        *((a + "attention.value_length", v) for v in (spec.head_dim * 2,)),
        *((a + "rope.dimension_count", v) for v in (0, spec.head_dim - 1, spec.head_dim - 2, spec.head_dim * 4)),
        *((a + "rope.freq_base", v) for v in (0.0, -1.0, NAN, INF, 3e38)),
        *((a + "attention.layer_norm_rms_epsilon", v) for v in (-1e-6, NAN, INF, 0.0, 1e30)),
        *((a + "attention.sliding_window", v) for v in (0, 1, BIG)),
    ]


def _patch_kv(path: Path, key: str, value: Any) -> bool:
    r = gguf.GGUFReader(path, "r+")
    f = r.fields.get(key)
    if f is None:
        return False
    f.parts[f.data[0]][0] = value
    r.data.flush()
    return True


def _patch_token(path: Path, index: int, text: bytes) -> None:
    """Overwrite a token string with one of the same length (tok_1 -> tok_2 makes a duplicate)."""
    r = gguf.GGUFReader(path, "r+")
    f = r.fields["tokenizer.ggml.tokens"]
    part = f.parts[f.data[index]]
    assert len(part) == len(text)
    part[:] = np.frombuffer(text, np.uint8)
    r.data.flush()


def _patch_tensor(path: Path, name: str, part: int, index: int, value: Callable[[int], int]) -> None:
    """Tensor info parts: name_len, name, n_dims, dims (ggml ne), type, offset."""
    r = gguf.GGUFReader(path, "r+")
    t = next(t for t in r.tensors if t.name == name)
    arr = t.field.parts[part]
    arr[index] = value(int(arr[index]))
    r.data.flush()


def _tensor_patches(spec: TinySpec) -> list[tuple[str, Callable[[Path], None]]]:
    exps = "blk.1.ffn_up_exps.weight"
    return [
        ("token_embd ne1+1", lambda p: _patch_tensor(p, "token_embd.weight", 3, 1, lambda v: v + 1)),
        ("token_embd ne0*2", lambda p: _patch_tensor(p, "token_embd.weight", 3, 0, lambda v: v * 2)),
        (f"{exps} ne2-1", lambda p: _patch_tensor(p, exps, 3, 2, lambda v: v - 1)),
        (f"{exps} ne2+1", lambda p: _patch_tensor(p, exps, 3, 2, lambda v: v + 1)),
        (f"{exps} ne0=1", lambda p: _patch_tensor(p, exps, 3, 0, lambda v: 1)),
        (f"{exps} n_dims=2", lambda p: _patch_tensor(p, exps, 2, 0, lambda v: 2)),
        (f"{exps} type=99", lambda p: _patch_tensor(p, exps, 4, 0, lambda v: 99)),
        (f"{exps} type=F32", lambda p: _patch_tensor(p, exps, 4, 0, lambda v: 0)),
        (f"{exps} offset huge", lambda p: _patch_tensor(p, exps, 5, 0, lambda v: 2**40)),
        (f"{exps} offset+32", lambda p: _patch_tensor(p, exps, 5, 0, lambda v: v + 32)),
        ("duplicate token", lambda p: _patch_token(p, 1, b"tok_2")),
        ("token equal after NUL", lambda p: _patch_token(p, 11, b"tok_1\0")),
    ]


def make_variants(arch: str, src: Path, out: Path, rng: random.Random) -> list[Variant]:
    spec = TINY_MODELS[arch]
    data = src.read_bytes()
    reader = gguf.GGUFReader(src)
    data_start = min(int(t.data_offset) for t in reader.tensors)
    info_start = min(int(t.field.offset) for t in reader.tensors)
    numeric = [f for f in reader.fields.values()
               if f.types and f.types[0] not in (gguf.GGUFValueType.STRING, gguf.GGUFValueType.ARRAY)
               and not f.name.startswith("GGUF.")]
    variants: list[Variant] = []

    def new(what: str, content: bytes | None = None) -> Path:
        path = out / f"{arch}-{len(variants):03d}.gguf"
        if content is None:
            shutil.copyfile(src, path)
        else:
            path.write_bytes(content)
        variants.append(Variant(arch, what, path))
        return path

    # truncations: in the KV section, the tensor infos and the data
    cuts = [rng.randrange(8, info_start), rng.randrange(info_start, data_start), data_start,
            *(rng.randrange(data_start, len(data)) for _ in range(N_TRUNCATE - 3))]
    for cut in cuts:
        new(f"truncated at {cut}/{len(data)}", data[:cut])
    # bit flips anywhere before the tensor data: counts, key names and lengths, types, values, tensor infos
    for _ in range(N_HEADER_FLIPS):
        buf = bytearray(data)
        flips = [(rng.randrange(4, data_start), rng.randrange(8)) for _ in range(rng.randint(1, 3))]
        for pos, bit in flips:
            buf[pos] ^= 1 << bit
        new("flipped " + ", ".join(f"byte {p} bit {b}" for p, b in flips), bytes(buf))
    # bit flips inside numeric metadata values
    for _ in range(N_VALUE_FLIPS):
        f = rng.choice(numeric)
        value = f.parts[f.data[0]]
        start = int(f.offset) + sum(int(p.nbytes) for p in f.parts[: f.data[0]])
        pos, bit = start + rng.randrange(value.nbytes), rng.randrange(8)
        buf = bytearray(data)
        buf[pos] ^= 1 << bit
        new(f"flipped {f.name} bit {8 * (pos - start) + bit}", bytes(buf))
    for key, value in _kv_patches(spec):
        if key in reader.fields:
            path = new(f"{key}={value}")
            assert _patch_kv(path, key, value)
    for what, patch in _tensor_patches(spec):
        patch(new(what))
    return variants


# --- running -------------------------------------------------------------------------------------------------

def run(command: str, variant: Variant) -> Outcome:
    argv = [sys.executable, "-m", "pyspecter", *cli_args(command, variant.path, TINY_MODELS[variant.arch])]
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=TIMEOUT_S, env=ENV,
                           stdin=subprocess.DEVNULL)
        return Outcome(variant, command, p.returncode, p.stderr)
    except subprocess.TimeoutExpired:
        return Outcome(variant, command, 124, f"timed out after {TIMEOUT_S} s")


def run_all(command: str, variants: list[Variant]) -> list[Outcome]:
    with ThreadPoolExecutor(WORKERS) as pool:
        return list(pool.map(lambda v: run(command, v), variants))


# One child runs the CLI's entry point once for each argument list on stdin (JSON, one a line) and writes one JSON
# line per run: its exit code and what it wrote to stderr (a traceback included, as a process would print it).
_LOOP = r"""
import contextlib, io, json, sys, traceback
from pyspecter.cli import main
for line in sys.stdin:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        sys.argv = ["pyspecter", *json.loads(line)]
        try:
            main()
            code = 0
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            traceback.print_exc()
            code = 1
    print(json.dumps({"code": code, "stderr": err.getvalue()}), flush=True)
"""


def _error_lines(stderr: str) -> list[str]:
    return [line for line in stderr.splitlines() if line.startswith("pyspecter: error:")]


def run_in_one(command: str, variants: list[Variant]) -> list[Outcome]:
    """``run(command, v)`` for every variant, in one child process, in order (module docstring); the variants after
    the one a child died on (or hung on) run a process each, that one first."""
    argvs = [cli_args(command, v.path, TINY_MODELS[v.arch]) for v in variants]
    try:
        p = subprocess.run([sys.executable, "-c", _LOOP], input="".join(json.dumps(a) + "\n" for a in argvs),
                           capture_output=True, text=True, timeout=TIMEOUT_S * 4, env=ENV)
        out, died = p.stdout, p.returncode != 0
    except subprocess.TimeoutExpired as e:
        out, died = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or ""), True
    done = [json.loads(line) for line in out.splitlines()]
    assert died or len(done) == len(variants), f"the {command} loop skipped {len(variants) - len(done)} variants"
    return ([Outcome(v, command, d["code"], d["stderr"]) for v, d in zip(variants, done, strict=False)]
            + run_all(command, variants[len(done):]))


def same_alone(outcomes: list[Outcome], n: int, seed: int) -> None:
    """A seeded sample of a loop's outcomes, run again a process each, must end the same way (its own generator,
    so the samples the test draws from ``rng`` are the ones this seed always drew)."""
    sample = random.Random(seed).sample(outcomes, min(n, len(outcomes)))
    if not sample:
        return
    for o, alone in zip(sample, run_all(sample[0].command, [o.variant for o in sample]), strict=True):
        assert (alone.returncode, _error_lines(alone.stderr)) == (o.returncode, _error_lines(o.stderr)), \
            f"seed {SEED}: {o.command} {o.variant.what} ({o.variant.arch}) ends differently in its own " \
            f"process: {alone.describe()} against {o.describe()}"


@pytest.mark.slow
def test_fuzz_corrupt_ggufs(tmp_path: Path) -> None:
    print(f"\nPYSPECTER_TEST_SEED={SEED}")
    t0 = time.monotonic()
    rng = random.Random(SEED)
    fixtures = {arch: build_tiny(arch) for arch in ARCHS}

    # the pristine fixtures must load and decode, or the runs below would prove nothing
    pristine = [Variant(arch, "pristine", path) for arch, path in fixtures.items()]
    for o in run_all("generate", pristine):
        assert o.returncode == 0, f"seed {SEED}: unmodified fixture fails: {o.describe()}"

    variants = [v for arch, src in fixtures.items() for v in make_variants(arch, src, tmp_path, rng)]
    inspected = run_in_one("inspect", variants)
    same_alone(inspected, N_ALONE["inspect"], SEED + 1)
    accepted = [o.variant for o in inspected if o.returncode == 0]
    for o in inspected:
        if o.returncode != 0:
            o.variant.path.unlink(missing_ok=True)
    decoded = run_in_one("generate", accepted)
    same_alone(decoded, N_ALONE["generate"], SEED + 2)
    verified = run_all("verify", rng.sample(accepted, min(N_VERIFY, len(accepted))))

    outcomes = inspected + decoded + verified
    failures = [o.describe() for o in outcomes if o.problem()]
    counts = Counter((o.command, o.returncode) for o in outcomes)
    summary = (f"seed {SEED}: {len(variants)} variants over {len(ARCHS)} archs; inspect refused "
               f"{len(variants) - len(accepted)}, accepted {len(accepted)}; generate ran {len(decoded)} "
               f"(exit 0: {counts['generate', 0]}, exit 2: {counts['generate', 2]}), verify ran {len(verified)}; "
               f"{time.monotonic() - t0:.0f} s")
    print(summary)
    assert len(variants) >= 200
    assert not failures, summary + "\n" + "\n".join(failures)
