"""pyspecter: run Mixture-of-Experts LLMs bigger than fast memory on a patched llama.cpp.

The Python API (``load``, ``generate``, ``stream_generate``) lives in ``pyspecter.api``; it is imported on first
use, so the CLI and ``import pyspecter`` stay quick.
"""

import os as _os

# numpy's BLAS would start a thread per core for the learned predictor's small matmuls, which run inside
# llama.cpp's compute (the input hook): on 2 cores its threads and llama.cpp's spinning OpenMP threads took
# 250-530 us per layer instead of 18. One thread, unless the user chose otherwise; set before numpy loads.
_os.environ.setdefault("OPENBLAS_NUM_THREADS", "1")

from pyspecter._version import __version__

__all__ = ["Response", "__version__", "generate", "load", "stream_generate"]


def __getattr__(name: str):
    if name in ("Response", "generate", "load", "stream_generate"):
        from pyspecter import api

        return getattr(api, name)
    raise AttributeError(f"module 'pyspecter' has no attribute {name!r}")
