"""OSS and ShardedDataParallel against what a torch user relies on (one world of 2 ranks).

Regressions:
- hooks registered on OSS with ``register_state_dict_pre_hook``/``_post_hook`` and
  ``register_load_state_dict_pre_hook``/``_post_hook`` (torch.optim.Optimizer's) were silently
  never called: OSS overrides ``state_dict``/``load_state_dict``;
- ``ShardedDataParallel`` over a model with ``nn.Embedding(sparse=True)`` crashed in backward
  ("reshape is not implemented for sparse tensors") where torch DDP trains it; sparse
  gradients are now reduced densely (same SGD update as one process), and an OSS over
  ``SparseAdam`` (sparse gradients only) is refused at construction;
- ``OSS(model.named_parameters(), ...)`` (named parameters, which torch's optimizers take and
  record as ``param_names``) raised TypeError; ``OSS(AdamW(model.named_parameters()))`` worked;
- a global step hook (``torch.optim.optimizer.register_optimizer_step_post_hook``: a step
  counter, an EMA update) ran once for the OSS and once more per sync bucket for its local
  optimizer: 4 times per step with 3 buckets;
- the engine had no way to tell DeepSpeed's ``safe_*_grad`` functions that its gradients were
  partial (mid accumulation window: each rank's own sums at stages 0-2, none at stage 3); its
  check now raises there on every rank, as DeepSpeed does;
- reading ``optimizer.state[p]`` for a parameter another rank owns (logging every parameter's
  ``exp_avg``) left an empty entry in the local optimizer's defaultdict, which a later
  ``refresh_trainable`` sent to the owner over its real state: Adam restarted from step 0;
- ``overlap_sync_with(model)``: a layer unfrozen (``refresh_trainable``) or added
  (``add_param_group``) afterwards had no forward pre-hook, so the forward after each step read
  its stale copy while its all-gather was still in flight; and ``ddp.module.state_dict()`` (or a
  submodule's) after ``overlap_sync_with(ddp)`` returned stale parameters;
- ``state_dict()`` gave the hyper-parameters of the ``consolidate_state_dict()`` call: a
  scheduler stepped in between saved the previous learning rate (torch and FairScale read the
  groups when ``state_dict()`` is called).
"""

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit import distributed
from shardkit.nn.data_parallel import ShardedDataParallel
from shardkit.optim import OSS
from shardkit.testing import world_fixture
from tests.utils.compare import max_diff

TOL = 1e-5

world2 = world_fixture(2, timeout=120)


# ---------------------------------------------------------------------- rank-side bodies


def _mlp():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 3))


def _hooks_on(optimizer, log: list) -> None:
    """Torch's four state-dict hooks, logging their calls; the post-hook adds a key to the
    dict it returns, the load pre-hook returns a copy whose learning rates are 0.5."""
    optimizer.register_state_dict_pre_hook(lambda o: log.append("sd_pre"))

    def post(o, state_dict):
        log.append("sd_post")
        return {**state_dict, "extra": 7}
    optimizer.register_state_dict_post_hook(post)

    def load_pre(o, state_dict):
        log.append("load_pre")
        groups = [{**g, "lr": 0.5} for g in state_dict["param_groups"]]
        return {**state_dict, "param_groups": groups}
    optimizer.register_load_state_dict_pre_hook(load_pre)
    optimizer.register_load_state_dict_post_hook(lambda o: log.append("load_post"))


