"""SHA-256 digests of a fixed set of calls, recorded before the format-generic refactor (issue 14) and
checked after it: behaviour must stay the same bit for bit.

    python tests/support/refactor_digests.py --write     # record (only on purpose: the fixture is the "before")
    python tests/support/refactor_digests.py             # compare, print the names that differ

Groups:
  "quant": every format x rule x rounding on fixed inputs (codes, scales, outer scales, values), the
    wire codecs, Hadamard, swizzle and the requantize-transposed operand. Elementwise IEEE arithmetic
    in a fixed order: the same on every machine.
  "model": a training step of each built-in recipe, each PTQ method on stories260K, a scale-learning
    step, the files of an export. These run float32 matrix products, whose sums depend on the CPU's
    BLAS kernels, so they are compared only on a machine like the one that recorded them (the fixture
    stores its fingerprint).
  "exports" (added before the export-path redesign, issue 30; its own fingerprint "exports_fingerprint"):
    every PTQ scheme on stories260K, the MoE families (NVFP4 and the mixed recipe with an FP8 KV cache) and
    streaming, each exported in both checkpoint formats (weights by content, configs by bytes, refusals
    by error type). Weight-only results are compared everywhere; keys under "calibrated/" only on a
    machine like the recording one. ``--write-exports`` records this group alone.
"""
from __future__ import annotations

import copy
import dataclasses
import hashlib
import json
import platform
import sys
from pathlib import Path

import torch

FIXTURE = Path(__file__).parent / "fixtures" / "refactor_digests.json"


def _h(*tensors) -> str:
    """SHA-256 over each tensor's dtype, shape and raw bytes (None counts as a marker)."""
    h = hashlib.sha256()
    for t in tensors:
        if t is None:
            h.update(b"none")
            continue
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b"")
    return h.hexdigest()


def _inputs() -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1234)
    x = torch.randn(48, 128, generator=g) * torch.logspace(-2, 1, 128)  # per-channel magnitudes
    x[3, 7] = 40.0  # an outlier
    x[5, :16] = 0.0  # an all-zero block
    return {"f32": x, "bf16": x.to(torch.bfloat16), "e3d": torch.randn(4, 32, 64, generator=g)}


ROUNDINGS = [("nearest", "hardware"), ("stochastic", "hardware"), ("stochastic", "exact")]


def _nvfp4_specs():
    """(digest name, NVFP4 spec, input name) for every scale rule, error, outer scale, 2-D block and rounding."""
    import blockscale as bs

    for rule in ("6", "4over6", "4", "sweep"):
        errors = ("mse", "mae", "maxabs") if rule == "4over6" else ("mse",)
        for err in errors:
            for outer in ("tensor", "row", "group", 3.5):
                for b2d in (False, True):
                    if b2d and outer == "row":
                        continue
                    for rnd, sr in ROUNDINGS:
                        if rule == "sweep" and rnd != "nearest":
                            continue
                        spec = bs.NVFP4(scale_rule=rule, error=err, outer=outer, block_2d=b2d, rounding=rnd, sr_mode=sr)
                        for xn in ("f32", "bf16", "e3d") if rnd == "nearest" else ("f32",):
                            yield f"nvfp4/{rule}/{err}/{outer}/{b2d}/{rnd}-{sr}/{xn}", spec, xn


