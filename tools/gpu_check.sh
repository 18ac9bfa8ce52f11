#!/usr/bin/env bash
# tools/gpu_check.sh: pyspecter's CUDA path checked end to end, in one prepared run, on a machine with an NVIDIA GPU.
#
#   bash tools/gpu_check.sh --prepare        here, where the package registry is reachable: writes .gpu/ (ignored
#                                            through .git/info/exclude): the pinned sdist trimmed to ~11 MiB and the
#                                            pure-Python wheels a bare GPU machine's Python may lack (gguf, diskcache)
#   bash tools/gpu_check.sh                  on the GPU machine, from the repository root, with .gpu/ carried along
#                                            (the device tool: carry [".gpu"]); results under $OUT
#   GPU_CHECK_DRY=1 bash tools/gpu_check.sh  anywhere: the same steps against the CPU build the venv has linked
#                                            (GPU_CHECK_DRY_BUILD=1: build it, from .gpu/ too), the device being a
#                                            local `pyspecter rpc-server` (GPU_CHECK_DEVICE=cpu for none: bench's
#                                            device-only policies then fail, a row says so)
#
# The steps, each time-boxed (timeout) and recorded; a failure is a row of the table and the run goes on:
#   1. python: the interpreter and the imports pyspecter needs (wheels from .gpu/wheels into a scratch folder)
#   2. build: SPECTER_CUDA=1 tools/build_llama.py from .gpu/llama-src.tar.gz (SPECTER_SDIST), one architecture (the
#      GPU's compute capability, else 90; SPECTER_CUDA_ARCH wins), flash-attention kernels left out; its own cache
#      key; the bindings are used through PYTHONPATH (--print-root), whatever the interpreter has linked
#   3. device: nvidia-smi, and `pyspecter inspect tiny-qwen3moe --device cuda0` (the device enumerates, memory)
#   4. verify: every fixture arch (pyspecter/models/tiny.py TINY_MODELS) with --device cuda0, slots k, E/2 and E,
#      misses wait and cpu, stock llama.cpp with the same placement as the reference (identical greedy tokens, max
#      |dlogit| <= 1e-4); plus one prompt of >= 32 tokens per arch (the ubatch where op offload would kick in)
#   5. bench: one VRAM budget (GPU_CHECK_VRAM, default 50% of the expert bytes) on the largest model made here in
#      time (bench-qwen3moe: random weights, generated locally), policies stock-device, all-resident (the two
#      give the routing round trip per layer), stock-cpu-moe, stock-n-cpu-moe, plan (the layer plan of full, host
#      and slot layers the cost model chooses at the budget), on-demand-lru and specter (with a draft made by
#      `pyspecter draft`), as far as this pyspecter's `bench --help` offers --device and them; what is missing is a
#      row saying so
# Then one table (stdout and $OUT/table.txt), and under it the device rows' host round trips beside their time per
# token (llama.cpp's splits of the one-token graph, host switches per MoE layer: stock --cpu-moe, stock --n-cpu-moe
# at equal memory, our plan; also $OUT/device_table.txt), $OUT/results.json (every step; the JSON that verify and
# bench printed), $OUT/build_log_tail.txt, $OUT/bench.json and $OUT/gpu_check.log (every command's output).
#
# Assumptions about the GPU machine (this workplace's H200 kind: 16 cores, no network; run by the device tool):
#   - bash with coreutils (timeout), a C/C++ compiler, CMake >= 3.18 on PATH or as this Python's `cmake` package;
#   - nvcc (CUDA 12 or 13) at $CUDACXX, $CUDA_HOME/bin, /usr/local/cuda/bin or on PATH; the driver's libcuda.so.1;
#   - cuBLAS in that toolkit or as NVIDIA's wheel in the Python (nvidia-cublas for CUDA 13, as PyTorch brings it);
#   - Python >= 3.11 (GPU_CHECK_PYTHON, else python3) with numpy, typer, psutil, jinja2, typing-extensions, pyyaml,
#     tqdm and requests; gguf and diskcache come from .gpu/wheels when it lacks them; nothing is fetched;
#   - the source is .gpu/llama-src.tar.gz (or SPECTER_SDIST); without either the build tries the registry.
# Sized to finish in under 9 minutes on 16 cores: GPU_CHECK_BUDGET_S (default 510) bounds the whole run; the verify
# steps stop early enough to leave GPU_CHECK_BENCH_S (default 150) for the model, the draft and the bench.
# Other knobs: OUT (default out/gpu_check), GPU_CHECK_MODEL (default bench-qwen3moe; dry run tiny-qwen3moe),
# GPU_CHECK_DEVICE (default cuda0), GPU_CHECK_PAR (verify runs at a time: 4, dry run 1), GPU_CHECK_REPEAT and
# GPU_CHECK_BENCH_N (bench repeats and decode tokens: 2 and 32, dry run 1 and 8), GPU_CHECK_WORK (scratch folder,
# kept when given; else a fresh one under /tmp, removed at the end).

