"""The README's facts that the code decides: its length, the demo sample's C API version and slot counts, the patch
count and the pinned llama.cpp / llama-cpp-python versions. Each is checked against the source of truth (the C
header, patches/, the pin, pyspecter's own budget and placement code), and each check is shown to fail on a stale
copy."""

from __future__ import annotations

import inspect
import re
from pathlib import Path

import pytest

from pyspecter.budget import MemoryPlan, parse_budget
from pyspecter.layout import ExpertTensor, ModelLayout, MoELayer

ROOT = Path(__file__).resolve().parents[2]
README = ROOT / "README.md"
DOCS = sorted((ROOT / "docs").glob("*.md"))
MAX_LINES = 250
MiB, KiB = 2**20, 2**10
NUMBERS = {w: i for i, w in enumerate(["zero", "one", "two", "three", "four", "five", "six", "seven", "eight",
                                       "nine", "ten", "eleven", "twelve"])}


def c_api_version() -> int:
    header = (ROOT / "csrc" / "include" / "llama-pyspecter.h").read_text()
    m = re.search(r"^#define\s+LLAMA_PYSPECTER_VERSION\s+(\d+)\s*$", header, re.MULTILINE)
    assert m, "LLAMA_PYSPECTER_VERSION not found in csrc/include/llama-pyspecter.h"
    return int(m.group(1))


def pin() -> dict[str, str]:
    out = {}
    for line in (ROOT / "vendor" / "llama-cpp-python.pin").read_text().splitlines():
        if "=" in line and not line.lstrip().startswith("#"):
            k, v = line.split("=", 1)
            out[k.strip()] = v.strip()
    return out


def _demo_sample(text: str) -> str:
    m = re.search(r"```\n\$ make demo[^\n]*\n(.*?)```", text, re.DOTALL)
    return m.group(1) if m else ""


def _mib(s: str) -> float:
    return float(s)


def sample_layout(sample: str) -> ModelLayout:
    """The model the demo sample describes, rebuilt from its own inspect lines (layers, experts, top-k, bytes)."""
    arch = re.search(r"^arch \S+: (\d+) layers, (\d+) MoE layers, (\d+) experts, top-(\d+)", sample, re.MULTILINE)
    one = re.search(r"^one expert: [\d.]+ MiB \((.*)\)$", sample, re.MULTILINE)
    sizes = re.search(r"^experts: ([\d.]+) MiB \(([\d.]+)%\), non-expert: ([\d.]+) MiB$", sample, re.MULTILINE)
    assert arch and one and sizes, "the demo sample lacks inspect's arch / one expert / experts lines"
    n_layer, n_moe, n_expert, k = (int(g) for g in arch.groups())
    tensors = re.findall(r"(\w+) (\S+) ([\d.]+) KiB", one.group(1))
    assert tensors, one.group(0)
    layers = [MoELayer(il, {kind: ExpertTensor(f"blk.{il}.ffn_{kind}_exps.weight", kind, t, (n_expert, 1, 1), 0,
                                               round(float(kib) * KiB)) for kind, t, kib in tensors})
              for il in range(n_layer - n_moe, n_layer)]
    experts = sum(L.expert_bytes for L in layers) * n_expert
    total = experts + round(_mib(sizes.group(3)) * MiB)
    return ModelLayout(path=None, arch="sample", name="sample", n_layer=n_layer,  # type: ignore[arg-type]
                       n_expert=n_expert, n_expert_used=k, n_shared_expert_layers=0, file_bytes=total,
                       tensor_bytes=total, layers=layers)


def _close(a: float, b: float, tol: float = 0.006) -> bool:
    return abs(a - b) <= tol


