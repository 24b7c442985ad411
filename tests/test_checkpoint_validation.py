"""Loading untrusted NVFP4 checkpoints: values are validated before anything is built (E4M3 block
scales finite and non-negative, outer / input scales positive normal finite, plain tensors finite, eps
finite and > 0), every malformed field is one ``CheckpointError`` naming the file and key, config
sizes are checked against the safetensors headers before any allocation, our exports carry SHA-256
digests of every tensor and of config.json (verified unless ``verify=False``), and every file read
resolves inside the checkpoint directory. (The fuzz test is test_checkpoint_fuzz.py.)"""
import hashlib
import json
import math
import os
import re
import resource
import shutil
import time
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from blockscale.export import CheckpointError, export_checkpoint, load_checkpoint

from test_export import CT, MO, _logits, make_model  # noqa: E402

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread", "reference_backend")

Q = "model.layers.0.self_attn.o_proj."  # a Linear outside any fused group (its own outer scale)
SUFFIX = {CT: {"packed": "weight_packed", "outer": "weight_global_scale", "input": "input_global_scale"},
          MO: {"packed": "weight", "outer": "weight_scale_2", "input": "input_scale"}}


# ---- helpers --------------------------------------------------------------------------------------
def _sha(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()).hexdigest()


def _canonical_sha(cfg: dict) -> str:
    text = json.dumps(cfg, sort_keys=True, separators=(",", ":"), ensure_ascii=True, allow_nan=True)
    return hashlib.sha256(text.encode("ascii")).hexdigest()


def _copy(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, symlinks=True)
    return dst


def _shards(d: Path) -> list[Path]:
    return sorted(d.glob("*.safetensors"))


def _meta(f: Path) -> dict:
    with safe_open(str(f), "pt") as h:
        return h.metadata() or {}


def _config(d: Path) -> dict:
    return json.loads((d / "config.json").read_text())


def _write_config(d: Path, cfg: dict) -> None:
    (d / "config.json").write_text(json.dumps(cfg, indent=2, allow_nan=True))


def seal(d: Path) -> Path:
    """Re-sign ``d`` as our exporter would (digests of the current tensors and config.json): what a
    consistent but hostile checkpoint looks like, so only value validation can refuse it."""
    cfg_sha = _canonical_sha(_config(d))
    for f in _shards(d):
        t = load_file(str(f))
        meta = {"format": "pt", "blockscale.config_sha256": cfg_sha,
                "blockscale.sha256": json.dumps({k: _sha(v) for k, v in t.items()})}
        save_file(t, str(f), metadata=meta)
    return d


def foreign(d: Path) -> Path:
    """``d`` as another producer would write it: no digest marker, no digests."""
    cfg = _config(d)
    cfg["quantization_config"]["blockscale"].pop("tensor_digests")
    _write_config(d, cfg)
    for f in _shards(d):
        save_file(load_file(str(f)), str(f), metadata={"format": "pt"})
    return d


def edit_tensors(d: Path, fn, *, sealed=True) -> Path:
    f = d / "model.safetensors"
    t = load_file(str(f))
    fn(t)
    save_file(t, str(f), metadata={"format": "pt"})
    return seal(d) if sealed else d


def edit_config(d: Path, fn, *, sealed=True, file="config.json") -> Path:
    cfg = json.loads((d / file).read_text())
    fn(cfg)
    (d / file).write_text(json.dumps(cfg, indent=2, allow_nan=True))
    return seal(d) if sealed else d


def _offsets(f: Path, name: str) -> tuple[int, int]:
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    a, b = json.loads(data[8:8 + n])[name]["data_offsets"]
    return 8 + n + a, 8 + n + b


def _set_byte(t: torch.Tensor, pos, value: int) -> None:
    u = t.view(torch.uint8)
    u[pos] = value


