"""``python -m blockscale.train``: the ``blockscale train`` command (``blockscale.cli.train``), also under torchrun."""
import sys

from ..cli.train import main

sys.exit(main(prog="python -m blockscale.train"))
