"""Every command in README.md runs, so the front door stays true.

- ```python blocks are executed as they are (the README keeps them small: 256 x 256 tensors), and a
  comment that states a result's dtype and shape (``q.codes  # uint8 [256, 128]: ...``) is checked.
- ```bash blocks: each ``blockscale ...`` line runs through the command line
  (``python -m blockscale.cli``, a subprocess) in a fresh temporary directory, one directory per block
  so a block's later lines read what its earlier lines wrote. What a README line names for a real run
  is replaced by the built-in tiny model and tiny sizes through the explicit tables below
  (MODEL_SUBSTITUTES, VALUE_SUBSTITUTES, EXTRA_FLAGS); every other word of the line is passed as
  written, so a renamed flag or subcommand fails here. Each command must exit 0 and write what
  EXPECTED_FILES says.
- ``make X`` (in a bash block or inline in the prose) must name a target of the Makefile;
  ``blockscale X`` inline in the prose must name a subcommand.
- A line starting with a word in NOT_RUN is not run, for the reason given there; any other first word
  fails the test until it is added to one of these tables.
- Relative links in README.md and docs/index.md must exist, and docs/index.md must list every file of
  docs/ and docs/results/.

The whole file takes well under a minute on 2 cores (five subprocesses on stories260K).
"""
from __future__ import annotations

import json
import math
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
INDEX = ROOT / "docs" / "index.md"

pytestmark = pytest.mark.usefixtures("one_thread")

# --- what the README's commands are run with instead -------------------------------------------------
# Model arguments (the first positional argument of a subcommand) -> the built-in 260K-parameter Llama,
# read from the shared data folder: the real models need a download (hub) or `make demo`'s extras.
MODEL_SUBSTITUTES = {
    "meta-llama/Llama-3.2-1B": "stories260k",
    "smollm2-135m": "stories260k",
}
# A flag's value -> the value used here (the flag itself stays, so its name is still checked).
VALUE_SUBSTITUTES = {
    "--steps": "2",             # 50 / 200 steps -> 2: the command's path, not its result
    "--model-preset": "tiny",   # train: the `small` Llama (4.5M) -> `tiny`
}
# Flags appended per subcommand: calibration / training / evaluation sizes shrunk, one thread (the
# machine that runs the suite has 2 busy cores), no progress bars or plots.
EXTRA_FLAGS = {
    "quantize": ["--n-samples", "8", "--seq-len", "64", "--threads", "1"],
    "learn-scales": ["--n-samples", "8", "--seq-len", "64", "--batch-size", "2", "--threads", "1"],
    "train": ["--batch-size", "2", "--seq-len", "32", "--warmup-steps", "1", "--eval-batches", "1",
              "--no-progress", "--no-plot", "--threads", "1"],
    "eval ppl": ["--max-tokens", "2048", "--threads", "1"],
}
# `--out DIR` is kept as written: DIR must be relative, and the command runs with the block's temporary
# directory as its working directory, so DIR lands there.
EXPECTED_FILES = {  # (subcommand) -> files under --out that must exist afterwards
    "quantize": ["config.json", "ptq_report.json", "blockscale_report.json"],
    "learn-scales": ["config.json", "lsq_report.json"],
    "train": ["ckpt.pt", "metrics.jsonl"],
}
NOT_RUN = {
    "vllm": "vLLM is not a dependency and needs a GPU; the checkpoint's config is checked here instead "
            "(compressed-tensors nvfp4-pack-quantized, what vLLM's compressed-tensors loader reads), its "
            "tensor names against vLLM's loader code in docs/formats.md / tests/ptq/test_moe_families.py, and "
            "transformers loads it in tests/export/test_export_transformers.py",
    "torchrun": "multi-process runs are covered by tests/train/test_fsdp.py, tests/lsq/test_lsq_distill.py and "
                "tests/ptq/test_ptq_torchrun.py; not repeated here",
}

FENCE = re.compile(r"^```(\w*)[ \t]*\n(.*?)^```[ \t]*$", re.M | re.S)


def _fenced_blocks() -> list[tuple[str, str]]:
    return [(m.group(1), m.group(2)) for m in FENCE.finditer(README.read_text())]


def _blocks(lang: str) -> list[str]:
    return [body for kind, body in _fenced_blocks() if kind == lang]


def _commands(block: str) -> list[list[str]]:
    """The block's commands as argument lists (comments dropped, backslash continuations joined)."""
    text = re.sub(r"\\\n", " ", block)
    return [words for words in (shlex.split(line, comments=True) for line in text.splitlines()) if words]


def _makefile_targets() -> set[str]:
    return set(re.findall(r"^([A-Za-z0-9_-]+)\s*:(?!=)", (ROOT / "Makefile").read_text(), re.M))


def _subcommand(args: list[str]) -> str:
    return "eval ppl" if args[:2] == ["eval", "ppl"] else args[0]


def _substitute(args: list[str]) -> list[str]:
    """A README `blockscale` command's arguments (without `blockscale`) as run here."""
    sub = _subcommand(args)
    n_words = len(sub.split())
    out = list(args[:n_words])
    rest = args[n_words:]
    i = 0
    while i < len(rest):
        word = rest[i]
        if word in VALUE_SUBSTITUTES and i + 1 < len(rest):
            out += [word, VALUE_SUBSTITUTES[word]]
            i += 2
            continue
        if word == "--out" and i + 1 < len(rest):
            assert not Path(rest[i + 1]).is_absolute(), f"README: --out {rest[i + 1]} should be relative"
        out.append(MODEL_SUBSTITUTES.get(word, word))
        i += 1
    return out + EXTRA_FLAGS.get(sub, [])


