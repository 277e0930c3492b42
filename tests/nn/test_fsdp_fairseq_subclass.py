"""fairseq's FSDP subclass (fairseq/distributed/fully_sharded_data_parallel.py) over shardkit's.

fairseq subclasses FairScale's FullyShardedDataParallel, wraps every layer and the model with
``enable_wrap(wrapper_cls=<subclass>, ...)`` / ``wrap``, and overrides ``state_dict`` and
``load_state_dict``: rank 0 returns the full dict, every other rank calls
``super().state_dict()`` without arguments "due to use of communication primitives" and returns
``destination or {}``; with ``use_sharded_state`` it returns ``local_state_dict`` and loads with
``load_local_state_dict(state_dict, strict=strict)``. Each unit, inner ones too, is the subclass,
so the other ranks' inner units call ``super().state_dict()`` while the root builds its dict:
that hung (their gather paired with another unit's on rank 0) and ``strict=`` was a TypeError.
fairseq's trainer also passes its own optimizer wrapper (``FairseqOptimizer``, or the fp16
optimizer around it, whose ``state_dict()`` adds ``loss_scale``) to
``gather_full_optim_state_dict`` and loads ``get_shard_from_optim_state_dict``'s result through
it, as FairScale's duck typing allowed: that was a TypeError ("expected the torch.optim.Optimizer").
Checked against one process on the global batch; one World(2).
"""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as skd
from shardkit.nn import FullyShardedDataParallel as FSDP
from shardkit.nn.wrap import enable_wrap, wrap
from shardkit.testing import world_fixture

world2 = world_fixture(2, timeout=90)


class FairseqFSDP(FSDP):
    """fairseq's subclass, as written there (FairScale's FSDP replaced by shardkit's)."""

    def __init__(self, *args, is_moe: bool = None, use_sharded_state: bool = False, **kwargs):
        super().__init__(*args, **kwargs)
        self.is_moe = is_moe
        self.use_sharded_state = use_sharded_state

    def state_dict(self, destination=None, prefix="", keep_vars=False):
        if self.use_sharded_state:
            return super().local_state_dict(destination=destination, prefix=prefix,
                                            keep_vars=keep_vars)
        if self.rank == 0:
            return super().state_dict(destination=destination, prefix=prefix,
                                      keep_vars=keep_vars)
        super().state_dict()  # "we must call state_dict() due to use of communication"
        return destination or {}

    def load_state_dict(self, state_dict, strict=True, model_cfg=None):
        if self.use_sharded_state:
            return super().load_local_state_dict(state_dict, strict=strict)
        box = [state_dict]
        torch.distributed.broadcast_object_list(box, src=0)
        return super().load_state_dict(box[0], strict=strict)


class _Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.fc1, self.fc2 = nn.Linear(6, 9), nn.Linear(9, 6)

    def forward(self, x):
        return x + self.fc2(torch.relu(self.fc1(x)))


def _net(seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 6), _Layer(), _Layer(), nn.Linear(6, 3))


def _wrapped(seed: int, use_sharded_state: bool) -> nn.Module:
    model = _net(seed)
    with enable_wrap(wrapper_cls=FairseqFSDP, use_sharded_state=use_sharded_state, is_moe=False,
                     reshard_after_forward=True, mixed_precision=False, flatten_parameters=True,
                     compute_dtype=torch.float32, state_dict_device=torch.device("cpu")):
        for i in (1, 2):
            model[i] = wrap(model[i])
        return wrap(model)


def _train(reference, model, steps: int = 2) -> None:
    rank, world = skd.get_rank(), skd.get_world_size()
    ref_optim = torch.optim.Adam(reference.parameters(), lr=1e-2)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    for step in range(steps):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
        for net, opt, xb, yb in ((reference, ref_optim, x, y),
                                 (model, optim, x.chunk(world)[rank], y.chunk(world)[rank])):
            opt.zero_grad()
            F.mse_loss(net(xb), yb).backward()
            opt.step()


class _FairseqOptimizer:
    """fairseq's optimizer wrapper (not a torch optimizer) with its fp16 subclass's loss scale."""

    def __init__(self, params):
        self._optimizer = torch.optim.Adam(params, lr=1e-2)
        self.loss_scale = 128.0

    @property
    def optimizer(self):
        return self._optimizer

    @property
    def param_groups(self):
        return self.optimizer.param_groups

    def state_dict(self):
        return dict(self.optimizer.state_dict(), loss_scale=self.loss_scale)

    def load_state_dict(self, state_dict, optimizer_overrides=None):
        self.loss_scale = state_dict["loss_scale"]
        self.optimizer.load_state_dict(state_dict)


def _worst(full: dict, reference: nn.Module) -> float:
    assert sorted(full) == sorted(reference.state_dict())
    return max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())


def _full_state_on_rank0(_=None) -> dict:
    reference, model = _net(0), _wrapped(0, use_sharded_state=False)
    _train(reference, model)
    saved = model.state_dict()
    out = {"kinds": sorted({type(m).__name__ for m in model.modules() if isinstance(m, FSDP)}),
           "empty": not saved, "diff": _worst(saved, reference) if saved else None}
    fresh = _wrapped(3, use_sharded_state=False)
    fresh.load_state_dict(saved if skd.get_rank() == 0 else None)
    again = fresh.state_dict()
    out["reloaded"] = _worst(again, reference) if again else None
    return out


