"""Five small gaps, each with the behaviour it has now:

1. ``initialize(optimizer=<callable>)`` at stage 3 refuses an optimizer that needs whole
   tensors (LBFGS) with the ConfigError a passed instance gets, on every rank, before any
   collective.
2. Gradient clipping of replicated gradients (``compose(stage=0)``) and OSS's clipping take
   sparse gradients (``nn.Embedding(sparse=True)``) as torch's ``clip_grad_norm_`` takes the
   same gradients held dense; ``compose`` refuses sparse embeddings at stages 1-3, naming the
   parameter, before any wrapper exists.
3. ``OSS.load_state_dict`` (stages 1-2) refuses per-parameter state with a key the optimizer
   does not keep, or without one its step reads, on every rank before anything changes
   (before: the load passed, and at the next step the owner alone raised a KeyError while
   the others waited in the parameter sync).
4. ``World(failure_grace_s=...)``: how long the other ranks get once one has failed.
5. ``engine.optimizer.step()`` called by the script with ``gradient_accumulation_steps > 1``
   (nanoGPT's loop over an engine, which never reduces) is a RuntimeError on every rank;
   ``engine.require_backward_grad_sync`` reaches the wrapped model.

One world of 2 gloo ranks for the module.
"""

import math
import time

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.optim.optimizer import register_optimizer_step_post_hook

import shardkit
from shardkit import distributed
from shardkit.comm_counter import CommCounter
from shardkit.optim import OSS
from shardkit.recipes import OptimizerRecipe, _clip_replicated, compose
from shardkit.testing import World, WorldError, world_fixture

world2 = world_fixture(2)

STAGE3 = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3}}


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(4, 6), nn.ReLU(), nn.Linear(6, 2))


class _SparseNet(nn.Module):
    def __init__(self, sparse: bool = True):
        super().__init__()
        torch.manual_seed(3)
        self.emb = nn.Embedding(12, 4, sparse=sparse)
        self.lin = nn.Linear(4, 3)

    def forward(self, ids):
        return self.lin(self.emb(ids))


def _dense_twin(model: _SparseNet) -> _SparseNet:
    twin = _SparseNet(sparse=False)
    twin.load_state_dict(model.state_dict())
    return twin


def _outcome(fn):
    try:
        return ("ok", fn())
    except Exception as error:
        return (type(error).__name__, str(error))


# ---------------------------------------------------------------- 1. stage-3 callable optimizer


def _stage3_optimizers():
    outcomes = {}
    with CommCounter() as comm:
        for kind, optimizer in (
                ("instance", lambda model: torch.optim.LBFGS(model.parameters(), lr=0.1)),
                ("callable", lambda model: lambda params: torch.optim.LBFGS(params, lr=0.1)),
                ("subclass", lambda model: lambda params: type(
                    "MyLBFGS", (torch.optim.LBFGS,), {})(params, lr=0.1)),
                ("not_an_optimizer", lambda model: lambda params: [params])):
            model = _mlp()
            outcomes[kind] = _outcome(lambda: shardkit.initialize(
                model, optimizer=optimizer(model), config=STAGE3, peer_timeout_s=0))
        calls = len(comm.calls)
    # a callable whose optimizer built state (Adagrad's sums) is rebuilt over the shards
    engine, optimizer, _, _ = shardkit.initialize(
        _mlp(), optimizer=lambda params: torch.optim.Adagrad(params, lr=0.1), config=STAGE3,
        peer_timeout_s=0)
    return outcomes, calls, type(optimizer).__name__


def test_stage3_callable_optimizer_refused_like_an_instance(world2):
    for outcomes, calls, adagrad in world2.run(_stage3_optimizers):
        assert calls == 0  # every refusal came before any collective
        kind, instance_message = outcomes["instance"]
        assert kind == "ConfigError", outcomes["instance"]
        problem = instance_message.split("zero_optimization.stage=3: ", 1)[1]
        for case, name in (("callable", "LBFGS"), ("subclass", "MyLBFGS")):
            kind, message = outcomes[case]
            assert kind == "ConfigError", outcomes[case]
            assert message.startswith(
                "initialize(optimizer=<callable>) at zero_optimization.stage=3: "), message
            assert name in message and "stages 0-2" in message, message
        assert outcomes["callable"][1].endswith(problem)
        kind, message = outcomes["not_an_optimizer"]
        assert kind == "TypeError" and "optimizer=<callable>" in message and "list" in message
        assert adagrad == "Adagrad"