def _state_dict_hooks() -> dict:
    model, oracle = _mlp(), _mlp()
    opt = OSS(model.parameters(), optim=torch.optim.AdamW, lr=0.01)
    plain = torch.optim.AdamW(oracle.parameters(), lr=0.01)
    log, plain_log = [], []
    _hooks_on(opt, log)
    _hooks_on(plain, plain_log)
    x, y = torch.randn(4, 5), torch.randn(4, 3)
    for m, o in ((model, opt), (oracle, plain)):
        F.mse_loss(m(x), y).backward()
        o.step()
    opt.consolidate_state_dict(recipient_rank=-1)
    saved = opt.state_dict()
    again = opt.state_dict()  # the post-hook's edit must not pile up in OSS's consolidated copy
    again_is_copy = again is not saved and "extra" not in opt._consolidated
    plain_saved = plain.state_dict()
    opt.load_state_dict(saved)
    plain.load_state_dict(plain_saved)
    return {"log": log, "plain_log": plain_log, "extra": saved.get("extra"),
            "plain_extra": plain_saved.get("extra"),
            "again_is_copy": again_is_copy,
            "lrs": [g["lr"] for g in opt.param_groups] + [g["lr"] for g in opt.optim.param_groups],
            "plain_lrs": [g["lr"] for g in plain.param_groups]}


def _sparse_net():
    torch.manual_seed(1)
    return nn.Sequential(nn.Embedding(30, 4, sparse=True), nn.Linear(4, 2))


def _sparse_embedding_parity(accumulate_in_no_sync: bool) -> float:
    """SGD with momentum over an ``nn.Embedding(sparse=True)`` under ShardedDDP (one bucket
    per parameter), against one process on the global batch, every step."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    oracle, net = _sparse_net(), _sparse_net()
    hyper = dict(lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(oracle.parameters(), **hyper)
    opt = OSS(net.parameters(), optim=torch.optim.SGD, **hyper)
    model = ShardedDataParallel(net, opt, reduce_buffer_size=0)
    micro = 2 if accumulate_in_no_sync else 1
    worst = 0.0
    for step in range(4):
        gen = torch.Generator().manual_seed(step)
        x = torch.randint(0, 30, (world, micro, 6), generator=gen)
        y = torch.randn(world, micro, 6, 2, generator=gen)
        ref_opt.zero_grad()
        for r in range(world):
            for i in range(micro):
                (F.mse_loss(oracle(x[r, i]), y[r, i]) / (world * micro)).backward()
        ref_opt.step()
        opt.zero_grad()
        for i in range(micro):
            last = i == micro - 1
            with (model.no_sync() if not last else torch.enable_grad()):
                (F.mse_loss(model(x[rank, i]), y[rank, i]) / micro).backward()
        opt.step()
        worst = max(worst, max_diff(net, oracle))
    return worst


def _sparse_adam_refused() -> str:
    net = _sparse_net()
    opt = OSS(net.parameters(), optim=torch.optim.SparseAdam, lr=0.1)
    try:
        ShardedDataParallel(net, opt)
    except ValueError as error:
        return str(error)
    return "no error"


def _sparse_checks() -> dict:
    return {"plain": _sparse_embedding_parity(False),
            "no_sync": _sparse_embedding_parity(True),
            "sparse_adam": _sparse_adam_refused()}


def _named_parameters() -> dict:
    """OSS built from ``named_parameters()`` (two named groups) under ShardedDDP, against
    torch's AdamW built alike: every step, the consolidated param groups (``param_names``
    included), and torch's rule that groups are all named or none."""
    rank, world = distributed.get_rank(), distributed.get_world_size()
    oracle, net = _mlp(), _mlp()

    def groups(m):
        named = list(m.named_parameters())
        return [{"params": [(n, p) for n, p in named if n.endswith("weight")]},
                {"params": [(n, p) for n, p in named if n.endswith("bias")], "lr": 0.02}]
    ref_opt = torch.optim.AdamW(groups(oracle), lr=0.01)
    opt = OSS(groups(net), optim=torch.optim.AdamW, lr=0.01)
    model = ShardedDataParallel(net, opt)
    worst = 0.0
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(world, 4, 5, generator=gen), torch.randn(world, 4, 3, generator=gen)
        ref_opt.zero_grad()
        sum(F.mse_loss(oracle(x[r]), y[r]) for r in range(world)).div(world).backward()
        ref_opt.step()
        opt.zero_grad()
        F.mse_loss(model(x[rank]), y[rank]).backward()
        opt.step()
        worst = max(worst, max_diff(net, oracle))
    opt.consolidate_state_dict(recipient_rank=-1)
    errors = []
    for bad in ([("w", nn.Parameter(torch.zeros(2))), nn.Parameter(torch.zeros(2))],
                [{"params": [("w", nn.Parameter(torch.zeros(2)))]},
                 {"params": [nn.Parameter(torch.zeros(2))]}]):
        try:
            OSS(bad, optim=torch.optim.SGD, lr=0.1)
            errors.append("no error")
        except ValueError as error:
            errors.append(str(error))
    saved, ref_saved = opt.state_dict(), ref_opt.state_dict()
    return {"worst": worst, "errors": errors,
            "groups_equal": saved["param_groups"] == ref_saved["param_groups"],
            "names": opt.param_groups[1]["param_names"]}


