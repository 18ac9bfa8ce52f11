"""Built-in model names: what a user may type instead of a GGUF path, and how each is built (or found cached)."""

from __future__ import annotations

import re
from pathlib import Path

from pyspecter.errors import SpecterError

DRAFT_NAME = re.compile(r"smol-moe-draft(?:-(Q\w+))?(?:-w([0-9.]+))?")  # smol-moe-draft[-TYPE][-wWIDTH]


def builtin_names() -> list[str]:
    from pyspecter.models import big, tiny

    return ["smol-moe", "smol-moe-draft", "smol-moe-draft-TYPE-wKEEP", *tiny.TINY_MODELS, *tiny.BENCH_MODELS,
            *big.BIG_MODELS]


def is_builtin(name: str) -> bool:
    return name in builtin_names() or DRAFT_NAME.fullmatch(name) is not None


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
    m = DRAFT_NAME.fullmatch(spec)
    if m:  # smol-moe-draft, or e.g. smol-moe-draft-Q4_0-w0.25: experts Q4_0, narrowed to a quarter
        from pyspecter.models.draft import build_smol_moe_draft

        keep = float(m.group(2)) if m.group(2) else 1.0
        if not 0 < keep <= 1:
            raise SpecterError(f"{spec}: the width after -w must be in (0, 1]")
        return build_smol_moe_draft(m.group(1) or "Q2_K", ffn_keep=keep)
    raise SpecterError(f"{spec}: no such file, and not a built-in model ({', '.join(builtin_names())})")
