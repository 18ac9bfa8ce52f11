#!/usr/bin/env bash
# tools/gpu_check.sh: pyspecter's CUDA path checked end to end, in one prepared run, on a machine with an NVIDIA GPU.
#
#   bash tools/gpu_check.sh --prepare        here, where the package registry is reachable: writes .gpu/ (git-
#                                            ignored): the pinned sdist trimmed to ~2 MiB; the GPU half of the CUDA
#                                            build (tools/cuda_part.py: libggml-cuda and libggml, ~25 MiB, for
#                                            GPU_CHECK_CUDA_ARCH, default 90; the CUDA build here first, ~15 min on 2
#                                            cores when none is cached; GPU_CHECK_CUDA_PART=0: none); a wheelhouse of
#                                            every runtime dependency (pyproject's, transitively, read now) for the
#                                            GPU machine's Python: 3.12 x86_64, else GPU_CHECK_PYVER / GPU_CHECK_ARCH;
#                                            and bench-qwen3moe's learned predictor (fitted here first if need be);
#                                            fails when .gpu/ is over the device tool's 64 MiB carry limit
#   bash tools/gpu_check.sh --list-requirements   what --prepare starts from: pyproject's dependencies
#   bash tools/gpu_check.sh                  on the GPU machine, from the repository root, with .gpu/ carried along
#                                            (the device tool: carry [".gpu"]); results under $OUT
#   GPU_CHECK_DRY=1 bash tools/gpu_check.sh  anywhere: the same steps against this checkout's CPU build (or the one
#                                            the venv has linked; GPU_CHECK_DRY_BUILD=1: build it, from .gpu/ too),
#                                            with GPU_CHECK_PYTHON a bare venv to rehearse the GPU machine; the device a
#                                            local `pyspecter rpc-server` (GPU_CHECK_DEVICE=cpu for none: bench's
#                                            device-only policies then fail, a row says so)
#
# The steps, each time-boxed (timeout) and recorded; a failure is a row of the table and the run goes on:
#   1. python: the wheelhouse installed offline into a scratch folder first on PYTHONPATH (pip from the wheelhouse
#      where the interpreter has none), every requirement's version checked, and `pyspecter --help` (the CLI imports)
#   2. build: with .gpu/cuda-part.tar.xz, `tools/cuda_part.py splice`: this machine's CPU build (its own native
#      flags; seconds on 16 cores) with the carried libggml-cuda and libggml, when they were built from the same
#      sdist, patches, CMake options, architecture and CUDA major release, and only if stock then decodes a fixture
#      on the device through it to finite logits (a row says why not); else SPECTER_CUDA=1 tools/build_llama.py (~170 s on 16 cores), both from
#      .gpu/llama-src.tar.xz (SPECTER_SDIST); one architecture (the GPU's compute capability, else 90;
#      SPECTER_CUDA_ARCH wins), flash-attention kernels left out; its own cache key; the bindings are used through
#      PYTHONPATH (--print-root), whatever the interpreter has linked
#   3. device: nvidia-smi; the probe (tools/gpu_probe.cu, compiled with nvcc, the CUDA runtime alone, seconds):
#      a host wait's and a host visit's floor, one expert uploaded or read zero-copy from pinned host memory, H2D
#      rates pinned and pageable, to $OUT/gpu_probe.json; `pyspecter inspect tiny-qwen3moe --device cuda0`
#      (the device enumerates, memory); and tools/mmid_check.py: patch 0008's negative ids on each MUL_MAT_ID
#      kernel path it touches (mmvq, its several-token kernel, MMQ, MMF, the fused gate+up+GLU), against the CPU
#   4. verify: every fixture arch (pyspecter/models/tiny.py TINY_MODELS) with --device cuda0, slots k, E/2 and E,
#      misses wait and cpu, and at E/2 mapped (the GPU reads misses from pinned host memory: decode's with MMVQ/MMF,
#      and with the long prompt a prompt ubatch's with MMQ, MMF or cuBLAS), and at E/2 a hot set (--hot, moving between decodes, what a
#      layer plan's hot slot layers run) with misses cpu and mapped; verify's `contract_ok` decides where its
#      JSON has one (the GPU contract: never NaN/inf,
#      every expert in a slot = stock-device, with misses no further from stock-device than stock's --cpu-moe run;
#      the row shows the reference and the bound), else the CPU criterion against stock with the same placement
#      (identical greedy tokens, max |dlogit| <= 1e-4); plus one prompt of >= 32 tokens per arch (the ubatch where
#      op offload would kick in); run breadth first (every arch's first case, then every arch's second, ...). A step
#      the run's budget cuts short, or leaves no time for, is a skip row saying so, not a failure. Misses are
#      negative ids on CUDA (patch 0008, never run on a GPU before); each arch's first case runs again with zero
#      slots (SPECTER_ZERO_SLOTS=1), and if only the negative-id cases fail, steps 5 and 6 run with zero slots
#   5. bench: `verify --forced` of the bench model (the contract on teacher-forced real text), then one VRAM
#      budget (GPU_CHECK_VRAM, default 50% of the expert bytes) on the largest model made here in time (bench-qwen3moe: random weights, generated locally), policies stock-device, all-resident (the two
#      give the routing round trip per layer), stock-cpu-moe, stock-n-cpu-moe, plan (the layer plan of full, host
#      and slot layers the cost model chooses at the budget), on-demand-lru, on-demand-mapped (--miss mapped),
#      static-hot-mapped (the chat profile's hottest experts, misses read by the GPU, nothing uploaded),
#      adaptive-hot-mapped (the same set re-chosen between decodes from the text's routing), plan-mapped
#      (the layer plan priced and run with --miss mapped), learned (layer-ahead prefetches: its
#      predictor, fitted by --prepare, is carried in .gpu/predictors and used only for the same model file) and
#      specter (with a draft made by `pyspecter draft`), as far as this pyspecter's `bench --help` offers --device
#      and them; what is missing is a row saying so
#   6. big (issue 42's GPU benchmark; GPU_CHECK_BIG=0 leaves it out): tools/gpu_bench.py builds big-qwen3moe-q4
#      (Qwen3-30B-A3B's shapes, Q4_0 experts, ~17 GB, made here from random bytes: nothing carried) and benches it
#      at 8 GiB and 16 GiB of VRAM for experts (GPU_CHECK_BIG_MODEL, GPU_CHECK_BIG_BUDGETS): stock --n-cpu-moe N at
#      equal VRAM, stock --cpu-moe, the layer plan, the plan with --miss mapped, the engine, on-demand-mapped (the
#      floor of host syncs: stock-device's in step 5's
#      bench of the same architecture, else benched once),
#      teacher-forced; ms per token, host switches per MoE layer (split count and counted synchronisations), upload
#      GB/s beside the link, hit rate, the cost model's prediction; $OUT/gpu_bench.md (for docs/BENCHMARKS.md) and
#      $OUT/gpu_bench.json. Its time guard skips the 16 GiB set, saying so, when the 8 GiB set's own time does not
#      fit in what is left. Steps 4 and 5 stop early enough to leave it GPU_CHECK_BIG_S; step 5 then leaves out
#      specter (its draft takes a minute and a half to make)
# Then one table (stdout and $OUT/table.txt) whose failed rows give the cause found in the output (a traceback's
# exception and where, else the first error line; a timeout or a signal such as SEGV), and under it the device
# rows' host round trips beside their time per token (llama.cpp's splits of the one-token graph, host switches per
# MoE layer: stock --cpu-moe, stock --n-cpu-moe at equal memory, our plan; and for rows that uploaded, the bytes a
# token, the copies' own GB/s and the most batches in flight; also $OUT/device_table.txt),
# $OUT/results.json (every step; the JSON that verify and
# bench printed), $OUT/build_log_tail.txt, $OUT/bench.json and $OUT/gpu_check.log (every command's output).
#
# Assumptions about the GPU machine (this workplace's H100 and H200 kinds: compute capability 9.0, 16 cores, no
# network; run by the device tool):
#   - bash with coreutils (timeout), a C/C++ compiler, CMake >= 3.18 on PATH or as this Python's `cmake` package;
#   - nvcc (CUDA 12 or 13) at $CUDACXX, $CUDA_HOME/bin, /usr/local/cuda/bin or on PATH; the driver's libcuda.so.1;
#   - cuBLAS in that toolkit or as NVIDIA's wheel in the Python (nvidia-cublas for CUDA 13, as PyTorch brings it);
#   - Python >= 3.11 (GPU_CHECK_PYTHON: an interpreter or a venv's folder; else python3) of the version and machine
#     the wheelhouse was prepared for, with nothing installed (not even pip); its own packages are shadowed by the
#     wheelhouse's; nothing is fetched;
#   - the source is .gpu/llama-src.tar.xz (or SPECTER_SDIST); without either the build tries the registry.
# Sized for one device-tool command (10 minutes at most, in a 15-minute lease that also pays the machine's start):
# GPU_CHECK_BUDGET_S (default 575: run it with the device tool's timeout_s 600) bounds the whole run; the verify
# steps stop early enough to leave GPU_CHECK_BENCH_S (default 110) for the bench model and its bench, and those
# GPU_CHECK_BIG_S (default 250; 310 when the carried CUDA part is used) for step 6. With the CUDA build's ~170 s that
# leaves verify about half a minute on 16 cores, less the probe's seconds (breadth first: every arch's first case);
# with the CUDA part (a CPU build and a decode check, estimated at 30-40 s there) about a minute and a half.
# GPU_CHECK_BIG=0 gives step 6's time back to steps 4 and 5.
# Other knobs: OUT (default out/gpu_check), GPU_CHECK_MODEL (default bench-qwen3moe; dry run tiny-qwen3moe),
# GPU_CHECK_DEVICE (default cuda0), GPU_CHECK_PAR (verify runs at a time: 4, dry run 1), GPU_CHECK_REPEAT and
# GPU_CHECK_BENCH_N (bench repeats and decode tokens: 2 and 32, dry run 1 and 8), GPU_CHECK_WORK (scratch folder,
# kept when given; else a fresh one under /tmp, removed at the end).

