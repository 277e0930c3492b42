"""An optimizer instance of a class that is not torch's own, sharded: ``OSS(existing)`` and
``shardkit.initialize(model, optimizer=instance)`` at ZeRO stages 1-2, fp32 and bf16.

Such a class's constructor may keep its own arguments beside ``defaults`` (``self.factor =
factor``), or require arguments ``defaults`` cannot supply. Regression: OSS built each rank's
local optimizer again from the class and ``defaults``, so a required argument raised
``TypeError: missing 1 required positional argument`` at stages 1-2 (DeepSpeed steps such an
optimizer as given), and an argument with a default silently took that default (the training
went on with another optimizer). Now the instance is copied on each shard, its constructor not
called again; its step hooks run at each step, given the copy, as DeepSpeed runs them on the
client's optimizer. Every rank's weights follow one fp32 process at every step.
"""

import pytest
import torch
import torch.nn.functional as F

import shardkit
from shardkit import distributed
from shardkit.optim import OSS
from shardkit.testing import world_fixture
from tests.utils.master_weights import fp32_weights
from tests.utils.optimizers import ScaledSGD

world2 = world_fixture(2, timeout=180)

STEPS = 3
TOL = {"fp32": 1e-6, "bf16": 2e-3}  # bf16: the forward and the gradients are bf16


class BoostedAdamW(torch.optim.AdamW):
    """AdamW whose gradients are multiplied by ``boost`` first: an argument with a default,
    kept as an attribute (built again from the class, it silently became 1.0)."""

    def __init__(self, params, lr=1e-3, boost=1.0, **kwargs):
        super().__init__(params, lr=lr, **kwargs)
        self.boost = boost

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.param_groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.grad.mul_(self.boost)
        return super().step(closure)


OPTIMIZERS = {"scaled_sgd": lambda params: ScaledSGD(params, lr=0.05, factor=3.0),
              "boosted_adamw": lambda params: BoostedAdamW(params, lr=0.01, boost=4.0,
                                                           weight_decay=0.1)}


def _model():
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 4))


def _batch(step: int, world: int):
    gen = torch.Generator().manual_seed(50 + step)
    return torch.randn(2 * world, 8, generator=gen), torch.randn(2 * world, 4, generator=gen)


def _oracle_step(model, optimizer, x, y, half):
    """One process over the whole batch: fp32 weights, the forward in ``half`` if any."""
    with torch.autocast("cpu", dtype=half, enabled=half is not None):
        out = model(x)
    F.mse_loss(out.float(), y).backward()
    optimizer.step()
    optimizer.zero_grad()


def _counting_hook(optimizer) -> list:
    calls = []
    optimizer.register_step_post_hook(lambda opt, args, kwargs: calls.append(type(opt)))
    return calls


def _train_engine(name: str, stage: int, precision: str) -> dict:
    rank, world = distributed.get_rank(), distributed.get_world_size()
    model = _model()
    instance = OPTIMIZERS[name](model.parameters())
    calls = _counting_hook(instance)
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "zero_optimization": {"stage": stage}}
    half = None
    if precision == "bf16":
        config["bf16"], half = {"enabled": True}, torch.bfloat16
    engine, *_ = shardkit.initialize(model=model, optimizer=instance, config=config)
    reference = _model()
    with torch.no_grad():  # the engine starts from the 16-bit values
        for p in reference.parameters():
            p.copy_(p.to(half).float() if half else p)
    oracle = OPTIMIZERS[name](reference.parameters())
    worst = 0.0
    for step in range(STEPS):
        x, y = _batch(step, world)
        mine = slice(2 * rank, 2 * rank + 2)
        engine.backward(F.mse_loss(engine(x[mine]).float(), y[mine]))
        engine.step()
        _oracle_step(reference, oracle, x, y, half)
        weights = fp32_weights(engine)
        worst = max(worst, max((weights[k] - v).abs().max().item()
                               for k, v in reference.state_dict().items()))
    return {"diff": worst, "hook_calls": len(calls),
            "hook_given_the_class": all(c is type(instance) for c in calls)}


