"""OSS's automatic fused kernel and parameters whose state is laid out otherwise in memory.

For SGD, Adam, AdamW and Adagrad left with ``fused=None``, OSS steps its shard with torch's
fused kernel, which pairs a parameter's elements with its state's in memory order. Regression:
a state tensor laid out otherwise than its parameter (a state dict saved contiguous, as a
consolidated one is, loaded for a ``channels_last`` model; state made before ``p.data =
w.t()``) updated each element from another element's state, silently: the steps drifted from
the torch optimizer OSS stands in for (by about the learning rate per step). Each rank now lays
such state out as its parameter is before the fused step, so training matches torch's default
loop step by step (worlds of 1 and 2, under ShardedDataParallel and under plain averaging).

From a review:

OSS's own choice of torch's fused kernel at a world of one, next to the state re-layout of
8ddaef9 (from a review).

The fused kernel walks a parameter, its gradient and its state linearly in memory. Regressions:
a parameter that is not dense (``p.data = big[:, ::2]``) was stepped from the wrong elements and
the kernel wrote into ``big``'s other columns; a gradient kept laid out as before ``p.data =
w.t()`` (``zero_grad(set_to_none=False)``) paired each element with another's gradient; the
state re-layout replaced the state tensor, so a reference the caller held to
``optimizer.state[p]["exp_avg"]`` stopped being the state stepped. OSS now steps such a rank
with torch's default loop (matching torch step by step) and re-lays state out in place.
"""

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from shardkit.nn.data_parallel import ShardedDataParallel
from shardkit.optim import OSS
from shardkit.testing import world_fixture

world1 = world_fixture(1)
world2 = world_fixture(2)

OPTIMIZERS = {"adam": (torch.optim.Adam, {"lr": 0.01}),
              "sgd_momentum": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9}),
              "adagrad": (torch.optim.Adagrad, {"lr": 0.1})}


@pytest.fixture(params=[1, 2], ids=lambda n: f"world{n}")
def world(request):
    return request.getfixturevalue(f"world{request.param}")


def _conv_model(channels_last: bool) -> nn.Module:
    torch.manual_seed(0)
    model = nn.Sequential(nn.Conv2d(3, 4, 3), nn.ReLU(), nn.Conv2d(4, 2, 3), nn.Flatten(),
                          nn.Linear(2 * 4 * 4, 3))
    return model.to(memory_format=torch.channels_last) if channels_last else model


def _image_batch(step: int, world_size: int):
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(2 * world_size, 3, 8, 8, generator=gen)
    return x.to(memory_format=torch.channels_last), torch.randn(2 * world_size, 3, generator=gen)


def _vector_batch(step: int, world_size: int):
    gen = torch.Generator().manual_seed(step)
    x = torch.randn(2 * world_size, 5, generator=gen)
    return x, torch.randn(2 * world_size, 3, generator=gen)


def _train(model, optimizer, reference, ref_optimizer, steps, sharded_ddp: bool,
           batch=_image_batch, before_step=None) -> float:
    """Each rank trains ``model`` on its slice of the global ``batch`` (under
    ShardedDataParallel, or averaging the gradients by hand) and ``reference`` with a plain
    optimizer on the whole batch; returns the worst parameter difference after any step."""
    rank, world_size = dist.get_rank(), dist.get_world_size()
    net = ShardedDataParallel(model, optimizer) if sharded_ddp else model
    worst = 0.0
    for step in steps:
        if before_step is not None:
            before_step(step)
        x, y = batch(step, world_size)
        optimizer.zero_grad()
        ref_optimizer.zero_grad()
        mine = slice(2 * rank, 2 * rank + 2)
        ((net(x[mine]) - y[mine]) ** 2).mean().backward()
        if not sharded_ddp:
            for p in model.parameters():
                dist.all_reduce(p.grad)
                p.grad /= world_size
        ((reference(x) - y) ** 2).mean().backward()
        optimizer.step()
        ref_optimizer.step()
        worst = max(worst, max((p - q).abs().max().item()
                               for p, q in zip(model.parameters(), reference.parameters())))
    return worst


