"""Refusals that only some ranks reach, and ranks given different models, optimizers or configs.

Each check of ``compose``/``initialize`` reads the rank's own model, optimizer and config. When
they differ between ranks (the llama-recipes pattern builds the real model on rank 0 and a meta
model elsewhere; a sparse embedding, a frozen layer, a learning rate or a config key on one rank
only), the refusing ranks used to raise while the others went on into the wrappers' first
collective and hung (or trained different replicas without a word). Now the ranks agree once,
before any wrapper collective: every rank raises the same error naming the refusing ranks, or
the first difference. ShardedDataParallel still trains like one process when requires_grad
changes alike on every rank. One world of 2 gloo ranks; each body returns what every rank
raised.
"""

import pytest
import torch
import torch.nn as nn

import shardkit
from shardkit import distributed as skdist
from shardkit import recipes
from shardkit.nn.data_parallel import ShardedDataParallel
from shardkit.optim import OSS
from shardkit.testing import world_fixture

world2 = world_fixture(2, timeout=90, failure_grace_s=20)


def _mlp(width: int = 8) -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, width), nn.ReLU(), nn.Linear(width, 3))


class _Embedded(nn.Module):
    def __init__(self, sparse: bool):
        super().__init__()
        torch.manual_seed(0)
        self.emb = nn.Embedding(10, 4, sparse=sparse)
        self.lin = nn.Linear(4, 3)

    def forward(self, x):
        return self.lin(self.emb(x))


def _raised(fn) -> str:
    try:
        fn()
    except Exception as error:  # what this rank raised, for the test to compare across ranks
        return f"{type(error).__name__}: {error}"
    return "no error"


def _config(stage: int, lr: float = 0.1) -> dict:
    return {"train_batch_size": 4, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "SGD", "params": {"lr": lr}}}


# ---------------------------------------------------------------------- rank-side bodies


def _meta_on_all_ranks_but_rank0() -> dict:
    out = {}
    for stage in (0, 1, 2):
        def model():
            if skdist.get_rank() == 0:
                return _mlp()
            with torch.device("meta"):
                return _mlp()
        m = model()
        out[f"compose {stage}"] = _raised(lambda: recipes.compose(m, stage, recipes.adamw(lr=1e-2)))
        m = model()
        out[f"initialize {stage}"] = _raised(
            lambda: shardkit.initialize(model=m, config=_config(stage)))
    return out


def _sparse_on_rank1_only() -> dict:
    out = {}
    sparse = skdist.get_rank() == 1
    for stage in (1, 2, 3):
        m = _Embedded(sparse)
        out[f"compose {stage}"] = _raised(
            lambda: recipes.compose(m, stage, recipes.OptimizerRecipe(torch.optim.SGD,
                                                                      {"lr": 0.1})))
    m = _Embedded(sparse)
    out["initialize 2"] = _raised(lambda: shardkit.initialize(model=m, config=_config(2)))
    return out


def _one_rank_differs() -> dict:
    """Nothing any rank refuses by itself: a wider layer, a frozen layer, another learning
    rate, another stage, a config key on rank 1; a factory that fails on rank 1 only."""
    r1 = skdist.get_rank() == 1
    sgd = recipes.OptimizerRecipe(torch.optim.SGD, {"lr": 0.1})
    out = {}
    for stage in (0, 2, 3):
        m = _mlp(9 if r1 else 8)
        out[f"shape {stage}"] = _raised(lambda: recipes.compose(m, stage, sgd))
        m = _mlp()
        m[0].weight.requires_grad_(not r1)
        out[f"frozen {stage}"] = _raised(lambda: recipes.compose(m, stage, sgd))
        m = _mlp()
        lr = recipes.OptimizerRecipe(torch.optim.SGD, {"lr": 0.5 if r1 else 0.1})
        out[f"lr {stage}"] = _raised(lambda: recipes.compose(m, stage, lr))
    m = _mlp()
    out["stage"] = _raised(lambda: recipes.compose(m, 1 if r1 else 2, sgd))
    m = _mlp()
    out["config"] = _raised(lambda: shardkit.initialize(model=m, config=_config(
        2, lr=0.5 if r1 else 0.1)))

    def factory(params):
        if r1:
            raise ValueError("this factory refuses on rank 1")
        return torch.optim.SGD(params, lr=0.1)
    m = _mlp()
    config = {"train_batch_size": 4, "zero_optimization": {"stage": 2}}
    out["factory"] = _raised(
        lambda: shardkit.initialize(model=m, optimizer=factory, config=config))
    return out