set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
REPO=$(pwd)

# The runtime requirements: pyproject's [project].dependencies, read when asked (the pins move; nothing is copied
# here). Needs a Python >= 3.11 (tomllib).
requirements() {
    "$1" -c 'import tomllib
print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]))'
}

# pip with nothing but its arguments: this machine's pip configuration (extra indexes, find-links, constraints) and
# PIP_* variables must not decide what the wheelhouse holds or where the GPU machine's pip looks
PIP_CLEAN=(env)
for v in $(compgen -e | grep '^PIP_'); do PIP_CLEAN+=(-u "$v"); done
PIP_CLEAN+=(PIP_CONFIG_FILE=/dev/null)

if [ "${1:-}" = "--list-requirements" ]; then  # what --prepare carries (before dependencies), one a line
    PY=python3
    [ -x .venv/bin/python ] && PY=.venv/bin/python
    requirements "$PY"
    exit
fi

if [ "${1:-}" = "--prepare" ]; then
    # the Python that runs pip here (any >= 3.11); the wheels are for the GPU machine's, GPU_CHECK_PYVER
    PY=python3
    [ -x .venv/bin/python ] && PY=.venv/bin/python
    PYVER=${GPU_CHECK_PYVER:-3.12}
    ARCH=${GPU_CHECK_ARCH:-x86_64}
    [[ $PYVER =~ ^3\.[0-9]+$ ]] || { echo "GPU_CHECK_PYVER=$PYVER: want 3.N, e.g. 3.12" >&2; exit 2; }
    ABI=cp${PYVER/./}
    # manylinux up to glibc 2.28 (numpy's newest wheels need 2.27+): any GPU machine of the last years has that
    PLATFORMS=()
    for p in manylinux_2_28 manylinux_2_27 manylinux_2_17 manylinux2014 manylinux_2_12 manylinux2010 manylinux_2_5 \
        manylinux1; do
        PLATFORMS+=(--platform "${p}_$ARCH")
    done
    TARGET=(--only-binary=:all: --python-version "$PYVER" --implementation cp --abi "$ABI" "${PLATFORMS[@]}")
    rm -f .gpu/llama-src.tar.gz  # an older --prepare's name for it
    "$PY" tools/build_llama.py --trim-sdist .gpu/llama-src.tar.xz || exit 2
    # the GPU half of the CUDA build (tools/cuda_part.py), compiled here so that the lease does not: the CUDA build
    # of this checkout for GPU_CHECK_CUDA_ARCH (default 90: H100, H200), incremental when one is cached, else about
    # 15 min on 2 cores; where nvcc is missing or the build fails, the GPU machine builds CUDA itself
    rm -f .gpu/cuda-part.tar.xz
    if [ "${GPU_CHECK_CUDA_PART:-1}" != 0 ]; then
        # as gpu_check builds there: flash attention's kernels left out whatever this shell says
        if env -u SPECTER_CUDA_FA SPECTER_CUDA=1 SPECTER_CUDA_ARCH=${GPU_CHECK_CUDA_ARCH:-90} \
            "$PY" tools/build_llama.py &&
            env -u SPECTER_CUDA_FA SPECTER_CUDA_ARCH=${GPU_CHECK_CUDA_ARCH:-90} "$PY" tools/cuda_part.py export \
                .gpu/cuda-part.tar.xz; then
            :
        else
            rm -f .gpu/cuda-part.tar.xz
            echo "no CUDA part carried (see above): the GPU machine will build CUDA itself (~170 s of its lease)" >&2
        fi
    fi
    # one wheelhouse, for one Python: a second version would double numpy (~16 MB) against the 64 MiB carry limit
    rm -rf .gpu/wheels
    mkdir -p .gpu/wheels || exit 2
    requirements "$PY" > .gpu/wheels/requirements.txt || exit 2
    echo "$PYVER $ARCH" > .gpu/wheels/PYTHON
    # every dependency, transitively, as resolved for that Python (pydantic comes with a typer that needs it, pyyaml,
    # tqdm and requests with gguf, ...); and pip itself, run from its wheel where the GPU machine's Python has none.
    # No cmake wheel (~30 MB): CMake is assumed there.
    "$PY" -m pip download -q "${TARGET[@]}" -d .gpu/wheels -r .gpu/wheels/requirements.txt pip || exit 2
    # the proof that the wheelhouse alone satisfies pyproject on that Python: resolve from it, offline, as step 1 will
    scratch=$(mktemp -d)
    "${PIP_CLEAN[@]}" "$PY" -m pip install --dry-run --no-index --find-links .gpu/wheels "${TARGET[@]}" \
        --target "$scratch" -r .gpu/wheels/requirements.txt | grep -i '^would install' || exit 2
    rmdir "$scratch"
    # the bench model's learned predictor, for step 5's `learned` row (layer-ahead prefetches beside LRU's coverage
    # in the same run): fitted here once (cached; ~2 min on two cores), carried, not fitted in the lease's time
    rm -rf .gpu/predictors
    mkdir -p .gpu/predictors || exit 2
    read -r model side < <("$PY" -c 'from pyspecter.models.catalog import resolve_model
from pyspecter.learned import sidecar_path
m = resolve_model("bench-qwen3moe", predictor=False)
print(m, sidecar_path(m))') || exit 2
    [ -f "$side" ] || "$PY" -m pyspecter fit-predictor "$model" || exit 2
    cp "$side" .gpu/predictors/ || exit 2
    ls -l .gpu/llama-src.tar.xz .gpu/cuda-part.tar.xz .gpu/wheels .gpu/predictors 2> /dev/null
    size=$(du -sb .gpu | cut -f1)
    echo ".gpu: $((size / 1024 / 1024)) MiB (Python $PYVER $ARCH wheels: $(du -sh .gpu/wheels | cut -f1))"
    # the device tool carries at most 64 MiB of ignored paths in all; the CUDA part goes first (the machine can
    # compile CUDA itself, in ~170 s of its lease)
    if [ "$size" -gt $((64 * 1024 * 1024)) ] && [ -f .gpu/cuda-part.tar.xz ]; then
        rm -f .gpu/cuda-part.tar.xz
        size=$(du -sb .gpu | cut -f1)
        echo ".gpu/ was over the 64 MiB carry limit: the CUDA part left out ($((size / 1024 / 1024)) MiB without it)" >&2
    fi
    if [ "$size" -gt $((64 * 1024 * 1024)) ]; then echo "over the 64 MiB carry limit" >&2; exit 2; fi
    echo "ready: carry .gpu with the working tree (device tool: carry [\".gpu\"]) and run: bash tools/gpu_check.sh"
    exit 0
fi

DRY=${GPU_CHECK_DRY:-0}
OUT=${OUT:-$REPO/out/gpu_check}
WORK=${GPU_CHECK_WORK:-${TMPDIR:-/tmp}/gpu_check.$$}
BUDGET_S=${GPU_CHECK_BUDGET_S:-575}
BENCH_S=${GPU_CHECK_BENCH_S:-110}
BIG=${GPU_CHECK_BIG:-1}
MAPPED=1  # the mapped rows of steps 5 and 6 (--miss mapped); step 4 turns them off when its mapped cases fail
BIG_S=0
[ "$BIG" = 1 ] && BIG_S=${GPU_CHECK_BIG_S:-250}
VRAM=${GPU_CHECK_VRAM:-50%}
if [ "$DRY" = 1 ]; then
    # the dry run's device is an RPC server on this machine: one client at a time, a TCP round trip per switch
    MODEL=${GPU_CHECK_MODEL:-tiny-qwen3moe} REPEAT=${GPU_CHECK_REPEAT:-1} BENCH_N=${GPU_CHECK_BENCH_N:-8}
    PAR=${GPU_CHECK_PAR:-1}
    # step 6 scaled down: the same code path on a 1 GB model at budgets that leave it host layers to plan
    BIG_MODEL=${GPU_CHECK_BIG_MODEL:-bench-qwen3moe} BIG_BUDGETS=${GPU_CHECK_BIG_BUDGETS:-25%,50%} BIG_N=6
else
    MODEL=${GPU_CHECK_MODEL:-bench-qwen3moe} REPEAT=${GPU_CHECK_REPEAT:-2} BENCH_N=${GPU_CHECK_BENCH_N:-32}
    PAR=${GPU_CHECK_PAR:-4}
    BIG_MODEL=${GPU_CHECK_BIG_MODEL:-big-qwen3moe-q4} BIG_BUDGETS=${GPU_CHECK_BIG_BUDGETS:-8GiB,16GiB} BIG_N=16
fi
PY=${GPU_CHECK_PYTHON:-}
if [ -z "$PY" ]; then
    if [ "$DRY" = 1 ] && [ -x .venv/bin/python ]; then PY=$REPO/.venv/bin/python; else PY=$(command -v python3); fi
fi
# a venv's folder stands for its interpreter
if [ -d "$PY" ] && [ -x "$PY/bin/python" ]; then PY=$PY/bin/python; fi
mkdir -p "$OUT" "$WORK" || exit 2
LOG=$OUT/gpu_check.log
STEPS=$WORK/steps.tsv
: > "$LOG"
: > "$STEPS"
T0=$(date +%s)
DEADLINE=$((T0 + BUDGET_S))
BIG_FROM=$((DEADLINE - BIG_S))  # steps 4 and 5 end by then
RPC_PID=

# the Python side of the report, written once: gc.py cause | python | build-detail | verify-row | bench-rows |
# probe-detail | device-table | table
cat > "$WORK/gc.py" <<'EOF'
import json, re, sys
from pathlib import Path


def last_json(path):
    """The JSON object a command printed, among whatever else it wrote (its stderr shares the file)."""
    t = Path(path).read_text()
    dec, found = json.JSONDecoder(), None
    for i in [0] + [i + 1 for i, c in enumerate(t) if c == "\n"]:
        if t.startswith("{", i):
            try:
                found = dec.raw_decode(t, i)[0]
            except ValueError:
                continue
    if found is None:
        raise ValueError(f"no JSON object in {path}")
    return found


def cause(path):
    """The real cause of a failed step, in a line or two: a Python traceback's exception line and where it was
    raised; else the output's first error line (the root, before its consequences) and the one after it; else the
    last line."""
    lines = [ln.rstrip() for ln in Path(path).read_text(errors="replace").splitlines()
             if ln.strip() and not ln.startswith("-- exit ")]
    tb = [i for i, ln in enumerate(lines) if ln.startswith("Traceback (most recent call last)")]
    if tb:
        frames, exc = [], None
        for ln in lines[tb[-1] + 1:]:
            if ln.startswith("  File "):
                frames.append(ln)
            elif not ln.startswith(" "):
                exc = ln
                break
        if exc:
            where = ""
            if frames and (m := re.match(r'  File "([^"]+)", line (\d+)', frames[-1])):
                where = f" (at {'/'.join(Path(m[1]).parts[-2:])}:{m[2]})"
            print(exc[:240] + where)
            return
    err = re.compile(r"error|fatal|abort|failed|cannot|no such|not found|illegal|segmentation|killed", re.I)
    for i, ln in enumerate(lines):
        if err.search(ln):
            print(" | ".join(x.strip() for x in lines[i:i + 2])[:300])
            return
    print(lines[-1][:300] if lines else "(no output)")


def python(reqs, site, wheels=""):
    """Every requirement's distribution, its version and where it comes from (the wheelhouse's scratch folder or
    the interpreter), or MISSING / OUT OF RANGE: exit 1 then."""
    import importlib.metadata as md
    # the version ranges are read with pip's packaging: the interpreter's pip, else the wheelhouse's, as a zip
    sys.path += [str(w) for w in sorted(Path(wheels).glob("pip-*.whl"))] if wheels else []
    try:
        from pip._vendor.packaging.requirements import Requirement
    except ImportError:
        Requirement = None
    got, bad = [], []
    for line in Path(reqs).read_text().splitlines():
        line = line.split("#")[0].strip()
        if not line:
            continue
        name = re.match(r"[A-Za-z0-9._-]+", line)[0]
        try:
            dist = md.distribution(name)
        except md.PackageNotFoundError:
            bad.append(f"{name} MISSING")
            continue
        v = dist.version
        if Requirement is not None and not Requirement(line).specifier.contains(v, prereleases=True):
            bad.append(f"{name} {v} OUT OF RANGE ({line})")
            continue
        from_site = site and str(Path(dist.locate_file("")).resolve()).startswith(str(Path(site).resolve()))
        got.append(f"{name} {v}" + ("" if from_site else " (interpreter's)"))
    print(f"Python {sys.version.split()[0]} at {sys.executable}; " + ", ".join(bad + got)
          + ("" if Requirement else " (versions unchecked: no pip to read the ranges)"))
    sys.exit(1 if bad else 0)


def build_detail(info_path, what):
    i = json.loads(Path(info_path).read_text())
    c, part = i.get("cuda_setup") or {}, i.get("cuda_part")
    print(f"{what}: key {i['key']}, built in {i['build_s']:.0f}s on {i['cpus']} cpus"
          + (f", CUDA {c['release']} arch {c['arch']}, cuBLAS {c['cublas']}, libcuda {c['libcuda']}" if c else "")
          + (f"; GPU half from CUDA build {part['key']} (CUDA {part['cuda_release']}, {part['cpus']} cpus)"
             if part else ""))


def _num(x):
    return f"{x:.1e}" if isinstance(x, (int, float)) and not isinstance(x, bool) else str(x)


def verify_row(path, rc):
    """STATUS<tab>DETAIL of one verify case from the JSON it printed (exit 3 when it printed none). The GPU
    exactness contract decides where verify reports one (contract_ok: never NaN/inf; every expert in a slot: stock
    with every expert on the device; with misses: no further from stock-device than stock's own --cpu-moe run);
    else the CPU criterion: identical tokens and max |dlogit| <= 1e-4 against stock with the same placement."""
    try:
        r = last_json(path)
    except (OSError, ValueError):
        sys.exit(3)
    d = r.get("max_abs_logit_diff", float("nan"))
    same = r.get("identical_tokens")
    detail = (f"{'IDENTICAL' if same else 'DIFFERENT'} tokens ({r.get('n_tokens')} after a "
              f"{r.get('n_prompt_tokens')}-token prompt) on {r.get('device')}, max |dlogit| vs stock same placement "
              f"{_num(d)}, hit {100 * r.get('hit_rate', 0):.0f}%, {r.get('uploads')} uploads")
    if r.get("host_experts"):  # CUDA_Host_experts: pinned (uploads at the link rate, mapped reads in place)
        detail += f" from {r['host_experts']}"
    if "contract_ok" in r:
        ok = bool(r["contract_ok"])
        c = r.get("contract") or {}
        diff = c.get("max_abs_logit_diff_vs_device")
        shown = {"ok", "finite", "reference", "max_abs_logit_diff_vs_device", "bound", "bound_is"}
        detail += (f"; contract {'met' if ok else 'NOT MET'}: " + ("" if c.get("finite", True) else "NaN/inf! ")
                   + f"|dlogit| vs {c.get('reference', 'reference')} {_num(diff)} "
                   + ("<=" if ok else "vs") + f" bound {_num(c.get('bound'))}"
                   + (f" ({c['bound_is']})" if c.get("bound_is") else "")
                   + "".join(f", {k} {_num(v)}" for k, v in c.items()
                             if k not in shown and isinstance(v, (int, float, str, bool))))
    else:
        ok = bool(same) and d <= 1e-4  # a NaN fails too
        detail += " (CPU criterion: verify's JSON has no contract)"
    if r.get("miss") == "mapped":  # the device read the misses from the host copy: a case where it never did tests
        t = r.get("device_tables") or {}  # nothing of it (speculation off, say)
        rows, spec = t.get("mapped_rows", 0), t.get("spec_ubatches", 0)
        detail += f"; {spec} ubatches speculated, {rows} rows read from the host copy"
        if not rows and r.get("hit_rate", 1.0) < 1.0:
            ok, detail = False, detail + " (the mapped path never ran)"
    if rc not in ("0", "1"):  # it printed its result, then failed
        print(f"FAIL\texit {rc} after its result: {detail}")
    else:
        print(f"{'ok' if ok else 'DIFF'}\t{detail}")


def bench_rows(path, steps, status, secs, cause=""):
    r = last_json(path)
    rows = [("bench", status, secs, (f"{cause}; " if cause else "") +
             f"{r['model'].rsplit('/', 1)[-1]} on {r.get('device')}, budget {r['budget']} = {r['slots_per_layer']}/"
             f"{r['n_expert']} slots per layer, {r['decode_tokens']} decode tokens x {r['repeat']}"
             + (f", routing round trip {r['round_trip_us_per_layer']:.1f} us per MoE layer"
                if "round_trip_us_per_layer" in r else ""))]
    for name, p in r["policies"].items():
        if "skipped" in p:
            rows.append((f"bench {name}", "skip", "", str(p["skipped"])))
            continue
        same = p.get("same_tokens_as_stock")
        splits = (f", {p['splits_per_token']} splits/token = {p['host_switches_per_moe_layer']:.2f} host switches "
                  f"per MoE layer" if "splits_per_token" in p else "")
        if "switches_taken_per_moe_layer" in p:  # as the scheduler ran them (speculated ubatches take none)
            splits += f" planned, {p['switches_taken_per_moe_layer']:.2f} taken"
        rows.append((f"bench {name}", "ok", "",
                     f"{p['decode_tok_s']:.1f} tok/s, TPOT {p['tpot_ms']:.2f} ms, prefill "
                     f"{p.get('prefill_tok_s', float('nan')):.0f} tok/s, hit {100 * p.get('hit_rate', 1):.0f}%, "
                     f"{p['bytes_per_token'] / 1024:.0f} KiB/token" + splits
                     + ("" if same is None else f", {'same' if same else 'DIFFERENT'} tokens as stock")))
    with open(steps, "a") as f:
        for row in rows:
            f.write("\t".join(str(x) for x in row) + "\n")


def probe_detail(path):
    """The probe's row: tools/gpu_probe.cu's JSON, short."""
    p = last_json(path)
    print(f"sync {p['sync_us']:.1f} us, host visit {p['visit_us']:.1f} us; one expert uploaded "
          f"{p['upload_expert_us']:.0f} us, read zero-copy {p['zero_copy_expert_us']:.0f} us (from device memory "
          f"{p['device_expert_us']:.0f}); H2D {p['h2d_pinned_gbps']:.1f} GB/s pinned, {p['h2d_pageable_gbps']:.1f} "
          f"pageable; zero-copy reads {p['zero_copy_gbps']:.1f} GB/s, device {p['device_read_gbps']:.0f}"
          + (f"; a landing waited {p['wait_spin_us']:.0f} us ({p['wait_spin_cpu_us']:.0f} us CPU), with a "
             f"blocking event {p['wait_block_us']:.0f} us ({p['wait_block_cpu_us']:.0f} us CPU)"
             if "wait_spin_us" in p else ""))


def device_table(bench_json, out):
    """Host round trips beside time per token: stock --cpu-moe, stock --n-cpu-moe at equal device memory, our
    layer plan (and the other device rows bench ran), one table ($OUT/device_table.txt). Splits and switches are
    those the scheduler took per decode token where bench counted them, else llama.cpp's planned count."""
    r = last_json(bench_json)
    order = ["stock-cpu-moe", "stock-n-cpu-moe", "plan", "plan-mapped", "stock-device", "all-resident",
             "on-demand-lru", "on-demand-mapped", "learned", "specter"]
    pol = r["policies"]
    names = [n for n in order if n in pol] + [n for n in pol if n not in order]
    lines = [f"{r['model'].rsplit('/', 1)[-1]} on {r.get('device')}, budget {r['budget']}",
             f"{'placement':<18} {'TPOT ms':>9} {'splits/token':>13} {'switches/MoE layer':>19} "
             f"{'syncs/token':>11} {'wait/split/launch/settle ms':>27}  note"]
    for n in names:
        p = pol[n]
        if "tpot_ms" not in p:
            lines.append(f"{n:<18} {'-':>9} {'-':>13} {'-':>19} {'-':>11} {'-':>27}  {str(p.get('skipped', ''))[:60]}")
            continue
        note = f"N={p['n_cpu_moe']}" if "n_cpu_moe" in p else ""
        if n in ("plan", "plan-mapped") and (lp := r.get("layer_plan" if n == "plan" else "layer_plan_mapped")):
            note = (f"{lp['plan']}; predicted {lp['predicted_ms']:.2f} ms vs stock --n-cpu-moe "
                    f"{lp['predicted_stock_n_cpu_moe_ms']:.2f}, --cpu-moe {lp['predicted_stock_cpu_moe_ms']:.2f}")
        # where the token went (bench's device times): host waits, CPU splits, device launches, and the bookkeeping
        # after a speculated ubatch (the device idle); the rest is copies
        times = "/".join(f"{p[k]:.2f}" if k in p else "-" for k in
                         ("host_wait_ms_per_token", "host_split_ms_per_token", "device_launch_ms_per_token",
                          "host_settle_ms_per_token"))
        if p.get("bytes_per_token") and p.get("upload_busy_gbps"):  # what moved, its rate, batches in flight
            note = (note + "; " if note else "") + (f"uploads {p['bytes_per_token'] / 1e6:.1f} MB/token, "
                                                    f"{p['upload_busy_gbps']:.1f} GB/s while copying, "
                                                    f"{p.get('upload_inflight_peak', '-')} in flight at most"
                                                    + (f" from {p['host_experts']}" if p.get("host_experts") else "")
                                                    + (f", landings waited {p['landing_wait_ns_per_token'] / 1e6:.2f} ms"
                                                       f" ({p.get('landing_wait_cpu_ns_per_token', 0) / 1e6:.2f} CPU)"
                                                       if p.get("landing_wait_ns_per_token") else ""))
        if p.get("spec_ubatches_per_token"):  # ubatches with no host visit, and those a miss ran again
            note = (note + "; " if note else "") + (f"speculated {p['spec_ubatches_per_token']:.2f}/token, "
                                                    f"redone {p.get('spec_redos_per_token', 0.0):.2f}")
        if p.get("cuda_graph_warmups_per_token") or p.get("cuda_graph_resets_per_token"):  # ggml-cuda's graphs
            note = (note + "; " if note else "") + (f"CUDA graphs captured {p['cuda_graph_warmups_per_token']:.2f}, "
                                                    f"dropped {p.get('cuda_graph_resets_per_token', 0.0):.2f}/token")
        # as the scheduler took them where counted (a speculated graph is not the one llama.cpp's line reports)
        splits = p.get("splits_computed_per_token", p.get("splits_per_token", "-"))
        switches = p.get("switches_taken_per_moe_layer", p.get("host_switches_per_moe_layer", float("nan")))
        lines.append(f"{n:<18} {p['tpot_ms']:>9.2f} {splits:>13} {switches:>19.2f} "
                     f"{p.get('host_syncs_per_token', float('nan')):>11.1f} {times:>27}  {note}")
    text = "\n".join(lines)
    print(text)
    Path(out, "device_table.txt").write_text(text + "\n")


def zero_fallback(*row_files):
    """STATUS<tab>DETAIL<tab>FALLBACK of the verify rows: whether misses as negative ids (CUDA: patch 0008) held,
    and FALLBACK 1 when only they failed (every zero-slot case passed), so that the benches run with zero slots."""
    rows = [(line.rstrip("\n").split("\t") + [""] * 4)[:4] for f in row_files for line in open(f) if line.strip()]
    # mapped misses need negative ids but are their own mechanism (a GPU reading host memory), and so is a static
    # hot set (no residency engine): their rows say so
    neg = [r for r in rows if "(zero slots)" not in r[0] and "miss=mapped" not in r[0] and "(hot set)" not in r[0]]
    zero = [r for r in rows if "(zero slots)" in r[0]]
    neg_bad, zero_bad = (sum(r[1] not in ("ok", "skip") for r in rs) for rs in (neg, zero))
    if not neg_bad:
        print("ok\tevery verify case ran with them (no zero slots) and passed\t0")
    elif not zero_bad and any(r[1] == "ok" for r in zero):
        print(f"FAIL\t{neg_bad} verify case(s) failed with them, every zero-slot case passed: steps 5 and 6 run "
              "with SPECTER_ZERO_SLOTS=1\t1")
    else:
        print(f"FAIL\t{neg_bad} case(s) failed with them, {zero_bad} with zero slots: not the ids alone\t0")


def table(steps, out, total, dry, device, work):
    out, work = Path(out), Path(work)
    rows = [(line.rstrip("\n").split("\t") + [""] * 4)[:4] for line in open(steps) if line.strip()]
    w = max([len(r[0]) for r in rows] + [10])
    lines = [f"pyspecter gpu_check{' (DRY RUN: CPU build, no GPU)' if dry == '1' else ''}: device {device}, "
             f"{total} s in all", "", f"{'step':<{w}}  {'status':<7} {'s':>4}  detail", "-" * (w + 90)]
    lines += [f"{n:<{w}}  {st:<7} {s:>4}  {d}" for n, st, s, d in rows]
    bad = [r for r in rows if r[1] not in ("ok", "skip")]
    lines += ["", f"{len(rows)} steps: {sum(r[1] == 'ok' for r in rows)} ok, {len(bad)} failed "
              f"({', '.join(r[0] for r in bad) or 'none'}), {sum(r[1] == 'skip' for r in rows)} skipped"]
    text = "\n".join(lines)
    print(text)
    (out / "table.txt").write_text(text + "\n")
    verify = {}
    for f in sorted((work / "verify").glob("*.json")):
        try:
            verify[f.stem] = last_json(f)
        except ValueError:
            verify[f.stem] = {"output": f.read_text()[-2000:]}
    (out / "results.json").write_text(json.dumps({
        "dry_run": dry == "1", "device": device, "total_s": int(total),
        "steps": [{"step": n, "status": st, "seconds": s, "detail": d} for n, st, s, d in rows],
        "verify": verify}, indent=1))


if __name__ == "__main__":
    cmd, args = sys.argv[1].replace("-", "_"), sys.argv[2:]
    globals()[cmd](*args)
EOF
GC=$WORK/gc.py

cleanup() {
    if [ -n "$RPC_PID" ]; then kill "$RPC_PID" 2>/dev/null; wait "$RPC_PID" 2>/dev/null; fi
    if [ -f "$WORK/rpc.txt" ]; then { echo "-- the dry run's rpc-server:"; cat "$WORK/rpc.txt"; } >> "$LOG"; fi
    # the scratch folder (wheels, the draft, raw outputs) goes, unless GPU_CHECK_WORK named it
    if [ -z "${GPU_CHECK_WORK:-}" ]; then rm -rf "$WORK"; fi
}
trap cleanup EXIT

say() { echo "[gpu_check $(($(date +%s) - T0))s] $*" | tee -a "$LOG"; }

# record NAME STATUS SECONDS DETAIL: one row of the table
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$(printf '%s' "$4" | tr '\t\n' '  ' | cut -c1-300)" >> "$STEPS"; }

# run NAME CAP_S UNTIL OUTFILE CMD...: runs CMD under timeout (CAP_S, or less so as to end by UNTIL, an epoch
# second), output to OUTFILE and the log; sets RC (124: timed out, 125: not run for lack of time), SECS and CUT (1:
# its time was cut to end by UNTIL)
RC=0
SECS=0
CUT=0
run() {
    local name=$1 cap=$2 until=$3 outf=$4
    shift 4
    local now left t0
    now=$(date +%s)
    left=$((until - now))
    CUT=0
    [ "$left" -lt "$cap" ] && cap=$left CUT=1
    if [ "$cap" -lt 5 ]; then
        RC=125 SECS=0
        echo "not run: out of time" > "$outf"
        say "$name: not run (out of time)"
        return
    fi
    say "$name (up to ${cap}s): $*"
    t0=$(date +%s)
    timeout -k 10 "$cap" "$@" > "$outf" 2>&1
    RC=$?
    SECS=$(($(date +%s) - t0))
    { cat "$outf"; echo "-- exit $RC after ${SECS}s"; } >> "$LOG"
}

status_of() {  # RC -> word
    case $1 in
        0) echo ok ;;
        # cut short by the run's budget (not by its own cap): out of time, as a step not run for want of it is
        124|137) if [ "$CUT" = 1 ]; then echo skip; else echo TIMEOUT; fi ;;
        125) echo "skip" ;;
        *) echo FAIL ;;
    esac
}

