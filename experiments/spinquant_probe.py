"""Do SpinQuant's learned rotations lift NVFP4 W4A4? (issue 33, item 4: R1 / R2 learned on the Stiefel manifold
"if it pays"; a probe, not a feature.)

SpinQuant (Liu et al. 2024) learns the residual-stream rotation R1 and the per-layer head rotation R2 with the
activations quantized in the loop, then quantizes the weights with GPTQ. Fixed random-Hadamard R1 / R2 cost NVFP4
perplexity on SmolLM2 (docs/results/rotations.md: r1r2r4 is below no rotation for every method), so here the learned
rotation starts either from no rotation (``--init identity``: step 0 is the unrotated model) or from the random
Hadamard that ``--rotate r1r2`` fuses (``--init hadamard``, SpinQuant's own start), and learns a rotation on top:

- the base model is ``rotate_model`` with R1 / R2 of that kind (norm weights folded into the following Linears, the
  embeddings and lm_head rotated, lm_head untied);
- R1 = cayley(A1) on the residual stream, R2_l = cayley(A2_l) per decoder layer between v_proj and o_proj, with
  cayley(A) = (I + A/2)^-1 (I - A/2), A = X - X^T from an unconstrained X (zero at the start, so R = I): every
  iterate is orthogonal to fp32 rounding (the Cayley parametrisation of SO(n); SpinQuant's Cayley SGD is a Riemannian
  SGD that retracts with the same transform, here Adam moves the generator X), and the full-precision function does
  not change whatever X (checked at the end: ``fp_logit_max_diff``);
- readers of the residual stream (q/k/v, gate/up, lm_head) take W R1, writers (o_proj, down_proj) R1^T W, the
  embeddings E R1; v_proj's rows of each key/value head R2^T W, o_proj's columns of each head W R2;
- in the loop, every decoder Linear's input is NVFP4-rounded (straight-through; per-tensor amax of the batch, scale
  rule 6) and, with ``--in-loop w4a4``, its rotated weight too (RTN, rule 6); SpinQuant, when GPTQ quantizes the
  weights afterwards, learns with the activations quantized only (``a4``, the default);
- the loss is lsq's (T^2 KL to the full-precision model on the training windows of recovery_results.py), Adam on
  the X's, cosine lr; the held-out distillation loss of 16 disjoint windows picks the best step (step 0 included).

The learned rotations are then fused into the base model's weights (float64) and the ``--start`` PTQ runs on it with
``--activations`` as recovery_results.py runs it; ``--steps 0`` is the base model's PTQ (the control). Llama-style
decoder layers only. Rows go to ``--out``/results.jsonl (resumable), never to the committed results.

    python experiments/spinquant_probe.py --model stories260k --start "GPTQ hessian" --lr 1e-3 --out DIR
"""
from __future__ import annotations

import copy
import math
import sys
import time
from pathlib import Path

import torch
from torch.func import functional_call

sys.path.insert(0, str(Path(__file__).resolve().parent))
import recovery_results as rr  # noqa: E402
from blockscale import lsq  # noqa: E402
from blockscale.ptq.rotations import RotationPlan, rotate_model  # noqa: E402
from blockscale.quant import NVFP4  # noqa: E402
from blockscale.quant.dispatch import fake_quantize  # noqa: E402

READERS = ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")
WRITERS = ("self_attn.o_proj", "mlp.down_proj")
SPEC = NVFP4(scale_rule="6")


def cayley(x: torch.Tensor) -> torch.Tensor:
    a = x - x.T
    eye = torch.eye(x.shape[0], dtype=x.dtype, device=x.device)
    return torch.linalg.solve(eye + a / 2, eye - a / 2)


def ste(t: torch.Tensor) -> torch.Tensor:
    """NVFP4 fake quantization of ``t`` (rule 6, its own per-tensor amax) with the straight-through gradient."""
    return t + (fake_quantize(t.detach(), SPEC, check_finite=False) - t).detach()


