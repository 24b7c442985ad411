"""The ``blockscale`` command line: one module per subcommand.

    main.py           the parser and dispatch: demo | quantize | eval ppl | learn-scales | formats | recipes | train
    common.py         flags and helpers every subcommand shares (--debug, --threads, recipes, progress, JSON records)
    checks.py         every flag value checked before work starts (finite floats, bounded sizes, devices, --out)
    reporting.py      one error line ``blockscale CMD: error: ...``, exit 2 usage / 1 runtime / 130, --debug
    quantize.py       ``quantize``'s method flags, built from the PTQ methods' option dataclasses
    learn_scales.py   ``learn-scales`` (an explicit teacher; metadata names only with a flag)
    train.py          ``train`` (also ``python -m blockscale.train``): every TrainConfig field is a flag
    demo.py           ``demo``: the main job (SmolLM2 PTQ + a short scale-learning run -> export -> reload -> table)
    formats_table.py  ``formats``: every format on a real weight matrix
"""
from .main import build_parser, main

__all__ = ["build_parser", "main"]