def _global_step_hooks() -> dict:
    from torch.optim.optimizer import (register_optimizer_step_post_hook,
                                       register_optimizer_step_pre_hook)
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    opt = OSS(net.parameters(), optim=torch.optim.AdamW, lr=0.01, bucket_numel=4096)
    seen = []
    handles = [register_optimizer_step_pre_hook(lambda o, a, k: seen.append("pre")),
               register_optimizer_step_post_hook(lambda o, a, k: seen.append("post"))]
    try:
        for _ in range(2):
            net(torch.randn(2, 64)).sum().backward()
            opt.step()
            opt.zero_grad()
    finally:
        for handle in handles:
            handle.remove()
    return {"seen": seen, "buckets": opt.num_buckets}


# ---------------------------------------------------------------------- tests


def test_state_dict_hooks_run_as_on_a_torch_optimizer(world2):
    for r in world2.run(_state_dict_hooks):
        # two state_dict() calls, one consolidation: the pre-hook runs where the dict is built
        assert r["log"] == ["sd_pre", "sd_post", "sd_post", "load_pre", "load_post"]
        assert r["plain_log"] == ["sd_pre", "sd_post", "load_pre", "load_post"]
        assert r["extra"] == r["plain_extra"] == 7
        assert r["again_is_copy"]
        assert r["lrs"] == [0.5, 0.5] and r["plain_lrs"] == [0.5]


def test_sparse_embedding_under_sharded_ddp_matches_one_process(world2):
    for r in world2.run(_sparse_checks):
        assert r["plain"] <= TOL, r
        assert r["no_sync"] <= TOL, r
        assert "SparseAdam" in r["sparse_adam"] and "sharded_optimizer" in r["sparse_adam"]


def test_named_parameters_as_torch_takes_them(world2):
    for r in world2.run(_named_parameters):
        assert r["worst"] <= TOL, r
        assert r["groups_equal"] and r["names"] == ["0.bias", "2.bias"]
        assert "mixes (name, tensor) pairs and bare tensors" in r["errors"][0]
        assert "param group 1 is given without parameter names" in r["errors"][1]


def test_global_step_hooks_run_once_per_step(world2):
    for r in world2.run(_global_step_hooks):
        assert r["buckets"] > 1, r  # the case that fired once per bucket
        assert r["seen"] == ["pre", "post"] * 2, r


def _local_optimizer_own_hooks_and_names() -> dict:
    """Hooks and a step wrapper a factory puts on the local optimizer it builds still run (only
    torch's global hooks are left to the OSS); the local groups name their own parameters."""
    calls, wrapped = [], []

    def make(groups, **kw):
        o = torch.optim.AdamW(groups, **kw)
        o.register_step_post_hook(lambda opt, a, k: calls.append(1))
        inner = o.step

        def step(*a, **k):
            wrapped.append(1)
            return inner(*a, **k)
        o.step = step
        return o
    torch.manual_seed(0)
    net = nn.Sequential(*[nn.Linear(64, 64) for _ in range(6)])
    opt = OSS(net.named_parameters(), optim=make, lr=0.01, bucket_numel=4096)
    net(torch.randn(2, 64)).sum().backward()
    opt.step()
    names = dict(net.named_parameters())
    local = opt.optim.param_groups[0]
    opt.add_param_group({"params": [("extra", nn.Parameter(torch.zeros(3)))]})
    return {"calls": len(calls), "wrapped": len(wrapped),
            "names_match": [names[n] is p for n, p in zip(local["param_names"], local["params"])],
            "public_names": len(opt.param_groups[0]["param_names"]),
            "added": [len(g["param_names"]) == len(g["params"]) for g in opt.optim.param_groups]}


