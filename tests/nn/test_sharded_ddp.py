"""ShardedDataParallel + OSS parity with single-process training on the same global batch.

Every rank also trains the single-process oracle itself (same seed, the global batch made of
all ranks' local batches, plain torch.optim.AdamW), and compares every parameter after each
step. One grid of configurations runs inside one world per size.
"""

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as skdist
from shardkit.nn.data_parallel import ShardedDataParallel
from shardkit.optim import OSS
from shardkit.testing import world_fixture
from tests.nn.test_sharded_ddp_errors import _FailInBackward
from tests.utils.compare import max_diff

STEPS = 10
LOCAL_BATCH = 8
TOLERANCE = 1e-5


class Net(nn.Module):
    """Small MLP with a branch that a forward may skip (an unused parameter set)."""

    def __init__(self, width: int = 24, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.inp = nn.Linear(8, width)
        self.hidden = nn.Linear(width, width)
        self.branch = nn.Linear(width, width)
        self.out = nn.Linear(width, 4)

    def forward(self, x, use_branch: bool = True):
        h = torch.tanh(self.inp(x))
        h = torch.tanh(self.hidden(h))
        if use_branch:
            h = h + torch.tanh(self.branch(h))
        return self.out(h)


def _batch(step: int, rank: int, micro: int = 0):
    gen = torch.Generator().manual_seed(1000 * step + 10 * rank + micro)
    return torch.randn(LOCAL_BATCH, 8, generator=gen), torch.randn(LOCAL_BATCH, 4, generator=gen)


def _param_groups(model: nn.Module, two_groups: bool):
    if not two_groups:
        return [{"params": list(model.parameters())}]
    return [{"params": [*model.inp.parameters(), *model.hidden.parameters()]},
            {"params": [*model.branch.parameters(), *model.out.parameters()], "lr": 5e-3,
             "weight_decay": 0.0}]


def _uses_branch(cfg: dict, step: int, rank: int) -> bool:
    mode = cfg.get("unused_branch")
    if mode == "everywhere":
        return False
    if mode == "on_rank0":  # data-dependent: rank 0 skips it, the others use it
        return rank != 0
    if mode == "before_step_4":
        return step >= 4
    return True


def _reference_step(model, optimizer, cfg, step, world_size):
    """Single process, global batch = every rank's local batch(es)."""
    optimizer.zero_grad()
    micro_batches = cfg.get("accumulate", 1)
    for rank in range(world_size):
        for micro in range(micro_batches):
            x, y = _batch(step, rank, micro)
            out = model(x, use_branch=_uses_branch(cfg, step, rank))
            loss = F.mse_loss(out, y) / (world_size * micro_batches)
            loss.backward()
    optimizer.step()


def _sharded_step(model, optimizer, cfg, step, rank):
    micro_batches = cfg.get("accumulate", 1)
    if cfg.get("zero_grad") == "model":
        model.zero_grad()
    elif cfg.get("zero_grad") == "zeros":
        optimizer.zero_grad(set_to_none=False)
    else:
        optimizer.zero_grad()  # torch's default: set_to_none=True
    manual = cfg.get("manual_reduce", 0)
    for micro in range(micro_batches):
        x, y = _batch(step, rank, micro)
        last = micro == micro_batches - 1
        accumulate_locally = (not last or manual) and not cfg.get("no_no_sync")
        with model.no_sync() if accumulate_locally else contextlib.nullcontext():
            out = model(x, use_branch=_uses_branch(cfg, step, rank))
            (F.mse_loss(out, y) / micro_batches).backward()
    for _ in range(manual):  # FairScale's manual reduction; a second call changes nothing
        model.reduce()
    owned = {id(p) for p in optimizer.owned_params()}
    for p in model.parameters():
        if p.grad is not None and id(p) not in owned:
            raise AssertionError("a non-owner still holds a gradient after backward")
    optimizer.step()


def _transport(kind):
    if kind == "shared_memory":  # small parts: buckets take several rounds
        from shardkit.shm_transport import SharedMemoryTransport
        return SharedMemoryTransport(part_bytes=4096)
    return None


def _build(cfg, rank):
    lr, wd = 1e-2, 0.05
    ref = Net(seed=0)
    model = Net(seed=0 if not cfg.get("rank_seeds") else rank)  # startup sync fixes rank seeds
    if cfg.get("freeze") in ("always", "until_step_3"):
        for m in (ref, model):
            m.hidden.requires_grad_(False)
    if cfg.get("checkpoint"):  # recomputation inside backward must not disturb the buckets
        from shardkit.nn.checkpoint import checkpoint_wrapper
        checkpoint_wrapper(model.hidden)
        checkpoint_wrapper(model.branch)
    optim_cls, hyper = ((torch.optim.SGD, {"lr": lr, "momentum": 0.9, "weight_decay": wd})
                        if cfg.get("optim") == "sgd_momentum"
                        else (torch.optim.AdamW, {"lr": lr, "weight_decay": wd}))
    ref_opt = optim_cls(_param_groups(ref, cfg.get("two_groups", False)), **hyper)
    comm = _transport(cfg.get("comm"))
    if cfg.get("two_optimizers"):
        first = OSS([*model.inp.parameters(), *model.hidden.parameters()],
                    optim=optim_cls, comm=comm, bucket_numel=cfg.get("sync_bucket"), **hyper)
        second = OSS([*model.branch.parameters(), *model.out.parameters()],
                     optim=optim_cls, comm=comm, bucket_numel=cfg.get("sync_bucket"), **hyper)
        optimizers = [first, second]
    else:
        optimizers = [OSS(_param_groups(model, cfg.get("two_groups", False)),
                          optim=optim_cls, comm=comm, bucket_numel=cfg.get("sync_bucket"),
                          **hyper)]
    wrapped = ShardedDataParallel(model, optimizers if len(optimizers) > 1 else optimizers[0],
                                  reduce_buffer_size=cfg.get("bucket", 2 ** 23), comm=comm,
                                  max_inflight_bytes=cfg.get("inflight", 2 ** 26),
                                  step_in_backward=cfg.get("step_in_backward", False))
    return ref, ref_opt, wrapped, _Optimizers(optimizers)


class _Optimizers(list):
    """One or more OSS driven as one optimizer by the training loop."""

    def zero_grad(self, set_to_none=True):
        for o in self:
            o.zero_grad(set_to_none=set_to_none)

    def step(self):
        for o in self:
            o.step()

    def owned_params(self):
        rank = skdist.get_rank()
        return [p for o in self for p, r in o.param_to_rank.items() if r == rank]


def _run_parity(cfg: dict) -> float:
    rank, world_size = skdist.get_rank(), skdist.get_world_size()
    ref, ref_opt, model, optimizer = _build(cfg, rank)
    worst = 0.0
    for step in range(STEPS):
        if cfg.get("freeze") == "at_step_5" and step == 5:
            for m in (ref, model.module):
                m.hidden.requires_grad_(False)
        if cfg.get("freeze") == "until_step_3" and step == 3:  # first gradient comes late
            for m in (ref, model.module):
                m.hidden.requires_grad_(True)
        _reference_step(ref, ref_opt, cfg, step, world_size)
        _sharded_step(model, optimizer, cfg, step, rank)
        if cfg.get("step_in_backward"):
            worst = max(worst, _diff_read_as_users_do(ref, model, cfg, step))
        else:
            worst = max(worst, max_diff(ref, model.module))
    return worst


def _diff_read_as_users_do(ref, model, cfg, step) -> float:
    """With the parameter sync still in flight after step(), read the parameters the ways a
    user does: an evaluation forward (waits module by module) and state_dict() (waits for
    all); neither may see a stale weight."""
    worst = 0.0
    if cfg.get("eval_between_steps"):
        x, _ = _batch(10_000 + step, 0)
        model.eval()
        with torch.no_grad():
            worst = max_diff([model(x)], [ref(x)])
        model.train()
    return max(worst, max_diff(ref.state_dict(), model.module.state_dict()))


CONFIGS = {
    "plain": {},
    "model_zero_grad": {"zero_grad": "model"},
    "zero_grad_to_zeros": {"zero_grad": "zeros"},
    "no_sync_4_micro_batches": {"accumulate": 4},
    "accumulate_without_no_sync": {"accumulate": 2, "no_no_sync": True},
    "frozen_layer": {"freeze": "always"},
    "freeze_at_step_5": {"freeze": "at_step_5"},
    "unused_branch_everywhere": {"unused_branch": "everywhere"},
    "unused_branch_on_rank0": {"unused_branch": "on_rank0"},
    "two_param_groups": {"two_groups": True},
    "manual_reduce_after_no_sync": {"accumulate": 3, "manual_reduce": 1},
    "manual_reduce_twice": {"accumulate": 2, "manual_reduce": 2, "bucket": 1024},
    "sgd_momentum_unfreeze_at_step_3": {"optim": "sgd_momentum", "freeze": "until_step_3"},
    "sgd_momentum_branch_first_used_at_step_4": {"optim": "sgd_momentum",
                                                 "unused_branch": "before_step_4"},
    "two_optimizers": {"two_optimizers": True},
    "startup_sync_of_rank_seeds": {"rank_seeds": True},
    "small_buckets": {"bucket": 1024},
    "small_buckets_one_in_flight": {"bucket": 1024, "inflight": 0},
    "small_buckets_shared_memory": {"bucket": 1024, "comm": "shared_memory"},
    "one_param_per_bucket": {"bucket": 0},
    "activation_checkpointing": {"checkpoint": True, "bucket": 1024},
    # the owners step each OSS sync bucket inside backward (small buckets: several of each)
    "step_in_backward": {"step_in_backward": True, "bucket": 1024, "sync_bucket": 50},
    "step_in_backward_eval_between_steps": {"step_in_backward": True, "bucket": 1024,
                                            "sync_bucket": 50, "eval_between_steps": True},
    "step_in_backward_no_sync": {"step_in_backward": True, "accumulate": 3, "bucket": 1024,
                                 "sync_bucket": 50},
    "step_in_backward_unused_branch_on_rank0": {"step_in_backward": True, "bucket": 1024,
                                                "sync_bucket": 50, "unused_branch": "on_rank0"},
    "step_in_backward_two_optimizers": {"step_in_backward": True, "two_optimizers": True,
                                        "bucket": 1024, "sync_bucket": 50},
    "step_in_backward_freeze_at_step_5": {"step_in_backward": True, "freeze": "at_step_5",
                                          "bucket": 1024, "sync_bucket": 50},
    "step_in_backward_shared_memory": {"step_in_backward": True, "bucket": 1024,
                                       "sync_bucket": 50, "comm": "shared_memory"},
    "step_in_backward_one_bucket_each": {"step_in_backward": True},
    "step_in_backward_manual_reduce": {"step_in_backward": True, "accumulate": 2,
                                       "manual_reduce": 1, "bucket": 1024, "sync_bucket": 50},
}


def _run_grid(names):
    return {name: _run_parity(CONFIGS[name]) for name in names}


world2 = world_fixture(2)


world4 = world_fixture(4)


def _assert_parity(per_rank: list[dict]):
    failures = {name: diff for result in per_rank for name, diff in result.items()
                if not diff <= TOLERANCE}
    assert not failures, f"max |param - oracle| above {TOLERANCE}: {failures}"


def test_parity_grid_world2(world2):
    _assert_parity(world2.run(_run_grid, list(CONFIGS)))


def test_parity_grid_world4(world4):
    names = ["plain", "no_sync_4_micro_batches", "frozen_layer", "unused_branch_on_rank0",
             "manual_reduce_twice", "sgd_momentum_unfreeze_at_step_3",
             "two_param_groups", "small_buckets_shared_memory", "step_in_backward",
             "step_in_backward_eval_between_steps"]
    _assert_parity(world4.run(_run_grid, names))


def test_parity_grid_world1():
    # one rank owns everything: nothing to reduce or sync, on either transport
    from shardkit.testing import World
    with World(1) as world:
        _assert_parity(world.run(_run_grid, ["plain", "no_sync_4_micro_batches",
                                             "small_buckets", "small_buckets_shared_memory",
                                             "step_in_backward"]))


class WithFrozenIndex(nn.Module):
    """Net plus a frozen integer parameter, as FairScale's ``test_mixed_types`` tripwire: a
    parameter of another dtype that is not trainable must not disturb buckets or partition."""

    def __init__(self):
        super().__init__()
        self.net = Net(seed=0)
        self.index = nn.Parameter(torch.tensor([3, 3]), requires_grad=False)

    def forward(self, x, use_branch: bool = True):
        return self.net(x, use_branch)


def _check_fairscale_feature_switches():
    """What FairScale's test_sharded_ddp_features checks beyond its parity grid, each step
    compared with the single-process oracle: an eval forward between steps (no reduction, no
    gradient), a cast to fp16 and back after wrapping (its GPT-2 test's ``.to()`` stress),
    and a frozen integer parameter."""
    rank, world_size = skdist.get_rank(), skdist.get_world_size()
    ref, model = WithFrozenIndex(), WithFrozenIndex()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-2, momentum=0.9)
    optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=1e-2, momentum=0.9)
    wrapped = ShardedDataParallel(model, optimizer, reduce_buffer_size=1024)
    worst, eval_grads = 0.0, []
    for step in range(4):
        _reference_step(ref, ref_opt, {}, step, world_size)
        optimizer.zero_grad()
        x, y = _batch(step, rank)
        F.mse_loss(wrapped(x), y).backward()
        optimizer.step()
        wrapped.zero_grad()
        wrapped.eval()
        wrapped(x)  # FairScale's train -> eval -> train switch
        eval_grads += [p.grad for p in model.parameters() if p.grad is not None]
        wrapped.train()
        if step == 1:
            for m in (ref, wrapped):
                m.to(dtype=torch.float16)
                m.to(dtype=torch.float32)
        worst = max(worst, max_diff(ref, model))
    return worst, len(eval_grads) == 0, model.index.tolist()