class _Refused(Exception):
    """A user's own error class: every rank must raise this class, not a RuntimeError."""


def _error_classes_kept_and_per_rank_keys() -> dict:
    """What a refusal on rank 1 only raises on both ranks (its own class: a KeyError from the
    user's optimizer factory, the user's own exception class); an optimizer that stepped on
    rank 1 only, at stage 0 (replicated: the replicas would diverge); a config that differs
    only in a per-rank key (``nvme_path``), which passes."""
    r1 = skdist.get_rank() == 1
    out = {}
    for name, error in (("key", KeyError("no such group")), ("own", _Refused("user's own"))):
        def factory(params, error=error):
            if r1:
                raise error
            return torch.optim.SGD(params, lr=0.1)
        config = {"train_batch_size": 4, "zero_optimization": {"stage": 2}}
        out[name] = _raised(
            lambda: shardkit.initialize(model=_mlp(), optimizer=factory, config=config))

    def every_rank_refuses(params):
        raise ValueError(f"rank {skdist.get_rank()} says no")
    config = {"train_batch_size": 4, "zero_optimization": {"stage": 2}}
    out["all refuse"] = _raised(lambda: shardkit.initialize(
        model=_mlp(), optimizer=every_rank_refuses, config=config))
    m = _mlp()
    adam = torch.optim.Adam(m.parameters(), lr=0.1)
    if r1:
        m(torch.randn(2, 4)).sum().backward()
        adam.step()
        adam.zero_grad()
    out["stepped"] = _raised(lambda: recipes.compose(m, 0, recipes.OptimizerRecipe.of(adam)))
    config = _config(2)
    config["zero_optimization"]["offload_optimizer"] = {
        "device": "cpu", "nvme_path": f"/local_nvme/rank{skdist.get_rank()}"}
    out["nvme_path"] = _raised(lambda: shardkit.initialize(model=_mlp(), config=config))
    return out


def _agreeing_ranks_still_train() -> list:
    """Same model and config everywhere: the agreement passes and a step runs."""
    sums = []
    for stage in (0, 1, 2, 3):
        m = _mlp()
        engine, *_ = shardkit.initialize(model=m, config=_config(stage))
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(skdist.get_rank()))
        engine.backward(engine(x).sum())
        engine.step()
        with torch.no_grad():
            if stage == 3:
                with engine.wrapped.summon_full_params():
                    sums.append(round(sum(p.sum().item() for p in engine.wrapped.parameters()), 5))
            else:
                sums.append(round(sum(p.sum().item() for p in m.parameters()), 5))
    return sums


def _sharded_ddp_trainable_change(where: str, auto: bool):
    """Freeze the first layer before the second forward (on every rank). Returns what was
    raised and the largest difference from a one-process oracle."""
    model, oracle = _mlp(), _mlp()
    optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    ref_optimizer = torch.optim.SGD(oracle.parameters(), lr=0.1)
    wrapped = ShardedDataParallel(model, optimizer, auto_refresh_trainable=auto)
    rank, world = skdist.get_rank(), skdist.get_world_size()

    def train():
        for step in range(3):
            batch = torch.randn(2 * world, 4, generator=torch.Generator().manual_seed(step))
            if step == 1 and (where == "every rank" or rank == 1):
                model[0].weight.requires_grad_(False)
                oracle[0].weight.requires_grad_(False)
                if not auto and where == "every rank":  # a collective: every rank calls it
                    wrapped.refresh_trainable()
            optimizer.zero_grad()
            ref_optimizer.zero_grad()
            wrapped(batch[2 * rank:2 * rank + 2]).sum().backward()
            oracle(batch).sum().div(world).backward()
            optimizer.step()
            ref_optimizer.step()
    raised = _raised(train)
    pairs = zip(model.parameters(), oracle.parameters())
    worst = max((p - q).abs().max().item() for p, q in pairs)
    return raised, worst


