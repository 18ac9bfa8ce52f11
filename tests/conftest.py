from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import gguf
import numpy as np
import pytest


def pytest_configure(config: pytest.Config) -> None:
    """The measured costs and routing (devcosts.json, routing.json) go to a folder of the test session's own, for it
    and the CLI processes it starts: the suite's models in temporary folders and its RPC servers on random ports
    would otherwise each leave an entry in the user's files. Built models stay in the shared cache; a test that
    reads those files in a cache of its own unsets it."""
    if "SPECTER_MEASUREMENTS" not in os.environ:
        config._specter_measurements = os.environ["SPECTER_MEASUREMENTS"] = tempfile.mkdtemp(prefix="specter-m-")


def pytest_unconfigure(config: pytest.Config) -> None:
    folder = getattr(config, "_specter_measurements", None)
    if folder:
        shutil.rmtree(folder, ignore_errors=True)
        os.environ.pop("SPECTER_MEASUREMENTS", None)


def run_cli(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    """The CLI as a user runs it: a fresh process, so exit codes and stderr are the real ones."""
    return subprocess.run([sys.executable, "-m", "pyspecter", *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def dense_gguf(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A small dense llama GGUF (no experts): only its header matters to the commands that refuse it."""
    path = tmp_path_factory.mktemp("dense") / "dense.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("dense test model")
    w.add_block_count(1)
    w.add_embedding_length(8)
    w.add_feed_forward_length(16)
    w.add_head_count(2)
    w.add_tensor("token_embd.weight", np.zeros((4, 8), np.float32))
    w.add_tensor("blk.0.ffn_up.weight", np.zeros((16, 8), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.fixture(scope="module")
def dev():
    """A strict RPC server's device for one module's in-process tests (integration/test_device.rpc_device); a
    module that needs another (counted synchronisations) defines its own."""
    from test_device import rpc_device

    yield from rpc_device()


@pytest.fixture
def poisoned_slots(monkeypatch: pytest.MonkeyPatch) -> None:
    """Device slots start as NaN, not zeros (a GPU's fresh memory is garbage, the RPC server's is zeroed): a read of
    a slot before an upload wrote it, or of a zero slot never zeroed, turns the logits NaN. A module takes it with
    ``pytestmark = pytest.mark.usefixtures("poisoned_slots")``."""
    monkeypatch.setenv("SPECTER_POISON_SLOTS", "1")