def test_fairscale_feature_switches_keep_parity(world2):
    for worst, no_grad_after_eval, index in world2.run(_check_fairscale_feature_switches):
        assert worst <= TOLERANCE, worst
        assert no_grad_after_eval and index == [3, 3]


def _discarded_wrappers_are_collected():
    """ShardedDDP, its module and its OSS are garbage collected once the user drops them, built
    only or after training steps: the wrapper's post-accumulate-grad hooks on the parameters
    (kept by torch in C++, out of the collector's sight) held it, and with it the model and
    the optimizer state, for good."""
    import gc
    import weakref
    from shardkit.nn.data_parallel import ShardedDataParallel
    from shardkit.optim import OSS
    alive = {}
    for steps in (0, 2):
        module = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
        optim = OSS(module.parameters(), optim=torch.optim.AdamW, lr=0.1)
        model = ShardedDataParallel(module, optim)
        for _ in range(steps):
            model(torch.randn(3, 4)).sum().backward()
            optim.step()
            optim.zero_grad()
        refs = [weakref.ref(x) for x in (module, optim, model)]
        del module, optim, model
        gc.collect()
        alive[steps] = [r() is not None for r in refs]
    return alive


def test_discarded_wrappers_are_collected(world2):
    for alive in world2.run(_discarded_wrappers_are_collected):
        assert alive == {0: [False] * 3, 2: [False] * 3}, alive


