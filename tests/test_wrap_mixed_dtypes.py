"""Stage 3's default wrap policy on models whose dtypes mix below the top level (review of
9af3d29): a submodule that mixes dtypes under it but whose own parameters share one dtype
(an fp64 scale beside an fp32 Linear) becomes a unit of its own, so that its parameters do
not fall into the root unit beside another dtype (FSDP refused it: "one unit's parameters
must share a dtype"); ``split_dtypes_policy`` over torch's ``CustomPolicy`` keeps the
wrapper arguments its ``lambda_fn`` gives each module (they were dropped)."""

import torch
import torch.nn as nn
import torch.nn.functional as F

from torch.distributed.fsdp.wrap import CustomPolicy

from shardkit import distributed
from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
from shardkit.nn.wrap import split_dtypes_policy, transformer_auto_wrap_policy
from shardkit.recipes import OptimizerRecipe, compose, default_wrap_policy
from shardkit.testing import world_fixture

world2 = world_fixture(2)

WIDTH = 6
HYPER = {"lr": 1e-2, "weight_decay": 0.01}


class ScaledLinear(nn.Module):
    """An fp32 Linear and an fp64 scale of its own: mixes dtypes below it, holds one."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(torch.linspace(0.5, 1.5, WIDTH, dtype=torch.float64))
        self.lin = nn.Linear(WIDTH, WIDTH)

    def forward(self, x):
        return (self.lin(x).double() * self.scale).float()


class DeepMixed(nn.Module):
    """An fp32 parameter of the root beside a :class:`ScaledLinear` and an fp32 head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(3)
        self.shift = nn.Parameter(torch.randn(WIDTH))
        self.inner = ScaledLinear()
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x):
        return self.head(torch.tanh(self.inner(x + self.shift)))


def _selected(model, policy):
    """The names of the submodules ``policy`` makes units of (the root aside)."""
    return [name for name, m in model.named_modules()
            if name and policy(module=m, recurse=False, unwrapped_params=0)]


def test_a_mixed_submodule_holding_one_dtype_itself_is_a_unit():
    model = DeepMixed()
    never = transformer_auto_wrap_policy(nn.Embedding)  # the model has none: units by dtype
    assert _selected(model, split_dtypes_policy(model, never)) == \
        ["inner", "inner.lin", "head"]
    # a one-dtype model keeps the given policy itself (its units are unchanged)
    same = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    assert split_dtypes_policy(same, never) is never
    # a module mixing dtypes in its own parameters cannot be split: it is left to FSDP
    own_mix = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    own_mix[1].bias.data = own_mix[1].bias.data.double()
    assert _selected(own_mix, split_dtypes_policy(own_mix, never)) == ["0"]


def _batch(step):
    g = torch.Generator().manual_seed(70 + step)
    return torch.randn(8, WIDTH, generator=g), torch.randn(8, 2, generator=g)


def _reference(steps, world):
    """One process on the global batch (the mean of the ranks' slice losses), AdamW."""
    model = DeepMixed()
    opt = torch.optim.AdamW(model.parameters(), **HYPER)
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        for xs, ys in zip(x.chunk(world), y.chunk(world)):
            (F.mse_loss(model(xs), ys) / world).backward()
        opt.step()
    return model.state_dict()


def _deep_mixed_at_stage3(steps=3):
    """Train :class:`DeepMixed` at stage 3 with the default wrap policy; the worst relative
    difference from :func:`_reference`."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    model = DeepMixed()
    c = compose(model, 3, OptimizerRecipe(torch.optim.AdamW, HYPER),
                wrap_policy=default_wrap_policy(model))
    for step in range(steps):
        x, y = _batch(step)
        c.zero_grad()
        F.mse_loss(c.wrapped(x.chunk(world)[rank]), y.chunk(world)[rank]).backward()
        c.optimizer.step()
    got, expected = c.wrapped.state_dict(), _reference(steps, world)
    assert {k: v.dtype for k, v in got.items()} == {k: v.dtype for k, v in expected.items()}
    return max(((got[k] - v).abs().max() / v.abs().max()).item() for k, v in expected.items())


def test_stage3_default_policy_trains_dtypes_mixed_below_the_top(world2):
    # was: every rank raised "one unit's parameters must share a dtype" (the root unit held
    # the fp32 shift beside the fp64 scale)
    assert max(world2.run(_deep_mixed_at_stage3)) < 1e-5


def _reshard_after_forward_of_units():
    """``reshard_after_forward`` of each unit of an fp32 + fp64 model wrapped with
    ``split_dtypes_policy`` over a ``CustomPolicy`` asking it off for every Linear."""
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 2).double())
    custom = CustomPolicy(lambda m: {"reshard_after_forward": False}
                          if isinstance(m, nn.Linear) else False)
    wrapped = FSDP(model, auto_wrap_policy=split_dtypes_policy(model, custom))
    return [unit.reshard_after_forward for unit in wrapped.modules() if isinstance(unit, FSDP)]


def test_split_dtypes_keeps_a_custom_policys_wrapper_arguments(world2):
    # was [True, True, True]: the Linears' units resharded after forward all the same
    for flags in world2.run(_reshard_after_forward_of_units):
        assert flags == [True, False, False]


class _AdaptedBlock(nn.Module):
    """A frozen bf16 base Linear and an fp32 adapter beside it (a PEFT layer)."""

    def __init__(self):
        super().__init__()
        self.base = nn.Linear(WIDTH, WIDTH).to(torch.bfloat16).requires_grad_(False)
        self.adapter = nn.Linear(WIDTH, WIDTH, bias=False)

    def forward(self, x):
        return self.base(x.to(torch.bfloat16)).float() + self.adapter(x)


class _AdaptedModel(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_AdaptedBlock(), _AdaptedBlock()])
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _adapted_units():
    import shardkit
    torch.manual_seed(0)
    model = _AdaptedModel()
    engine, *_ = shardkit.initialize(model=model, model_parameters=model.parameters(), config={
        "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
        "bf16": {"enabled": True}, "optimizer": {"type": "AdamW", "params": {"lr": 1e-3}}})
    units = [type(m.module).__name__ for m in engine.modules() if isinstance(m, FSDP)]
    loss = engine(torch.randn(2, WIDTH)).sum()
    engine.backward(loss)
    engine.step()
    return sorted(units)


def test_initialize_keeps_one_unit_per_adapted_block(world2):
    """A PEFT-style model (bf16 frozen weights beside fp32 adapters in each block) under
    ``shardkit.initialize`` at stage 3 with bf16 training: the engine casts each block's
    16-bit weights to fp32 (one dtype per unit) and keeps one unit per block; the dtype split
    of the default policy is only for units that would still mix dtypes (it made a unit of
    each Linear here)."""
    for units in world2.run(_adapted_units):
        assert units == ["_AdaptedBlock", "_AdaptedBlock", "_AdaptedModel"], units


def _mixed_unit_error() -> str:
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Linear(WIDTH, 2).double())
    try:
        FSDP(model)
    except ValueError as error:
        return str(error)
    return "no error"


def test_a_unit_mixing_dtypes_names_its_parameters(world2):
    """The refusal names a few parameters of each dtype and the policy that splits them."""
    for message in world2.run(_mixed_unit_error):
        assert "torch.float64 (Linear.weight; Linear.bias)" in message, message
        assert "split_dtypes_policy" in message, message