last_line() { grep -v '^\s*$' "$1" 2>/dev/null | tail -1; }

# why RC FILE: what a failed step's row says: a timeout or a signal (a segfault is exit 139), then the real cause in
# the output (gc.py cause: a traceback's exception line, else the first error line), never a guess
why() {
    local rc=$1 f=$2 pre c
    case $rc in
        124|137) if [ "$CUT" = 1 ]; then pre="cut at the run's deadline after ${SECS}s: "; else pre="timed out after ${SECS}s: "; fi ;;
        125) echo "not run: out of time"; return ;;
        *) if [ "$rc" -gt 128 ]; then pre="killed by SIG$(kill -l $((rc - 128)) 2>/dev/null): "; else pre="exit $rc: "; fi ;;
    esac
    c=$("$PY" "$GC" cause "$f" 2>/dev/null) || c=$(last_line "$f")
    echo "$pre$c"
}

# --- 1. python --------------------------------------------------------------------------------------------------
# Nothing but the interpreter is assumed: every runtime dependency comes from the wheelhouse (.gpu/wheels, made by
# --prepare for one Python version), installed offline into a scratch folder that goes first on PYTHONPATH, so the
# versions are the wheelhouse's whatever the interpreter has (the H200's numpy 2.5 and newer typer, say).
WHEELS=$REPO/.gpu/wheels
SITE=$WORK/site
mkdir -p "$SITE"
if [ -z "$PY" ] || ! "$PY" -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null; then
    record "python" FAIL 0 "no Python >= 3.11 (GPU_CHECK_PYTHON=${GPU_CHECK_PYTHON:-unset}, python3=$(command -v python3))"
