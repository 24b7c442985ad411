"""``python -m blockscale.cli``: the ``blockscale`` command (also under torchrun: ``-m blockscale.cli learn-scales``)."""
import sys

from .main import main

sys.exit(main())
