"""Our MoE ``Llama`` as a transformers ``MixtralForCausalLM`` (in memory, or saved as a directory that
``from_pretrained``, ``blockscale quantize`` and ``blockscale eval ppl`` open like any hub model).

    hf = to_hf_mixtral(model)                                   # fp32, eval mode, weights copied
    save_hf_mixtral(model, "runs/moe-hf", tokenizer="tok512")   # config.json, model.safetensors, tokenizer

The mapping (ours -> transformers), per block i:

    tok_embeddings / norm / output              model.embed_tokens / model.norm / lm_head
    layers.i.attention.wq / wk                  self_attn.q_proj / k_proj, rows permuted from RoPE's
                                                interleaved pairs to halves (``rope_interleaved``)
    layers.i.attention.wv / wo                  self_attn.v_proj / o_proj
    layers.i.attention_norm / ffn_norm          input_layernorm / post_attention_layernorm
    layers.i.feed_forward.router.weight [E, d]  mlp.gate.weight (MixtralTopKRouter)
    layers.i.feed_forward.experts.w1, w3        mlp.experts.gate_up_proj[e] = cat(w1[e], w3[e]) [E, 2I, d]
    layers.i.feed_forward.experts.w2            mlp.experts.down_proj [E, d, I]

The two forwards are the same function: RMSNorm in FP32, SwiGLU experts, p = softmax(W_r x) in FP32,
top-k, the k weights renormalised to sum 1 (Mixtral always renormalises), y = sum_k g_k E_k(x). In FP32
the logits agree up to float rounding (RoPE angles: ours FP64 then rounded, transformers' FP32; the
expert sums in another order): max |difference| ~1e-7 on unit-scale logits (the tests allow 1e-5), the
routing decisions equal (except on exact ties of two router probabilities). Not representable in
Mixtral, refused with a UsageError naming the field: a dense model (``to_hf_llama``), ``moe_every != 1``
(dense blocks between MoE blocks), ``shared_expert``, ``normalize_top_k=False``, expert-parallel layers
(collect the experts first). A model trained with a recipe is saved with its master (high-precision)
weights.

Tokenizer: a transformers tokenizer saved next to the weights, so loaders find it with
``AutoTokenizer.from_pretrained(dir)``: "tok512" (stories260K's BPE, ``stories260k.transformers_tokenizer``),
"bytes" (UTF-8 bytes, vocab 256: what ``blockscale train`` trains on, ``byte_transformers_tokenizer``), a
transformers tokenizer object, or None (weights only).
"""
from __future__ import annotations

import shutil
import tempfile
from pathlib import Path
from typing import Any, Union

import torch

from ..data.paths import data_root
from ..errors import UsageError
from ..nn.moe import MoE
from .hf import _permute_rope_rows as permute_rope_rows
from .llama import Llama
from .stories260k import load_tokenizer, transformers_tokenizer

TOKENIZERS = ("tok512", "bytes")


def check_mixtral_compatible(model: Llama) -> None:
    """Raise UsageError (naming the config field and the allowed value) when ``model`` has something a
    ``MixtralForCausalLM`` cannot represent."""
    if not isinstance(model, Llama):
        raise UsageError(f"to_hf_mixtral takes a blockscale Llama, got {type(model).__name__}")
    c = model.config
    if c.moe is None:
        raise UsageError("LlamaConfig.moe is None (a dense model): save it with models.hf.to_hf_llama, "
                         "not as a Mixtral")
    if c.moe_every != 1:
        raise UsageError(f"LlamaConfig.moe_every={c.moe_every}: Mixtral has an MoE block in every layer "
                         "(moe_every=1); a mix of dense and MoE blocks has no Mixtral equivalent")
    if c.moe.shared_expert:
        raise UsageError("MoEConfig.shared_expert=True: Mixtral has no shared expert (Qwen2-MoE / DeepSeek-V3 "
                         "do); only shared_expert=False saves as a Mixtral")
    if not c.moe.normalize_top_k:
        raise UsageError("MoEConfig.normalize_top_k=False: Mixtral always renormalises the top-k router "
                         "probabilities to sum 1; only normalize_top_k=True saves as a Mixtral")
    for i, layer in enumerate(model.layers):
        ff = layer.feed_forward
        if not isinstance(ff, MoE) or ff.experts.n_local != ff.experts.n_experts:
            raise UsageError(f"layers.{i}.feed_forward is a {type(ff).__name__} holding "
                             f"{getattr(getattr(ff, 'experts', None), 'n_local', '?')} of the experts: save the "
                             "model before to_expert_parallel (a Mixtral holds every expert in every layer)")


