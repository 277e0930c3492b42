"""Compressed DDP comm hooks under torch DDP + OSS, in one world of 2 gloo ranks: gradients and
trained weights against fp32 DDP, and the bytes CommCounter sees against fp32's."""

import pytest
import torch
import torch.nn as nn

from shardkit import distributed as skdist
from shardkit.comm_hooks import (QuantizedHookState, bf16_allreduce_hook,
                                 counted_allreduce_hook, fp16_allreduce_hook,
                                 quantized_allreduce_hook)
from shardkit.optim import OSS
from shardkit.quantized_comm import wire_bytes
from shardkit.testing import world_fixture

world2 = world_fixture(2)
HOOKS = {"fp32": (None, counted_allreduce_hook), "bf16": (None, bf16_allreduce_hook),
         "fp16": (None, fp16_allreduce_hook),
         "int8": (QuantizedHookState(bits=8), quantized_allreduce_hook),
         "int4": (QuantizedHookState(bits=4, block=64), quantized_allreduce_hook)}


def _train(hook: str, steps: int = 3):
    """A small MLP under torch DDP with ``hook``, stepped by OSS(SGD); per step: the averaged
    gradients, the bytes and (op, dtype) of the collectives backward issued."""
    from torch.nn.parallel import DistributedDataParallel

    rank = skdist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 8))
    ddp = DistributedDataParallel(model)
    state, fn = HOOKS[hook]
    ddp.register_comm_hook(state, fn)
    optimizer = OSS(ddp.parameters(), optim=torch.optim.SGD, lr=0.1)
    records = []
    for step in range(steps):
        x = torch.randn(16, 32, generator=torch.Generator().manual_seed(100 * step + rank))
        optimizer.zero_grad()
        with skdist.CommCounter() as comm:
            ddp(x).pow(2).mean().backward()
        grads = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
        records.append((grads, comm.bytes, sorted({(c.op, c.dtype) for c in comm.calls})))
        optimizer.step()
    weights = torch.cat([p.detach().reshape(-1) for p in model.parameters()])
    return records, weights


def _run_all():
    return {name: _train(name) for name in HOOKS}


@pytest.fixture(scope="module")
def runs(world2):
    return world2.run(_run_all)


RELATIVE_ERROR = {"bf16": 2.0 ** -7, "fp16": 2.0 ** -10, "int8": 3 / 127, "int4": 3 / 7}
WIRE = {"int8": 8 / 32 + 1 / 256, "int4": 4 / 32 + 1 / 64}  # x fp32, before padding


@pytest.mark.parametrize("hook", ["bf16", "fp16", "int8", "int4"])
def test_compressed_hook_matches_fp32_ddp_within_its_precision(runs, hook):
    for rank_runs in runs:
        (reference, ref_weights), (records, weights) = rank_runs["fp32"], rank_runs[hook]
        grads, ref_grads = records[0][0], reference[0][0]  # step 0: the same weights
        scale = ref_grads.abs().max()
        err = (grads - ref_grads).abs().max()
        assert err <= RELATIVE_ERROR[hook] * scale, (hook, float(err / scale))
        assert err > 0, "the gradients really travelled compressed"
        assert torch.allclose(weights, ref_weights, atol=0.05 * float(ref_weights.abs().max()))
    assert torch.equal(runs[0][hook][1], runs[1][hook][1]), "ranks stay in sync"


