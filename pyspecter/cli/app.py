"""pyspecter: run Mixture-of-Experts LLMs bigger than fast memory on a patched llama.cpp.

Bad input (missing or corrupt file, a budget that can't fit, a model without experts) ends with a one-line
error and exit code 2.
"""

from __future__ import annotations

import inspect
import re
import sys
from typing import Annotated, Any

import typer

from pyspecter.errors import SpecterError


# Only typer's public surface here: the CLI must import on every typer that pyproject allows (its internals move
# between releases; an assignment to one, TyperOption.display_type_rich, once broke every command at import on all
# typers but one). A group class passed as Typer(cls=...) overriding click's Group.list_commands is documented
# typer/click API and works at both ends of the pinned range (tests/integration/test_typer_range.py).
def reflow(text: str | None) -> str | None:
    """Each paragraph of a help text (docstring) on one line, so that the terminal's width alone decides where lines
    break. Docstrings break at the source's width, and typer keeps those breaks in rich markup mode (in the
    command list always; from 0.28 also past a command's first paragraph), so at 120 columns a word or two was left
    alone on a line. Paragraphs (blank-line separated) and click's \\b no-rewrap blocks stay as written."""
    if not text:
        return text
    paragraphs = inspect.cleandoc(text).split("\n\n")
    return "\n\n".join(p if p.startswith("\b") else " ".join(line.strip() for line in p.splitlines())
                       for p in paragraphs)


class _Reflowed(typer.core.TyperGroup):
    """A group whose own help and whose commands' help are reflowed (:func:`reflow`). Both through click's public
    Command API (the help attribute, get_command), the same at both ends of the typer range."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.help = reflow(self.help)

    def get_command(self, ctx: typer.Context, cmd_name: str) -> Any:
        cmd = super().get_command(ctx, cmd_name)
        if cmd is not None:
            cmd.help = reflow(cmd.help)
        return cmd


class _ByUse(_Reflowed):
    """--help lists commands in the order people reach for them, not the order they were written."""

    ORDER = ("chat", "generate", "serve", "rpc-server", "inspect", "bench", "scale", "verify", "models", "draft",
             "trace", "analyze", "fit-predictor", "surrogate", "demo")

    def list_commands(self, ctx: typer.Context) -> list[str]:
        names = super().list_commands(ctx)
        return sorted(names, key=lambda n: self.ORDER.index(n) if n in self.ORDER else len(self.ORDER))

    def resolve_command(self, ctx: typer.Context, args: list[str]) -> tuple[str | None, Any, list[str]]:
        """The command and its arguments, ``-m MODEL`` among them (``model_first``): click's public Group API,
        so the same in-process (``app([...])``, typer's test runner) as from the entry point, on every typer."""
        name, cmd, rest = super().resolve_command(ctx, args)
        return name, cmd, model_first(cmd, rest)

    # A usage error (a bad option value, a missing argument, an unknown option or command) ends in one line and exit
    # code 2, like every other bad input, instead of typer's boxed usage text. make_context parses this group's own
    # options; invoke resolves the command and parses its (and a sub-group's) options. Both are click's public
    # Command API at both ends of the typer range; everything else (--help, Ctrl-C, typer.Exit codes) is left to typer.
    def make_context(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return super().make_context(*args, **kwargs)
        except _usage_error() as e:
            _one_line_usage_error(e)

    def invoke(self, ctx: typer.Context) -> Any:
        try:
            return super().invoke(ctx)
        except _usage_error() as e:
            _one_line_usage_error(e, ctx)


def _usage_error() -> type[Exception]:
    """click's UsageError, from the click that typer runs on: click itself up to typer 0.27, typer's own copy
    (typer._click) from 0.28, when a separately installed click (uvicorn's) has a UsageError of its own that typer
    never raises. typer exports BadParameter at every release, and it is a UsageError."""
    return next(c for c in typer.BadParameter.__mro__ if c.__name__ == "UsageError")


def _one_line_usage_error(e: Exception, ctx: typer.Context | None = None) -> None:
    """Print ``pyspecter: error: <what>`` with where to look, and end with exit code 2 (click's for usage errors)."""
    # Group help shown for a bare `pyspecter models` is a UsageError on click 8.2+; typer shows it as help and so do
    # we (typer tells it apart by this name, cf. its rich_utils, to import nothing private)
    if type(e).__name__ == "NoArgsIsHelpError":
        raise e
    msg = re.sub(r"\s*\n\s*", " ", e.format_message()).strip().rstrip(".")  # type: ignore[attr-defined]
    if msg[:2].istitle():  # "Invalid value ...", "No such option ...": lower case, as our own errors read
        msg = msg[0].lower() + msg[1:]
    where = getattr(e, "ctx", None) or ctx
    hint = f" (see {where.command_path} --help)" if where is not None else ""
    print(f"pyspecter: error: {msg}{hint}", file=sys.stderr)
    raise typer.Exit(2)


app = typer.Typer(cls=_ByUse, add_completion=False, no_args_is_help=True, help=__doc__,
                  pretty_exceptions_enable=False)
models_app = typer.Typer(cls=_Reflowed, no_args_is_help=True,
                         help="Build the project's own models (fixtures, smol-moe, drafts).")
app.add_typer(models_app, name="models")


def _version(value: bool) -> None:
    if value:
        from pyspecter.versions import describe

        print(describe())
        raise typer.Exit()


@app.callback()
def _root(version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True,
                                                help="print the package, patch-series and llama.cpp versions")]
          = False) -> None:
    """pyspecter: run Mixture-of-Experts LLMs bigger than fast memory on a patched llama.cpp."""


