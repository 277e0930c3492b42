"""OSS state dicts and re-partitioning.

- world 2 -> consolidate -> torch.save -> load at world 1, 2 and 4 -> training continues as if
  nothing happened (bit-exact at world 2, within float rounding of the gradient average else);
- plain torch.optim.AdamW state dict -> OSS -> consolidated back: identical, and both continue
  identically (as does OSS(existing AdamW with state));
- state_dict() without consolidating, or on a rank that is not the recipient, or after a step:
  clear error; consolidate_state_dict(True) (meant as "every rank") is refused, where it
  hung; a state dict with the wrong number of parameters: clear error;
- add_param_group and refresh_trainable move optimizer state to the new owner (parity with a
  plain optimizer going through the same changes).
"""

import copy

import re

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit import distributed
from shardkit.distributed import CommCounter
from shardkit.optim import OSS
from shardkit.testing import MLP, World, world_fixture
from tests.utils.compare import max_diff

WIDTH, BATCH, SAVE_AT, MORE = 16, 8, 3, 3
HYPER = {"lr": 1e-2, "weight_decay": 0.01}


world2 = world_fixture(2)


def _groups(model):
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases = [p for n, p in model.named_parameters() if n.endswith("bias")]
    return [{"params": weights}, {"params": biases, "lr": 5e-3, "weight_decay": 0.0}]


def _batch(step):
    gen = torch.Generator().manual_seed(7 + step)
    return torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, 4, generator=gen)


def _ddp_step(ddp, opt, step):
    rank, world = distributed.get_rank(), distributed.get_world_size()
    x, y = _batch(step)
    per = BATCH // world
    opt.zero_grad()
    F.mse_loss(ddp(x[rank * per:(rank + 1) * per]), y[rank * per:(rank + 1) * per]).backward()
    opt.step()


def _params(model):
    return [p.detach().clone() for p in model.parameters()]


def _train_and_save(path):
    """World 2: train, consolidate on rank 0, save, keep training; return the final params."""
    model = MLP(WIDTH, 3, out=4, seed=1)
    opt = OSS(_groups(model), optim=torch.optim.AdamW, **HYPER)
    ddp = DDP(model)
    for step in range(SAVE_AT):
        _ddp_step(ddp, opt, step)
    opt.consolidate_state_dict(recipient_rank=0)
    if opt.rank == 0:
        torch.save({"model": model.state_dict(), "optim": opt.state_dict()}, path)
    distributed.barrier()
    for step in range(SAVE_AT, SAVE_AT + MORE):
        _ddp_step(ddp, opt, step)
    return _params(model)


def _resume(path):
    """Any world: load the world-2 checkpoint and continue training."""
    checkpoint = torch.load(path, weights_only=False)
    model = MLP(WIDTH, 3, out=4, seed=99)
    model.load_state_dict(checkpoint["model"])
    opt = OSS(_groups(model), optim=torch.optim.AdamW, **HYPER)
    opt.load_state_dict(checkpoint["optim"])
    ddp = DDP(model)
    for step in range(SAVE_AT, SAVE_AT + MORE):
        _ddp_step(ddp, opt, step)
    return _params(model)


def test_world2_checkpoint_resumes_at_world_1_2_4(world2, tmp_path):
    path = str(tmp_path / "oss.pt")
    expected = world2.run(_train_and_save, path)[0]
    assert max_diff(world2.run(_resume, path)[0], expected) == 0.0
    for n in (1, 4):
        with World(n) as w:
            got = w.run(_resume, path)
        for rank_params in got:
            assert max_diff(rank_params, expected) <= 1e-6, f"world {n}"