@pytest.fixture(scope="module")
def exported(tmp_path_factory):
    root = tmp_path_factory.mktemp("validation")
    model = make_model(layers=1, act="6", bias=True)
    out = {fmt: export_checkpoint(model, root / fmt, fmt) for fmt in (CT, MO)}
    out["logits"] = _logits(model)
    return out


def test_exports_record_digests(tmp_path, exported):
    for fmt in (CT, MO):
        d = exported[fmt]
        cfg = _config(d)
        assert cfg["quantization_config"]["blockscale"]["tensor_digests"] == "sha256"
        meta = _meta(d / "model.safetensors")
        assert meta["blockscale.config_sha256"] == _canonical_sha(cfg)
        digests = json.loads(meta["blockscale.sha256"])
        t = load_file(str(d / "model.safetensors"))
        assert digests == {k: _sha(v) for k, v in t.items()}
    out = export_checkpoint(make_model(layers=1), tmp_path / "sh", CT, max_shard_size="8KB")
    files = _shards(out)
    assert len(files) > 2
    for f in files:  # each shard lists exactly its own tensors
        assert set(json.loads(_meta(f)["blockscale.sha256"])) == set(load_file(str(f)))
    assert torch.equal(_logits(load_checkpoint(out)), _logits(make_model(layers=1)))


# ---- 1. values ------------------------------------------------------------------------------------
def _scale_bytes(positions_values):
    def fn(t):
        for pos, v in positions_values:
            _set_byte(t[Q + "weight_scale"], pos, v)
    return fn


VALUE_CASES = {  # name -> (edit(t, fmt), expected message regex)
    "scale-nan-7f": (lambda t, f: _scale_bytes([((2, 1), 0x7F)])(t),
                     rf"tensor '{Q}weight_scale': 1 of 256 E4M3 block-scale bytes .*first at \[2, 1\].*0x7f"),
    "scale-nan-ff": (lambda t, f: _scale_bytes([((5, 3), 0xFF), ((9, 0), 0x7F), ((40, 2), 0xFF)])(t),
                     rf"tensor '{Q}weight_scale': 3 of 256 E4M3 block-scale bytes .*first at \[5, 3\].*0xff"),
    "scale-negative": (lambda t, f: _scale_bytes([((0, 2), 0xB8)])(t),
                       rf"tensor '{Q}weight_scale': 1 of 256 .*negative or NaN.*first at \[0, 2\].*0xb8"),
    "scale-minus-zero": (lambda t, f: _scale_bytes([((63, 3), 0x80)])(t),
                         rf"tensor '{Q}weight_scale': 1 of 256 .*first at \[63, 3\].*0x80"),
}
for _what, _v in {"subnormal": 1e-45, "zero": 0.0, "negative": -2.0, "inf": math.inf, "nan": math.nan,
                  "tiny-subnormal": 2.0 ** -127}.items():
    for _kind in ("outer", "input"):
        VALUE_CASES[f"{_kind}-{_what}"] = (
            (lambda k, v: lambda t, f: t[Q + SUFFIX[f][k]].fill_(v))(_kind, _v),
            (lambda k: lambda f: rf"tensor '{Q}{SUFFIX[f][k]}'.* must be a positive, normal \(>= 2\*\*-126\), finite "
                                 r"FP32 value")(_kind))
VALUE_CASES.update({
    "norm-nan": (lambda t, f: t["model.norm.weight"].__setitem__(5, math.nan),
                 r"tensor 'model\.norm\.weight': 1 non-finite value \(first at \[5\]"),
    "layernorm-inf": (lambda t, f: t["model.layers.0.input_layernorm.weight"].__setitem__([7, 9], -math.inf),
                      r"tensor 'model\.layers\.0\.input_layernorm\.weight': 2 non-finite values \(first at \[7\]"),
    "embedding-inf": (lambda t, f: t["model.embed_tokens.weight"].__setitem__((3, 7), math.inf),
                      r"tensor 'model\.embed_tokens\.weight': 1 non-finite value \(first at \[3, 7\]"),
    "bias-nan": (lambda t, f: t[Q + "bias"].__setitem__(0, math.nan),
                 rf"tensor '{Q}bias': 1 non-finite value \(first at \[0\]"),
})


