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
