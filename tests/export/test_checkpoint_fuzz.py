"""Fuzzing a small exported checkpoint (both formats): seeded random mutations of the safetensors
header and data bytes, of config.json's fields (random types and values) and bytes, and of
hf_quant_config.json; every load either raises ``CheckpointError`` or returns a model whose logits
equal the original's exactly (with digest verification), and never raises anything else (without)."""
import json
import math
import random
import time
from pathlib import Path

import pytest
import torch

from blockscale.export import CheckpointError, load_checkpoint

from checkpoint_edits import copy, exported  # noqa: F401  (a fixture)
from nvfp4_checkpoints import CT, MO, model_logits  # noqa: E402

pytest.importorskip("transformers")

pytestmark = pytest.mark.usefixtures("one_thread", "reference_backend")

# ---- 6. fuzz --------------------------------------------------------------------------------------
FUZZ_VALUES = [None, True, False, 0, 1, -1, 2, 15, 16, 63, 64, 65, 96, 2**31, 10**7, 10**15, -10**15, 0.0, -0.0,
               1e-45, 1e-6, 0.5, 1e300, math.nan, math.inf, -math.inf, "", "x", "float16", "bfloat16", "float8_e4m3fn",
               "re:(", "re:.*", "Linear", "lm_head", "6", "4over6", "mae", "NVFP4", "W4A16_NVFP4", "sha256", [], [1],
               ["lm_head", 5], ["*"], {}, {"a": 1}, {"group_0": "x"}]


def _paths(obj, prefix=()):
    yield prefix
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield from _paths(v, prefix + (k,))
    elif isinstance(obj, list):
        for i, v in enumerate(obj):
            yield from _paths(v, prefix + (i,))


def _mutate_json(rng: random.Random, obj):
    paths = [p for p in _paths(obj) if p]
    path = rng.choice(paths)
    parent = obj
    for k in path[:-1]:
        parent = parent[k]
    old = parent[path[-1]]
    op = rng.random()
    if op < 0.15 and isinstance(parent, dict):
        del parent[path[-1]]
        return f"del {path}"
    if op < 0.25 and isinstance(old, dict):
        old[rng.choice(["x", "eps", "layer_norm_eps", "input_overrides", "tensor_digests"])] = rng.choice(FUZZ_VALUES)
        return f"add key under {path}"
    if op < 0.45 and isinstance(old, (int, float)) and not isinstance(old, bool):
        new = old + rng.choice([1, -1]) if isinstance(old, int) else old * rng.choice([0.5, 2, -1])
    else:
        new = rng.choice(FUZZ_VALUES)
    parent[path[-1]] = new
    return f"{path}: {old!r} -> {new!r}"


def _mutate(rng: random.Random, d: Path, orig: dict, fmt: str) -> str:
    kind = rng.choice(["header", "header", "data", "data", "config", "config", "config", "config-bytes", "reindent"] +
                      (["hfq"] if fmt == MO else []))
    if kind == "reindent":  # not a change of content: must load
        (d / "config.json").write_text(json.dumps(json.loads(orig["config.json"]), indent=rng.choice([None, 1, 4])))
        return "config.json re-indented"
    if kind in ("config", "hfq"):
        name = "config.json" if kind == "config" else "hf_quant_config.json"
        obj = json.loads(orig[name])
        desc = _mutate_json(rng, obj)
        (d / name).write_text(json.dumps(obj, allow_nan=True))
        return f"{name} {desc}"
    name = "config.json" if kind == "config-bytes" else "model.safetensors"
    data = bytearray(orig[name])
    n = int.from_bytes(data[:8], "little")
    lo, hi = {"header": (0, 8 + n), "data": (8 + n, len(data)), "config-bytes": (0, len(data))}[kind]
    edits = []
    for _ in range(rng.choice([1, 1, 2, 3])):
        i = rng.randrange(lo, hi)
        new = rng.choice([rng.randrange(256), ord(rng.choice('0123456789"{}[],: .-eE')), data[i] ^ (1 << rng.randrange(8))])
        edits.append((i, data[i], new))
        data[i] = new
    (d / name).write_bytes(bytes(data))
    return f"{kind} bytes {edits}"


@pytest.mark.parametrize("fmt", [CT, MO])
def test_fuzz_never_loads_a_wrong_model(tmp_path, exported, fmt):
    rng = random.Random(12 + (fmt == MO))
    ref = exported["logits"]
    d = copy(exported[fmt], tmp_path / "ck")
    orig = {p.name: p.read_bytes() for p in d.iterdir()}
    outcomes = {"refused": 0, "loaded": 0, "refused-unverified": 0}
    deadline = time.monotonic() + 3.0
    trials = 0
    while trials < 300 and (trials < 20 or time.monotonic() < deadline):
        for name, data in orig.items():
            (d / name).write_bytes(data)
        desc = _mutate(rng, d, orig, fmt)
        for verify in (True, False):
            try:
                m = load_checkpoint(d, verify=verify)
            except CheckpointError:
                outcomes["refused" if verify else "refused-unverified"] += 1
                continue
            except Exception as e:  # noqa: BLE001 - the point of the test
                pytest.fail(f"mutation {desc} (verify={verify}): {type(e).__name__}: {e}")
            if verify:
                outcomes["loaded"] += 1
                assert torch.equal(model_logits(m), ref), f"mutation {desc} loaded a different model"
        trials += 1
    assert outcomes["refused"] > trials // 2 and outcomes["loaded"] > 0, outcomes