else
    pyver=$("$PY" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
    reqs=$WORK/requirements.txt
    whl_note="no .gpu/wheels (run --prepare where a registry is reachable): the interpreter's own packages"
    if [ -f "$WHEELS/requirements.txt" ]; then
        cp "$WHEELS/requirements.txt" "$reqs"
        read -r whl_ver whl_arch < "$WHEELS/PYTHON"
        if [ "$whl_ver" != "$pyver" ] || [ "$whl_arch" != "$(uname -m)" ]; then
            record wheels FAIL 0 "the wheelhouse is for Python $whl_ver $whl_arch, $PY is $pyver $(uname -m): \
prepare it with GPU_CHECK_PYVER=$pyver bash tools/gpu_check.sh --prepare"
        else
            # pip: the interpreter's, else the wheelhouse's own wheel run as a zip (a bare Python may have none)
            pip=("$PY" -m pip)
            if ! "$PY" -m pip --version > /dev/null 2>&1; then
                pip=("$PY" "$(ls "$WHEELS"/pip-*.whl | head -1)/pip")
            fi
            run wheels 120 "$DEADLINE" "$WORK/wheels.txt" "${PIP_CLEAN[@]}" PYTHONNOUSERSITE=1 "${pip[@]}" install \
                --no-index --find-links "$WHEELS" --only-binary=:all: --no-compile --no-cache-dir \
                --disable-pip-version-check --target "$SITE" -r "$reqs"
            if [ "$RC" = 0 ]; then
                whl_note="$(ls "$WHEELS"/*.whl | grep -vc '/pip-') wheels from .gpu/wheels installed"
                record wheels ok "$SECS" "$whl_note into the scratch folder, first on PYTHONPATH"
            else
                record wheels "$(status_of $RC)" "$SECS" "$(why $RC "$WORK/wheels.txt")"
            fi
        fi
    else
        requirements "$PY" > "$reqs" 2>> "$LOG"
        record wheels skip 0 "$whl_note"
    fi
    # the user site (~/.local) stays out: a package found only there would hide a gap in the wheelhouse
    export PYTHONNOUSERSITE=1
    export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
    run python 60 "$DEADLINE" "$WORK/python.txt" "$PY" "$GC" python "$reqs" "$SITE" "$WHEELS"
    if [ "$RC" = 0 ]; then
        record python ok "$SECS" "$(last_line "$WORK/python.txt")"
    else
        record python "$(status_of $RC)" "$SECS" "$(why $RC "$WORK/python.txt")"
    fi
    # the CLI imports and renders its help: the H200's first run died right here (a typer internal)
    run cli 60 "$DEADLINE" "$WORK/cli.txt" "$PY" -m pyspecter --help
    if [ "$RC" = 0 ]; then
        record "pyspecter --help" ok "$SECS" "the CLI imports and prints its help"
    else
        record "pyspecter --help" "$(status_of $RC)" "$SECS" "$(why $RC "$WORK/cli.txt")"
    fi
fi

# --- 2. build -----------------------------------------------------------------------------------------------------
BUILT=0
if [ "$DRY" = 1 ]; then
    export SPECTER_CUDA=0
    build_what="CPU build (dry run)"
else
    export SPECTER_CUDA=1
    if [ -z "${SPECTER_CUDA_ARCH:-}" ]; then
        cc=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -1 | tr -d ' .')
        export SPECTER_CUDA_ARCH=${cc:-90}
    fi
    build_what="CUDA build, arch $SPECTER_CUDA_ARCH"
