"""torch's ``torch.distributed.checkpoint.state_dict`` API over shardkit's FSDP.

``shardkit.checkpoint.get_state_dict`` / ``set_state_dict`` (torch's signatures and
``StateDictOptions``) with ``torch.distributed.checkpoint`` (dcp): saved at world 2, loaded at
world 2 and in one process (plain model, torch's own functions), saved in one process and
loaded at world 2; training then continues exactly as the uninterrupted run (parameters and
optimizer state, every rank). ``full_state_dict=True`` round trips, with ``cpu_offload`` (rank
0 only) and ``broadcast_from_rank0``. torch's own ``get_state_dict`` over a stage-3
``compose`` optimizer is refused by ``dcp.save`` on every rank before anything is written.
Bad options raise on every rank before any collective. One world of 2 gloo ranks.
"""

import os

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.checkpoint import state_dict as tsd

from shardkit.testing import world_fixture
from tests.utils.factored_moments import FactoredMoments
from tests.utils.compare import max_diff

world2 = world_fixture(2)

LOCAL_BATCH = 3
FIRST, THEN = 3, 3
EXACT = 1e-6      # the same ranks, the same shards: the same arithmetic
CLOSE = 1e-5      # one process against two: reductions in another order


# ---------------------------------------------------------------------- rank-side helpers


def _plain(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 7), nn.ReLU(), nn.Linear(7, 3))


def _fsdp(seed: int):
    from shardkit.nn import FullyShardedDataParallel as FSDP
    model = _plain(seed)
    model[2] = FSDP(model[2])  # a nested unit: 3 rows over 2 ranks, 7 over 2 (uneven)
    return FSDP(model)


def _optims(model, two: bool) -> list:
    if not two:
        return [torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)]
    named = list(model.named_parameters())
    return [torch.optim.AdamW([p for n, p in named if n.endswith("weight")], lr=0.05,
                              weight_decay=0.01),
            torch.optim.Adam([p for n, p in named if n.endswith("bias")], lr=0.03)]


def _batch(step: int, world: int):
    gen = torch.Generator().manual_seed(1000 + step)
    return (torch.randn(LOCAL_BATCH * world, 5, generator=gen),
            torch.randn(LOCAL_BATCH * world, 3, generator=gen))


def _train(model, optims, start: int, steps: int, rank: int = 0, world: int = 1) -> None:
    for step in range(start, start + steps):
        x, y = _batch(step, 2)  # the global batch of a world of 2, cut into `world` slices
        cut = slice(rank * x.shape[0] // world, (rank + 1) * x.shape[0] // world)
        for optim in optims:
            optim.zero_grad(set_to_none=True)
        F.mse_loss(model(x[cut]), y[cut]).backward()
        for optim in optims:
            optim.step()


def _full(model, optims) -> tuple:
    """The model's and the optimizers' full state, keyed by FQN, on every rank."""
    from shardkit.checkpoint import StateDictOptions, get_state_dict
    msd, osd = get_state_dict(model, optims, options=StateDictOptions(full_state_dict=True))
    return _plainly(msd, osd)


def _plainly(msd, osd) -> tuple:
    tensors = {f"model.{k}": v.detach().clone() for k, v in msd.items()}
    for fqn, entry in osd["state"].items():
        for key, value in entry.items():
            tensors[f"optim.{fqn}.{key}"] = torch.as_tensor(value, dtype=torch.float32).clone()
    return tensors, [dict(g) for g in osd["param_groups"]]


def _dist_rank_world():
    import torch.distributed as dist
    return dist.get_rank(), dist.get_world_size()


def save_and_resume(folder: str, two: bool, cpu_offload: bool):
    """Train, dcp.save (default options: DTensors), train on; a fresh model and optimizer
    (another seed) dcp.load + set_state_dict and train the same steps. Both full states."""
    from shardkit.checkpoint import StateDictOptions, get_state_dict, set_state_dict
    rank, world = _dist_rank_world()
    options = StateDictOptions(cpu_offload=cpu_offload)
    model = _fsdp(0)
    optims = _optims(model, two)
    _train(model, optims, 0, FIRST, rank, world)
    msd, osd = get_state_dict(model, optims, options=options)
    kinds = sorted({type(v).__name__ for v in msd.values()} |
                   {type(v).__name__ for e in osd["state"].values() for k, v in e.items()
                    if k != "step"})
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder)
    _train(model, optims, FIRST, THEN, rank, world)
    reference = _full(model, optims)

    resumed = _fsdp(7)
    fresh = _optims(resumed, two)
    msd, osd = get_state_dict(resumed, fresh, options=options)  # fresh: state initialised
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(resumed, fresh, model_state_dict=state["model"],
                   optim_state_dict=state["optim"], options=options)
    _train(resumed, fresh, FIRST, THEN, rank, world)
    mine = _full(resumed, fresh)
    return kinds, max_diff(reference[0], mine[0]), reference[1] == mine[1], reference


