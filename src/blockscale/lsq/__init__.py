"""Learned step size (LSQ) training of NVFP4 block scales; distillation is a task on ``train``'s one loop;
``recover`` runs the whole scale learning after PTQ (``blockscale learn-scales``)."""
from .distill import (DISTILL_TRAIN, LR_RETRY_FACTOR, LR_SCHEDULES, DistillConfig, DistillTask, distill, distill_loss,
                      eval_next_token_loss, load_distill_checkpoint, retry_config)
from .enable import ENABLE_INITS, LSQLinear, enable, exact_latent_weights, freeze, learner_modules, lsq_layers, scale_parameters, weight_parameters
from .experts import LSQExperts, NVFP4ExpertsScaleLearner
from .latent_weight import WEIGHT_UNITS
from .parameterisation import DUAL_FORMS, LSQ_PARAMS
from .quantizer import LSQ_INITS, LSQ_MODES, NVFP4ScaleLearner, lsq_fake_quantize
from .recover import (QuantizedStudent, RecoveryConfig, RecoveryResult, ScaleSetupError, is_main_rank,
                      perplexity_evaluator, quantize_student, recover, split_holdout)
from .recovery import (RECOVERY_ENABLE, RECOVERY_HOLDOUT, RECOVERY_LR_RETRIES, RECOVERY_LR_SCALES, RECOVERY_LR_WEIGHTS,
                       recovery_distill_config)
from .scale_steps import steps_per_scale_step
from .start_selection import START_CANDIDATES, StartCandidate, StartChoice, choose_start

__all__ = ["DISTILL_TRAIN", "DUAL_FORMS", "LR_RETRY_FACTOR", "LR_SCHEDULES", "LSQ_PARAMS", "WEIGHT_UNITS", "DistillConfig", "DistillTask", "distill", "distill_loss", "eval_next_token_loss",
           "load_distill_checkpoint", "ENABLE_INITS", "LSQExperts", "LSQLinear", "LSQ_INITS", "LSQ_MODES",
           "NVFP4ExpertsScaleLearner", "NVFP4ScaleLearner", "enable", "exact_latent_weights", "freeze", "learner_modules", "lsq_fake_quantize",
           "lsq_layers", "QuantizedStudent", "RecoveryConfig", "RecoveryResult", "ScaleSetupError", "is_main_rank",
           "perplexity_evaluator", "quantize_student", "recover", "split_holdout", "RECOVERY_ENABLE", "RECOVERY_HOLDOUT", "RECOVERY_LR_RETRIES", "RECOVERY_LR_SCALES", "RECOVERY_LR_WEIGHTS", "recovery_distill_config", "retry_config",
           "scale_parameters", "steps_per_scale_step", "weight_parameters", "START_CANDIDATES", "StartCandidate",
           "StartChoice", "choose_start"]