def _debug_mode_in_a_new_default_group() -> str:
    """The job re-formed in process (destroy_process_group, init_distributed on a new port)
    around a replacement rank 1 (a fresh process: no collectives counted), debug mode on."""
    import os
    import torch.distributed as dist
    from shardkit import collective_check
    from shardkit.testing import free_port
    collective_check.set_debug_collectives(True)
    try:
        skdist.barrier()  # counted in the first world
        port = skdist.broadcast_object(free_port() if skdist.get_rank() == 0 else None, src=0)
        if skdist.get_rank() == 1:
            collective_check._sequence.clear()  # what a replacement process starts with
        dist.destroy_process_group()
        os.environ["MASTER_PORT"] = str(port)
        skdist.init_distributed(backend="gloo")
        return _raised(lambda: skdist.all_reduce(torch.ones(2)))
    finally:
        collective_check.set_debug_collectives(False)


# ---------------------------------------------------------------------- tests


def _same_on_every_rank(results: list) -> dict:
    assert results[0] == results[1], results
    return results[0]


def test_meta_model_on_all_ranks_but_rank0_refused_on_every_rank(world2):
    got = _same_on_every_rank(world2.run(_meta_on_all_ranks_but_rank0))
    for name, error in got.items():
        assert error.startswith("ValueError: "), (name, error)
        assert "on the meta device" in error and "parameter '0.weight'" in error, (name, error)
        assert "refused on rank(s) [1], not on rank(s) [0]" in error, (name, error)


def test_sparse_embedding_on_one_rank_refused_on_every_rank(world2):
    got = _same_on_every_rank(world2.run(_sparse_on_rank1_only))
    for name, error in got.items():
        assert error.startswith(("ValueError: ", "ConfigError: ")), (name, error)
        assert "sparse=True" in error and "refused on rank(s) [1]" in error, (name, error)


def test_model_optimizer_stage_or_config_differing_on_one_rank_named_on_every_rank(world2):
    results = world2.run(_one_rank_differs)
    got = results[0]
    for name, error in got.items():
        if name != "stage":  # each rank names its own stage in the message's first words
            assert results[1][name] == error, (name, results)
        assert error.startswith("ValueError: "), (name, error)
    for stage in (0, 2, 3):
        assert "model is 4 parameters (67 elements" in got[f"shape {stage}"]
        assert "(75 elements" in got[f"shape {stage}"]
        assert "4 trainable" in got[f"frozen {stage}"] and "3 trainable" in got[f"frozen {stage}"]
        assert "optimizer is SGD(lr=0.1)" in got[f"lr {stage}"] and "SGD(lr=0.5)" in \
            got[f"lr {stage}"]
    assert "stage is 2 on rank 0 and 1 on rank 1" in results[0]["stage"]
    assert "stage is 2 on rank 0 and 1 on rank 1" in results[1]["stage"]
    assert "config.optimizer.params.lr is 0.1 on rank 0 and 0.5 on rank 1" in got["config"]
    assert "this factory refuses on rank 1" in got["factory"]
    assert "refused on rank(s) [1], not on rank(s) [0]" in got["factory"]


def test_error_class_kept_stepped_optimizer_refused_per_rank_paths_taken(world2):
    results = world2.run(_error_classes_kept_and_per_rank_keys)
    assert results[0] == results[1], results
    got = results[0]
    assert got["key"].startswith("KeyError: ") and "no such group" in got["key"], got
    assert got["own"].startswith("_Refused: ") and "user's own" in got["own"], got
    assert got["stepped"].startswith("ValueError: ") and "state for 4 parameters" in \
        got["stepped"] and "state for 0 parameters" in got["stepped"], got
    assert got["nvme_path"] == "no error", got
    assert got["all refuse"] == ("ValueError: rank 0 says no [rank 0's refusal; every rank "
                                 "refused; rank(s) [1] refused for other reasons; initialize "
                                 "raises the same error on every rank]"), got


