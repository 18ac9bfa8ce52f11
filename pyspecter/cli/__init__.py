"""The command line: it parses and prints, one module per command group; the library decides everything else.

Importing this package registers every command on ``app``.
"""

from pyspecter.cli import bench, info, measure, models, run, serve, study  # noqa: F401 - they register commands
from pyspecter.cli.app import app, main
from pyspecter.cli.options import BENCH_DEFAULTS, BENCH_POLICIES, DEFAULT_THREADS

__all__ = ["BENCH_DEFAULTS", "BENCH_POLICIES", "DEFAULT_THREADS", "app", "main"]
