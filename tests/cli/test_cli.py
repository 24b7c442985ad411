"""The `blockscale` command line: demo on a real safetensors file, the generated fallback, bad input."""
import pytest
import torch
from safetensors.torch import save_file

from blockscale import cli
from blockscale.cli import formats_table as demo


def test_demo_on_a_safetensors_file(tmp_path, capsys):
    w = torch.randn(64, 96, generator=torch.Generator().manual_seed(0))
    path = tmp_path / "w.safetensors"
    save_file({"layer.weight": w, "layer.bias": torch.zeros(64)}, str(path))
    assert cli.main(["formats", "--safetensors", str(path), "--tensor", "layer.weight", "--repeats", "1",
                     "--backend", "reference"]) == 0
    out = capsys.readouterr().out
    assert "layer.weight (64, 96) float32" in out
    lines = {line[:30].strip(): line.split() for line in out.splitlines()}
    for label, _ in demo.demo_specs():
        assert label in lines
    # on Gaussian data: 4/6 beats RTN, the sweep beats 4/6, MXFP8 beats NVFP4 (numbers from the table)
    rel = {k: float(v[-4]) for k, v in lines.items() if k in dict(demo.demo_specs())}
    assert rel["NVFP4 sweep (126 scales)"] < rel["NVFP4 4/6 MSE"] < rel["NVFP4 scale-to-6 (RTN)"]
    assert rel["MXFP8 E4M3 ceil"] < rel["NVFP4 scale-to-6 (RTN)"] / 5


def test_demo_without_minilm_uses_a_generated_matrix(monkeypatch, capsys):
    monkeypatch.setattr(demo, "minilm_safetensors_path", lambda: None)
    w, source = demo.load_weight(None, None)
    assert w.shape == (1536, 384) and "generated" in source


def test_demo_bad_input(tmp_path, capsys):
    assert cli.main(["formats", "--safetensors", str(tmp_path / "missing.safetensors")]) == 2
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.safetensors"
    bad.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    assert cli.main(["formats", "--safetensors", str(bad)]) == 2
    assert "not a readable safetensors file" in capsys.readouterr().err
    good = tmp_path / "g.safetensors"
    save_file({"a": torch.zeros(4, 4)}, str(good))
    assert cli.main(["formats", "--safetensors", str(good), "--tensor", "nope"]) == 2
    assert "'nope' is not in" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["formats", "--backend", "gpu"])


def test_backend_choices_are_the_quant_backends():
    from blockscale.quant.backend import BACKENDS
    from blockscale.cli.train import build_parser as train_parser

    assert "triton" in BACKENDS
    for name in BACKENDS:
        assert cli.build_parser().parse_args(["formats", "--backend", name]).backend == name
        assert train_parser().parse_args(["--data", "x", "--backend", name]).backend == name


def test_recipes_command(capsys):
    assert cli.main(["recipes"]) == 0
    out = capsys.readouterr().out
    for name in ("bf16", "mxfp8", "nvfp4-nvidia", "nvfp4-nvidia-4over6", "nvfp4-fwd-mxfp8-bwd"):
        assert name in out
    assert cli.main(["recipes", "nvfp4-fwd-mxfp8-bwd"]) == 0
    import yaml

    from blockscale.recipes import get_recipe, recipe_from_dict
    assert recipe_from_dict(yaml.safe_load(capsys.readouterr().out)) == get_recipe("nvfp4-fwd-mxfp8-bwd")


def test_train_command_with_a_recipe(tmp_path, capsys):
    import json

    import blockscale as bs

    threads = torch.get_num_threads()
    with bs.use_backend("reference"):
        rc = cli.main(["train", "--data", "shakespeare", "--model-preset", "tiny", "--recipe", "nvfp4-nvidia",
                       "--backend", "reference", "--steps", "3", "--batch-size", "2", "--seq-len", "32",
                       "--eval-interval", "3", "--eval-batches", "1", "--no-progress", "--out", str(tmp_path / "run"),
                       "--no-plot", "--threads", "1"])
    torch.set_num_threads(threads)
    assert rc == 0
    out = capsys.readouterr().out
    assert "convert(nvfp4-nvidia)" in out and "done: step 3" in out
    lines = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    assert lines[-1]["step"] == 3 and "val_loss" in lines[-1]
    assert cli.main(["train", "--data", "shakespeare", "--recipe", "fp2", "--steps", "1", "--no-progress"]) == 2
