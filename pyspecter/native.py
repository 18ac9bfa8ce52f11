"""ctypes access to the patched llama.cpp that llama-cpp-python loads.

Our extra ``extern "C"`` functions live in the same libllama the bindings load, so we bind them on that handle
(as ``llama_cpp/llama_cpp_ext.py`` does) instead of loading a second copy of the library.
"""

from __future__ import annotations

import ctypes
import os

from pyspecter.errors import SpecterError

PATCH_SERIES_VERSION = 5


def llama_lib() -> ctypes.CDLL:
    """The loaded libllama; refuses a stock or stale build with a clear message."""
    os.environ.setdefault("GGML_LOG_LEVEL", "error")
    try:
        import llama_cpp
    except ImportError as e:
        raise SpecterError(f"llama_cpp bindings are not installed ({e}); run `make build`") from None
    lib = llama_cpp.llama_cpp._lib
    try:
        fn = lib.llama_pyspecter_version
    except AttributeError:
        raise SpecterError("the loaded libllama lacks pyspecter's patches; run `make build`") from None
    fn.restype = ctypes.c_int32
    fn.argtypes = []
    got = fn()
    if got < PATCH_SERIES_VERSION:
        raise SpecterError(f"libllama has patch series v{got}, need v{PATCH_SERIES_VERSION}; run `make build`")
    return lib


def patch_series_version() -> int:
    return int(llama_lib().llama_pyspecter_version())


def quiet_logs() -> None:
    """Silence llama.cpp's stderr chatter (model loading prints hundreds of lines)."""
    import llama_cpp

    @llama_cpp.llama_log_callback
    def _sink(level, text, user_data):  # noqa: ARG001
        return None

    quiet_logs._keep = _sink  # type: ignore[attr-defined]  # the C side holds a pointer to it
    llama_cpp.llama_log_set(_sink, ctypes.c_void_p(0))


# --- expert slots (patches/0003) ------------------------------------------------------------------------------

KIND_GATE, KIND_UP, KIND_DOWN, KIND_GATE_UP = 0, 1, 2, 3
KIND_NAMES = {"gate": KIND_GATE, "up": KIND_UP, "down": KIND_DOWN, "gate_up": KIND_GATE_UP}

ROUTE_CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
                            ctypes.POINTER(ctypes.c_int32), ctypes.POINTER(ctypes.c_float))
WAIT_CB = ctypes.CFUNCTYPE(None, ctypes.c_void_p, ctypes.c_int32)  # (user_data, layer): late uploads must land

_SIGNATURES = {
    "llama_pyspecter_slots_init": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32]),
    "llama_pyspecter_n_slots": (ctypes.c_int32, [ctypes.c_void_p]),
    "llama_pyspecter_is_moe_layer": (ctypes.c_bool, [ctypes.c_void_p, ctypes.c_int32]),
    "llama_pyspecter_expert_nbytes": (ctypes.c_size_t, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32]),
    "llama_pyspecter_slots_nbytes": (ctypes.c_size_t, [ctypes.c_void_p]),
    "llama_pyspecter_slot_of": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32]),
    "llama_pyspecter_expert_in": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32]),
    "llama_pyspecter_set_slot": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32]),
    "llama_pyspecter_write_slot": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32,
                                                    ctypes.c_void_p, ctypes.c_size_t]),
    "llama_pyspecter_load_expert": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32,
                                                     ctypes.c_int32]),
    "llama_pyspecter_write_slot_async": (ctypes.c_int64, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32,
                                                          ctypes.c_int32, ctypes.c_void_p, ctypes.c_size_t]),
    "llama_pyspecter_load_expert_async": (ctypes.c_int64, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32,
                                                           ctypes.c_int32]),
    "llama_pyspecter_upload_done": (ctypes.c_bool, [ctypes.c_void_p, ctypes.c_int64]),
    "llama_pyspecter_upload_wait": (None, [ctypes.c_void_p, ctypes.c_int64]),
    "llama_pyspecter_set_link_gbps": (None, [ctypes.c_void_p, ctypes.c_double]),
    "llama_pyspecter_set_route_cb": (None, [ctypes.c_void_p, ROUTE_CB, ctypes.c_void_p]),
    "llama_pyspecter_set_wait_cb": (None, [ctypes.c_void_p, WAIT_CB, ctypes.c_void_p]),
    "llama_pyspecter_set_late": (ctypes.c_int32, [ctypes.c_void_p, ctypes.c_int32, ctypes.c_int32, ctypes.c_int32]),
    "llama_pyspecter_stats": (None, [ctypes.c_void_p, ctypes.POINTER(ctypes.c_int64)]),
    "llama_pyspecter_stats_reset": (None, [ctypes.c_void_p]),
    "llama_pyspecter_release_host_experts": (ctypes.c_size_t, [ctypes.c_void_p]),
}


