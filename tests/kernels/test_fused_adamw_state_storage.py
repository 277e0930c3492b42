"""Regressions from the review of ccbaddf (FusedAdamW state dicts on storage of their own).

* ``FusedAdamW.state_dict()`` copied a state tensor only where it did not own its storage or
  was not in its parameter's layout: the state of a parameter alone in its flat buffer (a
  transposed or channels_last one, or one beside a 0-element parameter) came back half live,
  half copied (moments copied and ``step`` live, or the other way round). Taking a state dict,
  training on and loading it resumed with the moments of one step and the bias correction of
  another.
* A parameter repeated in a group (which torch warns of) is numbered in a state dict by its
  last place, as torch numbers it; the dict kept its moments contiguous for a transposed one.
"""

import copy
import warnings

import pytest
import torch

from shardkit.optim import FusedAdamW


def transposed_alone():
    return [torch.randn(4, 6).t()]


def channels_last_alone():
    return [torch.randn(2, 3, 2, 2).to(memory_format=torch.channels_last)]


def beside_an_empty_one():
    return [torch.randn(5, 3), torch.randn(0)]


def sharing_a_buffer():
    return [torch.randn(5, 3), torch.randn(7)]


def contiguous_alone():
    return [torch.randn(5, 3)]


def train(params, opt, gen, steps):
    for _ in range(steps):
        for p in params:
            p.grad = torch.empty_like(p).copy_(torch.randn(p.shape, generator=gen))
        opt.step()


@pytest.mark.parametrize("make", [transposed_alone, channels_last_alone, beside_an_empty_one,
                                  sharing_a_buffer, contiguous_alone])
def test_state_dict_taken_then_trained_on_restores_its_point(backend, make):
    torch.manual_seed(0)
    values = make()
    ours = [torch.nn.Parameter(v.clone(memory_format=torch.preserve_format)) for v in values]
    ref = [torch.nn.Parameter(v.clone(memory_format=torch.preserve_format)) for v in values]
    opt = FusedAdamW(ours, lr=0.05, weight_decay=0.1)
    ref_opt = torch.optim.AdamW(ref, lr=0.05, weight_decay=0.1, foreach=False)
    gen, ref_gen = torch.Generator().manual_seed(1), torch.Generator().manual_seed(1)
    train(ours, opt, gen, 3)
    train(ref, ref_opt, ref_gen, 3)
    saved, ref_saved = opt.state_dict(), copy.deepcopy(ref_opt.state_dict())

    train(ours, opt, gen, 2)
    train(ref, ref_opt, ref_gen, 2)
    for state in saved["state"].values():  # the dict still holds step 3, all of it
        assert state["step"].item() == 3.0
    for state, ref_state in zip(saved["state"].values(), ref_saved["state"].values()):
        for key, value in ref_state.items():
            assert torch.allclose(state[key], value, atol=1e-6), key
    opt.load_state_dict(saved)
    ref_opt.load_state_dict(ref_saved)
    train(ours, opt, gen, 2)
    train(ref, ref_opt, ref_gen, 2)
    for p, q in zip(ours, ref):
        assert torch.allclose(p, q, atol=1e-6)


def test_repeated_parameter_keeps_its_layout_in_the_state_dict():
    weight = torch.nn.Parameter(torch.randn(4, 6).t())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # torch: duplicate parameters in a group
        opt = FusedAdamW([weight, weight], lr=0.1)
    weight.grad = torch.randn(4, 6).t()
    opt.step()
    state = opt.state_dict()["state"]
    assert list(state) == [1]  # torch's numbering: the last place
    for key in ("exp_avg", "exp_avg_sq"):
        assert state[1][key].stride() == weight.stride(), key
        assert torch.equal(state[1][key], opt.state[weight][key])
