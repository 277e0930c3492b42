"""OSS's param groups when the ranks disagree on them, and OSS's own choice of torch's fused
kernel against the caller's plain optimizer when a gradient holds a NaN (one world of 2 gloo
ranks).

Regressions:

- a learning rate set on some ranks only (``optimizer.param_groups[0]["lr"] = ...`` under
  ``if rank == 0``) stepped silently, each parameter with its owner's rate; ``add_param_group``
  called on some ranks only left the others hanging in the next step's parameter sync. Both
  are now an error on every rank, naming the hyper-parameter and its values (a ValueError) or
  the ranks in each call (a RuntimeError), raised before any parameter is stepped; the ranks
  can go on (the same rate set everywhere steps);

- ``reduce_to_owners_hook`` over a model whose ``nn.Embedding`` was built with
  ``sparse=True`` on some ranks only: those ranks refused the sparse bucket alone and the
  others hung in their reduction. Every rank now raises a ValueError before any transfer, and
  the ranks can go on;
- ``OSS(params, optim=torch.optim.AdamW, amsgrad=True)`` (or ``Adam``) ran torch's fused
  kernel, which after a step whose gradient held a NaN (no loss scaler skipping it) keeps the
  old ``max_exp_avg_sq`` in the elements of its scalar tail, where ``torch.optim.AdamW``'s
  default loop makes it NaN: the state, and the consolidated state dict loaded into a plain
  optimizer, differed from one process's. OSS now chooses the fused kernel only for settings
  whose trial step carries a NaN as the loop does (``amsgrad=True`` set in a group later turns
  it off at the next step); plain AdamW keeps it.

review

Review of OSS's param-group agreement (one world of 2 gloo ranks).

Regressions:

- ``ShardedDataParallel(step_in_backward=True)``: the step begins in backward and skipped the
  agreement that ``OSS.step`` runs, so a learning rate set on some ranks only stepped each
  parameter silently with its owner's rate. Now a ValueError on every rank, nothing stepped;
- Adam's ``betas`` given as tensors were compared by their ``repr`` (rounded to 4 digits, and
  naming the rank's own ``cuda:r``): betas that differ between ranks stepped silently (and on
  GPUs identical ones were refused). Now compared exactly, without the device;
- the agreement pickled an object all-gather on every step; it is now one all-gather of two
  int64s a rank (no object all-gather per step).
"""

import copy

import torch
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit import distributed as skdist
from shardkit.comm_hooks import reduce_to_owners_hook
from shardkit.nn.data_parallel import ShardedDataParallel
from shardkit.optim import OSS
from shardkit.optim.oss_arguments import param_group_settings
from shardkit.testing import world_fixture

world2 = world_fixture(2, timeout=90)


def _model():
    # 15 and 3 elements: the NaN lands in the kernel's scalar tail (8, 16 or 32 lanes)
    torch.manual_seed(0)
    return nn.Linear(5, 3)


def _same_with_nans(a: torch.Tensor, b: torch.Tensor) -> bool:
    nan = torch.isnan(a)
    return torch.equal(nan, torch.isnan(b)) and torch.equal(a[~nan], b[~nan])


def _amsgrad_after_a_nan_gradient(optim_name: str, amsgrad_set_later: bool):
    """OSS and the plain optimizer, same gradients on every rank (as under DDP), the second
    step's holding a NaN in the weight's last element: whether the parameters and the
    consolidated state match the plain optimizer's, NaN for NaN, after four steps."""
    optim_cls = getattr(torch.optim, optim_name)
    model = _model()
    oracle = copy.deepcopy(model)
    given = {} if amsgrad_set_later else {"amsgrad": True}
    opt = OSS(model.parameters(), optim=optim_cls, lr=0.1, **given)
    if amsgrad_set_later:
        opt.param_groups[0]["amsgrad"] = True
    ref = optim_cls(oracle.parameters(), lr=0.1, amsgrad=True)
    for step in range(4):
        gen = torch.Generator().manual_seed(step)
        grads = [torch.randn(p.shape, generator=gen) for p in model.parameters()]
        if step == 1:
            grads[0][-1, -1] = float("nan")
        for m in (model, oracle):
            for p, g in zip(m.parameters(), grads):
                p.grad = g.clone()
        opt.step()
        ref.step()
    opt.consolidate_state_dict(recipient_rank=-1)
    saved, expected = opt.state_dict()["state"], ref.state_dict()["state"]
    same_state = sorted(saved) == sorted(expected) and all(
        _same_with_nans(saved[i][k], expected[i][k]) for i in expected for k in expected[i])
    same_params = all(_same_with_nans(p.detach(), q.detach())
                      for p, q in zip(model.parameters(), oracle.parameters()))
    return {"same_state": same_state, "same_params": same_params, "fused": opt.fused}