def mixtral_config(model: Llama):
    """The ``transformers.MixtralConfig`` of ``model`` (see ``check_mixtral_compatible``)."""
    from transformers import MixtralConfig

    check_mixtral_compatible(model)
    c = model.config
    return MixtralConfig(vocab_size=c.vocab_size, hidden_size=c.dim, intermediate_size=c.moe.d_ff or c.hidden_dim,
                         num_hidden_layers=c.n_layers, num_attention_heads=c.n_heads, num_key_value_heads=c.n_kv_heads,
                         head_dim=c.head_dim, max_position_embeddings=c.max_seq_len, rms_norm_eps=c.norm_eps,
                         rope_parameters={"rope_type": "default", "rope_theta": c.rope_theta},
                         tie_word_embeddings=c.tie_embeddings, num_local_experts=c.moe.n_experts,
                         num_experts_per_tok=c.moe.top_k, router_aux_loss_coef=float(c.moe.aux_loss_coef),
                         router_jitter_noise=0.0, sliding_window=None, hidden_act="silu", bos_token_id=1,
                         eos_token_id=2)


def mixtral_state_dict(model: Llama) -> dict[str, torch.Tensor]:
    """``model``'s weights under MixtralForCausalLM's names (new tensors; lm_head left out when tied)."""
    check_mixtral_compatible(model)
    c = model.config
    sd = {"model.embed_tokens.weight": model.tok_embeddings.weight, "model.norm.weight": model.norm.weight}
    if not c.tie_embeddings:
        sd["lm_head.weight"] = model.output.weight
    for i, layer in enumerate(model.layers):
        a, moe, p = layer.attention, layer.feed_forward, f"model.layers.{i}."
        wq, wk = a.wq.weight, a.wk.weight
        if c.rope_interleaved:
            wq, wk = permute_rope_rows(wq, c.n_heads), permute_rope_rows(wk, c.n_kv_heads)
        ex = moe.experts
        sd.update({p + "self_attn.q_proj.weight": wq, p + "self_attn.k_proj.weight": wk,
                   p + "self_attn.v_proj.weight": a.wv.weight, p + "self_attn.o_proj.weight": a.wo.weight,
                   p + "input_layernorm.weight": layer.attention_norm.weight,
                   p + "post_attention_layernorm.weight": layer.ffn_norm.weight,
                   p + "mlp.gate.weight": moe.router.weight,
                   p + "mlp.experts.gate_up_proj": torch.cat((ex.w1, ex.w3), dim=1),
                   p + "mlp.experts.down_proj": ex.w2})
    return {k: v.detach().float().clone() for k, v in sd.items()}


