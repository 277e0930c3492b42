"""OSS's collective calls made on some ranks only, its per-step fused-kernel check, and
FusedAdamW over parameters that share memory (one world of 2 gloo ranks; FusedAdamW's tests
run in this process).

Regressions:

- ``OSS.clip_grad_norm`` called on rank 0 only (under ``if rank == 0``) waited in its norm's
  all-reduce, which the other rank's next collective answered: rank 1's next clip returned
  its own partial norm as the global one, silently, and rank 0 hung; ``consolidate_state_dict``
  on one rank, or with another ``recipient_rank`` per rank, hung too. Each is now an error on
  every rank, before anything is clipped or gathered (the agreement ``OSS.step`` already runs:
  one all-gather of two int64s a rank), and the ranks can go on;
- ``OSS._settle_fused_choice`` looked at every parameter on every step (288 µs a step for 1000
  parameters on this machine); it now reads the sync buckets' dtypes only when they were laid
  out again, and a flag the gradient check already computes (7 µs);
- ``FusedAdamW`` over two parameters that share elements (a strided view overlapping another
  view of one tensor) stepped the shared elements 0.3 away from ``torch.optim.AdamW``,
  silently. It is now a ValueError naming both parameters; views that share no element still
  step as torch's AdamW does.
"""

import copy

import pytest
import torch
import torch.nn as nn

from shardkit import distributed as skdist
from shardkit.ops.adam import FusedAdam
from shardkit.optim import OSS, FusedAdamW
from shardkit.testing import world_fixture

world2 = world_fixture(2, timeout=120)


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.Tanh(), nn.Linear(8, 3))


def _seeded_grads(model, step: int) -> None:
    gen = torch.Generator().manual_seed(step)  # the same on every rank, as after DDP
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen).mul_(10).to(p.dtype)


def _error_of(fn):
    try:
        fn()
    except (RuntimeError, ValueError) as error:
        return type(error).__name__, str(error)
    return None


# ---------------------------------------------------------------- collective calls


def _collective_calls_on_some_ranks():
    """clip_grad_norm / consolidate_state_dict on rank 0 only (rank 1 steps), other arguments
    per rank; then a clip on every rank against one process's norm."""
    rank = skdist.get_rank()
    model = _mlp()
    oracle = copy.deepcopy(model)
    opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=0.1)
    before = [p.detach().clone() for p in model.parameters()]
    _seeded_grads(model, 0)
    grads = [p.grad.clone() for p in model.parameters()]
    errors = {
        "clip_vs_step": _error_of(lambda: opt.clip_grad_norm(1.0) if rank == 0 else opt.step()),
        "clip_args": _error_of(lambda: opt.clip_grad_norm(1.0 + rank)),
        "consolidate_vs_step": _error_of(lambda: opt.consolidate_state_dict(0) if rank == 0
                                         else opt.step()),
        "recipients": _error_of(lambda: opt.consolidate_state_dict(recipient_rank=rank)),
    }
    unchanged = all(torch.equal(p, q) for p, q in zip(model.parameters(), before)) and all(
        torch.equal(p.grad, g) for p, g in zip(model.parameters(), grads))
    norm = opt.clip_grad_norm(1.0).item()
    _seeded_grads(oracle, 0)
    want = torch.nn.utils.clip_grad_norm_(oracle.parameters(), 1.0).item()
    opt.step()
    opt.consolidate_state_dict(recipient_rank=-1)
    return {"errors": errors, "unchanged": unchanged, "norm": norm, "want": want,
            "saved": sorted(opt.state_dict()["state"])}


def test_collective_calls_on_some_ranks_fail_on_every_rank(world2):
    for got in world2.run(_collective_calls_on_some_ranks):
        errors = got["errors"]
        kind, message = errors["clip_vs_step"]
        assert kind == "RuntimeError", errors
        assert "[0] in OSS.clip_grad_norm" in message and "[1] in OSS.step" in message, message
        kind, message = errors["clip_args"]
        assert kind == "ValueError" and "max_norm" in message, errors
        assert "1.0 on rank 0" in message and "2.0 on rank 1" in message, message
        kind, message = errors["consolidate_vs_step"]
        assert kind == "RuntimeError" and "[0] in OSS.consolidate_state_dict" in message, errors
        kind, message = errors["recipients"]
        assert kind == "ValueError" and "recipient_rank" in message, errors
        assert got["unchanged"], "a refused call clipped or stepped"
        assert abs(got["norm"] - got["want"]) < 1e-4 * got["want"], got
        assert got["saved"] == [0, 1, 2, 3], got