def _resume_channels_last_from_consolidated(name: str, sharded_ddp: bool) -> tuple:
    """Train a channels_last model 3 steps, consolidate OSS's state on every rank, load it into
    a fresh OSS (and into the plain optimizer of the reference), train 3 more steps.
    Returns (whether OSS chose the fused kernel, worst difference after resuming)."""
    optim_class, hyper = OPTIMIZERS[name]
    model = _conv_model(channels_last=True)
    optimizer = OSS(model.parameters(), optim=optim_class, **hyper)
    reference = copy.deepcopy(model)
    _train(model, optimizer, reference, optim_class(reference.parameters(), **hyper), range(3),
           sharded_ddp)
    saved = optimizer.state_dict(all_ranks=True)

    resumed = _conv_model(channels_last=True)
    resumed.load_state_dict(model.state_dict())
    resumed_optimizer = OSS(resumed.parameters(), optim=optim_class, **hyper)
    resumed_optimizer.load_state_dict(copy.deepcopy(saved))
    ref_optimizer = optim_class(reference.parameters(), **hyper)
    ref_optimizer.load_state_dict(copy.deepcopy(saved))
    worst = _train(resumed, resumed_optimizer, reference, ref_optimizer, range(3, 6), sharded_ddp)
    return resumed_optimizer.fused, worst


def _transposed_data_after_state_exists(name: str, sharded_ddp: bool) -> tuple:
    """``p.data = w.t()`` on every rank (and on the reference) after two steps made the state,
    contiguous: the weight is now laid out column-major. Returns (fused, worst difference)."""
    optim_class, hyper = OPTIMIZERS[name]
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.Tanh(),
                          nn.Linear(6, 3))
    reference = copy.deepcopy(model)
    optimizer = OSS(model.parameters(), optim=optim_class, **hyper)
    ref_optimizer = optim_class(reference.parameters(), **hyper)

    def transpose_middle_weight(step):
        if step == 2:
            for m in (model, reference):
                m[2].weight.data = torch.randn(7, 6, generator=torch.Generator().manual_seed(1)).t()

    worst = _train(model, optimizer, reference, ref_optimizer, range(5), sharded_ddp,
                   batch=_vector_batch, before_step=transpose_middle_weight)
    return optimizer.fused, worst


@pytest.mark.parametrize("sharded_ddp", [True, False], ids=["sharded_ddp", "averaged"])
def test_fused_step_after_loading_contiguous_state_for_channels_last_matches_torch(
        world, sharded_ddp):
    for name in OPTIMIZERS:
        results = world.run(_resume_channels_last_from_consolidated, name, sharded_ddp)
        for rank, (fused, worst) in enumerate(results):
            assert fused, f"{name}: OSS did not choose the fused kernel; the test lost its point"
            assert worst < 1e-6, f"{name}, rank {rank}: drifted {worst:.3g} from torch after " \
                                 f"resuming from the consolidated state dict"


@pytest.mark.parametrize("sharded_ddp", [True, False], ids=["sharded_ddp", "averaged"])
def test_fused_step_after_parameter_relaid_out_by_data_assignment_matches_torch(
        world, sharded_ddp):
    for name in OPTIMIZERS:
        results = world.run(_transposed_data_after_state_exists, name, sharded_ddp)
        for rank, (fused, worst) in enumerate(results):
            assert fused, f"{name}: OSS did not choose the fused kernel; the test lost its point"
            assert worst < 1e-6, f"{name}, rank {rank}: drifted {worst:.3g} from torch after " \
                                 f"p.data = w.t()"


OPTIMIZERS_rev = {"adam": (torch.optim.Adam, {"lr": 0.01}),
                  "sgd_nesterov": (torch.optim.SGD, {"lr": 0.1, "momentum": 0.9,
                                                     "nesterov": True}),
                  "adagrad": (torch.optim.Adagrad, {"lr": 0.1})}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 7), nn.Tanh(), nn.Linear(7, 6), nn.Tanh(), nn.Linear(6, 3))