def test_local_optimizer_keeps_its_own_hooks_and_names(world2):
    for r in world2.run(_local_optimizer_own_hooks_and_names):
        assert r["calls"] >= 1 and r["wrapped"] >= 1, r
        assert r["names_match"] and all(r["names_match"]), r
        assert r["public_names"] == 12 and all(r["added"]), r


def _grads_readable_only_at_the_boundary() -> dict:
    """The engine's check behind DeepSpeed's ``safe_*_grad`` functions: in the middle of an
    accumulation window each rank holds its own partial gradients (stage 2: the owner's local
    sum, which ``safe_get_full_grad`` broadcast as if averaged; stage 3: none), so the check
    raises there, on every rank alike, and passes at the boundary and after the step."""
    import shardkit
    out = {}
    for stage in (2, 3):
        torch.manual_seed(0)
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                  "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                  "zero_optimization": {"stage": stage}}
        engine, *_ = shardkit.initialize(model=nn.Sequential(nn.Linear(4, 4)), config=config)
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(distributed.get_rank()))
        seen = []

        def check():
            try:
                engine._check_full_grads_readable("safe_get_full_grad")
                seen.append(None)
            except ValueError as e:
                seen.append(str(e))
        check()                          # nothing accumulated
        engine.backward(engine(x).sum())
        check()                          # after micro-batch 1 of 2
        engine.step()
        check()                          # before micro-batch 2's backward
        engine.backward(engine(x).sum())
        check()                          # the boundary: reduced
        engine.step()
        check()                          # stepped: nothing accumulated
        out[stage] = seen
    return out


def test_full_gradients_are_readable_only_at_the_accumulation_boundary(world2):
    first, second = world2.run(_grads_readable_only_at_the_boundary)
    assert first == second
    for stage, seen in first.items():
        assert seen[0] is None and seen[3] is None and seen[4] is None, (stage, seen)
        assert seen[1].startswith("safe_get_full_grad: called after micro-batch 1 of 2 of a "
                                  "gradient accumulation window"), (stage, seen)
        assert seen[2] == seen[1], (stage, seen)


def _stage0_mid_window_reads_local_grad() -> list:
    """Stage 0 in the middle of a window: each rank's own accumulated ``.grad``, as DeepSpeed's
    ``safe_get_full_grad`` returns ``param.grad`` (no ZeRO: reduced only at the boundary)."""
    import shardkit
    from shardkit.utils.tensor_fragment import safe_get_full_grad
    config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
              "zero_optimization": {"stage": 0}}
    torch.manual_seed(0)
    engine, *_ = shardkit.initialize(model=nn.Sequential(nn.Linear(4, 4)), config=config)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(distributed.get_rank()))
    engine.backward(engine(x).sum())
    weight = engine.module[0].weight
    return [torch.equal(safe_get_full_grad(weight), weight.grad)]


def test_stage0_mid_window_reads_return_the_local_grad(world2):
    assert world2.run(_stage0_mid_window_reads_local_grad) == [[True], [True]]


