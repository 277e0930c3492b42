"""DeepSpeed's ``deepspeed.zero.GatheredParameters`` nested on the same ZeRO-3 parameters, and
``zero_to_fp32`` given one tag's directory instead of the checkpoint directory.

Nested blocks: inside an outer block the parameters stay full after an inner block on them
closes, so their ``ds_status`` must stay ``AVAILABLE`` (DeepSpeed-Chat's
``_z3_params_to_fetch`` picks the parameters to gather by ``NOT_AVAILABLE``); the inner block's
``modifier_rank`` edit and the outer block's edit both reach every rank. The tensor-fragment
API inside a block (where a stage-3 parameter holds its full value, not its rows) reads and
writes what it does outside. One world of 2 gloo ranks, started once.

From a review:

Review of the nested ``zero.GatheredParameters`` blocks and of the tensor-fragment API inside
a stage-3 gather: gradient setters where the parameter has no gradient yet, an inner block
that raises inside an outer one, and one block object entered again inside itself. One world
of 2 gloo ranks, started once.
"""

import os

import pytest
import torch
import torch.nn as nn

import shardkit
from shardkit import distributed
from shardkit.testing import world_fixture
from shardkit.zero import ZeroParamStatus

world2 = world_fixture(2)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(6, 5)  # 5 rows: the last row block is padded at 2 ranks
        self.second = nn.Linear(5, 3)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


def _stage3_engine(optimizer="SGD"):
    torch.manual_seed(0)
    cfg = {"train_batch_size": 2 * distributed.get_world_size(), "steps_per_print": 10 ** 6,
           "optimizer": {"type": optimizer, "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3}}
    engine, *_ = shardkit.initialize(model=Net(), config=cfg)
    return engine


def _nested_blocks():
    """Statuses seen around an inner block nested in an outer one on the same weight, and the
    full weight's change after both (rank 0's inner edit +1, every rank's outer edit x2)."""
    from shardkit.utils import safe_get_full_fp32_param
    engine = _stage3_engine()
    rank = distributed.get_rank()
    weight = engine.module.first.weight
    before = safe_get_full_fp32_param(weight)
    seen = {"before": weight.ds_status}
    with shardkit.zero.GatheredParameters(engine.module.parameters()):
        seen["outer"] = weight.ds_status
        with shardkit.zero.GatheredParameters([weight], modifier_rank=0):
            seen["inner"] = weight.ds_status
            with torch.no_grad():
                weight.add_(1.0 if rank == 0 else 50.0)  # only rank 0's edit is kept
        seen["outer after inner"] = weight.ds_status
        seen["shape after inner"] = tuple(weight.shape)
        seen["to fetch"] = sum(1 for p in engine.module.parameters() if hasattr(p, "ds_id")
                               and p.ds_status is ZeroParamStatus.NOT_AVAILABLE)
        with torch.no_grad():
            weight.mul_(2.0)  # the same edit on every rank: kept (modifier_rank=None)
    seen["after"] = weight.ds_status
    change = safe_get_full_fp32_param(weight) - (before + 1.0) * 2.0
    return seen, float(change.abs().max())


def _fragment_api_inside_blocks():
    """What the tensor-fragment API gives inside GatheredParameters, against what it gives
    outside: the largest difference of each read, and of each write's result."""
    from shardkit.utils import (safe_get_full_fp32_param, safe_get_full_optimizer_state,
                                safe_get_local_fp32_param, safe_get_local_optimizer_state,
                                safe_set_full_fp32_param)
    engine = _stage3_engine("Adam")
    weight, bias = engine.module.first.weight, engine.module.first.bias
    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(distributed.get_rank()))
    engine.backward(engine(x).square().mean())
    engine.step()
    outside = {"full": safe_get_full_fp32_param(weight),
               "exp_avg": safe_get_full_optimizer_state(weight, "exp_avg"),
               "local": safe_get_local_fp32_param(weight),
               "local exp_avg": safe_get_local_optimizer_state(weight, "exp_avg")}
    worst = {}
    with shardkit.zero.GatheredParameters([weight], modifier_rank=0):
        inside = {"full": safe_get_full_fp32_param(weight),
                  "exp_avg": safe_get_full_optimizer_state(weight, "exp_avg"),
                  "local": safe_get_local_fp32_param(weight),
                  "local exp_avg": safe_get_local_optimizer_state(weight, "exp_avg")}
        for key, value in inside.items():
            assert value.shape == outside[key].shape, (key, value.shape, outside[key].shape)
            worst[key] = float((value - outside[key]).abs().max())
        new = torch.arange(30, dtype=torch.float32).reshape(5, 6) / 7
        safe_set_full_fp32_param(weight, new)  # the block sees it, and it outlives the block
        worst["set, seen inside"] = float((weight.detach() - new).abs().max())
    worst["set, after"] = float((safe_get_full_fp32_param(weight) - new).abs().max())
    with shardkit.zero.GatheredParameters([bias]):  # the weight's unit is gathered, not it
        safe_set_full_fp32_param(weight, new * 2)
    worst["set unlisted, after"] = float((safe_get_full_fp32_param(weight) - new * 2)
                                         .abs().max())
    return worst


def _save_checkpoint(save_dir):
    engine = _stage3_engine()
    engine.save_checkpoint(save_dir, tag="global_step7")
    return True


def test_nested_gathered_parameters_stay_available_and_keep_both_edits(world2):
    for seen, change in world2.run(_nested_blocks):
        assert seen == {"before": ZeroParamStatus.NOT_AVAILABLE,
                        "outer": ZeroParamStatus.AVAILABLE,
                        "inner": ZeroParamStatus.AVAILABLE,
                        "outer after inner": ZeroParamStatus.AVAILABLE,
                        "shape after inner": (5, 6), "to fetch": 0,
                        "after": ZeroParamStatus.NOT_AVAILABLE}
        assert change < 1e-6


def test_tensor_fragment_api_inside_gathered_parameters(world2):
    for worst in world2.run(_fragment_api_inside_blocks):
        assert set(worst) == {"full", "exp_avg", "local", "local exp_avg", "set, seen inside",
                              "set, after", "set unlisted, after"}
        assert all(v < 1e-6 for v in worst.values()), worst


def test_a_tag_directory_as_checkpoint_dir_names_the_parent_and_the_tag(world2, tmp_path):
    from shardkit.utils.zero_to_fp32 import (CheckpointNotFound, main,
                                             get_fp32_state_dict_from_zero_checkpoint)
    save_dir = str(tmp_path / "ckpt")
    assert all(world2.run(_save_checkpoint, save_dir))
    tag_dir = os.path.join(save_dir, "global_step7")
    hint = f"checkpoint_dir={save_dir!r}, tag='global_step7'"
    for tag in (None, "global_step7"):
        with pytest.raises(CheckpointNotFound) as info:
            get_fp32_state_dict_from_zero_checkpoint(tag_dir, tag=tag)
        assert hint in str(info.value)
    output = str(tmp_path / "out")
    assert main([tag_dir, output]) == 2
    assert not os.path.exists(output)
    state = get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="global_step7")
    assert sorted(state) == ["first.bias", "first.weight", "second.bias", "second.weight"]