@pytest.mark.parametrize("case", list(VALUE_CASES))
@pytest.mark.parametrize("fmt", [CT, MO])
def test_bad_values_refused(tmp_path, exported, fmt, case):
    edit, msg = VALUE_CASES[case]
    msg = msg(fmt) if callable(msg) else msg
    for mode in ("sealed", "foreign"):
        d = _copy(exported[fmt], tmp_path / mode)
        if mode == "foreign":
            foreign(d)
        edit_tensors(d, lambda t: edit(t, fmt), sealed=mode == "sealed")
        for verify in (True, False):
            with pytest.raises(CheckpointError, match=r"model\.safetensors: " + msg):
                load_checkpoint(d, verify=verify)


@pytest.mark.parametrize("fmt", [CT, MO])
def test_outer_scales_that_dequantize_to_inf_refused(tmp_path, exported, fmt):
    key = Q + SUFFIX[fmt]["outer"]
    # the decode scale 1/S: q * s * (1/S) with q = 6 and the largest block scale s must stay finite
    scales = load_file(str(exported[fmt] / "model.safetensors"))[Q + "weight_scale"].float()
    smax = float(scales.max())
    decode = torch.tensor(torch.finfo(torch.float32).max / (6 * smax) * 1.01, dtype=torch.float32)
    stored = decode if fmt == MO else 1.0 / decode
    d = edit_tensors(_copy(exported[fmt], tmp_path / "big"), lambda t: t[key].copy_(stored.reshape(t[key].shape)))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor '{key}'=.* dequantizes the largest code "
                                              rf"\(6 x block scale {smax!r}\) to inf"):
        load_checkpoint(d)
    if fmt == CT:  # S = FLT_MAX: 1/S = 2.9e-39 is subnormal but finite; the weights are ~0, the model loads
        d = edit_tensors(_copy(exported[fmt], tmp_path / "max"),
                         lambda t: t[key].fill_(torch.finfo(torch.float32).max))
        assert torch.isfinite(_logits(load_checkpoint(d))).all()


EPS_CASES = {"inf": math.inf, "minus-one": -1.0, "zero": 0.0, "nan": math.nan, "string": "1e-6", "null": None,
             "bool": True}


@pytest.mark.parametrize("value", list(EPS_CASES))
@pytest.mark.parametrize("key", ["rms_norm_eps", "layer_norm_eps", "norm_eps"])
def test_bad_eps_refused(tmp_path, exported, key, value):
    d = edit_config(_copy(exported[CT], tmp_path / "ck"), lambda c: c.__setitem__(key, EPS_CASES[value]))
    with pytest.raises(CheckpointError, match=rf"config\.json: {key}=.*must be a finite number > 0"):
        load_checkpoint(d)


def test_non_finite_config_number_refused(tmp_path, exported):
    d = edit_config(_copy(exported[CT], tmp_path / "ck"),
                    lambda c: c["rope_parameters"].__setitem__("rope_theta", math.nan))
    with pytest.raises(CheckpointError, match=r"config\.json: rope_parameters\.rope_theta=nan is not a finite number"):
        load_checkpoint(d)


# ---- 2. malformed fields --------------------------------------------------------------------------
def _qc(fn):
    return lambda c: fn(c["quantization_config"])


def _group(fn):
    return lambda c: fn(c["quantization_config"]["config_groups"]["group_0"])


