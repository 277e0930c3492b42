"""torch.amp.GradScaler (not ShardedGradScaler) with ShardedDataParallel + OSS, at world 4.

Under ShardedDataParallel each rank holds the gradients it owns only, so torch's scaler on
each rank checks only those. An overflow in one owner's shard was refused with a RuntimeError
at the first overflow (hours into a run), and a rank that owns no parameter recorded no
inf check at all, so its ``update()`` raised while the other ranks waited in the next step.
Now every rank skips and backs off exactly as one process does.

From a review:

Review of OSS under torch's GradScaler and of OSS's agreement made in advance, at world 2.

``OSS.agreed_in_advance`` takes rows a caller gathered: a rank whose row was not made from the
arguments it passes (or rows that are no OSS agreement's) must be refused on every rank, not
leave the other ranks waiting in the all-gather that names a difference. One torch scaler over
two OSS optimizers, with ``unscale_`` and ``clip_grad_norm`` before ``step``, skips, backs off
and grows as one process does.
"""

import pytest
import torch

from shardkit import distributed as skdist
from shardkit.testing import world_fixture

world4 = world_fixture(4)


class _FourBranches(torch.nn.Module):
    """Four linear branches summed into the loss; ``big`` multiplies the first branch only,
    so that an overflow reaches that branch's gradients alone (its owners', not the others')."""

    def __init__(self):
        super().__init__()
        self.branches = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(4))

    def forward(self, x, big):
        first, *rest = self.branches
        return first(x).sum() * big + sum(branch(x).pow(2).mean() for branch in rest)


def _batch(step: int, world: int) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, 32 * world).reshape(8 * world, 4) * (step + 1)


def _scaled_step(model, optimizer, scaler, x, big, unscale_first):
    optimizer.zero_grad()
    scaler.scale(model(x, big)).backward()
    if unscale_first:  # the AMP recipe for clipping: unscale_, then step
        scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()


def _check_torch_scaler_overflow_on_some_owners(unscale_first):
    from shardkit.nn.data_parallel import ShardedDataParallel
    from shardkit.optim import OSS

    rank, world = skdist.get_rank(), skdist.get_world_size()
    torch.manual_seed(0)
    reference, model = _FourBranches(), _FourBranches()
    model.load_state_dict(reference.state_dict())
    optimizer = OSS(model.parameters(), optim=torch.optim.Adam, lr=0.05)
    sharded = ShardedDataParallel(model, optimizer)
    reference_optimizer = torch.optim.Adam(reference.parameters(), lr=0.05)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=2)
    reference_scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=2)
    overflow_seen_here, history, max_error = [], [], 0.0
    for step in range(5):
        big = 1e36 if step in (1, 3) else 1.0  # scaled by 2**16: inf in the first branch only
        x = _batch(step, world)
        _scaled_step(sharded, optimizer, scaler, x.chunk(world)[rank], big, unscale_first)
        overflow_seen_here.append(any(p.grad is not None and not p.grad.isfinite().all()
                                      for p in model.parameters()))
        _scaled_step(reference, reference_optimizer, reference_scaler, x, big, unscale_first)
        history.append(((scaler.get_scale(), scaler._get_growth_tracker()),
                        (reference_scaler.get_scale(), reference_scaler._get_growth_tracker())))
        max_error = max(max_error, max((p - q).abs().max().item() for p, q in
                                       zip(model.parameters(), reference.parameters())))
    return dict(history=history, max_error=max_error, overflow_seen_here=overflow_seen_here)


def test_torch_scaler_skips_and_backs_off_on_every_rank_when_one_owner_overflows(world4):
    for unscale_first in (False, True):
        results = world4.run(_check_torch_scaler_overflow_on_some_owners, unscale_first)
        # the overflow reached some owners only: the case torch's scaler cannot see alone
        seen = [r["overflow_seen_here"][1] for r in results]
        assert any(seen) and not all(seen), seen
        for r in results:
            assert [ours for ours, _ in r["history"]] == [ref for _, ref in r["history"]]
            assert [scale for (scale, _), _ in r["history"]] == \
                [2.0 ** 16, 2.0 ** 15, 2.0 ** 15, 2.0 ** 14, 2.0 ** 14]
            assert r["max_error"] < 1e-6


