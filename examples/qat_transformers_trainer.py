"""Quantization-aware fine-tuning with a plain transformers ``Trainer``, then a quantized checkpoint.

    python examples/qat_transformers_trainer.py --model stories260k --steps 20 --out runs/qat-trainer

1. ``bs.convert(model, recipe)`` swaps every Linear of a Hugging Face causal LM for a ``QuantizedLinear`` of a
   training recipe (``bs.list_recipes()``; "nvfp4-nvidia": NVFP4 forward GEMMs with 16x16 weight blocks, random
   Hadamard transforms and stochastic rounding of gradients, the last layers in bf16-like precision): the forward
   sees the quantization error, so fine-tuning learns around it.
2. A plain ``transformers.Trainer`` fine-tunes it for a few steps on a text (nothing blockscale-specific).
3. ``bs.unconvert`` gives plain Linears back (the trained weights), ``bs.quantize_model`` quantizes them with a
   PTQ recipe (``bs.list_ptq_recipes()``; RTN, no calibration; Linears whose inputs are not whole blocks stay in
   high precision) and ``bs.export_checkpoint`` writes the
   compressed-tensors checkpoint vLLM and transformers load; ``bs.load`` reads it back.

The same checkpoint comes from ``save_pretrained`` of the unconverted model and a reload through
``from_pretrained(dir, quantization_config=bs.BlockscaleConfig(recipe=...))`` (docs/transformers.md).
``main`` is what the script runs; ``tests/hf/test_hf_qat_example.py`` runs it on a tiny model.
"""
from __future__ import annotations

import argparse
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch
from torch import nn

import blockscale as bs

TEXT = ("Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her "
        "friends. One day, she saw a big red ball under a tree. She ran to get it, but a small dog got there first. "
        "The dog wagged its tail and dropped the ball at her feet. Lily laughed and threw the ball, and the dog ran "
        "after it. They played together until the sun went down, and then Lily went home happy. ")


class TokenWindows(torch.utils.data.Dataset):
    """Consecutive windows of ``seq_len`` token ids of ``ids`` (repeated to fill ``count`` windows), each an
    example ``{"input_ids", "labels"}``: a causal LM shifts the labels itself."""

    def __init__(self, ids: list[int], seq_len: int, count: int):
        need = seq_len * count
        ids = (ids * (need // max(len(ids), 1) + 1))[:need]
        self.windows = torch.tensor(ids, dtype=torch.long).view(count, seq_len)

    def __len__(self) -> int:
        return len(self.windows)

    def __getitem__(self, i: int) -> dict:
        return {"input_ids": self.windows[i], "labels": self.windows[i]}


@dataclass
class QATResult:
    losses: list[float]  # the training loss at each step (Trainer's log)
    checkpoint: Path  # the exported compressed-tensors checkpoint
    conversion: object  # what bs.convert did (bs.ConversionReport)


def fine_tune(model: nn.Module, data: TokenWindows, work_dir: Path, steps: int, batch_size: int, lr: float) -> list:
    """``steps`` optimizer steps of a plain transformers Trainer on ``data``; the per-step losses."""
    from transformers import Trainer, TrainingArguments

    args = TrainingArguments(output_dir=str(work_dir), max_steps=steps, per_device_train_batch_size=batch_size,
                             learning_rate=lr, warmup_steps=0, logging_steps=1, save_strategy="no", report_to="none",
                             use_cpu=not torch.cuda.is_available(), disable_tqdm=True, seed=0)
    trainer = Trainer(model=model, args=args, train_dataset=data)
    trainer.train()
    return [row["loss"] for row in trainer.state.log_history if "loss" in row]


def main(model: Union[str, nn.Module] = "stories260k", out: Union[str, Path] = "runs/qat-trainer", *,
         tokenizer=None, recipe: str = "nvfp4-nvidia", ptq_recipe: str = "nvfp4", text: str = TEXT, steps: int = 20,
         seq_len: int = 64, batch_size: int = 4, lr: float = 5e-4) -> QATResult:
    """Fine-tune ``model`` (a built-in name, a Hugging Face directory / hub name, or a transformers causal LM with
    ``tokenizer``: anything with ``encode(text) -> ids``) under the training ``recipe``, then export it quantized
    with ``ptq_recipe`` to ``out`` (replaced if it is a blockscale checkpoint)."""
    if isinstance(model, (str, Path)):
        from blockscale.models.hf import load_model

        loaded = load_model(str(model))
        model, tokenizer = loaded.model, loaded.tokenizer
    if tokenizer is None:
        raise ValueError("a model object needs its tokenizer (anything with encode(text) -> token ids)")
    out = Path(out)
    data = TokenWindows(list(tokenizer.encode(text)), seq_len, count=steps * batch_size)
    model.train()
    conversion = bs.convert(model, recipe)
    losses = fine_tune(model, data, out.parent / f".{out.name}-trainer", steps, batch_size, lr)
    bs.unconvert(model)
    model.eval()
    # (stories260K's down_proj has 172 inputs, not whole NVFP4 blocks of 16: kept in high precision, with a note)
    bs.quantize_model(model, bs.PTQConfig(recipe=ptq_recipe, skip_indivisible=True), progress=False)
    hf_tokenizer: Optional[object] = getattr(tokenizer, "hf", None)  # built-ins carry a transformers tokenizer
    bs.export_checkpoint(model, out, tokenizer=hf_tokenizer, overwrite=True)
    return QATResult(losses, out, conversion)


def cli() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--model", default="stories260k", help="built-in name, Hugging Face directory or hub name")
    p.add_argument("--recipe", default="nvfp4-nvidia", help=f"training recipe: {', '.join(bs.list_recipes())}")
    p.add_argument("--ptq-recipe", default="nvfp4", help=f"PTQ recipe: {', '.join(bs.list_ptq_recipes())}")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--seq-len", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=4)
    p.add_argument("--lr", type=float, default=5e-4)
    p.add_argument("--out", default="runs/qat-trainer")
    a = p.parse_args()
    result = main(a.model, a.out, recipe=a.recipe, ptq_recipe=a.ptq_recipe, steps=a.steps, seq_len=a.seq_len,
                  batch_size=a.batch_size, lr=a.lr)
    print(result.conversion)
    print("loss per step:", " ".join(f"{x:.3f}" for x in result.losses))
    assert all(math.isfinite(x) for x in result.losses)
    back = bs.load(result.checkpoint)
    print(f"wrote {result.checkpoint}; bs.load reads it back ({type(back).__name__})")


if __name__ == "__main__":
    cli()
