"""The package's shape, read from the source (docs/architecture.md states the same rules):

- each layer imports only from the layers below it (LAYERS, lowest first), or from its own package;
- no module imports a private (``_name``) function from a module of another package directory;
- no import circle between modules (imports inside functions count: they are circles deferred);
- no file over 500 lines;
- nothing inside the package imports the root package ``blockscale``.

Imports are read with ``ast`` (every ``import`` / ``from ... import`` statement, wherever it is).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest

import blockscale

SRC = Path(blockscale.__file__).parent
REPO = SRC.parent.parent
MAX_LINES = 500

# Lowest first. A module may import modules of a lower layer, and modules of its own top-level package.
# ``__main__`` modules (``python -m blockscale.X``) are command-line entry points: they sit with ``cli``.
LAYERS = ("version", "errors", "file_errors", "formats", "quant", "recipes", "nn", "data", "models",
          "eval", "train", "export", "ptq", "hf", "lsq", "cli")
RANK = {name: i for i, name in enumerate(LAYERS)}


def _modules() -> dict[str, tuple[Path, bool]]:
    """{dotted module name: (file, is a package __init__)} for every .py file in the package."""
    out = {}
    for path in sorted(SRC.rglob("*.py")):
        parts = list(path.relative_to(SRC.parent).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


MODULES = _modules()


def _imports(module: str) -> list[tuple[str, str | None, int]]:
    """(imported blockscale module, imported name or None, line) for each import in ``module``."""
    path, is_pkg = MODULES[module]
    here = module.split(".") if is_pkg else module.split(".")[:-1]
    out = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out += [(a.name, None, node.lineno) for a in node.names if a.name.split(".")[0] == "blockscale"]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = here[: len(here) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
                if target.split(".")[0] != "blockscale":
                    continue
            for a in node.names:
                sub = f"{target}.{a.name}"
                out.append((sub, None, node.lineno) if sub in MODULES else (target, a.name, node.lineno))
    return out


IMPORTS = {m: _imports(m) for m in MODULES}


def _layer(module: str) -> str:
    """The layer of a module: its top-level package, or the root file's name; __main__ is cli."""
    parts = module.split(".")
    if parts[-1] == "__main__":
        return "cli"
    if len(parts) == 1:
        return "<root>"
    return parts[1]


def test_version_is_pyproject_version():
    import tomllib

    from blockscale.version import __version__

    assert tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"] == __version__


def test_every_package_and_root_module_has_a_layer():
    unknown = sorted({_layer(m) for m in MODULES} - set(LAYERS) - {"<root>"})
    assert unknown == [], f"add these to LAYERS (and docs/architecture.md): {unknown}"
    root_files = sorted(m for m in MODULES if m.count(".") == 1 and not MODULES[m][1])
    assert root_files == ["blockscale.errors", "blockscale.file_errors", "blockscale.version"], \
        f"root leftovers belong in a package: {root_files}"


def test_layers_import_only_downward():
    bad = []
    for m, imps in IMPORTS.items():
        src = _layer(m)
        if src == "<root>":
            continue  # blockscale/__init__.py: the public API gathers every layer
        for target, _, line in imps:
            dst = _layer(target)
            if dst == src:
                continue
            if dst == "<root>" or RANK[dst] >= RANK[src]:
                bad.append(f"{MODULES[m][0].relative_to(SRC.parent)}:{line}: {src} imports {target} ({dst})")
    assert bad == [], "\n".join(bad)


def test_no_private_import_across_package_directories():
    bad = []
    for m, imps in IMPORTS.items():
        here = m if MODULES[m][1] else m.rsplit(".", 1)[0]
        for target, name, line in imps:
            private = (name or target.rsplit(".", 1)[-1]).startswith("_") and not (name or "").startswith("__")
            if name is None and target.rsplit(".", 1)[-1].startswith("__"):
                private = False
            there = target if (name is not None and MODULES.get(target, (None, False))[1]) else target.rsplit(".", 1)[0]
            if private and there != here:
                bad.append(f"{MODULES[m][0].relative_to(SRC.parent)}:{line}: imports {name or target} from {target}")
    assert bad == [], "\n".join(bad)


def _cycles() -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    graph = {m: sorted({t for t, _, _ in imps if t in MODULES and t != m}) for m, imps in IMPORTS.items()}
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]

    def visit(v):
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in graph:
        if v not in index:
            visit(v)
    return out


def test_no_import_circles():
    assert _cycles() == []


def test_the_cycle_finder_finds_a_circle(monkeypatch):
    """The check above can fail: a planted two-module circle is reported."""
    a, b = sorted(MODULES)[1:3]
    monkeypatch.setitem(IMPORTS, a, IMPORTS[a] + [(b, None, 0)])
    monkeypatch.setitem(IMPORTS, b, IMPORTS[b] + [(a, None, 0)])
    assert any({a, b} <= set(c) for c in _cycles())


def test_nothing_imports_the_root_package():
    bad = [f"{m}:{line}" for m, imps in IMPORTS.items() if m != "blockscale"
           for target, _, line in imps if target == "blockscale"]
    assert bad == []


@pytest.mark.parametrize("folder", ["src", "tests", "benchmarks", "experiments"])
def test_no_file_over_500_lines(folder):
    long = {str(p.relative_to(REPO)): n for p in sorted((REPO / folder).rglob("*.py"))
            if (n := len(p.read_text().splitlines())) > MAX_LINES}
    assert long == {}