fi
if [ -z "${SPECTER_SDIST:-}" ] && [ -f .gpu/llama-src.tar.xz ]; then export SPECTER_SDIST=$REPO/.gpu/llama-src.tar.xz; fi
PART=$REPO/.gpu/cuda-part.tar.xz  # the GPU half compiled by --prepare (tools/cuda_part.py); GPU_CHECK_CUDA_PART=0: not used
# both archives are xz, which Python reads only when built with lzma: without it, plain tars made by xz(1)
if ! "$PY" -c 'import lzma' 2> /dev/null; then
    for a in SPECTER_SDIST PART; do
        src=${!a:-}
        case $src in *.xz) ;; *) continue ;; esac
        [ -f "$src" ] || continue
        if xz -dc "$src" > "$WORK/$(basename "${src%.xz}")" 2>> "$LOG"; then
            printf -v "$a" '%s' "$WORK/$(basename "${src%.xz}")"
            say "$PY has no lzma: $(basename "$src") decompressed with xz into $WORK"
        fi
    done
fi
# build_llama.py links what it builds into its interpreter's site-packages (a .pth): on the GPU machine that would
# write into the system Python (or fail there for want of permission), on a dry run into GPU_CHECK_PYTHON's venv.
# It runs from a scratch venv instead, which takes the link with it (the system's packages stay visible: a pip cmake)
BPY=$PY
if "$PY" -m venv --without-pip --system-site-packages "$WORK/buildenv" >> "$LOG" 2>&1; then
    BPY=$WORK/buildenv/bin/python
