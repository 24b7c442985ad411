"""``python -m blockscale.train``: the ``blockscale train`` command (``blockscale.cli.train``), also under torchrun
(a rank ends through ``exit_process``)."""
from ..cli.train import main
from .distributed import exit_process

exit_process(main(prog="python -m blockscale.train"))
