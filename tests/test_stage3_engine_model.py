"""The stage-3 engine's model (forward_* through the root unit, kept gathers, placeholders).

One world of 2 gloo ranks: ``engine.forward_value`` of a model behind a wrapper that hands
out its inner model's methods (PEFT's ``PeftModel``, ``torch.compile``) trains like one
process; ``engine.module.state_dict()`` inside ``summon_full_params()`` holds the values; a
frozen module may run with gradients after a ``no_grad`` call kept its unit gathered, a
trainable one gets an error that says why; ``load_state_dict_from_zero_checkpoint`` on the
engine's model says what to do.
"""

import inspect
import os

import pytest
import torch
import torch.nn as nn

import shardkit as deepspeed
from shardkit import distributed
from shardkit.testing import world_fixture

W, STEPS, LR = 8, 2, 0.1

world2 = world_fixture(2)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(W, W)

    def forward(self, x):
        return torch.tanh(self.lin(x))


class Critic(nn.Module):
    """Blocks (their own FSDP units), then the root's own ``emb`` (frozen) and ``v_head``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(16, W)
        self.emb.weight.requires_grad_(False)
        self.blocks = nn.ModuleList(Block() for _ in range(2))
        self.v_head = nn.Linear(W, 1)

    def forward(self, ids):
        h = self.emb(ids)
        for block in self.blocks:
            h = block(h)
        return h

    def forward_value(self, ids, scale=1.0):
        return self.v_head(self.forward(ids)).squeeze(-1) * scale


class Delegating(nn.Module):
    """A wrapper that hands out its inner model's attributes (as PEFT's PeftModel)."""

    def __init__(self, inner):
        super().__init__()
        self.inner = inner

    def forward(self, *args, **kwargs):
        return self.inner(*args, **kwargs)

    def __getattr__(self, name):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self.inner, name)


def _engine(model):
    optimizer = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=LR)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 10 ** 6,
              "zero_optimization": {"stage": 3}}
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer, config=config)
    return engine


def _batch(step):
    g = torch.Generator().manual_seed(step)
    return torch.randint(0, 16, (4, 3), generator=g), torch.randn(4, 3, generator=g)


def _strip(name):
    for wrapper in ("inner.", "_orig_mod."):
        name = name.replace(wrapper, "")
    return name


def _forward_value_behind_a_wrapper(kind):
    rank = distributed.get_rank()
    inner = Critic()
    model = Delegating(inner) if kind == "delegating" else torch.compile(inner, backend="eager")
    engine = _engine(model)
    oracle = Critic()
    ref_opt = torch.optim.SGD([p for p in oracle.parameters() if p.requires_grad], lr=LR)
    worst = 0.0
    for step in range(STEPS):
        ids, target = _batch(step)
        mine = slice(2 * rank, 2 * rank + 2)
        loss = (engine.forward_value(ids[mine]) - target[mine]).pow(2).mean()
        engine.backward(loss)
        engine.step()
        ref_loss = (oracle.forward_value(ids) - target).pow(2).mean()
        ref_opt.zero_grad()
        ref_loss.backward()
        ref_opt.step()
        full = {_strip(k): v for k, v in engine.module_state_dict().items()}
        worst = max(worst, max((full[k] - v).abs().max().item()
                               for k, v in oracle.state_dict().items()))
    signature = str(inspect.signature(engine.forward_value))
    return worst, signature, engine.forward_value.__name__


@pytest.mark.parametrize("kind", ["delegating", "compiled"])
def test_forward_method_of_a_wrapped_model_runs_as_the_root_unit(world2, kind):
    for worst, signature, name in world2.run(_forward_value_behind_a_wrapper, kind):
        assert worst < 1e-6, worst
        assert signature == "(ids, scale=1.0)" and name == "forward_value", (signature, name)


def _state_dict_inside_summon_full_params():
    engine = _engine(Critic())
    with engine.wrapped.summon_full_params():
        inside = engine.module.state_dict()
    outside = engine.module.state_dict()
    full = engine.module_state_dict()
    return (max((inside[k] - v).abs().max().item() for k, v in full.items()),
            sorted(k for k, v in outside.items() if v.numel() == 0))


def test_state_dict_inside_summon_full_params_holds_the_values(world2):
    for worst, placeholders in world2.run(_state_dict_inside_summon_full_params):
        assert worst == 0.0, worst
        # outside the block, DeepSpeed's empty placeholders as before
        assert placeholders == ["blocks.0.lin.bias", "blocks.0.lin.weight",
                                "blocks.1.lin.bias", "blocks.1.lin.weight", "emb.weight",
                                "v_head.bias", "v_head.weight"], placeholders


def _direct_calls_after_a_no_grad_call():
    engine = _engine(Critic())
    ids = torch.arange(6).reshape(2, 3)
    h = torch.ones(2, W)
    with torch.no_grad():  # keeps the root unit gathered, as HF generate() does
        frozen_before = engine.module.emb(ids)
        engine.module.v_head(h)
    frozen = (engine.module.emb(ids) - frozen_before).abs().max().item()  # nothing to drop
    try:
        engine.module.v_head(h)  # trainable: its gradients would be dropped
        message = None
    except RuntimeError as error:
        message = str(error)
    return frozen, message


def test_frozen_module_runs_with_grad_after_a_kept_gather_a_trainable_one_is_told_why(world2):
    for frozen, message in world2.run(_direct_calls_after_a_no_grad_call):
        assert frozen == 0.0, frozen
        assert message is not None and "torch.no_grad()" in message, message
        assert "dropped" in message and "sharded" not in message, message


def _load_zero_checkpoint_into_the_engine_model(save_dir):
    from shardkit.utils.zero_to_fp32 import load_state_dict_from_zero_checkpoint
    engine = _engine(Critic())
    engine.save_checkpoint(save_dir, tag="t")
    try:
        load_state_dict_from_zero_checkpoint(engine.module, save_dir, tag="t")
    except RuntimeError as error:
        return str(error)
    return None


def test_load_state_dict_from_zero_checkpoint_into_the_engine_model_says_what_to_do(
        world2, tmp_path):
    for message in world2.run(_load_zero_checkpoint_into_the_engine_model,
                              os.fspath(tmp_path)):
        assert message is not None and "engine.load_checkpoint(" in message, message
        assert "does not match" not in message, message
