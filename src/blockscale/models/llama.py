"""A small Llama-style decoder in one file: RMSNorm, RoPE, grouped-query attention, SwiGLU.

Every projection is a plain ``nn.Linear(bias=False)`` in PyTorch layout ([out, in]) under a stable
name, so a recipe can later swap Linear modules by name:

    tok_embeddings                      nn.Embedding [vocab, dim]
    layers.{i}.attention_norm           RMSNorm
    layers.{i}.attention.wq / wk / wv / wo
    layers.{i}.ffn_norm                 RMSNorm
    layers.{i}.feed_forward.w1 / w2 / w3
    norm                                final RMSNorm
    output                              nn.Linear [vocab, dim] (weight tied to tok_embeddings if asked)

These are the names llama2.c uses, so its checkpoints map one to one (see ``stories260k.py``).

With ``LlamaConfig.moe`` set, the blocks that use it hold a ``blockscale.nn.MoE`` as their
``feed_forward`` instead:

    layers.{i}.feed_forward.router                      Router, weight [n_experts, dim] (never quantized)
    layers.{i}.feed_forward.experts.w1 / w3 / w2        stacked [n_experts, d_ff, dim] / [n_experts, dim, d_ff]
    layers.{i}.feed_forward.shared_expert.w1 / w2 / w3  nn.Linear (only with MoEConfig.shared_expert)

and the training loss adds their load-balancing losses (see ``Llama.forward``).
"""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Optional

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..nn.moe import MoE, MoEConfig


@dataclass(frozen=True)
class LlamaConfig:
    """Model shape. ``hidden_dim=None`` takes Llama's rule: 2/3 of 4*dim, rounded up to ``multiple_of``.

    rope_interleaved: True rotates adjacent pairs (x0,x1),(x2,x3),... (llama2.c, Meta's original
      code); False rotates the halves (x_i, x_{i+d/2}) (Hugging Face). The two are the same model up
      to a permutation of the rows of wq and wk within each head.
    moe: None (dense SwiGLU everywhere) or a MoEConfig (a dict is converted); its d_ff=0 means
      hidden_dim. moe_every: block i uses MoE when i % moe_every == moe_every - 1 (1: every block,
      2: every second block starting with block 1).
    """

    dim: int = 256
    n_layers: int = 6
    n_heads: int = 8
    n_kv_heads: Optional[int] = None  # None: n_heads (plain multi-head attention)
    vocab_size: int = 512
    hidden_dim: Optional[int] = None
    multiple_of: int = 32
    max_seq_len: int = 256
    norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    rope_interleaved: bool = True
    tie_embeddings: bool = True
    moe: Optional[MoEConfig] = None
    moe_every: int = 1

    def __post_init__(self):
        # frozen dataclass: fill the derived defaults through object.__setattr__
        if self.n_kv_heads is None:
            object.__setattr__(self, "n_kv_heads", self.n_heads)
        if self.hidden_dim is None:
            hidden = int(2 * (4 * self.dim) / 3)
            object.__setattr__(self, "hidden_dim", self.multiple_of * math.ceil(hidden / self.multiple_of))
        for name in ("dim", "n_layers", "n_heads", "n_kv_heads", "vocab_size", "hidden_dim", "multiple_of",
                     "max_seq_len"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"LlamaConfig.{name}={value!r}: expected a positive int")
        if self.dim % self.n_heads:
            raise ValueError(f"dim={self.dim} is not a multiple of n_heads={self.n_heads}")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_heads={self.n_heads} is not a multiple of n_kv_heads={self.n_kv_heads}")
        if self.head_dim % 2:
            raise ValueError(f"head_dim={self.head_dim} must be even for RoPE")
        if isinstance(self.moe, dict):
            object.__setattr__(self, "moe", MoEConfig(**self.moe))
        if self.moe is not None and not isinstance(self.moe, MoEConfig):
            raise ValueError(f"LlamaConfig.moe={self.moe!r}: expected None or a MoEConfig")
        if isinstance(self.moe_every, bool) or not isinstance(self.moe_every, int) or self.moe_every <= 0:
            raise ValueError(f"LlamaConfig.moe_every={self.moe_every!r}: expected a positive int")
        if self.moe is not None and self.moe_every > self.n_layers:
            raise ValueError(f"LlamaConfig.moe_every={self.moe_every} > n_layers={self.n_layers}: "
                             "no block would use MoE")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def uses_moe(self, layer: int) -> bool:
        """Whether block ``layer`` has an MoE feed-forward."""
        return self.moe is not None and layer % self.moe_every == self.moe_every - 1


