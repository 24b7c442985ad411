"""Learned step size (LSQ) training of NVFP4 block scales; distillation is a task on ``train``'s one loop."""
from .distill import (DISTILL_TRAIN, DistillConfig, DistillTask, distill, distill_loss, eval_next_token_loss,
                      load_distill_checkpoint, steps_per_scale_step)
from .enable import ENABLE_INITS, LSQLinear, enable, freeze, learner_modules, lsq_layers, scale_parameters, weight_parameters
from .experts import LSQExperts, NVFP4ExpertsScaleLearner
from .quantizer import LSQ_INITS, LSQ_MODES, NVFP4ScaleLearner, lsq_fake_quantize

__all__ = ["DISTILL_TRAIN", "DistillConfig", "DistillTask", "distill", "distill_loss", "eval_next_token_loss",
           "load_distill_checkpoint", "ENABLE_INITS", "LSQExperts", "LSQLinear", "LSQ_INITS", "LSQ_MODES",
           "NVFP4ExpertsScaleLearner", "NVFP4ScaleLearner", "enable", "freeze", "learner_modules", "lsq_fake_quantize",
           "lsq_layers",
           "scale_parameters", "steps_per_scale_step", "weight_parameters"]
