"""FullyShardedDataParallel when only some ranks build the model on the meta device.

The llama-recipes / torchtune pattern: rank 0 builds (or loads) the real model, the other
ranks build it under ``torch.device("meta")`` and wrap it with ``sync_module_states=True``.
Checked in one world of 2 gloo ranks: with ``param_init_fn=to_empty(recurse=False)`` every rank
ends with rank 0's parameters and buffers, including a non-persistent buffer computed in
``__init__`` (a rotary ``inv_freq``), and trains like one process; without ``param_init_fn``
(a module with no ``reset_parameters()``), or with a ``param_init_fn`` that fails on one rank,
every rank raises the same clear error instead of rank 0 waiting in the unit's first
collective.
"""

import functools

import pytest
import torch

import shardkit
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as skdist
from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
from shardkit.nn.wrap import auto_wrap, transformer_auto_wrap_policy
from shardkit.testing import world_fixture
from tests.utils.compare import max_diff

VOCAB, D, BLOCKS, SEQ, LOCAL_BATCH, STEPS, LR = 13, 8, 2, 6, 2, 3, 1e-2

world2 = world_fixture(2)


class Norm(nn.Module):
    """An RMSNorm as HF writes it: a weight and no reset_parameters()."""

    def __init__(self, d: int):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


class Rotary(nn.Module):
    """A non-persistent buffer computed in __init__ (not in any state_dict)."""

    def __init__(self, d: int):
        super().__init__()
        self.register_buffer("inv_freq", 1.0 / (10000 ** (torch.arange(0, d, 2) / d)),
                             persistent=False)

    def forward(self, x):
        pos = torch.arange(x.shape[1], dtype=x.dtype)[:, None] * self.inv_freq
        return x + torch.cat([pos.sin(), pos.cos()], dim=-1)


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.norm = Norm(D)
        self.fc = nn.Linear(D, D)

    def forward(self, x):
        return x + self.fc(self.norm(x))


class Tiny(nn.Module):
    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, D)
        self.rotary = Rotary(D)
        self.layers = nn.ModuleList(Layer() for _ in range(BLOCKS))
        self.head = nn.Linear(D, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, idx):
        x = self.rotary(self.embed(idx))
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def _built(meta: bool, seed: int = 0) -> Tiny:
    torch.manual_seed(seed)
    if meta:
        with torch.device("meta"):
            return Tiny()
    return Tiny()


def _to_empty(module: nn.Module) -> None:
    module.to_empty(device=torch.device("cpu"), recurse=False)


def _wrap(model: nn.Module, **kwargs) -> FSDP:
    return FSDP(auto_wrap(model, transformer_auto_wrap_policy({Layer}), **kwargs), **kwargs)


def _rank0_real_others_meta(**kwargs) -> FSDP:
    return _wrap(_built(meta=skdist.get_rank() != 0), sync_module_states=True, **kwargs)


def _trains_from_rank0() -> dict:
    model = _rank0_real_others_meta(param_init_fn=_to_empty)
    oracle = _built(meta=False)  # what rank 0 built
    assert model.module.head.weight is model.module.embed.weight
    start = max_diff(model.state_dict(), oracle.state_dict())
    buffers = max_diff(dict(model.named_buffers()), dict(oracle.named_buffers()))
    opt = torch.optim.AdamW(model.parameters(), lr=LR)
    ref_opt = torch.optim.AdamW(oracle.parameters(), lr=LR)

    def step(loss):
        loss.backward()
        opt.step()
        opt.zero_grad()
    worst = _train_beside(oracle, ref_opt, model, step, model.state_dict)
    return {"start": start, "buffers": buffers, "worst": worst}


def _train_beside(oracle, ref_opt, model, step, full_state) -> float:
    """STEPS steps: the oracle on the global batch, ``model`` on this rank's part (``step``
    takes its loss); the largest difference of ``full_state()`` from the oracle's."""
    rank, world = skdist.get_rank(), skdist.get_world_size()
    worst = 0.0
    for i in range(STEPS):
        gen = torch.Generator().manual_seed(i)
        idx = torch.randint(0, VOCAB, (LOCAL_BATCH * world, SEQ), generator=gen)
        target = torch.randint(0, VOCAB, (LOCAL_BATCH * world, SEQ), generator=gen)
        F.cross_entropy(oracle(idx).reshape(-1, VOCAB), target.reshape(-1)).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        step(F.cross_entropy(model(idx[mine]).reshape(-1, VOCAB), target[mine].reshape(-1)))
        worst = max(worst, max_diff(full_state(), oracle.state_dict()))
    return worst