def problems(readme: str, docs: dict[str, str] | None = None) -> list[str]:
    """Every fact of ``readme`` (and ``docs``: name -> text) that disagrees with the code; empty when none does."""
    docs = docs or {}
    out: list[str] = []
    n_lines = len(readme.splitlines())
    if n_lines > MAX_LINES:
        out.append(f"README.md has {n_lines} lines, more than {MAX_LINES}: move details to docs/")

    # the C API version the library reports (the demo's first line) is the header's
    want = c_api_version()
    sample = _demo_sample(readme)
    if not sample:
        out.append("README.md has no `$ make demo` sample")
    elif not re.search(rf"^patched llama\.cpp with pyspecter C API v{want}$", sample, re.MULTILINE):
        out.append(f"the demo sample's first line must say 'C API v{want}' (LLAMA_PYSPECTER_VERSION in "
                   "csrc/include/llama-pyspecter.h): update README.md's sample")
    for name, text in {"README.md": readme, **docs}.items():
        for v in re.findall(r"C API v(\d+)", text):
            if int(v) != want:
                out.append(f"{name} says C API v{v}; the header says {want} (quote the number only in the demo "
                           "sample, which this test checks)")

    # the patch count
    n_patches = len(list((ROOT / "patches").glob("*.patch")))
    said = re.findall(r"\b(\d+|[a-z]+) (?:small |upstream )?patches\b", readme, re.IGNORECASE)
    counts = [int(w) if w.isdigit() else NUMBERS.get(w.lower()) for w in said]
    counts = [c for c in counts if c is not None]
    if not counts:
        out.append("README.md does not say how many patches patches/ holds")
    for name, text in {"README.md": readme, **docs}.items():
        for w in re.findall(r"\b(\d+|[a-z]+) (?:small |upstream )?patches\b", text, re.IGNORECASE):
            c = int(w) if w.isdigit() else NUMBERS.get(w.lower())
            if c is not None and c != n_patches:
                out.append(f"{name} says {w} patches; patches/ holds {n_patches}")

    # the pinned versions
    p = pin()
    for name, text in {"README.md": readme, **docs}.items():
        for v in re.findall(r"llama-cpp-python(?:==| )(\d+\.\d+\.\d+)", text):
            if v != p["version"]:
                out.append(f"{name} says llama-cpp-python {v}; vendor/llama-cpp-python.pin pins {p['version']}")
        for c in re.findall(r"llama\.cpp (?:at commit )?([0-9a-f]{7,40})\b", text):
            if not p["llama_cpp_commit"].startswith(c) and not c.startswith(p["llama_cpp_commit"]):
                out.append(f"{name} says llama.cpp {c}; the pinned sdist bundles {p['llama_cpp_commit']}")
    if f"llama-cpp-python {p['version']}" not in readme or f"llama.cpp {p['llama_cpp_commit']}" not in readme:
        out.append(f"README.md should name the pin: llama-cpp-python {p['version']}, llama.cpp "
                   f"{p['llama_cpp_commit']}")

    if sample:
        out += _slot_problems(readme, sample)
    return out


def _slot_problems(readme: str, sample: str) -> list[str]:
    """The demo sample's budget, slot and memory lines, and the README's note on the predictor, against budget.py
    and placement.py (the one wording of a slot count that inspect, demo, generate and /stats share)."""
    from pyspecter.placement import slot_count
    from pyspecter.study import demo
    from pyspecter.study.bench import RUNTIME_HEADROOM

    out = []
    lay = sample_layout(sample)
    sizes = re.search(r"^experts: ([\d.]+) MiB \(([\d.]+)%\)", sample, re.MULTILINE)
    assert sizes
    if not _close(_mib(sizes.group(1)), lay.expert_total_bytes / MiB):
        out.append(f"the sample's experts ({sizes.group(1)} MiB) are not its layers x experts x one expert's bytes")
    budget_text = inspect.signature(demo.demo).parameters["budget"].default  # what `make demo` runs with
    budget = parse_budget(budget_text, lay.expert_total_bytes)
    # the sample's session holds the learned predictor's reuse maps (its size as the sample gives it), which come
    # out of the budget first; the rest is spread by layer (MemoryPlan, as Session plans it)
    said = re.search(rf"^budget {re.escape(budget_text)}, tier disk: .*; the rest of the budget: the learned "
                     r"predictor ([\d.]+) MiB$", sample, re.MULTILINE)
    if not said:
        return [*out, f"the sample's inspect line must read 'budget {budget_text}, tier disk: ...; the rest of the "
                      "budget: the learned predictor N MiB' (placement.SlotCount)"]
    pred = round(float(said.group(1)) * MiB)
    plan = MemoryPlan.for_budget(lay, budget_text, spread=True, predictor_bytes=pred)
    count = slot_count(lay, plan, (("the learned predictor", pred),))
    want = f"budget {budget_text}, tier disk: {count}"
    if said.group(0) != want:
        out.append(f"the sample's inspect line must read {want!r} (placement.slot_count)")
    if not re.search(rf"^pyspecter's slots: {re.escape(str(count))}$", sample, re.MULTILINE):
        out.append(f"the sample's slots line must read \"pyspecter's slots: {count}\"")
    ours = re.search(r"^pyspecter \((\d+)/(\d+) expert slots, disk\)", sample, re.MULTILINE)
    if not ours or (int(ours.group(1)), int(ours.group(2))) != (count.min, lay.n_expert):
        out.append(f"the sample's pyspecter row must say {count.min}/{lay.n_expert} expert slots (the fewest of "
                   "any layer)")
    mem = re.search(r"^memory: ([\d.]+) MiB each.*\n\s+= budget ([\d.]+) MiB \+", sample, re.MULTILINE)
    want_cap = (budget + lay.nonexpert_bytes + RUNTIME_HEADROOM) / MiB
    if not mem or not _close(_mib(mem.group(1)), want_cap, tol=0.015):  # from the sample's rounded sizes
        out.append(f"the sample's memory cap must be budget + non-expert + runtime = {want_cap:.2f} MiB")
    if not mem or not _close(_mib(mem.group(2)), budget / MiB):
        out.append(f"the sample's budget must be {budget_text} of its experts ({budget / MiB:.2f} MiB)")
    # the prose under the sample says what the rest of the budget buys
    flat = re.sub(r"\s+", " ", readme)
    rest = re.search(r"the rest buys (\d+) slots in every layer and an? (\d+)(?:st|nd|rd|th) in (\d+) of (\d+)\.",
                     flat)
    n_more = sum(1 for c in count.counts if c > count.min)
    if not rest or (int(rest.group(1)), int(rest.group(2)), int(rest.group(3)), int(rest.group(4))) != (
            count.min, count.min + 1, n_more, len(count.counts)):
        out.append(f"the README must say: the rest buys {count.min} slots in every layer and an {count.min + 1}th "
                   f"in {n_more} of {len(count.counts)}")
    return out


