"""GPU throughput of the Triton quantizer kernels against a device copy and torch.compile.

    python benchmarks/bench_triton.py [--shapes 8192x8192,16384x4096] [--iters 20] [--no-compile]
                                      [--no-train] [--out FILE]

Needs a CUDA device and triton: without them it prints why and exits with status 2.

For each kernel (NVFP4 1x16 rule 6, 4/6, 16x16 tiles, stochastic rounding; the fused NVFP4 ->
MXFP8-of-the-transpose backward kernel; MX / S2F6 through ``blockscale.quantize`` when a Triton
kernel for them exists in ``quant/triton_kernels``) and each bf16 input shape:

* kernel time (CUDA events, median of ``--iters`` after warm-up);
* GB/s = (bytes read + bytes written) / time, and the fraction of the bandwidth of a device-to-device
  ``Tensor.copy_`` moving the same number of bytes (read + write), timed in the same run;
* the time of ``torch.compile`` of the torch reference path (backend "compiled"), and its ratio;
* the 4/6-over-plain-NVFP4 time ratio.

Then one training step (forward + backward + AdamW) of the small Llama (``models/llama.py``
PRESETS["small"]) per built-in recipe against the bf16 recipe (``bench_train_step.time_recipe``,
backend "auto": the Triton kernels on CUDA). A markdown table goes to stdout (and ``--out FILE``).
"""
from __future__ import annotations

import argparse
import importlib.util
import os
import statistics
import sys

import torch

NO_DEVICE_EXIT = 2


def _need_gpu() -> str | None:
    """Why this benchmark cannot run here (None: it can)."""
    if not torch.cuda.is_available():
        return "no CUDA device: bench_triton.py times GPU kernels (run benchmarks/bench_quant.py on CPU)"
    from blockscale.quant.triton_kernels import TRITON_AVAILABLE

    if not TRITON_AVAILABLE:
        return "triton is not installed (pip install 'blockscale[triton]')"
    if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
        return "TRITON_INTERPRET is set: kernels would run in the interpreter, unset it to benchmark"
    return None