def _only_some_ranks_fail() -> dict:
    found = {}
    # no param_init_fn: rank 1's Norm has no reset_parameters(), rank 0 has nothing on meta
    with pytest.raises(ValueError, match=r"'norm' \(Norm\) in the wrapped Layer holds parameter "
                                         r"'weight' on the meta device") as caught:
        _rank0_real_others_meta()
    found["no_reset"] = str(caught.value)

    def fails_on_rank1(module):
        raise RuntimeError("checkpoint shard missing")  # only rank 1 calls it (meta)
    with pytest.raises(RuntimeError if skdist.get_rank() else ValueError,
                       match="checkpoint shard missing"):
        _rank0_real_others_meta(param_init_fn=fails_on_rank1)
    skdist.barrier()  # every rank raised and is still in step
    return found


def _engine_with_some_ranks_meta() -> str:
    """initialize at stage 3 without a reset_parameters() for Norm cannot materialize the
    model on rank 1 (rank 0 built it for real): raised on both ranks."""
    config = {"train_micro_batch_size_per_gpu": LOCAL_BATCH,
              "optimizer": {"type": "AdamW", "params": {"lr": LR}},
              "zero_optimization": {"stage": 3}}
    with pytest.raises(ValueError, match="meta device") as caught:
        shardkit.initialize(model=_built(meta=skdist.get_rank() != 0), config=config)
    skdist.barrier()
    return str(caught.value)


def test_rank0_real_other_ranks_meta_trains_from_rank0(world2):
    for result in world2.run(_trains_from_rank0):
        assert result["start"] == 0.0 and result["buffers"] == 0.0
        assert result["worst"] < 1e-5


def test_a_failure_on_some_ranks_is_raised_on_every_rank(world2):
    for found in world2.run(_only_some_ranks_fail):
        assert "no reset_parameters()" in found["no_reset"]
        assert "param_init_fn" in found["no_reset"]


def test_initialize_with_some_ranks_meta_raises_on_every_rank(world2):
    for message in world2.run(_engine_with_some_ranks_meta):
        assert "'norm' (Norm)" in message and "no reset_parameters()" in message


def _new_memory_after_wrapping_refused() -> float:
    """to_empty under any spelling (torch's lambda today; a partial or a named function
    tomorrow): refused by what it does to a shard (new memory), the shards untouched."""
    model = _wrap(_built(meta=False))
    before = model.state_dict()
    for fn in (functools.partial(torch.empty_like, device="cpu"), lambda t: t.clone()):
        with pytest.raises(RuntimeError, match="to_empty"):
            nn.Sequential(model)._apply(fn)
    return max_diff(model.state_dict(), before)


def test_new_memory_after_wrapping_is_refused_whatever_its_name(world2):
    assert world2.run(_new_memory_after_wrapping_refused) == [0.0, 0.0]


def _engine_with_param_init_fn() -> dict:
    """The llama-recipes pattern through initialize at stage 3: rank 0 real, rank 1 on meta,
    param_init_fn for the Norm without reset_parameters(); every rank then holds rank 0's
    model (buffers included) and trains like one process. At stage 1 the keyword is refused
    on every rank before any collective."""
    rank = skdist.get_rank()
    config = {"train_micro_batch_size_per_gpu": LOCAL_BATCH,
              "optimizer": {"type": "AdamW", "params": {"lr": LR, "weight_decay": 0.0}},
              "zero_optimization": {"stage": 3}}
    engine, *_ = shardkit.initialize(model=_built(meta=rank != 0), config=config,
                                     param_init_fn=_to_empty)
    oracle = _built(meta=False)
    start = max_diff(engine.module_state_dict(), oracle.state_dict())
    buffers = max_diff(dict(engine.module.named_buffers()), dict(oracle.named_buffers()))
    ref_opt = torch.optim.AdamW(oracle.parameters(), lr=LR, weight_decay=0.0)

    def step(loss):
        engine.backward(loss)
        engine.step()
    worst = _train_beside(oracle, ref_opt, engine, step, engine.module_state_dict)
    with pytest.raises(ValueError, match=r"param_init_fn.*stage 1") as caught:
        shardkit.initialize(model=_built(meta=False), param_init_fn=_to_empty,
                            config={**config, "zero_optimization": {"stage": 1}})
    skdist.barrier()
    return {"start": start, "buffers": buffers, "worst": worst, "stage1": str(caught.value)}


def test_initialize_takes_param_init_fn_at_stage_3(world2):
    for result in world2.run(_engine_with_param_init_fn):
        assert result["start"] == 0.0 and result["buffers"] == 0.0, result
        assert result["worst"] < 1e-5, result
