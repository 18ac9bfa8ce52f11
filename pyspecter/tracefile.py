"""Reading routing traces (``.npz``, written by ``pyspecter trace``; the format is described in study/trace.py).

The runtime reads a trace only as a routing profile (which experts to load first), so the reader lives here
and the recorder with the study code.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from pyspecter.errors import SpecterError

TRACE_FORMAT = 1


@dataclass
class Trace:
    """A loaded trace: ``meta`` (the JSON) and the arrays by name (see the module docstring)."""

    meta: dict
    arrays: dict[str, np.ndarray]

    def get(self, name: str) -> np.ndarray | None:
        return self.arrays.get(name)

    def __getitem__(self, name: str) -> np.ndarray:
        return self.arrays[name]

    @property
    def n_rows(self) -> int:
        return int(self.arrays["target_ids"].shape[0])

    @property
    def n_expert(self) -> int:
        return int(self.meta["n_expert"])

    @property
    def n_used(self) -> int:
        return int(self.arrays["target_ids"].shape[2])

    @property
    def expert_bytes(self) -> np.ndarray:
        return np.asarray(self.meta["expert_bytes"], np.float64)

    @property
    def row_split(self) -> np.ndarray:
        """The split ("tune"/"eval") of each row's prompt."""
        splits = np.array([p["split"] for p in self.meta["prompts"]] or ["eval"])
        return splits[self.arrays["prompt_index"].astype(np.int64)]


def load_trace(path: str | os.PathLike) -> Trace:
    p = Path(path)
    if not p.is_file():
        raise SpecterError(f"{p}: no such trace")
    try:
        with np.load(p, allow_pickle=False) as z:
            arrays = {name: z[name] for name in z.files}
    except Exception as e:  # noqa: BLE001 - numpy raises many types on a damaged .npz (BadZipFile, EOFError, ...)
        raise SpecterError(f"{p}: not a routing trace ({type(e).__name__}: {e})") from None
    if "meta" not in arrays or "target_ids" not in arrays:
        raise SpecterError(f"{p}: not a routing trace (no meta/target_ids)")
    try:
        meta = json.loads(str(arrays.pop("meta")))
    except ValueError:
        raise SpecterError(f"{p}: not a routing trace (bad meta)") from None
    if meta.get("format") != TRACE_FORMAT:
        raise SpecterError(f"{p}: trace format {meta.get('format')}, this pyspecter reads {TRACE_FORMAT}")
    return Trace(meta, arrays)
