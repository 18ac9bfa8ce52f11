"""Thin command-line layer: parse, call, print. Work lives in the modules."""

import typer

app = typer.Typer(add_completion=False, no_args_is_help=True, help=__doc__)


def main() -> None:
    app()
