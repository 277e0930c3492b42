"""Gradient clipping of the data-parallel wrappers under tensor parallelism, in one world of 4.

2 tensor x 2 data parallel: a ColumnParallelLinear -> RowParallelLinear -> LayerNorm model inside
OSS (+ torch DDP), ShardedDataParallel + OSS, or FSDP over the data-parallel group. Their own
clipping (``OSS.clip_grad_norm``, ``FullyShardedDataParallel.clip_grad_norm_``) must return the
norm of the unsplit model on every rank and clip as ``torch.nn.utils.clip_grad_norm_`` does in one
process over the same global batch: split weights counted once per slice, replicated ones (the
LayerNorm, the row-parallel bias) once in all, so the replicas stay equal.
"""

import math

import pytest
import torch
import torch.nn as nn

from shardkit.distributed import CommCounter
from shardkit.nn import model_parallel as mp
from shardkit.nn.data_parallel import ShardingStrategy
from shardkit.nn.model_parallel.full_state import full_model_state_dict
from shardkit.testing import world_fixture

MAX_NORM, LR, STEPS, BATCH, WIDTH = 0.05, 0.1, 3, 8, 8
TOL = 1e-5
WRAPPERS = ("oss_ddp", "sharded_ddp", "fsdp", "fsdp_mixed_strategies")

world4 = world_fixture(4)


def _tensor_parallel_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(mp.ColumnParallelLinear(WIDTH, 2 * WIDTH, gather_output=False), nn.ReLU(),
                         mp.RowParallelLinear(2 * WIDTH, WIDTH, input_is_parallel=True),
                         nn.LayerNorm(WIDTH))


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(BATCH, WIDTH, generator=g), torch.randn(BATCH, WIDTH, generator=g)


def _loss(out, target):
    return ((out - target) ** 2).mean()


def _reference_run(full_state: dict):
    """The unsplit model in one process, clipped by torch before each SGD step over the whole
    batch: (final state, clipped norms, first step's 1- and inf-norms)."""
    ref = nn.Sequential(nn.Linear(WIDTH, 2 * WIDTH), nn.ReLU(), nn.Linear(2 * WIDTH, WIDTH),
                        nn.LayerNorm(WIDTH))
    ref.load_state_dict(full_state)
    opt = torch.optim.SGD(ref.parameters(), lr=LR)
    norms, other_norms = [], {}
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        _loss(ref(x), y).backward()
        if step == 0:
            grads = [p.grad for p in ref.parameters()]
            other_norms = {p: torch.nn.utils.get_total_norm(grads, p).item()
                           for p in (1.0, math.inf)}
        norms.append(torch.nn.utils.clip_grad_norm_(ref.parameters(), MAX_NORM).item())
        opt.step()
    return ref.state_dict(), norms, other_norms


def _wrap(model: nn.Module, wrapper: str, group):
    """(callable model, optimizer, clip function) over the data-parallel ``group``."""
    from torch.nn.parallel import DistributedDataParallel

    from shardkit.nn.data_parallel import FullyShardedDataParallel, ShardedDataParallel
    from shardkit.optim import OSS

    if wrapper.startswith("fsdp"):
        if wrapper == "fsdp_mixed_strategies":  # a NO_SHARD unit under a FULL_SHARD root
            model[0] = FullyShardedDataParallel(model[0], process_group=group,
                                                sharding_strategy=ShardingStrategy.NO_SHARD)
        wrapped = FullyShardedDataParallel(model, process_group=group)
        return wrapped, torch.optim.SGD(wrapped.parameters(), lr=LR), wrapped.clip_grad_norm_
    opt = OSS(model.parameters(), optim=torch.optim.SGD, group=group, lr=LR)
    wrapped = (ShardedDataParallel(model, opt, process_group=group) if wrapper == "sharded_ddp"
               else DistributedDataParallel(model, process_group=group))
    return wrapped, opt, opt.clip_grad_norm