def cuda_time(fn, iters: int, warmup: int = 3) -> float:
    """Median seconds per call of ``fn`` over ``iters`` calls, CUDA events around each call."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        ts.append(a.elapsed_time(b) * 1e-3)
    return statistics.median(ts)


def copy_time(nbytes: int, iters: int) -> float:
    """A device-to-device copy reading nbytes/2 and writing nbytes/2 (the same traffic)."""
    n = max(nbytes // 2, 1)
    src = torch.empty(n, dtype=torch.uint8, device="cuda")
    dst = torch.empty_like(src)
    return cuda_time(lambda: dst.copy_(src), iters)


def _compiled_time(fn, iters: int) -> float | None:
    import blockscale as bs

    try:
        with bs.use_backend("compiled"):
            return cuda_time(fn, iters, warmup=2)
    except Exception as exc:  # noqa: BLE001 - report and go on
        print(f"  torch.compile reference failed: {type(exc).__name__}: {exc}"[:300], file=sys.stderr)
        return None


def nvfp4_cases(x: torch.Tensor):
    """(name, spec, kernel fn, bytes moved) for the NVFP4 Triton kernels on x [M, K]."""
    import blockscale as bs
    from blockscale.quant import nvfp4 as nv
    from blockscale.quant.triton_kernels import nvfp4_triton as nt

    M, K = x.shape
    out_bytes = M * K // 2 + M * K // 16  # packed codes + E4M3 scales
    moved = x.numel() * x.element_size() + out_bytes
    specs = [
        ("NVFP4 1x16 rule 6", bs.NVFP4()),
        ("NVFP4 1x16 4/6 (MSE)", bs.NVFP4(scale_rule="4over6")),
        ("NVFP4 16x16 rule 6", bs.NVFP4(block_2d=True)),
        ("NVFP4 16x16 4/6 (MSE)", bs.NVFP4(scale_rule="4over6", block_2d=True)),
        ("NVFP4 1x16 rule 6, SR", bs.NVFP4(rounding="stochastic")),
        ("NVFP4 1x16 rule 6, swizzled scales", bs.NVFP4()),
    ]
    cases = []
    for name, spec in specs:
        S = nv.outer_scale(x.abs().amax().float(), spec.outer_bound)
        if spec.block_2d:
            fn = (lambda spec=spec, S=S: nt.quantize_nvfp4_tiles(x, S, spec.scale_rule, spec.error, spec.rounding,
                                                                  spec.sr_mode, 1))
        else:
            layout = "swizzled" if "swizzled" in name else "plain"
            fn = (lambda spec=spec, S=S, layout=layout: nt.quantize_nvfp4_2d(
                x, S, spec.scale_rule, spec.error, spec.rounding, spec.sr_mode, 1, scale_layout=layout))
        # the reference with the same given outer scale (no amax pass, like the kernel call)
        if "swizzled" in name:
            ref = (lambda spec=spec, S=S: bs.quantize(x, spec, check_finite=False, encode_scale=S).scales_swizzled())
        else:
            ref = (lambda spec=spec, S=S: bs.quantize(x, spec, check_finite=False, encode_scale=S))
        cases.append((name, spec, fn, moved, ref))
    return cases


def fused_case(x: torch.Tensor):
    """The fused backward kernel: NVFP4 q of x [M, K] -> MXFP8 E4M3 (SR) of dequantize(q).T."""
    import blockscale as bs
    from blockscale.quant.transforms import requantize_transposed as fused

    M, K = x.shape
    with bs.use_backend("auto"):
        q = bs.quantize(x, bs.NVFP4(scale_rule="4over6", outer="row"), check_finite=False)
    from blockscale.quant.triton_kernels.requantize_transposed_triton import nvfp4_to_mx_t

    mx = bs.MX(element="e4m3", rounding="stochastic")
    Mp = -(-M // 32) * 32
    moved = q.codes.numel() + q.scales.numel() + M * 4 + K * Mp + K * (Mp // 32)
    gen = torch.Generator(device="cuda").manual_seed(0)
    inv_s = (1.0 / q.outer_scale).reshape(M)

    def kernel():  # the kernel alone (the dispatcher adds a seed draw from ``gen``: one sync)
        nvfp4_to_mx_t(q.codes, q.scales, inv_s, K, "e4m3", "ceil", "stochastic", "hardware", 1)

    def reference():  # torch.compile'd dequantize, transposed copy, torch.compile'd MX quantize
        fused.nvfp4_to_mx_transposed_reference(q, mx, gen)

    return ("fused NVFP4 -> MXFP8-T (SR)", mx, kernel, moved, reference)


def other_triton_cases(x: torch.Tensor):
    """MX / S2F6 through blockscale.quantize when their Triton kernels exist (imported defensively)."""
    import blockscale as bs

    cases = []
    have = lambda mod: importlib.util.find_spec(f"blockscale.quant.triton_kernels.{mod}") is not None  # noqa: E731
    M, K = x.shape
    read = x.numel() * x.element_size()
    if have("mx_triton"):
        for name, spec in (("MXFP8 E4M3 (RNE)", bs.MX(element="e4m3")),
                           ("MXFP8 E4M3 (SR)", bs.MX(element="e4m3", rounding="stochastic")),
                           ("MXFP4 E2M1", bs.MX(element="e2m1"))):
            out = M * K // (2 if spec.element == "e2m1" else 1) + M * K // 32
            cases.append((name, spec, read + out))
    if have("s2f6_triton"):
        cases.append(("S2F6 + Hadamard", bs.S2F6(hadamard=True), read + M * K + M * K // 32))
    out = []
    for name, spec, moved in cases:
        def kernel(spec=spec):
            with bs.use_backend("triton"):
                bs.quantize(x, spec, check_finite=False)

        out.append((name + " [quantize()]", spec, kernel, moved,
                    (lambda spec=spec: bs.quantize(x, spec, check_finite=False))))
    return out


def bench_kernels(shapes, iters: int, compile_ref: bool):
    rows = []
    for M, K in shapes:
        x = torch.randn(M, K, device="cuda", generator=torch.Generator(device="cuda").manual_seed(0)).to(torch.bfloat16)
        cases = nvfp4_cases(x) + [fused_case(x)]
        try:
            cases += other_triton_cases(x)
        except Exception as exc:  # noqa: BLE001 - another kernel module may be half-written
            print(f"  skipping MX / S2F6 Triton cases: {type(exc).__name__}: {exc}"[:300], file=sys.stderr)
        copies = {}
        for name, _spec, fn, moved, ref in cases:
            try:
                t = cuda_time(fn, iters)
            except Exception as exc:  # noqa: BLE001
                print(f"  {name}: failed: {type(exc).__name__}: {exc}"[:300], file=sys.stderr)
                continue
            if moved not in copies:
                copies[moved] = copy_time(moved, iters)
            tc = _compiled_time(ref, max(iters // 4, 3)) if compile_ref else None
            rows.append(dict(shape=f"{M}x{K}", case=name, ms=t * 1e3, gbs=moved / t / 1e9,
                             copy_frac=copies[moved] / t, compiled_ms=None if tc is None else tc * 1e3,
                             speedup=None if tc is None else tc / t))
            print(f"  {M}x{K} {name:40s} {t * 1e6:9.1f} us  {moved / t / 1e9:7.1f} GB/s", file=sys.stderr, flush=True)
        del x
        torch.cuda.empty_cache()
    return rows


def ratio_46(rows, shape: str, one_d: bool = True) -> float | None:
    pre = "NVFP4 1x16" if one_d else "NVFP4 16x16"
    t = {r["case"]: r["ms"] for r in rows if r["shape"] == shape}
    a, b = t.get(f"{pre} 4/6 (MSE)"), t.get(f"{pre} rule 6")
    return a / b if a and b else None


def bench_train(preset: str, batch: int, seq: int, steps: int):
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
    import bench_train_step as bts

    import blockscale as bs

    bs.set_backend("auto")
    out = []
    for r in bts.RECIPES:
        try:
            t = bts.time_recipe(r, preset, batch, seq, steps, 2, "cuda")
        except Exception as exc:  # noqa: BLE001
            print(f"  train step {r}: failed: {type(exc).__name__}: {exc}"[:300], file=sys.stderr)
            continue
        out.append((r, t))
        print(f"  train step {r:22s} {t * 1e3:8.1f} ms", file=sys.stderr, flush=True)
    return out


def render(rows, train, shapes, args) -> str:
    dev = torch.cuda.get_device_name(0)
    lines = [f"# Triton kernels on {dev}, torch {torch.__version__}, bf16 inputs, median of {args.iters}", "",
             "| shape | kernel | us | GB/s (read+write) | x copy bandwidth | torch.compile us | speedup vs compile |",
             "|---|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        comp = "-" if r["compiled_ms"] is None else f"{r['compiled_ms'] * 1e3:.1f}"
        sp = "-" if r["speedup"] is None else f"{r['speedup']:.2f}"
        lines.append(f"| {r['shape']} | {r['case']} | {r['ms'] * 1e3:.1f} | {r['gbs']:.0f} | {r['copy_frac']:.2f} | "
                     f"{comp} | {sp} |")
    lines.append("")
    for M, K in shapes:
        for one_d in (True, False):
            q = ratio_46(rows, f"{M}x{K}", one_d)
            if q:
                lines.append(f"- {M}x{K}: 4/6 / plain NVFP4 time ratio ({'1x16' if one_d else '16x16'}): {q:.2f}")
    if train:
        base = dict(train).get("bf16")
        lines += ["", f"## Training step, Llama preset {args.preset}, batch {args.batch} x seq {args.seq}, backend auto",
                  "", "| recipe | ms / step | x bf16 |", "|---|---:|---:|"]
        for r, t in train:
            lines.append(f"| {r} | {t * 1e3:.1f} | {t / base:.2f} |" if base else f"| {r} | {t * 1e3:.1f} | - |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shapes", default="8192x8192,16384x4096", help="comma-separated MxK bf16 inputs")
    ap.add_argument("--iters", type=int, default=20)
    ap.add_argument("--no-compile", action="store_true", help="skip the torch.compile reference timings")
    ap.add_argument("--no-train", action="store_true", help="skip the small-Llama training steps")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", help="also write the markdown table to this file")
    args = ap.parse_args(argv)
    why = _need_gpu()
    if why:
        print(f"bench_triton.py: skipped: {why}")
        return NO_DEVICE_EXIT
    shapes = [tuple(int(v) for v in s.lower().split("x")) for s in args.shapes.split(",")]
    rows = bench_kernels(shapes, args.iters, not args.no_compile)
    train = [] if args.no_train else bench_train(args.preset, args.batch, args.seq, args.steps)
    text = render(rows, train, shapes, args)
    sys.stdout.write(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