def _train_oss(name: str) -> dict:
    rank, world = distributed.get_rank(), distributed.get_world_size()
    model, reference = _model(), _model()
    opt = OSS(OPTIMIZERS[name](model.parameters()))
    oracle = OPTIMIZERS[name](reference.parameters())
    worst = 0.0
    for step in range(STEPS):
        x, y = _batch(step, world)
        mine = slice(2 * rank, 2 * rank + 2)
        F.mse_loss(model(x[mine]), y[mine]).backward()
        for p in model.parameters():
            distributed.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        opt.zero_grad()
        _oracle_step(reference, oracle, x, y, None)
        worst = max(worst, max((p - q).abs().max().item()
                               for p, q in zip(model.parameters(), reference.parameters())))
    opt.consolidate_state_dict(recipient_rank=0)
    consolidated = opt.state_dict() if rank == 0 else None
    loads = True
    if consolidated is not None:  # a plain instance of the class takes it and steps on
        plain = OPTIMIZERS[name](_model().parameters())
        plain.load_state_dict(consolidated)
        loads = plain.state_dict()["param_groups"][0]["lr"] == oracle.param_groups[0]["lr"]
    return {"diff": worst, "factor_kept": getattr(opt.optim, "factor", None),
            "boost_kept": getattr(opt.optim, "boost", None), "loads": loads}


def _all_cases() -> dict:
    results = {}
    for name in OPTIMIZERS:
        results[("oss", name)] = _train_oss(name)
        for stage in (1, 2):
            for precision in ("fp32", "bf16"):
                results[(stage, precision, name)] = _train_engine(name, stage, precision)
    return results


@pytest.fixture(scope="module")
def results(world2):
    return world2.run(_all_cases)


@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_oss_takes_over_a_custom_optimizer_and_keeps_its_arguments(results, name):
    for rank, got in enumerate(results):
        case = got[("oss", name)]
        assert case["diff"] <= TOL["fp32"], (rank, case)
        assert case["loads"], (rank, case)
        if name == "scaled_sgd":
            assert case["factor_kept"] == 3.0, (rank, case)
        else:
            assert case["boost_kept"] == 4.0, (rank, case)


@pytest.mark.parametrize("precision", ["fp32", "bf16"])
@pytest.mark.parametrize("stage", [1, 2])
@pytest.mark.parametrize("name", list(OPTIMIZERS))
def test_initialize_shards_a_custom_optimizer_instance(results, name, stage, precision):
    for rank, got in enumerate(results):
        case = got[(stage, precision, name)]
        assert case["diff"] <= TOL[precision], (rank, stage, precision, name, case)
        # the hooks registered on the instance ran once per step on each rank, given the copy
        assert case["hook_calls"] == STEPS, (rank, case)
        assert case["hook_given_the_class"], (rank, case)


class Lookahead(torch.optim.Optimizer):
    """timm's Lookahead shape: a wrapper stepping a base optimizer whose param groups it
    shares, keeping the base (and so every parameter, and the moments) as an attribute."""

    def __init__(self, base, alpha=0.5, k=2):
        super().__init__(base.param_groups, dict(base.defaults, lookahead_alpha=alpha,
                                                 lookahead_k=k))
        self._base_optimizer = base
        self.param_groups = base.param_groups

    @torch.no_grad()
    def step(self, closure=None):
        return self._base_optimizer.step(closure)


class ListedSGD(torch.optim.Optimizer):
    """SGD that steps the parameter list its constructor kept, not ``param_groups``."""

    def __init__(self, params, lr):
        params = list(params)
        super().__init__(params, dict(lr=lr))
        self.params = params

    @torch.no_grad()
    def step(self, closure=None):
        for p in self.params:
            if p.grad is not None:
                p.add_(p.grad, alpha=-self.param_groups[0]["lr"])