def _quant_digests() -> dict[str, str]:
    import blockscale as bs
    from blockscale.quant import decode_rows, encode_rows, WIRE_PAYLOADS
    from blockscale.quant.transforms.requantize_transposed import nvfp4_to_mx_transposed

    xs = _inputs()
    out: dict[str, str] = {}

    def record(name, spec, x):
        g = torch.Generator().manual_seed(7)
        try:
            q = bs.quantize(x, spec, g)
        except ValueError:  # a combination the format refuses (e.g. groups on a 2-D tensor): stays refused
            out[name] = "ValueError"
            return
        g = torch.Generator().manual_seed(7)
        fq = bs.fake_quantize(x, spec, g)
        out[name] = _h(q.codes, q.scales, q.outer_scale, q.amax, q.signs, q.dequantize(), fq)

    for name, spec, xn in _nvfp4_specs():
        record(name, spec, xs[xn])
    for el in ("e4m3", "e5m2", "e2m1"):
        for rule in ("ceil", "floor"):
            for rnd, sr in ROUNDINGS:
                for dim in (-1, 0):
                    spec = bs.MX(element=el, scale_rule=rule, rounding=rnd, sr_mode=sr, dim=dim)
                    for xn in ("f32", "bf16") if rnd == "nearest" else ("f32",):
                        record(f"mx/{el}/{rule}/{rnd}-{sr}/{dim}/{xn}", spec, xs[xn])
    for had in (True, False):
        for rule in ("ceil", "floor"):
            for rnd, sr in ROUNDINGS:
                spec = bs.S2F6(hadamard=had, seed=11, scale_rule=rule, rounding=rnd, sr_mode=sr)
                record(f"s2f6/{had}/{rule}/{rnd}-{sr}/f32", spec, xs["f32"])
    x = xs["f32"]
    g = torch.Generator().manual_seed(3)
    enc = bs.quantize(x, bs.NVFP4(), encode_scale=torch.tensor(0.75))
    out["nvfp4/encode_scale"] = _h(enc.codes, enc.scales, enc.outer_scale)
    for payload in WIRE_PAYLOADS:
        buf = encode_rows(x, payload, seed=5)
        out[f"wire/{payload}"] = _h(buf, decode_rows(buf, payload, x.shape[-1], seed=5))
    out["hadamard"] = _h(bs.hadamard(x.reshape(-1, 16)), bs.inverse_hadamard(x.reshape(-1, 16)))
    q = bs.quantize(x, bs.NVFP4(block_2d=True))
    out["swizzle"] = _h(bs.swizzle_scales(q.scales), q.scales_swizzled())
    for el in ("e4m3", "e5m2"):
        for rnd in ("nearest", "stochastic"):
            g = torch.Generator().manual_seed(9)
            t = nvfp4_to_mx_transposed(q, bs.MX(element=el, rounding=rnd), g)
            out[f"requantize_transposed/{el}/{rnd}"] = _h(t.codes, t.scales)
    return out


def _stories():
    from blockscale.models.hf import load_model

    return load_model("stories260k")


def _calib(n=8, t=64, seed=0):
    return torch.randint(1, 512, (n, t), generator=torch.Generator().manual_seed(seed))


def _state_digest(model) -> str:
    sd = model.state_dict()
    return _h(*[torch.tensor(list(k.encode()), dtype=torch.uint8) for k in sd] + list(sd.values()))


def _safetensors_digest(path: Path) -> str:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        names = sorted(f.keys())
        meta = json.dumps(f.metadata(), sort_keys=True).encode()
        return _h(torch.tensor(list(meta), dtype=torch.uint8),
                  *[t for n in names for t in (torch.tensor(list(n.encode()), dtype=torch.uint8), f.get_tensor(n))])


def _model_digests(tmp: Path) -> dict[str, str]:
    import blockscale as bs
    from blockscale import lsq
    from blockscale.lsq.distill import DistillConfig, distill
    from blockscale.ptq import AWQOptions, GPTQOptions, PTQConfig, quantize_model
    from blockscale.train import TokenData, TrainConfig, train

    out: dict[str, str] = {}
    tokens = torch.randint(0, 256, (4096,), generator=torch.Generator().manual_seed(2))
    data = TokenData.from_tokens(tokens, 256)
    for name in bs.list_recipes():
        torch.manual_seed(0)
        model = bs.Llama(bs.MODEL_PRESETS["tiny"])
        bs.convert(model, bs.get_recipe(name), generator=torch.Generator().manual_seed(1))
        res = train(model, data, TrainConfig(steps=2, batch_size=4, seq_len=32, warmup_steps=1, eval_batches=0,
                                             device="cpu", progress=False, plot=False, log_interval=1))
        out[f"train/{name}"] = _h(torch.tensor(res.train_losses, dtype=torch.float64),
                                  *[p for p in model.parameters()])
    base = _stories()
    calib = _calib()
    cfgs = {
        "rtn-6": PTQConfig(method="rtn"),
        "rtn-4over6-w4a4": PTQConfig(method="rtn", scale_rule="4over6", activations="w4a4", n_samples=8,
                                     seq_len=64, batch_size=4),
        "rtn-sweep": PTQConfig(method="rtn", scale_rule="sweep"),
        "awq-4over6": PTQConfig(method="awq", scale_rule="4over6", n_samples=8, seq_len=64, batch_size=4,
                                options=AWQOptions(grid=5, clip=False)),  # recorded before auto-clip was the default
        "smoothquant-w4a4": PTQConfig(method="smoothquant", activations="w4a4", n_samples=8, seq_len=64, batch_size=4),
        "gptq-4over6-aware": PTQConfig(method="gptq", scale_rule="4over6", n_samples=8, seq_len=64, batch_size=4,
                                       options=GPTQOptions(block_size=32)),
        "gptq-plain-actorder": PTQConfig(method="gptq", scale_rule="4over6",
                                         options=GPTQOptions(four_over_six="plain", act_order=True),
                                         n_samples=8, seq_len=64, batch_size=4),
    }
    ptq_models = {}
    for name, cfg in cfgs.items():
        m = copy.deepcopy(base.model)
        cfg = dataclasses.replace(cfg, skip_indivisible=True)  # stories260K's down_proj has 172 inputs
        quantize_model(m, cfg, calib if cfg.needs_calibration else None, progress=False)
        ptq_models[name] = m
        out[f"ptq/{name}"] = _state_digest(m)
    student = copy.deepcopy(ptq_models["rtn-6"])
    lsq.enable(student, mode="tied", weights=base.model)
    distill(student, base.model, _calib(16, 32, seed=4),
            DistillConfig(steps=2, lr_scales=1e-3, batch_size=4, seq_len=32), progress=False)
    out["lsq/tied-2-steps"] = _h(*lsq.scale_parameters(student))
    lsq.freeze(student)
    out["lsq/frozen"] = _state_digest(student)
    for fmt in ("compressed-tensors", "modelopt"):
        d = bs.export_checkpoint(ptq_models["rtn-4over6-w4a4"], tmp / fmt, fmt)
        for f in sorted(Path(d).iterdir()):
            if f.suffix == ".safetensors":  # its header's metadata map has no fixed order: compare contents
                out[f"export/{fmt}/{f.name}"] = _safetensors_digest(f)
            elif f.name in ("config.json", "hf_quant_config.json"):
                out[f"export/{fmt}/{f.name}"] = hashlib.sha256(f.read_bytes()).hexdigest()
    return out


