"""checkpoint_wrapper: same outputs and grads as the plain module, less saved memory, flags."""

import copy

import pytest
import torch
import torch.nn as nn

from shardkit.nn.checkpoint import (checkpoint_wrapper, disable_checkpointing, is_checkpointing,
                                    is_recomputing)
from tests.utils.compare import max_diff


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


def _saved_bytes(fn):
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    return total[0], out


def test_saved_activation_memory_goes_down():
    torch.manual_seed(0)
    blocks = [nn.Sequential(nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU())
              for _ in range(4)]
    plain = nn.Sequential(*copy.deepcopy(blocks))
    ckpt = nn.Sequential(*[checkpoint_wrapper(b) for b in blocks])
    x = torch.randn(32, 64, requires_grad=True)
    plain_bytes, out_plain = _saved_bytes(lambda: plain(x))
    ckpt_bytes, out_ckpt = _saved_bytes(lambda: ckpt(x))
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
