"""Does learned smoothing (OmniQuant's LET) lift W4A4 learning? (issue 32's 75% / issue 33's 80% W4A4 goals; a probe,
not a feature.)

The activations' own NVFP4 rounding is a third of SmolLM2's W4A4 gap (experiments/w4a4_floor.py), and AWQ's smoothing,
searched one layer at a time, is what lifted its best W4A4 start (AWQ + GPTQ hessian 62% against GPTQ hessian 45%).
This learns the smoothing end to end with lsq's defaults: per decoder layer four log-scale vectors u (from 0), each
moving a per-channel factor s = exp(u) from the activations into the weights, so that the full-precision function is
unchanged whatever u (a Linear kept in high precision, e.g. a down_proj whose 172 inputs are no multiple of 16, takes
its factors through its input and output):

- q/k/v inputs: the input RMSNorm's output divided by s (its weight / s), the columns of q/k/v times s;
- gate/up inputs: the post-attention RMSNorm the same way, the columns of gate/up times s;
- o_proj inputs: v_proj's rows divided by s, o_proj's columns times s (s per key/value head channel, repeated over the
  query heads of each group, as the attention's repeat_kv does);
- down_proj inputs: up_proj's rows divided by s, down_proj's columns times s.

Each learner's block amaxes follow its weight: a row times s moves its amaxes by s; columns times s move each block's
amax by the ratio of the block's largest |w * s| to its largest |w| (the latent weight as it is, detached). u = 0 gives
factors of exactly 1, so step 0 is the PTQ model bit for bit. The u vectors train in their own optimizer group at
``--lr-factor`` times the scales' lr (both are relative steps; a retry divides both).

Only the forward is changed (the student's perplexity is measured on it): exporting would fold s into the norm
weights and into the latent weights before ``to_quantized`` (not written; a probe). Llama-style decoder layers
(input_layernorm, self_attn.{q,k,v,o}_proj, post_attention_layernorm, mlp.{gate,up,down}_proj) only. ``--lr-factor 0``
is the run without smoothing (it reproduces recovery_results.py's row of the same start). Rows go to
``--out``/results.jsonl (resumable), never to the committed results.

    python experiments/smoothing_probe.py --model stories260k --start "GPTQ hessian" --lr-factor 1 3 --out DIR
"""
from __future__ import annotations

import importlib
import sys
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))
import recovery_results as rr  # noqa: E402
from blockscale.lsq.quantizer import NVFP4ScaleLearner, lsq_fake_quantize  # noqa: E402

distill_module = importlib.import_module("blockscale.lsq.distill")  # (the package exports a function of that name)
LET_NAMES = ("let_attn_in", "let_mlp_in", "let_o", "let_down")
_FACTOR = {"lr_factor": 0.0}