@pytest.mark.parametrize("hook", ["bf16", "fp16", "int8", "int4"])
def test_compressed_hook_bytes(runs, hook):
    for rank_runs in runs:
        fp32_bytes = rank_runs["fp32"][0][0][1]
        records = rank_runs[hook][0]
        for _, nbytes, ops in records:
            if hook in ("bf16", "fp16"):
                dtype = torch.bfloat16 if hook == "bf16" else torch.float16
                assert ops == [("all_reduce", dtype)]
                assert nbytes == fp32_bytes / 2
            else:
                assert ops == [("all_gather", torch.uint8), ("all_to_all", torch.uint8)]
                state = HOOKS[hook][0]
                psi = int(fp32_bytes / 4)  # one bucket of all the gradients, N = 2
                per_op = wire_bytes(-(-psi // 2), 2, bits=state.bits, block=state.block)
                assert nbytes == 2 * per_op, "a quantized reduce-scatter and all-gather"
                assert nbytes <= WIRE[hook] * fp32_bytes * (1 + state.block / (psi / 2))


def _train_reduced_to_owners(steps: int = 4, bucket_cap_mb: float = 0.004):
    """torch DDP + OSS(AdamW) with reduce_to_owners_hook (small buckets: several per backward)
    against single-process AdamW on the global batch, at every step; per step the bytes the
    hook sent and whether the gradients this rank does not own are zero."""
    from torch.nn.parallel import DistributedDataParallel
    from shardkit.comm_hooks import reduce_to_owners_hook

    rank, n = skdist.get_rank(), skdist.get_world_size()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                          nn.Linear(64, 8))
    oracle = nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 64), nn.Tanh(),
                           nn.Linear(64, 8))
    oracle.load_state_dict(model.state_dict())
    ddp = DistributedDataParallel(model, bucket_cap_mb=bucket_cap_mb)
    optimizer = OSS(ddp.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    ddp.register_comm_hook(optimizer, reduce_to_owners_hook)
    reference = torch.optim.AdamW(oracle.parameters(), lr=1e-2)
    owned = {id(p) for p, r in optimizer.param_to_rank.items() if r == rank}
    psi = sum(p.numel() for p in model.parameters())
    worst, sent, zero_elsewhere = 0.0, [], []
    for step in range(steps):
        batch = [torch.randn(8, 32, generator=torch.Generator().manual_seed(100 * step + r))
                 for r in range(n)]
        reference.zero_grad()
        for x in batch:
            (oracle(x).pow(2).mean() / n).backward()
        reference.step()
        optimizer.zero_grad()
        with skdist.CommCounter() as comm:
            ddp(batch[rank]).pow(2).mean().backward()
        # DESIGN.md's convention: a rooted reduce counts (N-1)/N of the gradients on every
        # rank (the ranks' sends of their not-owned shares, averaged)
        sent.append((comm.by_op.get("reduce", 0), 4 * psi * (n - 1) / n))
        zero_elsewhere.append(all(not p.grad.any() for p in model.parameters()
                                  if id(p) not in owned))
        optimizer.step()
        worst = max(worst, max((p - q).abs().max().item()
                               for p, q in zip(model.parameters(), oracle.parameters())))
    return worst, sent, zero_elsewhere


def test_reduce_to_owners_hook_trains_like_one_process_on_stage2_bytes(world2):
    for worst, sent, zero_elsewhere in world2.run(_train_reduced_to_owners):
        assert worst <= 1e-5, worst
        for counted, expected in sent:  # (N-1)/N of exactly Ψ: no padding
            assert counted == expected, sent
        assert all(zero_elsewhere)


class _WithEmptyParameter(nn.Module):
    """A weight and a zero-element parameter: at world 2 OSS gives each its own rank, so one
    rank owns nothing but zero elements and receives nothing."""

    def __init__(self):
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))
        self.z = nn.Parameter(torch.zeros(0))

    def forward(self, x):
        return (x * self.w).sum() + self.z.sum()


def _owner_of_only_zero_elements_trains():
    from torch.nn.parallel import DistributedDataParallel
    from shardkit.comm_hooks import reduce_to_owners_hook

    rank, world = skdist.get_rank(), skdist.get_world_size()
    model, oracle = _WithEmptyParameter(), _WithEmptyParameter()
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    ref_opt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(opt, reduce_to_owners_hook)
    owners = sorted(opt.param_to_rank[p] for p in model.parameters())
    for step in range(2):
        x = torch.randn(world, 4, generator=torch.Generator().manual_seed(step))
        ddp(x[rank]).backward()
        opt.step()
        opt.zero_grad()
        ref_opt.zero_grad()
        (oracle(x.sum(0)) / world).backward()
        ref_opt.step()
    return owners, (model.w - oracle.w).abs().max().item()


def test_reduce_to_owners_hook_with_a_rank_owning_only_zero_elements(world2):
    for owners, worst in world2.run(_owner_of_only_zero_elements_trains):
        assert owners == [0, 1], owners  # the zero-element parameter has a rank of its own
        assert worst <= 1e-6, worst


