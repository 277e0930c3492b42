"""torch FSDP1's ``register_comm_hook`` on shardkit's FSDP (world of 2 gloo ranks).

Parity with torch's own FSDP1 (FULL_SHARD on CPU) registering the same hook, with one process
on the global batch under torch's fp16 / bf16 compress hooks (FULL_SHARD and NO_SHARD, exactly
the hook's rounding), the side values kept working (a parameter no rank used keeps ``.grad``
None, an overflow in one rank's reduced shard reaches every rank), and the refusals torch
makes, raised on every rank before any collective.

Review of the hook registration

``register_comm_hook`` refuses a hook whose signature does not fit a unit's strategy
(world of 2 gloo ranks): torch's ``allreduce_hook`` on a FULL_SHARD model, or its
``reduce_scatter_hook`` on a NO_SHARD one, is named at registration on every rank, before
any collective, and leaves the model free to take the right hook.
"""

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from shardkit import distributed as skd
from shardkit.comm_counter import CommCounter
from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
from shardkit.testing import world_fixture

world2 = world_fixture(2, timeout=240)

STEPS = 3


def _net() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 9), nn.Tanh(), nn.Linear(9, 5), nn.Tanh(),
                         nn.Linear(5, 3))


def _batch(step: int, rank: int) -> torch.Tensor:
    return torch.randn(4, 6, generator=torch.Generator().manual_seed(100 * step + rank))


def _max_diff(a: dict, b: dict) -> float:
    assert sorted(a) == sorted(b)
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _summing_hook(state, grad, output):
    """A hook of the user's own: the sum over ranks (no division), reduce-scattered."""
    dist.reduce_scatter_tensor(output, grad, group=state)


def _decompress_on_cpu(state, grad):
    """torch's ``default_hooks._decompress`` without its ``record_stream``, which CPU
    tensors refuse ("unknown parameter type"): the cast back to the parameters' dtype."""
    grad.data = grad.data.to(state.parameter_type)


def _against_torch_fsdp1() -> dict:
    """torch FSDP1 and shardkit's FSDP, a unit per Linear, the same hook registered on the
    root: the full state dicts after STEPS SGD steps on each rank's own batches."""
    from torch.distributed.algorithms._comm_hooks import default_hooks
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import StateDictType
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy
    rank, group = skd.get_rank(), dist.group.WORLD
    policy = ModuleWrapPolicy({nn.Linear})
    inputs = [_batch(s, rank) for s in range(STEPS)]
    results = {}
    for name, state, hook in (("reduce_scatter_hook", default_hooks.DefaultState(group),
                               default_hooks.reduce_scatter_hook),
                              ("user's summing hook", group, _summing_hook)):
        states = {}
        for which in ("torch", "shardkit"):
            if which == "torch":
                model = TorchFSDP(_net(), device_id=torch.device("cpu"), auto_wrap_policy=policy)
            else:
                model = FSDP(_net(), auto_wrap_policy=policy)
            model.register_comm_hook(state, hook)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
            for x in inputs:  # a micro-batch inside no_sync first: accumulated, then hooked
                with model.no_sync():
                    model(x * 2).pow(2).sum().backward()
                model(x).pow(2).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
            if which == "torch":
                with TorchFSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT):
                    states[which] = {k: v.clone() for k, v in model.state_dict().items()}
            else:
                states[which] = {k: v.clone() for k, v in model.state_dict().items()}
        results[name] = _max_diff(states["torch"], states["shardkit"])
    return results


def _one_process(low: torch.dtype = None) -> dict:
    """One process over both ranks' batches, each step's gradient the mean of the two ranks'
    gradients: exact, or as a ``low``-precision compress hook makes it (each halved in
    ``low``, summed in ``low``)."""
    model = _net()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    for s in range(STEPS):
        per_rank = []
        for r in range(2):
            model(_batch(s, r)).pow(2).sum().backward()
            per_rank.append([p.grad for p in model.parameters()])
            optimizer.zero_grad()
        for p, g0, g1 in zip(model.parameters(), *per_rank):
            p.grad = (g0 + g1) / 2 if low is None else (g0.to(low) / 2 + g1.to(low) / 2).float()
        optimizer.step()
        optimizer.zero_grad()
    return model.state_dict()