def test_public_api_is_listed_and_importable():
    names = blockscale.__all__
    assert len(names) == len(set(names))
    missing = [n for n in names if not hasattr(blockscale, n)]
    assert missing == []
    public = {n for n in vars(blockscale) if not n.startswith("_")} - set(names)
    public -= {n for n in public if type(getattr(blockscale, n)).__name__ == "module"}
    assert public == set(), f"public names not in __all__: {sorted(public)}"


def test_root_names_do_not_shadow_subpackages():
    """``from .quant import formats`` at the root once replaced the ``blockscale.formats`` package."""
    import types

    for sub in ("formats", "quant", "recipes", "nn", "data", "models", "eval", "train", "export", "ptq", "hf", "lsq",
                "cli"):
        __import__(f"blockscale.{sub}")
        assert isinstance(getattr(blockscale, sub), types.ModuleType), sub


def _scheme_vocabularies() -> list[str]:
    """Literal tuples / lists / sets / dicts (keys) naming three or more quantization schemes, by file and line."""
    from blockscale.quant.schemes import SCHEME_TABLE

    names = {r.name for r in SCHEME_TABLE}
    found = []
    for module, (path, _) in MODULES.items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            items = node.keys if isinstance(node, ast.Dict) else node.elts if isinstance(
                node, (ast.Tuple, ast.List, ast.Set)) else []
            hits = {n.value for n in items if isinstance(n, ast.Constant) and n.value in names}
            if len(hits) >= 3:
                found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    return found


def test_one_scheme_table():
    """Schemes are rows of quant.schemes.SCHEME_TABLE: no other literal lists three or more scheme names
    (issue 30: SCHEME_NAMES with parallel tables, KINDS and MX_SCHEME_NAMES were three vocabularies)."""
    assert _scheme_vocabularies() == []


MAX_FUNCTION_LINES = 80


def _long_functions(limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Functions whose body (from the first statement after the docstring to the end) is over ``limit``
    lines; argparse builders (``add_*`` functions that only declare flags) aside."""
    found = []
    for path, _ in MODULES.values():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name.startswith("add_"):
                continue
            body = node.body[1:] if len(node.body) > 1 and isinstance(node.body[0], ast.Expr) and isinstance(
                node.body[0].value, ast.Constant) and isinstance(node.body[0].value.value, str) else node.body
            n = node.end_lineno - body[0].lineno + 1
            if n > limit:
                found.append(f"{path.relative_to(SRC)}:{node.lineno} {node.name} ({n} lines)")
    return found


def test_no_function_body_over_80_lines():
    """Issue 30: functions that did the whole workflow (quantize_streaming, the training loop's _run,
    cmd_learn_scales, awq_search, export_checkpoint, ...) are split into named steps."""
    assert _long_functions() == []


def test_the_length_rule_sees_a_long_function():
    assert any("(" in f for f in _long_functions(limit=60))


def _family_names() -> set[str]:
    from blockscale.quant.schemes import SCHEME_TABLE

    return {r.family for r in SCHEME_TABLE}


def _family_tests() -> list[str]:
    """Comparisons of a ``family`` / ``kind`` / ``fam`` value with a format family's name ("nvfp4", "fp8",
    "mx", "none") and uses of ``.is_nvfp4``, outside ``quant/`` (the format packages and the scheme table)."""
    families = _family_names()
    found = []
    for module, (path, _) in MODULES.items():
        if module.startswith("blockscale.quant"):
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and node.attr == "is_nvfp4" and isinstance(node.ctx, ast.Load):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}")
            if not isinstance(node, ast.Compare):
                continue
            sides = [node.left, *node.comparators]
            named = any(isinstance(s, ast.Attribute) and s.attr in ("family", "kind") or
                        isinstance(s, ast.Name) and s.id in ("family", "kind", "fam") for s in sides)
            consts = [c for s in sides for c in (s.elts if isinstance(s, (ast.Tuple, ast.Set, ast.List)) else [s])
                      if isinstance(c, ast.Constant)]
            if named and any(c.value in families for c in consts):
                found.append(f"{path.relative_to(SRC)}:{node.lineno}")
    return found


MAX_FAMILY_TESTS = 0  # (1 until the experts became one module: FP8 128x128 tiles now slice by Format.scale_rows)


def test_few_format_family_tests_outside_quant():
    """Issue 30: 77 such tests in 18 files before (by this rule); none now. Schemes are rows (quant.schemes), checkpoint codecs are
    matched per (checkpoint format, tensor format)."""
    found = _family_tests()
    assert len(found) <= MAX_FAMILY_TESTS, "\n".join(found)


def test_ruff():
    """The small rule set of pyproject.toml [tool.ruff.lint]: complexity, argument count, syntax errors,
    undefined names."""
    import shutil
    import subprocess
    import sys

    ruff = shutil.which("ruff") or str(Path(sys.executable).parent / "ruff")
    if not Path(ruff).exists():
        pytest.fail("ruff is not installed: pip install -e '.[test]'")
    p = subprocess.run([ruff, "check", "--no-cache", "--output-format", "concise", "src", "tests"], cwd=REPO,
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stdout + p.stderr