def _docs() -> dict[str, str]:
    more = [ROOT / "patches" / "README.md", ROOT / "vendor" / "README.md"]
    return {str(p.relative_to(ROOT)): p.read_text() for p in [*DOCS, *more] if p.is_file()}


def test_readme_facts_match_the_code() -> None:
    found = problems(README.read_text(), _docs())
    assert not found, "\n".join(found)


def _stale(old: str, new: str, count: int = 1) -> str:
    text = README.read_text()
    assert old in text, f"the README no longer contains {old!r}: update this test's stale copies"
    return text.replace(old, new, count)


@pytest.mark.parametrize("old, new, says", [
    (f"C API v{c_api_version()}", f"C API v{c_api_version() - 2}", "C API"),
    ("eight small patches", "3 small patches", "patches"),
    ("(7/16 expert slots, disk)", "(8/16 expert slots, disk)", "pyspecter row"),
    ("budget 50%, tier disk: 7-8 of 16 slots per layer", "budget 50%, tier disk: 8/16 slots per layer",
     "inspect line"),
    ("budget 50%, tier disk: 7-8 of 16 slots per layer (mean 7.97); the rest of the budget: the learned predictor",
     "budget 50%: 8/16 slots per layer (8 in 29 of 30 layers); the rest of the budget: the learned predictor",
     "inspect line"),
    ("slots: 7-8 of 16 slots per layer (mean 7.97)", "slots: 7/16 slots per layer", "slots line"),
    ("an 8th in 29 of 30", "an 8th in 30 of 30", "rest buys"),
    ("= budget 379.69 MiB", "= budget 389.69 MiB", "budget must be"),
    ("memory: 681.38 MiB", "memory: 937.38 MiB", "memory cap"),
    ("llama-cpp-python 0.3.36", "llama-cpp-python 0.3.35", "llama-cpp-python"),
])
def test_a_stale_readme_is_caught(old: str, new: str, says: str) -> None:
    found = problems(_stale(old, new))
    assert any(says in p for p in found), found


def test_a_long_readme_is_caught() -> None:
    text = README.read_text() + "\n" * MAX_LINES
    assert any("lines" in p for p in problems(text))


def documented_commands(text: str) -> set[str]:
    """The commands the code blocks run: the word after ``pyspecter`` at the start of a line (the demo's output,
    whose lines also start with "pyspecter", is not a command)."""
    blocks = [b for b in re.findall(r"```[a-z]*\n(.*?)```", text, re.DOTALL) if not b.startswith("$ make demo")]
    return {m for b in blocks for m in re.findall(r"^(?:\$ )?pyspecter ([a-z][a-z-]*)", b, re.MULTILINE)}


def unknown_commands(text: str) -> set[str]:
    import typer.main

    from pyspecter.cli import app

    return documented_commands(text) - set(typer.main.get_command(app).commands)


def test_the_documented_commands_exist() -> None:
    docs = [README, *DOCS]
    assert documented_commands(README.read_text()) >= {"chat", "generate", "serve", "inspect"}
    bad = {str(p.relative_to(ROOT)): unknown_commands(p.read_text()) for p in docs}
    assert not any(bad.values()), bad
    assert unknown_commands("```\npyspecter summon smol-moe\n```") == {"summon"}