def _against_one_process_compressed() -> dict:
    """shardkit's FSDP with torch's own fp16 / bf16 compress hooks (FULL_SHARD, NO_SHARD)
    against one process rounding the gradient mean the same way, and against the exact mean.
    torch's hooks end in a CUDA-only ``record_stream``: swapped for its cast here (CPU)."""
    from torch.distributed.algorithms._comm_hooks import default_hooks
    rank, group = skd.get_rank(), dist.group.WORLD
    exact = _one_process()
    results = {}
    original, default_hooks._decompress = default_hooks._decompress, _decompress_on_cpu
    try:
        for strategy, low, hook in (
                ("FULL_SHARD", torch.float16, default_hooks.fp16_compress_hook),
                ("NO_SHARD", torch.float16, default_hooks.fp16_compress_hook),
                ("FULL_SHARD", torch.bfloat16, default_hooks.bf16_compress_hook)):
            inner = _net()
            inner[2] = FSDP(inner[2], sharding_strategy=strategy)
            model = FSDP(inner, sharding_strategy=strategy)
            model.register_comm_hook(default_hooks.LowPrecisionState(group), hook)
            optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
            for s in range(STEPS):
                model(_batch(s, rank)).pow(2).sum().backward()
                optimizer.step()
                optimizer.zero_grad()
            state = model.state_dict()
            results[(strategy, str(low))] = (_max_diff(_one_process(low), state),
                                             _max_diff(exact, state))
    finally:
        default_hooks._decompress = original
    return results


class _WithUnused(nn.Module):
    def __init__(self):
        super().__init__()
        self.used = nn.Linear(4, 4)
        self.unused = nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


def _overflowing_hook(state, grad, output):
    """A hook whose reduction overflows on rank 0's block only (say an fp16 cast)."""
    if skd.get_rank() == 0:
        grad[0] = float("inf")
    dist.reduce_scatter_tensor(output, grad, group=state)


def _side_values_under_a_hook() -> dict:
    """The values that travel beside the gradients still work under a hook: a parameter no
    rank's forward reached keeps ``.grad`` None, as in one process; an inf that the hook's
    reduction made in rank 0's shard only reaches every rank's shard of the unit."""
    from torch.distributed.algorithms._comm_hooks import default_hooks
    torch.manual_seed(0)
    model = FSDP(_WithUnused())
    model.register_comm_hook(default_hooks.DefaultState(dist.group.WORLD),
                             default_hooks.reduce_scatter_hook)
    model(torch.ones(2, 4)).sum().backward()
    overflowing = FSDP(_net())
    overflowing.register_comm_hook(dist.group.WORLD, _overflowing_hook)
    overflowing(torch.ones(2, 6)).sum().backward()
    return {"used has grad": model.module.used.weight.grad is not None,
            "unused grad": model.module.unused.weight.grad,
            "non-finite here": not all(torch.isfinite(p.grad).all()
                                       for p in overflowing.parameters())}


def _refusals() -> dict:
    from torch.distributed.algorithms._comm_hooks import default_hooks
    state, hook = dist.group.WORLD, default_hooks.allreduce_hook
    errors = {}

    def record(name, call):
        try:
            call()
        except (AssertionError, ValueError) as error:
            errors[name] = (type(error).__name__, str(error))
        else:
            errors[name] = None

    inner = _net()
    inner[0] = FSDP(inner[0])
    root = FSDP(inner)
    record("inner unit", lambda: root.module[0].register_comm_hook(state, hook))
    record("not callable", lambda: root.register_comm_hook(state, "allreduce"))
    root.register_comm_hook(state, _summing_hook)
    record("twice", lambda: root.register_comm_hook(state, _summing_hook))
    late = FSDP(_net())
    late(torch.ones(1, 6)).sum().backward()
    record("after a forward", lambda: late.register_comm_hook(state, _summing_hook))
    singles = [dist.new_group([r]) for r in range(2)]
    hybrid = FSDP(_net(), sharding_strategy="HYBRID_SHARD",
                  process_group=(singles[skd.get_rank()], dist.group.WORLD))
    record("hybrid", lambda: hybrid.register_comm_hook(state, _summing_hook))
    qgz = FSDP(_net(), quantize_gradients=True)
    record("qgZ", lambda: qgz.register_comm_hook(state, _summing_hook))
    return errors


