"""ShardedDataParallel's buffers against torch DDP (gloo) at world 2, and torch's GradScaler
whose private record OSS cannot find.

Regressions:

- OSS writes what every rank agreed about inf/nan into the record of the calling
  ``torch.amp.GradScaler.step``, found by torch's private names. Under a torch that names it
  otherwise, a rank owning no gradient recorded no inf check and its ``update()`` alone
  raised (the other rank went on). Now every rank raises the same RuntimeError naming
  ShardedGradScaler before stepping, and ShardedGradScaler, which needs no such record,
  still trains as one process does.

Guards (from reviews of an attempt, reverted, to move ``broadcast_buffers``' broadcast from
the forward to the end of the reducing backward so that a forward rank 0 runs alone would not
wait for the others: each variant broke one of these): with ``broadcast_buffers=True`` every
rank evaluates with rank 0's statistics after a cast (``ddp.double()``) or a write relative to
the current value, ``state_dict()`` on rank 1 after the last backward holds what torch DDP's
does, forwards before one backward (training then evaluation, training twice, with
``retain_graph``) give torch DDP's gradients.

From a review:

ShardedDataParallel's ``broadcast_buffers`` and graphs still to be backwarded, at world 2
(second review of 64eaae0 and 9d6b829).

Regression: at the end of each reducing backward every rank overwrites its buffers with rank
0's, version counters kept. A graph that saved a buffer and is backwarded again after that
(``loss.backward(retain_graph=True)`` then ``loss.backward()``) then read rank 0's value on the
other ranks instead of the one its forward used: with a buffer its backward reads (a scale
kept as a running average) the gradients, and every parameter after the step, silently
differed from torch DDP's (``(2 * loss).backward()``) and from the code before. Such a buffer
now keeps its value until the next forward, which takes rank 0's; every other buffer is still
rank 0's right after the backward.
"""

import inspect
import re
import textwrap

import torch
import torch.nn as nn

from shardkit import distributed as skdist
from shardkit.testing import world_fixture

world2 = world_fixture(2)

STEPS = 3


def _batchnorm_net() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.ReLU(), nn.Linear(8, 2))


def _batch(step: int, world: int) -> torch.Tensor:
    return torch.randn(4 * world, 4, generator=torch.Generator().manual_seed(step))


def _step_with_renamed_record():
    """torch.amp.GradScaler.step as this torch has it, its per-optimizer record renamed: what
    a torch release that renames that private local would look like to OSS."""
    source = textwrap.dedent(inspect.getsource(torch.amp.GradScaler.step))
    namespace = dict(vars(inspect.getmodule(torch.amp.GradScaler)))
    exec(compile(re.sub(r"\boptimizer_state\b", "per_optimizer_record", source),
                 "<renamed GradScaler.step>", "exec"), namespace)
    return namespace["step"]


def _scaled_steps(model, optimizer, scaler, world, rank, reference=False):
    for step in range(2):
        x = _batch(step, world)
        chunks = [x] if reference else [x.chunk(world)[rank]]
        scaler.scale(model(chunks[0]).square().mean()).backward()
        scaler.step(optimizer)
        scaler.update()
        optimizer.zero_grad()


def _check_torch_scaler_record_renamed():
    from shardkit.nn.data_parallel import ShardedDataParallel
    from shardkit.optim import OSS, ShardedGradScaler

    rank, world = skdist.get_rank(), skdist.get_world_size()
    original = torch.amp.GradScaler.step
    torch.amp.GradScaler.step = _step_with_renamed_record()
    try:
        # one parameter: rank 1 owns no gradient, so torch's scaler records no check there
        torch.manual_seed(0)
        model = nn.Linear(4, 1, bias=False)
        before = model.weight.detach().clone()
        optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
        ddp = ShardedDataParallel(model, optimizer)
        scaler = torch.amp.GradScaler("cpu", init_scale=2.0 ** 8)
        scaler.scale(ddp(_batch(0, world).chunk(world)[rank]).sum()).backward()
        try:
            scaler.step(optimizer)
            scaler.update()
            refusal = None
        except (RuntimeError, AssertionError) as e:
            refusal = f"{type(e).__name__}: {e}"
        unchanged = torch.equal(model.weight, before)
        optimizer.zero_grad()

        torch.manual_seed(0)
        reference = nn.Linear(4, 1, bias=False)
        reference_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
        _scaled_steps(reference, reference_optimizer,
                      torch.amp.GradScaler("cpu", init_scale=2.0 ** 8), world, rank, True)
        sharded_scaler = ShardedGradScaler("cpu", init_scale=2.0 ** 8)
        _scaled_steps(ddp, optimizer, sharded_scaler, world, rank)
        error = (model.weight - reference.weight).abs().max().item()
    finally:
        torch.amp.GradScaler.step = original
    return dict(refusal=refusal, unchanged=unchanged, error=error,
                scale=sharded_scaler.get_scale())