def to_hf_mixtral(model: Llama):
    """Our MoE ``Llama`` as a transformers ``MixtralForCausalLM`` (fp32, eval mode; weights copied).
    UsageError for what Mixtral cannot represent (``check_mixtral_compatible``)."""
    from transformers import MixtralForCausalLM

    cfg = mixtral_config(model)
    sd = mixtral_state_dict(model)
    hf = MixtralForCausalLM(cfg)
    missing, unexpected = hf.load_state_dict(sd, strict=False)
    missing = [k for k in missing if not (model.config.tie_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise RuntimeError(f"Llama -> Mixtral conversion: missing {missing}, unexpected {unexpected}")
    if model.config.tie_embeddings:
        hf.tie_weights()
    return hf.eval()


def byte_transformers_tokenizer():
    """UTF-8 bytes as a ``transformers.PreTrainedTokenizerFast``: ids 0..255 are the bytes (the tokens
    ``<0x00>`` .. ``<0xFF>``, reached by BPE byte fallback: no merges), no BOS / EOS / normalizer; encode
    equals ``data.tokenizer.ByteTokenizer``'s for any text, decode is lossless on valid UTF-8."""
    from tokenizers import Tokenizer as RawTokenizer
    from tokenizers import decoders, models
    from transformers import PreTrainedTokenizerFast

    vocab = {f"<0x{b:02X}>": b for b in range(256)}
    raw = RawTokenizer(models.BPE(vocab=vocab, merges=[], byte_fallback=True, fuse_unk=False))
    raw.decoder = decoders.Sequence([decoders.ByteFallback(), decoders.Fuse()])
    return PreTrainedTokenizerFast(tokenizer_object=raw, clean_up_tokenization_spaces=False)


def resolve_tokenizer(tokenizer: Union[str, Any, None]):
    """A transformers tokenizer from "tok512" / "bytes" / a tokenizer object (returned as is) / None."""
    if tokenizer is None or not isinstance(tokenizer, str):
        return tokenizer
    if tokenizer == "tok512":
        return transformers_tokenizer(load_tokenizer(data_root() / "stories260K" / "tok512.bin"))
    if tokenizer == "bytes":
        return byte_transformers_tokenizer()
    raise UsageError(f"tokenizer={tokenizer!r}: allowed values: {', '.join(map(repr, TOKENIZERS))}, a transformers "
                     "tokenizer or None")


def check_destination(out: Path, overwrite: bool) -> None:
    """UsageError unless ``out`` is absent, an empty directory, or (``overwrite``) a model directory."""
    if not out.exists():
        return
    if not out.is_dir():
        raise UsageError(f"{out} exists and is not a directory")
    if not any(out.iterdir()):
        return
    if not overwrite:
        raise UsageError(f"{out} exists and is not empty: pass overwrite=True (--overwrite) to replace a model "
                         "directory")
    if not (out / "config.json").is_file():
        raise UsageError(f"{out} holds no config.json: not a model directory, so it is never replaced (choose "
                         "another directory)")


def save_hf_mixtral(model: Llama, out: Union[str, Path], tokenizer: Union[str, Any, None] = None,
                    overwrite: bool = False) -> Path:
    """Write ``to_hf_mixtral(model)`` to directory ``out`` with ``save_pretrained`` (config.json,
    model.safetensors) and the tokenizer (see ``resolve_tokenizer``; its vocabulary must fit the model's).
    ``out`` must be absent or empty, or (with ``overwrite``) a model directory (it holds a config.json),
    which is replaced. Written to a temporary sibling directory first and renamed, so ``out`` is never
    half-written.
    Returns ``out``."""
    out = Path(out)
    check_destination(out, overwrite)
    hf = to_hf_mixtral(model)
    tok = resolve_tokenizer(tokenizer)
    if tok is not None and len(tok) > model.config.vocab_size:
        raise UsageError(f"the tokenizer has {len(tok)} tokens but the model's vocabulary is "
                         f"{model.config.vocab_size}: it does not belong to this model")
    if tok is not None:
        hf.config.bos_token_id, hf.config.eos_token_id = tok.bos_token_id, tok.eos_token_id
        hf.generation_config.bos_token_id, hf.generation_config.eos_token_id = tok.bos_token_id, tok.eos_token_id
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    try:
        hf.save_pretrained(tmp)
        if tok is not None:
            tok.save_pretrained(tmp)
        if out.exists():
            shutil.rmtree(out)
        tmp.rename(out)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp)
    return out


__all__ = ["TOKENIZERS", "byte_transformers_tokenizer", "check_destination", "check_mixtral_compatible",
           "mixtral_config", "mixtral_state_dict", "resolve_tokenizer", "save_hf_mixtral", "to_hf_mixtral"]