def _user_post_accumulate_hooks_see_local_gradients():
    """Post-accumulate-grad hooks the user registers on the parameters after wrapping (gradient
    logging, per-parameter clipping) find ``p.grad``, this rank's local gradient, as under torch
    DDP and in one process: the bucket a gradient completes is launched only after them (they
    found ``None`` on the last parameter of each bucket, on every parameter with
    ``reduce_buffer_size=0``). The step still matches the oracle."""
    rank, world_size = skdist.get_rank(), skdist.get_world_size()
    out = {}
    for size in (0, 2 ** 23):
        ref, model = Net(), Net()
        local = Net()
        ref_opt = torch.optim.SGD(ref.parameters(), lr=1e-2)
        optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=1e-2)
        wrapped = ShardedDataParallel(model, optimizer, reduce_buffer_size=size)
        seen = {}
        for name, p in model.named_parameters():
            p.register_post_accumulate_grad_hook(
                lambda q, name=name: seen.__setitem__(
                    name, None if q.grad is None else q.grad.detach().clone()))
        x, y = _batch(0, rank)
        F.mse_loss(local(x), y).backward()
        _reference_step(ref, ref_opt, {}, 0, world_size)
        F.mse_loss(wrapped(x), y).backward()
        optimizer.step()
        out[size] = (max(float("inf") if seen.get(n) is None else (seen[n] - p.grad).abs().max()
                         for n, p in local.named_parameters()), max_diff(ref, model))
    return out


