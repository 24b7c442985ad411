"""Running the command line in-process from tests."""
from __future__ import annotations

from blockscale import cli


def run_cli(argv, capsys):
    """(exit code, stdout, stderr) of ``cli.main(argv)`` in-process (argparse errors exit via SystemExit);
    what fixtures printed before is dropped."""
    capsys.readouterr()
    try:
        code = cli.main([str(a) for a in argv])
    except SystemExit as exc:
        code = exc.code
    cap = capsys.readouterr()
    return code, cap.out, cap.err