class Rotated:
    """The base model's weights as functions of the learned rotations (Llama-style decoder layers)."""

    def __init__(self, model):
        self.model = model
        cfg = model.config
        self.layers = [f"model.layers.{i}" for i in range(cfg.num_hidden_layers)]
        self.head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
        named = dict(model.named_parameters())
        self.w0 = {n: p.detach().clone() for n, p in named.items() if self._touched(n)}
        for n in self.w0:
            if not n.endswith(".weight"):
                raise SystemExit(f"{n}: biases on rotated Linears are not handled by this probe")
        hidden = cfg.hidden_size
        self.x1 = torch.zeros(hidden, hidden, requires_grad=True)
        self.x2 = [torch.zeros(self.head_dim, self.head_dim, requires_grad=True) for _ in self.layers]

    def _touched(self, n: str) -> bool:
        if n in ("model.embed_tokens.weight", "lm_head.weight"):
            return True
        return any(n.startswith(f"{p}.") and n[len(p) + 1:].rpartition(".")[0] in READERS + WRITERS
                   for p in getattr(self, "layers", []))

    def params(self) -> list[torch.Tensor]:
        return [self.x1, *self.x2]

    def weights(self, quantize: bool = False, dtype=torch.float32) -> dict[str, torch.Tensor]:
        r1 = cayley(self.x1.to(dtype))
        out = {"model.embed_tokens.weight": self.w0["model.embed_tokens.weight"].to(dtype) @ r1,
               "lm_head.weight": self.w0["lm_head.weight"].to(dtype) @ r1}
        hd = self.head_dim
        for p, x2 in zip(self.layers, self.x2):
            r2 = cayley(x2.to(dtype))
            for rel in READERS:
                w = self.w0[f"{p}.{rel}.weight"].to(dtype) @ r1
                if rel == "self_attn.v_proj":  # rows of each key/value head: R2^T W
                    w = torch.einsum("ji,kjh->kih", r2, w.reshape(-1, hd, w.shape[1])).reshape(w.shape)
                out[f"{p}.{rel}.weight"] = w
            for rel in WRITERS:
                w = r1.T @ self.w0[f"{p}.{rel}.weight"].to(dtype)
                if rel == "self_attn.o_proj":  # columns of each head: W R2
                    w = (w.reshape(w.shape[0], -1, hd) @ r2).reshape(w.shape)
                out[f"{p}.{rel}.weight"] = w
        if quantize:
            out = {n: (ste(w) if n.startswith("model.layers.") else w) for n, w in out.items()}
        return out

    def fuse(self) -> None:
        """Write the rotated weights (computed in float64) into the model."""
        with torch.no_grad():
            for n, w in self.weights(dtype=torch.float64).items():
                self.model.get_parameter(n).data.copy_(w.to(self.w0[n].dtype))


def _act_hooks(model, layers):
    def pre(mod, args):
        return (ste(args[0]),) + tuple(args[1:])

    return [model.get_submodule(f"{p}.{rel}").register_forward_pre_hook(pre)
            for p in layers for rel in READERS + WRITERS]


def _kl(student_logits, teacher_logits, x) -> torch.Tensor:
    return lsq.distill_loss(student_logits, teacher_logits, x)[1]  # lsq's KL (T = 1), the mean over tokens


