"""The examples in docs/formats.md are doctests: the documentation stays true."""
import doctest
from pathlib import Path

import blockscale as bs

DOCS = Path(__file__).resolve().parents[1] / "docs"


def test_formats_md_examples_run():
    assert bs.get_backend() == "auto"  # the page shows the default
    result = doctest.testfile(str(DOCS / "formats.md"), module_relative=False,
                              optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    assert result.attempted > 20
    assert result.failed == 0