def test_torch_scaler_whose_record_oss_cannot_find_is_refused_on_every_rank(world2):
    results = world2.run(_check_torch_scaler_record_renamed)
    for result in results:
        assert result["refusal"] is not None and result["refusal"].startswith(
            "RuntimeError: OSS.step: torch.amp.GradScaler.step is stepping this OSS, but this "
            "torch"), result
        assert "per_optimizer" not in result["refusal"] and \
            "'optimizer_state'" in result["refusal"], result
        assert "shardkit.optim.ShardedGradScaler" in result["refusal"], result
        assert result["unchanged"], result
        assert result["error"] < 1e-6 and result["scale"] == 2.0 ** 8, result


def _micro_batch(step: int, rank: int, world: int) -> torch.Tensor:
    """Each rank's share of the step's batch, scaled by rank so the statistics differ."""
    x = torch.randn(4 * world, 4, generator=torch.Generator().manual_seed(step))
    return x.chunk(world)[rank] * (1 + rank)


def _evaluation_input() -> torch.Tensor:
    return torch.randn(5, 4, generator=torch.Generator().manual_seed(99))


def _wrapped(kind: str):
    """(wrapper, module, optimizer): torch DDP with SGD, or ShardedDataParallel with OSS."""
    from shardkit.nn.data_parallel import ShardedDataParallel
    from shardkit.optim import OSS

    model = _batchnorm_net()
    if kind == "torch":
        return (nn.parallel.DistributedDataParallel(model, broadcast_buffers=True), model,
                torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9))
    optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    return ShardedDataParallel(model, optimizer, broadcast_buffers=True), model, optimizer


def _train_step(wrapper, optimizer, step: int, rank: int, world: int) -> None:
    wrapper(_micro_batch(step, rank, world)).square().mean().backward()
    optimizer.step()
    optimizer.zero_grad()


def _evaluate(wrapper, dtype=torch.float32) -> torch.Tensor:
    wrapper.eval()
    with torch.no_grad():
        out = wrapper(_evaluation_input().to(dtype))
    wrapper.train()
    return out.double()


def _changes_between_steps(kind: str) -> dict:
    """What every rank evaluates after a relative write and after a cast, and the state each
    rank holds right after the last backward."""
    rank, world = skdist.get_rank(), skdist.get_world_size()
    wrapper, model, optimizer = _wrapped(kind)
    _train_step(wrapper, optimizer, 0, rank, world)
    with torch.no_grad():
        model[1].running_mean.mul_(0.5)  # every rank, relative to its current value
    after_write = _evaluate(wrapper)
    _train_step(wrapper, optimizer, 1, rank, world)
    after_last_backward = {k: v.clone() for k, v in model.state_dict().items()}
    wrapper.double()
    after_cast = _evaluate(wrapper, torch.float64)
    return dict(after_write=after_write, after_cast=after_cast,
                after_last_backward=after_last_backward)


def _check_changes_between_steps():
    torch_ddp, sharded = _changes_between_steps("torch"), _changes_between_steps("sharded")
    return dict(
        write_error=(torch_ddp["after_write"] - sharded["after_write"]).abs().max().item(),
        cast_error=(torch_ddp["after_cast"] - sharded["after_cast"]).abs().max().item(),
        state_error=max((v.double() - torch_ddp["after_last_backward"][k].double()).abs().max()
                        .item() for k, v in sharded["after_last_backward"].items()))


def test_casts_writes_and_state_dict_after_a_step_match_torch_ddp(world2):
    for rank, result in enumerate(world2.run(_check_changes_between_steps)):
        assert result["write_error"] < 1e-6, (rank, result)
        assert result["cast_error"] < 1e-6, (rank, result)
        assert result["state_error"] < 1e-6, (rank, result)


def _backward_twice(loss: torch.Tensor, kind: str) -> None:
    """``loss`` backwarded twice with ``retain_graph`` (torch DDP, whose reducer allows one
    backward per forward: the loss doubled, the same gradients)."""
    if kind == "torch":
        (2 * loss).backward()
    else:
        loss.backward(retain_graph=True)
        loss.backward()


def _forwards_before_one_backward(kind: str, eval_second: bool, retain: bool) -> list:
    """Three steps of two forwards (the second in evaluation mode or not) and one loss,
    backwarded once, or twice with ``retain_graph=True`` (torch DDP: the loss doubled)."""
    rank, world = skdist.get_rank(), skdist.get_world_size()
    wrapper, model, optimizer = _wrapped(kind)
    params = []
    for step in range(3):
        loss = wrapper(_micro_batch(step, rank, world)).sum()
        wrapper.train(not eval_second)
        loss = loss + wrapper(_micro_batch(step + 50, rank, world)).square().sum()
        wrapper.train()
        if not retain:
            loss.backward()
        else:
            _backward_twice(loss, kind)
        optimizer.step()
        optimizer.zero_grad()
        params.append([p.detach().clone() for p in model.parameters()])
    return params + [_evaluate(wrapper)]