def _check_torch_scaler_on_a_rank_owning_nothing():
    from shardkit.nn.data_parallel import ShardedDataParallel
    from shardkit.optim import OSS

    torch.manual_seed(0)
    reference, model = torch.nn.Linear(4, 3), torch.nn.Linear(4, 3)
    model.load_state_dict(reference.state_dict())
    optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    sharded = ShardedDataParallel(model, optimizer)  # two parameters: ranks 2 and 3 own none
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=1)
    reference_scaler = torch.amp.GradScaler("cpu", init_scale=16.0, growth_interval=1)
    world = skdist.get_world_size()
    x = torch.ones(2 * world, 4)
    local = x.chunk(world)[skdist.get_rank()]
    for step in range(2):
        for net, opt, scl, batch in ((sharded, optimizer, scaler, local),
                                     (reference, reference_optimizer, reference_scaler, x)):
            opt.zero_grad()
            scl.scale(net(batch).pow(2).mean()).backward()
            scl.step(opt)
            scl.update()
    owns = any(owner == skdist.get_rank() for owner in optimizer.param_to_rank.values())
    error = max((p - q).abs().max().item()
                for p, q in zip(model.parameters(), reference.parameters()))
    return dict(owns=owns, scale=scaler.get_scale(), reference_scale=reference_scaler.get_scale(),
                error=error)


def test_torch_scaler_on_a_rank_that_owns_no_parameter(world4):
    results = world4.run(_check_torch_scaler_on_a_rank_owning_nothing)
    assert [r["owns"] for r in results].count(False) == 2
    for r in results:
        assert r["scale"] == r["reference_scale"] == 64.0
        assert r["error"] < 1e-6


def _counting_control_gathers(counts: list):
    """Wrap shardkit.distributed.gather_control_rows (OSS's agreement exchange) to count its
    calls in ``counts``; returns the original, to put back."""
    original = skdist.gather_control_rows

    def counted(*args, **kwargs):
        counts.append(args[0])
        return original(*args, **kwargs)

    skdist.gather_control_rows = counted
    return original


def _check_agreement_gathered_by_the_caller():
    """A caller (the DeepSpeed-style engine) gathers OSS's clip and step rows with its own row
    in one exchange; OSS's clip and step then make no exchange of their own and train as one
    process does. A difference in the rows is still refused on every rank, nothing stepped."""
    from shardkit.nn.data_parallel import ShardedDataParallel
    from shardkit.optim import OSS

    rank, world = skdist.get_rank(), skdist.get_world_size()
    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    model.load_state_dict(reference.state_dict())
    optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    sharded = ShardedDataParallel(model, optimizer)
    reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)

    def backward(step):
        x = _batch(step, world)
        optimizer.zero_grad()
        sharded(x.chunk(world)[rank]).pow(2).mean().backward()
        reference_optimizer.zero_grad()
        reference(x).pow(2).mean().backward()

    def rows_in_one_exchange(max_norm):
        caller_row = [7, 0]  # the caller's own agreement, carried by the same all-gather
        row = caller_row + optimizer.agreement_row("clip_grad_norm", max_norm=max_norm) + \
            optimizer.agreement_row("step")
        every = skdist.gather_control_rows("the caller's step agreement", row, optimizer.group)
        return [r[2:4] for r in every], [r[4:6] for r in every]

    gathers_inside, max_error = [], 0.0
    for step in range(3):
        backward(step)
        clip_rows, step_rows = rows_in_one_exchange(0.5)
        original = _counting_control_gathers(gathers_inside)
        try:
            with optimizer.agreed_in_advance("clip_grad_norm", clip_rows, max_norm=0.5), \
                    optimizer.agreed_in_advance("step", step_rows):
                norm = optimizer.clip_grad_norm(0.5)
                optimizer.step()
        finally:
            skdist.gather_control_rows = original
        reference_norm = torch.nn.utils.clip_grad_norm_(reference.parameters(), 0.5)
        reference_optimizer.step()
        max_error = max(max_error, (norm - reference_norm).abs().item(),
                        max((p - q).abs().max().item()
                            for p, q in zip(model.parameters(), reference.parameters())))

    # a learning rate set on rank 1 only: refused on every rank before the block runs
    backward(3)
    before = [p.detach().clone() for p in model.parameters()]
    optimizer.param_groups[0]["lr"] = 0.2 if rank == 1 else 0.1
    _, step_rows = rows_in_one_exchange(0.5)
    try:
        with optimizer.agreed_in_advance("step", step_rows):
            optimizer.step()
        lr_refusal = None
    except ValueError as error:
        lr_refusal = str(error)
    optimizer.param_groups[0]["lr"] = 0.1
    # a call made with other arguments than agreed (every rank alike): refused, nothing clipped
    clip_rows, _ = rows_in_one_exchange(0.5)
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    try:
        with optimizer.agreed_in_advance("clip_grad_norm", clip_rows, max_norm=0.5):
            optimizer.clip_grad_norm(1.0)
        changed_refusal = None
    except RuntimeError as error:
        changed_refusal = str(error)
    unclipped = all(torch.equal(g, p.grad) for g, p in
                    zip(grads, [p for p in model.parameters() if p.grad is not None]))
    untouched = all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    # outside a block, the step agrees on its own again: one exchange
    gathers_after = []
    original = _counting_control_gathers(gathers_after)
    try:
        optimizer.step()
    finally:
        skdist.gather_control_rows = original
    return dict(gathers_inside=gathers_inside, max_error=max_error, lr_refusal=lr_refusal,
                changed_refusal=changed_refusal, unclipped=unclipped, untouched=untouched,
                gathers_after=gathers_after)


