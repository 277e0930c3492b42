"""Users' own models against what the planner (``python -m shardkit plan --model``) says the
wrappers hold.

A model loaded in bf16 (or with an fp64 layer beside fp32 ones) trained without mixed
precision keeps each parameter's weight, gradient and optimizer state in the parameter's own
dtype; the planner priced every parameter at fp32's 4 bytes per element (twice a bf16 model's
real figures). The rows must match ``model_state_bytes`` of the composed wrappers at 2 ranks.
"""

import json

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed, plan
from shardkit.nn.wrap import transformer_auto_wrap_policy
from shardkit.recipes import adamw, compose
from shardkit.testing import world_fixture
from shardkit.utils.memory import model_state_bytes

world2 = world_fixture(2)

WIDTH = 12


class HalfHead(nn.Module):
    """An fp32 body and a bf16 head (two dtypes, one FSDP unit per Linear)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body = nn.Linear(WIDTH, 2 * WIDTH + 1)
        self.head = nn.Linear(2 * WIDTH + 1, 3).to(torch.bfloat16)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)).bfloat16()).float()


def bf16_mlp():
    """A factory for ``plan --model``: a whole model loaded in bf16."""
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH + 1), nn.Tanh(),
                         nn.Linear(2 * WIDTH + 1, 3)).to(torch.bfloat16)


def half_head():
    """A factory for ``plan --model``: :class:`HalfHead`."""
    return HalfHead()


def _plan_rows(capsys, factory, *extra):
    code = plan.main(["--model", f"tests.test_plan_model_dtypes:{factory}", "--world-size", "2",
                      "--optimizer", "adamw", "--wrap-block", "Linear", "--json", *extra])
    out, err = capsys.readouterr()
    assert code == 0, err
    result = json.loads(out)
    return result, {r["stage"]: r for r in result["rows"]}


def _measured_after_steps(factory, stage):
    """This rank's model-state bytes after two AdamW steps of ``factory()`` composed at
    ``stage`` (FSDP: one unit per Linear), and its number of trainable tensors."""
    model = {"bf16_mlp": bf16_mlp, "half_head": half_head}[factory]()
    kwargs = {"wrap_policy": transformer_auto_wrap_policy({nn.Linear})} if stage == 3 else {}
    setup = compose(model, stage, adamw(1e-3), **kwargs).training_setup(
        lambda out, target: F.mse_loss(out.float(), target))
    rank = distributed.get_rank()
    g = torch.Generator().manual_seed(rank)
    x, y = torch.randn(4, WIDTH, generator=g), torch.randn(4, 3, generator=g)
    dtype = next(model.parameters()).dtype
    for _ in range(2):
        setup.train_step(x.to(dtype), y)
    return model_state_bytes(setup.module, setup.optimizer).total, \
        sum(1 for p in model.parameters() if p.requires_grad)


def test_plan_sizes_parameters_by_their_own_dtype(world2, capsys):
    """Stages 0-3 at 2 ranks: each row is the most loaded rank's measured bytes, less
    AdamW's 4-byte step count per trainable tensor (which the planner leaves out)."""
    for factory in ("bf16_mlp", "half_head"):
        result, rows = _plan_rows(capsys, factory)
        for stage in range(4):
            measured = world2.run(_measured_after_steps, factory, stage)
            step_counts = measured[0][1] * 4
            top = max(total for total, _ in measured)
            where = f"{factory} stage {stage}: planned {rows[stage]}, measured {measured}"
            assert rows[stage]["model_states"] <= top <= rows[stage]["model_states"] \
                + step_counts, where
        assert result["fp32_equivalent_params"] < result["params"], result