# ---------------------------------------------------------------- 2. sparse gradients, clipping


def _sparse_step_grads(model, ids):
    model.zero_grad(set_to_none=True)
    F.mse_loss(model(ids), torch.linspace(-1, 1, ids.numel() * 3).reshape(-1, 3)).backward()


@pytest.mark.parametrize("max_norm", [0.05, 1e3, math.inf])
def test_clip_replicated_sparse_matches_torch_on_dense(max_norm):
    model = _SparseNet()
    twin = _dense_twin(model)
    ids = torch.tensor([1, 4, 1, 7, 4, 1])  # repeated rows: an uncoalesced sparse gradient
    _sparse_step_grads(model, ids)
    _sparse_step_grads(twin, ids)
    assert model.emb.weight.grad.is_sparse and not model.emb.weight.grad.is_coalesced()
    norm = _clip_replicated(list(model.parameters()), max_norm)
    expected = torch.nn.utils.clip_grad_norm_(list(twin.parameters()), max_norm)
    torch.testing.assert_close(norm, expected, rtol=1e-6, atol=0)
    for p, q in zip(model.parameters(), twin.parameters()):
        torch.testing.assert_close(p.grad.to_dense(), q.grad, rtol=1e-6, atol=1e-9)


def _sparse_parity(stage_or_oss, max_norm, steps=3):
    """Train the sparse model (stage 0 through compose, DDP averaging each rank's ids; or OSS
    alone, every rank on the whole batch) against one process training its dense twin on the
    whole batch with torch's clip_grad_norm_; the largest norm and parameter differences."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    model = _SparseNet()
    oracle = _dense_twin(model)
    ref = torch.optim.SGD(oracle.parameters(), lr=0.5, momentum=0.9)
    if stage_or_oss == "oss":
        opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.5, momentum=0.9)
        run, clip = model, opt.clip_grad_norm
    else:
        composition = compose(model, 0, OptimizerRecipe(torch.optim.SGD,
                                                        {"lr": 0.5, "momentum": 0.9}))
        run, opt, clip = composition.wrapped, composition.optimizer, \
            composition.clip_grad_norm
    worst_norm = worst_param = 0.0
    for step in range(steps):
        ids = torch.randint(0, 12, (4 * world,), generator=torch.Generator().manual_seed(step))
        target = torch.randn(4 * world, 3, generator=torch.Generator().manual_seed(50 + step))
        mine = slice(None) if stage_or_oss == "oss" else slice(4 * rank, 4 * rank + 4)
        opt.zero_grad()
        F.mse_loss(run(ids[mine]), target[mine]).backward()
        assert model.emb.weight.grad.is_sparse
        norm = clip(max_norm)
        ref.zero_grad()
        F.mse_loss(oracle(ids), target).backward()
        expected = torch.nn.utils.clip_grad_norm_(oracle.parameters(), max_norm)
        opt.step()
        ref.step()
        worst_norm = max(worst_norm, abs(float(norm) - float(expected)))
        worst_param = max(worst_param, max((p - q).abs().max().item() for p, q in
                                           zip(model.parameters(), oracle.parameters())))
    return worst_norm, worst_param


def _refused_sparse_stages():
    out = {}
    with CommCounter() as comm:
        for stage in (1, 2, 3):
            out[stage] = _outcome(lambda: compose(
                _SparseNet(), stage, OptimizerRecipe(torch.optim.SGD, {"lr": 0.1})))
    return out, len(comm.calls)


@pytest.mark.parametrize("where", [0, "oss"])
def test_sparse_gradients_clip_like_torch(world2, where):
    for max_norm in (0.05, math.inf):
        for worst_norm, worst_param in world2.run(_sparse_parity, where, max_norm):
            assert worst_norm < 1e-5 and worst_param < 1e-5, \
                (where, max_norm, worst_norm, worst_param)


def test_compose_refuses_sparse_embeddings_at_stages_1_to_3(world2):
    for out, calls in world2.run(_refused_sparse_stages):
        assert calls == 0
        for stage, (kind, message) in out.items():
            assert kind == "ValueError", (stage, kind, message)
            assert message.startswith(f"compose(stage={stage}): parameter 'emb.weight'")
            assert "sparse=True" in message and "stage 0" in message


# ---------------------------------------------------------------- 3. OSS.load_state_dict keys


def _adamw_full_state():
    model = _mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=0.1)
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    return opt.state_dict()


def _local_state(oss):
    return {i: {k: v.clone() if torch.is_tensor(v) else v for k, v in s.items()}
            for i, s in oss.optim.state_dict()["state"].items()}


def _same_state(a, b):
    return a.keys() == b.keys() and all(
        a[i].keys() == b[i].keys() and all(torch.equal(torch.as_tensor(a[i][k]),
                                                       torch.as_tensor(b[i][k])) for k in a[i])
        for i in a)


def _load_bad_state(index, edit):
    model = _mlp()
    oss = OSS(model.parameters(), optim=torch.optim.AdamW, lr=0.1)
    model(torch.ones(3, 4)).sum().backward()
    oss.step()
    before, lrs = _local_state(oss), [g["lr"] for g in oss.param_groups]
    full = _adamw_full_state()
    full["param_groups"][0]["lr"] = 0.5
    if edit == "extra":
        full["state"][index]["foo"] = torch.zeros(1)
    else:
        del full["state"][index]["exp_avg"]
    owner = oss.param_to_rank[list(model.parameters())[index]]
    checked = _outcome(lambda: oss.check_state_dict(full, labels=["a", "b", "c", "d"]))
    loaded = _outcome(lambda: oss.load_state_dict(full))
    unchanged = _same_state(before, _local_state(oss)) and lrs == [g["lr"]
                                                                   for g in oss.param_groups]
    model(torch.ones(3, 4)).sum().backward()
    oss.step()  # every rank still steps together (nothing was half-loaded)
    oss.load_state_dict(_adamw_full_state())  # the unedited dict loads
    keys = sorted({k for s in oss.optim.state.values() for k in s})
    return owner, checked, loaded, unchanged, keys == ["exp_avg", "exp_avg_sq", "step"]


@pytest.mark.parametrize("edit", ["extra", "missing"])
def test_oss_load_refuses_unknown_or_missing_state_keys(world2, edit):
    owners = set()
    for index in (0, 3):  # owned by different ranks
        results = world2.run(_load_bad_state, index, edit)
        owners.add(results[0][0])
        messages = {r[2][1] for r in results}
        assert len(messages) == 1, messages  # the same error on every rank
        for owner, checked, loaded, unchanged, good_loaded in results:
            assert loaded[0] == "ValueError", loaded
            message = loaded[1]
            assert message.startswith(f"OSS.load_state_dict: the saved state of parameter "
                                      f"{index} "), message
            key = "['foo'] that AdamW does not keep" if edit == "extra" else \
                "no ['exp_avg'], which AdamW's step reads"
            assert key in message and "the optimizer was left unchanged" in message, message
            assert checked[0] == "ValueError" and f"parameter {'abcd'[index]!r}" in checked[1]
            assert unchanged and good_loaded
    assert owners == {0, 1}


def _engine_load_bad_state(stage, edit, directory):
    config = {"train_micro_batch_size_per_gpu": 3, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "AdamW", "params": {"lr": 0.1}}}
    engine, opt, _, _ = shardkit.initialize(_mlp(), config=config, peer_timeout_s=0)
    x = torch.ones(3, 4)
    engine.backward(engine(x).sum())
    engine.step()
    weight = engine.module[0].weight
    owner = opt.param_to_rank[weight]
    if distributed.get_rank() == owner:  # the saved state of '0.weight' is edited
        if edit == "extra":
            opt.optim.state[weight]["foo"] = torch.zeros(1)
        else:
            del opt.optim.state[weight]["exp_avg"]
    engine.save_checkpoint(directory, tag="edited")
    fresh, _, _, _ = shardkit.initialize(_mlp(), config=config, peer_timeout_s=0)
    before = [p.detach().clone() for p in fresh.module.parameters()]
    loaded = _outcome(lambda: fresh.load_checkpoint(directory, tag="edited"))
    unchanged = all(torch.equal(a, b) for a, b in zip(before, fresh.module.parameters()))
    fresh.backward(fresh(x).sum())
    fresh.step()  # every rank still steps together
    return owner, loaded, unchanged


@pytest.mark.parametrize("stage", [1, 2])
def test_engine_load_refuses_edited_optimizer_state_on_every_rank(world2, tmp_path, stage):
    for edit in ("extra", "missing"):
        results = world2.run(_engine_load_bad_state, stage, edit, str(tmp_path / edit))
        for rank, (owner, (kind, message), unchanged) in enumerate(results):
            assert kind == "CheckpointError" and unchanged, (rank, kind, message)
            if rank == owner:
                assert "parameter '0.weight'" in message and \
                    ("'foo'" if edit == "extra" else "'exp_avg'") in message, message
            else:
                assert "failed on 1 other rank(s)" in message and "nothing was loaded" in \
                    message, message


def _torch_saved(kind):
    """``(optimizer class, kwargs, state dict)`` that torch's own optimizer of that class
    loads: ``"plain"``, AdamW's as saved; ``"empty"``, AdamW's with an empty entry for the
    last bias (``opt.state[p]`` read before saving: torch's optimizers start such a state
    afresh); ``"none"``, SGD without momentum as torch <= 2.1 saved it
    (``momentum_buffer=None``)."""
    model = _mlp()
    cls, kwargs = {"plain": (torch.optim.AdamW, {"lr": 0.1}),
                   "empty": (torch.optim.AdamW, {"lr": 0.1}),
                   "none": (torch.optim.SGD, {"lr": 0.1})}[kind]
    opt = cls(model.parameters(), **kwargs)
    model(torch.ones(3, 4)).sum().backward()
    opt.step()
    last_bias = list(model.parameters())[3]
    if kind == "empty":
        del opt.state[last_bias]
        opt.state[last_bias]  # the defaultdict makes an empty entry, saved as {}
    saved = opt.state_dict()
    if kind == "none":
        saved["state"] = {i: {"momentum_buffer": None} for i in range(4)}
    return cls, kwargs, saved


def _load_torch_saved(kind):
    """Load the dict into OSS and into torch's optimizer, step both once: the OSS outcome,
    torch's, the largest parameter difference after the step, and the global step hooks the
    load ran."""
    cls, kwargs, saved = _torch_saved(kind)
    model, twin = _mlp(), _mlp()
    oss, ref = OSS(model.parameters(), optim=cls, **kwargs), cls(twin.parameters(), **kwargs)
    hooked = []
    handle = register_optimizer_step_post_hook(
        lambda opt, args, kw: hooked.append(type(opt).__name__))
    try:
        loaded = _outcome(lambda: oss.load_state_dict(saved))
    finally:
        handle.remove()
    ref_loaded = _outcome(lambda: ref.load_state_dict(saved))
    for m, o in ((model, oss), (twin, ref)):
        o.zero_grad()
        m(torch.ones(3, 4)).sum().backward()
    stepped = _outcome(oss.step)
    ref_stepped = _outcome(ref.step)
    diff = max((p - q).abs().max().item()
               for p, q in zip(model.parameters(), twin.parameters()))
    return loaded[0], stepped[0], ref_loaded[0], ref_stepped[0], diff, hooked, loaded[1]


@pytest.mark.parametrize("kind", ["plain", "empty", "none"])
def test_oss_loads_what_torch_loads(world2, kind):
    """An empty per-parameter state, or a key saved as None, is no unknown or missing key;
    the check's trial steps run no global optimizer step hook (the user took no step)."""
    for loaded, stepped, ref_loaded, ref_stepped, diff, hooked, message in \
            world2.run(_load_torch_saved, kind):
        assert (ref_loaded, ref_stepped) == ("ok", "ok")
        assert (loaded, stepped) == ("ok", "ok"), message
        assert diff < 1e-6 and hooked == [], (diff, hooked)