MALFORMED = {  # name -> (formats, file edited, edit, expected message regex)
    "config_groups-list": ([CT], "config.json", _qc(lambda q: q.__setitem__("config_groups", [q["config_groups"]])),
                           r"config\.json: quantization_config\.config_groups must be a JSON object, got a list"),
    "group-string": ([CT], "config.json", _qc(lambda q: q["config_groups"].__setitem__("group_0", "NVFP4")),
                     r"config\.json: quantization_config\.config_groups\.group_0 must be a JSON object, got a string"),
    "weights-string": ([CT], "config.json", _group(lambda g: g.__setitem__("weights", "nvfp4")),
                       r"config\.json: quantization_config\.config_groups\.group_0\.weights must be a JSON object, "
                       r"got a string"),
    "input_activations-list": ([CT], "config.json", _group(lambda g: g.__setitem__("input_activations", [1])),
                               r"config_groups\.group_0\.input_activations must be a JSON object or null, got a list"),
    "targets-int": ([CT], "config.json", _group(lambda g: g.__setitem__("targets", ["Linear", 3])),
                    r"config\.json: quantization_config\.config_groups\.group_0\.targets\[1\] must be a string, "
                    r"got an integer"),
    "ignore-int": ([CT, MO], "config.json", _qc(lambda q: q.__setitem__("ignore", ["lm_head", 5])),
                   r"config\.json: quantization_config\.ignore\[1\] must be a string, got an integer"),
    "ignore-string": ([CT], "config.json", _qc(lambda q: q.__setitem__("ignore", "lm_head")),
                      r"config\.json: quantization_config\.ignore must be a list of strings, got a string"),
    "ignore-bad-regex": ([CT], "config.json", _qc(lambda q: q.__setitem__("ignore", ["lm_head", "re:("])),
                         r"config\.json: quantization_config\.ignore\[1\]='re:\(' is not a valid regular expression"),
    "blockscale-string": ([CT, MO], "config.json", _qc(lambda q: q.__setitem__("blockscale", "NVFP4")),
                          r"config\.json: quantization_config\.blockscale must be a JSON object or null, got a string"),
    "input_scale_rule-int": ([CT, MO], "config.json", _qc(lambda q: q["blockscale"].__setitem__("input_scale_rule", 6)),
                             r"config\.json: quantization_config\.blockscale\.input_scale_rule must be one of "
                             r"'6', '4over6', got 6"),
    "input_overrides-list": ([CT, MO], "config.json",
                             _qc(lambda q: q["blockscale"].__setitem__("input_overrides", [Q[:-1]])),
                             r"config\.json: quantization_config\.blockscale\.input_overrides must be a JSON object "
                             r"or null, got a list"),
    "input_override-entry": ([CT, MO], "config.json",
                             _qc(lambda q: q["blockscale"].__setitem__("input_overrides", {Q[:-1]: "4over6"})),
                             rf"config\.json: quantization_config\.blockscale\.input_overrides\['{Q[:-1]}'\] must be a "
                             r"JSON object, got a string"),
    "input_override-rule": ([CT, MO], "config.json",
                            _qc(lambda q: q["blockscale"].__setitem__("input_overrides",
                                                                      {Q[:-1]: {"input_error": "l2"}})),
                            r"input_overrides\['.*'\]\.input_error must be one of 'mse', 'mae', 'maxabs', got 'l2'"),
    "tensor_digests-unknown": ([CT, MO], "config.json", _qc(lambda q: q["blockscale"].__setitem__("tensor_digests",
                                                                                                  "md5")),
                               r"quantization_config\.blockscale\.tensor_digests must be one of 'sha256', got 'md5'"),
    "exclude_modules-int": ([MO], "hf_quant_config.json",
                            lambda h: h["quantization"].__setitem__("exclude_modules", ["lm_head", 7]),
                            r"hf_quant_config\.json: quantization\.exclude_modules\[1\] must be a string, "
                            r"got an integer"),
    "quantization-list": ([MO], "hf_quant_config.json", lambda h: h.__setitem__("quantization", []),
                          r"hf_quant_config\.json: quantization must be a JSON object, got a list"),
    "quant_algo-list": ([MO], "hf_quant_config.json", lambda h: h["quantization"].__setitem__("quant_algo", ["NVFP4"]),
                        r"hf_quant_config\.json: quantization\.quant_algo must be a string, got a list"),
    "negative-hidden_size": ([CT, MO], "config.json", lambda c: c.__setitem__("hidden_size", -64),
                             r"config\.json: hidden_size=-64 must be an integer in \[1, "),
    "string-hidden_size": ([CT], "config.json", lambda c: c.__setitem__("hidden_size", "64"),
                           r"config\.json: hidden_size='64' must be an integer in \[1, "),
    "bool-num_layers": ([CT], "config.json", lambda c: c.__setitem__("num_hidden_layers", True),
                        r"config\.json: num_hidden_layers=True must be an integer in \[1, "),
    "dtype-fp8": ([CT, MO], "config.json", lambda c: c.__setitem__("dtype", "float8_e4m3fn"),
                  r"config\.json: dtype='float8_e4m3fn' is not a model dtype \(expected one of 'float32', "
                  r"'float16', 'bfloat16', 'float64'\)"),
    "dtype-int": ([CT], "config.json", lambda c: c.__setitem__("torch_dtype", 16),
                  r"config\.json: torch_dtype=16 is not a model dtype"),
}


