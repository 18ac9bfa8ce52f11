"""Surrogate experts: an approximate, opt-in way to serve a miss without waiting for the slow tier.

Each routed expert keeps, in fast memory, the ``keep`` fraction of its hidden neurons that matter most (measured
per expert on calibration text, as for narrowed drafts). They are stored as the target's own quantized bytes —
gate/up rows and whole down-projection blocks — so serving one is a copy into a slot with the dropped neurons'
bytes zeroed (an all-zero block is 0.0 in every ggml type used for weights), not a re-quantization. SPICE's LoRE
does this with a low-rank factorisation; a neuron subset is what a llama.cpp slot can hold without new kernels.

The output is no longer the target's: ``measure`` reports the perplexity cost next to the exact mode, and the
mode is never on by default.
"""

from __future__ import annotations

import numpy as np

from pyspecter import native
from pyspecter.errors import SpecterError
from pyspecter.layout import ModelLayout

_KINDS = ("gate", "up", "down")


def group_size(layout: ModelLayout) -> int:
    """Neurons per selectable unit: one quantization block of the down projection's rows (1 for float types)."""
    import gguf

    t = layout.layers[0].tensors["down"]
    return int(gguf.GGML_QUANT_SIZES[gguf.GGMLQuantizationType[t.ggml_type]][0])


class Surrogates:
    """The kept bytes of every expert, in RAM, and how to put one into a slot."""

    def __init__(self, layout: ModelLayout, groups: dict[int, np.ndarray]) -> None:
        self.layout = layout
        self.group = g = group_size(layout)
        self.data: dict[int, dict[str, np.ndarray]] = {}  # layer -> kind -> [E, ...kept bytes]
        self.rows: dict[int, np.ndarray] = {}  # layer -> [E, kept neurons]
        self.groups = groups
        self.nbytes = 0
        mm = np.memmap(layout.path, dtype=np.uint8, mode="r")
        for L in layout.layers:
            gr = groups[L.index]
            neurons = (gr[:, :, None] * g + np.arange(g)).reshape(gr.shape[0], -1)
            self.rows[L.index] = neurons
            per = {}
            for kind, t in L.tensors.items():
                E, n_rows, _ = t.shape
                raw = mm[t.offset: t.offset + E * t.expert_bytes].reshape(E, n_rows, -1)
                if kind == "down":  # [E, n_embd, n_groups, group bytes]: keep whole blocks
                    blocks = raw.reshape(E, n_rows, t.shape[2] // g, -1)
                    per[kind] = np.ascontiguousarray(np.take_along_axis(blocks, gr[:, None, :, None], axis=2))
                else:  # [E, n_ff, row bytes]: keep whole rows
                    per[kind] = np.ascontiguousarray(np.take_along_axis(raw, neurons[:, :, None], axis=1))
                self.nbytes += per[kind].nbytes
            self.data[L.index] = per
        del mm

    def install(self, api: native.SlotAPI, model_ptr, il: int, first: int, n_reserved: int) -> None:
        """Hand layer il's kept bytes to native residency, which expands them into its reserved slots
        [first, first + n_reserved) (csrc/surrogate.cpp); this copy of them can go afterwards (``release``)."""
        gr = np.ascontiguousarray(self.groups[il], np.int32)
        rc = api.set_surrogates(model_ptr, il, first, n_reserved, self.group, gr.ctypes.data, gr.shape[1])
        for kind, data in self.data[il].items():
            if rc == 0:
                rc = api.set_surrogate_bytes(model_ptr, il, native.KIND_NAMES[kind], data.ctypes.data, data.nbytes)
        if rc != 0:
            raise SpecterError(f"layer {il}: the surrogates do not fit the slots ({native.status_name(rc)})")

    def release(self) -> None:
        """C holds its own copy of the kept bytes: drop this one (``nbytes`` still says what they take)."""
        self.data = {}