def _plain_adamw_round_trip():
    """A plain single-process AdamW state dict goes into OSS and comes back unchanged."""
    plain_model = MLP(WIDTH, 3, out=4, seed=2)
    plain = torch.optim.AdamW(_groups(plain_model), **HYPER)
    for step in range(2):
        plain.zero_grad()
        F.mse_loss(plain_model(_batch(step)[0]), _batch(step)[1]).backward()
        plain.step()
    saved = copy.deepcopy(plain.state_dict())
    model = copy.deepcopy(plain_model)
    opt = OSS(_groups(model), optim=torch.optim.AdamW, **HYPER)
    opt.load_state_dict(copy.deepcopy(saved))
    held = sum(len(s) > 0 for s in opt.state.values())
    opt.consolidate_state_dict(recipient_rank=-1)
    back = opt.state_dict()
    same = _same_state_dict(back, saved)  # the state dict records the caller's fused=None
    same = same and _same_state_dict(opt.state_dict(all_ranks=True), saved)  # FairScale's form
    fused_seen = {"chosen": opt.fused,
                  "public": [g["fused"] for g in opt.param_groups],
                  "local": [g["fused"] for g in opt.optim.param_groups]}
    reloaded = torch.optim.AdamW(_groups(copy.deepcopy(plain_model)), **HYPER)
    reloaded.load_state_dict(back)  # the consolidated dict loads into plain torch
    # OSS(existing_optimizer) takes over a plain optimizer that already has state
    taken_model = copy.deepcopy(plain_model)
    resumed = torch.optim.AdamW(_groups(taken_model), **HYPER)
    resumed.load_state_dict(copy.deepcopy(saved))
    taken = OSS(resumed)
    for step in range(2, 4):  # all continue alike (every rank computes the full batch)
        for m, o in ((plain_model, plain), (model, opt), (taken_model, taken)):
            o.zero_grad()
            F.mse_loss(m(_batch(step)[0]), _batch(step)[1]).backward()
            o.step()
    result = {"same": same, "held": held, "total": len(saved["state"]), "fused": fused_seen,
              "diff": max_diff(_params(model), _params(plain_model)),
              "takeover_diff": max_diff(_params(taken_model), _params(plain_model))}
    opt.param_groups[1]["fused"] = False  # the user turns the kernel off for one group
    opt.zero_grad()
    F.mse_loss(model(_batch(4)[0]), _batch(4)[1]).backward()
    opt.step()
    fused_seen["local_after_off"] = [g["fused"] for g in opt.optim.param_groups]
    return result


def _same_state_dict(a, b) -> bool:
    if a["param_groups"] != b["param_groups"] or sorted(a["state"]) != sorted(b["state"]):
        return False
    return all(torch.equal(a["state"][i][k], b["state"][i][k])
               for i in b["state"] for k in b["state"][i])


def test_plain_adamw_state_dict_into_oss_and_back(world2):
    results = world2.run(_plain_adamw_round_trip)
    for r in results:
        # OSS steps its shard with torch's fused AdamW: the same update within rounding
        assert r["same"] and r["diff"] <= 1e-6 and r["takeover_diff"] <= 1e-6
        # the shard runs the fused kernel OSS chose; the public groups keep the caller's None
        assert r["fused"] == {"chosen": True, "public": [None, None], "local": [True, True],
                              "local_after_off": [True, False]}
    assert sum(r["held"] for r in results) == results[0]["total"]  # each state on one rank only
    assert all(0 < r["held"] < r["total"] for r in results)


