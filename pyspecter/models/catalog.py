"""Built-in model names: what a user may type instead of a GGUF path, and how each is built (or found cached)."""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

from pyspecter.errors import SpecterError
from pyspecter.paths import cache_dir, models_dir

DRAFT_NAME = re.compile(r"smol-moe-draft(?:-(Q\w+))?(?:-w([0-9.]+))?")  # smol-moe-draft[-TYPE][-wWIDTH]
SELF_DRAFT_NAME = re.compile(r"smol-moe-self-draft(?:-(\w+))?")  # smol-moe-self-draft[-TYPE]


def builtin_names() -> list[str]:
    from pyspecter.models import big, tiny

    return ["smol-moe", "smol-moe-self-draft", "smol-moe-self-draft-TYPE", "smol-moe-draft",
            "smol-moe-draft-TYPE-wKEEP", *tiny.TINY_MODELS, *tiny.BENCH_MODELS, *big.BIG_MODELS]


def is_builtin(name: str) -> bool:
    return (name in builtin_names() or DRAFT_NAME.fullmatch(name) is not None
            or SELF_DRAFT_NAME.fullmatch(name) is not None)


def resolve_model(spec: str, *, predictor: bool = True) -> Path:
    """A path as given, or a built-in model name built (or found in the cache) on demand. The embedded model,
    smol-moe, comes with its learned routing predictor, fitted on first use (models/embedded.py), unless
    ``predictor`` is False (``fit-predictor`` itself: it fits its own)."""
    p = Path(spec)
    if p.exists() or "/" in spec or spec.endswith(".gguf"):
        return p
    from pyspecter.models import tiny

    if spec in tiny.TINY_MODELS or spec in tiny.BENCH_MODELS:
        return tiny.build_tiny(spec)
    from pyspecter.models import big

    if spec in big.BIG_MODELS:  # bigger than RAM: streamed to disk on first use (minutes; refused if no room)
        return big.build_big(spec)
    if spec == "smol-moe":
        from pyspecter.models.smol import build_smol_moe

        path = build_smol_moe()
        if predictor:
            from pyspecter.models.embedded import ensure_predictor

            ensure_predictor(path)
        return path
    m = SELF_DRAFT_NAME.fullmatch(spec)
    if m:  # smol-moe's self-draft: its FFN once per layer at low bits, the target's routers (models/smol_draft.py)
        from pyspecter.models.smol_draft import DEFAULT_FFN_TYPE, build_smol_moe_self_draft

        return build_smol_moe_self_draft(m.group(1) or DEFAULT_FFN_TYPE)
    m = DRAFT_NAME.fullmatch(spec)
    if m:  # smol-moe-draft, or e.g. smol-moe-draft-Q4_0-w0.25: experts Q4_0, narrowed to a quarter
        from pyspecter.models.draft import build_smol_moe_draft

        keep = float(m.group(2)) if m.group(2) else 1.0
        if not 0 < keep <= 1:
            raise SpecterError(f"{spec}: the width after -w must be in (0, 1]")
        return build_smol_moe_draft(m.group(1) or "Q2_K", ffn_keep=keep)
    raise SpecterError(f"{spec}: no such file, and not a built-in model ({', '.join(builtin_names())})")


# smol-moe's size before it is built, when its source isn't fetched either: what smol._moe_bytes gives for the
# pinned SmolLM2 GGUF (sha256 in smol.py) and 16 experts; tests/unit/test_catalog.py checks it against that
SMOL_MOE_BYTES = 847_267_072


@dataclass(frozen=True)
class Builtin:
    """A built-in model as `models list` shows it."""

    name: str
    nbytes: int  # on disk: the built file's size, else what building it writes (see ``size``)
    size: str  # "file": the built file's; "planned": from its spec, to within its header; "at most": a bound
    built: bool | None  # None: not a model (a name pattern), or can't tell (see ``note``)
    path: Path | None  # where it is (built) or will be
    note: str = ""  # why ``built`` is None


def builtins() -> list[Builtin]:
    """Every built-in name with its size on disk, built or not, so that a user sees what a first use writes
    (big-qwen3moe: 33 GB). Builds nothing: the cache paths come from the builders' content keys."""
    from pyspecter.models import big, tiny

    out = [_smol_moe()]
    draft = _draft(out[0].nbytes)
    out += [_self_draft(out[0].nbytes), Builtin("smol-moe-self-draft-TYPE", out[0].nbytes, "at most", None, None,
                                                "a name pattern")]
    out += [draft, Builtin("smol-moe-draft-TYPE-wKEEP", out[0].nbytes, "at most", None, None, "a name pattern")]
    for name, spec in (tiny.TINY_MODELS | tiny.BENCH_MODELS | big.BIG_MODELS).items():
        # tiny's planner sizes every expert type (big's refuses those it cannot make from random bytes), and
        # the big models are its tensor list grown up, so one planner for all
        key = big._cache_key(spec) if name in big.BIG_MODELS else tiny._cache_key(spec)
        # the file name that build_tiny and build_big give it (tests/unit/test_catalog.py checks tiny's)
        path = models_dir() / f"{name}-{key}.gguf"
        out.append(_found(Builtin(name, tiny.planned_bytes(spec), "planned", None, path)))
    return out


_NO_KEY = "unknown: llama.cpp's version, in its cache key, needs the native library"


def _found(b: Builtin) -> Builtin:
    """``b`` built (with its file's real size) or not, where its path is known; as it is where not."""
    if b.path is not None and b.path.exists():
        return Builtin(b.name, b.path.stat().st_size, "file", True, b.path)
    if b.path is not None:  # its key is known, and no file has it
        return Builtin(b.name, b.nbytes, b.size, False, b.path)
    return b


def _smol_moe() -> Builtin:
    from pyspecter.models import smol

    try:
        path = smol.smol_moe_path()
    except ImportError:  # llama.cpp's version is in the key: without it, size only
        path = None
    src = cache_dir() / "smollm2" / smol.GGUF_FILE
    nbytes = smol._moe_bytes(src, 16) if src.exists() else SMOL_MOE_BYTES
    return _found(Builtin("smol-moe", nbytes, "planned", None, path, _NO_KEY))


def _draft(target_bytes: int) -> Builtin:
    """The default draft: its size depends on which expert tensors llama.cpp's quantizer can make Q2_K, so until
    it is built only a bound is known (the draft code never writes more than the target's size)."""
    from pyspecter.models import draft

    try:
        path = draft.smol_moe_draft_path()
    except ImportError:
        path = None
    return _found(Builtin("smol-moe-draft", target_bytes, "at most", None, path, _NO_KEY))


def _self_draft(target_bytes: int) -> Builtin:
    """smol-moe's self-draft: a bound until built (its size depends on the quantizer's type choices; the staged
    copy it quantizes holds one FFN per layer, so a sixteenth of the experts plus the rest, under the target)."""
    from pyspecter.models import smol_draft

    try:
        path = smol_draft.smol_moe_self_draft_path()
    except ImportError:
        path = None
    return _found(Builtin("smol-moe-self-draft", target_bytes, "at most", None, path, _NO_KEY))
