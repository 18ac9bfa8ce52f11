"""pyspecter: run Mixture-of-Experts LLMs bigger than fast memory on a patched llama.cpp.

The Python API (``load``, ``generate``, ``stream_generate``) lives in ``pyspecter.api``; it is imported on first
use, so the CLI and ``import pyspecter`` stay quick.
"""

__version__ = "0.1.0"

__all__ = ["Response", "__version__", "generate", "load", "stream_generate"]


def __getattr__(name: str):
    if name in ("Response", "generate", "load", "stream_generate"):
        from pyspecter import api

        return getattr(api, name)
    raise AttributeError(f"module 'pyspecter' has no attribute {name!r}")