def test_user_post_accumulate_hooks_see_local_gradients(world2):
    for out in world2.run(_user_post_accumulate_hooks_see_local_gradients):
        for size, (hook_diff, worst) in out.items():
            assert hook_diff <= 1e-6 and worst <= TOLERANCE, (size, hook_diff, worst)


def _carried_fp16_gradients_stay_finite():
    """fp16 gradients accumulated over reducing backward passes without zeroing (the engine's
    stage 2 with gradient accumulation does this every micro-batch): the owner's reduced
    gradient carried into the next backward is added to the next reduction, not multiplied
    by the world size first (it overflowed above 65504 / N: 40000 then 20000 gave inf, and
    a second ``reduce()`` with no backward between did too)."""
    rank = skdist.get_rank()
    out = {}
    for size in (0, 2 ** 23):
        model = nn.Linear(1, 1, bias=False).half()
        optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.0)
        wrapped = ShardedDataParallel(model, optimizer, reduce_buffer_size=size)
        seen = []
        for local in ((40000.0, 40000.0), (30000.0, 10000.0)):
            x = torch.full((1, 1), local[rank], dtype=torch.half)
            wrapped(x).sum().backward()
            seen.append(None if model.weight.grad is None else float(model.weight.grad))
        wrapped.reduce()  # nothing new since the last reduction: the gradient stays
        seen.append(None if model.weight.grad is None else float(model.weight.grad))
        out[size] = (optimizer.partition.owner(model.weight) == rank, seen)
    return out


