"""DeepSpeed's tensor-fragment API (``shardkit.utils.safe_*``) inside every kind of stage-3
gather: ``zero.GatheredParameters`` and ``summon_full_params`` with and without
``with_grads`` and ``writeback``. Each read must give what the same call gives outside any
gather, and each write must outlive the block. One world of 2 gloo ranks, started once.

From a review:

From a review of the tensor-fragment API inside ``summon_full_params`` and of DeepSpeed's
script names (``logger``, ``shardkit.runtime``).

``summon_full_params(with_grads=True, rank0_only=True)`` (which needs ``writeback=False``):
the first rank holds the full gradient and drops edits to it on exit; the other ranks hold
their shard's gradient. A gradient setter of the fragment API must leave every rank's rows
alike (all dropped), not the first rank's from before the edit beside the others' from after
it. One world of 2 gloo ranks, started once.

The script logger keeps one stdout handler when its module is reloaded (a notebook's
autoreload), and ``shardkit.runtime``'s namespaces have a module spec, as imported modules do.
"""

import importlib.util
import subprocess
import sys

import torch
import torch.nn as nn

import shardkit
from shardkit import distributed
from shardkit.nn.data_parallel import FullyShardedDataParallel
from shardkit.testing import world_fixture

world2 = world_fixture(2)


class Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.first = nn.Linear(6, 5)  # 5 rows: rank 1's row block is padded at 2 ranks
        self.second = nn.Linear(5, 3)

    def forward(self, x):
        return self.second(torch.tanh(self.first(x)))


def _model_after_backward():
    torch.manual_seed(0)
    model = FullyShardedDataParallel(Net(), use_orig_params=True)
    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(distributed.get_rank()))
    model(x).square().mean().backward()
    return model


def _blocks(model, weight) -> dict:
    return {"GatheredParameters": lambda: shardkit.zero.GatheredParameters([weight]),
            "summon": lambda: model.summon_full_params(),
            "summon, no writeback": lambda: model.summon_full_params(writeback=False),
            "summon with_grads": lambda: model.summon_full_params(with_grads=True),
            "summon with_grads, no writeback":
                lambda: model.summon_full_params(with_grads=True, writeback=False)}


def _reads(param) -> dict:
    from shardkit.utils import (safe_get_full_fp32_param, safe_get_full_grad,
                                safe_get_local_fp32_param, safe_get_local_grad)
    return {"full fp32": safe_get_full_fp32_param(param),
            "local fp32": safe_get_local_fp32_param(param),
            "full grad": safe_get_full_grad(param), "local grad": safe_get_local_grad(param)}


def _difference(got, expected):
    if tuple(got.shape) != tuple(expected.shape):
        return f"shape {tuple(got.shape)} instead of {tuple(expected.shape)}"
    return float((got - expected).abs().max())


def _reads_inside_each_block():
    """``{block: {read: difference from the same read outside any block}}``."""
    model = _model_after_backward()
    weight = model.module.first.weight
    outside = _reads(weight)
    found = {}
    for name, block in _blocks(model, weight).items():
        with block():
            inside = _reads(weight)
        found[name] = {key: _difference(value, outside[key]) for key, value in inside.items()}
    return found