def resume_from(folder: str):
    """A fresh world-2 model loads a checkpoint (saved by one process) and trains on."""
    from shardkit.checkpoint import get_state_dict, set_state_dict
    rank, world = _dist_rank_world()
    model = _fsdp(11)
    optims = _optims(model, False)
    msd, osd = get_state_dict(model, optims)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=folder)
    set_state_dict(model, optims, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    _train(model, optims, FIRST, THEN, rank, world)
    return _full(model, optims)


def full_round_trip(cpu_offload_get: bool):
    """full_state_dict=True: get (every rank; rank 0 only with cpu_offload), set into a fresh
    model (with broadcast_from_rank0 when only rank 0 has it), train on."""
    from shardkit.checkpoint import StateDictOptions, get_state_dict, set_state_dict
    rank, world = _dist_rank_world()
    model = _fsdp(0)
    optims = _optims(model, False)
    _train(model, optims, 0, FIRST, rank, world)
    options = StateDictOptions(full_state_dict=True, cpu_offload=cpu_offload_get)
    msd, osd = get_state_dict(model, optims, options=options)
    got = (len(msd), len(osd))
    shapes = {k: tuple(v.shape) for k, v in msd.items()}
    _train(model, optims, FIRST, THEN, rank, world)
    reference = _full(model, optims)
    resumed = _fsdp(5)
    fresh = _optims(resumed, False)
    set_state_dict(resumed, fresh, model_state_dict=msd, optim_state_dict=osd,
                   options=StateDictOptions(full_state_dict=True,
                                            broadcast_from_rank0=cpu_offload_get))
    _train(resumed, fresh, FIRST, THEN, rank, world)
    return got, shapes, max_diff(reference[0], _full(resumed, fresh)[0])


def torch_functions_on_compose(folder: str):
    """torch's own get_state_dict over a compose stage-3 optimizer: dcp.save refuses on this
    rank; shardkit's functions over the same model and optimizer save; torch.save unaffected."""
    import io

    from shardkit.checkpoint import get_state_dict
    from shardkit.recipes import adamw, compose
    rank, world = _dist_rank_world()
    composition = compose(_plain(0), stage=3, optimizer=adamw(lr=0.05))
    model, optim = composition.wrapped, composition.optimizer
    _train(model, [optim], 0, 1, rank, world)
    refused = os.path.join(folder, "refused")
    msd, osd = tsd.get_state_dict(model, optim)
    try:
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=refused)
        error = None
    except CheckpointException as e:  # raised on every rank (a BaseException)
        error = str(e)
    written = sorted(os.listdir(refused)) if os.path.isdir(refused) else []
    msd, osd = get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=os.path.join(folder, "ok"))
    buffer = io.BytesIO()
    torch.save(optim.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer, weights_only=True)
    same = max_diff({k: v for k, v in loaded["state"][0].items()},
                    {k: v for k, v in optim.state_dict()["state"][0].items()})
    plain = torch.optim.SGD(_fsdp(0).parameters(), lr=0.1)  # shardkit never saw it
    engine_error = _torch_save_of_initialize(os.path.join(folder, "engine"), rank, world)
    return error, written, same, len(plain._optimizer_state_dict_post_hooks), engine_error


def _torch_save_of_initialize(folder: str, rank: int, world: int):
    """The same through shardkit.initialize at stage 3 (a user's optimizer object)."""
    import shardkit
    model = _plain(0)
    config = {"train_micro_batch_size_per_gpu": LOCAL_BATCH, "steps_per_print": 10 ** 6,
              "zero_optimization": {"stage": 3}}
    engine, optim, _, _ = shardkit.initialize(
        model=model, optimizer=torch.optim.AdamW(model.parameters(), lr=0.05), config=config)
    x, y = _batch(0, world)
    cut = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    engine.backward(F.mse_loss(engine(x[cut]), y[cut]))
    engine.step()
    msd, osd = tsd.get_state_dict(engine.module, optim)
    try:
        dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder)
        refused = None
    except CheckpointException as e:
        refused = str(e)
    from shardkit.checkpoint import get_state_dict
    msd, osd = get_state_dict(engine, optim)  # the engine stands for its FSDP root
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=folder + "_ok")
    return refused


