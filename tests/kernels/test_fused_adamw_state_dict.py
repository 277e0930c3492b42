"""Regressions from a hunt through the fused optimizers and their kernels.

* ``FusedAdamW.state_dict()`` (and DeepSpeed's FusedAdam on it) held views into the flat
  state buffers: pickled (an object collective, ``pickle.dumps``, ``torch.save`` of one
  parameter's entry), every view carried its whole buffer, so a state dict of N parameters
  pickled about N times larger than torch.optim.AdamW's; pickling the optimizer did the same.
"""

import copy
import pickle

import pytest
import torch

from shardkit.ops.adam import FusedAdam
from shardkit.optim import FusedAdamW


def stepped_pair(cls, kwargs, n_params=20, numel=1000):
    """``cls`` and torch.optim.AdamW(fused=True) over equal parameters, one equal step each."""
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(numel, generator=gen) for _ in range(n_params)]
    grads = [torch.randn(numel, generator=gen) for _ in range(n_params)]
    ours = [torch.nn.Parameter(v.clone()) for v in values]
    ref = [torch.nn.Parameter(v.clone()) for v in values]
    opt, ref_opt = cls(ours, **kwargs), torch.optim.AdamW(ref, fused=True, **kwargs)
    for params, optimizer in ((ours, opt), (ref, ref_opt)):
        for p, g in zip(params, grads):
            p.grad = g.clone()
        optimizer.step()
    return (ours, opt), (ref, ref_opt)


@pytest.mark.parametrize("cls,kwargs", [(FusedAdamW, dict(amsgrad=True, weight_decay=0.1)),
                                        (FusedAdamW, dict()),
                                        (FusedAdam, dict(weight_decay=0.01))])
def test_state_dict_pickles_as_small_as_torch_adamws(backend, cls, kwargs):
    (params, opt), (_, ref_opt) = stepped_pair(cls, kwargs)
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    assert len(pickle.dumps(sd)) < 1.05 * len(pickle.dumps(ref_sd))
    assert len(pickle.dumps(sd["state"][3])) < 1.05 * len(pickle.dumps(ref_sd["state"][3]))
    for index, state in sd["state"].items():
        assert state.keys() == ref_sd["state"][index].keys()
        for key, value in state.items():
            assert value.untyped_storage().nbytes() == value.numel() * value.element_size()
            expected = ref_sd["state"][index][key]
            assert value.dtype == expected.dtype and value.shape == expected.shape
            if backend == "torch":  # torch's own fused kernel on CPU: the same bits
                assert torch.equal(value, expected), (index, key)

    # the copies are the live state's values, and a copy is all they are
    live = opt.state[params[3]]["exp_avg"]
    assert torch.equal(sd["state"][3]["exp_avg"], live)
    sd["state"][3]["exp_avg"].add_(1.0)
    assert not torch.equal(sd["state"][3]["exp_avg"], live)


def test_pickled_optimizer_is_small_and_trains_on(backend):
    (params, opt), (ref_params, ref_opt) = stepped_pair(FusedAdamW, dict(weight_decay=0.1))
    assert len(pickle.dumps((params, opt))) < 1.1 * len(pickle.dumps((ref_params, ref_opt)))
    twins = [pickle.loads(pickle.dumps((params, opt))), copy.deepcopy((params, opt))]
    gen = torch.Generator().manual_seed(1)
    grads = [torch.randn(p.shape, generator=gen) for p in params]
    for twin_params, twin in twins + [(params, opt)]:
        for p, g in zip(twin_params, grads):
            p.grad = g.clone()
        twin.step()
    for twin_params, twin in twins:
        for p, q in zip(params, twin_params):
            assert torch.equal(p, q)
            assert opt.state[p]["step"].item() == twin.state[q]["step"].item() == 2


