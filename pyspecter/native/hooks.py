"""The one place where Python registers itself on llama.cpp's compute path.

The patched library calls a route hook once per MoE layer per ubatch (after the router, before the expert
matmuls) and, in ordered wait mode, a wait hook before a layer's late experts. Both run on llama.cpp's compute
thread inside ``llama_decode``: an exception must not unwind into C, so it is parked here and re-raised by
``check()`` once the decode has returned. The C side keeps only a function pointer, so the ctypes callbacks are
kept alive here for as long as they are registered.
"""

from __future__ import annotations

import ctypes
from collections.abc import Callable

import numpy as np

from pyspecter.errors import SpecterError
from pyspecter.native.lib import INPUT_CB, ROUTE_CB, WAIT_CB, slots

# on_route(il, n_tokens, n_used, ids, weights): ids and weights are ctypes pointers to [n_tokens][n_used]
RouteFn = Callable[[int, int, int, "ctypes._Pointer", "ctypes._Pointer"], None]
WaitFn = Callable[[int], None]
# on_input(il, x): x is a float32 numpy view [n_tokens, n_embd] of the layer's router input, valid during the call
InputFn = Callable[[int, "object"], None]


class Hooks:
    """Route (and optionally wait and input) hooks on one model. ``n_slots``: enable the model's slots first with
    that many per layer (observers that only watch the routing pass 1 or top-k: nothing is ever uploaded into
    them, so every row stays on the host path, which is stock llama.cpp's computation). The wait and input hooks
    change the graph, so they must be registered before the model's context is created."""

    def __init__(self, model, on_route: RouteFn | None, on_wait: WaitFn | None = None, *,
                 n_slots: int | None = None, on_input: InputFn | None = None, weights: bool = False) -> None:
        """weights=True: on_route reads the router weights (else it gets a null pointer for them, as the C side's
        default: on a device they stay there, one read back to the host less per layer)."""
        self.model = model
        self.api = slots()
        if n_slots is not None:
            rc = self.api.slots_init(model.ptr, n_slots)
            if rc != 0:
                raise SpecterError(f"{model.path}: could not enable the routing hook (slots_init returned {rc})")
        self.error: BaseException | None = None
        self._route_fn, self._wait_fn, self._input_fn = on_route, on_wait, on_input
        self._route_cb = ROUTE_CB(self._route) if on_route is not None else None
        if self._route_cb is not None:
            self.api.set_route_cb(model.ptr, self._route_cb, None)
            self.api.set_route_weights(model.ptr, weights)
        self._wait_cb = WAIT_CB(self._wait) if on_wait is not None else None
        if self._wait_cb is not None:
            self.api.set_wait_cb(model.ptr, self._wait_cb, None)
        self._input_cb = INPUT_CB(self._input) if on_input is not None else None
        if self._input_cb is not None:
            self.api.set_input_cb(model.ptr, self._input_cb, None)

    def _route(self, _ud, il, n_tokens, n_used, ids_p, w_p) -> None:
        try:
            self._route_fn(il, n_tokens, n_used, ids_p, w_p)
        except BaseException as e:  # noqa: BLE001 - never unwind into C
            self.error = self.error or e

    def _wait(self, _ud, il) -> None:
        try:
            self._wait_fn(il)
        except BaseException as e:  # noqa: BLE001 - never unwind into C
            self.error = self.error or e

    def _input(self, _ud, il, n_tokens, n_embd, x_addr) -> None:
        try:
            x = np.frombuffer((ctypes.c_float * (n_tokens * n_embd)).from_address(x_addr), np.float32)
            self._input_fn(il, x.reshape(n_tokens, n_embd))
        except BaseException as e:  # noqa: BLE001 - never unwind into C
            self.error = self.error or e

    def check(self) -> None:
        """Re-raise the first error a hook parked (call after each decode)."""
        if self.error is not None:
            err, self.error = self.error, None
            raise err

    def close(self) -> None:
        if self.model.ptr:
            if self._route_cb is not None:
                self.api.set_route_cb(self.model.ptr, ROUTE_CB(), None)
            if self._input_cb is not None:
                self.api.set_input_cb(self.model.ptr, INPUT_CB(), None)
            if self._wait_cb is not None:
                self.api.set_wait_cb(self.model.ptr, WAIT_CB(), None)
