"""How the command line reports a failure: one line ``blockscale <cmd>: error: <message>`` on stderr and an
exit code, never a traceback (unless ``--debug``).

    exit 2   a usage error: argparse rejected the command line, or ``UsageError`` (a bad flag value)
    exit 1   a runtime error: ``CheckpointError``, ``DataError``, ``QuantizationError`` (any other
             ``BlockscaleError``), ``OSError`` (``FileExistsError``, ``PermissionError``, ...),
             ``ImportError``, ``MemoryError`` / CUDA out of memory, ``RecursionError``, safetensors'
             ``SafetensorError`` (readers and writers name the file: ``file_errors``); anything else is
             reported as ``internal error: <Type>: <message> (rerun with --debug for the traceback)``
    exit 130 interrupted (Ctrl-C)
"""
from __future__ import annotations

import argparse
import re
import sys
import warnings
from typing import Callable

from ..errors import BlockscaleError, UsageError

EXIT_RUNTIME, EXIT_USAGE, EXIT_INTERRUPTED = 1, 2, 130
MAX_MESSAGE_CHARS = 2000
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


def one_line(text: str, limit: int = MAX_MESSAGE_CHARS) -> str:
    """``text`` on one line: terminal colour codes dropped, runs of whitespace (newlines too) made one
    space, cut to ``limit`` characters."""
    text = " ".join(_ANSI.sub("", str(text)).split())
    return text if len(text) <= limit else text[:limit - 3] + "..."


# Python keyword spellings in library messages -> the command line's flags (the CLI names its flags)
_FLAG_WORDS = {"skip_indivisible=True": "--skip-indivisible", "allow_partial=True": "--allow-partial",
               "exclude=[...]": "--exclude REGEX", "overwrite=True": "--overwrite", "verify=False": "--no-verify",
               "force=True": "--force"}
_WITH_FLAG = re.compile(r"\b[a-z_]+=(?:True|False|\[\.\.\.\]) \((--[a-z0-9-]+)\)")


def cli_wording(message: str) -> str:
    """``message`` with the library's keyword spellings replaced by the command line's flags:
    ``skip_indivisible=True`` -> ``--skip-indivisible``, ``allow_partial=True (--allow-partial)`` ->
    ``--allow-partial``."""
    message = _WITH_FLAG.sub(r"\1", message)
    for word, flag in _FLAG_WORDS.items():
        message = message.replace(word, flag)
    return message


def _is_out_of_memory(exc: BaseException) -> bool:
    oom = getattr(sys.modules.get("torch"), "OutOfMemoryError", None)
    return isinstance(exc, MemoryError) or (oom is not None and isinstance(exc, oom))


def describe(exc: BaseException) -> tuple[int, str]:
    """(exit code, one-line message) for an exception that ended a command."""
    msg = cli_wording(one_line(exc))
    if isinstance(exc, UsageError):
        return EXIT_USAGE, msg
    if isinstance(exc, BlockscaleError):
        return EXIT_RUNTIME, msg
    if _is_out_of_memory(exc):
        return EXIT_RUNTIME, "out of memory" + (f": {msg}" if msg else " (try smaller sizes, e.g. --batch-size)")
    if isinstance(exc, RecursionError):
        return EXIT_RUNTIME, f"input nested too deeply ({msg or 'maximum recursion depth exceeded'})"
    if isinstance(exc, (OSError, ImportError)):
        return EXIT_RUNTIME, msg or type(exc).__name__
    if type(exc).__name__ == "SafetensorError":  # a reader or writer that did not name its file (file_errors)
        return EXIT_RUNTIME, f"a safetensors file could not be read or written: {msg}"
    return EXIT_RUNTIME, (f"internal error: {type(exc).__name__}" + (f": {msg}" if msg else "")
                          + " (rerun with --debug for the traceback)")


def run_reported(prog: str, command: Callable[[], int], debug: bool = False) -> int:
    """``command()``'s exit code; any exception it raises printed as one line ``<prog>: error: ...``
    on stderr, with the exit code ``describe`` gives (re-raised as it is with ``debug``). Python warnings
    raised meanwhile print as one line ``<prog>: warning: ...`` each (in Python's format with ``debug``)."""
    try:
        with warnings.catch_warnings():
            if not debug:
                warnings.showwarning = lambda message, *a, **k: warn(prog, str(message))
            return command()
    except KeyboardInterrupt:
        if debug:
            raise
        print(f"{prog}: interrupted", file=sys.stderr, flush=True)
        return EXIT_INTERRUPTED
    except Exception as exc:  # noqa: BLE001: the top level reports every failure
        if debug:
            raise
        code, msg = describe(exc)
        print(f"{prog}: error: {msg}", file=sys.stderr, flush=True)
        return code


def warn(prog: str, message: str) -> None:
    """One line ``<prog>: warning: <message>`` on stderr."""
    print(f"{prog}: warning: {one_line(message)}", file=sys.stderr, flush=True)


_FLAG_ACTIONS = (argparse._StoreTrueAction, argparse._StoreFalseAction, argparse._StoreConstAction,
                 argparse._HelpAction, argparse._VersionAction)


def shows_default(action: argparse.Action) -> bool:
    """Whether ``--help`` should state ``action``'s default: an option taking a value whose default is
    neither None nor False (on/off flags and --help / --version have none to show)."""
    return (bool(action.option_strings) and not isinstance(action, _FLAG_ACTIONS)
            and action.default not in (None, False, argparse.SUPPRESS))


def default_text(value) -> str:
    """A default as ``--help`` shows it: 0.003 -> ``0.003``, (0.9, 0.95) -> ``0.9 0.95``."""
    if isinstance(value, (tuple, list)):
        return " ".join(default_text(v) for v in value)
    return f"{value:g}" if isinstance(value, float) else str(value)


class HelpFormatter(argparse.HelpFormatter):
    """Help that states every default: ``(default: X)`` is appended to an option's help unless the text
    already shows X (choices are listed by argparse or by the option's metavar)."""

    def _format_action(self, action):
        if shows_default(action):
            text = default_text(action.default)
            words = re.findall(r"[^\s(),:;]+", action.help or "")
            if text not in words and text.replace(" ", "") not in words:
                saved = action.help
                action.help = ((saved or "").replace("%", "%%") + f" (default: {text.replace('%', '%%')})").strip()
                try:
                    return super()._format_action(action)
                finally:
                    action.help = saved
        return super()._format_action(action)


class ArgumentParser(argparse.ArgumentParser):
    """argparse with one-line errors: ``<prog>: error: <message> (see <prog> --help)``, exit code 2, and
    ``HelpFormatter``. Subparsers made with ``add_subparsers`` are of this class too."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("formatter_class", HelpFormatter)
        super().__init__(*args, **kwargs)

    def error(self, message: str):
        print(f"{self.prog}: error: {one_line(message)} (see {self.prog} --help)", file=sys.stderr, flush=True)
        sys.exit(EXIT_USAGE)


__all__ = ["ArgumentParser", "HelpFormatter", "default_text", "shows_default", "EXIT_INTERRUPTED", "EXIT_RUNTIME", "EXIT_USAGE", "cli_wording", "describe", "one_line",
           "run_reported", "warn"]