# ---------------------------------------------------------------- fused choice per step


class _Untouchable(list):
    """A param list that fails when walked (the per-step check must not walk it)."""

    def __iter__(self):
        raise AssertionError("the per-step fused-kernel check walked the parameters")


def _fused_choice_reads_no_parameter():
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(3, 3) for _ in range(50)])
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    _seeded_grads(model, 0)
    opt.step()
    chose_fused = opt.fused
    groups = opt.param_groups + opt.optim.param_groups
    kept = [g["params"] for g in groups]
    for g in groups:
        g["params"] = _Untouchable(g["params"])
    try:
        walked = _error_of(lambda: opt._settle_fused_choice(False))
    except AssertionError as error:
        walked = str(error)
    finally:
        for g, params in zip(groups, kept):
            g["params"] = params
    still_fused = opt.fused
    opt.zero_grad()
    model.double()  # a cast after construction: the default loop from the next step on
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    return {"chose_fused": chose_fused, "walked": walked, "still_fused": still_fused,
            "fused_after_cast": opt.fused}


def _sparse_gradient_turns_fused_off():
    torch.manual_seed(0)
    embedding = nn.Embedding(10, 4, sparse=True)
    opt = OSS(embedding.parameters(), optim=torch.optim.SGD, lr=0.1)
    chose_fused = opt.fused
    embedding(torch.tensor([1, 2, 2])).sum().backward()
    opt.step()
    return chose_fused, opt.fused


def test_the_fused_choice_reads_no_parameter_per_step(world2):
    for got in world2.run(_fused_choice_reads_no_parameter):
        assert got["chose_fused"] and got["still_fused"], got
        assert got["walked"] is None, got
        assert got["fused_after_cast"] is False, got
    for chose_fused, fused_after in world2.run(_sparse_gradient_turns_fused_off):
        assert chose_fused and not fused_after


# ---------------------------------------------------------------- FusedAdamW, shared memory


def _views(kind: str) -> list:
    torch.manual_seed(0)
    base = torch.randn(12)
    columns = base.view(6, 2)
    return {"halves": lambda: [base[:5], base[5:]],
            "columns": lambda: [columns[:, 0], columns[:, 1]],
            "strided_overlap": lambda: [columns[:, 0], base[:6]],
            "overlap": lambda: [base[:7], base[4:]]}[kind]()


def _train(cls, params, steps: int = 3) -> torch.Tensor:
    opt = cls(params, lr=0.1, weight_decay=0.1)
    for step in range(steps):
        gen = torch.Generator().manual_seed(step)
        for p in params:
            p.grad = torch.randn(p.shape, generator=gen)
        opt.step()
    return torch.cat([p.detach().reshape(-1) for p in params])


@pytest.mark.parametrize("kind", ["halves", "columns"])
def test_fused_adamw_steps_views_that_share_no_element_as_torch(kind):
    ours = _train(FusedAdamW, [nn.Parameter(v) for v in _views(kind)])
    want = _train(torch.optim.AdamW, [nn.Parameter(v) for v in _views(kind)])
    assert (ours - want).abs().max().item() < 1e-6


@pytest.mark.parametrize("kind", ["strided_overlap", "overlap"])
def test_fused_optimizers_refuse_parameters_that_share_elements(kind):
    a, b = (nn.Parameter(v) for v in _views(kind))
    with pytest.raises(ValueError, match=r"parameters 0 of param group 0 .* and 1 of param "
                                         r"group 0 .* share memory"):
        FusedAdamW([a, b], lr=0.1)
    opt = FusedAdamW([a], lr=0.1)
    with pytest.raises(ValueError, match="share memory"):
        opt.add_param_group({"params": [b]})
    assert len(opt.param_groups) == 1
    # DeepSpeed's FusedAdam (built without FusedAdamW's constructor): at its first step
    deepspeed_style = FusedAdam([a, b], lr=0.1)
    before = [a.detach().clone(), b.detach().clone()]
    a.grad, b.grad = torch.ones_like(a), torch.ones_like(b)
    with pytest.raises(ValueError, match="share memory"):
        deepspeed_style.step()
    assert torch.equal(a, before[0]) and torch.equal(b, before[1])