def bad_arguments():
    """Each bad argument's error message on this rank (all local: raised before any
    collective, so the world goes on)."""
    from shardkit.checkpoint import (StateDictOptions, get_model_state_dict,
                                     get_optimizer_state_dict, get_state_dict,
                                     set_state_dict)
    from shardkit.optim import OSS
    model = _fsdp(0)
    optim = torch.optim.AdamW(model.parameters(), lr=0.1)
    cases = {
        "options_type": lambda: get_state_dict(model, optim, options={"full_state_dict": True}),
        "broadcast": lambda: set_state_dict(
            model, optim, model_state_dict={}, optim_state_dict={},
            options=StateDictOptions(broadcast_from_rank0=True)),
        "flatten": lambda: get_optimizer_state_dict(
            model, optim, options=StateDictOptions(flatten_optimizer_state_dict=True)),
        "not_bool": lambda: get_model_state_dict(model, options=StateDictOptions(strict="yes")),
        "modifiers": lambda: get_model_state_dict(
            model, options=StateDictOptions(dsd_fqn_modifiers="mine")),
        "submodules": lambda: get_model_state_dict(model, submodules={model}),
        "optimizers": lambda: get_state_dict(model, []),
        "oss": lambda: get_state_dict(_plain(0), OSS(_plain(0).parameters(), lr=0.1)),
        "plain_root": lambda: get_model_state_dict(nn.Sequential(_fsdp(0))),
        "foreign": lambda: get_optimizer_state_dict(
            model, torch.optim.SGD(_plain(0).parameters(), lr=0.1)),
    }
    out = {}
    for name, call in cases.items():
        try:
            call()
            out[name] = None
        except (TypeError, ValueError) as e:
            out[name] = f"{type(e).__name__}: {e}"
    return out


def frozen_and_replicated(folder: str):
    """ignore_frozen_params over FSDP; ShardedDataParallel's replicated model state through
    dcp (its OSS optimizer is refused, naming the way that works)."""
    from shardkit.checkpoint import (StateDictOptions, get_model_state_dict,
                                     get_state_dict, set_model_state_dict)
    from shardkit.nn.data_parallel import ShardedDataParallel
    from shardkit.optim import OSS
    rank, world = _dist_rank_world()
    model = _plain(0)
    model[0].weight.requires_grad_(False)
    model = _fsdp_of(model)
    kept = sorted(get_model_state_dict(model, options=StateDictOptions(
        ignore_frozen_params=True)))
    plain = _plain(0)
    oss = OSS(plain.parameters(), optim=torch.optim.AdamW, lr=0.05)
    sddp = ShardedDataParallel(plain, oss)
    _train(sddp, [oss], 0, 1, rank, world)
    try:
        get_state_dict(sddp, oss)
        refused = None
    except ValueError as e:
        refused = str(e)
    msd = get_model_state_dict(sddp)
    dcp.save(msd, checkpoint_id=folder)
    fresh = _plain(4)
    other = ShardedDataParallel(fresh, OSS(fresh.parameters(), lr=0.1))
    target = get_model_state_dict(other)
    dcp.load(target, checkpoint_id=folder)
    set_model_state_dict(other, target)
    return kept, sorted(msd), refused, max_diff(plain, other.module)


def _fsdp_of(model):
    from shardkit.nn import FullyShardedDataParallel as FSDP
    return FSDP(model)


# ---------------------------------------------------------------------- tests


@pytest.mark.parametrize("two", [False, True], ids=["one_optim", "two_optims"])
def test_dcp_resume_at_world2_continues_as_uninterrupted(world2, tmp_path, two):
    results = world2.run(save_and_resume, str(tmp_path), two, two)  # cpu_offload with two
    for kinds, diff, same_groups, _ in results:
        assert kinds == ["DTensor"]  # every parameter and moment a DTensor: dcp-safe
        assert diff <= EXACT and same_groups


def test_dcp_world2_checkpoint_loads_in_one_process(world2, tmp_path):
    """Saved at world 2 (rows), loaded by one process into a plain model with torch's own
    functions: dcp joins the rows; training continues as the world-2 run did."""
    results = world2.run(save_and_resume, str(tmp_path), False, False)
    reference = results[0][3][0]
    model = _plain(3)
    optim = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    msd, osd = tsd.get_state_dict(model, optim)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=str(tmp_path))
    tsd.set_state_dict(model, optim, model_state_dict=state["model"],
                       optim_state_dict=state["optim"])
    _train(model, [optim], FIRST, THEN)
    assert max_diff(reference, _plainly(*tsd.get_state_dict(model, optim))[0]) <= CLOSE


