"""FSDP's ``SHARDED_STATE_DICT`` optimizer state loaded through torch.distributed.checkpoint
into an optimizer that has not stepped yet.

A user resuming with torch FSDP1's pattern builds a fresh optimizer and writes::

    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
        dcp.load(state, ...)
        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, state["optim"]))

A fresh Adam has no state tensors, so ``dcp.load`` had nothing to load the checkpoint's moments
into and the load went through with none of them: training went on from restarted moments and
step counts, silently. Now ``optim_state_dict_to_load`` refuses that dict on every rank, naming
the fix (``init_optimizer_state`` first), with nothing loaded; with the fix the resumed run
continues exactly as the uninterrupted one. SGD without momentum, which keeps no state, loads
as before. torch FSDP1's older names for the same dicts, ``FSDP.sharded_optim_state_dict`` and
``FSDP.flatten_sharded_optim_state_dict``, were missing (AttributeError); they round-trip
through dcp at world 2 and 1. One World(2).

From a review:

A fresh optimizer's ``SHARDED_STATE_DICT`` optimizer state that ``dcp.load`` left empty,
on the load paths next to ``optim_state_dict_to_load`` under ``SHARDED_STATE_DICT``.

``FSDP.optim_state_dict(model, optim)`` of an optimizer that has not stepped yet has no
tensor for ``dcp.load`` to fill, so the checkpoint's moments and step counts never arrive.
Only ``optim_state_dict_to_load`` under ``SHARDED_STATE_DICT`` refused that dict: the same
dict loaded silently, with no state, when loaded under the model's default
``FULL_STATE_DICT`` (the call outside the ``state_dict_type`` block), with ``rank0_only``,
through ``shardkit.checkpoint.set_optimizer_state_dict``, or after ``copy.deepcopy``. Now
each refuses it on every rank, nothing loaded. ``FSDP.sharded_optim_state_dict(group=...)``
named ``optim_state_dict`` in its refusal. One World(2).
"""

import copy
import io

import torch
import torch.nn as nn

from shardkit import distributed as skd
from shardkit.checkpoint import torch_state_dict
from shardkit.checkpoint.dtensor_state import init_optimizer_state
from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP, StateDictType
from shardkit.nn.data_parallel.fsdp_state_dict_type import (FullOptimStateDictConfig,
                                                            FullStateDictConfig)
from shardkit.testing import world_fixture

WIDTH = 6

world2 = world_fixture(2, timeout=120)


# ---------------------------------------------------------------------- rank-side helpers


def _model(seed: int, group=None) -> FSDP:
    """Two nested units (7 and 5 rows: padded at world 2) in a root unit."""
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(WIDTH, 7), nn.Tanh(), nn.Linear(7, 5))
    m[0], m[2] = FSDP(m[0], process_group=group), FSDP(m[2], process_group=group)
    return FSDP(m, process_group=group)


def _optim(model, kind: str = "adam") -> torch.optim.Optimizer:
    if kind == "sgd":  # keeps no tensor state: a fresh one loses nothing
        return torch.optim.SGD(model.parameters(), lr=0.05)
    return torch.optim.Adam(model.parameters(), lr=0.05)


def _step(model, optim, step: int, group=None) -> None:
    gen = torch.Generator().manual_seed(300 + step)
    x, y = torch.randn(4, WIDTH, generator=gen), torch.randn(4, 5, generator=gen)
    per = 4 // skd.get_world_size(group)
    rows = slice(per * skd.get_rank(group), per * (skd.get_rank(group) + 1))
    loss = ((model(x[rows]) - y[rows]) ** 2).mean()
    optim.zero_grad()
    loss.backward()
    optim.step()


def _full(model) -> dict:
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
        return {k: v.clone() for k, v in model.state_dict().items()}


def _diff(a: dict, b: dict) -> float:
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _load_through_dcp(model, optim, folder: str) -> None:
    import torch.distributed.checkpoint as dcp
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)}
        dcp.load(state, storage_reader=dcp.FileSystemReader(folder))
        model.load_state_dict(state["model"])
        optim.load_state_dict(FSDP.optim_state_dict_to_load(model, optim, state["optim"]))