def _col_ratio(w: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """Per block [N, K/16]: max |w * c| / max |w| over the block (1 where the block is all zero)."""
    N, K = w.shape
    wd = w.detach().abs().reshape(N, K // 16, 16)
    before = wd.amax(-1)
    after = (wd * c.reshape(1, K // 16, 16)).amax(-1)
    safe = torch.where(before > 0, before, torch.ones_like(before))
    return torch.where(before > 0, after / safe, torch.ones_like(before))


def smoothed_forward(self: NVFP4ScaleLearner) -> torch.Tensor:
    """NVFP4ScaleLearner.forward with the layer's smoothing factors on its columns / rows (``self._let``)."""
    pre, post = self.amaxes()
    w = self.latent_weight()
    let = getattr(self, "_let", None)
    if let is not None:
        col, row = let()
        if col is not None:
            c = torch.exp(col)
            ratio = _col_ratio(w, c)
            w = w * c.unsqueeze(0)
            pre = pre * ratio
            post = None if post is None else post * ratio
        if row is not None:
            r = torch.exp(row).unsqueeze(1)
            w = w * r
            pre = pre * r
            post = None if post is None else post * r
    return lsq_fake_quantize(w, pre, self.encode_scale, post, self.grad_scale)


def _decoder_layers(student: nn.Module) -> list[nn.Module]:
    out = [m for m in student.modules()
           if all(hasattr(m, a) for a in ("self_attn", "mlp", "input_layernorm", "post_attention_layernorm"))]
    if not out:
        raise SystemExit("no Llama-style decoder layers (self_attn, mlp, input_layernorm, post_attention_layernorm)")
    return out


def add_smoothing(student: nn.Module) -> list[nn.Parameter]:
    """Register the four u vectors of every decoder layer (once), the norm hooks and each learner's ``_let``."""
    cfg = student.config
    heads, kv = cfg.num_attention_heads, cfg.num_key_value_heads
    hd = getattr(cfg, "head_dim", None) or cfg.hidden_size // heads
    params = []
    for layer in _decoder_layers(student):
        att, mlp = layer.self_attn, layer.mlp
        if not hasattr(layer, "let_o"):
            dev = layer.input_layernorm.weight.device
            sizes = (cfg.hidden_size, cfg.hidden_size, kv * hd, cfg.intermediate_size)
            for name, n in zip(LET_NAMES, sizes):
                layer.register_parameter(name, nn.Parameter(torch.zeros(n, device=dev)))

            def norm_hook(u_name):
                return lambda m, inp, out, layer=layer: out * torch.exp(-getattr(layer, u_name)).to(out.dtype)

            layer.input_layernorm.register_forward_hook(norm_hook("let_attn_in"))
            layer.post_attention_layernorm.register_forward_hook(norm_hook("let_mlp_in"))

            def o_cols(layer=layer):
                return layer.let_o.reshape(kv, hd).repeat_interleave(heads // kv, dim=0).reshape(-1)

            def setup(lin, col=None, row=None):
                if hasattr(lin, "learner"):
                    lin.learner._let = lambda: (None if col is None else col(), None if row is None else row())
                    return
                # a Linear kept in high precision: its columns / rows scaled through its input / output
                if col is not None:
                    lin.register_forward_pre_hook(lambda m, args: (args[0] * torch.exp(col()).to(args[0].dtype),
                                                                   *args[1:]))
                if row is not None:
                    lin.register_forward_hook(lambda m, args, out: out * torch.exp(row()).to(out.dtype))

            setup(att.q_proj, col=lambda layer=layer: layer.let_attn_in)
            setup(att.k_proj, col=lambda layer=layer: layer.let_attn_in)
            setup(att.v_proj, col=lambda layer=layer: layer.let_attn_in, row=lambda layer=layer: -layer.let_o)
            setup(att.o_proj, col=o_cols)
            setup(mlp.gate_proj, col=lambda layer=layer: layer.let_mlp_in)
            setup(mlp.up_proj, col=lambda layer=layer: layer.let_mlp_in, row=lambda layer=layer: -layer.let_down)
            setup(mlp.down_proj, col=lambda layer=layer: layer.let_down)
        params += [getattr(layer, n) for n in LET_NAMES]
    return params


def with_smoothing():
    """DistillTask.trainable, plus the smoothing vectors in a group "smoothing" at lr_factor x the scales' lr."""
    base = distill_module.DistillTask.trainable

    def trainable(self, student):
        base(self, student)
        if _FACTOR["lr_factor"] == 0:
            return [p for p in student.parameters() if p.requires_grad]
        params = add_smoothing(student)
        for p in params:
            p.requires_grad_(True)
        lr = _FACTOR["lr_factor"] * self.cfg.lr_scales
        self.groups.append({"params": params, "lr": lr, "name": "smoothing", "base_lr": lr})
        print(f"smoothing: {len(params)} vectors, {sum(p.numel() for p in params):,} values, lr {lr:g}", flush=True)
        return [p for p in student.parameters() if p.requires_grad]

    return trainable


def main(argv=None) -> int:
    ap = rr.probe_parser(__doc__)
    ap.add_argument("--lr-factor", type=float, nargs="+", default=[1.0],
                    help="the smoothing's lr over the scales' (0: no smoothing, the control); several run in turn "
                         "from one PTQ")
    ap.add_argument("--steps", type=int, default=50)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if not all(f >= 0 for f in args.lr_factor) or args.steps < 1:
        raise SystemExit(f"--lr-factor {args.lr_factor} / --steps {args.steps}: need factors >= 0 and steps >= 1")
    distill_module.DistillTask.trainable = with_smoothing()
    NVFP4ScaleLearner.forward = smoothed_forward
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    spec, lm, d = rr.model_and_texts(args.model)
    tokens = rr.calibration_batches(lm.tokenizer, d.calib, spec["train_samples"], spec["train_seq_len"], seed=1,
                                    bos=d.calib_bos)
    for i, f in enumerate(args.lr_factor):
        _FACTOR["lr_factor"] = f
        name = f"smoothing x{f:g}" if f > 0 else "no smoothing"
        rr.run_lsq(lm, spec, d, rr.Results(out), out, tokens, f"{name} [{args.start}] | {args.activations}",
                   args.start, rr.cli_defaults(args.steps, retry=True), (args.steps,), args.activations,
                   keep=i < len(args.lr_factor) - 1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