@pytest.mark.parametrize("case", list(MALFORMED))
def test_malformed_field_is_a_checkpoint_error(tmp_path, exported, case):
    fmts, file, edit, msg = MALFORMED[case]
    for fmt in fmts:
        d = foreign(_copy(exported[fmt], tmp_path / fmt))
        edit_config(d, edit, sealed=False, file=file)
        for verify in (True, False):
            with pytest.raises(CheckpointError, match=msg):
                load_checkpoint(d, verify=verify)


def test_inline_modelopt_config_fields(tmp_path, exported):
    d = foreign(_copy(exported[MO], tmp_path / "mo"))
    (d / "hf_quant_config.json").unlink()
    assert torch.equal(_logits(load_checkpoint(d)), exported["logits"])
    edit_config(d, _qc(lambda q: q.__setitem__("ignore", [None])), sealed=False)
    with pytest.raises(CheckpointError, match=r"config\.json: quantization_config\.ignore\[0\] must be a string, "
                                              r"got null"):
        load_checkpoint(d)


@pytest.fixture(scope="module")
def sharded(tmp_path_factory):
    return export_checkpoint(make_model(layers=1), tmp_path_factory.mktemp("sharded") / "ck", CT,
                             max_shard_size="8KB")


INDEX_CASES = {
    "value-int": (lambda wm, k: wm.__setitem__(k, 3), r"weight_map\['{k}'\] must be a shard file name \(a string\), "
                                                      r"got an integer"),
    "value-null": (lambda wm, k: wm.__setitem__(k, None), r"weight_map\['{k}'\] must be a shard file name \(a string\), "
                                                          r"got null"),
    "value-path": (lambda wm, k: wm.__setitem__(k, "../ck/" + wm[k]),
                   r"weight_map\['{k}'\]='\.\./ck/.*' is not a file name inside the checkpoint directory"),
    "value-dir": (lambda wm, k: wm.__setitem__(k, "."), r"weight_map\['{k}'\]='\.' is not a file name"),
}


@pytest.mark.parametrize("case", list(INDEX_CASES))
def test_malformed_index(tmp_path, sharded, case):
    edit, msg = INDEX_CASES[case]
    d = _copy(sharded, tmp_path / "ck")
    index = json.loads((d / "model.safetensors.index.json").read_text())
    key = sorted(index["weight_map"])[0]
    edit(index["weight_map"], key)
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(CheckpointError, match=r"model\.safetensors\.index\.json: " + msg.format(k=re.escape(key))):
        load_checkpoint(d)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": [1]}))
    with pytest.raises(CheckpointError, match=r"index\.json: weight_map must be a non-empty JSON object"):
        load_checkpoint(d)


