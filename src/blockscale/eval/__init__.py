"""Evaluation: the one next-token loss evaluation, perplexity over a token stream (windows of it), blockscale's own
zero-shot suite (``zero_shot``: last word and next sentence on held-out text; not a standard benchmark) and
lm-evaluation-harness on a model in memory or a checkpoint through vLLM (``harness``; ``blockscale[eval]``)."""
from .harness import TaskResults, evaluate_tasks, evaluate_tasks_vllm, task_recovery, vllm_model_args
from .next_token import WEIGHTINGS, model_device, next_token_loss, output_logits
from .perplexity import PerplexityResult, perplexity
from .zero_shot_suite import (DEFAULT_ITEMS, ZERO_SHOT_TASKS, TaskAccuracy, ZeroShotResult, zero_shot, zero_shot_items,
                              zero_shot_recovery)

__all__ = ["DEFAULT_ITEMS", "PerplexityResult", "TaskAccuracy", "TaskResults", "WEIGHTINGS", "ZERO_SHOT_TASKS",
           "ZeroShotResult", "evaluate_tasks", "evaluate_tasks_vllm", "model_device", "next_token_loss",
           "output_logits", "perplexity", "task_recovery", "vllm_model_args", "zero_shot", "zero_shot_items",
           "zero_shot_recovery"]
