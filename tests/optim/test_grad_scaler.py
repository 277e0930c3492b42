"""ShardedGradScaler: torch.amp.GradScaler semantics, with the skip decision shared by all ranks."""

import pytest
import torch

from shardkit import distributed as skdist
from shardkit.optim.grad_scaler import ShardedGradScaler
from shardkit.testing import world_fixture


world2 = world_fixture(2)


def _model_and_optimizer():
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.SGD(model.parameters(), lr=0.1)


def _scaled_step(model, optimizer, scaler, poison: bool):
    optimizer.zero_grad()
    loss = model(torch.ones(2, 4)).sum()
    scaler.scale(loss).backward()
    if poison:
        model.weight.grad[0, 0] = float("inf")
    scaler.step(optimizer)
    scaler.update()


def _check_inf_on_one_rank_skips_everywhere():
    rank = skdist.get_rank()
    model, optimizer = _model_and_optimizer()
    scaler = ShardedGradScaler("cpu", init_scale=1024.0, growth_interval=1)
    before = model.weight.detach().clone()
    with skdist.CommCounter() as comm:
        _scaled_step(model, optimizer, scaler, poison=(rank == 1))
    skipped = torch.equal(model.weight, before)
    scale_after_inf = scaler.get_scale()
    _scaled_step(model, optimizer, scaler, poison=False)
    stepped = not torch.equal(model.weight, before)
    return dict(skipped=skipped, scale_after_inf=scale_after_inf, stepped=stepped,
                scale_after_ok=scaler.get_scale(), all_reduces=comm.calls_by_op)


def test_inf_on_one_rank_makes_all_ranks_skip(world2):
    results = world2.run(_check_inf_on_one_rank_skips_everywhere)
    for r in results:
        assert r["skipped"], "a rank stepped although another rank found an inf"
        assert r["scale_after_inf"] == 512.0  # backed off on every rank
        assert r["stepped"]
        assert r["scale_after_ok"] == 1024.0  # growth_interval=1: grows back after a good step
        assert r["all_reduces"] == {"all_reduce": 1}


def _check_rank_without_grads_takes_part():
    """A rank holding no gradient of the optimizer (a non-owner under sharding) must still
    join the decision and skip with the others instead of asserting."""
    rank = skdist.get_rank()
    model, optimizer = _model_and_optimizer()
    scaler = ShardedGradScaler("cpu", init_scale=8.0)
    before = model.weight.detach().clone()
    loss = model(torch.ones(2, 4)).sum()
    scaler.scale(loss).backward()
    if rank == 0:
        for p in model.parameters():
            p.grad = None
    else:
        model.bias.grad[0] = float("nan")
    scaler.unscale_(optimizer)
    scaler.step(optimizer)
    scaler.update()
    return torch.equal(model.weight, before), scaler.get_scale()


def test_rank_without_grads_skips_with_the_others(world2):
    assert world2.run(_check_rank_without_grads_takes_part) == [(True, 4.0)] * 2


def _check_bf16_autocast_matches_torch_scaler():
    """Without infs, the sharded scaler trains exactly as torch's GradScaler (bf16 autocast)."""
    results = []
    for scaler_cls in (ShardedGradScaler, torch.amp.GradScaler):
        model, optimizer = _model_and_optimizer()
        scaler = scaler_cls("cpu", init_scale=256.0, growth_interval=2)
        for step in range(4):
            optimizer.zero_grad()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                loss = model(torch.full((2, 4), 0.1 * (step + 1))).float().sum()
            scaler.scale(loss).backward()
            scaler.step(optimizer)
            scaler.update()
        results.append((model.weight.detach().clone(), scaler.get_scale()))
    (w_ours, s_ours), (w_torch, s_torch) = results
    return torch.equal(w_ours, w_torch), s_ours, s_torch


def test_bf16_autocast_matches_torch_grad_scaler(world2):
    for same, ours, theirs in world2.run(_check_bf16_autocast_matches_torch_scaler):
        assert same and ours == theirs == 1024.0


def test_state_dict_round_trip_single_process():
    scaler = ShardedGradScaler("cpu", init_scale=32.0, growth_factor=4.0, backoff_factor=0.25,
                               growth_interval=7)
    model, optimizer = _model_and_optimizer()
    _scaled_step(model, optimizer, scaler, poison=True)   # no process group: local decision
    state = scaler.state_dict()
    assert state["scale"] == 8.0 and state["growth_factor"] == 4.0
    other = ShardedGradScaler("cpu")
    other.load_state_dict(state)
    assert other.get_scale() == 8.0 and other.get_growth_interval() == 7
    assert other.get_backoff_factor() == 0.25


