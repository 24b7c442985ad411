"""Behaviour unchanged bit for bit across the format-generic refactor (issue 14): the digests of a fixed
set of calls (``refactor_digests.py``) equal those recorded before it."""
from __future__ import annotations

import json

import pytest

import refactor_digests as rd

WANT = json.loads(rd.FIXTURE.read_text())


def _diff(got: dict, group: str) -> list[str]:
    return [k for k in WANT[group] if got[group].get(k) != WANT[group][k]]


def test_fixture_covers_every_format_rule_and_rounding():
    names = WANT["quant"]
    assert sum(k.startswith("nvfp4/") for k in names) >= 150
    assert sum(k.startswith("mx/") for k in names) == 3 * 2 * 2 * (2 + 1 + 1)
    assert sum(k.startswith("s2f6/") for k in names) == 12
    assert {k.split("/")[0] for k in WANT["model"]} == {"train", "ptq", "lsq", "export"}


def test_quantizer_outputs_unchanged(tmp_path):
    got = rd.compute(tmp_path, groups=("quant",))
    assert _diff(got, "quant") == []


def test_training_ptq_lsq_export_outputs_unchanged(tmp_path):
    if rd.fingerprint() != WANT["fingerprint"]:
        pytest.skip(f"float32 matrix-product sums differ between CPUs; recorded on {WANT['fingerprint']}, "
                    f"this is {rd.fingerprint()}")
    got = rd.compute(tmp_path, groups=("model",))
    assert _diff(got, "model") == []


def test_fixture_covers_every_scheme_family_and_format():
    names = WANT["exports"]
    from blockscale.recipes.ptq_recipe import SCHEME_NAMES

    for scheme in set(SCHEME_NAMES) - {"bf16"}:
        assert any(k.split("/")[-3:-2] == [scheme] or f"scheme/{scheme}/" in k for k in names), scheme
    for family in ("mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "deepseek_v3"):
        assert any(f"moe/{family}/" in k for k in names), family
    assert {k.split("/")[1] for k in names if k.startswith("streaming/")} == {"compressed-tensors", "modelopt"}


def test_exports_unchanged(tmp_path):
    """The bytes of every export path (issue 30's acceptance): weight-only everywhere, calibrated results only
    on a machine like the recording one."""
    got = rd.compute(tmp_path, groups=("exports",))["exports"]
    same_machine = rd.fingerprint() == WANT["exports_fingerprint"]
    keys = [k for k in WANT["exports"] if same_machine or not k.startswith(rd.CALIBRATED)]
    assert len(keys) >= 70
    assert [k for k in keys if got.get(k) != WANT["exports"][k]] == []