def test_malformed_safetensors_header_entries(tmp_path, exported):
    d = _copy(exported[CT], tmp_path / "ck")
    f = d / "model.safetensors"
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])

    def write(h):
        text = json.dumps(h).encode()
        text += b" " * (-len(text) % 8)
        f.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n:])

    name = "model.norm.weight"
    cases = [
        ({**header, name: {**header[name], "dtype": "F7"}}, rf"tensor '{name}': unknown dtype 'F7'"),
        ({**header, name: {**header[name], "shape": [-64]}},
         rf"tensor '{name}': shape \[-64\] must be a list of integers >= 0"),
        ({**header, name: {**header[name], "shape": "64"}}, rf"tensor '{name}': shape '64' must be a list of integers"),
        ({**header, name: {**header[name], "shape": [63]}}, rf"tensor '{name}': its shape and dtype need 252 bytes, "
                                                            r"data_offsets span 256"),
        ({**header, name: "x"}, rf"corrupt safetensors header entry for '{name}'"),
        ({**header, "__metadata__": {"a": 1}}, r"corrupt safetensors header: __metadata__ must map strings to strings"),
    ]
    for h, msg in cases:
        write(h)
        with pytest.raises(CheckpointError, match=r"model\.safetensors: " + msg):
            load_checkpoint(d, verify=False)
    # overlapping data offsets: two tensors share bytes
    a, b = header[name]["data_offsets"]
    other = next(k for k in header if k not in (name, "__metadata__") and
                 header[k]["data_offsets"][1] - header[k]["data_offsets"][0] == b - a)
    write({**header, other: {**header[other], "data_offsets": [a, b]}})
    with pytest.raises(CheckpointError, match=r"model\.safetensors: .*data_offsets .*overlap or leave gaps"):
        load_checkpoint(d, verify=False)
    entry = json.dumps({name: header[name]})[1:-1]
    text = ("{" + entry + ", " + json.dumps(header)[1:]).encode()
    text += b" " * (-len(text) % 8)
    f.write_bytes(len(text).to_bytes(8, "little") + text + data[8 + n:])
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: corrupt safetensors header \(duplicate key '{name}'\)"):
        load_checkpoint(d, verify=False)


# ---- 3. sizes checked against the headers before any allocation ----------------------------------
SIZE_CASES = {
    "vocab-1e15": ("vocab_size", 10**15, r"config\.json: vocab_size=1000000000000000 must be an integer in \[1, "),
    "layers-1e7": ("num_hidden_layers", 10**7, r"config\.json: num_hidden_layers=10000000 must be an integer in \[1, "),
    "vocab-mismatch": ("vocab_size", 2**20, r"config\.json: vocab_size=1048576 does not match the embedding "
                                            r"'model\.embed_tokens\.weight' \[64, 64\] in model\.safetensors"),
    "layers-mismatch": ("num_hidden_layers", 4000, r"config\.json: num_hidden_layers=4000, but the tensors in "
                                                   r"model\.safetensors hold 1 layer"),
    "intermediate-huge": ("intermediate_size", 2**20, r"tensor 'model\.layers\.0\.mlp\.down_proj\.weight_packed': "
                                                      r"torch\.uint8 \[64, 48\], expected torch\.uint8 \[64, 524288\]"),
    "hidden-huge": ("hidden_size", 2**18, r"config\.json: hidden_size=262144 does not match the embedding "
                                          r"'model\.embed_tokens\.weight' \[64, 64\] in model\.safetensors"),
    "kv-heads": ("num_key_value_heads", 4, r"model\.safetensors: tensor 'model\.layers\.0\.self_attn\.k_proj\.bias': "
                                           r"shape \[32\], the config implies \[64\]"),
    "heads": ("num_attention_heads", 8, r"tensor 'model\.layers\.0\.self_attn\.o_proj\.weight_packed': torch\.uint8 "
                                        r"\[64, 32\], expected torch\.uint8 \[64, 64\]"),
    "heads-indivisible": ("num_attention_heads", 2**14, r"config\.json: transformers cannot read it .*not a multiple of "
                                                        r"the number of attention heads"),
}


