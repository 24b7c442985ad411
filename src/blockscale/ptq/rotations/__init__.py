"""Rotations for PTQ (issue 33): ``RotationPlan`` / ``parse_rotate`` (``--rotate``) and ``rotate_model`` (fused R1 / R2,
online R4 and input rotations of every Linear: QuIP, block:N, MR-GPTQ's group-sized blocks)."""
from .model import RotationReport, rotate_model
from .plan import ROTATE_CHOICES, RotationPlan, parse_rotate

__all__ = ["ROTATE_CHOICES", "RotationPlan", "RotationReport", "parse_rotate", "rotate_model"]