def test_agreement_gathered_by_the_caller_replaces_oss_own(world4):
    for r in world4.run(_check_agreement_gathered_by_the_caller):
        assert r["gathers_inside"] == []
        assert r["max_error"] < 1e-6
        assert "['lr'] is 0.1 on rank 0 of the group and 0.2 on rank 1" in r["lr_refusal"]
        assert "changed on this rank" in r["changed_refusal"]
        assert r["unclipped"] and r["untouched"]
        assert r["gathers_after"] == ["OSS.step's agreement"]


world2 = world_fixture(2, timeout=60)


def _refusal(block_entered) -> str:
    """The error ``block_entered()`` raised, as ``"<type>: <text>"`` (or ``"entered"``)."""
    try:
        block_entered()
    except (ValueError, RuntimeError) as error:
        return f"{type(error).__name__}: {error}"
    return "entered"


def _check_rows_not_made_from_the_passed_arguments():
    from shardkit.optim import OSS

    rank = skdist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    model(torch.ones(2, 4)).pow(2).sum().backward()
    grads = [p.grad.clone() for p in model.parameters()]

    def clip_in_block(rows):
        def run():
            with optimizer.agreed_in_advance("clip_grad_norm", rows, max_norm=0.5):
                optimizer.clip_grad_norm(0.5)
        return run

    # rank 0 made its row for max_norm=1.0 but agrees (and clips) with 0.5
    row = optimizer.agreement_row("clip_grad_norm", max_norm=1.0 if rank == 0 else 0.5)
    rows = skdist.gather_control_rows("the caller's agreement", row, optimizer.group)
    other_arguments = _refusal(clip_in_block(rows))
    # rows whose first int names no OSS call (a negative one read as the last call's)
    digest = optimizer.agreement_row("clip_grad_norm", max_norm=0.5)[1]
    not_rows = [_refusal(clip_in_block([[code, digest]] * 2)) for code in (99, -1)]
    unclipped = all(torch.equal(g, p.grad) for g, p in zip(grads, model.parameters()))
    left_in_block = dict(optimizer._agreed_in_advance)
    # the world is still in step: an ordinary clip agrees and clips on every rank
    norm = optimizer.clip_grad_norm(0.5).item()
    return dict(other_arguments=other_arguments, not_rows=not_rows, unclipped=unclipped,
                left_in_block=left_in_block, norm=norm)