def _train_alike(name: str, relayout, set_to_none: bool = True, steps: int = 4) -> dict:
    """Train a model under OSS and a copy under the plain optimizer, calling
    ``relayout(step, model)`` on both before each step. Returns the worst parameter difference
    and what the relayout left aside (``big`` tensors) in each."""
    optim_class, hyper = OPTIMIZERS_rev[name]
    model = _model()
    reference = copy.deepcopy(model)
    optimizer = OSS(model.parameters(), optim=optim_class, **hyper)
    ref_optimizer = optim_class(reference.parameters(), **hyper)
    assert optimizer.fused, f"{name}: OSS did not choose the fused kernel; the test lost its point"
    aside = {"oss": [], "torch": []}
    worst = 0.0
    for step in range(steps):
        aside["oss"] += relayout(step, model)
        aside["torch"] += relayout(step, reference)
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(4, 5, generator=gen), torch.randn(4, 3, generator=gen)
        for net, opt in ((model, optimizer), (reference, ref_optimizer)):
            opt.zero_grad(set_to_none=set_to_none)
            ((net(x) - y) ** 2).mean().backward()
            opt.step()
        worst = max(worst, max((p - q).abs().max().item()
                               for p, q in zip(model.parameters(), reference.parameters())))
    gaps = [(a - b).abs().max().item() for a, b in zip(aside["oss"], aside["torch"])]
    return {"worst": worst, "aside_gap": max(gaps, default=0.0)}


def _every_other_column(step: int, model: nn.Module) -> list:
    if step != 1:
        return []
    big = torch.randn(6, 14, generator=torch.Generator().manual_seed(1))
    model[2].weight.data = big[:, ::2]
    return [big]


def _transposed(step: int, model: nn.Module) -> list:
    if step == 2:
        model[2].weight.data = model[2].weight.data.t().contiguous().t()
    return []


def _non_dense_parameter_steps_as_torch():
    return {name: _train_alike(name, _every_other_column) for name in OPTIMIZERS_rev}


def _gradient_kept_across_transpose_steps_as_torch():
    return {name: _train_alike(name, _transposed, set_to_none=False) for name in OPTIMIZERS_rev}


def _held_state_reference_after_relayout():
    results = {}
    for name, (optim_class, hyper) in OPTIMIZERS_rev.items():
        model = _model()
        optimizer = OSS(model.parameters(), optim=optim_class, **hyper)
        x = torch.randn(4, 5, generator=torch.Generator().manual_seed(0))
        weight = model[2].weight
        for step in range(4):
            if step == 2:
                weight.data = weight.data.t().contiguous().t()
            optimizer.zero_grad()
            model(x).sum().backward()
            optimizer.step()
            if step == 1:
                key, held = next((k, v) for k, v in optimizer.state[weight].items()
                                 if torch.is_tensor(v) and v.dim() > 0)
        current = optimizer.state[weight][key]
        results[name] = (held is current, current.stride() == weight.stride(), optimizer.fused)
    return results


def test_non_dense_parameter_steps_as_torch_and_leaves_its_base_alone(world1):
    for name, result in world1.run(_non_dense_parameter_steps_as_torch)[0].items():
        assert result["worst"] < 1e-6, f"{name}: drifted {result['worst']:.3g} from torch " \
                                       f"after p.data = big[:, ::2]"
        assert result["aside_gap"] == 0.0, f"{name}: wrote {result['aside_gap']:.3g} into " \
                                           f"big's other columns"


def test_gradient_laid_out_otherwise_than_its_parameter_steps_as_torch(world1):
    for name, result in world1.run(_gradient_kept_across_transpose_steps_as_torch)[0].items():
        assert result["worst"] < 1e-6, f"{name}: drifted {result['worst']:.3g} from torch " \
                                       f"with a gradient kept across p.data = w.t()"


def test_state_reference_held_across_relayout_stays_the_state_stepped(world1):
    results = world1.run(_held_state_reference_after_relayout)[0]
    for name, (same, laid_out, fused) in results.items():
        assert fused, f"{name}: OSS did not keep the fused kernel; the test lost its point"
        assert laid_out, f"{name}: the state was not laid out as its parameter"
        assert same, f"{name}: optimizer.state[p] holds a new tensor after the re-layout; " \
                     f"the caller's reference no longer steps"