def _state_dict_errors():
    model = MLP(WIDTH, 2, out=4, seed=3)
    opt = OSS(_groups(model), optim=torch.optim.AdamW, **HYPER)
    errors = {}

    def catch(name, fn):
        try:
            fn()
        except (RuntimeError, ValueError, TypeError) as e:
            errors[name] = f"{type(e).__name__}: {e}"

    catch("never_consolidated", opt.state_dict)
    opt.consolidate_state_dict(recipient_rank=1)
    catch("not_recipient", opt.state_dict)  # only rank 0 raises here
    for p in model.parameters():
        p.grad = torch.ones_like(p)
    opt.step()
    catch("stale_after_step", opt.state_dict)
    catch("bad_recipient", lambda: opt.consolidate_state_dict(recipient_rank=5))
    catch("bool_recipient", lambda: opt.consolidate_state_dict(True))  # not rank 1
    # a bare list of parameters (torch refuses it too): named as such, not as a bad item
    catch("add_group_not_dict", lambda: opt.add_param_group(list(model.parameters())[:1]))
    plain = torch.optim.AdamW(MLP(WIDTH, 3, out=4, seed=3).parameters())
    catch("wrong_param_count", lambda: opt.load_state_dict(_with_groups(plain.state_dict(), 2)))
    catch("wrong_group_count", lambda: opt.load_state_dict(plain.state_dict()))
    # the same architecture one unit wider: a fused step would read past the state's end
    wider = MLP(WIDTH + 1, 2, out=4, seed=3)
    wider_opt = torch.optim.AdamW(_groups(wider), **HYPER)
    for p in wider.parameters():
        p.grad = torch.ones_like(p)
    wider_opt.step()
    before = opt.optim.state_dict()
    catch("wrong_state_shape", lambda: opt.load_state_dict(wider_opt.state_dict()))
    errors["unchanged_after_refusal"] = str(opt.optim.state_dict()) == str(before)
    # the same elements saved flattened are read in the parameter's shape
    opt.consolidate_state_dict(recipient_rank=-1)
    flat = opt.state_dict()
    flat["state"] = {i: {k: v.flatten() if k.startswith("exp_avg") else v for k, v in s.items()}
                     for i, s in flat["state"].items()}
    opt.load_state_dict(flat)
    errors["flattened_loads"] = all(v.shape == p.shape for p, s in opt.optim.state.items()
                                    for k, v in s.items() if k.startswith("exp_avg"))
    return errors


def _with_groups(state_dict, n):
    ids = state_dict["param_groups"][0]["params"]
    return {"state": {}, "param_groups": [{**state_dict["param_groups"][0], "params": ids[:2]},
                                          {**state_dict["param_groups"][0], "params": ids[2:]}]}


def test_state_dict_errors_are_clear(world2):
    rank0, rank1 = world2.run(_state_dict_errors)
    assert "consolidate_state_dict" in rank0["never_consolidated"]
    assert "consolidate_state_dict" in rank0["not_recipient"]
    assert "not_recipient" not in rank1
    assert "consolidate_state_dict" in rank1["stale_after_step"]
    assert "recipient_rank=5" in rank0["bad_recipient"]
    assert "recipient_rank=True): must be a rank" in rank0["bool_recipient"]
    assert rank0["add_group_not_dict"] == (
        "TypeError: OSS.add_param_group(param_group=<list>): expected a dict with a 'params' "
        "key (and optional hyper-parameters such as 'lr')")
    assert "param group 0" in rank0["wrong_param_count"] and "parameters" in rank0[
        "wrong_param_count"]
    assert "1 param groups" in rank0["wrong_group_count"]
    for r in (rank0, rank1):
        assert re.search(r"OSS.load_state_dict: the saved state 'exp_avg' of parameter 0 has "
                         r"shape \(\d+, \d+\), the parameter has shape", r["wrong_state_shape"])
        assert r["unchanged_after_refusal"] and r["flattened_loads"], r


def _unpicklable_state_on_rank1():
    """A custom optimizer that keeps an object which cannot be pickled (a lambda) in the state
    of one parameter, on rank 1 only: before the fix rank 1 raised while pickling its shard's
    metadata and rank 0 waited for it in the broadcast."""
    model = MLP(WIDTH, 2, seed=0)
    opt = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    model(torch.ones(2, WIDTH)).sum().backward()
    opt.step()
    if distributed.get_rank() == 1:
        owned = next(iter(opt.optim.state))
        opt.optim.state[owned]["schedule"] = lambda step: 1.0
    try:
        opt.consolidate_state_dict(recipient_rank=0)
    except ValueError as error:
        return str(error)
    return None


def test_state_that_cannot_be_pickled_fails_on_every_rank(world2):
    for error in world2.run(_unpicklable_state_on_rank1):
        assert error is not None and "'schedule'" in error and "on rank 1" in error, error
        assert "function, which cannot be pickled" in error, error


