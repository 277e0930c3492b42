"""Checkpoint paths a DeepSpeed / torch.distributed.checkpoint user takes that failed:

- torch's dcp recipe over a ``shardkit.initialize`` engine with gradient accumulation
  (``get_state_dict(engine, engine.optimizer)`` -> ``dcp.save``; a fresh engine:
  ``get_state_dict`` -> ``dcp.load`` -> ``set_state_dict``) resumes as the uninterrupted run,
  at the stage that saved and at another (0 <-> 3), under the unwrapped model's names;
- DeepSpeed's ``load_state_dict_from_zero_checkpoint`` over a model with a module's extra state
  that is not a tensor (``get_extra_state`` returning a dict) loads it, and a model of another
  shape is refused naming the key, the model unchanged.

One world of 2 gloo ranks, started once for the module.
"""

import torch
import torch.distributed.checkpoint as dcp
import torch.nn as nn
import torch.nn.functional as F

import shardkit
from shardkit import distributed
from shardkit.testing import world_fixture
from tests.utils.compare import max_diff

world2 = world_fixture(2)

GLOBAL_BATCH, MICRO = 8, 2  # at world 2: two micro-batches per step (gradient accumulation)


def _engine(seed: int, stage: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 5), nn.Tanh(), nn.Linear(5, 3))
    config = {"train_batch_size": GLOBAL_BATCH, "train_micro_batch_size_per_gpu": MICRO,
              "zero_optimization": {"stage": stage}, "steps_per_print": 10000,
              "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "weight_decay": 0.1}}}
    # a torch scheduler replaces the optimizer's step on the instance (to note the call)
    engine, *_ = shardkit.initialize(
        model=model, model_parameters=model.parameters(), config=config,
        lr_scheduler=lambda optim: torch.optim.lr_scheduler.LambdaLR(optim, lambda s: 1.0))
    return engine


def _steps(engine, first: int, count: int) -> list:
    """``count`` steps on global batches ``first...`` (this rank's micro-batches); the full
    model state after each."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    mine = slice(rank * GLOBAL_BATCH // world, (rank + 1) * GLOBAL_BATCH // world)
    history = []
    for step in range(first, first + count):
        gen = torch.Generator().manual_seed(100 + step)
        x, y = torch.randn(GLOBAL_BATCH, 6, generator=gen), torch.randn(GLOBAL_BATCH, 3,
                                                                        generator=gen)
        for xb, yb in zip(x[mine].split(MICRO), y[mine].split(MICRO)):
            engine.backward(F.mse_loss(engine(xb), yb))
            engine.step()
        module = engine.wrapped if engine.zero_stage == 3 else engine.module
        history.append({k: v.detach().clone() for k, v in module.state_dict().items()})
    return history


def _dcp_save_then_go_on(folder: str, stage: int) -> tuple:
    from shardkit.checkpoint import get_state_dict
    engine = _engine(0, stage)
    _steps(engine, 0, 2)
    msd, osd = get_state_dict(engine, engine.optimizer)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder)
    return sorted(msd), sorted(osd["state"]), _steps(engine, 2, 2)


def _dcp_resume(folder: str, stage: int) -> list:
    from shardkit.checkpoint import get_state_dict, set_state_dict
    engine = _engine(7, stage)
    msd, osd = get_state_dict(engine, engine.optimizer)  # a fresh optimizer: state made here
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(engine, engine.optimizer, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    return _steps(engine, 2, 2)


def test_dcp_recipe_over_an_engine_with_gradient_accumulation_resumes(world2, tmp_path):
    # Before: get_state_dict(engine, engine.optimizer) over a fresh engine made its optimizer's
    # state with a zero-lr optimizer.step(), which the engine's guard refused on every rank
    # ("engine.optimizer.step() was called directly with gradient_accumulation_steps=2"): no
    # resume through dcp. At stage 0 every tensor came twice ("module.0.weight" and
    # "wrapped.0.weight"), so a stage-0 checkpoint did not load at stage 3 nor back.
    names = ["0.bias", "0.weight", "2.bias", "2.weight"]
    for saving, loading in ((3, 3), (0, 3), (3, 0)):
        folder = str(tmp_path / f"dcp{saving}{loading}")
        saved = world2.run(_dcp_save_then_go_on, folder, saving)
        resumed = world2.run(_dcp_resume, folder, loading)
        for (model_keys, optim_keys, want), got in zip(saved, resumed):
            assert model_keys == optim_keys == names, (saving, model_keys, optim_keys)
            # across stages the gradients are summed in another order (stage 3 reduce-scatters
            # each micro-batch, stage 0 all-reduces their sum): the last bits may differ
            tolerance = 0.0 if saving == loading else 1e-6
            assert max(max_diff(a, b) for a, b in zip(got, want)) <= tolerance, (saving, loading)


class _Counted(nn.Module):
    """A layer whose extra state is a dict (``get_extra_state``), as counters often are."""

    def __init__(self, width: int = 4):
        super().__init__()
        self.lin = nn.Linear(4, width)
        self.calls = 0

    def forward(self, x):
        self.calls += 1
        return self.lin(x)

    def get_extra_state(self):
        return {"calls": self.calls}

    def set_extra_state(self, state):
        self.calls = state["calls"]


class _History(nn.Module):
    """A layer whose extra state is a tensor whose length changes as it runs."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(2, 2)
        self.seen = torch.zeros(0)

    def forward(self, x):
        self.seen = torch.cat([self.seen, x.detach().sum().reshape(1)])
        return self.lin(x)

    def get_extra_state(self):
        return self.seen

    def set_extra_state(self, state):
        self.seen = state.clone()


def _save_engine_with_extra_state(save_dir: str, stage: int) -> dict:
    torch.manual_seed(0)
    model = nn.Sequential(_Counted(), nn.Linear(4, 2), _History())
    config = {"train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
              "zero_optimization": {"stage": stage},
              "optimizer": {"type": "Adam", "params": {"lr": 0.1}}}
    engine, *_ = shardkit.initialize(model=model, model_parameters=model.parameters(),
                                     config=config)
    engine.backward(engine(torch.randn(2, 4)).sum())
    engine.step()
    engine.save_checkpoint(save_dir)
    live = engine.wrapped if stage == 3 else engine.module
    return {k: v.detach().clone() if torch.is_tensor(v) else v
            for k, v in live.state_dict().items()}


def test_load_state_dict_from_zero_checkpoint_takes_extra_state(world2, tmp_path):
    # Before: AttributeError("'dict' object has no attribute 'shape'") from the shape check,
    # for every model with a get_extra_state() that is not a tensor, at every stage.
    from shardkit.utils.zero_to_fp32 import load_state_dict_from_zero_checkpoint
    for stage in (0, 3):
        save_dir = str(tmp_path / f"stage{stage}")
        live = world2.run(_save_engine_with_extra_state, save_dir, stage)[0]
        torch.manual_seed(5)
        model = nn.Sequential(_Counted(), nn.Linear(4, 2), _History())
        assert load_state_dict_from_zero_checkpoint(model, save_dir) is model
        assert model[0].calls == live["0._extra_state"]["calls"] == 1
        assert torch.equal(model[2].seen, live["2._extra_state"]) and len(model[2].seen) == 1
        assert max_diff({k: v for k, v in model.state_dict().items() if torch.is_tensor(v)},
                        {k: v for k, v in live.items() if torch.is_tensor(v)}) == 0.0

        wider = nn.Sequential(_Counted(width=5), nn.Linear(5, 2), _History())
        before = {k: v.clone() for k, v in wider.state_dict().items() if torch.is_tensor(v)}
        try:
            load_state_dict_from_zero_checkpoint(wider, save_dir)
            refusal = "accepted"
        except RuntimeError as error:
            refusal = str(error)
        assert "0.lin.weight: checkpoint (4, 4), model (5, 4)" in refusal, refusal
        assert "nothing was loaded" in refusal and wider[0].calls == 0
        assert all(torch.equal(before[k], v) for k, v in wider.state_dict().items()
                   if torch.is_tensor(v))