def test_parity_with_torch_fsdp1_under_the_same_hook(world2):
    for results in world2.run(_against_torch_fsdp1):
        for name, diff in results.items():
            assert diff < 1e-5, (name, diff)


def test_fp16_and_bf16_compress_hooks_match_one_process(world2):
    for results in world2.run(_against_one_process_compressed):
        for strategy, (to_rounded, to_exact) in results.items():
            # the hook's fp16 rounding, and only it: the exact mean differs by more
            assert to_rounded < 1e-5 < to_exact, (strategy, to_rounded, to_exact)


def test_use_counts_and_overflow_flag_still_work_under_a_hook(world2):
    for result in world2.run(_side_values_under_a_hook):
        assert result == {"used has grad": True, "unused grad": None, "non-finite here": True}


def test_refusals_name_the_problem_on_every_rank(world2):
    for errors in world2.run(_refusals):
        assert errors["inner unit"][0] == "_RefusedCommHook" and "root" in errors["inner unit"][1]
        assert errors["not callable"][0] == "ValueError" and "'allreduce'" in \
            errors["not callable"][1]
        assert "already registered" in errors["twice"][1]
        assert "first forward" in errors["after a forward"][1]
        assert "HYBRID_SHARD" in errors["hybrid"][1] and "not supported" in errors["hybrid"][1]
        assert errors["qgZ"][0] == "ValueError" and "quantize_gradients" in errors["qgZ"][1]


@pytest.mark.parametrize("catch", [AssertionError, RuntimeError])
def test_refusal_is_torchs_exception_type(catch):
    from shardkit.nn.data_parallel.fully_sharded import _RefusedCommHook
    assert issubclass(_RefusedCommHook, catch)


def _model(strategy: str) -> FSDP:
    torch.manual_seed(0)
    inner = nn.Sequential(nn.Linear(7, 9), nn.Tanh(), nn.Linear(9, 5))
    inner[0] = FSDP(inner[0], sharding_strategy=strategy)
    return FSDP(inner, sharding_strategy=strategy)


def _mismatched_hooks_refused_at_registration() -> dict:
    """Per strategy: the refusal (type, message, collectives issued while refusing), then
    the largest difference between the gradients under the right hook and without any."""
    from torch.distributed.algorithms._comm_hooks import default_hooks
    state = default_hooks.DefaultState(dist.group.WORLD)
    x = torch.ones(2, 7) * (1 + skd.get_rank())
    results = {}
    for strategy, wrong, right in (
            ("FULL_SHARD", default_hooks.allreduce_hook, default_hooks.reduce_scatter_hook),
            ("NO_SHARD", default_hooks.reduce_scatter_hook, default_hooks.allreduce_hook)):
        model = _model(strategy)
        with CommCounter() as comm:
            try:
                model.register_comm_hook(state, wrong)
            except ValueError as error:
                refusal = (type(error).__name__, str(error), len(comm.calls))
            else:
                refusal = None
        model.register_comm_hook(state, right)
        model(x).pow(2).sum().backward()
        reference = _model(strategy)
        reference(x).pow(2).sum().backward()
        diff = max((p.grad - q.grad).abs().max().item()
                   for p, q in zip(model.parameters(), reference.parameters()))
        results[strategy] = (refusal, diff)
    return results


def test_hook_signature_checked_against_each_units_strategy(world2):
    for results in world2.run(_mismatched_hooks_refused_at_registration):
        for strategy, (refusal, diff) in results.items():
            assert refusal is not None, strategy
            kind, message, collectives = refusal
            assert kind == "ValueError" and collectives == 0, (strategy, refusal)
            assert f"sharding_strategy={strategy}" in message, message
            expected = "hook(state, grad)" if strategy == "NO_SHARD" else \
                "hook(state, grad, output)"
            assert expected in message and "hook=" in message, message
            assert diff < 1e-6, (strategy, diff)
