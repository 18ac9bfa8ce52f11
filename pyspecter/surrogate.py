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
        self._scratch: dict[str, np.ndarray] = {}

    def write(self, api: native.SlotAPI, model_ptr, il: int, expert: int, slot: int) -> None:
        """Expand expert ``expert`` of layer ``il`` into ``slot`` (dropped neurons zero)."""
        L = self.layout.layer(il)
        for kind, t in L.tensors.items():
            E, n_rows, _ = t.shape
            # one scratch buffer per tensor kind, shared by all layers (their experts have the same size here;
            # a bigger one is allocated when not)
            buf = self._scratch.get(kind)
            if buf is None or buf.size < t.expert_bytes:
                buf = self._scratch[kind] = np.zeros(t.expert_bytes, np.uint8)
            buf = buf[: t.expert_bytes]
            buf[:] = 0
            if kind == "down":
                view = buf.reshape(n_rows, t.shape[2] // self.group, -1)
                view[:, self.groups[il][expert], :] = self.data[il][kind][expert]
            else:
                view = buf.reshape(n_rows, -1)
                view[self.rows[il][expert]] = self.data[il][kind][expert]
            rc = api.write_slot(model_ptr, il, native.KIND_NAMES[kind], slot, buf.ctypes.data, t.expert_bytes)
            if rc != 0:
                raise SpecterError(f"write of a surrogate into slot {slot} of layer {il} failed ({rc})")