@pytest.mark.parametrize("case", list(SIZE_CASES))
def test_config_sizes_checked_before_allocation(tmp_path, exported, case):
    key, value, msg = SIZE_CASES[case]
    d = edit_config(_copy(exported[CT], tmp_path / "ck"), lambda c: c.__setitem__(key, value))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match=msg):
        load_checkpoint(d)
    assert time.perf_counter() - t0 < 1.5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 100 * 1024  # KiB: no large allocation


# ---- 4. digests -----------------------------------------------------------------------------------
@pytest.mark.parametrize("fmt", [CT, MO])
def test_flipped_byte_in_codes_caught(tmp_path, exported, fmt):
    d = _copy(exported[fmt], tmp_path / "ck")
    f = d / "model.safetensors"
    a, _ = _offsets(f, Q + SUFFIX[fmt]["packed"])
    data = bytearray(f.read_bytes())
    data[a + 37] ^= 0x77
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor '{Q}{SUFFIX[fmt]['packed']}' does not "
                                              r"match its recorded SHA-256 digest.*verify=False"):
        load_checkpoint(d)
    wrong = load_checkpoint(d, verify=False)  # loads: the flip is a valid code, a different model
    assert not torch.equal(_logits(wrong), exported["logits"])


def test_flipped_byte_in_a_later_shard_names_it(tmp_path, sharded):
    d = _copy(sharded, tmp_path / "ck")
    f = _shards(d)[-1]
    data = bytearray(f.read_bytes())
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    name = min((k for k, v in header.items() if k != "__metadata__" and v["dtype"] != "F8_E4M3"),
               key=lambda k: header[k]["data_offsets"][0])
    data[8 + n + header[name]["data_offsets"][0]] ^= 0x01  # the lowest mantissa / code bit: still a valid value
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match=rf"{f.name}: tensor '{name}' does not match its recorded SHA-256 digest"):
        load_checkpoint(d)


def test_stripped_or_wrong_digests(tmp_path, exported):
    ref = exported["logits"]
    d = _copy(exported[CT], tmp_path / "strip")
    f = d / "model.safetensors"
    save_file(load_file(str(f)), str(f), metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"model\.safetensors: no SHA-256 digests .*tensor_digests='sha256'"):
        load_checkpoint(d)
    assert torch.equal(_logits(load_checkpoint(d, verify=False)), ref)

    d = _copy(exported[CT], tmp_path / "wrong")
    f = d / "model.safetensors"
    t, meta = load_file(str(f)), _meta(f)
    digests = json.loads(meta["blockscale.sha256"])
    digests["model.norm.weight"] = "0" * 64
    save_file(t, str(f), metadata={**meta, "blockscale.sha256": json.dumps(digests)})
    with pytest.raises(CheckpointError, match=r"tensor 'model\.norm\.weight' does not match its recorded SHA-256"):
        load_checkpoint(d)
    digests.pop("model.norm.weight")
    save_file(t, str(f), metadata={**meta, "blockscale.sha256": json.dumps(digests)})
    with pytest.raises(CheckpointError, match=r"model\.safetensors: no SHA-256 digest for tensor 'model\.norm\.weight'"):
        load_checkpoint(d)
    save_file(t, str(f), metadata={**meta, "blockscale.sha256": "[1, 2]"})
    with pytest.raises(CheckpointError, match=r"model\.safetensors: __metadata__\['blockscale\.sha256'\] is not a JSON "
                                              r"object of SHA-256 hex digests"):
        load_checkpoint(d)

    d = _copy(exported[MO], tmp_path / "marker")  # digests kept, marker stripped from config.json
    edit_config(d, _qc(lambda q: q["blockscale"].pop("tensor_digests")), sealed=False)
    with pytest.raises(CheckpointError, match=r"config\.json does not match the SHA-256 digest recorded in "
                                              r"model\.safetensors"):
        load_checkpoint(d)
    assert torch.equal(_logits(load_checkpoint(d, verify=False)), ref)