def test_plan_text_says_the_dtypes_weigh_in(capsys):
    """The table says its bytes are the model's own dtypes'; an all-fp32 model's plan is
    unchanged, and --mixed-precision keeps its own W, G and K."""
    assert plan.main(["--model", "tests.test_plan_model_dtypes:bf16_mlp", "--world-size", "2"]) == 0
    assert "parameters not in fp32 keep weights" in capsys.readouterr().out
    _, fp32_rows = _plan_rows(capsys, "bf16_mlp", "--mixed-precision")
    psi = sum(p.numel() for p in bf16_mlp().parameters())
    assert fp32_rows[0]["model_states"] == pytest.approx((2 + 2 + 12) * psi)
    result, rows = _plan_rows(capsys, "bf16_mlp")
    assert result["fp32_equivalent_params"] == psi / 2
    assert rows[0]["model_states"] == pytest.approx((4 + 4 + 8) * psi / 2)


# ------------------------------------------------------------ two dtypes under stage 3's default


class Fp64Head(nn.Module):
    """An fp32 body and an fp64 head (no block class repeats: FSDP's size policy)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.body = nn.Sequential(nn.Linear(WIDTH, 5), nn.LayerNorm(5))
        self.head = nn.Linear(5, 2).to(torch.float64)

    def forward(self, x):
        return self.head(torch.tanh(self.body(x)).double()).float()


HYPER = {"lr": 1e-2, "eps": 1e-6, "weight_decay": 0.01}
GLOBAL_BATCH = 8


def _batch(step):
    g = torch.Generator().manual_seed(50 + step)
    return torch.randn(GLOBAL_BATCH, WIDTH, generator=g), torch.randn(GLOBAL_BATCH, 2, generator=g)


def _reference(steps):
    """One process on the global batch (mean of the ranks' slice losses), AdamW."""
    model = Fp64Head()
    opt = torch.optim.AdamW(model.parameters(), **HYPER)
    n = distributed.get_world_size()
    for step in range(steps):
        x, y = _batch(step)
        opt.zero_grad()
        for xs, ys in zip(x.chunk(n), y.chunk(n)):
            (F.mse_loss(model(xs), ys) / n).backward()
        opt.step()
    return model.state_dict()


def _two_dtypes_at_stage3_by_default(via):
    """Train :class:`Fp64Head` 3 steps at stage 3 with the default wrap policy (``compose``
    or ``shardkit.initialize``); the worst relative difference from :func:`_reference`."""
    import shardkit
    from shardkit.recipes import OptimizerRecipe
    rank, n, steps = distributed.get_rank(), distributed.get_world_size(), 3
    if via == "compose":
        c = compose(Fp64Head(), 3, OptimizerRecipe(torch.optim.AdamW, HYPER))
        forward, full_state = c.wrapped, c.wrapped.state_dict

        def step(loss):
            c.zero_grad()
            loss.backward()
            c.optimizer.step()
    else:
        engine, _, _, _ = shardkit.initialize(model=Fp64Head(), config={
            "zero_optimization": {"stage": 3}, "train_batch_size": GLOBAL_BATCH,
            "steps_per_print": 10 ** 6, "optimizer": {"type": "AdamW", "params": HYPER}})
        forward, full_state = engine, engine.module_state_dict

        def step(loss):
            engine.backward(loss)
            engine.step()
    for s in range(steps):
        x, y = _batch(s)
        step(F.mse_loss(forward(x.chunk(n)[rank]), y.chunk(n)[rank]))
    got, expected = full_state(), _reference(steps)
    assert {k: (v.dtype, v.shape) for k, v in got.items()} == \
        {k: (v.dtype, v.shape) for k, v in expected.items()}
    return max(((got[k] - v).abs().max() / v.abs().max()).item() for k, v in expected.items())


def test_stage3_default_policy_gives_each_dtype_its_unit(world2):
    """Stage 3 with the default wrap policy on an fp32 body with an fp64 head trains like one
    process (compose and initialize were refused: one FSDP unit held both dtypes)."""
    for via in ("compose", "initialize"):
        assert max(world2.run(_two_dtypes_at_stage3_by_default, via)) < 1e-5, via