def _resume_into_fresh_optimizer(folder: str, kind: str) -> dict:
    import torch.distributed.checkpoint as dcp
    model = _model(1)
    optim = _optim(model, kind)
    for step in range(2):
        _step(model, optim, step)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        dcp.save({"model": model.state_dict(), "optim": FSDP.optim_state_dict(model, optim)},
                 storage_writer=dcp.FileSystemWriter(folder))
    for step in range(2, 4):
        _step(model, optim, step)
    uninterrupted = _full(model)
    out = {}

    fresh = _model(2)
    fresh_optim = _optim(fresh, kind)
    with FSDP.state_dict_type(fresh, StateDictType.SHARDED_STATE_DICT):
        buffer = io.BytesIO()  # a save before the first step still loads with weights_only
        torch.save(FSDP.optim_state_dict(fresh, fresh_optim), buffer)
    buffer.seek(0)
    out["fresh dict through torch.save"] = torch.load(buffer, weights_only=True)["state"]
    try:
        _load_through_dcp(fresh, fresh_optim, folder)
        out["fresh"] = "loaded"
        for step in range(2, 4):
            _step(fresh, fresh_optim, step)
        out["fresh vs uninterrupted"] = _diff(_full(fresh), uninterrupted)
    except ValueError as error:
        out["fresh"] = str(error)
    out["fresh optimizer state after"] = len(fresh_optim.state)
    alive = torch.ones(1)
    torch.distributed.all_reduce(alive)  # no rank left inside a collective
    out["alive"] = alive.item()

    resumed = _model(3)
    resumed_optim = _optim(resumed, kind)
    init_optimizer_state(resumed_optim)  # the documented fix: state tensors for dcp to fill
    _load_through_dcp(resumed, resumed_optim, folder)
    for step in range(2, 4):
        _step(resumed, resumed_optim, step)
    out["resumed vs uninterrupted"] = _diff(_full(resumed), uninterrupted)
    return out


def _legacy_sharded_names(folder: str) -> dict:
    """torch FSDP1's ``sharded_optim_state_dict`` / ``flatten_sharded_optim_state_dict``
    through dcp, saved at world 2, loaded at world 2 and at world 1 (each rank alone)."""
    import torch.distributed.checkpoint as dcp
    model = _model(1)
    optim = _optim(model)
    for step in range(2):
        _step(model, optim, step)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"model": model.state_dict()}
    state["optim"] = FSDP.sharded_optim_state_dict(model, optim)
    dcp.save(state, storage_writer=dcp.FileSystemWriter(folder))
    out = {"settings after": FSDP.get_state_dict_type(model).state_dict_type.name}
    for step in range(2, 4):
        _step(model, optim, step)
    uninterrupted = _full(model)
    for world, group in ((2, None), (1, skd.single_rank_group())):
        resumed = _model(3, group)
        resumed_optim = _optim(resumed)
        init_optimizer_state(resumed_optim)
        with FSDP.state_dict_type(resumed, StateDictType.SHARDED_STATE_DICT):
            state = {"model": resumed.state_dict(),
                     "optim": FSDP.sharded_optim_state_dict(resumed, resumed_optim)}
            dcp.load(state, storage_reader=dcp.FileSystemReader(folder), process_group=group)
            resumed.load_state_dict(state["model"])
        resumed_optim.load_state_dict(FSDP.flatten_sharded_optim_state_dict(
            state["optim"], resumed, resumed_optim))
        for step in range(2, 4):
            _step(resumed, resumed_optim, step, group)
        out[f"world {world} vs uninterrupted"] = _diff(_full(resumed), uninterrupted)
    return out


# ---------------------------------------------------------------------- tests


def test_fresh_optimizer_dict_filled_by_dcp_is_refused(world2, tmp_path):
    for r in world2.run(_resume_into_fresh_optimizer, str(tmp_path / "adam"), "adam"):
        assert "nothing was loaded on any rank" in r["fresh"], r
        assert "on ranks [0, 1]" in r["fresh"], r
        assert "had no state yet" in r["fresh"] and "init_optimizer_state(optim)" in r["fresh"], r
        assert r["fresh optimizer state after"] == 0, r
        assert r["fresh dict through torch.save"] == {}, r
        assert r["alive"] == 2.0, r
        assert r["resumed vs uninterrupted"] == 0.0, r
    # SGD without momentum has no state to lose: its fresh optimizer's dict loads as before
    for r in world2.run(_resume_into_fresh_optimizer, str(tmp_path / "sgd"), "sgd"):
        assert r["fresh"] == "loaded" and r["fresh vs uninterrupted"] == 0.0, r
        assert r["resumed vs uninterrupted"] == 0.0, r


def test_torch_fsdp1_sharded_optim_state_dict_names(world2, tmp_path):
    for r in world2.run(_legacy_sharded_names, str(tmp_path)):
        assert r["settings after"] == "FULL_STATE_DICT", r  # the model's own, unchanged
        assert r["world 2 vs uninterrupted"] == 0.0, r
        assert r["world 1 vs uninterrupted"] < 1e-6, r