def _hyper_text_lengths(with_names):
    """The lengths of the hyper-parameter texts the state-key check builds (its cache keys)
    for an AdamW dict of 200 parameters saved by torch with or without ``param_names`` (an
    optimizer built from ``named_parameters()``): one name per parameter, written out for
    each parameter, made the check's cost grow as N^2."""
    from shardkit.optim import oss_arguments
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(2, 2) for _ in range(100)])
    opt = torch.optim.AdamW(model.named_parameters() if with_names else model.parameters(),
                            lr=0.1)
    model(torch.ones(1, 2)).sum().backward()
    opt.step()
    oss = OSS(model.parameters(), optim=torch.optim.AdamW, lr=0.1)
    lengths, original = [], oss_arguments._stable_repr
    oss_arguments._stable_repr = lambda value: lengths.append(len(original(value))) or \
        original(value)
    try:
        oss.check_state_dict(opt.state_dict())
    finally:
        oss_arguments._stable_repr = original
    return len(lengths), max(lengths)


def test_state_key_check_does_not_write_out_param_names(world2):
    named, plain = world2.run(_hyper_text_lengths, True), world2.run(_hyper_text_lengths, False)
    assert named == plain, (named, plain)  # the names add nothing to what is written out


# ---------------------------------------------------------------- 4. World(failure_grace_s)


