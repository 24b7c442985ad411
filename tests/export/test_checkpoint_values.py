"""Loading untrusted NVFP4 checkpoints, what they hold: values are validated before anything is built
(E4M3 block scales finite and non-negative, outer / input scales positive normal finite, plain tensors
finite, eps finite and > 0), every malformed field (config.json, hf_quant_config.json, the shard index,
safetensors headers) is one ``CheckpointError`` naming the file and key, and config sizes are checked
against the safetensors headers before any allocation. (Digests and paths: test_checkpoint_integrity.py;
the fuzz test: test_checkpoint_fuzz.py.)"""
import json
import math
import re
import resource
import time

import pytest
import torch
from safetensors.torch import load_file

from blockscale.export import CheckpointError, load_checkpoint

from checkpoint_edits import (CT, MO, Q, SUFFIX, copy, edit_config, edit_tensors, exported, foreign,  # noqa: F401
                              qc, set_byte, sharded)
from nvfp4_checkpoints import model_logits  # noqa: E402

transformers = pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread", "reference_backend")


# ---- 1. values ------------------------------------------------------------------------------------
def _scale_bytes(positions_values):
    def fn(t):
        for pos, v in positions_values:
            set_byte(t[Q + "weight_scale"], pos, v)
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
        d = copy(exported[fmt], tmp_path / mode)
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
    d = edit_tensors(copy(exported[fmt], tmp_path / "big"), lambda t: t[key].copy_(stored.reshape(t[key].shape)))
    with pytest.raises(CheckpointError, match=rf"model\.safetensors: tensor '{key}'=.* dequantizes the largest code "
                                              rf"\(6 x block scale {smax!r}\) to inf"):
        load_checkpoint(d)
    if fmt == CT:  # S = FLT_MAX: 1/S = 2.9e-39 is subnormal but finite; the weights are ~0, the model loads
        d = edit_tensors(copy(exported[fmt], tmp_path / "max"),
                         lambda t: t[key].fill_(torch.finfo(torch.float32).max))
        assert torch.isfinite(model_logits(load_checkpoint(d))).all()


EPS_CASES = {"inf": math.inf, "minus-one": -1.0, "zero": 0.0, "nan": math.nan, "string": "1e-6", "null": None,
             "bool": True}


@pytest.mark.parametrize("value", list(EPS_CASES))
@pytest.mark.parametrize("key", ["rms_norm_eps", "layer_norm_eps", "norm_eps"])
def test_bad_eps_refused(tmp_path, exported, key, value):
    d = edit_config(copy(exported[CT], tmp_path / "ck"), lambda c: c.__setitem__(key, EPS_CASES[value]))
    with pytest.raises(CheckpointError, match=rf"config\.json: {key}=.*must be a finite number > 0"):
        load_checkpoint(d)


def test_non_finite_config_number_refused(tmp_path, exported):
    d = edit_config(copy(exported[CT], tmp_path / "ck"),
                    lambda c: c["rope_parameters"].__setitem__("rope_theta", math.nan))
    with pytest.raises(CheckpointError, match=r"config\.json: rope_parameters\.rope_theta=nan is not a finite number"):
        load_checkpoint(d)


# ---- 2. malformed fields --------------------------------------------------------------------------
def _group(fn):
    return lambda c: fn(c["quantization_config"]["config_groups"]["group_0"])