fi
if [ "$DRY" = 1 ] && [ "${GPU_CHECK_DRY_BUILD:-0}" != 1 ]; then
    # the dry run checks the plumbing, not the build: it takes this checkout's CPU build if `make build` made it,
    # else the one the interpreter has linked (building here would take minutes and could race a `make build` of
    # the same key); GPU_CHECK_DRY_BUILD=1 builds
    PKG_ROOT=$("$BPY" tools/build_llama.py --print-root 2> "$WORK/build.txt")
    if [ -f "$PKG_ROOT/BUILD_INFO.json" ]; then
        RC=0 SECS=0
        build_what="this checkout's CPU build (dry run)"
    else
        run build 60 "$DEADLINE" "$WORK/build.txt" "$PY" -c \
            'import pathlib, llama_cpp; print(pathlib.Path(llama_cpp.__file__).resolve().parent.parent)'
        PKG_ROOT=$(tail -1 "$WORK/build.txt")
        build_what="the CPU build $PY has linked (dry run)"
    fi
    build_rc=$RC
else
    build_rc=1
    if [ "$DRY" != 1 ] && [ "${GPU_CHECK_CUDA_PART:-1}" != 0 ] && [ -f "$PART" ]; then
        # this machine's CPU build (native flags, seconds on 16 cores) with the carried libggml-cuda and libggml; it
        # counts only if stock then decodes on the device through it: else a row says why, and CUDA is built here
        run build 420 "$DEADLINE" "$WORK/build.txt" "$BPY" tools/cuda_part.py splice "$PART"
        build_rc=$RC
        PKG_ROOT=$("$BPY" tools/cuda_part.py --print-root "$PART" 2>/dev/null)
        if [ "$build_rc" = 0 ]; then
            splice_s=$SECS
            # the device opens, and stock decodes a fixture on it (every weight there) to finite logits: a crash
            # here is the splice's to answer for, so CUDA is then built here rather than the whole run lost
            run "cuda part" 120 "$DEADLINE" "$WORK/part_check.txt" env PYTHONPATH="$PKG_ROOT:$PYTHONPATH" "$PY" -c \
                'import sys
import numpy as np
from pyspecter.models.catalog import resolve_model
from pyspecter.native.devices import open_device
from pyspecter.native.model import Context, Model
dev = open_device(sys.argv[1])
with Model(resolve_model("tiny-qwen3moe", predictor=False), device=dev, extra_bufts=True, n_cpu_moe=0) as m:
    with Context(m, n_ctx=64) as ctx:
        logits = ctx.decode([1, 2, 3, 4, 5, 6, 7, 8])
assert np.isfinite(logits).all(), "NaN or inf in the logits"
print(f"stock decodes tiny-qwen3moe on {sys.argv[1]} through the spliced build: finite logits")' \
                "${GPU_CHECK_DEVICE:-cuda0}"
            build_rc=$RC
            SECS=$((splice_s + SECS))
        fi
        if [ "$build_rc" = 0 ]; then
            build_what="$build_what: this machine's CPU build and the CUDA part carried in .gpu/"
            # of the ~150 s not spent compiling CUDA, a minute more for step 6 (whose 16 GiB set its time guard
            # may skip) and the rest to verify
            if [ "$BIG" = 1 ] && [ -z "${GPU_CHECK_BIG_S:-}" ]; then BIG_S=310 BIG_FROM=$((DEADLINE - 310)); fi
        else
            f=$WORK/build.txt status=$(status_of $build_rc)
            [ -f "$WORK/part_check.txt" ] && f=$WORK/part_check.txt
            # exit 3: a part of other inputs (patches changed since --prepare, another architecture), not a fault
            [ "$build_rc" = 3 ] && [ "$f" = "$WORK/build.txt" ] && status=skip
            record "build (carried CUDA part)" "$status" "$SECS" "$(why $build_rc "$f"); building CUDA here instead"
        fi
    fi
    if [ "$build_rc" != 0 ]; then
        run build 420 "$DEADLINE" "$WORK/build.txt" "$BPY" tools/build_llama.py
        build_rc=$RC
        PKG_ROOT=$("$BPY" tools/build_llama.py --print-root 2>/dev/null)
    fi
fi
BUILD_LOG=$(dirname "$PKG_ROOT")/build.log
if [ -f "$BUILD_LOG" ]; then tail -n 150 "$BUILD_LOG" > "$OUT/build_log_tail.txt"; fi
if [ "$build_rc" = 0 ] && [ -f "$PKG_ROOT/BUILD_INFO.json" ]; then
    BUILT=1
    export PYTHONPATH="$PKG_ROOT:$PYTHONPATH"
    detail=$("$PY" "$GC" build-detail "$PKG_ROOT/BUILD_INFO.json" "$build_what" 2>&1)
    # a build of this key found in the cache: say so, its time is the first build's
    if grep -q '^llama.cpp build .* cached' "$WORK/build.txt" 2>/dev/null; then detail="$detail (cached)"; fi
    record build ok "$SECS" "$detail"
elif [ "$build_rc" = 0 ]; then
    record build FAIL "$SECS" "$build_what: no BUILD_INFO.json under '$PKG_ROOT'"
else
    detail="$build_what: $(why "$build_rc" "$WORK/build.txt")"
    # build_llama.py says "see build.log" of a CMake failure: the log's first error line is the cause
    if [ -f "$BUILD_LOG" ]; then detail="$detail | build.log: $("$PY" "$GC" cause "$BUILD_LOG" 2>/dev/null)"; fi
    record build "$(status_of $build_rc)" "$SECS" "$detail"
fi

