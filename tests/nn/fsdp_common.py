"""Shared helpers of the FSDP tests: a small tied GPT, the single-process oracle, training loops.

Every rank builds the same model from the same seed; the oracle trains the unwrapped model on
the global batch, each rank trains its FSDP shard on its slice of that batch.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from shardkit import distributed as skdist
from shardkit.models import GPT, Block, GPTConfig, synthetic_batch
from shardkit.models import CausalSelfAttention
from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP
from shardkit.nn.wrap import auto_wrap, enable_wrap, transformer_auto_wrap_policy
from tests.utils.compare import max_diff  # noqa: F401  (the FSDP tests import it from here)

# seq_len 9: the position embedding has 9 rows, so its shards are padded at world 2 and 4
TINY = GPTConfig(vocab_size=64, n_layer=2, n_head=2, d_model=16, seq_len=9, tie_weights=True)
GLOBAL_BATCH = 8
LR = 1e-2
# The attention key bias gets a mathematically zero gradient; its rounding noise (~1e-9) would
# be blown up to lr-sized steps by Adam with a tiny eps, so parity uses a moderate eps.
EPS = 1e-4


def build_gpt(cfg=TINY, freeze=("blocks.0.ln1.weight",)) -> GPT:
    model = GPT(cfg, seed=3)
    for name, p in model.named_parameters():
        if name in freeze:
            p.requires_grad_(False)
    return model


def wrap_gpt(model: GPT, nested: bool = True, **kwargs) -> FSDP:
    """Root unit over per-Block units (and, with ``nested``, per-attention units inside them)."""
    classes = {Block, CausalSelfAttention} if nested else {Block}
    with enable_wrap(wrapper_cls=FSDP, **kwargs):
        return FSDP(auto_wrap(model, transformer_auto_wrap_policy(classes)), **kwargs)


def local_slice(tensor: torch.Tensor) -> torch.Tensor:
    n, r = skdist.get_world_size(), skdist.get_rank()
    per = tensor.shape[0] // n
    return tensor[r * per:(r + 1) * per]


def make_optimizer(model):
    return torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=LR, eps=EPS,
                             weight_decay=0.01)


def train_step(model, optim, step: int, cfg=TINY, micro_batches: int = 1, clip=None,
               local: bool = True, sync=None):
    """One optimizer step on the global batch of ``step`` (this rank's slice when ``local``);
    ``micro_batches`` > 1 accumulates, the earlier ones inside ``sync()`` when given."""
    idx, target = synthetic_batch(cfg, GLOBAL_BATCH, step)
    if local:
        idx, target = local_slice(idx), local_slice(target)
    losses = []
    chunks = list(zip(idx.chunk(micro_batches), target.chunk(micro_batches)))
    for i, (x, y) in enumerate(chunks):
        ctx = sync() if (sync is not None and i < len(chunks) - 1) else _nullcontext()
        with ctx:
            loss = model.loss(x, y) / micro_batches
            loss.backward()
        losses.append(loss.detach())
    norm = None
    if clip is not None:
        norm = model.clip_grad_norm_(clip) if isinstance(model, FSDP) else \
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
    optim.step()
    optim.zero_grad()
    return sum(losses), norm


class _nullcontext:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


def shard_diff(model: FSDP, reference: torch.nn.Module) -> float:
    """Largest difference between this rank's shard of every parameter and its rows of the
    single-process ``reference`` (no communication: every rank checks its own parameters)."""
    from shardkit.nn.data_parallel.flat_param import shard_rows
    layouts = model._param_layouts()
    ref = dict(reference.named_parameters())
    worst = 0.0
    for name, p in model.named_parameters():
        expected = shard_rows(ref[name].detach(), layouts[id(p)], model.rank)
        worst = max(worst, (p.detach() - expected).abs().max().item())
    return worst


class ResidualBlock(nn.Module):
    """``x + b(tanh(a(x)))``, 6 wide: the inner unit of :class:`TwoBlockNet`."""

    def __init__(self):
        super().__init__()
        self.a = nn.Linear(6, 12)
        self.b = nn.Linear(12, 6)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


class TwoBlockNet(nn.Module):
    """A root holding the head, two :class:`ResidualBlock` as inner units (6 features in, 3
    classes out)."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([ResidualBlock(), ResidualBlock()])
        self.head = nn.Linear(6, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def first_ranks_groups() -> dict:
    """Process groups of the first 1, 2 and 4 ranks (created on every rank of a world of 4)."""
    return {size: skdist.new_group(list(range(size))) for size in (1, 2, 4)}