def model_first(cmd: Any, args: list[str]) -> list[str]:
    """llama.cpp users type ``-m MODEL``; a command whose first argument is its MODEL (a positional parameter named
    ``model``) takes ``-m X`` / ``--model X`` / ``--model=X`` as exactly that. Other commands' arguments are
    untouched (``models build -m`` stays an error)."""
    if cmd is None or not any(p.name == "model" and p.param_type_name == "argument" for p in cmd.params):
        return args
    rest, model, i = [], None, 0
    while i < len(args):
        a = args[i]
        if a in ("-m", "--model") and i + 1 < len(args):
            model, i = args[i + 1], i + 2
            continue
        if a.startswith("--model="):
            model = a.split("=", 1)[1]
        else:
            rest.append(a)
        i += 1
    return [model, *rest] if model is not None else rest


def main() -> None:
    # Standalone mode lets click turn usage errors into exit code 2; our own bad-input errors come out here.
    try:
        app()
    except SpecterError as e:
        print(f"pyspecter: error: {e}", file=sys.stderr)
        sys.exit(2)
    except BrokenPipeError:  # `pyspecter ... | head`: the reader left; nothing to report
        import os

        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        sys.exit(1)
    except (ImportError, RuntimeError, OSError) as e:
        # the native library missing or not loading: one line with the command that fixes it, not a traceback
        from pyspecter.native.install import missing_native

        line = missing_native(e)
        if line is None and not isinstance(e, OSError):
            raise
        # else a full disk, a read-only or missing cache folder: one line, not a traceback
        print(f"pyspecter: error: {line or os_error_line(e)}", file=sys.stderr)
        sys.exit(2)


def os_error_line(e: OSError) -> str:
    """What went wrong with which file, and what to do when it is the cache (where every command writes)."""
    import os
    from pathlib import Path

    from pyspecter.paths import cache_dir

    path = e.filename if e.filename is not None else cache_dir()
    reason = e.strerror or str(e)
    in_cache = Path(os.path.abspath(path)).is_relative_to(os.path.abspath(cache_dir()))
    if in_cache:  # every command writes there: that is what failed
        return f"cannot write {path}: {reason} (set SPECTER_CACHE to a writable folder)"
    return f"cannot access {path}: {reason}"  # a file the user named, read or written
