"""FSDP(auto_wrap per block) + AdamW against single-process training on the same global batch:
10 steps, nested units, a tied embedding, a frozen layer, reshard_after_forward True/False,
no_sync accumulation and gradient clipping, over the default transport and the shared-memory
one; worlds 1, 2 and 4. Every rank compares its own shard of every parameter with the matching
rows of the single-process model after every step."""

import torch

from shardkit.testing import world_fixture
from tests.nn.fsdp_common import (build_gpt, make_optimizer, max_diff, shard_diff, train_step,
                                  wrap_gpt)

STEPS = 10
GRID = [  # (reshard_after_forward, micro_batches with no_sync, clip, transport)
    (True, 1, None, "process_group"),
    (False, 1, 0.05, "process_group"),
    (True, 2, 0.05, "process_group"),
    (False, 2, None, "process_group"),
    (True, 1, 0.05, "shared_memory"),
    (False, 2, None, "shared_memory"),
]


def _transport(kind):
    if kind == "shared_memory":  # small parts: every unit takes several rounds
        from shardkit.shm_transport import SharedMemoryTransport
        return SharedMemoryTransport(part_bytes=8192)
    return None


world2 = world_fixture(2)


world4 = world_fixture(4)


def _parity_grid():
    """Every configuration of GRID: largest abs difference of parameters, losses, norms."""
    results = []
    for reshard, micro, clip, kind in GRID:
        reference = build_gpt()
        ref_optim = make_optimizer(reference)
        model = wrap_gpt(build_gpt(), reshard_after_forward=reshard, comm=_transport(kind))
        optim = make_optimizer(model)
        worst_loss = worst_norm = worst_shard = 0.0
        for step in range(STEPS):
            ref_loss, ref_norm = train_step(reference, ref_optim, step, micro_batches=micro,
                                            clip=clip, local=False)
            loss, norm = train_step(model, optim, step, micro_batches=micro, clip=clip,
                                    sync=model.no_sync)
            local_mean = torch.tensor([loss.item()])
            from shardkit import distributed as skdist
            skdist.all_reduce(local_mean)
            worst_loss = max(worst_loss, abs(local_mean.item() / skdist.get_world_size()
                                             - ref_loss.item()))
            if clip is not None:
                worst_norm = max(worst_norm, abs(norm.item() - ref_norm.item()))
            worst_shard = max(worst_shard, shard_diff(model, reference))
        diff = max_diff(model.state_dict(), reference.state_dict())
        frozen = dict(model.named_parameters())["blocks.0.ln1.weight"]
        results.append({"config": (reshard, micro, clip, kind), "param_diff": diff,
                        "shard_diff_every_step": worst_shard,
                        "loss_diff": worst_loss, "norm_diff": worst_norm,
                        "frozen_grad_is_none": frozen.grad is None,
                        "tied": model.module.head.weight is model.module.tok_emb.weight})
    return results


def _check(every_rank):
    for results in every_rank:
        _check_rank(results)


def _check_rank(results):
    for r in results:
        assert r["param_diff"] <= 1e-5, r
        assert r["shard_diff_every_step"] <= 1e-5, r
        assert r["loss_diff"] <= 1e-5, r
        assert r["norm_diff"] <= 1e-5, r
        assert r["frozen_grad_is_none"] and r["tied"], r


def test_parity_world1():
    from shardkit.testing import World
    with World(1) as world:
        _check(world.run(_parity_grid))


def test_parity_world2(world2):
    _check(world2.run(_parity_grid))


def test_parity_world4(world4):
    _check(world4.run(_parity_grid))