def _bad_hyper_parameters():
    """Hyper-parameters the optimizer refuses: an error naming OSS and the optimizer, raised
    before the construction's first collective (so no rank waits on another)."""
    out = []
    for kwargs in ({"lr": -1.0}, {"lrr": 3}, {"lr": 0.1, "betas": (1.5, 0.9)}):
        with CommCounter() as comm:
            try:
                OSS(MLP(WIDTH, 2, seed=0).parameters(), optim=torch.optim.AdamW, **kwargs)
                out.append(None)
            except (TypeError, ValueError) as error:
                out.append((str(error), len(comm.calls)))
    return out


def _bad_groups():
    """A group argument that is not a process group: a TypeError naming the wrapper and the
    argument, before any collective."""
    from shardkit.nn import FullyShardedDataParallel, ShardedDataParallel
    out = []
    for build in (lambda: OSS(MLP(WIDTH, 2).parameters(), group=123, lr=0.1),
                  lambda: ShardedDataParallel(MLP(WIDTH, 2), OSS(MLP(WIDTH, 2).parameters(),
                                                                 lr=0.1), process_group="g"),
                  lambda: FullyShardedDataParallel(MLP(WIDTH, 2), process_group=[1, 2])):
        with CommCounter() as comm:
            try:
                build()
                out.append(None)
            except TypeError as error:
                out.append((str(error), len(comm.calls)))
    return out


def test_group_arguments_must_be_process_groups(world2):
    for oss, sdp, fsdp in world2.run(_bad_groups):
        assert oss == ("OSS(group=123): must be a torch.distributed ProcessGroup (e.g. from "
                       "new_group), or None for the default group", 0)
        assert sdp[0].startswith("ShardedDataParallel(process_group='g'): must be a torch")
        assert fsdp[0].startswith("FullyShardedDataParallel(process_group=[1, 2]): must be")
        assert "or a pair (intra_node_group, inter_node_group)" in fsdp[0]
        assert fsdp[1] == 0


def _tied_through_data():
    """Parameters tied through ``.data`` are refused before any collective; tied as one
    Parameter they train as in plain PyTorch."""
    model = MLP(WIDTH, 3, seed=0)
    model[2].weight.data = model[0].weight.data
    with CommCounter() as comm:
        try:
            OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
            refused = None
        except ValueError as error:
            refused = (str(error), len(comm.calls))
    model[2].weight = model[0].weight  # one Parameter: fine
    OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    return refused


def test_parameters_tied_through_data_are_refused(world2):
    for message, calls in world2.run(_tied_through_data):
        assert calls == 0
        assert "trainable parameters 0 of param group 0" in message, message
        assert "share memory" in message and "b.weight = a.weight" in message


def test_bad_hyper_parameters_fail_before_any_collective(world2):
    for lr, keyword, betas in world2.run(_bad_hyper_parameters):
        assert lr == ("OSS(optim=AdamW): the optimizer refused its arguments: Invalid learning "
                      "rate: -1.0", 0)
        assert "unexpected keyword argument 'lrr'" in keyword[0] and keyword[1] == 0
        assert "Invalid beta parameter at index 0: 1.5" in betas[0] and betas[1] == 0