def _own_rows(full, rank: int, world: int):
    """Rank ``rank``'s zero-padded row block of ``full``."""
    per = -(-full.shape[0] // world)
    block = torch.zeros(per, *full.shape[1:])
    rows = full[rank * per:(rank + 1) * per]
    block[:rows.shape[0]] = rows
    return block


def _writes_inside_each_block():
    """``{block: {write: difference between what was written and what is read after the
    block}}`` for the writes a block keeps (a gradient edit inside a ``with_grads`` block
    with ``writeback=False`` is dropped, as in torch)."""
    from shardkit.utils import (safe_get_full_fp32_param, safe_get_full_grad,
                                safe_get_local_fp32_param, safe_get_local_grad,
                                safe_set_full_grad, safe_set_local_fp32_param,
                                safe_set_local_grad)
    model = _model_after_backward()
    weight = model.module.first.weight
    rank, world = distributed.get_rank(), distributed.get_world_size()
    found = {}
    for step, (name, block) in enumerate(_blocks(model, weight).items()):
        value = torch.arange(30, dtype=torch.float32).reshape(5, 6) / 7 + step
        rows = _own_rows(value, rank, world)
        writes = {}
        with block():
            safe_set_local_fp32_param(weight, rows)
        writes["local fp32, own rows"] = _difference(safe_get_local_fp32_param(weight), rows)
        with block():
            safe_set_local_fp32_param(weight, rows)
        writes["local fp32, whole"] = _difference(safe_get_full_fp32_param(weight), value)
        if "no writeback" not in name or "with_grads" not in name:
            with block():
                safe_set_local_grad(weight, rows * 3)
            writes["local grad, own rows"] = _difference(safe_get_local_grad(weight), rows * 3)
            writes["local grad, whole"] = _difference(safe_get_full_grad(weight), value * 3)
            with block():
                safe_set_full_grad(weight, value * 5)
            writes["full grad"] = _difference(safe_get_full_grad(weight), value * 5)
        found[name] = writes
    return found


def test_tensor_fragment_reads_inside_every_gather_match_the_reads_outside(world2):
    for found in world2.run(_reads_inside_each_block):
        assert len(found) == 5
        for name, differences in found.items():
            assert all(d == 0.0 for d in differences.values()), (name, differences)


def test_tensor_fragment_writes_inside_every_gather_outlive_the_block(world2):
    for found in world2.run(_writes_inside_each_block):
        assert len(found) == 5
        for name, differences in found.items():
            assert len(differences) == (2 if name == "summon with_grads, no writeback" else 5)
            assert all(d == 0.0 for d in differences.values()), (name, differences)


def _edit_in_a_forward_hook(wrap_linears: bool):
    """A stage-3 engine whose ``second`` layer's forward pre-hook gathers ``mod.weight`` (what
    the module holds during its forward: a view of its unit's gathered copy) with
    ``modifier_rank=0`` and adds a different amount on each rank. Returns the change of the
    full weight after the forward against rank 0's edit, and the ranks' disagreement."""
    from shardkit.utils import safe_get_full_fp32_param
    torch.manual_seed(0)
    cfg = {"train_batch_size": 2 * distributed.get_world_size(), "steps_per_print": 10 ** 6,
           "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
           "zero_optimization": {"stage": 3}}
    policy = {}
    if wrap_linears:  # one unit per layer, gathered in its turn during the forward
        from torch.distributed.fsdp.wrap import ModuleWrapPolicy
        policy["wrap_policy"] = ModuleWrapPolicy({nn.Linear})
    engine, *_ = shardkit.initialize(model=Net(), config=cfg, **policy)
    weight = engine.module.second.weight
    before = safe_get_full_fp32_param(weight)
    rank = distributed.get_rank()

    def edit_own_weight(module, args):
        with shardkit.zero.GatheredParameters(module.weight, modifier_rank=0):
            with torch.no_grad():
                module.weight.add_(1.0 if rank == 0 else 50.0)

    hook = engine.module.second.register_forward_pre_hook(edit_own_weight)
    engine(torch.randn(2, 6))
    hook.remove()
    after = safe_get_full_fp32_param(weight)
    gathered = [torch.empty_like(after) for _ in range(distributed.get_world_size())]
    distributed.all_gather(gathered, after)
    return (float((after - before - 1.0).abs().max()),
            max(float((g - after).abs().max()) for g in gathered))


def test_gathered_parameters_inside_a_forward_hook_keeps_the_modifier_ranks_edit(world2):
    for wrap_linears in (False, True):
        for change, disagreement in world2.run(_edit_in_a_forward_hook, wrap_linears):
            assert change < 1e-6, wrap_linears
            assert disagreement == 0.0, wrap_linears


def _script_log_lines():
    """What DeepSpeed's script helpers log on this rank: ``{call: [messages]}``."""
    import logging

    from shardkit import deepspeed_compat
    lines = []

    class Keep(logging.Handler):
        def emit(self, record):
            lines.append(record.getMessage())

    keep = Keep()
    deepspeed_compat.logger.addHandler(keep)
    found = {}
    try:
        for name, call in (
                ("log_dist [1]", lambda: deepspeed_compat.log_dist("one", ranks=[1])),
                ("log_dist [-1]", lambda: deepspeed_compat.log_dist("all", ranks=[-1])),
                ("log_dist None", lambda: deepspeed_compat.log_dist("none")),
                ("memory", lambda: deepspeed_compat.see_memory_usage("after init", force=True)),
                ("memory unforced", lambda: deepspeed_compat.see_memory_usage("quiet"))):
            lines.clear()
            call()
            found[name] = list(lines)
    finally:
        deepspeed_compat.logger.removeHandler(keep)
    runtime = deepspeed_compat.runtime
    found["names"] = (runtime.utils.see_memory_usage is deepspeed_compat.see_memory_usage,
                      runtime.zero.partition_parameters.ZeroParamStatus
                      is shardkit.zero.ZeroParamStatus)
    return found


def test_deepspeed_log_dist_and_see_memory_usage_log_on_the_ranks_deepspeed_does(world2):
    for rank, found in enumerate(world2.run(_script_log_lines)):
        assert found["log_dist [1]"] == (["[Rank 1] one"] if rank == 1 else [])
        assert found["log_dist [-1]"] == [f"[Rank {rank}] all"]
        assert found["log_dist None"] == []  # in a process group: nowhere, as DeepSpeed
        if rank == 0:
            memory = found["memory"]
            assert memory[0] == "after init"
            assert memory[1].startswith("MA ") and "Max_MA" in memory[1] and "Max_CA" in memory[1]
        else:
            assert found["memory"] == []
        assert found["memory unforced"] == []
        assert found["names"] == (True, True)


def test_deepspeed_script_imports_of_runtime_and_utils_names_work():
    """``from deepspeed.runtime.utils import see_memory_usage``,
    ``from deepspeed.runtime.zero.partition_parameters import ZeroParamStatus`` and
    ``from deepspeed.utils import logger, log_dist`` with shardkit in deepspeed's place."""
    import shardkit
    from shardkit import deepspeed_compat, zero
    from shardkit.runtime.utils import see_memory_usage
    from shardkit.runtime.zero.partition_parameters import GatheredParameters, ZeroParamStatus
    from shardkit.utils import log_dist, logger
    assert see_memory_usage is deepspeed_compat.see_memory_usage
    assert ZeroParamStatus is zero.ZeroParamStatus and GatheredParameters is zero.GatheredParameters
    assert logger is deepspeed_compat.logger and log_dist is deepspeed_compat.log_dist
    assert shardkit.runtime is deepspeed_compat.runtime


def _gradient_after_rank0_only_edits():
    """The largest change of ``first.weight``'s full gradient after each fragment gradient
    setter inside ``summon_full_params(with_grads=True, rank0_only=True)`` (the full gradient
    is gathered from every rank's rows: a rank that kept its edit shows in it)."""
    from shardkit.utils import safe_get_full_grad, safe_set_full_grad, safe_set_local_grad
    torch.manual_seed(0)
    model = FullyShardedDataParallel(Net(), use_orig_params=True)
    x = torch.randn(2, 6, generator=torch.Generator().manual_seed(distributed.get_rank()))
    model(x).square().mean().backward()
    weight = model.module.first.weight
    before = safe_get_full_grad(weight)
    found = {}
    for name, edit in (("full", lambda: safe_set_full_grad(weight, torch.full((5, 6), 7.0))),
                       ("local", lambda: safe_set_local_grad(weight, torch.full((3, 6), 9.0)))):
        with model.summon_full_params(with_grads=True, writeback=False, rank0_only=True):
            edit()
        after = safe_get_full_grad(weight)
        found[name] = float((after - before).abs().max())
    return found


def test_gradient_edits_inside_a_rank0_only_summon_are_dropped_on_every_rank(world2):
    for found in world2.run(_gradient_after_rank0_only_edits):
        assert found == {"full": 0.0, "local": 0.0}


def test_reloading_the_script_helpers_keeps_one_stdout_handler():
    code = ("import importlib, logging, shardkit.deepspeed_compat as dc\n"
            "importlib.reload(dc)\n"
            "print(len(logging.getLogger('shardkit.scripts').handlers))\n"
            "dc.log_dist('once', ranks=[0])\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.splitlines()
    assert out[0] == "1"
    assert [line for line in out[1:] if line.endswith("[Rank -1] once")] == out[1:]
    assert len(out) == 2


def test_runtime_namespaces_have_module_specs():
    import shardkit.runtime  # noqa: F401 - puts the namespaces into sys.modules
    for name in ("shardkit.runtime", "shardkit.runtime.utils", "shardkit.runtime.zero",
                 "shardkit.runtime.zero.partition_parameters"):
        assert importlib.util.find_spec(name).name == name
