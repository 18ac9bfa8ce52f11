"""Models and contexts loaded through llama-cpp-python's bindings, with the settings exactness depends on."""

from __future__ import annotations

import ctypes
import os
import sys
from collections.abc import Iterable

from pyspecter.errors import SpecterError
from pyspecter.native.devices import Device, Placement
from pyspecter.native.lib import llama_lib, slots
from pyspecter.native.logs import quiet_logs


class Model:
    """A llama_model loaded through the bindings. ``extra_bufts=False`` keeps expert tensors in plain, readable
    CPU buffers (repacked ones can't be read back or take negative ids), which the slot path needs; exactness
    comparisons load the stock model the same way."""

    LOAD_MODES = {"auto": -1, "none": 0, "mmap": 1}

    def __init__(self, path: str | os.PathLike, *, n_gpu_layers: int = 0, load_mode: str = "mmap",
                 extra_bufts: bool = False, device: Device | None = None, n_cpu_moe: int | None = None,
                 host_layers: Iterable[int] | None = None, lazy_experts: bool = False, pinned: bool = False) -> None:
        """device: every layer on that ggml device, routed experts in host memory (all of them, only the first
        n_cpu_moe layers' as llama.cpp's --n-cpu-moe, or only host_layers': a layer plan's host and slot layers).
        None: everything on the CPU. lazy_experts: the file mapping
        is not pre-faulted for the routed experts (patch 0005), so a model bigger than RAM loads without reading
        them; stock pre-faults the whole file. pinned: with a device, those host experts are copied into its
        pinned host memory at load where it has one (``Placement``), as slot layers need; where that memory cannot
        be had, the model loads as stock places it, and says so (``self.pinned``: whether it is)."""
        import llama_cpp

        llama_lib()
        quiet_logs()
        self.path = str(path)
        self.device = device
        p = llama_cpp.llama_model_default_params()
        p.n_gpu_layers = n_gpu_layers
        # mmap: the model's expert tensors are then a view of the file, which is what the ram and disk tiers use
        # as the host copy
        p.load_mode = self.LOAD_MODES[load_mode]
        p.use_extra_bufts = extra_bufts
        if lazy_experts:
            p.lazy_mode = 2  # LLAMA_LAZY_MODE_ON: with patch 0005, routed experts too
        pinned = pinned and device is not None and not lazy_experts  # lazy experts stay in the file (patch 0005)
        placement = Placement(device, n_cpu_moe, host_layers, pinned) if device is not None else None
        if placement is not None:
            placement.apply(p)  # its arrays stay alive until the load below has read them
        self.ptr = llama_cpp.llama_model_load_from_file(self.path.encode(), p)
        self.pinned = placement is not None and placement.pinned
        if not self.ptr and self.pinned:  # pinned memory refused (csrc/pinned.cpp logs how much)
            print(f"pyspecter: {os.path.basename(self.path)}: could not pin the host experts on {device.name}: "
                  "they stay in the file's mapping (uploads slower, no --miss mapped)", file=sys.stderr)
            placement = Placement(device, n_cpu_moe, host_layers)
            placement.apply(p)
            self.ptr = llama_cpp.llama_model_load_from_file(self.path.encode(), p)
            self.pinned = False
        del placement
        if not self.ptr:
            where = f" on {device.name}" if device is not None else ""
            raise SpecterError(f"{self.path}: llama.cpp could not load this model{where}")
        self.vocab = llama_cpp.llama_model_get_vocab(self.ptr)
        self.n_vocab = int(llama_cpp.llama_vocab_n_tokens(self.vocab))
        self.n_layer = int(llama_cpp.llama_model_n_layer(self.ptr))

    def tokenize(self, text: str, add_special: bool = True, parse_special: bool = True) -> list[int]:
        import llama_cpp

        raw = text.encode()
        buf = (llama_cpp.llama_token * (len(raw) + 16))()
        n = llama_cpp.llama_tokenize(self.vocab, raw, len(raw), buf, len(buf), add_special, parse_special)
        if n < 0:
            raise SpecterError("tokenization overflow")
        return list(buf[:n])

    def detokenize(self, tokens: list[int]) -> str:
        import llama_cpp

        out = b""
        piece = ctypes.create_string_buffer(256)
        for t in tokens:
            n = llama_cpp.llama_token_to_piece(self.vocab, t, piece, len(piece), 0, False)
            out += piece.raw[: max(n, 0)]
        return out.decode("utf-8", errors="replace")

    def is_eog(self, token: int) -> bool:
        import llama_cpp

        return bool(llama_cpp.llama_vocab_is_eog(self.vocab, token))

    def host_experts(self) -> str | None:
        """The buffer type that holds the first slot layer's host experts, what its uploads and mapped misses read
        (CUDA_Host_experts: pinned; CPU_Mapped: the file's pages), or None before slots are made."""
        from pyspecter.native.device_api import host_experts_buffer

        return next(filter(None, (host_experts_buffer(self.ptr, il) for il in range(self.n_layer))), None)

    def close(self) -> None:
        """Free the model; safe to call again, and from __del__ (also on a half-built object)."""
        ptr, self.ptr = getattr(self, "ptr", None), None
        if ptr:
            import llama_cpp

            llama_cpp.llama_model_free(ptr)

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # noqa: BLE001  # interpreter shutdown: the bindings may already be gone
            pass

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Context:
    """A llama_context with the settings exactness depends on held explicit: flash attention off, fixed batch."""

    def __init__(self, model: Model, *, n_ctx: int = 512, n_batch: int = 512, n_threads: int = 2,
                 flash_attn: bool = False, cb_eval=None, op_offload: bool | None = None) -> None:
        """cb_eval: llama.cpp's eval callback (a llama_cpp.ggml_backend_sched_eval_callback), for observing
        graph nodes; keep a reference to it while the context lives. op_offload: llama.cpp's (send a host-weight
        matmul of a >= 32-token batch to the device); None: on, except for a model with expert slots on a
        device, whose host path carries negative ids that only the CPU kernel skips (the scheduler's copy of the
        used experts asserts on them) and whose misses belong on the CPU by design."""
        import llama_cpp

        self.model = model
        p = llama_cpp.llama_context_default_params()
        p.n_ctx = n_ctx
        p.n_batch = n_batch
        p.n_ubatch = n_batch
        p.n_threads = n_threads
        p.n_threads_batch = n_threads
        p.flash_attn_type = 1 if flash_attn else 0  # LLAMA_FLASH_ATTN_TYPE_{DISABLED=0,ENABLED=1}
        p.no_perf = True
        if op_offload is None:
            op_offload = model.device is None or slots().n_slots(model.ptr) == 0
        p.op_offload = op_offload
        if cb_eval is not None:
            p.cb_eval = cb_eval
            p.cb_eval_user_data = None
        self.n_ctx = n_ctx
        self.n_batch = n_batch
        self.ptr = llama_cpp.llama_init_from_model(model.ptr, p)
        if not self.ptr:
            raise SpecterError("llama.cpp could not create a context")
        self._batch = llama_cpp.llama_batch_init(n_batch, 0, 1)
        self.n_past = 0
        self.tokens: list[int] = []  # what the KV cache holds, position by position (prefix reuse reads it)
        self.n_decoded = 0  # tokens run through the model since the context was made

    def decode(self, tokens: list[int], *, logits_all: bool = False, logits: bool = True):
        """Append tokens to sequence 0; return the logits of the last token (or of every token), float32.
        logits=False asks for none and returns None: llama.cpp then skips the output head (and the last layer's
        FFN, which only feeds it)."""
        import llama_cpp
        import numpy as np

        if self.n_past + len(tokens) > self.n_ctx:
            raise SpecterError(f"context full ({self.n_ctx} tokens)")
        rows = []
        for start in range(0, len(tokens), self.n_batch):
            chunk = tokens[start:start + self.n_batch]
            b = self._batch
            b.n_tokens = len(chunk)
            for i, t in enumerate(chunk):
                b.token[i] = t
                b.pos[i] = self.n_past + i
                b.n_seq_id[i] = 1
                b.seq_id[i][0] = 0
                b.logits[i] = logits_all or (logits and i == len(chunk) - 1)
            rc = llama_cpp.llama_decode(self.ptr, b)
            if rc != 0:
                raise SpecterError(f"llama_decode failed ({rc})")
            self.n_past += len(chunk)
            self.tokens += chunk
            self.n_decoded += len(chunk)
            n_vocab = self.model.n_vocab
            if logits_all:
                for i in range(len(chunk)):
                    p = llama_cpp.llama_get_logits_ith(self.ptr, i)
                    rows.append(np.ctypeslib.as_array(p, shape=(n_vocab,)).copy())
            elif logits and start + self.n_batch >= len(tokens):
                p = llama_cpp.llama_get_logits_ith(self.ptr, -1)
                rows.append(np.ctypeslib.as_array(p, shape=(n_vocab,)).copy())
        if not logits and not logits_all:
            return None
        return np.stack(rows) if logits_all else rows[-1]

    def warmup(self) -> None:
        """Run one token and forget it: a fresh context's first decode allocates its compute buffers, which is
        load time, not speed."""
        self.decode([0])
        self.clear()

    def truncate(self, n_keep: int) -> None:
        """Drop cached positions >= n_keep (KV rollback)."""
        import llama_cpp

        llama_cpp.llama_memory_seq_rm(llama_cpp.llama_get_memory(self.ptr), 0, n_keep, -1)
        self.n_past = min(self.n_past, n_keep)
        del self.tokens[n_keep:]

    def clear(self) -> None:
        import llama_cpp

        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ptr), True)
        self.n_past = 0
        self.tokens = []

    def reuse(self, tokens: list[int]) -> list[int]:
        """Keep the longest cached prefix of ``tokens`` (at most all but the last, which must be decoded for its
        logits), drop the rest of the cache, and return the tokens still to decode: a chat turn then processes
        only what is new, as llama.cpp and mlx-lm do."""
        n = 0
        limit = min(len(self.tokens), len(tokens) - 1)
        while n < limit and self.tokens[n] == tokens[n]:
            n += 1
        self.truncate(n)
        return tokens[n:]

    def close(self) -> None:
        import llama_cpp

        if self.ptr:
            llama_cpp.llama_batch_free(self._batch)
            llama_cpp.llama_free(self.ptr)
            self.ptr = None

    def __enter__(self) -> Context:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