def test_ranks_that_agree_compose_and_step_alike(world2):
    sums = world2.run(_agreeing_ranks_still_train)
    assert sums[0] == sums[1], sums


@pytest.mark.parametrize("auto", [True, False])
def test_sharded_ddp_requires_grad_changed_on_every_rank_matches_one_process(world2, auto):
    for raised, worst in world2.run(_sharded_ddp_trainable_change, "every rank", auto):
        assert raised == "no error"
        assert worst < 1e-6, worst


def test_world_of_one_raises_the_local_error_without_a_collective(monkeypatch):
    def no_collective(*args, **kwargs):
        raise AssertionError("a world of 1 must not exchange anything")
    monkeypatch.setattr(torch.distributed, "all_gather_object", no_collective)
    monkeypatch.setattr(skdist, "all_gather_object", no_collective)
    with torch.device("meta"):
        model = _mlp()
    with pytest.raises(ValueError, match=r"compose\(stage=1\): the model holds parameter "
                                         r"'0.weight'.*meta device") as caught:
        recipes.compose(model, 1, recipes.adamw(lr=1e-2))
    assert "refused on rank" not in str(caught.value)


class _Clipper:
    """A setting object with Python's default repr (its memory address), different in every
    torchrun process even when the settings are equal."""


def test_fingerprints_leave_memory_addresses_out():
    """Two processes holding equal settings compare equal: the fingerprints drop ``0x...``
    addresses (objects with the default repr, functions), which torchrun's processes do not
    share (forked World ranks often do, so this is checked here, in one process)."""
    one, two = _Clipper(), _Clipper()
    assert repr(one) != repr(two)
    model = _mlp()
    recipes_of = [recipes.OptimizerRecipe(torch.optim.SGD, {"lr": 0.1}, param_groups=[
        {"params": list(model.parameters()), "clipper": clipper}]) for clipper in (one, two)]
    fingerprints = {recipes.optimizer_fingerprint(recipe) for recipe in recipes_of}
    assert len(fingerprints) == 1, fingerprints
    assert recipes.stable_repr(one) == recipes.stable_repr(two)
    from shardkit.engine import _flat_config
    assert _flat_config({"x": {"hook": one}}) == _flat_config({"x": {"hook": two}})


def test_debug_mode_counts_start_again_in_a_new_default_group(world2):
    """Sequence numbers used to carry on from the destroyed default group: a rank that joined
    the re-formed job fresh was "out of step" on every collective (a false
    CollectiveMismatchError on every rank)."""
    assert world2.run(_debug_mode_in_a_new_default_group) == ["no error"] * 2


def _oss_step_beside_a_checked_gather():
    """Rank 0 in OSS's step agreement (a wrapper's control row), rank 1 in the argument
    agreement of ``shardkit.distributed.gather`` (1 + 3 ints a rank before): rows of two
    sizes, which gloo aborted on; both now carry their kind and one size."""
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    optimizer = OSS(model.parameters(), lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    try:
        if skdist.get_rank() == 0:
            optimizer.step()
        else:
            skdist.gather(torch.ones(2), None, dst=0)
    except RuntimeError as error:
        message = str(error)
    else:
        message = "no error"
    skdist.barrier()  # nothing else was sent: the ranks are still in step
    return message


def test_a_wrapper_agreement_beside_a_collectives_argument_check_names_both(world2):
    messages = world2.run(_oss_step_beside_a_checked_gather)
    for message in messages:
        assert "the ranks of the group are not in the same collective call" in message, message
        assert "group rank(s) [0] in an OSS call's agreement" in message
        assert "group rank(s) [1] in " in message
    # rank 1 names both (rank 0 has made no gather yet to name it by)
    assert "group rank(s) [1] in shardkit.distributed.gather" in messages[1]
