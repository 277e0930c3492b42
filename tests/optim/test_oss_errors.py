"""OSS bad input: clear errors naming the argument and the value, raised before any collective
(these run in the test process itself, where no process group exists)."""

import pytest
import torch

from shardkit import distributed
from shardkit.optim import OSS


def _params():
    return list(torch.nn.Linear(4, 3).parameters())


def test_no_process_group_yet():
    assert not distributed.is_initialized()
    with pytest.raises(RuntimeError, match="OSS needs torch.distributed to be initialised"):
        OSS(_params(), optim=torch.optim.AdamW, lr=1e-3)


def test_parameter_in_two_groups():
    w, b = _params()
    with pytest.raises(ValueError, match=r"param group 0 \(item 0\) and again in group 1"):
        OSS([{"params": [w, b]}, {"params": [w]}], optim=torch.optim.SGD, lr=0.1)


@pytest.mark.parametrize("bad", [torch.nn.Linear, "AdamW", torch.optim.lr_scheduler.StepLR])
def test_optim_that_is_not_an_optimizer_class(bad):
    with pytest.raises(TypeError, match=r"OSS\(optim=.*must be a torch.optim.Optimizer subclass"):
        OSS(_params(), optim=bad, lr=0.1)


def test_optimizer_instance_passed_as_optim():
    params = _params()
    with pytest.raises(TypeError, match="the class, not an instance"):
        OSS(params, optim=torch.optim.SGD(params, lr=0.1))


def test_takeover_with_extra_hyper_parameters():
    with pytest.raises(TypeError, match=r"taken from the AdamW given; do not pass .*\['lr'\]"):
        OSS(torch.optim.AdamW(_params()), lr=0.1)


@pytest.mark.parametrize("kwargs, match", [
    ({"broadcast_fp16": "yes"}, r"broadcast_fp16='yes'\): must be True or False"),
    ({"bucket_numel": 0}, r"bucket_numel=0\): must be a positive int"),
])
def test_bad_flags(kwargs, match):
    with pytest.raises((TypeError, ValueError), match=match):
        OSS(_params(), optim=torch.optim.SGD, lr=0.1, **kwargs)


def test_empty_and_non_tensor_params():
    with pytest.raises(ValueError, match="empty parameter list"):
        OSS([], optim=torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match="item 1 is a str; expected a torch.Tensor"):
        OSS([torch.zeros(2, requires_grad=True), "w"], optim=torch.optim.SGD, lr=0.1)


@pytest.mark.parametrize("model", [torch.nn.Linear(4, 3),
                                   torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.ReLU())])
def test_model_given_instead_of_its_parameters(model):
    """FairScale's (and torch's) ``OSS(model, ...)`` fails with "'Linear' object is not
    iterable", or for an ``nn.Sequential`` with an error about its layers: say what to pass."""
    with pytest.raises(TypeError, match=r"OSS\(params=\.\.\.\): got a module "
                                        r"\((Linear|Sequential)\); pass its parameters, "
                                        r"OSS\(model\.parameters\(\)"):
        OSS(model, optim=torch.optim.SGD, lr=0.1)


def test_parameter_list_is_taken_as_torch_optimizers_take_it():
    """An ``nn.ParameterList`` is a module, but iterates over its parameters: torch's (and
    FairScale's) optimizers take it, and so did OSS until the module check above refused every
    module ("got a module (ParameterList)")."""
    from shardkit.optim.oss_arguments import normalize_param_groups
    weights = torch.nn.ParameterList([torch.nn.Parameter(torch.ones(4)),
                                      torch.nn.Parameter(torch.ones(3))])
    torch.optim.SGD(weights, lr=0.1)
    groups = normalize_param_groups(weights)
    assert len(groups) == 1 and all(a is b for a, b in zip(groups[0]["params"], weights))
    assert len(groups[0]["params"]) == 2


def test_parameters_in_a_set():
    """A set has no order that every rank shares: each rank would partition differently and the
    sync would swap same-shaped parameters silently. Refused before any collective."""
    with pytest.raises(TypeError, match=r"param group 0's 'params': got a set; .*ordered"):
        OSS([{"params": set(_params())}], optim=torch.optim.SGD, lr=0.1)
    with pytest.raises(TypeError, match=r"OSS\(params=\.\.\.\): got a set; .*ordered"):
        OSS(set(_params()), optim=torch.optim.SGD, lr=0.1)


@pytest.mark.parametrize("kwargs, named", [
    ({"optimizer_class": torch.optim.Adam, "lr": 0.01}, "optimizer_class: pass the optimizer "
                                                        "class as optim="),
    ({"process_group": None}, "process_group: pass the group as group="),
    ({"parameters_as_bucket_view": True}, "parameters_as_bucket_view: OSS always syncs"),
    ({"overlap_with_ddp": True}, "overlap_with_ddp: use shardkit.comm_hooks.step_oss_in_ddp"),
])
def test_zero_redundancy_optimizer_arguments_name_what_oss_takes(kwargs, named):
    """A script switching from torch's ZeroRedundancyOptimizer: its keywords are refused naming
    OSS's (they went to the inner optimizer, whose refusal named SGD, not what was asked)."""
    with pytest.raises(TypeError, match="ZeroRedundancyOptimizer's argument") as caught:
        OSS(_params(), **kwargs)
    assert named in str(caught.value), caught.value