def test_disabled_scaler_is_a_pass_through():
    scaler = ShardedGradScaler("cpu", enabled=False)
    model, optimizer = _model_and_optimizer()
    loss = model(torch.ones(1, 4)).sum()
    assert scaler.scale(loss) is loss


def test_fairscale_positional_order_and_fp16_gradients():
    """FairScale's order (init_scale first) and its fp16 gradients (pure fp16 training), which
    torch's scaler refuses to unscale."""
    scaler = ShardedGradScaler(1024.0, 4.0, 0.25, 7)
    assert (scaler.get_scale(), scaler.get_growth_factor(), scaler.get_backoff_factor(),
            scaler.get_growth_interval()) == (1024.0, 4.0, 0.25, 7)
    torch.manual_seed(0)
    model = torch.nn.Linear(4, 2).half()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    before = [p.detach().clone() for p in model.parameters()]
    scaler.scale(model(torch.ones(3, 4, dtype=torch.float16)).float().sum()).backward()
    expected = [p.grad.float() / 1024.0 for p in model.parameters()]
    scaler.unscale_(optimizer)
    for p, e in zip(model.parameters(), expected):
        assert p.grad.dtype == torch.float16 and torch.allclose(p.grad.float(), e, rtol=1e-3)
    scaler.step(optimizer)
    scaler.update()
    assert all(not torch.equal(p, b) for p, b in zip(model.parameters(), before))
    with pytest.raises(TypeError, match="init_scale given both"):
        ShardedGradScaler(8.0, init_scale=16.0)


@pytest.mark.parametrize("kwargs, match", [
    (dict(device=65536.0), "device=65536.0"),
    (dict(device="cpu", init_scale=0.0), "init_scale=0.0"),
    (dict(device="cpu", growth_factor=1.0), "growth_factor=1.0"),
    (dict(device="cpu", backoff_factor=1.5), "backoff_factor=1.5"),
    (dict(device="cpu", growth_interval=0), "growth_interval=0"),
    (dict(device="cpu", scale=8.0), "scale=.*unknown argument"),
    # a group given by name would fail only at the first unscale_, inside the all-reduce
    (dict(device="cpu", process_group="world"), r"process_group='world'\): must be a torch"),
])
def test_bad_arguments_are_named(kwargs, match):
    with pytest.raises((ValueError, TypeError), match=match):
        ShardedGradScaler(**kwargs)


# ---------------------------------------------------------------- torch's own GradScaler with OSS


def _sharded_and_reference_models():
    """The same small MLP twice: wrapped in ShardedDataParallel + OSS(Adam), and plain (the
    one-process oracle, trained on the global batch)."""
    from shardkit.nn.data_parallel import ShardedDataParallel
    from shardkit.optim import OSS

    torch.manual_seed(0)
    reference = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 3))
    model.load_state_dict(reference.state_dict())
    optimizer = OSS(model.parameters(), optim=torch.optim.Adam, lr=0.05)
    return (ShardedDataParallel(model, optimizer), optimizer,
            reference, torch.optim.Adam(reference.parameters(), lr=0.05))


def _global_batch(step: int) -> torch.Tensor:
    return torch.linspace(-1.0, 1.0, 16).reshape(4, 4) * (step + 1)


def _train_step(model, optimizer, scaler, x, loss_factor: float, clip: bool) -> None:
    optimizer.zero_grad()
    loss = model(x).pow(2).mean() * loss_factor
    scaler.scale(loss).backward()
    if clip:  # the AMP recipe: unscale, clip the true gradients, then step
        scaler.unscale_(optimizer)
        if hasattr(optimizer, "clip_grad_norm"):
            optimizer.clip_grad_norm(0.5)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
    scaler.step(optimizer)
    scaler.update()


