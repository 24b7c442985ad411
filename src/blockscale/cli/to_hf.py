"""``blockscale to-hf CHECKPOINT --out DIR``: a ``blockscale train`` checkpoint of an MoE Llama as a transformers
Mixtral directory (``models.hf_moe_export.save_hf_mixtral``), which ``blockscale quantize DIR`` and
``blockscale eval ppl DIR`` then open like any local transformers model.

The tokenizer saved next to the weights (``--tokenizer``): ``auto`` takes the one the checkpoint's run
record names (``record["tokenizer"]``: "bytes" or "tok512"), else ``bytes`` for a 256-token vocabulary
(``blockscale train`` tokenizes UTF-8 bytes), else none (weights only: RTN W4A16 still quantizes it).
"""
from __future__ import annotations

from pathlib import Path

from .checks import check_run_dir
from .common import add_common, setup
from .reporting import warn
from ..errors import UsageError

TOKENIZER_CHOICES = ("auto", "bytes", "tok512", "none")


def llama_from_training_checkpoint(path):
    """(Llama in eval mode, run record) of a ``blockscale train`` checkpoint (ckpt.pt or its run folder). The
    checkpoint must record the model config (``blockscale train`` does; in Python pass
    ``record={"model": dataclasses.asdict(model.config)}`` to ``train``). A model trained with a recipe is
    rebuilt with it, so its master weights load under their names."""
    from ..models.llama import Llama, LlamaConfig
    from ..train.checkpoint import CheckpointContents

    path = Path(path)
    if path.is_dir():
        path = path / "ckpt.pt"
    state = CheckpointContents().read(path)
    record = state.get("record") if isinstance(state.get("record"), dict) else {}
    cfg = record.get("model")
    if not isinstance(cfg, dict):
        raise UsageError(f"checkpoint {path} records no model config: it was not written by blockscale train (in "
                         "Python, pass record={'model': dataclasses.asdict(model.config)} to train)")
    try:
        model = Llama(LlamaConfig(**cfg))
    except (TypeError, ValueError) as exc:
        raise UsageError(f"checkpoint {path}: its recorded model config does not build a Llama ({exc})") from None
    if record.get("recipe") is not None:
        from ..nn import convert
        from ..recipes import recipe_from_dict

        convert(model, recipe_from_dict(record["recipe"]))
    model.load_state_dict(state["model"])
    return model.eval(), record


def choose_tokenizer(flag: str, record: dict, vocab_size: int):
    """The tokenizer name ``save_hf_mixtral`` gets for ``--tokenizer flag`` (None: weights only)."""
    if flag != "auto":
        return None if flag == "none" else flag
    recorded = record.get("tokenizer")
    if recorded in ("bytes", "tok512"):
        return recorded
    return "bytes" if vocab_size == 256 else None


def _cmd_to_hf(args) -> int:
    from ..models.hf_moe_export import save_hf_mixtral

    setup(args)
    src = Path(args.checkpoint)
    if not src.exists():
        raise UsageError(f"CHECKPOINT {src}: does not exist (a ckpt.pt file or the run folder holding it)")
    out = check_run_dir(args.out, "--out")
    ckpt_dir = (src if src.is_dir() else src.parent).resolve()
    if out.resolve() == ckpt_dir or ckpt_dir.is_relative_to(out.resolve()):
        raise UsageError(f"--out {args.out} is or contains the run folder being read ({ckpt_dir}); choose another "
                         "directory")
    model, record = llama_from_training_checkpoint(src)
    tok = choose_tokenizer(args.tokenizer, record, model.config.vocab_size)
    if tok is None:
        warn("blockscale to-hf", f"no tokenizer saved (vocabulary {model.config.vocab_size}, none recorded): pass "
                                 "--tokenizer tok512 or bytes for quantize / eval ppl to encode text")
    path = save_hf_mixtral(model, out, tokenizer=tok, overwrite=args.overwrite)
    c = model.config
    note = " (trained with a recipe: its master weights, unquantized)" if record.get("recipe") is not None else ""
    print(f"wrote a transformers Mixtral ({c.n_layers} layers, {c.moe.n_experts} experts, top-{c.moe.top_k}, "
          f"vocabulary {c.vocab_size}, tokenizer {tok or 'none'}){note} to {path}")
    return 0


def add_to_hf(sub) -> None:
    p = sub.add_parser("to-hf", help="save a blockscale train checkpoint of an MoE Llama as a transformers Mixtral "
                                     "directory (then: blockscale quantize DIR, blockscale eval ppl DIR)")
    p.add_argument("checkpoint", help="a blockscale train checkpoint: ckpt.pt or the run folder holding it")
    p.add_argument("--out", required=True, help="output directory (config.json, model.safetensors, tokenizer)")
    p.add_argument("--tokenizer", default="auto", choices=TOKENIZER_CHOICES,
                   help="tokenizer saved with the weights: auto (the run's recorded one, else bytes for a 256-token "
                        "vocabulary, else none), bytes (UTF-8, what blockscale train uses), tok512 (stories260K's "
                        "BPE), none")
    p.add_argument("--overwrite", action="store_true", help="replace --out if it is a model directory (config.json)")
    add_common(p)
    p.set_defaults(func=_cmd_to_hf)


__all__ = ["TOKENIZER_CHOICES", "add_to_hf", "choose_tokenizer", "llama_from_training_checkpoint"]
