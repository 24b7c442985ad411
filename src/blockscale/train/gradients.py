"""Gradient norms: the global L2 norm of a model's gradients and clipping to a bound."""
from __future__ import annotations

import torch


def grad_norm(parameters) -> torch.Tensor:
    """Global L2 norm of all gradients (fp32)."""
    norms = [torch.linalg.vector_norm(p.grad.detach().float()) for p in parameters if p.grad is not None]
    return torch.linalg.vector_norm(torch.stack(norms)) if norms else torch.zeros(())


def clip_gradients(parameters, max_norm: float) -> torch.Tensor:
    """Scale gradients so their global norm is at most ``max_norm`` (0: no clipping); returns the
    norm before clipping."""
    parameters = list(parameters)
    if max_norm > 0:
        return torch.nn.utils.clip_grad_norm_(parameters, max_norm)
    return grad_norm(parameters)


__all__ = ["clip_gradients", "grad_norm"]