def _sharded_state(_=None) -> dict:
    reference, model = _net(0), _wrapped(0, use_sharded_state=True)
    _train(reference, model)
    local, meta = model.state_dict(), model.local_metadata_dict()
    fresh = _wrapped(3, use_sharded_state=True)
    result = fresh.load_state_dict(copy.deepcopy(local))
    shards = [None, None]
    torch.distributed.all_gather_object(shards, (local, meta))
    full = FSDP.consolidate_shard_weights(shard_weights=[s[0] for s in shards],
                                          shard_metadata=[s[1] for s in shards], strict=False)
    with FSDP.summon_full_params(fresh):
        reloaded = {k: v.clone() for k, v in fresh.module.state_dict().items()}
    partial = {k: v for k, v in local.items() if k != "3.bias"}
    lenient = FSDP.load_local_state_dict(fresh, partial, False)  # FairScale's positional strict
    return {"keys": (list(result.missing_keys), list(result.unexpected_keys)),
            "lenient": (list(lenient.missing_keys), list(lenient.unexpected_keys)),
            "consolidated": _worst(full, reference), "reloaded": _worst(reloaded, reference)}


def _optimizer_through_fairseqs_wrapper(_=None) -> dict:
    rank, world = skd.get_rank(), skd.get_world_size()
    reference, model = _net(0), _wrapped(0, use_sharded_state=False)
    ref_optim, optim = torch.optim.Adam(reference.parameters(), lr=1e-2), \
        _FairseqOptimizer(model.parameters())
    steps = []
    for step in range(4):
        if step == 2:  # fairseq's consolidate_optimizer, save, and load on every rank
            saved = model.gather_full_optim_state_dict(optim)  # only returns on rank 0
            box = [saved]
            torch.distributed.broadcast_object_list(box, src=0)
            weights = {k: v.clone() for k, v in model.state_dict().items()}
            model = _wrapped(3, use_sharded_state=False)
            model.load_state_dict(weights if rank == 0 else None)
            optim = _FairseqOptimizer(model.parameters())
            optim.loss_scale = 1.0
            optim.load_state_dict(model.get_shard_from_optim_state_dict(box[0]))
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 5, generator=g), torch.randn(4, 3, generator=g)
        for net, opt, xb, yb in ((reference, ref_optim, x, y),
                                 (model, optim.optimizer, x.chunk(world)[rank],
                                  y.chunk(world)[rank])):
            opt.zero_grad()
            F.mse_loss(net(xb), yb).backward()
            opt.step()
        with FSDP.summon_full_params(model):
            full = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                    for n, p in model.module.named_parameters()}
        steps.append(max((full[n] - p).abs().max().item()
                         for n, p in reference.named_parameters()))
    return {"loss_scale": optim.loss_scale, "steps": steps,
            "saved_keys": sorted(box[0]) if rank == 0 else None}


def test_full_state_dict_saved_on_rank0_as_fairseq_does(world2):
    zero, one = world2.run(_full_state_on_rank0)
    assert zero["kinds"] == ["FairseqFSDP"]
    assert not zero["empty"] and one["empty"]
    assert zero["diff"] == pytest.approx(0.0, abs=1e-6)
    assert zero["reloaded"] == pytest.approx(0.0, abs=1e-6) and one["reloaded"] is None


def test_use_sharded_state_loads_with_strict_as_fairseq_does(world2):
    for r in world2.run(_sharded_state):
        assert r["keys"] == ([], [])
        assert r["lenient"] == (["3.bias"], [])
        assert r["consolidated"] == pytest.approx(0.0, abs=1e-6)
        assert r["reloaded"] == pytest.approx(0.0, abs=1e-6)


def test_optimizer_state_through_fairseqs_optimizer_wrapper(world2):
    results = world2.run(_optimizer_through_fairseqs_wrapper)
    assert "loss_scale" in results[0]["saved_keys"]
    for r in results:
        assert r["loss_scale"] == 128.0
        assert r["steps"] == [pytest.approx(0.0, abs=1e-6)] * 4


def _scheduler_passed_as_optimizer(_=None) -> str:
    model = _wrapped(0, use_sharded_state=False)
    optim = torch.optim.Adam(model.parameters(), lr=1e-2)
    scheduler = torch.optim.lr_scheduler.StepLR(optim, step_size=1)
    try:
        model.gather_full_optim_state_dict(scheduler)
    except TypeError as error:
        return str(error)
    return "gathered"


def test_an_lr_scheduler_is_not_taken_for_an_optimizer_wrapper(world2):
    # a scheduler holds its optimizer as .optimizer too, but its state_dict is no optimizer's
    for message in world2.run(_scheduler_passed_as_optimizer):
        assert "gather_full_optim_state_dict(optim=StepLR): expected the torch.optim" \
            in message, message