MALFORMED = {  # name -> (formats, file edited, edit, expected message regex)
    "config_groups-list": ([CT], "config.json", qc(lambda q: q.__setitem__("config_groups", [q["config_groups"]])),
                           r"config\.json: quantization_config\.config_groups must be a JSON object, got a list"),
    "group-string": ([CT], "config.json", qc(lambda q: q["config_groups"].__setitem__("group_0", "NVFP4")),
                     r"config\.json: quantization_config\.config_groups\.group_0 must be a JSON object, got a string"),
    "weights-string": ([CT], "config.json", _group(lambda g: g.__setitem__("weights", "nvfp4")),
                       r"config\.json: quantization_config\.config_groups\.group_0\.weights must be a JSON object, "
                       r"got a string"),
    "input_activations-list": ([CT], "config.json", _group(lambda g: g.__setitem__("input_activations", [1])),
                               r"config_groups\.group_0\.input_activations must be a JSON object or null, got a list"),
    "targets-int": ([CT], "config.json", _group(lambda g: g.__setitem__("targets", ["Linear", 3])),
                    r"config\.json: quantization_config\.config_groups\.group_0\.targets\[1\] must be a string, "
                    r"got an integer"),
    "ignore-int": ([CT, MO], "config.json", qc(lambda q: q.__setitem__("ignore", ["lm_head", 5])),
                   r"config\.json: quantization_config\.ignore\[1\] must be a string, got an integer"),
    "ignore-string": ([CT], "config.json", qc(lambda q: q.__setitem__("ignore", "lm_head")),
                      r"config\.json: quantization_config\.ignore must be a list of strings, got a string"),
    "ignore-bad-regex": ([CT], "config.json", qc(lambda q: q.__setitem__("ignore", ["lm_head", "re:("])),
                         r"config\.json: quantization_config\.ignore\[1\]='re:\(' is not a valid regular expression"),
    "blockscale-string": ([CT, MO], "config.json", qc(lambda q: q.__setitem__("blockscale", "NVFP4")),
                          r"config\.json: quantization_config\.blockscale must be a JSON object or null, got a string"),
    "input_scale_rule-int": ([CT, MO], "config.json", qc(lambda q: q["blockscale"].__setitem__("input_scale_rule", 6)),
                             r"config\.json: quantization_config\.blockscale\.input_scale_rule must be one of "
                             r"'6', '4over6', got 6"),
    "input_overrides-list": ([CT, MO], "config.json",
                             qc(lambda q: q["blockscale"].__setitem__("input_overrides", [Q[:-1]])),
                             r"config\.json: quantization_config\.blockscale\.input_overrides must be a JSON object "
                             r"or null, got a list"),
    "input_override-entry": ([CT, MO], "config.json",
                             qc(lambda q: q["blockscale"].__setitem__("input_overrides", {Q[:-1]: "4over6"})),
                             rf"config\.json: quantization_config\.blockscale\.input_overrides\['{Q[:-1]}'\] must be a "
                             r"JSON object, got a string"),
    "input_override-rule": ([CT, MO], "config.json",
                            qc(lambda q: q["blockscale"].__setitem__("input_overrides",
                                                                      {Q[:-1]: {"input_error": "l2"}})),
                            r"input_overrides\['.*'\]\.input_error must be one of 'mse', 'mae', 'maxabs', got 'l2'"),
    "tensor_digests-unknown": ([CT, MO], "config.json", qc(lambda q: q["blockscale"].__setitem__("tensor_digests",
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
        d = foreign(copy(exported[fmt], tmp_path / fmt))
        edit_config(d, edit, sealed=False, file=file)
        for verify in (True, False):
            with pytest.raises(CheckpointError, match=msg):
                load_checkpoint(d, verify=verify)


def test_inline_modelopt_config_fields(tmp_path, exported):
    d = foreign(copy(exported[MO], tmp_path / "mo"))
    (d / "hf_quant_config.json").unlink()
    assert torch.equal(model_logits(load_checkpoint(d)), exported["logits"])
    edit_config(d, qc(lambda q: q.__setitem__("ignore", [None])), sealed=False)
    with pytest.raises(CheckpointError, match=r"config\.json: quantization_config\.ignore\[0\] must be a string, "
                                              r"got null"):
        load_checkpoint(d)


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
    d = copy(sharded, tmp_path / "ck")
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
    d = copy(exported[CT], tmp_path / "ck")
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
    d = edit_config(copy(exported[CT], tmp_path / "ck"), lambda c: c.__setitem__(key, value))
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    t0 = time.perf_counter()
    with pytest.raises(CheckpointError, match=msg):
        load_checkpoint(d)
    assert time.perf_counter() - t0 < 1.5
    assert resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - rss < 100 * 1024  # KiB: no large allocation