def _check_torch_scaler_with_sharded_ddp_matches_one_process():
    """torch.amp.GradScaler with ShardedDDP + OSS where every rank agrees (a step that
    overflows everywhere, steps that overflow nowhere): the same weights and scale as one
    process training the global batch, and one all-reduce of one element per step."""
    rank, world = skdist.get_rank(), skdist.get_world_size()
    model, optimizer, reference, reference_optimizer = _sharded_and_reference_models()
    scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    reference_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=2)
    plan = [(1.0, False), (float("inf"), False), (1.0, True), (1.0, False), (1.0, True)]
    max_error, scales = 0.0, []
    with skdist.CommCounter() as comm:
        for step, (loss_factor, clip) in enumerate(plan):
            x = _global_batch(step)
            _train_step(model, optimizer, scaler, x.chunk(world)[rank], loss_factor, clip)
            with skdist.CommCounter():  # the oracle: local, not counted
                _train_step(reference, reference_optimizer, reference_scaler, x, loss_factor,
                            clip)
            max_error = max(max_error, max((p - q).abs().max().item() for p, q in
                                           zip(model.parameters(), reference.parameters())))
            scales.append((scaler.get_scale(), reference_scaler.get_scale()))
    # without a scaler, OSS.step adds no collective
    optimizer.zero_grad()
    model(_global_batch(0).chunk(world)[rank]).sum().backward()
    with skdist.CommCounter() as bare:
        optimizer.step()
    return dict(max_error=max_error, scales=scales,
                all_reduce_bytes=comm.by_op.get("all_reduce", 0),
                all_reduces=comm.calls_by_op.get("all_reduce", 0),
                bare_step_ops=sorted(bare.calls_by_op))


def test_torch_grad_scaler_with_sharded_ddp_matches_one_process(world2):
    for r in world2.run(_check_torch_scaler_with_sharded_ddp_matches_one_process):
        assert r["max_error"] < 1e-5
        assert [ours for ours, _ in r["scales"]] == [theirs for _, theirs in r["scales"]]
        assert [ours for ours, _ in r["scales"]] == [1024.0, 512.0, 512.0, 1024.0, 1024.0]
        # 5 agreements + 2 clippings, each one all-reduce of one element
        assert r["all_reduces"] == 7
        assert r["bare_step_ops"] == ["all_gather"]


def _check_torch_scaler_when_ranks_disagree():
    """An inf in one rank's owned gradient only: torch's scaler checks the gradients this rank
    holds, so it recorded "finite" on the other rank (which then grew its scale while rank 1
    backed off; the step was refused). OSS writes the agreed finding into the calling scaler's
    record: every rank skips, no weight changed, and every rank backs off alike.
    ShardedGradScaler, whose check spans the ranks, skips too with one all-reduce."""
    rank = skdist.get_rank()
    model, optimizer, _, _ = _sharded_and_reference_models()
    before = [p.detach().clone() for p in model.parameters()]

    def poisoned_step(scaler):
        optimizer.zero_grad()
        scaler.scale(model(_global_batch(rank)).pow(2).mean()).backward()
        if rank == 1:  # ShardedDDP reduced each gradient to its owner only
            owned = next(p for p, owner in optimizer.param_to_rank.items() if owner == rank)
            owned.grad.view(-1)[0] = float("inf")
        scaler.step(optimizer)
        scaler.update()

    torch_scaler = torch.amp.GradScaler("cpu", init_scale=1024.0)
    poisoned_step(torch_scaler)
    untouched = all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    attributes_left = [a for a in ("grad_scale", "found_inf") if hasattr(optimizer, a)]
    sharded = ShardedGradScaler("cpu", init_scale=1024.0)
    with skdist.CommCounter() as comm:
        poisoned_step(sharded)
    skipped = all(torch.equal(p, b) for p, b in zip(model.parameters(), before))
    return dict(torch_scale=torch_scaler.get_scale(), untouched=untouched,
                attributes_left=attributes_left, skipped=skipped, scale=sharded.get_scale(),
                ops=comm.calls_by_op)


def test_torch_grad_scaler_skips_on_every_rank_when_one_owner_overflows(world2):
    for r in world2.run(_check_torch_scaler_when_ranks_disagree):
        assert r["torch_scale"] == 512.0
        assert r["untouched"] and r["attributes_left"] == []
        assert r["skipped"] and r["scale"] == 512.0
        # ShardedGradScaler's check spans the ranks already: OSS adds no all-reduce of its own
        # (ShardedDDP's agreements on the trainable set, at the step's first forward and at the
        # start of the reducing backward, are control messages, which CommCounter leaves out)
        assert r["ops"].get("all_reduce") == 1 and r["ops"].get("all_gather") is None