def _out_dir(args: list[str], cwd: Path) -> Path | None:
    return cwd / args[args.index("--out") + 1] if "--out" in args else None


def _run_blockscale(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    env = dict(os.environ, BLOCKSCALE_QUIET="1", OMP_NUM_THREADS="1")
    return subprocess.run([sys.executable, "-m", "blockscale.cli", *args], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def test_every_fenced_block_is_bash_or_python():
    kinds = [kind for kind, _ in _fenced_blocks()]
    assert kinds, "README.md has no code blocks"
    assert set(kinds) <= {"bash", "python"}, f"a README block this test does not run: {kinds}"
    assert _blocks("python") and len(_blocks("bash")) >= 4  # make + the three paths


def test_make_commands_name_makefile_targets():
    targets = _makefile_targets()
    text = README.read_text()
    named = [words[1] for block in _blocks("bash") for words in _commands(block) if words[0] == "make"]
    named += re.findall(r"`make ([A-Za-z0-9_-]+)", text)
    assert {"demo", "test"} <= set(named)
    assert set(named) <= targets, f"not a Makefile target: {set(named) - targets}"


def test_inline_blockscale_commands_name_subcommands():
    import argparse

    from blockscale import cli

    parser = cli.build_parser()
    subs = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction)).choices
    inline = set(re.findall(r"`blockscale ([a-z][a-z-]*)", README.read_text()))
    assert inline <= set(subs), f"README names no such subcommand: {inline - set(subs)}"


def test_every_bash_line_is_run_or_listed():
    known = {"blockscale", "make", *NOT_RUN}
    for block in _blocks("bash"):
        for words in _commands(block):
            assert words[0] in known, f"README command this test neither runs nor lists: {shlex.join(words)}"


def _path_blocks() -> list[str]:
    return [b for b in _blocks("bash") if any(w[0] == "blockscale" for w in _commands(b))]


@pytest.mark.parametrize("index", range(3))
def test_bash_block_runs(index, tmp_path):
    blocks = _path_blocks()
    assert len(blocks) == 3, "the README's three paths changed: update this test's parametrization"
    for words in _commands(blocks[index]):
        if words[0] != "blockscale":
            continue  # make / NOT_RUN: checked by the tests above
        args = _substitute(words[1:])
        proc = _run_blockscale(args, tmp_path)
        shown = shlex.join(["blockscale", *args])
        assert proc.returncode == 0, f"{shown}\nexit {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}"
        sub = _subcommand(args)
        out = _out_dir(args, tmp_path)
        for name in EXPECTED_FILES.get(sub, []):
            assert (out / name).is_file(), f"{shown}: no {name} in {out}"
        if sub in ("quantize", "learn-scales"):
            assert list(out.glob("*.safetensors")), f"{shown}: no safetensors in {out}"
            qcfg = json.loads((out / "config.json").read_text())["quantization_config"]
            # what vLLM / transformers read to pick their compressed-tensors NVFP4 loader
            assert qcfg["quant_method"] == "compressed-tensors" and qcfg["format"] == "nvfp4-pack-quantized"
        if sub == "learn-scales":
            assert json.loads((out / "lsq_report.json").read_text())["distill"]["steps"] == 2
            assert out.with_name(out.name + ".train").is_dir()
        if sub == "train":
            last = json.loads((out / "metrics.jsonl").read_text().splitlines()[-1])
            assert last["step"] == 2
        if sub == "eval ppl":
            m = re.search(r": ppl (\S+)", proc.stdout)
            assert m and math.isfinite(float(m.group(1))), proc.stdout


def test_python_blocks_run():
    claim = re.compile(r"^(?P<expr>[A-Za-z_][\w.]*)\s+#\s*(?P<dtype>\w+) \[(?P<shape>\d+(?:, \d+)*)\]", re.M)
    checked = 0
    for block in _blocks("python"):
        ns: dict = {}
        exec(compile(block, str(README), "exec"), ns)  # noqa: S102 - the README's own example
        for m in claim.finditer(block):
            value = eval(m.group("expr"), ns)  # noqa: S307
            assert isinstance(value, torch.Tensor), m.group(0)
            assert value.dtype == getattr(torch, m.group("dtype")), m.group(0)
            assert list(value.shape) == [int(x) for x in m.group("shape").split(", ")], m.group(0)
            checked += 1
    assert checked >= 2  # q.codes and q.scales


def _links(path: Path) -> list[str]:
    return [t for t in re.findall(r"\]\(([^)#\s]+)(?:#[^)]*)?\)", path.read_text()) if "://" not in t]


@pytest.mark.parametrize("page", [README, INDEX], ids=["README", "docs-index"])
def test_relative_links_exist(page):
    missing = [t for t in _links(page) if not (page.parent / t).exists()]
    assert not missing, f"{page.name}: broken links {missing}"


def test_docs_index_lists_every_doc():
    listed = {(INDEX.parent / t).resolve() for t in _links(INDEX)}
    files = [p for p in (ROOT / "docs").iterdir() if p.is_file() and p != INDEX]
    files += [p for p in (ROOT / "docs" / "results").iterdir() if p.is_file()]
    missing = sorted(str(p.relative_to(ROOT)) for p in files if p.resolve() not in listed)
    assert not missing, f"docs/index.md does not list {missing}"