def _error_of(fn):
    try:
        fn()
    except (RuntimeError, ValueError) as error:
        return type(error).__name__, str(error)
    return None


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _seeded_grads(model, step: int) -> None:
    gen = torch.Generator().manual_seed(step)  # the same on every rank, as after DDP
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen)


def _param_groups_differ_between_ranks():
    """An lr set on rank 0 only, then add_param_group on rank 0 only while rank 1 steps: the
    errors each rank raised, whether any parameter moved, and a step after the lr is set
    alike again (with a scheduler stepped on every rank) against one process."""
    rank = skdist.get_rank()
    model = _mlp()
    oracle = copy.deepcopy(model)
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    ref = torch.optim.SGD(oracle.parameters(), lr=0.1, momentum=0.9)
    before = [p.detach().clone() for p in model.parameters()]
    _seeded_grads(model, 0)
    if rank == 0:
        opt.param_groups[0]["lr"] = 0.5
    lr_error = _error_of(opt.step)
    opt.param_groups[0]["lr"] = 0.1
    extra = nn.Parameter(torch.ones(3))
    add_error = _error_of(lambda: opt.add_param_group({"params": [extra]}) if rank == 0
                          else opt.step())
    unchanged = all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    groups_after = len(opt.param_groups)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s))
                 for o in (opt, ref)]
    for step in range(2):
        _seeded_grads(model, step)
        _seeded_grads(oracle, step)
        opt.step()
        ref.step()
        for schedule in schedules:
            schedule.step()
    pairs = zip(model.parameters(), oracle.parameters())
    worst = max((p - q).abs().max().item() for p, q in pairs)
    return {"lr_error": lr_error, "add_error": add_error, "unchanged": unchanged,
            "groups_after": groups_after, "worst": worst}


def test_param_groups_that_differ_between_ranks_fail_on_every_rank(world2):
    for rank, got in enumerate(world2.run(_param_groups_differ_between_ranks)):
        assert got["lr_error"] is not None, "an lr set on rank 0 only stepped silently"
        kind, message = got["lr_error"]
        assert kind == "ValueError", got
        assert "param_groups[0]['lr'] is 0.5 on rank 0" in message and "0.1 on rank 1" in message
        kind, message = got["add_error"]
        assert kind == "RuntimeError", got
        assert "[0] in OSS.add_param_group" in message and "[1] in OSS.step" in message, message
        assert got["unchanged"] and got["groups_after"] == 1, got
        assert got["worst"] < 1e-6, got  # (torch's fused SGD kernel rounds otherwise)


class _EmbeddingModel(nn.Module):
    def __init__(self, sparse: bool):
        super().__init__()
        torch.manual_seed(0)
        self.embedding = nn.Embedding(10, 3, sparse=sparse)
        self.head = nn.Linear(3, 2)

    def forward(self, tokens):
        return self.head(self.embedding(tokens))


def _sparse_embedding_on_rank0_only():
    """DDP + OSS with reduce_to_owners_hook, the embedding sparse on rank 0 only: the error of
    the backward, and an all-reduce after it (the ranks still talk)."""
    ddp = DDP(_EmbeddingModel(sparse=skdist.get_rank() == 0))
    opt = OSS(ddp.parameters(), optim=torch.optim.SGD, lr=0.1)
    ddp.register_comm_hook(opt, reduce_to_owners_hook)
    try:
        ddp(torch.tensor([1, 2, 2])).sum().backward()
        error = None
    except Exception as caught:  # DDP re-raises what its comm hook raised
        error = type(caught).__name__, str(caught)
    still_talking = torch.ones(1)
    skdist.all_reduce(still_talking)
    return error, still_talking.item()


def test_reduce_to_owners_hook_refuses_sparse_buckets_of_some_ranks_on_every_rank(world2):
    for error, total in world2.run(_sparse_embedding_on_rank0_only):
        assert error is not None and "reduce_to_owners_hook" in error[1], error
        assert "ValueError" in error[0] + error[1] and "sparse=True" in error[1], error
        assert total == 2.0


def _plain_adamw_keeps_the_fused_kernel():
    return OSS(_model().parameters(), optim=torch.optim.AdamW, lr=0.1).fused


def _run_all():
    assert skdist.get_world_size() == 2
    return {"cases": {(name, later): _amsgrad_after_a_nan_gradient(name, later)
                      for name in ("Adam", "AdamW") for later in (False, True)},
            "plain_fused": _plain_adamw_keeps_the_fused_kernel()}


def test_amsgrad_carries_a_nan_gradient_as_the_plain_optimizer(world2):
    for results in world2.run(_run_all):
        for case, got in results["cases"].items():
            assert got["same_state"] and got["same_params"], (case, got)
            assert got["fused"] is False, (case, got)
        assert results["plain_fused"] is True