PRESETS: dict[str, LlamaConfig] = {
    # unit tests: ~27K parameters, byte-level vocabulary
    "tiny": LlamaConfig(dim=32, n_layers=2, n_heads=4, n_kv_heads=2, vocab_size=256, hidden_dim=64,
                        max_seq_len=64),
    # CPU pretraining comparisons (~4.5M parameters, tok512 vocabulary): minutes, not hours
    "small": LlamaConfig(dim=256, n_layers=6, n_heads=8, n_kv_heads=4, vocab_size=512, hidden_dim=688,
                         max_seq_len=256),
    # the shape of Karpathy's stories260K (load the real weights with load_stories260k)
    "stories260k": LlamaConfig(dim=64, n_layers=5, n_heads=8, n_kv_heads=4, vocab_size=512, multiple_of=4,
                               max_seq_len=512),
}
# MoE variants: every block's FFN becomes 8 experts of the dense FFN's size, top-2 routing
# ("small-moe": ~27M parameters, ~2x the dense FFN compute per token)
PRESETS["tiny-moe"] = dataclasses.replace(PRESETS["tiny"], moe=MoEConfig(n_experts=8, top_k=2))
PRESETS["small-moe"] = dataclasses.replace(PRESETS["small"], moe=MoEConfig(n_experts=8, top_k=2))


