"""Reference models used by tests, examples, the demo and the benchmarks.

Both are plain ``nn.Module``s with deterministic initialisation from a seed, so every rank and
the single-process oracle build the same weights.

- :class:`MLP`: ``depth`` x (Linear(width, width) + GELU); the benchmarks' "MLP 16x1024".
- :class:`GPT`: a small GPT-style decoder (token + position embedding, pre-norm causal
  self-attention blocks, tied or untied LM head). The reference GPT of the benchmarks is
  :func:`reference_gpt_config`: vocab 8192, 6 layers, d 512, seq 128 (~25M parameters).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

__all__ = ["MLP", "GPT", "GPTConfig", "Block", "reference_gpt_config", "synthetic_batch"]


class MLP(nn.Sequential):
    """``depth`` blocks of Linear(width, width) + GELU, then an optional Linear to ``out``."""

    def __init__(self, width: int = 64, depth: int = 4, out: int | None = None, seed: int = 0):
        layers: list[nn.Module] = []
        for _ in range(depth):
            layers += [nn.Linear(width, width), nn.GELU()]
        if out is not None:
            layers.append(nn.Linear(width, out))
        super().__init__(*layers)
        _seeded_init(self, seed)


@dataclass(frozen=True)
class GPTConfig:
    """Shape of a :class:`GPT`."""

    vocab_size: int = 256
    n_layer: int = 2
    n_head: int = 4
    d_model: int = 64
    seq_len: int = 32
    dropout: float = 0.0
    tie_weights: bool = False


def reference_gpt_config() -> GPTConfig:
    """The benchmarks' reference GPT: vocab 8192, 6 layers, d 512, 8 heads, seq 128 (~25M)."""
    return GPTConfig(vocab_size=8192, n_layer=6, n_head=8, d_model=512, seq_len=128)


class CausalSelfAttention(nn.Module):
    """Multi-head causal self-attention with one fused q/k/v projection."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        if cfg.d_model % cfg.n_head:
            raise ValueError(f"GPTConfig: d_model={cfg.d_model} is not divisible by "
                             f"n_head={cfg.n_head}")
        self.n_head = cfg.n_head
        self.qkv = nn.Linear(cfg.d_model, 3 * cfg.d_model)
        self.proj = nn.Linear(cfg.d_model, cfg.d_model)
        self.dropout = cfg.dropout

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True,
                                           dropout_p=self.dropout if self.training else 0.0)
        return self.proj(y.transpose(1, 2).reshape(b, t, c))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(ln(x)); x + mlp(ln(x)). The unit FSDP wraps."""

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln1 = nn.LayerNorm(cfg.d_model)
        self.attn = CausalSelfAttention(cfg)
        self.ln2 = nn.LayerNorm(cfg.d_model)
        self.fc = nn.Linear(cfg.d_model, 4 * cfg.d_model)
        self.out = nn.Linear(4 * cfg.d_model, cfg.d_model)
        self.drop = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.drop(self.out(F.gelu(self.fc(self.ln2(x)))))


class GPT(nn.Module):
    """A small GPT-style decoder. ``forward(idx)`` returns logits ``[batch, seq, vocab]``;
    ``loss(idx, target)`` the mean cross-entropy."""

    def __init__(self, cfg: GPTConfig = GPTConfig(), seed: int = 0):
        super().__init__()
        self.cfg = cfg
        self.tok_emb = nn.Embedding(cfg.vocab_size, cfg.d_model)
        self.pos_emb = nn.Embedding(cfg.seq_len, cfg.d_model)
        self.blocks = nn.ModuleList([Block(cfg) for _ in range(cfg.n_layer)])
        self.ln_f = nn.LayerNorm(cfg.d_model)
        self.head = nn.Linear(cfg.d_model, cfg.vocab_size, bias=False)
        _seeded_init(self, seed)
        if cfg.tie_weights:
            self.head.weight = self.tok_emb.weight

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        t = idx.shape[1]
        if t > self.cfg.seq_len:
            raise ValueError(f"GPT: sequence length {t} exceeds seq_len={self.cfg.seq_len}")
        pos = torch.arange(t, device=idx.device)
        x = self.tok_emb(idx) + self.pos_emb(pos)
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln_f(x))

    def loss(self, idx: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """Mean cross-entropy of ``forward(idx)``'s logits against ``target`` token ids
        (``[batch, seq]``), over all positions."""
        logits = self(idx)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), target.reshape(-1))


def _seeded_init(module: nn.Module, seed: int) -> None:
    """Re-initialise every parameter from a private generator: the same seed, the same weights."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in module.named_parameters():
            if p.dim() >= 2:
                std = 1.0 / math.sqrt(p.shape[1])
                p.copy_(torch.randn(p.shape, generator=gen) * std)
            elif name.endswith("bias"):
                p.zero_()
            else:  # LayerNorm weights
                p.fill_(1.0)


def synthetic_batch(cfg: GPTConfig, batch: int, step: int, seed: int = 1234):
    """A deterministic next-token task: each sequence counts up modulo the vocabulary from a
    random start, so the loss can fall well below log(vocab). Returns ``(idx, target)``."""
    gen = torch.Generator().manual_seed(seed + step)
    start = torch.randint(0, cfg.vocab_size, (batch, 1), generator=gen)
    stride = torch.randint(1, 4, (batch, 1), generator=gen)
    seq = (start + stride * torch.arange(cfg.seq_len + 1)) % cfg.vocab_size
    return seq[:, :-1].contiguous(), seq[:, 1:].contiguous()