class GroupsKeptSGD(torch.optim.Optimizer):
    """SGD that steps the group list its constructor kept (``self.groups = self.param_groups``:
    the copy's own ``param_groups`` is a new list, this one still holds every group)."""

    def __init__(self, params, lr):
        super().__init__(params, dict(lr=lr))
        self.groups = self.param_groups

    @torch.no_grad()
    def step(self, closure=None):
        for group in self.groups:
            for p in group["params"]:
                if p.grad is not None:
                    p.add_(p.grad, alpha=-group["lr"])


HOLDING = {"lookahead": (lambda ps: Lookahead(torch.optim.AdamW(ps, lr=0.01)),
                         "'_base_optimizer'"),
           "listed_sgd": (lambda ps: ListedSGD(ps, lr=0.05), "'params'"),
           "groups_kept_sgd": (lambda ps: GroupsKeptSGD(ps, lr=0.05), "'groups'")}


def _refusals() -> dict:
    """Each optimizer of HOLDING given to OSS, and to initialize at stage 1 (fp32, bf16):
    the error raised, or None."""
    found = {}
    for name, (build, _) in HOLDING.items():
        try:
            OSS(build(_model().parameters()))
            found[("oss", name)] = None
        except TypeError as error:
            found[("oss", name)] = str(error)
        for precision in ("fp32", "bf16"):
            config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 1}}
            if precision == "bf16":
                config["bf16"] = {"enabled": True}
            model = _model()
            try:
                shardkit.initialize(model=model, optimizer=build(model.parameters()),
                                    config=config)
                found[(precision, name)] = None
            except TypeError as error:
                found[(precision, name)] = str(error)
    return found


def test_an_optimizer_holding_its_parameters_outside_its_groups_is_refused(world2):
    """Regression: a copy of such an optimizer (a Lookahead over AdamW) still stepped every
    parameter through the attribute on every rank, and the base's moments were left out of the
    consolidated state dict (resuming silently restarted Adam). Now a TypeError on every rank,
    naming the attribute and the callable to pass instead; classes holding only their own
    arguments are still copied (the tests above)."""
    for rank, found in enumerate(world2.run(_refusals)):
        for (where, name), error in found.items():
            attribute = HOLDING[name][1]
            assert error is not None, (rank, where, name)
            assert attribute in error and "callable" in error, (rank, where, name, error)


def _masters_over_adamw(params):
    from shardkit.optim import MasterWeights
    return MasterWeights.over(torch.optim.AdamW).around(torch.optim.AdamW(params, lr=0.01))


def _shardkit_optimizer_instances() -> dict:
    """A MasterWeights instance (shardkit's own class) taken over by OSS and by initialize at
    stage 1: the largest difference from one process, or the error."""
    OPTIMIZERS["masters_over_adamw"] = _masters_over_adamw
    found = {}
    try:
        for key, train in ((("oss",), lambda: _train_oss("masters_over_adamw")["diff"]),
                           (("fp32",), lambda: _train_engine("masters_over_adamw", 1,
                                                             "fp32")["diff"]),
                           (("bf16",), lambda: _train_engine("masters_over_adamw", 1,
                                                             "bf16")["diff"])):
            try:
                found[key] = train()
            except (TypeError, ValueError) as error:
                found[key] = str(error)
    finally:
        del OPTIMIZERS["masters_over_adamw"]
    return found


def test_a_shardkit_optimizer_instance_is_built_again_on_each_shard(world2):
    """Regression: shardkit's own optimizers were copied like a client's class, so
    ``OSS(MasterWeights.over(AdamW).around(adamw))`` (and initialize given it at stage 1) shared
    the instance's masters and raised "some parameters appear in more than one parameter
    group". Built again from its class on each shard, as torch's, it follows one process."""
    for rank, found in enumerate(world2.run(_shardkit_optimizer_instances)):
        for (where,), diff in found.items():
            tol = TOL["bf16"] if where == "bf16" else TOL["fp32"]
            assert not isinstance(diff, str) and diff <= tol, (rank, where, diff)