@pytest.mark.parametrize("bad", [0, -1.0, True, "5", None, math.nan, math.inf])
def test_world_failure_grace_s_is_validated(bad):
    with pytest.raises(ValueError, match=r"World\(failure_grace_s=.*positive"):
        World(2, failure_grace_s=bad)


def test_world_failure_grace_s_default():
    assert World(2).failure_grace_s == 5.0 and World(1, failure_grace_s=2).failure_grace_s == 2.0


def _fail_or_finish_late(seconds):
    if distributed.get_rank() == 1:
        raise RuntimeError("rank 1 fails at once")
    time.sleep(seconds)
    return "finished late"


def test_world_failure_grace_s_bounds_the_wait(world2):
    try:
        for grace, rank0_reported in ((20.0, "--- rank 0 returned:\n'finished late'"),
                                      (0.2, "--- rank 0 did not finish")):
            world2.failure_grace_s = grace
            with pytest.raises(WorldError) as failed:
                world2.run(_fail_or_finish_late, 2.0)
            assert rank0_reported in str(failed.value), str(failed.value)
            assert "rank 1 fails at once" in str(failed.value)
    finally:
        world2.failure_grace_s = 5.0


def _engines_sharing_an_optimizer():
    """Two engines over one client optimizer (stage 0): each engine's own step() runs it,
    whichever engine was built last and whatever its accumulation; a direct call is still
    refused by the latest engine's setting."""
    rank = distributed.get_rank()
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(rank))
    out = {}
    for first_gas, second_gas in ((1, 2), (2, 2)):
        model = _mlp()
        client = torch.optim.SGD(model.parameters(), lr=0.1)
        config = {"train_micro_batch_size_per_gpu": 4}
        first, _, _, _ = shardkit.initialize(model, optimizer=client, config=dict(
            config, gradient_accumulation_steps=first_gas), peer_timeout_s=0)
        second, _, _, _ = shardkit.initialize(model, optimizer=client, config=dict(
            config, gradient_accumulation_steps=second_gas), peer_timeout_s=0)

        def first_loop():
            for _ in range(first_gas):
                first.backward(first(x).sum())
                first.step()
            return first.global_steps
        out[(first_gas, second_gas)] = _outcome(first_loop)
        second(x).sum().backward()
        out[(first_gas, second_gas, "direct")] = _outcome(client.step)[0]
        client.zero_grad()
    return out


