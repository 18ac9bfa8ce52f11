"""Disk faults never produce a wrong token: a tier that fails or shortens chosen reads (after writing garbage into
the slot, as a torn read would) gives the stock greedy output in every miss mode, or a clean error."""

from __future__ import annotations

import errno
import os

import numpy as np
import pytest

from pyspecter import native
from pyspecter.cache import ExpertCache
from pyspecter.engine import greedy
from pyspecter.errors import SpecterError
from pyspecter.layout import read_layout
from pyspecter.models.tiny import build_tiny
from pyspecter.tiers import DiskTier

PROMPT = "faults must never change a token"


class FlakyDisk(DiskTier):
    """Every ``every``-th tensor read fails. ``torn``: it first writes garbage into the slot (a short read that
    landed part of the bytes); else it fails with EIO before touching the slot."""

    def __init__(self, every: int, torn: bool, seed: int) -> None:
        super().__init__()
        self.every, self.torn, self.reads, self.injected = every, torn, 0, 0
        self.rng = np.random.default_rng(seed)

    def _read_tensor(self, il: int, kind: str, expert: int, slot: int) -> None:
        with self._lock:
            self.reads += 1
            fail = self.reads % self.every == 0
            if fail:
                self.injected += 1
        if not fail:
            return super()._read_tensor(il, kind, expert, slot)
        if self.torn:
            t = self.layout.layer(il).tensors[kind]
            junk = self.rng.integers(0, 256, size=t.expert_bytes, dtype=np.uint8)
            self._write(il, kind, slot, junk.ctypes.data, t.expert_bytes)
            raise SpecterError(f"{self.layout.path}: short read of {t.name} expert {expert}")
        raise OSError(errno.EIO, os.strerror(errno.EIO))


@pytest.mark.parametrize("torn", [False, True], ids=["eio", "torn"])
@pytest.mark.parametrize("mode", ["wait", "ordered", "cpu"])
def test_failed_reads_never_map_a_slot(mode: str, torn: bool) -> None:
    seed = int(os.environ.get("PYSPECTER_TEST_SEED") or 0)
    print(f"PYSPECTER_TEST_SEED={seed}")
    path = build_tiny("tiny-mixtral")
    lay = read_layout(path)
    with native.Model(path) as m, native.Context(m) as ctx:
        toks = m.tokenize(PROMPT)
        ref, _ = greedy(ctx, toks, 16)
    tier = FlakyDisk(every=3, torn=torn, seed=seed)
    with native.Model(path) as m:
        cache = ExpertCache(m, lay, lay.n_expert_used + 1, miss="cpu" if mode == "cpu" else "wait",
                            ordered=mode == "ordered", tier=tier)
        try:
            with native.Context(m) as ctx:
                got, _ = greedy(ctx, toks, 16)
                cache.check()
        except SpecterError as e:  # a late expert that failed twice: a clean error, never a wrong token
            assert mode == "ordered" and "failed" in str(e), e
            got = None
        finally:
            cache.close()
    assert tier.injected > 0
    assert cache.residency.failed_uploads > 0
    if got is not None:
        assert got == ref