def test_rows_not_made_from_the_passed_arguments_are_refused_on_every_rank(world2):
    results = world2.run(_check_rows_not_made_from_the_passed_arguments)
    for r in results:
        # rank 0 refused its own row, and rank 1 waited for it in the object all-gather
        assert r["other_arguments"].startswith("ValueError: OSS.clip_grad_norm: the rows' "
                                               "settings digests differ"), r["other_arguments"]
        for refusal in r["not_rows"]:
            assert refusal.startswith("ValueError: OSS.agreed_in_advance(rows=...)") and \
                "are not OSS agreement rows" in refusal, refusal
        assert r["unclipped"] and r["left_in_block"] == {}
    assert results[0]["norm"] == pytest.approx(results[1]["norm"])


class _TwoBranches(torch.nn.Module):
    """Two linear branches; ``bigs[i]`` multiplies branch ``i``'s loss (an overflow there).
    The first has one parameter: one owner of its OSS, the other rank holds no gradient."""

    def __init__(self):
        super().__init__()
        self.first = torch.nn.Linear(4, 4, bias=False)
        self.second = torch.nn.Linear(4, 4)

    def forward(self, x, bigs):
        return self.first(x).pow(2).mean() * bigs[0] + self.second(x).pow(2).mean() * bigs[1]


def _scaled_step_with_clipping(model, optimizers, scaler, x, bigs, clip):
    for optimizer in optimizers:
        optimizer.zero_grad()
    scaler.scale(model(x, bigs)).backward()
    for optimizer in optimizers:
        scaler.unscale_(optimizer)
        clip(optimizer)
    for optimizer in optimizers:
        scaler.step(optimizer)
    scaler.update()


def _check_one_torch_scaler_over_two_oss_optimizers():
    from shardkit.nn.data_parallel import ShardedDataParallel
    from shardkit.optim import OSS

    rank, world = skdist.get_rank(), skdist.get_world_size()
    torch.manual_seed(0)
    reference, model = _TwoBranches(), _TwoBranches()
    model.load_state_dict(reference.state_dict())
    optimizers = [OSS(model.first.parameters(), optim=torch.optim.Adam, lr=0.05),
                  OSS(model.second.parameters(), optim=torch.optim.Adam, lr=0.05)]
    sharded = ShardedDataParallel(model, optimizers)
    references = [torch.optim.Adam(reference.first.parameters(), lr=0.05),
                  torch.optim.Adam(reference.second.parameters(), lr=0.05)]
    scalers = [torch.amp.GradScaler("cpu", init_scale=2.0 ** 16, growth_interval=2)
               for _ in range(2)]

    def clip_reference(optimizer):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        torch.nn.utils.clip_grad_norm_(params, 1.0)

    history, max_error, overflow_seen_here = [], 0.0, []
    # an overflow in one owner's shard of one optimizer, in both optimizers, none (growth)
    for step, overflows in enumerate([(), (0,), (), (), (0, 1), (), (), (1,)]):
        bigs = [1e36 if i in overflows else 1.0 for i in range(2)]
        x = torch.linspace(-1.0, 1.0, 16 * world).reshape(4 * world, 4) * (step + 1)
        _scaled_step_with_clipping(sharded, optimizers, scalers[0], x.chunk(world)[rank], bigs,
                                   lambda optimizer: optimizer.clip_grad_norm(1.0))
        overflow_seen_here.append(model.first.weight.grad is not None and
                                  not model.first.weight.grad.isfinite().all().item())
        _scaled_step_with_clipping(reference, references, scalers[1], x, bigs, clip_reference)
        history.append([(s.get_scale(), s._get_growth_tracker()) for s in scalers])
        max_error = max(max_error, max(
            torch.nan_to_num((p - q).abs(), nan=float("inf")).max().item()
            for p, q in zip(model.parameters(), reference.parameters())))
    return dict(history=history, max_error=max_error, overflow_seen_here=overflow_seen_here)


def test_one_torch_scaler_over_two_oss_optimizers_clipping_matches_one_process(world2):
    results = world2.run(_check_one_torch_scaler_over_two_oss_optimizers)
    # the first branch's overflow reached its one owner only (the other holds no gradient)
    assert sorted(r["overflow_seen_here"][1] for r in results) == [False, True]
    for r in results:
        assert [ours for ours, _ in r["history"]] == [ref for _, ref in r["history"]]
        assert [scale for (scale, _), _ in r["history"]][-4:] == \
            [2.0 ** 15, 2.0 ** 15, 2.0 ** 16, 2.0 ** 15]
        assert r["max_error"] < 1e-6