def test_an_earlier_engine_over_a_shared_optimizer_still_steps(world2):
    for out in world2.run(_engines_sharing_an_optimizer):
        for pair in ((1, 2), (2, 2)):
            assert out[pair] == ("ok", 1), out[pair]
            assert out[pair + ("direct",)] == "RuntimeError", out


# ---------------------------------------------------------------- 5. optimizer stepped directly


def _direct_steps():
    """A nanoGPT-style loop (``loss.backward()``, ``optimizer.step()``) over an engine: refused
    with accumulation, before any collective; fine with one micro-batch per step; the engine's
    own loop unaffected; a second engine over the same optimizer takes the guard over."""
    rank = distributed.get_rank()
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(rank))
    out = {}
    for stage in (0, 1, 3):
        config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 3,
                  "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                  "zero_optimization": {"stage": stage}}
        engine, optimizer, _, _ = shardkit.initialize(_mlp(), config=config, peer_timeout_s=0)
        engine(x).sum().backward()
        with CommCounter() as comm:
            out[(stage, "direct")] = _outcome(optimizer.step)
        out[(stage, "calls")] = len(comm.calls)
        engine.zero_grad()
        for _ in range(3):  # the engine's own loop still steps at the boundary
            engine.backward(engine(x).sum())
            engine.step()
        out[(stage, "engine_steps")] = engine.global_steps
        single = dict(config, gradient_accumulation_steps=1)
        engine, optimizer, _, _ = shardkit.initialize(_mlp(), config=single, peer_timeout_s=0)
        engine(x).sum().backward()
        out[(stage, "single")] = _outcome(optimizer.step)
    model = _mlp()
    client = torch.optim.SGD(model.parameters(), lr=0.1)
    accumulating = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}
    first, _, _, _ = shardkit.initialize(model, optimizer=client, config=accumulating,
                                         peer_timeout_s=0)
    second, _, _, _ = shardkit.initialize(model, optimizer=client, config=dict(
        accumulating, gradient_accumulation_steps=1), peer_timeout_s=0)
    second(x).sum().backward()
    out["second_engine"] = _outcome(second.optimizer.step)  # the latest engine's setting rules
    return out