def test_dcp_one_process_checkpoint_resumes_at_world2(world2, tmp_path):
    """Saved by one process (plain model, torch's functions), loaded at world 2."""
    model = _plain(0)
    optim = torch.optim.AdamW(model.parameters(), lr=0.05, weight_decay=0.01)
    _train(model, [optim], 0, FIRST)
    msd, osd = tsd.get_state_dict(model, optim)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=str(tmp_path))
    _train(model, [optim], FIRST, THEN)
    reference = _plainly(*tsd.get_state_dict(model, optim))[0]
    for tensors, _ in world2.run(resume_from, str(tmp_path)):
        assert max_diff(reference, tensors) <= CLOSE


@pytest.mark.parametrize("offload", [False, True], ids=["every_rank", "cpu_offload_rank0"])
def test_full_state_dict_round_trip(world2, offload):
    results = world2.run(full_round_trip, offload)
    (got0, shapes, diff0), (got1, _, diff1) = results
    assert got0 == (4, 2)
    assert shapes == {"0.weight": (7, 5), "0.bias": (7,), "2.weight": (3, 7), "2.bias": (3,)}
    assert got1 == ((0, 0) if offload else (4, 2))  # torch: cpu_offload -> rank 0 only
    assert diff0 <= EXACT and diff1 <= EXACT


def test_torch_get_state_dict_on_compose_optimizer_refused_by_dcp(world2, tmp_path):
    results = world2.run(torch_functions_on_compose, str(tmp_path))
    for error, written, same, hooks, engine_error in results:
        assert error is not None and "shardkit.checkpoint.get_state_dict" in error
        assert engine_error is not None and "shardkit.checkpoint.get_state_dict" in engine_error
        assert written == []  # refused before anything was written
        assert same == 0.0
        assert hooks == 0  # per instance: an optimizer shardkit never saw is left alone
    assert os.path.isfile(os.path.join(tmp_path, "ok", ".metadata"))


def test_bad_arguments_named_on_every_rank(world2):
    first, second = world2.run(bad_arguments)
    assert first == second
    expected = {
        "options_type": "options=dict",
        "broadcast": "full_state_dict=True",
        "flatten": "flatten_optimizer_state_dict=True",
        "not_bool": "strict='yes'",
        "modifiers": "dsd_fqn_modifiers='mine'",
        "submodules": "submodules=",
        "optimizers": "optimizers=list",
        "oss": "consolidate_state_dict",
        "plain_root": "pass the root",
        "foreign": "not parameters of the model",
    }
    for name, text in expected.items():
        assert first[name] is not None and text in first[name], (name, first[name])


def test_frozen_params_and_sharded_ddp_model_state(world2, tmp_path):
    for kept, keys, refused, diff in world2.run(frozen_and_replicated, str(tmp_path)):
        assert kept == ["0.bias", "2.bias", "2.weight"]
        assert keys == ["0.bias", "0.weight", "2.bias", "2.weight"]
        assert refused is not None and "consolidate_state_dict" in refused
        assert diff == 0.0


def factored_and_compiled() -> dict:
    """Adafactor's factored moments (computed from this rank's rows, shaped like neither the
    shard nor the parameter) are refused, not saved as replicated; a ``torch.compile``d FSDP
    root is taken as the root (torch's functions drop ``_orig_mod`` too)."""
    from shardkit.checkpoint import get_model_state_dict, get_optimizer_state_dict
    torch.manual_seed(0)
    model = _fsdp(0)
    adafactor = FactoredMoments(model.parameters(), lr=0.01)  # torch's Adafactor, renamed
    x, y = _batch(0, 1)
    nn.functional.mse_loss(model(x), y).backward()
    adafactor.step()
    out = {}
    try:
        get_optimizer_state_dict(model, adafactor)
        out["adafactor"] = None
    except ValueError as error:
        out["adafactor"] = str(error)
    out["compiled"] = sorted(get_model_state_dict(torch.compile(_fsdp(0))))
    return out


def test_factored_state_refused_and_compiled_root_taken(world2):
    for result in world2.run(factored_and_compiled):
        assert "(e.g. Adafactor's factored moments)" in result["adafactor"], result
        assert result["compiled"] == ["0.bias", "0.weight", "2.bias", "2.weight"], result