def _repartition_parity():
    """add_param_group and refresh_trainable against a plain AdamW doing the same."""
    def run(make_opt, model):
        head = list(model[-1].parameters())
        body = [p for p in model.parameters() if all(p is not h for h in head)]
        opt = make_opt([{"params": body}])
        for step in range(6):
            if step == 2:
                opt.add_param_group({"params": head, "lr": 2e-2})
            if step == 3:
                for p in model[0].parameters():
                    p.requires_grad_(False)
                if isinstance(opt, OSS):
                    opt.refresh_trainable()
            if step == 5:
                for p in model[0].parameters():
                    p.requires_grad_(True)
                if isinstance(opt, OSS):
                    opt.refresh_trainable()
            opt.zero_grad()
            F.mse_loss(model(_batch(step)[0]), _batch(step)[1]).backward()
            opt.step()
        return _params(model), opt

    plain_params, _ = run(lambda g: torch.optim.AdamW(g, **HYPER), MLP(WIDTH, 3, out=4, seed=4))
    model = MLP(WIDTH, 3, out=4, seed=4)
    oss_params, opt = run(lambda g: OSS(g, optim=torch.optim.AdamW, **HYPER), model)
    missing_refresh = None
    for p in model[0].parameters():
        p.requires_grad_(False)
    # they still hold their last gradients: the refresh keeps them partitioned (stepped as
    # torch steps them), and made trainable again they still need a refresh (ShardedDDP's hooks)
    opt.refresh_trainable()
    for p in model[0].parameters():
        p.requires_grad_(True)
    try:
        opt.step()
    except RuntimeError as e:
        missing_refresh = str(e)
    return {"diff": max_diff(oss_params, plain_params), "missing_refresh": missing_refresh}


def test_add_param_group_and_refresh_trainable_keep_parity(world2):
    for r in world2.run(_repartition_parity):
        assert r["diff"] <= 1e-6
        assert "refresh_trainable" in r["missing_refresh"]


def _public_views():
    """partition_parameters, per_device_params, param_to_rank and optim agree with the
    partition, and every trainable parameter has exactly one owner."""
    model = MLP(WIDTH, 3, out=4, seed=5)
    for p in model[0].parameters():
        p.requires_grad_(False)
    opt = OSS(_groups(model), optim=torch.optim.AdamW, **HYPER)
    trainable = [p for p in model.parameters() if p.requires_grad]
    per_rank = opt.partition_parameters()
    owned = [[p for g in groups for p in g["params"]] for groups in per_rank]
    hyper_ok = all(g["lr"] == mine["lr"] and g["weight_decay"] == mine["weight_decay"]
                   for groups in per_rank for g, mine in zip(groups, opt.param_groups))
    devices = opt.per_device_params
    return {
        "ranks": (opt.rank, opt.world_size, len(per_rank)),
        "each_once": sorted(id(p) for ps in owned for p in ps) == sorted(map(id, trainable)),
        "owners_agree": all(opt.param_to_rank[p] == r == opt.partition.owner(p)
                            for r, ps in enumerate(owned) for p in ps),
        "local_optim_is_own_share": [id(p) for g in opt.optim.param_groups for p in g["params"]]
        == [id(p) for p in owned[opt.rank]],
        "hyper_ok": hyper_ok,
        "per_device": list(devices) == [torch.device("cpu")]
        and [[id(p) for p in ps] for ps in devices[torch.device("cpu")]]
        == [sorted(map(id, ps), key=[id(q) for q in opt.partition.all_params()].index)
            for ps in owned],
        "frozen_not_partitioned": all(p not in opt.partition for p in model[0].parameters()),
        # FairScale's names for the same views, which its users' code reads
        "fairscale_names": opt.backend == "gloo" and opt._per_device_params == devices
        and opt._param_to_rank == opt.param_to_rank
        and opt._default_device == torch.device("cpu") and opt._local_params == [],
    }


def test_partition_views_are_consistent(world2):
    for rank, r in enumerate(world2.run(_public_views)):
        assert r.pop("ranks") == (rank, 2, 2)
        assert all(r.values()), r