def _check_forwards_before_one_backward():
    errors = {}
    for eval_second, retain in ((True, False), (False, False), (True, True), (False, True)):
        expected = _forwards_before_one_backward("torch", eval_second, retain)
        got = _forwards_before_one_backward("sharded", eval_second, retain)
        errors[(eval_second, retain)] = max(
            _relative_error(a, b) for xs, ys in zip(expected, got)
            for a, b in zip(xs if isinstance(xs, list) else [xs], ys if isinstance(ys, list)
                            else [ys]))
    return errors


def _relative_error(expected: torch.Tensor, got: torch.Tensor) -> float:
    return ((expected - got).abs().max() / (1 + expected.abs().max())).item()


def test_forwards_before_one_backward_match_torch_ddp(world2):
    for rank, errors in enumerate(world2.run(_check_forwards_before_one_backward)):
        assert max(errors.values()) < 1e-5, (rank, errors)


class RunningScale(nn.Module):
    """A linear layer whose output is multiplied by a running average of its magnitude (a
    buffer the backward reads), next to a BatchNorm (running statistics it does not read)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.linear = nn.Linear(4, 4)
        self.norm = nn.BatchNorm1d(4)
        self.register_buffer("scale", torch.ones(4))

    def forward(self, x):
        h = self.linear(x)
        if self.training:
            with torch.no_grad():
                self.scale.mul_(0.5).add_(0.5 * h.abs().mean(0))
        return self.norm(h * self.scale)


def _micro_batch_rev(step: int, rank: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(10 * step + rank)
    return torch.randn(3, 4, generator=g) * (1 + rank)   # the ranks' statistics differ


def _wrapped_rev(kind: str):
    from shardkit.nn.data_parallel import ShardedDataParallel
    from shardkit.optim import OSS

    model = RunningScale()
    if kind == "torch":
        return (nn.parallel.DistributedDataParallel(model, broadcast_buffers=True), model,
                torch.optim.SGD(model.parameters(), lr=0.05))
    optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.05)
    return ShardedDataParallel(model, optimizer, broadcast_buffers=True), model, optimizer


def _steps_backwarding_twice(kind: str) -> dict:
    """Three steps of one forward backwarded twice (torch DDP: the loss doubled), then an
    evaluation; the buffers each rank holds after the last backward."""
    rank = skdist.get_rank()
    wrapper, model, optimizer = _wrapped_rev(kind)
    params = []
    for step in range(3):
        loss = wrapper(_micro_batch_rev(step, rank)).square().sum()
        _backward_twice(loss, kind)
        optimizer.step()
        optimizer.zero_grad()
        params.append([p.detach().clone() for p in model.parameters()])
    buffers = [b.clone() for b in model.buffers()]
    wrapper.eval()
    with torch.no_grad():
        evaluated = wrapper(_micro_batch_rev(99, 0))
    return dict(params=params, buffers=buffers, evaluated=evaluated)


def _graph_kept_past_the_step() -> dict:
    """A retained graph still alive after the step: the next forward on every rank runs with
    rank 0's buffers."""
    rank = skdist.get_rank()
    wrapper, model, optimizer = _wrapped_rev("sharded")
    loss = wrapper(_micro_batch_rev(0, rank)).square().sum()
    loss.backward(retain_graph=True)
    optimizer.step()
    optimizer.zero_grad()
    wrapper.eval()
    with torch.no_grad():
        evaluated = wrapper(_micro_batch_rev(99, 0))
    del loss
    return dict(evaluated=evaluated, buffers=[b.clone() for b in model.buffers()])


def _check_graph_backwarded_after_the_broadcast():
    expected, got = _steps_backwarding_twice("torch"), _steps_backwarding_twice("sharded")
    param_error = max((a - b).abs().max().item() for xs, ys in
                      zip(expected["params"], got["params"]) for a, b in zip(xs, ys))
    kept = _graph_kept_past_the_step()
    kept_rank0 = skdist.all_gather_object(kept)[0]
    return dict(
        param_error=param_error,
        evaluation_error=(expected["evaluated"] - got["evaluated"]).abs().max().item(),
        buffer_error=max((a.double() - b.double()).abs().max().item()
                         for a, b in zip(expected["buffers"], got["buffers"])),
        kept_evaluation_is_rank0s=torch.equal(kept["evaluated"], kept_rank0["evaluated"]),
        kept_buffers_are_rank0s=all(torch.equal(a, b) for a, b in
                                    zip(kept["buffers"], kept_rank0["buffers"])))


def test_a_graph_backwarded_again_after_a_reduction_reads_what_its_forward_saw(world2):
    for rank, result in enumerate(world2.run(_check_graph_backwarded_after_the_broadcast)):
        assert result["param_error"] < 1e-5, (rank, result)
        assert result["evaluation_error"] < 1e-5, (rank, result)
        assert result["buffer_error"] < 1e-5, (rank, result)
        assert result["kept_evaluation_is_rank0s"], (rank, result)
        assert result["kept_buffers_are_rank0s"], (rank, result)