class SlotAPI:
    """The slot functions of the patched library, typed. Methods are the C names without the prefix."""

    def __init__(self) -> None:
        lib = llama_lib()
        for name, (res, args) in _SIGNATURES.items():
            fn = getattr(lib, name)
            fn.restype = res
            fn.argtypes = args
            setattr(self, "_" + name.removeprefix("llama_pyspecter_") if name.endswith("_stats") else
                    name.removeprefix("llama_pyspecter_"), fn)

    def stats(self, model: int) -> dict[str, int]:
        """Counters kept by the C side since the last stats_reset."""
        out = (ctypes.c_int64 * 7)()
        self._stats(model, out)
        keys = ("route_calls", "hit_rows", "miss_rows", "route_ns", "hook_ns", "upload_bytes", "upload_ns")
        return dict(zip(keys, out, strict=True))


_slot_api: SlotAPI | None = None


def slots() -> SlotAPI:
    global _slot_api
    if _slot_api is None:
        _slot_api = SlotAPI()
    return _slot_api


# --- models and contexts --------------------------------------------------------------------------------------

class Model:
    """A llama_model loaded through the bindings. ``extra_bufts=False`` keeps expert tensors in plain, readable
    CPU buffers (repacked ones can't be read back or take negative ids), which the slot path needs; exactness
    comparisons load the stock model the same way."""

    LOAD_MODES = {"auto": -1, "none": 0, "mmap": 1}

    def __init__(self, path: str | os.PathLike, *, n_gpu_layers: int = 0, load_mode: str = "mmap",
                 extra_bufts: bool = False) -> None:
        import llama_cpp

        llama_lib()
        quiet_logs()
        self.path = str(path)
        p = llama_cpp.llama_model_default_params()
        p.n_gpu_layers = n_gpu_layers
        # mmap: the model's expert tensors are then a view of the file, which is what the ram and disk tiers use
        # as the host copy
        p.load_mode = self.LOAD_MODES[load_mode]
        p.use_extra_bufts = extra_bufts
        self.ptr = llama_cpp.llama_model_load_from_file(self.path.encode(), p)
        if not self.ptr:
            raise SpecterError(f"{self.path}: llama.cpp could not load this model")
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

    def close(self) -> None:
        import llama_cpp

        if self.ptr:
            llama_cpp.llama_model_free(self.ptr)
            self.ptr = None

    def __enter__(self) -> Model:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class Context:
    """A llama_context with the settings exactness depends on held explicit: flash attention off, fixed batch."""

    def __init__(self, model: Model, *, n_ctx: int = 512, n_batch: int = 512, n_threads: int = 2,
                 flash_attn: bool = False, cb_eval=None) -> None:
        """cb_eval: llama.cpp's eval callback (a llama_cpp.ggml_backend_sched_eval_callback), for observing
        graph nodes; keep a reference to it while the context lives."""
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

    def clear(self) -> None:
        import llama_cpp

        llama_cpp.llama_memory_clear(llama_cpp.llama_get_memory(self.ptr), True)
        self.n_past = 0

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