def _clip_with_filter():
    """FairScale's ``clip_grad_norm(filter_params_fn=...)``: only the parameters the filter
    keeps are measured, and every gradient is clipped (every rank holds the same full gradients
    here). As in FairScale and Megatron-LM, the filter only keeps a gradient out of the norm
    (a replicated weight measured on one tensor-parallel rank): scaling only the filtered ones
    left the biases unclipped here."""
    model = MLP(WIDTH, 3, out=4, seed=4)
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    F.mse_loss(model(_batch(0)[0]), _batch(0)[1]).backward()
    weights = [p for n, p in model.named_parameters() if n.endswith("weight")]
    biases_before = [p.grad.clone() for n, p in model.named_parameters() if n.endswith("bias")]
    expected = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(p.grad)
                                                     for p in weights]))
    norm = opt.clip_grad_norm(1e-3, filter_params_fn=lambda ps: [p for p in ps if p.dim() == 2])
    owned = {id(p) for p in opt.partition.params_of(opt.rank)[0]}
    clipped = [torch.linalg.vector_norm(p.grad).item() for p in weights if id(p) in owned]
    biases_after = [p.grad for n, p in model.named_parameters() if n.endswith("bias")]
    try:
        opt.clip_grad_norm(1.0, filter_params_fn="weights")
        bad = "accepted"
    except TypeError as error:
        bad = str(error)
    coef = 1e-3 / (expected + 1e-6)
    return {"norm": norm.item(), "expected": expected.item(), "clipped": clipped,
            "biases_scaled": all(torch.allclose(a * coef, b, rtol=1e-5, atol=1e-9)
                                 for a, b in zip(biases_before, biases_after)),
            "bad": bad}


def test_clip_grad_norm_with_filter(world2):
    for r in world2.run(_clip_with_filter):
        assert r["norm"] == pytest.approx(r["expected"], rel=1e-5), r
        assert r["biases_scaled"] and "filter_params_fn" in r["bad"], r
        assert all(c < 2e-3 for c in r["clipped"]), r


def _clip_with_zero_element_parameter():
    """A zero-element parameter (owned by one rank) adds nothing to the norm: the infinity
    norm must not fail on its owner alone (the other ranks would wait in the all-reduce)."""
    model = MLP(WIDTH, 3, out=4, seed=4)
    empty = torch.nn.Parameter(torch.zeros(0, WIDTH))
    opt = OSS([*model.parameters(), empty], optim=torch.optim.SGD, lr=0.1)
    x, y = _batch(0)
    (F.mse_loss(model(x), y) + empty.sum()).backward()
    grads = [p.grad for p in model.parameters()]
    norms = {}
    for norm_type in (float("inf"), 2.0):  # max_norm above the norm: nothing is scaled
        expected = torch.nn.utils.get_total_norm(grads, norm_type).item()
        norms[norm_type] = (opt.clip_grad_norm(1e3, norm_type).item(), expected)
    return norms


def test_clip_grad_norm_with_a_zero_element_parameter(world2):
    for r in world2.run(_clip_with_zero_element_parameter):
        for norm_type, (norm, expected) in r.items():
            assert norm == pytest.approx(expected, rel=1e-5), (norm_type, r)


def _clip_with_an_empty_first_group():
    """Hugging Face groups parameters by weight decay, and either group may be empty: OSS must
    still find its device (the first parameter of any group) to clip."""
    model = MLP(WIDTH, 3, out=4, seed=4)
    opt = OSS([{"params": [], "weight_decay": 0.01},
               {"params": list(model.parameters()), "weight_decay": 0.0}],
              optim=torch.optim.AdamW, lr=0.1)
    x, y = _batch(0)
    F.mse_loss(model(x), y).backward()
    expected = torch.nn.utils.get_total_norm([p.grad for p in model.parameters()]).item()
    return opt.clip_grad_norm(1e3).item(), expected


def test_clip_grad_norm_with_an_empty_first_group(world2):
    for norm, expected in world2.run(_clip_with_an_empty_first_group):
        assert norm == pytest.approx(expected, rel=1e-5)


def _models_that_differ_by_shape():
    """Ranks that build OSS over models with as many parameters but one shape apart: the error
    names the parameter and both shapes (not only the group lengths, which agree)."""
    rank = distributed.get_rank()
    model = torch.nn.Sequential(torch.nn.Linear(4, 3), torch.nn.Linear(3, 2 + rank))
    try:
        OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    except ValueError as error:
        return str(error)
    return None


def test_models_that_differ_are_named_by_shape(world2):
    for message in world2.run(_models_that_differ_by_shape):
        assert message is not None and "trainable parameter 2 of param group 0 has shape" in \
            message and "(2, 3)" in message and "(3, 3)" in message, message