def _public_grad_functions_mid_window() -> dict:
    """Through the public functions (the test above calls the engine's check directly): each
    of them raises mid-window at stages 1-3 and works at the boundary."""
    import shardkit
    from shardkit.utils import tensor_fragment as tf
    out = {}
    for stage in (1, 2, 3):
        config = {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 2,
                  "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                  "zero_optimization": {"stage": stage}}
        torch.manual_seed(0)
        engine, *_ = shardkit.initialize(model=nn.Sequential(nn.Linear(4, 4)), config=config)
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(distributed.get_rank()))
        weight = engine.module[0].weight
        calls = {"get_full": lambda: tf.safe_get_full_grad(weight),
                 "set_full": lambda: tf.safe_set_full_grad(weight, torch.zeros(4, 4))}
        if stage == 3:
            local = tf.safe_get_local_fp32_param(weight)
            calls["get_local"] = lambda: tf.safe_get_local_grad(weight)
            calls["set_local"] = lambda: tf.safe_set_local_grad(weight, torch.zeros_like(local))
        engine.backward(engine(x).sum())
        mid = {}
        for name, call in calls.items():
            try:
                call()
                mid[name] = None
            except ValueError as e:
                mid[name] = str(e).split(":")[0]
        engine.step()
        engine.backward(engine(x).sum())
        boundary = {name: call() is None or True for name, call in calls.items()}
        out[stage] = (mid, boundary)
    return out


def test_public_grad_functions_raise_mid_window(world2):
    first, second = world2.run(_public_grad_functions_mid_window)
    assert first == second
    for stage, (mid, boundary) in first.items():
        assert all(v is not None and v.startswith("safe_") for v in mid.values()), (stage, mid)
        assert all(boundary.values()), (stage, boundary)


def _state_read_for_every_param_then_refresh() -> dict:
    """A user reads Adam's state of every parameter (owned here or not), then freezes one layer
    and calls refresh_trainable: training goes on exactly as one process's Adam does."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(5, 6), nn.Tanh(), nn.Linear(6, 4), nn.Tanh(), nn.Linear(4, 3))
    oracle = copy.deepcopy(model)
    opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=0.01)
    plain = torch.optim.Adam(oracle.parameters(), lr=0.01)
    worst = 0.0
    for step in range(5):
        x, y = torch.randn(4, 5), torch.randn(4, 3)  # the same on every rank (same seed)
        for m, o in ((model, opt), (oracle, plain)):
            o.zero_grad()
            F.mse_loss(m(x), y).backward()
            o.step()
        [opt.state[p].get("exp_avg") for p in model.parameters()]
        if step == 1:
            for net in (model, oracle):
                net[4].weight.requires_grad_(False)
            opt.refresh_trainable()
        worst = max(worst, max_diff(model, oracle))
    return {"worst": worst}


def test_reading_state_of_unowned_params_keeps_owner_state(world2):
    for r in world2.run(_state_read_for_every_param_then_refresh):
        assert r["worst"] <= TOL, r


def _overlap_reads_after_relayout() -> dict:
    """``overlap_sync_with(model)`` then layers joining the partition later: the forward after a
    step sees the synced parameters (the 16-bit wire lands at the wait only, so a missed wait
    is seen deterministically); a submodule's and ``ddp.module``'s state_dict wait too."""
    out = {}
    for change in ("refresh_trainable", "add_param_group", "ddp_module_state_dict"):
        torch.manual_seed(0)
        model = nn.Sequential(*[nn.Linear(8, 8, bias=False) for _ in range(4)])
        params = list(model.parameters())
        if change == "refresh_trainable":
            model[0].requires_grad_(False)
        opt = OSS(params[2:] if change == "add_param_group" else params, optim=torch.optim.SGD,
                  lr=0.1, bucket_numel=64, broadcast_fp16=torch.bfloat16)
        ddp = DDP(model)
        opt.overlap_sync_with(ddp if change == "ddp_module_state_dict" else model)
        if change == "refresh_trainable":
            model[0].requires_grad_(True)
            opt.refresh_trainable()
        elif change == "add_param_group":
            opt.add_param_group({"params": params[:2]})
        ddp = DDP(model)
        x = torch.randn(2, 8)
        for p in params:
            p.grad = torch.ones_like(p)
        opt.step()
        with torch.no_grad():
            if change == "ddp_module_state_dict":
                seen = [v.clone() for v in ddp.module.state_dict().values()] + \
                    [v.clone() for v in model[0].state_dict().values()]
            else:
                seen = [model(x)]
            opt.wait_for_sync()
            if change == "ddp_module_state_dict":
                synced = list(model.state_dict().values()) + list(model[0].state_dict().values())
            else:
                synced = [model(x)]
        out[change] = max((a - b).abs().max().item() for a, b in zip(seen, synced))
        out[change + "_buckets"] = opt.num_buckets
    return out


def test_overlapped_sync_is_awaited_after_relayout_and_by_submodule_state_dicts(world2):
    for r in world2.run(_overlap_reads_after_relayout):
        assert r["refresh_trainable_buckets"] == r["add_param_group_buckets"] == 2, r
        assert r["refresh_trainable"] == 0.0, r
        assert r["add_param_group"] == 0.0, r
        assert r["ddp_module_state_dict"] == 0.0, r


def _state_dict_reads_current_hyperparameters() -> dict:
    """consolidate_state_dict, then the scheduler steps, then state_dict (a checkpoint callback's
    order): the saved learning rate is the current one, as a plain optimizer's state_dict has."""
    out = {}
    for name in ("oss", "plain"):
        torch.manual_seed(0)
        model = _mlp()
        opt = OSS(model.parameters(), optim=torch.optim.AdamW, lr=0.1) if name == "oss" \
            else torch.optim.AdamW(model.parameters(), lr=0.1)
        sched = torch.optim.lr_scheduler.ExponentialLR(opt, gamma=0.5)
        F.mse_loss(model(torch.randn(4, 5)), torch.randn(4, 3)).backward()
        opt.step()
        if name == "oss":
            opt.consolidate_state_dict(recipient_rank=-1)
        sched.step()
        out[name] = opt.state_dict()["param_groups"][0]["lr"]
    return out