EXPORT_FILES = ("config.json", "hf_quant_config.json", "model.safetensors.index.json")


def _export_digests_of(d: Path, prefix: str, out: dict) -> None:
    """The weights (contents) and the configs (bytes) of the export in ``d``; reports (timings) are left out."""
    for f in sorted(Path(d).iterdir()):
        if f.suffix == ".safetensors":
            out[f"{prefix}/{f.name}"] = _safetensors_digest(f)
        elif f.name in EXPORT_FILES:
            out[f"{prefix}/{f.name}"] = hashlib.sha256(f.read_bytes()).hexdigest()


def _export_both(model, tmp: Path, prefix: str, out: dict) -> None:
    """Export ``model`` in both checkpoint formats (a refusal is recorded as the error's type)."""
    import blockscale as bs

    for fmt in ("compressed-tensors", "modelopt"):
        try:
            d = bs.export_checkpoint(model, tmp / prefix.replace("/", "_") / fmt, fmt)
        except ValueError as exc:
            out[f"{prefix}/{fmt}"] = f"refused: {type(exc).__name__}"
            continue
        _export_digests_of(Path(d), f"{prefix}/{fmt}", out)


def _scheme_recipes():
    """One PTQ recipe per scheme and option set, and the built-in mixed recipe (FP8 KV cache)."""
    from blockscale.recipes import get_ptq_recipe
    from blockscale.recipes.ptq_recipe import SCHEME_NAMES, PTQRecipe, Scheme

    recipes = {name: PTQRecipe(name=name, default=Scheme(name)) for name in SCHEME_NAMES if name != "bf16"}
    recipes["fp8-w8a8-channel-dynamic"] = PTQRecipe(name="x", default=Scheme("fp8-w8a8", weights="channel",
                                                                             activations="dynamic"))
    recipes["mxfp4-floor"] = PTQRecipe(name="x", default=Scheme("mxfp4-w4a16", scale_rule="floor"))
    recipes["nvfp4-w4a4-4over6"] = PTQRecipe(name="x", default=Scheme("nvfp4-w4a4", scale_rule="4over6",
                                                                      act_scale_rule="4over6"))
    recipes["mixed"] = get_ptq_recipe("nvfp4-experts-fp8-attention")
    return recipes


CALIBRATED = "calibrated/"


def _calibrated(cfg) -> str:
    """The key prefix of results that depend on calibration forward passes (float32 matrix-product sums,
    which differ between CPUs): compared only on a machine like the recording one."""
    return CALIBRATED if cfg.needs_calibration else ""