def _hook_with_a_foreign_optimizer():
    from torch.nn.parallel import DistributedDataParallel
    from shardkit.comm_hooks import reduce_to_owners_hook

    model = nn.Linear(4, 4)
    stranger = OSS(nn.Linear(4, 4).parameters(), optim=torch.optim.SGD, lr=0.1)
    ddp = DistributedDataParallel(model)
    ddp.register_comm_hook(stranger, reduce_to_owners_hook)
    try:
        ddp(torch.ones(2, 4)).sum().backward()
    except Exception as e:  # DDP re-raises the hook's error
        return str(e)
    return ""


def test_reduce_to_owners_hook_names_a_parameter_oss_does_not_hold(world2):
    for message in world2.run(_hook_with_a_foreign_optimizer):
        assert "is not in the OSS optimizer" in message, message


def _step_in_ddp_backward_refusals():
    from torch.nn.parallel import DistributedDataParallel
    from shardkit.comm_hooks import step_oss_in_ddp_backward

    errors = {}
    model = nn.Linear(4, 4)
    oss = OSS(model.parameters(), optim=torch.optim.AdamW, lr=0.1)
    try:
        step_oss_in_ddp_backward(DistributedDataParallel(model), oss)
    except ValueError as e:
        errors["bucket_view"] = str(e)
    lbfgs = OSS(model.parameters(), optim=torch.optim.LBFGS, lr=0.1)
    try:
        step_oss_in_ddp_backward(DistributedDataParallel(model, gradient_as_bucket_view=True),
                                 lbfgs)
    except ValueError as e:
        errors["optimizer"] = str(e)
    return errors


def test_step_oss_in_ddp_backward_refuses_what_it_cannot_step(world2):
    for errors in world2.run(_step_in_ddp_backward_refusals):
        assert "gradient_as_bucket_view=True" in errors["bucket_view"], errors
        assert "LBFGS does not update each parameter" in errors["optimizer"], errors


class _Routed(nn.Module):
    """``b`` used on one rank per step (alternating), ``c`` on none: a mixture-of-experts
    router's pattern under DDP with ``find_unused_parameters`` or ``static_graph``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.b, self.c = nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x, use_b: bool):
        h = self.a(x)
        return self.b(h) if use_b else h


def _step_in_backward_with_unused_parameters():
    """step_oss_in_ddp_backward against torch DDP + SGD (momentum, weight decay; OSS picks
    torch's fused kernel: rounding apart) when the owner of ``b`` did not use it (DDP gives
    its ``.grad`` only when backward ends, after the step in the hook: it was skipped) and
    ``c`` is used nowhere (``None`` everywhere: not stepped)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from shardkit.comm_hooks import step_oss_in_ddp_backward
    rank = skdist.get_rank()
    out = {}
    for kw in ({"find_unused_parameters": True}, {"static_graph": True}):
        ref = DDP(_Routed(), gradient_as_bucket_view=True, **kw)
        ddp = DDP(_Routed(), gradient_as_bucket_view=True, **kw)
        hyper = dict(lr=0.1, momentum=0.9, weight_decay=0.01)
        ref_opt = torch.optim.SGD(ref.parameters(), **hyper)
        opt = OSS(ddp.parameters(), optim=torch.optim.SGD, **hyper)
        step_oss_in_ddp_backward(ddp, opt)
        worst = 0.0
        for step in range(4):
            x = torch.randn(8, 4, generator=torch.Generator().manual_seed(10 * step + rank))
            use_b = rank == step % 2 if "find_unused_parameters" in kw else rank == 0
            for model, optimizer in ((ref, ref_opt), (ddp, opt)):
                optimizer.zero_grad()
                model(x, use_b).pow(2).sum().backward()
                optimizer.step()
            opt.wait_for_sync()
            worst = max(worst, max(float((p - q).abs().max()) for p, q in
                                   zip(ref.parameters(), ddp.parameters())))
        out[next(iter(kw))] = (worst, [p.grad is None for p in ddp.module.c.parameters()])
    return out


def test_step_oss_in_ddp_backward_steps_parameters_their_owner_did_not_use(world2):
    for out in world2.run(_step_in_backward_with_unused_parameters):
        for option, (worst, c_grads_none) in out.items():
            assert worst <= 1e-6 and c_grads_none == [True, True], (option, worst, c_grads_none)