def test_state_dict_reads_hyperparameters_when_called(world2):
    for r in world2.run(_state_dict_reads_current_hyperparameters):
        assert r["oss"] == r["plain"] == 0.05, r


def _overlap_hooks_cost_and_lifetime() -> dict:
    """``overlap_sync_with`` on a model of many small modules, most frozen: a forward pre-hook
    looks its buckets up instead of scanning every pending bucket's parameters (a forward with
    the 25 buckets pending cost 3.5x one without), hooked submodules still pickle, and the
    hooks do not keep a deleted optimizer's buffers alive."""
    import gc
    import io
    import weakref
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(4, 4) for _ in range(400)])
    for m in model[:350]:
        m.requires_grad_(False)
    params = [p for p in model.parameters() if p.requires_grad]
    opt = OSS(params, optim=torch.optim.SGD, lr=0.1, bucket_numel=20)
    opt.overlap_sync_with(model)
    opt.overlap_sync_with(model)  # a second call adds no second set of hooks
    sync = opt._sync
    scanned = []
    every = [b for buckets in sync.buckets for b in buckets]
    for b in every:  # count the slots the hooks read
        b._slots = _CountingList(b._slots, scanned)
    sync._pending = list(every)  # finished already: finish_gather is a no-op
    with torch.no_grad():
        model(torch.randn(2, 4))
    out = {"slots_read": len(scanned), "in_flight": sync.in_flight,
           "forward_hooks": sum(len(m._forward_pre_hooks) for m in model.modules())}
    torch.save(model[0], io.BytesIO())  # a frozen, hooked submodule
    torch.save(model, io.BytesIO())
    alive = weakref.ref(sync)
    del opt, sync, every
    gc.collect()
    out["sync_alive"] = alive() is not None
    return out


class _CountingList(list):
    def __init__(self, items, seen):
        super().__init__(items)
        self._seen = seen

    def __iter__(self):
        for item in super().__iter__():
            self._seen.append(1)
            yield item


def test_overlap_hooks_are_cheap_picklable_and_weak(world2):
    for r in world2.run(_overlap_hooks_cost_and_lifetime):
        assert r["slots_read"] == 0 and r["in_flight"] == 0, r
        assert r["forward_hooks"] == 400, r
        assert not r["sync_alive"], r