def strided_params():
    """A transposed matrix, a channels_last convolution weight and a plain vector."""
    gen = torch.Generator().manual_seed(0)
    return [torch.nn.Parameter(torch.randn(6, 4, generator=gen).t()),
            torch.nn.Parameter(torch.randn(2, 3, 4, 4, generator=gen)
                               .to(memory_format=torch.channels_last)),
            torch.nn.Parameter(torch.randn(5, generator=gen))]


def step_with_grads(params, opt, seed):
    """One step on gradients laid out like their parameters (as autograd gives them)."""
    gen = torch.Generator().manual_seed(seed)
    for p in params:
        p.grad = torch.empty_like(p).copy_(torch.randn(p.shape, generator=gen))
    opt.step()


def test_strided_parameters_state_round_trips_through_torchs_fused_adamw(backend):
    """torch.optim.AdamW(fused=True) -> FusedAdamW -> torch.optim.AdamW(fused=True), with a
    transposed and a channels_last parameter, trains as torch alone. The saved moments have
    the parameters' layout, as torch's: torch's fused kernel pairs memory element by element,
    and contiguous moments of these parameters updated the wrong elements."""
    kw = dict(lr=0.1, weight_decay=0.1, amsgrad=True)
    ref, moved = strided_params(), strided_params()
    ref_opt, first = (torch.optim.AdamW(ps, fused=True, **kw) for ps in (ref, moved))
    for seed in range(2):
        step_with_grads(ref, ref_opt, seed)
        step_with_grads(moved, first, seed)
    middle = FusedAdamW(moved, **kw)
    middle.load_state_dict(copy.deepcopy(first.state_dict()))
    step_with_grads(ref, ref_opt, 2)
    step_with_grads(moved, middle, 2)

    saved = pickle.loads(pickle.dumps(middle.state_dict()))
    assert saved["param_groups"][0]["fused"] is True  # kept from torch's state dict
    for index, p in enumerate(moved):
        assert saved["state"][index]["exp_avg"].stride() == p.stride()
    last = torch.optim.AdamW(moved, fused=True, **kw)
    last.load_state_dict(saved)
    for seed in (3, 4):
        step_with_grads(ref, ref_opt, seed)
        step_with_grads(moved, last, seed)
    for p, q in zip(ref, moved):
        torch.testing.assert_close(q, p, rtol=0, atol=0 if backend == "torch" else 1e-6)


@pytest.mark.parametrize("kwargs", [dict(amsgrad=True, weight_decay=0.1),
                                    dict(maximize=True, weight_decay=0.0)])
def test_complex_parameters_step_as_torchs_adamw(backend, kwargs):
    """Complex parameters (beside a real one, one of them transposed) train as with
    torch.optim.AdamW, which steps each complex tensor as its real view; the state keeps
    torch's complex format and loads back into torch.optim.AdamW."""
    gen = torch.Generator().manual_seed(0)
    values = [torch.randn(3, 5, dtype=torch.complex64, generator=gen),
              torch.randn(4, 3, dtype=torch.complex64, generator=gen).t(),
              torch.randn(6, generator=gen)]
    ours = [torch.nn.Parameter(v.clone()) for v in values]
    ref = [torch.nn.Parameter(v.clone()) for v in values]
    opt, ref_opt = FusedAdamW(ours, lr=0.05, **kwargs), torch.optim.AdamW(ref, lr=0.05, **kwargs)
    for seed in range(3):
        step_with_grads(ours, opt, seed)
        step_with_grads(ref, ref_opt, seed)
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
    sd, ref_sd = opt.state_dict(), ref_opt.state_dict()
    for index, state in ref_sd["state"].items():
        for key, value in state.items():
            assert sd["state"][index][key].dtype == value.dtype
            torch.testing.assert_close(sd["state"][index][key], value, rtol=1e-6, atol=1e-6)
    back = torch.optim.AdamW(ref, lr=0.05, **kwargs)
    back.load_state_dict(pickle.loads(pickle.dumps(sd)))  # as a checkpoint gives it
    step_with_grads(ours, opt, 3)
    step_with_grads(ref, back, 3)
    for p, q in zip(ours, ref):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-6)