set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2
REPO=$(pwd)

if [ "${1:-}" = "--prepare" ]; then
    PY=${GPU_CHECK_PYTHON:-}
    [ -n "$PY" ] || { [ -x .venv/bin/python ] && PY=.venv/bin/python || PY=python3; }
    mkdir -p .gpu/wheels || exit 2
    if [ -d .git ] && ! grep -qx '/.gpu/' .git/info/exclude 2>/dev/null; then
        mkdir -p .git/info && echo '/.gpu/' >> .git/info/exclude
    fi
    "$PY" tools/build_llama.py --trim-sdist .gpu/llama-src.tar.gz || exit 2
    # the same requirement strings as pyproject's, so the carried versions are the project's
    mapfile -t reqs < <("$PY" -c 'import re, tomllib
deps = tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"]
print("\n".join(d for d in deps if re.match(r"(gguf|diskcache)\b", d)))')
    rm -f .gpu/wheels/*.whl
    "$PY" -m pip download -q --no-deps --only-binary=:all: -d .gpu/wheels "${reqs[@]}" || exit 2
    du -sh .gpu; ls -l .gpu/llama-src.tar.gz .gpu/wheels
    echo "ready: carry .gpu with the working tree (device tool: carry [\".gpu\"]) and run: bash tools/gpu_check.sh"
    exit 0
fi

DRY=${GPU_CHECK_DRY:-0}
OUT=${OUT:-$REPO/out/gpu_check}
WORK=${GPU_CHECK_WORK:-${TMPDIR:-/tmp}/gpu_check.$$}
BUDGET_S=${GPU_CHECK_BUDGET_S:-510}
BENCH_S=${GPU_CHECK_BENCH_S:-150}
VRAM=${GPU_CHECK_VRAM:-50%}
if [ "$DRY" = 1 ]; then
    # the dry run's device is an RPC server on this machine: one client at a time, a TCP round trip per switch
    MODEL=${GPU_CHECK_MODEL:-tiny-qwen3moe} REPEAT=${GPU_CHECK_REPEAT:-1} BENCH_N=${GPU_CHECK_BENCH_N:-8}
    PAR=${GPU_CHECK_PAR:-1}
else
    MODEL=${GPU_CHECK_MODEL:-bench-qwen3moe} REPEAT=${GPU_CHECK_REPEAT:-2} BENCH_N=${GPU_CHECK_BENCH_N:-32}
    PAR=${GPU_CHECK_PAR:-4}
fi
PY=${GPU_CHECK_PYTHON:-}
if [ -z "$PY" ]; then
    if [ "$DRY" = 1 ] && [ -x .venv/bin/python ]; then PY=$REPO/.venv/bin/python; else PY=$(command -v python3); fi
fi
mkdir -p "$OUT" "$WORK" || exit 2
LOG=$OUT/gpu_check.log
STEPS=$WORK/steps.tsv
: > "$LOG"
: > "$STEPS"
T0=$(date +%s)
DEADLINE=$((T0 + BUDGET_S))
RPC_PID=

# the Python side of the report, written once: gc.py python | build-detail | verify-detail | bench-rows | table
cat > "$WORK/gc.py" <<'EOF'
import importlib, json, sys
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


def python():
    bad = []
    for m in ("numpy", "gguf", "typer", "psutil", "jinja2", "diskcache", "typing_extensions", "yaml", "tqdm"):
        try:
            importlib.import_module(m)
        except Exception as e:  # noqa: BLE001
            bad.append(f"{m} ({e.__class__.__name__})")
    import numpy
    print(f"Python {sys.version.split()[0]} at {sys.executable}, numpy {numpy.__version__}"
          + (f"; MISSING: {', '.join(bad)}" if bad else ""))
    sys.exit(1 if bad else 0)


def build_detail(info_path, what):
    i = json.loads(Path(info_path).read_text())
    c = i.get("cuda_setup") or {}
    print(f"{what}: key {i['key']}, built in {i['build_s']:.0f}s on {i['cpus']} cpus"
          + (f", CUDA {c['release']} arch {c['arch']}, cuBLAS {c['cublas']}, libcuda {c['libcuda']}" if c else ""))


def verify_detail(path):
    r = last_json(path)
    print(f"{'IDENTICAL' if r['identical_tokens'] else 'DIFFERENT'} tokens ({r['n_tokens']} after a "
          f"{r['n_prompt_tokens']}-token prompt) on {r['device']}, max |dlogit| {r['max_abs_logit_diff']:.1e}, "
          f"hit {100 * r['hit_rate']:.0f}%, {r['uploads']} uploads")


def bench_rows(path, steps, status, secs):
    r = last_json(path)
    rows = [("bench", status, secs,
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
        rows.append((f"bench {name}", "ok", "",
                     f"{p['decode_tok_s']:.1f} tok/s, TPOT {p['tpot_ms']:.2f} ms, prefill "
                     f"{p.get('prefill_tok_s', float('nan')):.0f} tok/s, hit {100 * p.get('hit_rate', 1):.0f}%, "
                     f"{p['bytes_per_token'] / 1024:.0f} KiB/token" + splits
                     + ("" if same is None else f", {'same' if same else 'DIFFERENT'} tokens as stock")))
    with open(steps, "a") as f:
        for row in rows:
            f.write("\t".join(str(x) for x in row) + "\n")


def device_table(bench_json, out):
    """Host round trips beside time per token: stock --cpu-moe, stock --n-cpu-moe at equal device memory, our
    layer plan (and the other device rows bench ran), one table ($OUT/device_table.txt)."""
    r = last_json(bench_json)
    order = ["stock-cpu-moe", "stock-n-cpu-moe", "plan", "stock-device", "all-resident", "on-demand-lru", "specter"]
    pol = r["policies"]
    names = [n for n in order if n in pol] + [n for n in pol if n not in order]
    lines = [f"{r['model'].rsplit('/', 1)[-1]} on {r.get('device')}, budget {r['budget']}",
             f"{'placement':<18} {'TPOT ms':>9} {'splits/token':>13} {'switches/MoE layer':>19}  note"]
    for n in names:
        p = pol[n]
        if "tpot_ms" not in p:
            lines.append(f"{n:<18} {'-':>9} {'-':>13} {'-':>19}  {str(p.get('skipped', ''))[:60]}")
            continue
        note = f"N={p['n_cpu_moe']}" if "n_cpu_moe" in p else ""
        if n == "plan" and "layer_plan" in r:
            lp = r["layer_plan"]
            note = (f"{lp['plan']}; predicted {lp['predicted_ms']:.2f} ms vs stock --n-cpu-moe "
                    f"{lp['predicted_stock_n_cpu_moe_ms']:.2f}, --cpu-moe {lp['predicted_stock_cpu_moe_ms']:.2f}")
        lines.append(f"{n:<18} {p['tpot_ms']:>9.2f} {p.get('splits_per_token', '-'):>13} "
                     f"{p.get('host_switches_per_moe_layer', float('nan')):>19.2f}  {note}")
    text = "\n".join(lines)
    print(text)
    Path(out, "device_table.txt").write_text(text + "\n")


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
    # the scratch folder (wheels, the draft, raw outputs) goes, unless GPU_CHECK_WORK named it
    if [ -z "${GPU_CHECK_WORK:-}" ]; then rm -rf "$WORK"; fi
}
trap cleanup EXIT

say() { echo "[gpu_check $(($(date +%s) - T0))s] $*" | tee -a "$LOG"; }

# record NAME STATUS SECONDS DETAIL: one row of the table
record() { printf '%s\t%s\t%s\t%s\n' "$1" "$2" "$3" "$(echo "$4" | tr '\t\n' '  ' | cut -c1-300)" >> "$STEPS"; }

# run NAME CAP_S UNTIL OUTFILE CMD...: runs CMD under timeout (CAP_S, or less so as to end by UNTIL, an epoch
# second), output to OUTFILE and the log; sets RC (124: timed out, 125: not run for lack of time) and SECS
RC=0
SECS=0
run() {
    local name=$1 cap=$2 until=$3 outf=$4
    shift 4
    local now left t0
    now=$(date +%s)
    left=$((until - now))
    [ "$left" -lt "$cap" ] && cap=$left
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
        124|137) echo TIMEOUT ;;
        125) echo "skip" ;;
        *) echo FAIL ;;
    esac
}

last_line() { grep -v '^\s*$' "$1" 2>/dev/null | tail -1; }

# --- 1. python --------------------------------------------------------------------------------------------------
SITE=$WORK/site
mkdir -p "$SITE"
if [ -z "$PY" ] || ! "$PY" -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null; then
    record "python" FAIL 0 "no Python >= 3.11 (GPU_CHECK_PYTHON=${GPU_CHECK_PYTHON:-unset}, python3=$(command -v python3))"
else
    whl_note=""
    if ls .gpu/wheels/*.whl > /dev/null 2>&1; then
        # only what the interpreter lacks (or has at another version), into a scratch folder first on the path
        need=$("$PY" - .gpu/wheels/*.whl <<'EOF'
import importlib.metadata as md, sys
from pathlib import Path
for w in sys.argv[1:]:
    name, version = Path(w).name.split("-")[:2]
    try:
        if md.version(name) == version:
            continue
    except md.PackageNotFoundError:
        pass
    print(w)
EOF
)
        if [ -n "$need" ]; then
            # shellcheck disable=SC2086
            "$PY" -m pip install -q --no-index --no-deps --no-compile --target "$SITE" $need >> "$LOG" 2>&1 \
                && whl_note="; from .gpu/wheels: $(echo $need | xargs -n1 basename | tr '\n' ' ')"
        fi
    fi
    export PYTHONPATH="$REPO:$SITE${PYTHONPATH:+:$PYTHONPATH}"
    run python 60 "$DEADLINE" "$WORK/python.txt" "$PY" "$GC" python
    record python "$(status_of $RC)" "$SECS" "$(last_line "$WORK/python.txt")${whl_note}"
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
if [ -z "${SPECTER_SDIST:-}" ] && [ -f .gpu/llama-src.tar.gz ]; then export SPECTER_SDIST=$REPO/.gpu/llama-src.tar.gz; fi
if [ "$DRY" = 1 ] && [ "${GPU_CHECK_DRY_BUILD:-0}" != 1 ]; then
    # the dry run checks the plumbing, not the build: it takes the CPU build this interpreter has linked (building
    # here would take minutes and could race a `make build` of the same key); GPU_CHECK_DRY_BUILD=1 builds
    run build 60 "$DEADLINE" "$WORK/build.txt" "$PY" -c \
        'import pathlib, llama_cpp; print(pathlib.Path(llama_cpp.__file__).resolve().parent.parent)'
    build_rc=$RC
    PKG_ROOT=$(tail -1 "$WORK/build.txt")
    build_what="the linked CPU build (dry run)"
else
    run build 420 "$DEADLINE" "$WORK/build.txt" "$PY" tools/build_llama.py
    build_rc=$RC
    PKG_ROOT=$("$PY" tools/build_llama.py --print-root 2>/dev/null)
fi
BUILD_LOG=$(dirname "$PKG_ROOT")/build.log
if [ -f "$BUILD_LOG" ]; then tail -n 150 "$BUILD_LOG" > "$OUT/build_log_tail.txt"; fi
if [ "$build_rc" = 0 ] && [ -f "$PKG_ROOT/BUILD_INFO.json" ]; then
    BUILT=1
    export PYTHONPATH="$PKG_ROOT:$PYTHONPATH"
    detail=$("$PY" "$GC" build-detail "$PKG_ROOT/BUILD_INFO.json" "$build_what" 2>&1)
    record build ok "$SECS" "$detail"
else
    record build "$(status_of $build_rc)" "$SECS" "$build_what: $(last_line "$WORK/build.txt")"
fi

# --- 3. device ----------------------------------------------------------------------------------------------------
DEVICE=${GPU_CHECK_DEVICE:-}
if [ "$DRY" = 1 ] && [ -z "$DEVICE" ]; then
    port=$("$PY" -c 'import socket; s = socket.socket(); s.bind(("127.0.0.1", 0)); print(s.getsockname()[1])')
    if [ "$BUILT" = 1 ]; then
        "$PY" -m pyspecter rpc-server --port "$port" -t 2 >> "$LOG" 2>&1 &
        RPC_PID=$!
        for _ in $(seq 1 40); do
            (exec 3<>"/dev/tcp/127.0.0.1/$port") 2>/dev/null && break
            sleep 0.5
        done
    fi
    DEVICE=rpc:127.0.0.1:$port
fi
DEVICE=${DEVICE:-cuda0}
if [ "$DRY" != 1 ]; then
    run nvidia-smi 30 "$DEADLINE" "$WORK/smi.txt" nvidia-smi --query-gpu=name,memory.total,driver_version,compute_cap \
        --format=csv,noheader
    record nvidia-smi "$(status_of $RC)" "$SECS" "$(last_line "$WORK/smi.txt")"
fi
if [ "$BUILT" = 1 ]; then
    run inspect 60 "$DEADLINE" "$WORK/inspect.txt" "$PY" -m pyspecter inspect tiny-qwen3moe --device "$DEVICE"
    record "inspect --device $DEVICE" "$(status_of $RC)" "$SECS" "$(grep -i -m1 'device' "$WORK/inspect.txt" \
        || last_line "$WORK/inspect.txt")"
else
    record "inspect --device $DEVICE" skip 0 "no build"
fi

# --- 4. verify ----------------------------------------------------------------------------------------------------
VERIFY_UNTIL=$((DEADLINE - BENCH_S))
LONG_PROMPT="The quick brown fox jumps over the lazy dog while seven wizards quietly judge boxing matches; \
meanwhile, a lazy river carries forty jugs of liquid past the old mill, and nobody counts the tokens."
mkdir -p "$WORK/verify"
if [ "$BUILT" = 1 ]; then
    cases=$("$PY" -c 'from pyspecter.models.tiny import TINY_MODELS
for n, s in TINY_MODELS.items():
    for slots in sorted({s.n_expert_used, s.n_expert // 2, s.n_expert}):
        for miss in ("wait", "cpu"):
            print(n, slots, miss, "short")
    print(n, s.n_expert // 2, "cpu", "long")' 2>> "$LOG")
    [ -n "$cases" ] || record verify FAIL 0 "could not list the fixture models (pyspecter.models.tiny)"
    i=0
    pids=()
    while read -r m slots miss plen; do
        [ -n "$m" ] || continue
        i=$((i + 1))
        # PAR cases at a time (GPU_CHECK_PAR: 4 on a GPU, 1 on the dry run's one-client RPC server); each writes
        # its own row, gathered in order below
        while :; do
            n=0
            for pid in "${pids[@]}"; do kill -0 "$pid" 2>/dev/null && n=$((n + 1)); done
            [ "$n" -lt "$PAR" ] && break
            sleep 0.2
        done
        (
            STEPS=$WORK/verify/$(printf '%03d' $i).row
            name="verify $m slots=$slots miss=$miss"
            [ "$plen" = long ] && name="$name (long prompt)"
            f="$WORK/verify/$m-$slots-$miss-$plen.json"
            if [ "$plen" = long ]; then
                run "$name" 90 "$VERIFY_UNTIL" "$f" "$PY" -m pyspecter verify "$m" --slots "$slots" --miss "$miss" \
                    --device "$DEVICE" --json --prompt "$LONG_PROMPT"
            else
                run "$name" 90 "$VERIFY_UNTIL" "$f" "$PY" -m pyspecter verify "$m" --slots "$slots" --miss "$miss" \
                    --device "$DEVICE" --json
            fi
            rc=$RC
            detail=$("$PY" "$GC" verify-detail "$f" 2>/dev/null || last_line "$f")
            st=$(status_of $rc)
            [ "$rc" = 1 ] && st=DIFF
            record "$name" "$st" "$SECS" "$detail"
        ) &
        pids+=($!)
    done <<< "$cases"
    for pid in "${pids[@]}"; do wait "$pid"; done
    cat "$WORK"/verify/*.row >> "$STEPS" 2>/dev/null
else
    record verify skip 0 "no build"
fi

# --- 5. bench -----------------------------------------------------------------------------------------------------
# all-resident beside stock-device: bench then reports the routing round trip per MoE layer
WANT="stock-device all-resident stock-cpu-moe stock-n-cpu-moe plan on-demand-lru specter"
if [ "$BUILT" = 1 ]; then
    COLUMNS=300 "$PY" -m pyspecter bench --help > "$WORK/bench_help.txt" 2>&1
    have=$("$PY" -c 'from pyspecter.cli import BENCH_POLICIES; print(" ".join(BENCH_POLICIES))' 2>/dev/null)
    [ -n "$have" ] || have=$(tr -s ' ,│' '\n' < "$WORK/bench_help.txt" | grep -E '^[a-z]+(-[a-z]+)+$|^stock$|^specter$' \
        | tr '\n' ' ')
    if ! grep -q -- '--device' "$WORK/bench_help.txt"; then
        record bench skip 0 "this pyspecter's bench has no --device yet: nothing to bench on the GPU"
    else
        pols=()
        for p in $WANT; do
            if [[ " $have " == *" $p "* ]]; then pols+=("$p"); else record "bench $p" skip 0 "not in this pyspecter's bench"; fi
        done
        run "model $MODEL" 150 "$DEADLINE" "$WORK/model.txt" "$PY" -m pyspecter models build "$MODEL"
        record "model $MODEL" "$(status_of $RC)" "$SECS" "$(last_line "$WORK/model.txt")"
        model_rc=$RC
        draft_args=()
        if [ "$model_rc" = 0 ] && [[ " ${pols[*]} " == *" specter "* ]]; then
            run "draft" 90 "$DEADLINE" "$WORK/draft.txt" "$PY" -m pyspecter draft "$MODEL" -o "$WORK/draft.gguf"
            record "draft of $MODEL" "$(status_of $RC)" "$SECS" "$(last_line "$WORK/draft.txt")"
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
            run "bench" 400 "$DEADLINE" "$WORK/bench.txt" "$PY" -m pyspecter bench "$MODEL" --device "$DEVICE" \
                --budget "$VRAM" --policies "$pol_list" --repeat "$REPEAT" -n "$BENCH_N" --json "${draft_args[@]}"
            bench_rc=$RC
            bench_secs=$SECS
            cp "$WORK/bench.txt" "$OUT/bench.json"
            "$PY" "$GC" bench-rows "$WORK/bench.txt" "$STEPS" "$(status_of $bench_rc)" "$bench_secs" 2>> "$LOG" \
                || record bench "$(status_of $bench_rc)" "$bench_secs" "$(last_line "$WORK/bench.txt")"
            "$PY" "$GC" device-table "$WORK/bench.txt" "$OUT" > "$WORK/device_table.txt" 2>> "$LOG" || true
        fi
    fi
else
    record bench skip 0 "no build"
fi

# --- the table ----------------------------------------------------------------------------------------------------
TOTAL=$(($(date +%s) - T0))
"$PY" "$GC" table "$STEPS" "$OUT" "$TOTAL" "$DRY" "$DEVICE" "$WORK" \
    || { column -t -s $'\t' "$STEPS" | tee "$OUT/table.txt"; }
if [ -s "$WORK/device_table.txt" ]; then
    echo; echo "host round trips and time per token:"; cat "$WORK/device_table.txt"
    { echo; echo "host round trips and time per token:"; cat "$WORK/device_table.txt"; } >> "$OUT/table.txt"
fi
failed=$(awk -F'\t' '$2 != "ok" && $2 != "skip"' "$STEPS" | wc -l)
say "done in ${TOTAL}s; results in $OUT"
[ "$failed" = 0 ]