class RMSNorm(nn.Module):
    """y = x / sqrt(mean(x^2) + eps) * weight, computed in fp32 whatever the input dtype."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        xf = x.float()
        xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + self.eps)
        return (xf * self.weight.float()).to(x.dtype)


def rope_tables(head_dim: int, seq_len: int, theta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin of angle t * theta^(-2i/head_dim) for positions t < seq_len, pairs i < head_dim/2: [T, head_dim/2]."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)
    angles = torch.outer(torch.arange(seq_len, dtype=torch.float64), inv_freq)
    return angles.cos().float(), angles.sin().float()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """Rotate each pair (a, b) of x [B, H, T, head_dim] by its angle: (a cos - b sin, a sin + b cos).

    interleaved pairs elements (2i, 2i+1); otherwise (i, i + head_dim/2). cos, sin: [T, head_dim/2].
    """
    xf = x.float()
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
    else:
        a, b = xf.chunk(2, dim=-1)
    ra, rb = a * cos - b * sin, a * sin + b * cos
    out = torch.stack((ra, rb), dim=-1).flatten(-2) if interleaved else torch.cat((ra, rb), dim=-1)
    return out.to(x.dtype)


class Attention(nn.Module):
    """Causal grouped-query attention: n_heads query heads share n_kv_heads key/value heads."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        self.interleaved = cfg.rope_interleaved
        self.wq = nn.Linear(cfg.dim, cfg.n_heads * cfg.head_dim, bias=False)
        self.wk = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wv = nn.Linear(cfg.dim, cfg.n_kv_heads * cfg.head_dim, bias=False)
        self.wo = nn.Linear(cfg.n_heads * cfg.head_dim, cfg.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.wq(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(B, T, self.n_kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_rope(q, cos, sin, self.interleaved), apply_rope(k, cos, sin, self.interleaved)
        # query head h reads kv head h // (n_heads / n_kv_heads), as in llama2.c's repeat_kv;
        # expanded explicitly rather than with SDPA's enable_gqa so torch < 2.5 works too
        rep = self.n_heads // self.n_kv_heads
        if rep > 1:
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


class FeedForward(nn.Module):
    """SwiGLU: w2(silu(w1 x) * w3 x)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.w1 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)
        self.w2 = nn.Linear(cfg.hidden_dim, cfg.dim, bias=False)
        self.w3 = nn.Linear(cfg.dim, cfg.hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    """Pre-norm residual block: h = x + attn(norm(x)); out = h + ffn(norm(h)).

    ffn: SwiGLU FeedForward, or MoE when ``cfg.uses_moe(layer_id)``."""

    def __init__(self, cfg: LlamaConfig, layer_id: int = 0):
        super().__init__()
        self.attention_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.attention = Attention(cfg)
        self.ffn_norm = RMSNorm(cfg.dim, cfg.norm_eps)
        self.feed_forward = MoE(cfg.dim, cfg.hidden_dim, cfg.moe) if cfg.uses_moe(layer_id) else FeedForward(cfg)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        h = x + self.attention(self.attention_norm(x), cos, sin)
        return h + self.feed_forward(self.ffn_norm(h))


class Llama(nn.Module):
    """Decoder-only Llama. ``model(idx)`` -> logits [B, T, vocab]; ``model(idx, targets)`` -> (logits, loss)."""

    def __init__(self, config: LlamaConfig, seed: Optional[int] = None):
        super().__init__()
        self.config = config
        self.tok_embeddings = nn.Embedding(config.vocab_size, config.dim)
        self.layers = nn.ModuleList(TransformerBlock(config, i) for i in range(config.n_layers))
        self.norm = RMSNorm(config.dim, config.norm_eps)
        self.output = nn.Linear(config.dim, config.vocab_size, bias=False)
        if config.tie_embeddings:
            self.output.weight = self.tok_embeddings.weight  # one Parameter, two uses
        # RoPE tables are derived, not learned: non-persistent buffers stay out of the state dict
        cos, sin = rope_tables(config.head_dim, config.max_seq_len, config.rope_theta)
        self.register_buffer("rope_cos", cos, persistent=False)
        self.register_buffer("rope_sin", sin, persistent=False)
        self.init_weights(seed)

    @torch.no_grad()
    def init_weights(self, seed: Optional[int] = None) -> None:
        """Normal(0, 0.02) for embeddings and projections (MoE routers and stacked experts too); the
        projections that write into the residual stream (wo, w2, experts' w2) get std
        0.02/sqrt(2*n_layers) so the stream's variance does not grow with depth (GPT-2). Norm
        weights = 1. ``seed`` makes it reproducible without touching the global RNG; None draws
        from the global RNG. (``initial_values``: the same values one tensor at a time.)"""
        self.init_seed = seed
        if next(self.parameters()).device.type == "meta":
            return  # built on the meta device: the values come later, shard by shard (train.fsdp_source)
        params = dict(self.named_parameters())
        for name, value in self.initial_values():
            params[name].copy_(value)

    def initial_values(self):
        """(name, initial CPU FP32 tensor) of every parameter in ``named_parameters`` order, drawn one at a time
        with the seed of the last ``init_weights`` (the model's construction), as ``init_weights`` draws them."""
        seed = self.init_seed
        gen = None if seed is None else torch.Generator().manual_seed(seed)
        std = 0.02
        for name, p in self.named_parameters():
            if p.dim() == 1:  # RMSNorm gains
                yield name, torch.ones(p.shape)
                continue
            residual = name.endswith(("wo.weight", "w2.weight", "experts.w2"))
            s = std / math.sqrt(2 * self.config.n_layers) if residual else std
            # draw on CPU in fp32 so a seed gives the same weights on every device and dtype
            yield name, torch.randn(p.shape, generator=gen) * s

    def reset_buffers(self, device=None) -> None:
        """The RoPE tables (derived, not learned) computed again, on ``device`` (a model built on the meta device)."""
        cos, sin = rope_tables(self.config.head_dim, self.config.max_seq_len, self.config.rope_theta)
        self.rope_cos, self.rope_sin = cos.to(device), sin.to(device)

    def num_params(self, exclude_embeddings: bool = False) -> int:
        """Number of distinct parameters (a tied embedding counts once)."""
        n = sum(p.numel() for p in self.parameters())
        if exclude_embeddings:
            n -= self.tok_embeddings.weight.numel()
        return n

    def forward(self, idx: torch.Tensor, targets: Optional[torch.Tensor] = None):
        """idx, targets: long [B, T] with T <= max_seq_len. loss = mean cross-entropy over targets != -1.

        With MoE blocks, in training mode the loss also includes the sum of their load-balancing
        losses (``MoE.aux_loss``); in eval mode it is the plain cross-entropy, so validation losses
        and perplexities compare with dense models."""
        B, T = idx.shape
        if T > self.config.max_seq_len:
            raise ValueError(f"sequence length {T} exceeds max_seq_len={self.config.max_seq_len}")
        h = self.tok_embeddings(idx)
        cos, sin = self.rope_cos[:T], self.rope_sin[:T]
        for layer in self.layers:
            h = layer(h, cos, sin)
        logits = self.output(self.norm(h))
        if targets is None:
            return logits
        loss = F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1), ignore_index=-1)
        if self.training and self.config.moe is not None:
            # MoE or its expert-parallel form: anything that left an aux_loss
            loss = loss + sum(layer.feed_forward.aux_loss for layer in self.layers
                              if getattr(layer.feed_forward, "aux_loss", None) is not None)
        return logits, loss

    @torch.no_grad()
    def generate(self, idx: torch.Tensor, max_new_tokens: int, temperature: float = 0.0,
                 generator: Optional[torch.Generator] = None) -> torch.Tensor:
        """Append max_new_tokens to idx [B, T]: argmax at temperature 0, else sample softmax(logits / T).

        No KV cache: each step reruns the (cropped to max_seq_len) context, fine for small models.
        """
        for _ in range(max_new_tokens):
            logits = self(idx[:, -self.config.max_seq_len:])[:, -1, :].float()
            if temperature == 0.0:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                probs = F.softmax(logits / temperature, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            idx = torch.cat((idx, nxt), dim=1)
        return idx
