"""``python -m blockscale.cli``: the ``blockscale`` command (also under torchrun: ``-m blockscale.cli learn-scales``)."""
from .main import entry

entry()