# --- 3. device ----------------------------------------------------------------------------------------------------
DEVICE=${GPU_CHECK_DEVICE:-}
if [ "$DRY" = 1 ] && [ -z "$DEVICE" ]; then
    port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    DEVICE=rpc:127.0.0.1:$port
    if [ "$BUILT" = 1 ]; then
        # the dry run's device; a row of its own, so that a server that never came up is not blamed on inspect
        t0=$(date +%s)
        "$PY" -m pyspecter rpc-server --port "$port" -t 2 > "$WORK/rpc.txt" 2>&1 &
        RPC_PID=$!
        up=0
        for _ in $(seq 1 40); do
            if (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null; then up=1; break; fi
            kill -0 "$RPC_PID" 2>/dev/null || break
            sleep 0.5
        done
        SECS=$(($(date +%s) - t0))
        if [ "$up" = 1 ]; then
            record "rpc-server" ok "$SECS" "the dry run's device: pyspecter rpc-server on 127.0.0.1:$port"
        else
            kill -0 "$RPC_PID" 2>/dev/null && rc=124 || { wait "$RPC_PID"; rc=$?; }
            record "rpc-server" "$(status_of $rc)" "$SECS" "$(why $rc "$WORK/rpc.txt")"
        fi
    fi
fi
DEVICE=${DEVICE:-cuda0}
if [ "$DRY" != 1 ]; then
    run nvidia-smi 30 "$DEADLINE" "$WORK/smi.txt" nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap \
        --format=csv,noheader
    if [ "$RC" = 0 ]; then
        record nvidia-smi ok "$SECS" "$(last_line "$WORK/smi.txt")"
    else
        record nvidia-smi "$(status_of $RC)" "$SECS" "$(why $RC "$WORK/smi.txt")"
    fi
fi
# the probe: what a host visit, an upload and a zero-copy read of pinned host memory cost on this GPU, with the
# CUDA runtime alone (tools/gpu_probe.cu; seconds): the numbers issue 42's candidate designs are chosen by
if [ "$DRY" = 1 ]; then
    record probe skip 0 "dry run: no GPU"
else
    NVCC=${CUDACXX:-}
    for c in "${CUDA_HOME:-/nonexistent}/bin/nvcc" /usr/local/cuda/bin/nvcc "$(command -v nvcc 2>/dev/null)"; do
        if [ -z "$NVCC" ] && [ -n "$c" ] && [ -x "$c" ]; then NVCC=$c; fi
    done
    probe_arch=${SPECTER_CUDA_ARCH:-90}
    if [ "$probe_arch" = native ]; then probe_arch=-arch=native; else probe_arch=-arch=sm_$probe_arch; fi
    if [ -z "$NVCC" ]; then
        record probe FAIL 0 "no nvcc (CUDACXX, CUDA_HOME/bin, /usr/local/cuda/bin, PATH)"
    else
        run probe 90 "$DEADLINE" "$WORK/probe.txt" bash -c '"$1" -O2 "$2" tools/gpu_probe.cu -o "$3" && "$3"' \
            probe "$NVCC" "$probe_arch" "$WORK/gpu_probe"
        if [ "$RC" = 0 ]; then
            last_line "$WORK/probe.txt" > "$OUT/gpu_probe.json"
            record probe ok "$SECS" "$("$PY" "$GC" probe-detail "$OUT/gpu_probe.json" 2>&1)"
        else
            record probe "$(status_of $RC)" "$SECS" "$(why $RC "$WORK/probe.txt")"
        fi
    fi
fi
if [ "$BUILT" = 1 ]; then
    run inspect 60 "$DEADLINE" "$WORK/inspect.txt" "$PY" -m pyspecter inspect tiny-qwen3moe --device "$DEVICE"
    if [ "$RC" = 0 ]; then
        record "inspect --device $DEVICE" ok "$SECS" "$(grep -i -m1 'device' "$WORK/inspect.txt" \
            || last_line "$WORK/inspect.txt")"
    else
        record "inspect --device $DEVICE" "$(status_of $RC)" "$SECS" "$(why $RC "$WORK/inspect.txt")"
    fi
else
    record "inspect --device $DEVICE" skip 0 "no build"
fi
# patch 0008's contract on this device's own kernels (tools/mmid_check.py, seconds): each MUL_MAT_ID path it touches
# gives zero rows for negative ids and the CPU's product elsewhere; a kernel that reads through one aborts, named by
# the last case the script announced
if [ "$BUILT" = 1 ]; then
    run "mmid_check" 60 "$DEADLINE" "$WORK/mmid.txt" "$PY" tools/mmid_check.py --device "$DEVICE"
    if [ "$RC" = 0 ]; then
        record "mul_mat_id negative ids (patch 0008)" ok "$SECS" "$(grep -c '^ok ' "$WORK/mmid.txt") kernel \
paths: negative rows zero, the others the CPU's"
    else
        record "mul_mat_id negative ids (patch 0008)" "$(status_of $RC)" "$SECS" "$(grep '^FAIL' "$WORK/mmid.txt" \
| head -3 | tr '\n' ' ')$(grep 'mmid_check: .* \.\.\.$' "$WORK/mmid.txt" | tail -1); $(why $RC "$WORK/mmid.txt")"
    fi
else
    record "mul_mat_id negative ids (patch 0008)" skip 0 "no build"
fi

# --- 4. verify ----------------------------------------------------------------------------------------------------
VERIFY_UNTIL=$((BIG_FROM - BENCH_S))
LONG_PROMPT="The quick brown fox jumps over the lazy dog while seven wizards quietly judge boxing matches; \
meanwhile, a lazy river carries forty jugs of liquid past the old mill, and nobody counts the tokens."
mkdir -p "$WORK/verify"
if [ "$BUILT" = 1 ]; then
    # breadth first: every arch's first case (E/2 slots, misses on the CPU), then every arch's second, ...; so a
    # run that the budget cuts short has covered every arch. Each line's key (arch, case) orders the table's rows.
    cases=$("$PY" -c 'from pyspecter.models.tiny import TINY_MODELS
per_arch = []
for n, s in TINY_MODELS.items():
    half = s.n_expert // 2
    # misses as negative ids (patch 0008), then the same case with zero slots (SPECTER_ZERO_SLOTS=1): the fallback;
    # then misses the GPU reads from pinned host memory (--miss mapped, csrc/mapped.cpp)
    cs = [(half, "cpu", "short", "neg"), (half, "cpu", "short", "zero"), (half, "mapped", "short", "neg")] + [
        (k, miss, "short", "neg") for k in sorted({s.n_expert_used, half, s.n_expert}) for miss in ("wait", "cpu")
        if (k, miss) != (half, "cpu")] + [(half, "cpu", "long", "neg"), (half, "mapped", "long", "neg")] + [
        (half, miss, "short", "hot") for miss in ("cpu", "mapped")]  # a hot set (verify --hot), as hot plans run
    per_arch.append([(n, *c) for c in cs])
for j in range(max(map(len, per_arch))):
    for a, cs in enumerate(per_arch):
        if j < len(cs):
            print(f"{a:02d}-{j:02d}", *cs[j])' 2> "$WORK/cases.txt")
    [ -n "$cases" ] || record verify FAIL 0 "could not list the fixture models: $(why 1 "$WORK/cases.txt")"
    pids=()
    while read -r key m slots miss plen mode; do
        [ -n "$m" ] || continue
        # PAR cases at a time (GPU_CHECK_PAR: 4 on a GPU, 1 on the dry run's one-client RPC server); each writes
        # its own row, gathered in order below
        while :; do
            n=0
            for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && n=$((n + 1)); done
            [ "$n" -lt "$PAR" ] && break
            sleep 0.2
        done
        (
            STEPS=$WORK/verify/$key.row
            name="verify $m slots=$slots miss=$miss"
            [ "$plen" = long ] && name="$name (long prompt)"
            zero=0 hot=()
            [ "$mode" = zero ] && name="$name (zero slots)" && zero=1
            [ "$mode" = hot ] && name="$name (hot set)" && hot=(--hot)
            f="$WORK/verify/$m-$slots-$miss-$plen-$mode.json"
            if [ "$plen" = long ]; then
                run "$name" 90 "$VERIFY_UNTIL" "$f" env SPECTER_ZERO_SLOTS=$zero "$PY" -m pyspecter verify "$m" \
                    --slots "$slots" --miss "$miss" --device "$DEVICE" --json --prompt "$LONG_PROMPT"
            else
                run "$name" 90 "$VERIFY_UNTIL" "$f" env SPECTER_ZERO_SLOTS=$zero "$PY" -m pyspecter verify "$m" \
                    --slots "$slots" --miss "$miss" --device "$DEVICE" --json "${hot[@]}"
            fi
            rc=$RC
            # from the JSON verify printed (the contract where it reports one); without any, the cause of the crash
            if row=$("$PY" "$GC" verify-row "$f" "$rc" 2>> "$LOG"); then
                st=${row%%$'\t'*} detail=${row#*$'\t'}
            else
                st=$(status_of $rc) detail=$(why $rc "$f")
                [ "$rc" = 0 ] && st=FAIL detail="exit 0 but no JSON result: $(last_line "$f")"
            fi
            record "$name" "$st" "$SECS" "$detail"
        ) &
        pids+=($!)
    done <<< "$cases"
    for pid in "${pids[@]}"; do wait "$pid"; done
    cat "$WORK"/verify/*.row >> "$STEPS" 2>/dev/null
    # a device slot layer's misses are negative ids (CUDA: patch 0008, never run on a GPU before this script). If
    # cases fail with them and every zero-slot case passes, the benches below run with zero slots instead, so the
    # lease still measures speed; the row says so
    if verdict=$("$PY" "$GC" zero-fallback "$WORK"/verify/*.row 2>> "$LOG"); then
        IFS=$'\t' read -r st detail fallback <<< "$verdict"
        [ "$fallback" = 1 ] && export SPECTER_ZERO_SLOTS=1
        record "misses as negative ids (patch 0008)" "$st" 0 "$detail"
    fi
    # a mapped case that failed (a GPU reading host memory: a crash there would take a whole bench's rows with
    # it), or zero slots (mapped needs negative ids): the benches below leave the mapped rows out, and say so
    bad_mapped=$(cat "$WORK"/verify/*.row 2>/dev/null | grep 'miss=mapped' | cut -f2 | grep -cvE '^(ok|skip)$')
    if [ "${SPECTER_ZERO_SLOTS:-0}" = 1 ] || [ "${bad_mapped:-0}" != 0 ]; then
        MAPPED=0
        export SPECTER_NO_MAPPED=1  # and the engine, given no --miss, never chooses them by itself
        record "mapped misses in the benches" skip 0 "left out: $([ "${bad_mapped:-0}" != 0 ] && \
echo "$bad_mapped mapped verify case(s) failed" || echo "zero slots (mapped needs negative ids)")"
    fi
else
    record verify skip 0 "no build"
fi

# --- 5. bench -----------------------------------------------------------------------------------------------------
# all-resident beside stock-device: bench then reports the routing round trip per MoE layer
WANT="stock-device all-resident stock-cpu-moe stock-n-cpu-moe plan on-demand-lru on-demand-mapped static-hot-mapped adaptive-hot-mapped plan-mapped specter"
# step 6's time comes first: the draft specter needs takes a minute and a half to make
[ "$BIG" = 1 ] && WANT=${WANT/ specter/}
[ "$MAPPED" = 1 ] || WANT=${WANT/ on-demand-mapped static-hot-mapped adaptive-hot-mapped plan-mapped/}
if [ "$BUILT" = 1 ]; then
    run "bench --help" 60 "$DEADLINE" "$WORK/bench_help.txt" env COLUMNS=300 "$PY" -m pyspecter bench --help
    help_rc=$RC
    have=$("$PY" -c 'from pyspecter.cli import BENCH_POLICIES; print(" ".join(BENCH_POLICIES))' 2>/dev/null)
    [ -n "$have" ] || have=$(tr -s ' ,│' '\n' < "$WORK/bench_help.txt" | grep -E '^[a-z]+(-[a-z]+)+$|^stock$|^specter$' \
        | tr '\n' ' ')
    if [ "$help_rc" != 0 ]; then
        # the CLI itself failed (an import error, say): that is the row, not a guess about bench's options
        record "bench --help" "$(status_of $help_rc)" "$SECS" "$(why $help_rc "$WORK/bench_help.txt")"
    elif ! grep -q -- '--device' "$WORK/bench_help.txt"; then
        record bench skip 0 "this pyspecter's bench --help shows no --device: nothing to bench on the GPU"
    else
        pols=()
        [ "$BIG" = 1 ] && record "bench specter" skip 0 "left out to leave step 6 its time (GPU_CHECK_BIG=0 runs it)"
        for p in $WANT; do
            if [[ " $have " == *" $p "* ]]; then pols+=("$p"); else record "bench $p" skip 0 "not in this pyspecter's bench"; fi
        done
        run "model $MODEL" 150 "$BIG_FROM" "$WORK/model.txt" "$PY" -m pyspecter models build "$MODEL"
        if [ "$RC" = 0 ]; then detail=$(last_line "$WORK/model.txt"); else detail=$(why $RC "$WORK/model.txt"); fi
        record "model $MODEL" "$(status_of $RC)" "$SECS" "$detail"
        model_rc=$RC
        if [ "$model_rc" = 0 ]; then
            # the contract on the bench model too: teacher-forced real text (its greedy text cycles), half the
            # expert bytes as slots, misses on the CPU, against stock-device and stock --cpu-moe
            f="$WORK/verify/model-forced.json"
            name="verify $MODEL --budget 50% miss=cpu (teacher-forced)"
            run "$name" 120 "$BIG_FROM" "$f" "$PY" -m pyspecter verify "$MODEL" --budget 50% --miss cpu \
                --device "$DEVICE" --forced -n 16 --json
            rc=$RC
            if row=$("$PY" "$GC" verify-row "$f" "$rc" 2>> "$LOG"); then
                st=${row%%$'\t'*} detail=${row#*$'\t'}
            else
                st=$(status_of $rc) detail=$(why $rc "$f")
            fi
            record "$name" "$st" "$SECS" "$detail"
        fi
        # learned: layer-ahead predictions prefetched, its coverage beside on-demand-lru's in the same run. Its
        # predictor comes from --prepare (.gpu/predictors, into the cache) and serves only the model file it was
        # fitted on: a model built here with other bytes leaves the row out, saying so
        if [ "$model_rc" = 0 ] && [[ " $have " == *" learned "* ]]; then
            if "$PY" -c 'import shutil, sys
from pathlib import Path
from pyspecter.learned import predictors_dir, sidecar_path
from pyspecter.models.catalog import resolve_model
for f in Path(sys.argv[2], ".gpu", "predictors").glob("*.npz"):
    if not (predictors_dir() / f.name).exists():
        predictors_dir().mkdir(parents=True, exist_ok=True)
        shutil.copy(f, predictors_dir() / f.name)
sys.exit(0 if sidecar_path(resolve_model(sys.argv[1], predictor=False)).exists() else 1)' "$MODEL" "$REPO" 2>> "$LOG"
            then
                pols+=(learned)
            else
                record "bench learned" skip 0 "no predictor for this model file (--prepare carries bench-qwen3moe's)"
            fi
        fi
        draft_args=()
        if [ "$model_rc" = 0 ] && [[ " ${pols[*]} " == *" specter "* ]]; then
            run "draft" 90 "$BIG_FROM" "$WORK/draft.txt" "$PY" -m pyspecter draft "$MODEL" -o "$WORK/draft.gguf"
            if [ "$RC" = 0 ]; then detail=$(last_line "$WORK/draft.txt"); else detail=$(why $RC "$WORK/draft.txt"); fi
            record "draft of $MODEL" "$(status_of $RC)" "$SECS" "$detail"
            if [ "$RC" = 0 ]; then
                draft_args=(--draft "$WORK/draft.gguf")
            else
                pols=("${pols[@]/specter/}")
                record "bench specter" skip 0 "no draft"
            fi
        fi
        pol_list=$(echo "${pols[*]}" | xargs | tr ' ' ',')
        if [ "$model_rc" != 0 ]; then
            record bench skip 0 "no model"
        elif [ -z "$pol_list" ]; then
            record bench skip 0 "none of $WANT in this pyspecter's bench"
        else
            run "bench" 400 "$BIG_FROM" "$WORK/bench.txt" "$PY" -m pyspecter bench "$MODEL" --device "$DEVICE" \
                --budget "$VRAM" --policies "$pol_list" --repeat "$REPEAT" -n "$BENCH_N" --json "${draft_args[@]}"
            bench_rc=$RC
            bench_secs=$SECS
            cp "$WORK/bench.txt" "$OUT/bench.json"
            cause=
            [ "$bench_rc" = 0 ] || cause=$(why $bench_rc "$WORK/bench.txt")
            "$PY" "$GC" bench-rows "$WORK/bench.txt" "$STEPS" "$(status_of $bench_rc)" "$bench_secs" "$cause" \
                2>> "$LOG" || record bench "$(status_of $bench_rc)" "$bench_secs" "${cause:-no JSON result}"
            "$PY" "$GC" device-table "$WORK/bench.txt" "$OUT" > "$WORK/device_table.txt" 2>> "$LOG" || true
        fi
    fi
else
    record bench skip 0 "no build"
fi

# --- 6. big: issue 42's benchmark ------------------------------------------------------------------------------------
if [ "$BIG" != 1 ]; then
    record "gpu_bench" skip 0 "GPU_CHECK_BIG=0"
elif [ "$BUILT" = 1 ]; then
    # its own time guard: the model's build, then each budget only if it fits in what is left of the run
    rm -f "$OUT/gpu_bench.md" "$OUT/gpu_bench.json"
    # its own deadline comes first, so that it cuts its own bench short and still writes what it has; the run's
    # timeout is the backstop (the earlier steps may have ended before BIG_FROM: it gets their time too)
    run "gpu_bench" "$BUDGET_S" "$DEADLINE" "$WORK/gpu_bench.txt" "$PY" tools/gpu_bench.py --model "$BIG_MODEL" \
        --device "$DEVICE" --budgets "$BIG_BUDGETS" --until "$((DEADLINE - 15))" --out "$OUT" -n "$BIG_N" \
        --floor-from "$OUT/bench.json" $([ "$MAPPED" = 1 ] || echo --no-mapped) \
        --threads "$(nproc)" --min-first-s "$([ "$DRY" = 1 ] && echo 30 || echo 90)"
    if [ "$RC" = 0 ]; then
        detail="$BIG_MODEL at $BIG_BUDGETS: $(grep -c '^| [^-V]' "$OUT/gpu_bench.md" 2>/dev/null) rows in $OUT/gpu_bench.md"
        grep -q 'skipped: out of time' "$OUT/gpu_bench.md" 2>/dev/null && detail="$detail (a budget skipped: out of time)"
        record "gpu_bench" ok "$SECS" "$detail"
    else
        record "gpu_bench" "$(status_of $RC)" "$SECS" "$(why $RC "$WORK/gpu_bench.txt")"
    fi
else
    record "gpu_bench" skip 0 "no build"
fi

# --- the table ----------------------------------------------------------------------------------------------------
TOTAL=$(($(date +%s) - T0))
"$PY" "$GC" table "$STEPS" "$OUT" "$TOTAL" "$DRY" "$DEVICE" "$WORK" \
    || { column -t -s $'\t' "$STEPS" | tee "$OUT/table.txt"; }
if [ -s "$WORK/device_table.txt" ]; then
    echo; echo "host round trips and time per token:"; cat "$WORK/device_table.txt"
    { echo; echo "host round trips and time per token:"; cat "$WORK/device_table.txt"; } >> "$OUT/table.txt"
fi
if [ -s "$OUT/gpu_bench.md" ]; then
    echo; echo "issue 42's benchmark (also $OUT/gpu_bench.md):"; cat "$OUT/gpu_bench.md"
    { echo; echo "issue 42's benchmark:"; cat "$OUT/gpu_bench.md"; } >> "$OUT/table.txt"
fi
failed=$(awk -F'\t' '$2 != "ok" && $2 != "skip"' "$STEPS" | wc -l)
say "done in ${TOTAL}s; results in $OUT"
[ "$failed" = 0 ]
