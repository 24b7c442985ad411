"""AutoRound: the PTQ method (``AutoRound``), its options, the per-format grids and the layer reconstruction."""
from .grid import FP8Grid, Grid, MXGrid, NVFP4Grid, make_grid, spacing
from .method import AutoRound
from .options import AutoRoundOptions
from .reconstruct import ExpertsLearner, LinearLearner, batch_loss, fake_weights, reconstruct, sign_step

__all__ = ["AutoRound", "AutoRoundOptions", "ExpertsLearner", "FP8Grid", "Grid", "LinearLearner", "MXGrid", "NVFP4Grid",
           "batch_loss", "fake_weights", "make_grid", "reconstruct", "sign_step", "spacing"]