def _batch(step: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(step)
    rows = torch.randn(8, 6, generator=gen)
    return rows.chunk(skdist.get_world_size())[skdist.get_rank()]


def _lr_on_one_rank_with_step_in_backward():
    """An lr set on rank 0 only under step_in_backward=True: the backward's error, whether any
    parameter moved, and a few steps after it is set alike again against one process."""
    model, oracle = _mlp(), _mlp()
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    ref = torch.optim.SGD(oracle.parameters(), lr=0.1, momentum=0.9)
    wrapped = ShardedDataParallel(model, opt, step_in_backward=True)
    before = [p.detach().clone() for p in model.parameters()]
    if skdist.get_rank() == 0:
        opt.param_groups[0]["lr"] = 0.5
    error = _error_of(lambda: wrapped(_batch(0)).pow(2).mean().backward())
    if error is None:  # the owners stepped in that backward: finish the step
        opt.step()
    unchanged = all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    opt.param_groups[0]["lr"] = 0.1
    for step in range(3):
        opt.zero_grad()
        ref.zero_grad()
        wrapped(_batch(step)).pow(2).mean().backward()
        opt.step()
        oracle(_full_batch(step)).pow(2).mean().backward()
        ref.step()
    opt.wait_for_sync()
    worst = max((p - q).abs().max().item()
                for p, q in zip(model.parameters(), oracle.parameters()))
    return {"error": error, "unchanged": unchanged, "worst": worst}


def _full_batch(step: int) -> torch.Tensor:
    return torch.randn(8, 6, generator=torch.Generator().manual_seed(step))


def test_lr_set_on_one_rank_fails_on_every_rank_with_step_in_backward(world2):
    for got in world2.run(_lr_on_one_rank_with_step_in_backward):
        assert got["error"] is not None, "an lr set on rank 0 only stepped silently in backward"
        kind, message = got["error"]
        assert kind == "ValueError", got
        assert "param_groups[0]['lr'] is 0.5 on rank 0" in message and "0.1 on rank 1" in message
        assert got["unchanged"], got
        assert got["worst"] < 1e-6, got


def _tensor_betas_that_differ_between_ranks():
    """Adam with betas as tensors, beta2 then set in the 6th digit on rank 1 only (a schedule
    of its own there): the step's error and whether any parameter moved."""
    model = _mlp()
    opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-3,
              betas=(torch.tensor(0.9), torch.tensor(0.999)))
    if skdist.get_rank() == 1:
        opt.param_groups[0]["betas"] = (torch.tensor(0.9), torch.tensor(0.99901))
    before = [p.detach().clone() for p in model.parameters()]
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    error = _error_of(opt.step)
    unchanged = all(torch.equal(p, q) for p, q in zip(model.parameters(), before))
    return {"error": error, "unchanged": unchanged}


def test_tensor_betas_that_differ_between_ranks_fail_on_every_rank(world2):
    for got in world2.run(_tensor_betas_that_differ_between_ranks):
        assert got["error"] is not None, "betas that differ between ranks stepped silently"
        kind, message = got["error"]
        assert kind == "ValueError" and "param_groups[0]['betas']" in message, got
        assert got["unchanged"], got


def test_tensor_betas_are_compared_exactly_and_without_their_device():
    def text(beta2, device="cpu"):
        betas = (torch.tensor(0.9, device=device), torch.tensor(beta2, device=device))
        return param_group_settings([{"params": [], "betas": betas}])["param_groups[0]['betas']"]

    assert text(0.999) != text(0.99901)
    assert "device" not in text(0.999)
    assert text(0.999) == text(0.999)


def _object_all_gathers_in_steps():
    """How many object all-gathers ten steps (five with a LambdaLR) issue, and parity with one
    process."""
    model = _mlp()
    oracle = copy.deepcopy(model)
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    ref = torch.optim.SGD(oracle.parameters(), lr=0.1, momentum=0.9)
    schedules = [torch.optim.lr_scheduler.LambdaLR(o, lambda s: 1.0 / (1 + s)) for o in (opt, ref)]
    gathered = []
    original = skdist.all_gather_object
    skdist.all_gather_object = lambda *a, **k: gathered.append(1) or original(*a, **k)
    try:
        for step in range(10):
            gen = torch.Generator().manual_seed(step)
            grads = [torch.randn(p.shape, generator=gen) for p in model.parameters()]
            for m in (model, oracle):
                for p, g in zip(m.parameters(), grads):
                    p.grad = g.clone()
            opt.step()
            ref.step()
            for schedule in schedules[: 2 if step < 5 else 0]:
                schedule.step()
    finally:
        skdist.all_gather_object = original
    worst = max((p - q).abs().max().item()
                for p, q in zip(model.parameters(), oracle.parameters()))
    return len(gathered), worst


def test_the_agreement_of_a_step_pickles_nothing(world2):
    for gathered, worst in world2.run(_object_all_gathers_in_steps):
        assert gathered == 0, f"{gathered} object all-gathers in 10 steps"
        assert worst < 1e-6
