"""A tiny Llama written as a GGUF file with the ``gguf`` package (what llama.cpp's converter writes: q / k rows
permuted, 2-D weights Q8_0, norms and the embeddings F32, a SentencePiece-style vocabulary), for streaming tests."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

V, H, I, NH, NKV = 128, 64, 128, 4, 2


def _permute(x: np.ndarray, n_head: int) -> np.ndarray:
    """llama.cpp's q / k row permutation (transformers' LlamaTensorProcessor reverses it)."""
    return x.reshape(n_head, 2, x.shape[0] // n_head // 2, *x.shape[1:]).swapaxes(1, 2).reshape(x.shape)


def _names(layers: int) -> dict:
    out = {"model.embed_tokens.weight": "token_embd.weight", "model.norm.weight": "output_norm.weight",
           "lm_head.weight": "output.weight"}
    leaves = {"input_layernorm": "attn_norm", "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k",
              "self_attn.v_proj": "attn_v", "self_attn.o_proj": "attn_output", "post_attention_layernorm": "ffn_norm",
              "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up", "mlp.down_proj": "ffn_down"}
    for i in range(layers):
        out.update({f"model.layers.{i}.{hf}.weight": f"blk.{i}.{g}.weight" for hf, g in leaves.items()})
    return out


def write_tiny_llama_gguf(path: Path, layers: int = 3, seed: int = 0):
    """Write the GGUF; returns the transformers model it was made from (weights before Q8_0)."""
    import gguf
    import transformers

    cfg = transformers.LlamaConfig(vocab_size=V, hidden_size=H, intermediate_size=I, num_hidden_layers=layers,
                                   num_attention_heads=NH, num_key_value_heads=NKV, max_position_embeddings=128,
                                   tie_word_embeddings=False, rms_norm_eps=1e-5, rope_theta=10000.0)
    torch.manual_seed(seed)
    model = transformers.AutoModelForCausalLM.from_config(cfg).eval()
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_name("tiny-llama")
    w.add_context_length(128)
    w.add_embedding_length(H)
    w.add_feed_forward_length(I)
    w.add_block_count(layers)
    w.add_head_count(NH)
    w.add_head_count_kv(NKV)
    w.add_rope_freq_base(10000.0)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_vocab_size(V)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_Q8_0)
    w.add_tokenizer_model("llama")
    w.add_token_list([f"<{i}>" for i in range(V)])
    w.add_token_scores([0.0] * V)
    w.add_token_types([gguf.TokenType.NORMAL] * V)
    w.add_bos_token_id(1)
    w.add_eos_token_id(2)
    w.add_unk_token_id(0)
    state = {k: v.detach().numpy().astype(np.float32) for k, v in model.state_dict().items()}
    for hf, name in _names(layers).items():
        x = state[hf]
        if ".attn_q." in name:
            x = _permute(x, NH)
        elif ".attn_k." in name:
            x = _permute(x, NKV)
        if x.ndim == 2 and name != "token_embd.weight":
            q = gguf.quants.quantize(x, gguf.GGMLQuantizationType.Q8_0)
            w.add_tensor(name, q, raw_shape=q.shape, raw_dtype=gguf.GGMLQuantizationType.Q8_0)
        else:
            w.add_tensor(name, np.ascontiguousarray(x))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return model


def write_gguf_header(path: Path, arch: str) -> None:
    """A GGUF file with only ``general.architecture`` (for the refusal of architectures not streamed)."""
    import gguf

    w = gguf.GGUFWriter(str(path), arch)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
