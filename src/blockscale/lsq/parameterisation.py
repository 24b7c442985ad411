"""How a learner holds its trainable block amaxes: the units the optimizer steps in.

The learned quantity is always the FP32 block amax (block scale = e4m3(amax * S / 6)); the
parameterisation only changes what Adam moves:

    param="amax"  (the write-up's): the amax itself, ``amax`` [..., N, K/16]. Adam moves it by about
                  ``lr`` per step whatever the gradient's size, so one lr means a relative step of
                  lr / amax: 100x slower on a model whose block amaxes are 100x larger.
    param="log"   ``amax = amax_init * exp(log_amax)`` with ``log_amax`` starting at 0 (``amax_init``: a
                  buffer, the initial amax). Adam moves log_amax by about ``lr``: a relative step of lr
                  on every block of every model; exp(0) == 1, so step 0 is the initial amax bit for bit.

Dual mode (codes from ``pre``, value scale from ``post``) has two forms:

    dual_form="pair"  (the write-up's): ``pre`` and ``post`` are independent parameters (``amax_pre`` /
                      ``amax_post``, or ``log_amax_pre`` / ``log_amax_post``).
    dual_form="ratio": ``post = pre * ratio``: the pre amax is learned as in tied mode (``amax`` /
                      ``log_amax``) and the ratio on its own (``ratio`` starting at 1 / ``log_ratio`` at 0),
                      so a step along the pre amax moves the grid and the value together (the tied
                      gradient) and only the ratio's step changes the value alone.
"""
from __future__ import annotations

import torch
from torch import nn

LSQ_PARAMS = ("amax", "log")
DUAL_FORMS = ("pair", "ratio")
# every parameter name a learner may hold its block scales in (``lsq.scale_parameters`` selects them)
SCALE_PARAMETER_NAMES = ("amax", "amax_pre", "amax_post", "log_amax", "log_amax_pre", "log_amax_post", "ratio",
                         "log_ratio", "log_input_amax")
# the parameters that move the codes' grid (dual "pair": the pre amax; tied / "ratio": the amax)
PRE_PARAMETER_NAMES = ("amax_pre", "log_amax_pre")


def check_parameterisation(mode: str, param: str, dual_form: str) -> None:
    if param not in LSQ_PARAMS:
        raise ValueError(f"param={param!r}; allowed values: {', '.join(LSQ_PARAMS)}")
    if dual_form not in DUAL_FORMS:
        raise ValueError(f"dual_form={dual_form!r}; allowed values: {', '.join(DUAL_FORMS)}")


class BlockAmaxes:
    """A mixin for the learners (``nn.Module`` subclasses): ``init_amaxes`` registers the trainable block
    amaxes (see the module docstring) as parameters of the learner itself (so the default "amax" / "pair"
    names are those of earlier releases: ``amax``, ``amax_pre``, ``amax_post``); ``amaxes()`` gives the
    effective FP32 (pre, post) amax tensors (post None when tied), differentiable w.r.t. the parameters."""

    def init_amaxes(self, amax: torch.Tensor, mode: str, param: str = "amax", dual_form: str = "pair") -> None:
        check_parameterisation(mode, param, dual_form)
        self.mode, self.param, self.dual_form = mode, param, dual_form
        amax = amax.detach().to(torch.float32)
        if param == "log":
            self.register_buffer("amax_init", amax.clone())
        for name in self.parameter_names():
            if name in ("amax", "amax_pre", "amax_post"):
                value = amax.clone()
            elif name == "ratio":
                value = torch.ones_like(amax)
            else:  # log_*: 0
                value = torch.zeros_like(amax)
            setattr(self, name, nn.Parameter(value))

    def parameter_names(self) -> tuple[str, ...]:
        log = self.param == "log"
        if self.mode == "tied":
            return ("log_amax",) if log else ("amax",)
        if self.dual_form == "pair":
            return ("log_amax_pre", "log_amax_post") if log else ("amax_pre", "amax_post")
        return ("log_amax", "log_ratio") if log else ("amax", "ratio")

    def amaxes(self) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(pre, post): the effective FP32 amaxes (post None when tied)."""
        names = self.parameter_names()
        log = self.param == "log"
        first = getattr(self, names[0])
        if log:
            first = self.amax_init * torch.exp(first)
        if self.mode == "tied":
            return first, None
        second = getattr(self, names[1])
        if self.dual_form == "pair":
            return first, (self.amax_init * torch.exp(second) if log else second)
        return first, first * (torch.exp(second) if log else second)

    @torch.no_grad()
    def set_amax(self, amax: torch.Tensor) -> None:
        """Start again from ``amax`` (pre == post == amax): the raw amaxes copied, or amax_init = amax and the
        logs (and the ratio) back at 0 (1)."""
        amax = amax.to(torch.float32)
        if self.param == "log":
            self.amax_init.copy_(amax)
        for name in self.parameter_names():
            p = getattr(self, name)
            if name in ("amax", "amax_pre", "amax_post"):
                p.copy_(amax)
            elif name == "ratio":
                p.fill_(1.0)
            else:
                p.zero_()

    def amax_repr(self) -> str:
        return f"mode={self.mode!r}, param={self.param!r}" + (f", dual_form={self.dual_form!r}"
                                                               if self.mode == "dual" else "")


__all__ = ["BlockAmaxes", "DUAL_FORMS", "LSQ_PARAMS", "PRE_PARAMETER_NAMES", "SCALE_PARAMETER_NAMES",
           "check_parameterisation"]
