"""checkpoint_wrapper composes with FullyShardedDataParallel, inside and outside a unit."""

import pytest
import torch
import torch.nn as nn

from shardkit import distributed as dist
from shardkit.nn.checkpoint import checkpoint_wrapper
from shardkit.testing import world_fixture


world2 = world_fixture(2)


def _blocks(seed=0):
    torch.manual_seed(seed)
    return [nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Dropout(0.2), nn.Linear(16, 16))
            for _ in range(3)]


def _build(variant):
    from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP

    units = []
    for block in _blocks():
        if variant == "checkpoint inside FSDP":
            units.append(FSDP(checkpoint_wrapper(block)))
        elif variant == "checkpoint outside FSDP":
            units.append(checkpoint_wrapper(FSDP(block)))
        else:
            units.append(FSDP(block))
    return FSDP(nn.Sequential(*units, nn.Linear(16, 2)))


def _train(variant):
    model = _build(variant)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        g = torch.Generator().manual_seed(100 * step + dist.get_rank())
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 2, generator=g)
        torch.manual_seed(step)  # the same dropout masks in every variant
        opt.zero_grad()
        loss = nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, [p.detach().clone() for p in model.parameters()]


def _compare_variant(variant):
    ref_losses, ref_params = _train("no checkpoint")
    try:
        losses, params = _train(variant)
    except Exception as error:  # reported to the test, which decides
        return f"{type(error).__name__}: {str(error).splitlines()[0]}"
    return (max(abs(a - b) for a, b in zip(losses, ref_losses)),
            max((a - b).abs().max().item() for a, b in zip(params, ref_params)))


@pytest.mark.parametrize("variant", ["checkpoint inside FSDP", "checkpoint outside FSDP"])
def test_fsdp_with_checkpoint_matches_fsdp_without(world2, variant):
    for result in world2.run(_compare_variant, variant):
        assert not isinstance(result, str), result
        loss_diff, param_diff = result
        assert loss_diff <= 1e-6 and param_diff <= 1e-6, (variant, loss_diff, param_diff)


def _gathers_per_step(variant):
    """All-gathered bytes and the peak of gathered parameters in a step once the units' order
    is known (the second: prefetching on)."""
    from shardkit.distributed import CommCounter
    from shardkit.nn.data_parallel.flat_param import gathered_param_bytes
    model = _build(variant)
    x = torch.randn(8, 16, generator=torch.Generator().manual_seed(dist.get_rank()))
    model(x).pow(2).mean().backward()
    gathered_param_bytes().reset_peak()
    with CommCounter() as comm:
        model(x).pow(2).mean().backward()
    return comm.by_op["all_gather"], gathered_param_bytes().peak


def test_a_recompute_prefetches_what_backward_needs_next(world2):
    # checkpoint_wrapper(FSDP(block)): the recomputed forward of each unit used to prefetch the
    # unit after it in forward order, which backward had already freed (33% more all-gather
    # bytes here, three units gathered at the peak instead of two)
    for plain, outside in zip(world2.run(_gathers_per_step, "no checkpoint"),
                              world2.run(_gathers_per_step, "checkpoint outside FSDP")):
        assert outside == plain, (outside, plain)