def test_carried_fp16_gradients_stay_finite(world2):
    for out in world2.run(_carried_fp16_gradients_stay_finite):
        for size, (owner, seen) in out.items():
            assert seen == ([40000.0, 60000.0, 60000.0] if owner else [None] * 3), (size, seen)


def _ref_mean_step(ref, batches, world_size, frozen=()):
    """One SGD step of ``ref`` on the mean over ranks of each micro-batch's loss, summed."""
    opt = torch.optim.SGD(ref.parameters(), lr=1e-2)
    opt.zero_grad()
    for micro in batches:
        for r in range(world_size):
            x, y = micro(r)
            (F.mse_loss(ref(x), y) / world_size).backward()
        for name in frozen:
            ref.get_parameter(name).requires_grad_(False)
    opt.step()


def _carried_gradients_after_failures_and_freezing():
    """A reduced gradient carried into the next backward (accumulation without no_sync) and:
    (1) that backward raises, the script zeroes through the optimizer (or the module) and
    steps on one more backward: one backward's mean, as before the carry was set aside
    (the set-aside gradient came back after the zeroing: 0.1 off); (2) with
    ``step_in_backward``, that backward is refused because the owners already stepped, and
    the script steps and zeroes as the error says; (3) a parameter frozen while it carries
    one keeps it as it is (it was multiplied by N and stepped so)."""
    rank, world_size = skdist.get_rank(), skdist.get_world_size()
    out = {}
    for zero in ("optimizer", "module"):
        ref, model = Net(), Net()
        optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=1e-2)
        wrapped = ShardedDataParallel(model, optimizer, reduce_buffer_size=0)
        x, y = _batch(0, rank)
        F.mse_loss(wrapped(x), y).backward()
        failing = model.hidden.register_forward_hook(
            lambda module, inputs, output: _FailInBackward.apply(output))
        with contextlib.suppress(RuntimeError):  # raises half-way through the backward
            F.mse_loss(wrapped(x), y).backward()
        failing.remove()
        (optimizer if zero == "optimizer" else model).zero_grad()
        x, y = _batch(1, rank)
        F.mse_loss(wrapped(x), y).backward()
        optimizer.step()
        _ref_mean_step(ref, [lambda r: _batch(1, r)], world_size)
        out[f"failed_backward_{zero}_zero_grad"] = max_diff(ref, model)
    ref, model = Net(), Net()
    optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=1e-2)
    wrapped = ShardedDataParallel(model, optimizer, step_in_backward=True)
    F.mse_loss(wrapped(_batch(0, rank)[0]), _batch(0, rank)[1]).backward()
    with contextlib.suppress(RuntimeError):
        F.mse_loss(wrapped(_batch(0, rank)[0]), _batch(0, rank)[1]).backward()
    optimizer.step()
    optimizer.zero_grad()
    F.mse_loss(wrapped(_batch(1, rank)[0]), _batch(1, rank)[1]).backward()
    optimizer.step()
    _ref_mean_step(ref, [lambda r: _batch(0, r)], world_size)
    _ref_mean_step(ref, [lambda r: _batch(1, r)], world_size)
    with torch.no_grad():
        wrapped(_batch(0, rank)[0])  # the last sync lands
    out["refused_backward_then_step"] = max_diff(ref, model)
    ref, model = Net(), Net()
    optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=1e-2)
    wrapped = ShardedDataParallel(model, optimizer)
    F.mse_loss(wrapped(_batch(0, rank)[0]), _batch(0, rank)[1]).backward()
    model.inp.weight.requires_grad_(False)
    F.mse_loss(wrapped(_batch(1, rank)[0]), _batch(1, rank)[1]).backward()
    optimizer.step()
    _ref_mean_step(ref, [lambda r: _batch(0, r), lambda r: _batch(1, r)], world_size,
                   frozen=("inp.weight",))
    with torch.no_grad():
        wrapped(_batch(0, rank)[0])
    out["frozen_while_carried"] = max_diff(ref, model)
    return out


def test_carried_gradients_after_failures_and_freezing(world2):
    for out in world2.run(_carried_gradients_after_failures_and_freezing):
        for case, worst in out.items():
            assert worst <= TOLERANCE, (case, worst)