def _clipped_training(wrapper: str) -> dict:
    """Train STEPS clipped steps with ``wrapper`` over the data-parallel group; compare the
    norms and the final unsplit weights with the one-process reference."""
    model = _tensor_parallel_model()
    ref_state, ref_norms, ref_other_norms = _reference_run(full_model_state_dict(model))
    group = mp.get_data_parallel_group()
    wrapped, opt, clip = _wrap(model, wrapper, group)
    half = BATCH // mp.get_data_parallel_world_size()
    lo = mp.get_data_parallel_rank() * half
    out = {"norms": [], "ref_norms": ref_norms}
    for step in range(STEPS):
        x, y = _batch(step)
        opt.zero_grad()
        _loss(wrapped(x[lo:lo + half]), y[lo:lo + half]).backward()
        if step == 0:  # measuring only (max_norm=inf) leaves the gradients as they are
            out["other_norms"] = {p: clip(math.inf, norm_type=p).item() for p in (1.0, math.inf)}
            out["ref_other_norms"] = ref_other_norms
        with CommCounter() as comm:
            out["norms"].append(clip(MAX_NORM).item())
        out["clip_calls"] = [(r.op, r.numel, r.group_size) for r in comm.calls]
        opt.step()
    if wrapper.startswith("fsdp"):
        with wrapped.summon_full_params():
            state, layer_norm = full_model_state_dict(model), model[3].weight.detach().clone()
    else:
        state, layer_norm = full_model_state_dict(model), model[3].weight.detach().clone()
    out["param_diff"] = max((state[k] - ref_state[k]).abs().max().item() for k in ref_state)
    out["layer_norm_weight"] = layer_norm
    return out


def _every_wrapper():
    mp.initialize_model_parallel(2)
    try:
        return {wrapper: _clipped_training(wrapper) for wrapper in WRAPPERS}
    finally:
        mp.destroy_model_parallel()


@pytest.fixture(scope="module")
def trained(world4):
    return world4.run(_every_wrapper)


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_wrapper_clips_by_the_unsplit_models_norm(trained, wrapper):
    for rank, res in enumerate(trained):
        r = res[wrapper]
        assert min(r["ref_norms"]) > MAX_NORM  # every step really clips
        for norm, ref in zip(r["norms"], r["ref_norms"]):
            assert abs(norm - ref) <= TOL * ref, (rank, r["norms"], r["ref_norms"])
        for p, ref in r["ref_other_norms"].items():
            assert abs(r["other_norms"][p] - ref) <= TOL * ref, (rank, p, r["other_norms"], ref)
        assert r["param_diff"] <= TOL, (rank, r["param_diff"])


@pytest.mark.parametrize("wrapper", WRAPPERS)
def test_replicated_weights_stay_equal_across_tensor_parallel_ranks(trained, wrapper):
    # ranks 0 and 1 (and 2 and 3) are one tensor-parallel group, each holding the LayerNorm
    for a, b in ((0, 1), (2, 3)):
        assert torch.equal(trained[a][wrapper]["layer_norm_weight"],
                           trained[b][wrapper]["layer_norm_weight"])


@pytest.mark.parametrize("wrapper", ("oss_ddp", "sharded_ddp", "fsdp"))
def test_tensor_parallelism_costs_one_more_one_element_all_reduce(trained, wrapper):
    for res in trained:
        assert res[wrapper]["clip_calls"] == [("all_reduce", 1, 2), ("all_reduce", 1, 2)]


def _plain_model_and_misuse():
    """A model without tensor-parallel layers clips as before (one all-reduce); OSS over the
    whole world around a tensor-parallel model is an error when it is built, raised through its
    construction agreement, before any data moves (the engine runs over the data-parallel
    group: tests/test_engine_tensor_parallel.py)."""
    from shardkit.optim import OSS

    out = {}
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.LayerNorm(WIDTH))
    opt = OSS(plain.parameters(), optim=torch.optim.SGD, lr=LR)
    plain(torch.ones(2, WIDTH)).sum().backward()
    with CommCounter() as comm:
        opt.clip_grad_norm(MAX_NORM)
    out["plain_calls"] = [(r.op, r.numel, r.group_size) for r in comm.calls]
    mp.initialize_model_parallel(2)
    try:
        model = _tensor_parallel_model()
        with CommCounter() as comm:
            try:
                OSS(model.parameters(), optim=torch.optim.SGD, lr=LR)
            except ValueError as e:
                out["world_error"] = str(e)
        out["collectives_before_errors"] = [r.op for r in comm.calls]
    finally:
        mp.destroy_model_parallel()
    return out


def test_plain_model_unchanged_and_misuse_refused(world4):
    for r in world4.run(_plain_model_and_misuse):
        assert r["plain_calls"] == [("all_reduce", 1, 4)], r
        assert "get_data_parallel_group()" in r.get("world_error", ""), r
        assert "tensor-parallel group" in r["world_error"], r
        # only OSS's construction agreement (one object all-gather), which carries the refusal
        # to every rank of the group: a rank without such layers would otherwise wait there
        assert r["collectives_before_errors"] == ["all_gather"], r
