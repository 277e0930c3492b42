"""FSDP(auto_wrap per block) + AdamW against single-process training on the same global batch:
10 steps, nested units, a tied embedding, a frozen layer, reshard_after_forward True/False,
no_sync accumulation and gradient clipping, over the default transport and the shared-memory
one; worlds 1, 2 and 4. Every rank compares its own shard of every parameter with the matching
rows of the single-process model after every step."""

import contextlib

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


# ------------------------------------------------------------- parameters a step leaves unused


class _Branches(torch.nn.Module):
    """``a -> (b or c) -> out``: which branch runs is the caller's choice."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b = torch.nn.Linear(4, 8), torch.nn.Linear(8, 8)
        self.c, self.out = torch.nn.Linear(8, 8), torch.nn.Linear(8, 2)

    def forward(self, x, use_b):
        h = torch.relu(self.a(x))
        return self.out(torch.relu(self.b(h) if use_b else self.c(h)))


def _branch_batch(step, n):
    g = torch.Generator().manual_seed(step)
    return torch.randn(4 * n, 4, generator=g), torch.randn(4 * n, 2, generator=g)


def _unused_branch_parity(nested: bool, per_rank_branch: bool, micro: int):
    """FSDP (one unit, or a unit per Linear) against one process on the global batch, with
    SGD momentum + weight decay (which would move a parameter given a zero gradient).
    ``micro`` micro-batches under no_sync alternate the branch (with units per Linear, a unit
    used only in the first is reduced at the end of the last); ``per_rank_branch``: rank r
    takes branch b when r is even (ranks disagree: the other rank's rows are averaged in)."""
    import torch.nn.functional as F
    from shardkit import distributed as skdist
    from shardkit.nn import FullyShardedDataParallel as FSDP
    from shardkit.nn.wrap import auto_wrap, enable_wrap

    rank, n = skdist.get_rank(), skdist.get_world_size()
    reference, model = _Branches(), _Branches()
    if nested:
        with enable_wrap(wrapper_cls=FSDP):
            model = auto_wrap(model, lambda module, recurse, **_: recurse or
                              isinstance(module, torch.nn.Linear))
    model = FSDP(model)
    hyper = dict(lr=0.1, momentum=0.9, weight_decay=0.01)
    ref_opt = torch.optim.SGD(reference.parameters(), **hyper)
    opt = torch.optim.SGD(model.parameters(), **hyper)
    worst, none_when_unused = 0.0, True
    for step in range(4):
        x, y = _branch_batch(step, n)
        branch = [(step + m) % 2 == 0 for m in range(micro)]  # per micro-batch
        ref_opt.zero_grad()
        for r in range(n):
            for m, rows in enumerate(torch.arange(4 * r, 4 * r + 4).chunk(micro)):
                use_b = (r % 2 == 0) if per_rank_branch else branch[m]
                (F.mse_loss(reference(x[rows], use_b), y[rows]) * len(rows) / 4 / n).backward()
        ref_opt.step()
        opt.zero_grad()
        mine = torch.arange(4 * rank, 4 * rank + 4).chunk(micro)
        for m, rows in enumerate(mine):
            use_b = (rank % 2 == 0) if per_rank_branch else branch[m]
            ctx = model.no_sync() if m + 1 < micro else contextlib.nullcontext()
            with ctx:
                (F.mse_loss(model(x[rows], use_b), y[rows]) * len(rows) / 4).backward()
        if not per_rank_branch and micro == 1:  # the branch not taken keeps grad None
            idle = model.module.c if branch[0] else model.module.b
            none_when_unused &= all(p.grad is None for p in idle.parameters())
        opt.step()
        worst = max(worst, max_diff(model.state_dict(), reference.state_dict()))
    return worst, none_when_unused


def _unused_branch_grid():
    # ranks may disagree about parameters inside a unit, not about whole units (FSDP's rule)
    return {(nested, per_rank, micro): _unused_branch_parity(nested, per_rank, micro)
            for nested in (False, True) for per_rank in (False, True) for micro in (1, 2)
            if not (nested and per_rank)}


def test_parameters_unused_in_a_step_train_as_in_one_process(world2):
    for rank, grid in enumerate(world2.run(_unused_branch_grid)):
        for config, (worst, none_when_unused) in grid.items():
            assert worst <= 1e-5, (rank, config, worst)
            assert none_when_unused, (rank, config)