def _stage3_engine_rev():
    torch.manual_seed(0)
    cfg = {"train_batch_size": 2 * distributed.get_world_size(), "steps_per_print": 10 ** 6,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3}}
    engine, *_ = shardkit.initialize(model=Net(), config=cfg)
    return engine


def _gradient_setters_without_a_gradient_inside_blocks():
    """After ``engine.step()`` cleared the gradients, the gradient setters inside a block
    (listing the parameter, or a sibling of its unit): the largest difference between what
    was set and what is read back after the block, per case."""
    from shardkit.utils import (safe_get_full_grad, safe_get_local_grad, safe_set_full_grad,
                                safe_set_local_grad)
    engine = _stage3_engine_rev()
    weight, bias = engine.module.first.weight, engine.module.first.bias
    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(distributed.get_rank()))
    engine.backward(engine(x).square().mean())
    engine.step()
    new = torch.arange(30, dtype=torch.float32).reshape(5, 6) / 7
    worst = {}
    for listed in ("itself", "a sibling"):
        weight.grad = None
        with shardkit.zero.GatheredParameters([weight] if listed == "itself" else [bias]):
            safe_set_full_grad(weight, new)
        worst[f"full, {listed}"] = float((safe_get_full_grad(weight) - new).abs().max())
        rows = torch.full((3, 6), 2.5)
        weight.grad = None
        with shardkit.zero.GatheredParameters([weight] if listed == "itself" else [bias]):
            safe_set_local_grad(weight, rows)
        worst[f"local, {listed}"] = float((safe_get_local_grad(weight) - rows).abs().max())
    return worst


def _inner_block_that_raises():
    """An outer block doubles the weight on every rank; an inner block (modifier_rank=0)
    adds a different amount on each rank and raises. The weight's change after both against
    the outer edit alone, and whether the ranks agree."""
    from shardkit.utils import safe_get_full_fp32_param
    engine = _stage3_engine_rev()
    weight = engine.module.first.weight
    before = safe_get_full_fp32_param(weight)
    with shardkit.zero.GatheredParameters([weight]):
        with torch.no_grad():
            weight.mul_(2.0)
        try:
            with shardkit.zero.GatheredParameters([weight], modifier_rank=0):
                with torch.no_grad():
                    weight.add_(1.0 + 10.0 * distributed.get_rank())
                raise KeyError("the inner block fails")
        except KeyError:
            pass
    after = safe_get_full_fp32_param(weight)
    gathered = [torch.empty_like(after) for _ in range(distributed.get_world_size())]
    distributed.all_gather(gathered, after)
    return (float((after - before * 2.0).abs().max()),
            max(float((g - after).abs().max()) for g in gathered))


def _same_block_entered_twice():
    """One GatheredParameters object entered inside its own block: the shape inside the outer
    entry after the inner one closes, and the change the outer entry's edit leaves."""
    from shardkit.utils import safe_get_full_fp32_param
    engine = _stage3_engine_rev()
    weight = engine.module.first.weight
    before = safe_get_full_fp32_param(weight)
    block = shardkit.zero.GatheredParameters([weight])
    with block:
        with block:
            pass
        shape = tuple(weight.shape)
        with torch.no_grad():
            weight.add_(1.0)
    change = float((safe_get_full_fp32_param(weight) - (before + 1.0)).abs().max())
    return shape, change, tuple(weight.shape)


def test_gradient_setters_inside_a_block_when_the_gradient_is_none(world2):
    for worst in world2.run(_gradient_setters_without_a_gradient_inside_blocks):
        assert set(worst) == {"full, itself", "full, a sibling", "local, itself",
                              "local, a sibling"}
        assert all(v < 1e-6 for v in worst.values()), worst


def test_an_inner_block_that_raises_leaves_no_edit_for_the_outer_block(world2):
    for change, disagreement in world2.run(_inner_block_that_raises):
        assert change < 1e-6
        assert disagreement < 1e-6


def test_the_same_block_entered_inside_itself(world2):
    for shape, change, shape_after in world2.run(_same_block_entered_twice):
        assert shape == (5, 6)
        assert change < 1e-6
        assert shape_after == (3, 6)