def _exports_digests(tmp: Path) -> dict[str, str]:
    """Every scheme on stories260K and the MoE families, each exported in both formats, and a streaming
    export: the bytes the export-path redesign (issue 30) must keep. Weight-only results are the same on
    every machine; those under ``CALIBRATED`` are not."""
    from blockscale.ptq import PTQConfig, quantize_model
    from blockscale.ptq.streaming import quantize_streaming
    import tiny_moe

    out: dict[str, str] = {}
    base = _stories()
    calib = _calib()
    for name, recipe in _scheme_recipes().items():
        m = copy.deepcopy(base.model)
        cfg = PTQConfig(recipe=recipe, n_samples=8, seq_len=64, batch_size=4, skip_indivisible=True)
        quantize_model(m, cfg, calib if cfg.needs_calibration else None, progress=False)
        key = f"{_calibrated(cfg)}scheme/{name}"
        out[f"{key}/state"] = _state_digest(m)
        _export_both(m, tmp, key, out)
    moe_calib = torch.randint(1, 96, (8, 32), generator=torch.Generator().manual_seed(5))
    families = {f: (lambda f=f: tiny_moe.tiny_moe(f)) for f in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe")}
    families.update({"gpt_oss": tiny_moe.tiny_gpt_oss, "deepseek_v3": tiny_moe.tiny_deepseek})
    moe_recipes = {"nvfp4": None, "mixed": _scheme_recipes()["mixed"]}
    for fam, build in families.items():
        for rname, recipe in moe_recipes.items():
            m = build()
            cfg = PTQConfig(recipe=recipe, n_samples=8, seq_len=32, batch_size=4, calibrate_all_experts=True) \
                if recipe is not None else PTQConfig()
            key = f"{_calibrated(cfg)}moe/{fam}/{rname}"
            try:
                quantize_model(m, cfg, moe_calib if cfg.needs_calibration else None, progress=False)
            except ValueError as exc:  # e.g. DeepSeek's MLA has no k_proj / v_proj for an FP8 KV cache
                out[key] = f"refused: {type(exc).__name__}"
                continue
            out[f"{key}/state"] = _state_digest(m)
            _export_both(m, tmp, key, out)
    src = tmp / "stories-src"
    base.model.save_pretrained(src)
    for fmt in ("compressed-tensors", "modelopt"):
        quantize_streaming(src, tmp / f"streaming-{fmt}", PTQConfig(skip_indivisible=True), format=fmt,
                           progress=False)
        _export_digests_of(tmp / f"streaming-{fmt}", f"streaming/{fmt}", out)
    return out


def fingerprint() -> str:
    """What the float32 matrix-product sums depend on: the machine, the CPU's flags, torch."""
    flags = ""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("flags"):
                flags = hashlib.sha256(" ".join(sorted(line.split(":", 1)[1].split())).encode()).hexdigest()[:16]
                break
    except OSError:
        pass
    return f"{platform.machine()}|{flags}|torch {torch.__version__}"


def compute(tmp: Path, groups=("quant", "model", "exports")) -> dict:
    """The digests of ``groups``, computed on one thread (restored afterwards), warnings silenced."""
    import warnings

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            out = {"fingerprint": fingerprint()}
            if "quant" in groups:
                out["quant"] = _quant_digests()
            if "model" in groups:
                out["model"] = _model_digests(tmp)
            if "exports" in groups:
                out["exports"] = _exports_digests(tmp)
                out["exports_fingerprint"] = out["fingerprint"]
            return out
    finally:
        torch.set_num_threads(threads)


def main(argv) -> int:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        got = compute(Path(tmp))
    if "--write-exports" in argv:
        want = json.loads(FIXTURE.read_text())
        want.update(exports=got["exports"], exports_fingerprint=got["fingerprint"])
        FIXTURE.write_text(json.dumps(want, indent=1, sort_keys=True) + "\n")
        print(f"wrote {len(got['exports'])} export digests to {FIXTURE}")
        return 0
    if "--write" in argv:
        FIXTURE.parent.mkdir(exist_ok=True)
        FIXTURE.write_text(json.dumps(got, indent=1, sort_keys=True) + "\n")
        print(f"wrote {sum(len(v) for k, v in got.items() if k != 'fingerprint')} digests to {FIXTURE}")
        return 0
    want = json.loads(FIXTURE.read_text())
    bad = [f"{grp}/{k}" for grp in ("quant", "model", "exports") for k in want.get(grp, {})
           if got[grp].get(k) != want[grp][k]]
    print("\n".join(bad) or "all digests equal", f"\nfingerprint recorded {want['fingerprint']}, here {got['fingerprint']}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).parent))
    sys.exit(main(sys.argv[1:]))