def learn(rot: Rotated, teacher, tokens, held, args, lr: float) -> dict:
    """Adam on the rotations' generators; returns the log and leaves the best held-out step's generators in ``rot``."""
    model, quant_w = rot.model, args.in_loop == "w4a4"
    with torch.no_grad():
        t_held = [teacher(held[i:i + 4]).logits for i in range(0, len(held), 4)]
    hooks = _act_hooks(model, rot.layers)

    def held_loss() -> float:
        with torch.no_grad():
            w = rot.weights(quantize=quant_w)
            tot = sum(float(_kl(functional_call(model, w, (held[i:i + 4],)).logits, t_held[i // 4], held[i:i + 4]))
                      * len(held[i:i + 4]) for i in range(0, len(held), 4))
        return tot / len(held)

    opt = torch.optim.Adam(rot.params(), lr=lr)
    warm = max(1, args.steps // 10)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: (s + 1) / warm if s < warm else
                                              0.5 * (1 + math.cos(math.pi * (s - warm) / max(1, args.steps - warm))))
    g = torch.Generator().manual_seed(0)
    best = (held_loss(), 0, [p.detach().clone() for p in rot.params()])
    log = {"held": [(0, best[0])], "train": []}  # train: the mean training loss of each stretch of --every steps
    stretch = []
    print(f"step 0: held-out {best[0]:.4f}", flush=True)
    t0 = time.time()
    try:
        for step in range(1, args.steps + 1):
            batch = tokens[torch.randint(len(tokens), (args.batch_size,), generator=g)]
            with torch.no_grad():
                t_logits = teacher(batch).logits
            loss = _kl(functional_call(model, rot.weights(quantize=quant_w), (batch,)).logits, t_logits, batch)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            stretch.append(float(loss.detach()))
            if step % args.every == 0 or step == args.steps:
                h = held_loss()
                log["held"].append((step, h))
                log["train"].append((step, sum(stretch) / len(stretch)))
                stretch = []
                print(f"step {step}: train {log['train'][-1][1]:.4f} held-out {h:.4f} ({(time.time() - t0) / step:.2f} s/step)",
                      flush=True)
                if h < best[0]:
                    best = (h, step, [p.detach().clone() for p in rot.params()])
    finally:
        for h in hooks:
            h.remove()
    with torch.no_grad():
        for p, b in zip(rot.params(), best[2]):
            p.copy_(b)
    log.update(best_step=best[1], best_held=best[0], seconds_per_step=(time.time() - t0) / max(1, args.steps))
    return log


def main(argv=None) -> int:
    ap = rr.probe_parser(__doc__)
    ap.add_argument("--init", default="identity", choices=("identity", "hadamard"))
    ap.add_argument("--in-loop", default="a4", choices=("a4", "w4a4"))
    ap.add_argument("--lr", type=float, nargs="+", default=[1e-3])
    ap.add_argument("--steps", type=int, default=100)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--out", required=True)
    args = ap.parse_args(argv)
    if args.steps < 0 or args.every < 1 or args.batch_size < 1 or not all(x > 0 for x in args.lr):
        raise SystemExit("--steps >= 0, --every >= 1, --batch-size >= 1 and every --lr > 0, please")
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    res = rr.Results(out)
    spec, lm, d = rr.model_and_texts(args.model)
    lm.model.eval()
    n = spec["train_samples"]
    windows = rr.calibration_batches(lm.tokenizer, d.calib, n + 16, spec["train_seq_len"], seed=1, bos=d.calib_bos,
                                     holdout=16)
    tokens, held = windows[:n], windows[n:]
    for lr in (args.lr if args.steps else [0.0]):
        name = (f"{args.start}, {args.activations}, init {args.init}, in-loop {args.in_loop}, {args.steps} steps"
                + (f", lr {lr:g}" if args.steps else "") + (f", batch {args.batch_size}" if args.batch_size != 4 else ""))
        if res.get(name) is not None:
            continue
        base = copy.deepcopy(lm.model)
        rotate_model(base, RotationPlan(r1=True, r2=True, fused_kind="identity" if args.init == "identity"
                                        else "random-hadamard"))
        rot = Rotated(base)
        for p in base.parameters():
            p.requires_grad_(False)
        log = {}
        if args.steps:
            log = learn(rot, lm.model, tokens, held, args, lr)
        rot.fuse()
        with torch.no_grad():
            fp_diff = float((base(held[:2]).logits - lm.model(held[:2]).logits).abs().max())
        fields = dict(rr.STARTS[args.start])
        cfg = rr.PTQConfig(activations=args.activations, n_samples=fields.pop("n_samples", spec["calib_samples"]),
                           seq_len=spec["calib_seq_len"], skip_indivisible=spec["skip_indivisible"], **fields)
        t = time.time()
        rr.calibrate_and_quantize(base, lm.tokenizer, cfg, d.calib, d.calib_bos, progress=False)
        sec = time.time() - t
        ppl = rr._ppl(base, lm, spec, d)
        res.add({"key": name, "start": args.start, "activations": args.activations, "init": args.init,
                 "in_loop": args.in_loop, "steps": args.steps, "lr": lr, "ppl": ppl, "ptq_seconds": sec,
                 "fp_logit_max_diff": fp_diff, **log})
        print(f"{name}: ppl {ppl:.4f} (best step {log.get('best_step', 0)}, fp logits within {fp_diff:.2e})",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