def _model_rev(seed: int) -> FSDP:
    torch.manual_seed(seed)
    m = nn.Sequential(nn.Linear(6, 7), nn.Tanh(), nn.Linear(7, 5))
    m[0], m[2] = FSDP(m[0]), FSDP(m[2])
    return FSDP(m)


def _save_stepped_checkpoint(folder: str) -> None:
    import torch.distributed.checkpoint as dcp
    model = _model_rev(1)
    optim = torch.optim.Adam(model.parameters(), lr=0.05)
    model(torch.randn(3, 6)).pow(2).mean().backward()
    optim.step()
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        dcp.save({"optim": FSDP.optim_state_dict(model, optim)},
                 storage_writer=dcp.FileSystemWriter(folder))


def _outcome(load) -> str:
    try:
        load()
        return "loaded"
    except ValueError as error:
        return str(error)


def _fresh_dict_on_other_load_paths(folder: str) -> dict:
    """Each load path given a fresh optimizer's sharded dict after ``dcp.load``."""
    import torch.distributed.checkpoint as dcp
    _save_stepped_checkpoint(folder)
    model = _model_rev(2)
    optim = torch.optim.Adam(model.parameters(), lr=0.05)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state = {"optim": FSDP.optim_state_dict(model, optim)}
    dcp.load(state, storage_reader=dcp.FileSystemReader(folder))
    filled = state["optim"]
    rank0_only = (StateDictType.FULL_STATE_DICT, FullStateDictConfig(rank0_only=True),
                  FullOptimStateDictConfig(rank0_only=True))
    out = {}
    out["default settings"] = _outcome(lambda: optim.load_state_dict(
        FSDP.optim_state_dict_to_load(model, optim, filled)))
    with FSDP.state_dict_type(model, *rank0_only):
        given = filled if torch.distributed.get_rank() == 0 else {}
        out["rank0_only"] = _outcome(lambda: optim.load_state_dict(
            FSDP.optim_state_dict_to_load(model, optim, given)))
    out["set_optimizer_state_dict"] = _outcome(
        lambda: torch_state_dict.set_optimizer_state_dict(model, optim, filled))
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        for name, copied in (("deepcopy", copy.deepcopy(filled)),
                             ("copy of its state", dict(filled, state=copy.copy(filled["state"])))):
            out[name] = _outcome(lambda: optim.load_state_dict(
                FSDP.optim_state_dict_to_load(model, optim, copied)))
    out["optimizer state after"] = len(optim.state)
    out["group"] = _outcome(lambda: FSDP.sharded_optim_state_dict(
        model, optim, group=torch.distributed.group.WORLD))
    alive = torch.ones(1)
    torch.distributed.all_reduce(alive)  # no rank left inside a collective
    out["alive"] = alive.item()
    return out


def test_fresh_dict_refused_on_every_load_path(world2, tmp_path):
    paths = ("default settings", "rank0_only", "set_optimizer_state_dict", "deepcopy",
             "copy of its state")
    for r in world2.run(_fresh_dict_on_other_load_paths, str(tmp_path)):
        for path in paths:
            assert "nothing was loaded on any rank" in r[path], (path, r)
            assert "had no state yet" in r[path], (path, r)
            assert "init_optimizer_state(optim)" in r[path], (path, r)
        assert "on ranks [0, 1]" in r["default settings"], r
        assert r["optimizer state after"] == 0, r
        assert r["group"].startswith("FSDP.sharded_optim_state_dict(group=...)"), r
        assert r["alive"] == 2.0, r


class _SignSGD(torch.optim.Optimizer):
    """A user's optimizer that keeps no state at all."""

    def __init__(self, params, lr=0.05):
        super().__init__(params, {"lr": lr})

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad.sign(), alpha=-group["lr"])


def _stateless_users_optimizer_round_trip() -> dict:
    """Its sharded dict, saved after two steps, loads back into a fresh one (it was marked as
    a fresh optimizer's and refused for good: no state ever comes)."""
    model = _model(0)
    optim = _SignSGD(model.parameters())
    for step in range(2):
        _step(model, optim, step)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        osd = FSDP.optim_state_dict(model, optim)
        fresh = _SignSGD(model.parameters())
        try:
            fresh.load_state_dict(FSDP.optim_state_dict_to_load(model, fresh, osd))
            return {"outcome": "loaded"}
        except ValueError as error:
            return {"outcome": str(error)}


def test_a_users_stateless_optimizer_is_not_taken_for_a_fresh_one(world2):
    for r in world2.run(_stateless_users_optimizer_round_trip):
        assert r["outcome"] == "loaded", r
