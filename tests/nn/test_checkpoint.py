"""checkpoint_wrapper: same outputs and grads as the plain module, less saved memory, flags;
several backwards, tensor-parallel dropout and pipeline schedules (a world of 2)."""

import copy

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as dist
from shardkit.nn import Pipe
from shardkit.nn import model_parallel as mp
from shardkit.nn.checkpoint import (checkpoint_wrapper, disable_checkpointing, is_checkpointing,
                                    is_recomputing)
from shardkit.nn.pipe import (PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleZeroBubble,
                              split_sequential)
from shardkit.testing import world_fixture
from tests.utils.compare import max_diff
from tests.utils.saved_tensors import saved_bytes

world2 = world_fixture(2)


class TwoInTwoOut(nn.Module):
    """Several inputs (one without grad), a keyword argument, two outputs, dropout and BN."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.bn = nn.BatchNorm1d(8)
        self.drop = nn.Dropout(0.5)

    def forward(self, x, mask, *, scale=1.0):
        h = self.drop(torch.tanh(self.bn(self.lin(x)))) * scale
        return h * mask, h.sum(dim=1)


class FlagProbe(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.seen = []

    def forward(self, x):
        self.seen.append((is_checkpointing(), is_recomputing()))
        return torch.relu(self.lin(x))


def _run(module, x, mask, seed=123):
    torch.manual_seed(seed)
    xg = x.clone().requires_grad_(True)
    a, b = module(xg, mask, scale=2.0)
    (a.square().sum() + b.sum()).backward()
    grads = [p.grad.clone() for p in module.parameters()]
    return a.detach(), b.detach(), xg.grad.clone(), grads


@pytest.mark.parametrize("offload", [False, True])
def test_parity_kwargs_multi_io_dropout_batchnorm(offload):
    plain = TwoInTwoOut()
    wrapped = checkpoint_wrapper(copy.deepcopy(plain), offload_to_cpu=offload)
    assert type(wrapped) is TwoInTwoOut
    assert list(wrapped.state_dict()) == list(plain.state_dict())
    x = torch.randn(16, 8)
    mask = (torch.rand(16, 8) > 0.3).float()  # an input that does not require grad
    ref, got = _run(plain, x, mask), _run(wrapped, x, mask)
    # identical dropout masks (same RNG draw in forward and recomputation) -> identical grads
    assert max_diff(ref[:3], got[:3]) <= 1e-6
    assert max_diff(ref[3], got[3]) <= 1e-6
    # running statistics updated once, not twice (the recomputation leaves them alone)
    assert torch.equal(plain.bn.num_batches_tracked, wrapped.bn.num_batches_tracked)
    assert max_diff([plain.bn.running_mean, plain.bn.running_var],
                    [wrapped.bn.running_mean, wrapped.bn.running_var]) <= 1e-7


def test_flags_first_forward_then_recompute():
    probe = checkpoint_wrapper(FlagProbe())
    assert (is_checkpointing(), is_recomputing()) == (False, False)
    probe(torch.randn(3, 4, requires_grad=True)).sum().backward()
    assert probe.seen == [(True, False), (False, True)]
    assert (is_checkpointing(), is_recomputing()) == (False, False)


def test_disable_checkpointing_and_no_grad_run_plain():
    probe = checkpoint_wrapper(FlagProbe())
    with disable_checkpointing():
        probe(torch.randn(3, 4, requires_grad=True)).sum().backward()
    with torch.no_grad():
        probe(torch.randn(3, 4))
    assert probe.seen == [(False, False), (False, False)]


def test_saved_activation_memory_goes_down():
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU())
              for _ in range(4)]
    plain = nn.Sequential(*copy.deepcopy(blocks))
    ckpt = nn.Sequential(*[checkpoint_wrapper(b) for b in blocks])
    x = torch.randn(32, 64, requires_grad=True)
    plain_bytes, out_plain = saved_bytes(lambda: plain(x))
    ckpt_bytes, out_ckpt = saved_bytes(lambda: ckpt(x))
    assert ckpt_bytes == 4 * 32 * 64 * 4  # each region keeps only its input
    assert plain_bytes >= 4 * 4 * 32 * 64 * 4  # >= four activations saved per block
    out_plain.sum().backward()
    out_ckpt.sum().backward()
    assert max_diff([p.grad for p in plain.parameters()],
                    [p.grad for p in ckpt.parameters()]) <= 1e-6


def test_params_only_region_and_nested_wrapping():
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(5, 5), nn.Tanh(), nn.Sequential(nn.Linear(5, 5), nn.Tanh()))
    ckpt = copy.deepcopy(plain)
    checkpoint_wrapper(ckpt[2])
    checkpoint_wrapper(ckpt)
    x = torch.randn(4, 5)  # no input requires grad: grads still reach the parameters
    plain(x).sum().backward()
    ckpt(x).sum().backward()
    assert max_diff([p.grad for p in plain.parameters()],
                    [p.grad for p in ckpt.parameters()]) <= 1e-6


def test_copies_stay_independent():
    wrapped = checkpoint_wrapper(FlagProbe())
    clone = copy.deepcopy(wrapped)
    clone(torch.randn(2, 4, requires_grad=True)).sum().backward()
    assert wrapped.seen == [] and len(clone.seen) == 2


def test_bad_input():
    with pytest.raises(TypeError, match="module=function"):
        checkpoint_wrapper(lambda x: x)


@pytest.mark.parametrize("value, offload", [(1, True), ("yes", True), (None, False), (0, False),
                                            ([], False)])
def test_offload_to_cpu_takes_any_truthy_or_falsy_value(value, offload):
    wrapped = checkpoint_wrapper(nn.Linear(2, 2), offload_to_cpu=value)
    assert wrapped._shardkit_offload_to_cpu is offload
    x = torch.randn(3, 2, requires_grad=True)
    wrapped(x).sum().backward()
    assert x.grad is not None and wrapped.weight.grad is not None


def _run_twice(module, x, mask):
    """Two backwards through one forward (retain_graph); returns the grads and BN stats."""
    torch.manual_seed(123)
    a, b = module(x, mask, scale=2.0)
    loss = a.square().sum() + b.sum()
    loss.backward(retain_graph=True)
    loss.backward()
    return ([p.grad.clone() for p in module.parameters()],
            [module.bn.running_mean, module.bn.running_var, module.bn.num_batches_tracked])


def test_a_deleted_wrapped_module_is_freed_at_once_and_it_pickles():
    # Before: forward was a bound method stored on its own module (a reference cycle), so
    # `del model` kept the parameters alive until the cyclic GC ran (FairScale binds weakly to
    # avoid exactly that), and torch.save(model) / pickle failed with "AttributeError: 'TwoInTwoOut'
    # object has no attribute '_checkpointed_forward'".
    import gc
    import pickle
    import weakref
    gc.disable()
    try:
        with torch.utils.checkpoint.set_checkpoint_early_stop(False):
            for _ in range(2):  # the first call imports lazily, which keeps its frames
                wrapped = checkpoint_wrapper(TwoInTwoOut())
                _run(wrapped, torch.randn(4, 8), torch.ones(4, 8))
        alive = weakref.ref(wrapped)
        del wrapped
        assert alive() is None
    finally:
        gc.enable()
    plain = TwoInTwoOut()
    loaded = pickle.loads(pickle.dumps(checkpoint_wrapper(copy.deepcopy(plain))))
    x, mask = torch.randn(16, 8), (torch.rand(16, 8) > 0.3).float()
    *ref_outputs, ref_grads = _run(plain, x, mask)
    *got_outputs, got_grads = _run(loaded, x, mask)
    assert max_diff(ref_outputs + ref_grads, got_outputs + got_grads) <= 1e-6
    probe = pickle.loads(pickle.dumps(checkpoint_wrapper(FlagProbe())))
    probe(torch.randn(3, 4, requires_grad=True)).sum().backward()
    assert probe.seen == [(True, False), (False, True)]


class _LinearBatchNormGelu(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)
        self.bn = nn.BatchNorm1d(4)

    def forward(self, x, scale=1.0):
        return F.gelu(self.bn(self.lin(x))) * scale


def test_torch_compile_of_a_model_with_a_checkpointed_block_trains_like_eager():
    # Before: any torch.compile over a checkpoint_wrapper module failed with "NotImplementedError:
    # checkpoint not implemented for <class '...NestedUserFunctionVariable'> context_fn".
    torch.manual_seed(0)
    plain = nn.Sequential(nn.Linear(4, 4), _LinearBatchNormGelu(), nn.Linear(4, 1))
    model = copy.deepcopy(plain)
    checkpoint_wrapper(model[1])
    compiled = torch.compile(model, backend="aot_eager")
    for step in range(2):
        x = torch.randn(6, 4)
        compiled(x).sum().backward()
        plain(x).sum().backward()
    assert max_diff([p.grad for p in plain.parameters()],
                    [p.grad for p in model.parameters()]) <= 1e-5
    assert max_diff(list(plain[1].bn.buffers()), list(model[1].bn.buffers())) <= 1e-6


def test_two_backwards_with_retain_graph_match_plain():
    plain = TwoInTwoOut()
    wrapped = checkpoint_wrapper(copy.deepcopy(plain))
    x = torch.randn(16, 8)
    mask = (torch.rand(16, 8) > 0.3).float()
    ref_grads, ref_stats = _run_twice(plain, x, mask)
    got_grads, got_stats = _run_twice(wrapped, x, mask)
    # both recomputations draw the first forward's dropout mask; BN stats updated once
    assert max_diff(ref_grads, got_grads) <= 1e-6
    assert max_diff(ref_stats, got_stats) == 0
    probe = checkpoint_wrapper(FlagProbe())
    out = probe(torch.randn(3, 4, requires_grad=True)).sum()
    out.backward(retain_graph=True)
    out.backward()
    assert probe.seen == [(True, False), (False, True), (False, True)]


class _TensorParallelBlock(nn.Module):
    """Column-parallel -> dropout on the shards (model-parallel stream) -> row-parallel."""

    def __init__(self):
        super().__init__()
        self.fc1 = mp.ColumnParallelLinear(8, 16, gather_output=False)
        self.fc2 = mp.RowParallelLinear(16, 8, input_is_parallel=True)

    def forward(self, x):
        h = F.gelu(self.fc1(x))
        with mp.get_model_parallel_rng_tracker().fork():
            h = F.dropout(h, 0.5, self.training)
        return x + self.fc2(h)


def _tensor_parallel_grads(wrap):
    mp.model_parallel_manual_seed(0)
    model = wrap(_TensorParallelBlock())
    mp.model_parallel_manual_seed(123)
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    out = model(x)
    out.pow(2).sum().backward()
    with mp.get_model_parallel_rng_tracker().fork():  # where the streams stand afterwards
        after = torch.rand(8)
    return [out.detach(), after, torch.rand(8)] + [p.grad for p in model.parameters()]


def _tensor_parallel_dropout_parity():
    mp.initialize_model_parallel(2)
    try:
        plain = _tensor_parallel_grads(lambda m: m)
        wrapped = _tensor_parallel_grads(checkpoint_wrapper)
        piped = _tensor_parallel_grads(
            lambda m: Pipe(nn.Sequential(m), balance=[1], chunks=1, checkpoint="always"))
        return max_diff(plain, wrapped), max_diff(plain, piped)
    finally:
        mp.destroy_model_parallel()


def test_tensor_parallel_dropout_in_tracker_fork_matches_plain(world2):
    for wrapped_diff, piped_diff in world2.run(_tensor_parallel_dropout_parity):
        assert wrapped_diff <= 1e-6 and piped_diff <= 1e-6


def _pipeline_model(checkpointed):
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(8, 8), nn.Tanh()) for _ in range(2)]
    if checkpointed:
        blocks = [checkpoint_wrapper(b) for b in blocks]
    return nn.Sequential(nn.Linear(8, 8), blocks[0], blocks[1], nn.Linear(8, 4))


def _pipeline_batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(8, 8, generator=g), torch.randn(8, 4, generator=g)


def _train(step_fn, params, steps=2):
    opt = torch.optim.Adam(params, lr=1e-2)
    for step in range(steps):
        opt.zero_grad()
        step_fn(*_pipeline_batch(step))
        opt.step()


def _pipeline_with_checkpointed_blocks_parity():
    rank = dist.get_rank()
    ref = _pipeline_model(checkpointed=False)
    _train(lambda x, y: F.mse_loss(ref(x), y).backward(), ref.parameters())
    ref_stage = split_sequential(ref, [2, 2])[rank]
    out = {}
    for cls in (ScheduleGPipe, Schedule1F1B, ScheduleZeroBubble):  # all recompute in a W pass
        module = split_sequential(_pipeline_model(checkpointed=True), [2, 2])[rank]
        schedule = cls(PipelineStage(module, rank, 2), 2, F.mse_loss)
        _train(lambda x, y: schedule.step(x, target=y), module.parameters())
        out[cls.__name__] = max_diff(module, ref_stage)
    return out


def test_pipeline_schedules_with_checkpointed_blocks_match_single_process(world2):
    for per_schedule in world2.run(_pipeline_with_checkpointed_blocks_parity):
        assert max(per_schedule.values()) <= 1e-5, per_schedule