def test_optimizer_stepped_directly_with_accumulation_is_refused(world2):
    for out in world2.run(_direct_steps):
        for stage in (0, 1, 3):
            kind, message = out[(stage, "direct")]
            assert kind == "RuntimeError", out[(stage, "direct")]
            assert "gradient_accumulation_steps=3" in message and "engine.step()" in message
            assert out[(stage, "calls")] == 0  # refused before the optimizer's collectives
            assert out[(stage, "engine_steps")] == 1
            assert out[(stage, "single")][0] == "ok", out[(stage, "single")]
        assert out["second_engine"][0] == "ok", out["second_engine"]


def _engine_flag_accumulation():
    """nanoGPT's accumulation over an engine with one micro-batch per step: the flag set on
    the engine reaches the wrapped model, so the first two backward passes reduce nothing and
    the result equals the engine reducing every pass."""
    rank = distributed.get_rank()
    xs = [torch.randn(4, 4, generator=torch.Generator().manual_seed(10 * rank + i))
          for i in range(3)]
    out = {}
    for stage in (0, 1, 2, 3):
        config = {"train_micro_batch_size_per_gpu": 4,
                  "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                  "zero_optimization": {"stage": stage}}
        results = []
        for use_flag in (True, False):
            engine, optimizer, _, _ = shardkit.initialize(_mlp(), config=config,
                                                          peer_timeout_s=0)
            with CommCounter() as comm:
                for i, x in enumerate(xs):
                    if use_flag:
                        engine.require_backward_grad_sync = i == len(xs) - 1
                        if i == 0:  # what the wrapped model (torch DDP at stages 0-1) reads
                            out[(stage, "wrapped")] = engine.wrapped.require_backward_grad_sync
                    (engine(x).sum() / len(xs)).backward()
            optimizer.step()
            results.append((comm.bytes, [p.detach().clone() for p in engine.parameters()],
                            engine.require_backward_grad_sync))
        (flag_bytes, flag_params, flag_end), (all_bytes, all_params, _) = results
        out[stage] = ((flag_bytes, all_bytes), flag_end,
                      max((a - b).abs().max().item() for a, b in zip(flag_params, all_params)))
    engine, _, _, _ = shardkit.initialize(_mlp(), config=config, peer_timeout_s=0)
    out["bad"] = _outcome(lambda: setattr(engine, "require_backward_grad_sync", 1))
    return out


def test_engine_require_backward_grad_sync_accumulates_like_no_sync(world2):
    for out in world2.run(_engine_flag_accumulation):
        for stage in (0, 1, 2, 3):
            fewer_bytes, flag_end, diff = out[stage]
            assert out[(stage, "wrapped")] is False and flag_end is True and diff < 1e-6, \
                (stage, out[stage])
            if stage > 0:  # torch DDP's own all-reduce at stage 0 bypasses CommCounter
                assert fewer_bytes[0] < fewer_bytes[1], (stage, fewer_bytes)
        assert out["bad"][0] == "TypeError" and "require_backward_grad_sync" in out["bad"][1]


def _flag_off_then_step(stage):
    model = _mlp()
    config = {"train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": stage},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, _, _, _ = shardkit.initialize(model=model, config=config, peer_timeout_s=0)
    engine.require_backward_grad_sync = False  # left off at the accumulation boundary
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(distributed.get_rank()))
    engine.backward(engine(x).sum())
    return _outcome(engine.step)


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_boundary_step_after_require_backward_grad_sync_false_is_refused(world2, stage):
    """engine.step() after a boundary backward the flag kept from reducing: refused on every
    rank, as after no_sync() (stage 0 stepped each rank on its own gradients, silently)."""
    for kind, message in world2.run(_flag_off_then_step, stage):
        assert kind == "RuntimeError" and "require_backward_grad_sync" in message, message