@pytest.mark.parametrize("fmt", [CT, MO])
def test_modified_config_caught(tmp_path, exported, fmt):
    d = _copy(exported[fmt], tmp_path / "ck")
    edit_config(d, lambda c: c.__setitem__("rms_norm_eps", 1e-5), sealed=False)
    with pytest.raises(CheckpointError, match=r"config\.json does not match the SHA-256 digest recorded in "
                                              r"model\.safetensors \(it was modified after export\).*verify=False"):
        load_checkpoint(d)
    assert not torch.equal(_logits(load_checkpoint(d, verify=False)), exported["logits"])
    d = _copy(exported[fmt], tmp_path / "reindented")  # whitespace is not content
    _write_config(d, _config(d))
    assert torch.equal(_logits(load_checkpoint(d)), exported["logits"])


@pytest.mark.parametrize("fmt", [CT, MO])
def test_foreign_checkpoint_loads_without_digests(tmp_path, exported, fmt):
    d = foreign(_copy(exported[fmt], tmp_path / "ck"))
    assert torch.equal(_logits(load_checkpoint(d)), exported["logits"])


def test_open_model_passes_verify(tmp_path, exported):
    from blockscale.ptq.pipeline import open_model

    d = _copy(exported[CT], tmp_path / "ck")
    f = d / "model.safetensors"
    a, _ = _offsets(f, Q + "weight_packed")
    data = bytearray(f.read_bytes())
    data[a] ^= 0x11
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="SHA-256"):
        open_model(str(d))
    assert open_model(str(d), verify=False).model is not None


# ---- 5. paths -------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", ["model.safetensors", "config.json", "hf_quant_config.json", "generation_config.json",
                                  "tokenizer.json"])
def test_symlink_outside_refused(tmp_path, exported, name):
    d = _copy(exported[MO], tmp_path / "ck")
    outside = tmp_path / "outside"
    outside.mkdir()
    target = outside / name
    if (d / name).exists():
        shutil.move(str(d / name), str(target))
    else:
        target.write_text("{}")
    os.symlink(target, d / name)
    with pytest.raises(CheckpointError, match=rf"{re.escape(str(d / name))}: a symlink to {re.escape(str(target.resolve()))}, "
                                              r"outside the checkpoint directory"):
        load_checkpoint(d)


def test_symlinks_inside_are_followed(tmp_path, exported):
    d = _copy(exported[CT], tmp_path / "ck")
    (d / "blobs").mkdir()
    shutil.move(str(d / "model.safetensors"), str(d / "blobs" / "x"))
    os.symlink(d / "blobs" / "x", d / "model.safetensors")
    os.symlink("blobs", d / "alias")  # a directory link inside
    assert torch.equal(_logits(load_checkpoint(d)), exported["logits"])
    os.symlink(tmp_path, d / "blobs" / "up")  # not top level, never read: allowed
    assert torch.equal(_logits(load_checkpoint(d)), exported["logits"])
    os.symlink(tmp_path / "nowhere", d / "dangling.json")
    with pytest.raises(CheckpointError, match=r"dangling\.json: a symlink to .*nowhere, outside the checkpoint"):
        load_checkpoint(d)


def test_sharded_symlinks(tmp_path, sharded):
    d = _copy(sharded, tmp_path / "ck")
    shard = _shards(d)[1]
    shutil.move(str(shard), str(tmp_path / shard.name))
    os.symlink(tmp_path / shard.name, shard)
    with pytest.raises(CheckpointError, match=rf"{shard.name}: a symlink to .*outside the checkpoint directory"):
        load_checkpoint(d)
