"""FairScale's own OSS test suite (tests/optim/test_oss.py), re-expressed for shardkit.

A FairScale user changes ``fairscale`` to ``shardkit`` in the imports and nothing else; these
checks hold shardkit to what FairScale's suite promised such a user: the exact numbers of its
small single-parameter cases, state dicts consolidated on a recipient rank and loaded on every
rank, ``add_param_group``, per-group hyper-parameters, closures and step keyword arguments,
lr schedulers, ``clip_grad_norm`` for every norm type against torch's, gradient accumulation,
OSS on sub-process-groups, ``broadcast_fp16``, ``refresh_trainable`` and frozen parameters,
the size-balanced partition, and parity with torch DDP + the plain optimizer, step by step.
Where shardkit differs on purpose (README, "Coming from FairScale") the check asserts shardkit's
documented behaviour instead.

Each check runs on every rank of one world per size (1, 2 and 4 gloo ranks) and returns what
the test asserts; one ``World.run`` per check, so a failing check names itself.
"""

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.nn.parallel import DistributedDataParallel as DDP

from shardkit import distributed
from shardkit.optim import OSS
from shardkit.testing import world_fixture
from tests.utils.compare import max_diff

world1 = world_fixture(1)
world2 = world_fixture(2)
world4 = world_fixture(4)

TOL = 1e-5


def _rank_world():
    return distributed.get_rank(), distributed.get_world_size()


def _broadcast_object(obj, src):
    box = [obj]
    torch.distributed.broadcast_object_list(box, src=src)
    return box[0]


def _same_on_every_rank(tensors, group=None) -> bool:
    """True if every tensor is bit-identical on every rank of ``group``."""
    flat = torch.cat([t.detach().reshape(-1).float() for t in tensors])
    low, high = flat.clone(), flat.clone()
    distributed.all_reduce(low, op=torch.distributed.ReduceOp.MIN, group=group)
    distributed.all_reduce(high, op=torch.distributed.ReduceOp.MAX, group=group)
    return bool(torch.equal(low, high))


def _mlp(widths, seed):
    torch.manual_seed(seed)
    layers = [torch.nn.Linear(a, b) for a, b in zip(widths[:-1], widths[1:])]
    return torch.nn.Sequential(*layers)


# ---------------------------------------------------------------------- FairScale's single-rank
# cases: one parameter, exact numbers. At world > 1 one rank owns it and the others receive it.


def check_create_with_plain_tensor():
    o = OSS([torch.rand(1)], lr=0.01)       # a tensor that does not require grad
    return len(o.param_groups) == 1 and o.param_groups[0]["lr"] == 0.01


def check_state_dict_exact_numbers():
    rank, world = _rank_world()
    x = torch.tensor([1.0], requires_grad=True)
    o = OSS([x], lr=0.1, momentum=0.9)
    x.backward()
    o.step()
    out = {"after_step": x.item()}
    owner = o.param_to_rank[x]
    if rank == owner:
        out["momentum"] = o.optim.state[x]["momentum_buffer"].item()
    else:
        out["momentum"] = None if x not in o.optim.state else "held by a non-owner"
    o.zero_grad()
    o.consolidate_state_dict()
    sd = o.state_dict() if rank == 0 else None
    sd = _broadcast_object(sd, 0)
    g = sd["param_groups"][0]
    out["keys"] = sorted(sd.keys())
    out["hyper"] = (g["lr"], g["momentum"], g["nesterov"], g["weight_decay"], g["dampening"])
    out["groups_in_sync"] = all(g[k] == o.param_groups[0][k] for k in g if k != "params")
    o = OSS([x], lr=0.01)
    o.load_state_dict(sd)
    out["loaded_lr"] = o.param_groups[0]["lr"]
    if rank == owner:
        out["loaded_momentum"] = o.optim.state[x]["momentum_buffer"].item()
    x.backward()
    o.step()
    out["second_step"] = round(x.item(), 6)
    if rank == owner:
        out["second_momentum"] = round(o.optim.state[x]["momentum_buffer"].item(), 6)
    out["device"] = o.param_groups[0]["params"][0].device == x.device
    return out


def check_lr_scheduler_matches_torch():
    x = torch.tensor([1.0], requires_grad=True)
    x2 = torch.tensor([1.0], requires_grad=True)
    o, o2 = OSS([x], lr=0.01), torch.optim.SGD([x2], lr=0.01)
    s = torch.optim.lr_scheduler.StepLR(o, 1, gamma=0.5)
    s2 = torch.optim.lr_scheduler.StepLR(o2, 1, gamma=0.5)
    trace = []
    for _ in range(5):
        for t, opt, sched in ((x, o, s), (x2, o2, s2)):
            opt.zero_grad()
            (t * 3.0).sum().backward()
            opt.step()
            sched.step()
        trace.append((x.item(), x2.item(), o.param_groups[0]["lr"], o2.param_groups[0]["lr"]))
    return trace


class SGDWithStepKwarg(torch.optim.SGD):
    def step(self, closure=None, kwarg=None):
        super().step()
        kwarg.append(5)


class SGDWithNewKey(torch.optim.SGD):
    def step(self, closure=None):
        super().step()
        self.param_groups[0]["new_key"] = 0.1


class SGDWithoutClosure(torch.optim.SGD):
    def step(self):
        return super().step()


def check_step_variants():
    """FairScale's step tests: keyword arguments reach the optimizer's step once (also with
    several sync buckets), a key the optimizer adds to its groups shows in OSS's, and an
    optimizer whose step takes no closure works."""
    out = {}
    kwarg = []
    x = torch.tensor([1.0], requires_grad=True)
    o = OSS([x], SGDWithStepKwarg, lr=0.1)
    x.backward()
    o.step(0, kwarg=kwarg)                  # FairScale's test passes closure=0 positionally
    out["kwarg"] = (kwarg, x.item())
    kwarg = []
    xs = [torch.ones(3, requires_grad=True) for _ in range(4)]
    o = OSS(xs, SGDWithStepKwarg, lr=0.1, bucket_numel=1)
    sum(t.sum() for t in xs).backward()
    o.step(kwarg=kwarg)
    out["kwarg_buckets"] = (kwarg, o.num_buckets, [t[0].item() for t in xs])
    x = torch.tensor([1.0], requires_grad=True)
    o = OSS([x], SGDWithNewKey, lr=0.1)
    x.backward()
    o.step()
    out["new_key"] = (o.param_groups[0].get("new_key"), x.item())
    x = torch.tensor([1.0], requires_grad=True)
    o = OSS([x], SGDWithoutClosure, lr=0.1)
    x.backward()
    o.step()
    out["no_closure"] = x.item()
    return out


def check_state_dict_needs_consolidation():
    x = torch.tensor([1.0], requires_grad=True)
    o = OSS([x], lr=0.1)
    try:
        o.state_dict()
    except RuntimeError as error:
        return "consolidate_state_dict" in str(error)
    return "no error"


# ---------------------------------------------------------------------- partition


def check_add_param_group_balance():
    """FairScale's sizes: 9, 7, 5, 3 per rank (the last one missing), then a group of 3: every
    rank ends with 24 elements over two local param groups; a big frozen parameter first."""
    _, world = _rank_world()
    torch.manual_seed(0)
    sizes = [9, 7, 5, 3]
    params = [torch.rand(s, 1, requires_grad=True) for s in (sizes * world)[:-1]]
    o = OSS(params, lr=0.1)
    before = len(o.param_groups)
    o.add_param_group({"params": [torch.rand(3, 1, requires_grad=True)]})
    out = {"all_trainable": (before, len(o.param_groups), len(o.optim.param_groups),
                             sum(p.numel() for g in o.optim.param_groups for p in g["params"]))}
    params = [torch.rand(s, 1) for s in (100, 3, 5, 2, 6, 4)]
    for p in params[1:]:
        p.requires_grad_(True)
    o = OSS(params, lr=0.1)
    before = len(o.param_groups)
    o.add_param_group({"params": [torch.rand(3, 1, requires_grad=True)]})
    out["some_trainable"] = (before, len(o.param_groups), len(o.optim.param_groups))
    return out


def check_sharding_balance():
    _, world = _rank_world()
    torch.manual_seed(0)
    params = [torch.rand(s, 1, requires_grad=True) for s in [9, 7, 5, 3] * world]
    o = OSS(params, lr=0.1)
    return sum(p.numel() for p in o.optim.param_groups[0]["params"])


def check_partition_views():
    """partition_parameters / _param_to_rank / _per_device_params / _local_params agree, and a
    frozen parameter (README: shardkit partitions trainable ones only) is owned by no rank."""
    rank, world = _rank_world()
    model = _mlp([6, 5, 4, 3], seed=1)
    model[1].weight.requires_grad_(False)
    groups = [{"params": [model[0].weight, model[2].weight]},
              {"params": [model[0].bias, model[1].weight, model[1].bias, model[2].bias],
               "lr": 0.5}]
    o = OSS(groups, lr=0.1)
    parts = o.partition_parameters()
    ok = len(parts) == world and all(len(p) == 2 for p in parts)
    ok &= all(parts[r][1]["lr"] == 0.5 and parts[r][0]["lr"] == 0.1 for r in range(world))
    owned = [id(p) for r in range(world) for g in parts[r] for p in g["params"]]
    trainable = [p for p in model.parameters() if p.requires_grad]
    ok &= sorted(owned) == sorted(id(p) for p in trainable)
    ok &= all(parts[o.param_to_rank[p]] is not None for p in trainable)
    ok &= model[1].weight not in o.param_to_rank
    ok &= all(o._param_to_rank[p] == r for r in range(world) for g in parts[r]
              for p in g["params"])
    per_dev = o._per_device_params[torch.device("cpu")]
    ok &= [sorted(map(id, row)) for row in per_dev] == [
        sorted(id(p) for g in parts[r] for p in g["params"]) for r in range(world)]
    F.mse_loss(model(torch.randn(2, 6)), torch.zeros(2, 3)).backward()
    mine = sorted(id(p) for g in parts[rank] for p in g["params"])
    ok &= sorted(map(id, o._local_params)) == mine
    return ok


# ---------------------------------------------------------------------- stepping


def check_zero_grad():
    m = torch.nn.Linear(1, 1)
    o = OSS(m.parameters(), lr=0.1)
    m(torch.rand(1)).backward()
    had = m.weight.grad is not None and m.bias.grad is not None
    o.zero_grad()
    return had and not m.weight.grad and not m.bias.grad


def check_empty_shard_steps():
    """Two parameters over up to four ranks: some ranks own nothing and still clip (the norm
    is torch's) and step, and the state consolidates on the last rank (which owns nothing at
    world 4)."""
    torch.manual_seed(0)
    m = torch.nn.Linear(1, 1)
    ref = copy.deepcopy(m)
    o = OSS(m.parameters(), lr=0.1)
    ref_o = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.rand(20, 1)
    norms = []
    for model, opt in ((m, o), (ref, ref_o)):
        model(x).sum().backward()
        norms.append(float(o.clip_grad_norm(0.5) if opt is o else
                           torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)))
        opt.step()
    if abs(norms[0] - norms[1]) > 1e-5 * norms[1]:
        return float("inf")
    last = distributed.get_world_size() - 1
    o.consolidate_state_dict(recipient_rank=last)
    if distributed.get_rank() == last:
        sd = o.state_dict()
        if sd["param_groups"][0]["params"] != [0, 1]:
            return float("inf")
    return max_diff(m, ref)


def check_step_exact_numbers():
    """FairScale's test_step: x = rank + 1, gradients averaged by hand, SGD lr 0.1."""
    rank, world = _rank_world()
    x = torch.tensor([float(rank + 1)])
    m = torch.nn.Linear(1, 1)
    m.weight.data = torch.tensor([[1.0]])
    m.bias.data = torch.tensor([2.0])
    o = OSS(m.parameters(), lr=0.1)
    m(x).backward(x)
    for p in m.parameters():
        distributed.all_reduce(p.grad)
        p.grad /= world
    o.step()
    xs = [float(r + 1) for r in range(world)]
    expect_w = 1.0 - 0.1 * sum(v * v for v in xs) / world
    expect_b = 2.0 - 0.1 * sum(xs) / world
    return abs(m.weight.item() - expect_w) < 1e-6 and abs(m.bias.item() - expect_b) < 1e-6


def check_step_with_closure_exact_numbers():
    """FairScale's test_step_with_closure: the closure's loss comes back from step(); here the
    closure averages the gradients (as DDP would), so the result does not depend on which rank
    owns which parameter."""
    rank, world = _rank_world()
    x = torch.tensor([float(rank + 1)])
    target = x * 1.0 + 2.0 + 1.0            # weight 1, bias 2, error 1
    m = torch.nn.Linear(1, 1)
    m.weight.data = torch.tensor([[1.0]])
    m.bias.data = torch.tensor([2.0])
    o = OSS(m.parameters(), lr=0.1)

    def closure():
        o.zero_grad()
        loss = F.l1_loss(m(x), target)
        loss.backward()
        for p in m.parameters():
            distributed.all_reduce(p.grad)
            p.grad /= world
        return loss

    loss = o.step(closure=closure)
    mean_x = sum(r + 1 for r in range(world)) / world
    return (float(loss), round(m.weight.item() - (1.0 + 0.1 * mean_x), 6),
            round(m.bias.item() - 2.1, 6))


def check_step_with_closure_as_fairscale_wrote_it():
    """FairScale's test exactly: the closure does not average, each owner steps with its own
    rank's gradient. Its numbers (weight 1.1, bias 2.1 on every rank) hold because the weight
    is owned by rank 0 and the bias by rank 1 (world >= 2), FairScale's partition too."""
    rank, world = _rank_world()
    x = torch.tensor([float(rank + 1)])
    target = x * 1.0 + 2.0 + 1.0
    m = torch.nn.Linear(1, 1)
    m.weight.data = torch.tensor([[1.0]])
    m.bias.data = torch.tensor([2.0])
    o = OSS(m.parameters(), lr=0.1)

    def closure():
        o.zero_grad()
        loss = F.l1_loss(m(x), target)
        loss.backward()
        return loss

    loss = o.step(closure=closure)
    owners = [o.param_to_rank[m.weight], o.param_to_rank[m.bias]]
    return float(loss), round(m.weight.item(), 6), round(m.bias.item(), 6), owners


def _train_against_torch(optim_cls, hyper, *, steps=5, groups_fn=None, clip=None,
                         accumulate=1, closure=False, no_grad_param=False,
                         broadcast_fp16=False, frozen=False):
    """DDP + OSS beside DDP + the plain optimizer, both from the same weights, each rank its
    own data; returns (max parameter difference over the steps, max loss difference)."""
    rank, _ = _rank_world()
    base = _mlp([5, 7, 7, 3], seed=11)
    if no_grad_param:
        base.register_parameter("unused", torch.nn.Parameter(torch.ones(4)))
    if frozen:  # in the optimizers' groups, but frozen from the start (fine-tuning)
        base[1].requires_grad_(False)
    ref_model, oss_model = copy.deepcopy(base), copy.deepcopy(base)

    def groups(model):
        return groups_fn(model) if groups_fn else model.parameters()

    ref_opt = optim_cls(groups(ref_model), **hyper)
    opt = OSS(groups(oss_model), optim=optim_cls, broadcast_fp16=broadcast_fp16, **hyper)
    ddp_kw = {"find_unused_parameters": True} if no_grad_param else {}
    ref_ddp, oss_ddp = DDP(ref_model, **ddp_kw), DDP(oss_model, **ddp_kw)
    gen = torch.Generator().manual_seed(1000 + rank)
    worst, worst_loss = 0.0, 0.0
    for _ in range(steps):
        batches = [(torch.randn(4, 5, generator=gen), torch.randn(4, 3, generator=gen))
                   for _ in range(accumulate)]
        losses = []
        for ddp, o in ((ref_ddp, ref_opt), (oss_ddp, opt)):
            def forward_backward(ddp=ddp, o=o):
                o.zero_grad()
                total = 0.0
                for i, (x, y) in enumerate(batches):
                    loss = F.mse_loss(ddp(x), y) / accumulate
                    if i + 1 < accumulate:
                        with ddp.no_sync():
                            loss.backward()
                    else:
                        loss.backward()
                    total = total + loss.detach()
                return total
            if closure:
                losses.append(o.step(forward_backward))
                continue
            losses.append(forward_backward())
            if clip is not None:
                if o is opt:
                    norm = o.clip_grad_norm(clip[0], norm_type=clip[1])
                else:
                    norm = torch.nn.utils.clip_grad_norm_(ddp.parameters(), clip[0], clip[1])
                losses[-1] = norm
            o.step()
        worst_loss = max(worst_loss, abs(float(losses[0]) - float(losses[1])))
        worst = max(worst, max_diff(oss_model, ref_model))
    return worst, worst_loss


def _interleaved_groups(model):
    """FairScale's test_ddp_parity groups: interleaved, each with its own learning rate."""
    params = list(model.parameters())
    return [{"params": params[:-3] + params[-2:], "lr": 1e-2},
            {"params": [params[-3]], "lr": 1e-1}]


def check_parity_grid():
    adam = (torch.optim.Adam, {"lr": 1e-2})
    sgd = (torch.optim.SGD, {"lr": 5e-2, "momentum": 0.9})
    rms = (torch.optim.RMSprop, {"lr": 1e-3})
    grid = {
        "adam": dict(opt=adam),
        "sgd_momentum": dict(opt=sgd),
        "rmsprop": dict(opt=rms),
        "adam_interleaved_groups": dict(opt=adam, groups_fn=_interleaved_groups),
        "sgd_interleaved_groups_closure": dict(opt=sgd, groups_fn=_interleaved_groups,
                                               closure=True),
        "adam_accumulate_3": dict(opt=adam, accumulate=3),
        "sgd_param_without_grad": dict(opt=sgd, no_grad_param=True),
        "adam_param_without_grad": dict(opt=adam, no_grad_param=True),
        "adam_frozen_layer": dict(opt=adam, frozen=True),
        "sgd_frozen_layer_interleaved_groups": dict(opt=sgd, frozen=True,
                                                    groups_fn=_interleaved_groups),
    }
    for norm in (float("inf"), 1, 1.0, 2, 3.0):
        grid[f"clip_norm_{norm}"] = dict(opt=sgd, clip=(0.05, norm))
    out = {}
    for name, cfg in grid.items():
        cfg = dict(cfg)
        optim_cls, hyper = cfg.pop("opt")
        out[name] = _train_against_torch(optim_cls, hyper, **cfg)
    return out


def check_clip_returns_torch_norm_and_clips_owned():
    """FairScale's test_gradient_clipping: the norm OSS returns is torch's over the full
    (DDP-reduced) gradients, twice in a row for each norm type, and every owned gradient is
    below the clip afterwards."""
    rank, _ = _rank_world()
    out = {}
    for norm in (1.0, 2.0, 1, 2, 3, float("inf")):
        for _ in range(2):
            base = _mlp([20, 10, 10, 5], seed=4)
            ref, model = DDP(copy.deepcopy(base)), DDP(copy.deepcopy(base))
            opt = OSS(model.parameters(), lr=0.1, momentum=0.99)
            torch.manual_seed(rank)
            x, y = torch.rand(3, 20), torch.rand(3, 5)
            F.l1_loss(ref(x), y).backward()
            F.l1_loss(model(x), y).backward()
            mine = opt.clip_grad_norm(0.3, norm_type=norm)
            torchs = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.3, norm_type=norm)
            owned = [p for row in opt._per_device_params.values() for p in row[rank]
                     if p.grad is not None]
            below = all(float(torch.norm(p.grad, p=norm)) < 0.3 for p in owned)
            out[str(norm)] = (abs(float(mine) - float(torchs)) / float(torchs) < 1e-5,
                              below, mine.dim() == 0)
    return out


# ---------------------------------------------------------------------- state dicts


def check_collect_shards(recipient):
    """FairScale's test_collect_shards: consolidate on a recipient, broadcast, load on every
    rank; then state_dict(all_ranks=True); the models stay identical over the ranks; a fresh
    OSS with no state yet consolidates too."""
    rank, world = _rank_world()
    recipient = min(recipient, world - 1)
    torch.manual_seed(rank)
    inputs, target = torch.rand(3, 3), torch.rand(3, 5)
    model = _mlp([3, 3, 5], seed=2)
    opt = OSS(model.parameters(), lr=0.1, momentum=0.99)

    def closure():
        opt.zero_grad()
        loss = F.l1_loss(model(inputs), target)
        loss.backward()
        return loss

    opt.step(closure=closure)
    opt.consolidate_state_dict(recipient_rank=recipient)
    sd = opt.state_dict() if rank == recipient else {}
    size_ok = len(sd["state"]) == 4 if rank == recipient else True
    sd = _broadcast_object(sd, recipient)
    opt.load_state_dict(sd)
    opt.step(closure=closure)
    sd_all = opt.state_dict(all_ranks=True)
    opt.load_state_dict(sd_all)
    opt.step(closure=closure)
    same = _same_on_every_rank(list(model.parameters()))
    fresh = OSS(model.parameters(), lr=0.1, momentum=0.99)
    fresh.consolidate_state_dict(recipient_rank=recipient)
    empty_ok = (fresh.state_dict()["state"] == {}) if rank == recipient else True
    return size_ok, len(sd_all["state"]) == 4, same, empty_ok


def check_reproducibility(broadcast_fp16):
    """FairScale's test_reproducibility: snapshot (state_dict(all_ranks=True) + model), two
    steps, rewind, two steps: the same loss; parameters stay fp32."""
    rank, _ = _rank_world()
    torch.manual_seed(rank)
    inputs, target = torch.rand(3, 3), torch.rand(3, 5)
    model = DDP(_mlp([3, 3, 5], seed=2))
    opt = OSS(model.parameters(), optim=torch.optim.RMSprop, lr=0.1,
              broadcast_fp16=broadcast_fp16)

    def closure():
        opt.zero_grad()
        loss = F.l1_loss(model(inputs), target)
        loss.backward()
        return loss

    opt.step(closure=closure)
    opt_sd = copy.deepcopy(opt.state_dict(all_ranks=True))
    model_sd = copy.deepcopy(model.state_dict())
    opt.step(closure=closure)
    reference = opt.step(closure=closure)
    opt.load_state_dict(opt_sd)
    model.load_state_dict(model_sd)
    opt.step(closure=closure)
    again = opt.step(closure=closure)
    return (bool(torch.allclose(reference, again)),
            all(p.dtype == torch.float32 for p in model.parameters()))


def check_state_dict_distributed():
    """FairScale's test_state_dict_distributed: two identical tracks with a head added by
    add_param_group; the second saves on rank 1, is rebuilt with absurd hyper-parameters and
    reloaded, and follows the first step by step."""
    rank, world = _rank_world()
    recipient = min(1, world - 1)
    torch.manual_seed(rank)
    inputs, target = torch.rand(3, 20), torch.rand(3, 5)
    trunk1, head1 = _mlp([20, 10, 10], seed=5), _mlp([10, 5], seed=6)
    trunk2, head2 = copy.deepcopy(trunk1), copy.deepcopy(head1)
    ddp1, ddp2 = DDP(trunk1), DDP(trunk2)

    def build(ddp, head, lr=0.1, momentum=0.99):
        o = OSS(ddp.parameters(), lr=lr, momentum=momentum)
        o.add_param_group({"params": head.parameters()})
        return o

    def step(ddp, head, o):
        o.zero_grad()
        F.l1_loss(head(ddp(inputs)), target).backward()
        for p in head.parameters():          # the head is outside DDP: average it by hand
            distributed.all_reduce(p.grad)
            p.grad /= world
        o.step()

    def saved(o):
        o.consolidate_state_dict(recipient_rank=recipient)
        return _broadcast_object(o.state_dict() if rank == recipient else {}, recipient)

    def diff():
        return max(max_diff(trunk1, trunk2), max_diff(head1, head2))

    o1, o2 = build(ddp1, head1), build(ddp2, head2)
    step(ddp1, head1, o1)
    step(ddp2, head2, o2)
    sd = saved(o2)
    o2 = build(ddp2, head2, lr=1e6, momentum=1e-4)
    o2.load_state_dict(sd)
    worst = [diff()]
    for _ in range(2):
        step(ddp1, head1, o1)
        step(ddp2, head2, o2)
        worst.append(diff())
    sd = saved(o2)
    groups_ok = all(sd["param_groups"][i][k] == o2.param_groups[i][k]
                    for i in range(2) for k in sd["param_groups"][i] if k != "params")
    o2 = build(ddp2, head2)
    o2.load_state_dict(sd)
    step(ddp1, head1, o1)
    step(ddp2, head2, o2)
    worst.append(diff())
    return max(worst), groups_ok, o2.param_groups[0]["lr"]


def check_cross_load_with_torch(optim_cls):
    """FairScale's test_ddp_parity end: OSS's consolidated state loads into the plain optimizer
    and the plain optimizer's into OSS, and both keep training alike."""
    rank, world = _rank_world()
    recipient = min(1, world - 1)
    hyper = {"momentum": 0.9} if optim_cls is torch.optim.SGD else {}
    base = _mlp([3, 5, 5, 3], seed=7)
    base.register_buffer("test_buffer", torch.ones(1) * rank)
    ref_model, oss_model = copy.deepcopy(base), copy.deepcopy(base)
    ref_opt = optim_cls(_interleaved_groups(ref_model), **hyper)
    opt = OSS(_interleaved_groups(oss_model), optim=optim_cls, **hyper)
    ref_ddp, oss_ddp = DDP(ref_model), DDP(oss_model)
    gen = torch.Generator().manual_seed(rank)
    worst = 0.0

    def check_step():
        nonlocal worst
        x = torch.rand(16, 3, generator=gen)
        losses = []
        for ddp, o in ((ref_ddp, ref_opt), (oss_ddp, opt)):
            def closure(ddp=ddp, o=o):
                o.zero_grad()
                loss = ddp(x).abs().sum()
                loss.backward()
                return loss
            losses.append(float(o.step(closure=closure)))
        worst = max(worst, abs(losses[0] - losses[1]) / max(abs(losses[0]), 1e-6),
                    max_diff(oss_model, ref_model))

    for _ in range(3):
        check_step()
    ref_sd = ref_opt.state_dict()
    opt.consolidate_state_dict(recipient_rank=recipient)
    oss_sd = _broadcast_object(opt.state_dict() if rank == recipient else {}, recipient)
    # torch's load_state_dict keeps the given tensors (no copy): hand each optimizer its own
    ref_opt.load_state_dict(copy.deepcopy(oss_sd))  # mixed up on purpose, as FairScale does
    opt.load_state_dict(copy.deepcopy(ref_sd))
    check_step()
    ref_opt.load_state_dict(copy.deepcopy(ref_sd))  # rewind each to its own saved state
    opt.load_state_dict(copy.deepcopy(oss_sd))
    check_step()
    return worst


def check_save_for_other_worlds():
    """Train 3 steps (Adam, two groups), consolidate on rank 1 (or 0), return the state dict,
    the weights and the plain optimizer's state dict from the same run."""
    rank, world = _rank_world()
    base = _mlp([5, 7, 7, 3], seed=11)
    ref_model, model = copy.deepcopy(base), copy.deepcopy(base)
    ref_opt = torch.optim.Adam(_interleaved_groups(ref_model), lr=1e-2)
    opt = OSS(_interleaved_groups(model), optim=torch.optim.Adam, lr=1e-2)
    for step in range(3):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 5, generator=gen), torch.randn(8, 3, generator=gen)
        for m, o in ((ref_model, ref_opt), (model, opt)):
            o.zero_grad()
            F.mse_loss(m(x), y).backward()
            o.step()
    recipient = min(1, world - 1)
    opt.consolidate_state_dict(recipient_rank=recipient)
    if rank != recipient:
        return None
    return opt.state_dict(), model.state_dict(), ref_opt.state_dict(), max_diff(model, ref_model)


def check_load_from_other_world(saved):
    """A consolidated state dict from another world size loads, and OSS then trains as the
    plain optimizer loaded with the plain optimizer's own state dict does."""
    oss_sd, weights, ref_sd, _ = saved
    model, ref_model = _mlp([5, 7, 7, 3], seed=0), _mlp([5, 7, 7, 3], seed=0)
    model.load_state_dict(weights)
    ref_model.load_state_dict(weights)
    opt = OSS(_interleaved_groups(model), optim=torch.optim.Adam, lr=1.0)
    ref_opt = torch.optim.Adam(_interleaved_groups(ref_model), lr=1.0)
    opt.load_state_dict(copy.deepcopy(oss_sd))
    ref_opt.load_state_dict(copy.deepcopy(ref_sd))
    worst = 0.0
    for step in range(3, 6):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 5, generator=gen), torch.randn(8, 3, generator=gen)
        for m, o in ((ref_model, ref_opt), (model, opt)):
            o.zero_grad()
            F.mse_loss(m(x), y).backward()
            o.step()
        worst = max(worst, max_diff(model, ref_model))
    return worst, [g["lr"] for g in opt.param_groups]


def check_add_param_group_while_training():
    """A head added by add_param_group after two Adam steps (with its own lr) re-partitions
    the model; the moved optimizer state follows its parameters and training matches torch."""
    base = _mlp([4, 6, 5, 2], seed=1)
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    ref_opt = torch.optim.Adam(ref[:2].parameters(), lr=1e-2)
    opt = OSS(model[:2].parameters(), optim=torch.optim.Adam, lr=1e-2)
    worst = 0.0
    for step in range(6):
        if step == 2:
            ref_opt.add_param_group({"params": ref[2].parameters(), "lr": 5e-2})
            opt.add_param_group({"params": model[2].parameters(), "lr": 5e-2})
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step))
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
        worst = max(worst, max_diff(model, ref))
    return worst, [g["lr"] for g in opt.optim.param_groups]


def check_world_group_objects():
    """group=dist.group.WORLD (FairScale's default, often passed explicitly) and a new group of
    every rank behave as group=None."""
    out = []
    for group in (torch.distributed.group.WORLD,
                  torch.distributed.new_group(list(range(_rank_world()[1])))):
        base = _mlp([4, 5, 3], seed=2)
        model, ref = copy.deepcopy(base), copy.deepcopy(base)
        opt = OSS(model.parameters(), lr=0.1, momentum=0.9, group=group)
        ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(0))
        for m, o in ((model, opt), (ref, ref_opt)):
            m(x).sum().backward()
            if o is opt:
                norm = o.clip_grad_norm(0.5)
            else:
                norm = torch.nn.utils.clip_grad_norm_(m.parameters(), 0.5)
            o.step()
        opt.consolidate_state_dict(0)
        out.append((max_diff(model, ref) <= TOL, float(norm) > 0, opt.world_size))
    return out


# ---------------------------------------------------------------------- groups, fp16, frozen


def check_sub_groups():
    """FairScale's test_multiple_groups (world 6, ranks 0, 2, 4) as world 4: one OSS per group
    of even and of odd ranks, each rank its own data; parameters agree inside each group, and
    each group trains (clipped by its own gradients' norm) as one process on its ranks'
    concatenated data would."""
    rank, world = _rank_world()
    evens, odds = list(range(0, world, 2)), list(range(1, world, 2))
    groups = [torch.distributed.new_group(ranks=r) if r else None for r in (evens, odds)]
    mine = evens if rank in evens else odds
    group = groups[0] if rank in evens else groups[1]
    out = {}
    norm_types = (2.0, float("inf"))
    for bucket_kw in ({"broadcast_buffer_size": 2 ** 20}, {"broadcast_buffer_size": 0}):
        base = _mlp([20, 10, 5], seed=8)
        model, oracle = copy.deepcopy(base), copy.deepcopy(base)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", DeprecationWarning)
            opt = OSS(model.parameters(), lr=0.1, momentum=0.99, group=group, **bucket_kw)
        ref_opt = torch.optim.SGD(oracle.parameters(), lr=0.1, momentum=0.99)
        worst, agree = 0.0, True
        for step in range(4):
            data = {r: (torch.rand(3, 20, generator=torch.Generator().manual_seed(r * 50 + step)),
                        torch.rand(3, 5, generator=torch.Generator().manual_seed(r * 70 + step)))
                    for r in mine}

            opt.zero_grad()
            (F.l1_loss(model(data[rank][0]), data[rank][1]) / len(mine)).backward()
            for p in model.parameters():
                distributed.all_reduce(p.grad, group=group)
            # FairScale summed the norm over the whole world; it belongs to the OSS's group
            norm = opt.clip_grad_norm(0.05, norm_type=norm_types[step % 2])
            opt.step()
            ref_opt.zero_grad()
            sum(F.l1_loss(oracle(x), y) for x, y in data.values()).div(len(mine)).backward()
            ref_norm = torch.nn.utils.clip_grad_norm_(oracle.parameters(), 0.05,
                                                      norm_type=norm_types[step % 2])
            ref_opt.step()
            agree &= abs(float(norm) - float(ref_norm)) <= 1e-5 * float(ref_norm)
            agree &= _same_on_every_rank(list(model.parameters()), group=group)
            worst = max(worst, max_diff(model, oracle))
        out[str(bucket_kw)] = (agree, worst, opt.world_size == len(mine),
                               opt.global_rank == rank)
    return out


def check_sub_group_with_idle_ranks():
    """FairScale's exact shape: only some ranks (the even ones) build an OSS on their group;
    the others do nothing but create the group."""
    rank, world = _rank_world()
    evens = list(range(0, world, 2))
    group = torch.distributed.new_group(ranks=evens)
    if rank not in evens:
        return True
    model = _mlp([6, 4, 2], seed=9)
    oracle = copy.deepcopy(model)
    opt = OSS(model.parameters(), lr=0.1, group=group)
    ref = torch.optim.SGD(oracle.parameters(), lr=0.1)
    x = torch.rand(3, 6, generator=torch.Generator().manual_seed(3))
    for m, o in ((model, opt), (oracle, ref)):
        m(x).sum().backward()
        o.step()
    return max_diff(model, oracle) == 0.0


def check_broadcast_fp16_replicas():
    """broadcast_fp16=True, shardkit's documented difference: each owner keeps its parameters
    exact (bit-equal to plain fp32 training), the other ranks hold them rounded to fp16
    (FairScale rounds the owner's copy as well, so its replicas agree but every step is lost
    below fp16's resolution)."""
    rank, _ = _rank_world()
    base = _mlp([6, 8, 3], seed=3)
    model, ref = copy.deepcopy(base), copy.deepcopy(base)
    opt = OSS(model.parameters(), lr=0.1, broadcast_fp16=True)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    x = torch.randn(4, 6, generator=torch.Generator().manual_seed(0))
    for m, o in ((model, opt), (ref, ref_opt)):
        m(x).sum().backward()
        o.step()
    pairs = list(zip(model.parameters(), ref.parameters()))
    owned_exact = all(torch.equal(p, q) for p, q in pairs if opt.param_to_rank[p] == rank)
    others_rounded = all(torch.equal(p, q.half().float()) for p, q in pairs
                         if opt.param_to_rank[p] != rank)
    return owned_exact, others_rounded


def check_broadcast_fp16():
    """broadcast_fp16=True: close to the fp32 reference (the non-owned copies are rounded),
    every rank holds the same values, and the parameters stay fp32."""
    worst, _ = _train_against_torch(torch.optim.SGD, {"lr": 5e-2, "momentum": 0.9},
                                    broadcast_fp16=True)
    model = _mlp([4, 4], seed=1)
    opt = OSS(model.parameters(), lr=0.1, broadcast_fp16=True)
    model(torch.ones(2, 4)).sum().backward()
    opt.step()
    return worst, all(p.dtype == torch.float32 for p in model.parameters())


def check_refresh_trainable():
    """Freeze a layer, refresh_trainable, train; unfreeze, refresh_trainable, train: DDP + OSS
    follows the plain optimizer throughout (FairScale's change_train_graph, with the refresh
    call its comment asks for)."""
    rank, _ = _rank_world()
    base = _mlp([5, 6, 6, 3], seed=12)
    ref_model, model = copy.deepcopy(base), copy.deepcopy(base)
    hyper = {"lr": 1e-2}
    ref_opt = torch.optim.Adam(ref_model.parameters(), **hyper)
    opt = OSS(model.parameters(), optim=torch.optim.Adam, **hyper)
    gen = torch.Generator().manual_seed(rank)
    worst = 0.0
    partitions = []
    for step in range(6):
        if step in (2, 4):
            for m in (ref_model, model):
                m[0].weight.requires_grad_(step == 4)
            opt.refresh_trainable()
            partitions.append(len(opt.param_to_rank))
        x, y = torch.randn(4, 5, generator=gen), torch.randn(4, 3, generator=gen)
        for m, o in ((ref_model, ref_opt), (model, opt)):
            o.zero_grad()
            F.mse_loss(m(x), y).backward()
            for p in m.parameters():
                if p.grad is not None:
                    distributed.all_reduce(p.grad)
            o.step()
        worst = max(worst, max_diff(model, ref_model))
    return worst, partitions


def check_frozen_then_trainable_without_refresh_is_refused():
    """A parameter made trainable without refresh_trainable(): FairScale steps it silently on
    some ranks only; shardkit refuses the step on every rank, naming refresh_trainable."""
    model = _mlp([3, 3], seed=1)
    model[0].weight.requires_grad_(False)
    opt = OSS(model.parameters(), lr=0.1)
    model[0].weight.requires_grad_(True)
    model(torch.ones(1, 3)).sum().backward()
    try:
        opt.step()
    except RuntimeError as error:
        return "refresh_trainable" in str(error)
    return "stepped"


# ---------------------------------------------------------------------- more FairScale
# expectations: positional arguments, optimizer factories, the local shard's state dict


def check_fairscale_positional_arguments():
    """FairScale's OSS(params, optim, group, broadcast_buffer_size, broadcast_fp16,
    force_broadcast_object, **defaults), given by place: broadcast_fp16 (5th) is honoured, the
    ignored 4th and 6th warn; a bool or dtype in the 4th place is broadcast_fp16 (DESIGN.md's
    order: OSS(params, optim, group, broadcast_fp16)); given in both places, a TypeError."""
    model = _mlp([4, 3], seed=1)
    out = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        opt = OSS(model.parameters(), torch.optim.SGD, None, 2 ** 20, True, False, lr=0.1)
    out["fp16"] = opt.broadcast_fp16 is True and opt.bucket_numel is None
    out["warned"] = sorted({str(w.message).split("=")[0] for w in caught
                            if w.category is DeprecationWarning})
    out["lr"] = opt.param_groups[0]["lr"]
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        fourth = OSS(model.parameters(), torch.optim.SGD, None, True, lr=0.1)
        dtype_fourth = OSS(model.parameters(), torch.optim.SGD, None, torch.bfloat16, lr=0.1)
    out["bool_4th"] = (fourth.broadcast_fp16 is True and
                       dtype_fourth.broadcast_fp16 is torch.bfloat16 and
                       not [w for w in caught if w.category is DeprecationWarning])
    try:
        OSS(model.parameters(), torch.optim.SGD, None, True, True, lr=0.1)
        out["twice"] = "accepted"
    except TypeError as error:
        out["twice"] = "broadcast_fp16 given twice" in str(error)
    return out


def _adam_factory(param_groups, **kwargs):
    """FairScale calls ``optim(param_groups, **defaults)``: any callable returning an
    optimizer works there (ClassyVision's ZeRO passes such a factory)."""
    return torch.optim.Adam(param_groups, **kwargs)


def _classy_style_factory(param_groups, *args, **kwargs):
    """ClassyVision's trampoline: ignores OSS's arguments, builds its own configured optimizer."""
    return torch.optim.SGD(param_groups, lr=0.05, momentum=0.9)


def check_optimizer_factories():
    """optim= given as functools.partial of an optimizer class, as a factory function, or as
    ClassyVision's argument-ignoring factory (with group=dist.group.WORLD): each trains as the
    plain optimizer it builds, and its state consolidates and loads back."""
    import functools
    rank, world = _rank_world()
    cases = {
        "partial": (functools.partial(torch.optim.SGD, momentum=0.9), {"lr": 0.05},
                    lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)),
        "factory": (_adam_factory, {"lr": 1e-2}, lambda ps: torch.optim.Adam(ps, lr=1e-2)),
        "classy": (_classy_style_factory, {},
                   lambda ps: torch.optim.SGD(ps, lr=0.05, momentum=0.9)),
    }
    out = {}
    for name, (optim, hyper, plain) in cases.items():
        base = _mlp([5, 6, 3], seed=4)
        model, ref = copy.deepcopy(base), copy.deepcopy(base)
        opt = OSS(model.parameters(), optim=optim, group=torch.distributed.group.WORLD, **hyper)
        ref_opt = plain(ref.parameters())
        worst = 0.0
        for step in range(3):
            x = torch.randn(4, 5, generator=torch.Generator().manual_seed(step))
            for m, o in ((model, opt), (ref, ref_opt)):
                o.zero_grad()
                m(x).pow(2).sum().backward()
                o.step()
            worst = max(worst, max_diff(model, ref))
        sd = opt.state_dict(all_ranks=True)
        opt.load_state_dict(sd)
        out[name] = (worst <= TOL, type(opt.optim).__name__, len(sd["state"]))
    return out


def check_optimizer_factory_errors():
    """What a factory cannot be, refused on every rank before any collective: a partial with
    positional arguments, a factory that returns something other than an optimizer."""
    import functools
    model = _mlp([3, 2], seed=1)
    out = {}
    for name, optim in (("positional", functools.partial(torch.optim.SGD, model.parameters())),
                        ("returns_none", lambda groups, **kw: None)):
        try:
            OSS(model.parameters(), optim=optim, lr=0.1)
            out[name] = "accepted"
        except TypeError as error:
            out[name] = str(error)
    return out


def check_local_shard_state_dict():
    """FairScale's old local_state_dict() (removed there in favour of consolidation) was
    ``optimizer.optim.state_dict()``: the shard's own torch-format state dict, holding the
    state of this rank's parameters only, in local indices."""
    rank, world = _rank_world()
    model = _mlp([5, 6, 6, 3], seed=2)
    opt = OSS(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.ones(2, 5)).sum().backward()
    opt.step()
    local = opt.optim.state_dict()
    owned = [p for g in opt.optim.param_groups for p in g["params"]]
    mine = sum(1 for p in model.parameters() if opt.param_to_rank[p] == rank)
    indices = [i for g in local["param_groups"] for i in g["params"]]
    return (len(local["state"]) == mine == len(owned), indices == list(range(len(owned))),
            all(opt.param_to_rank[p] == rank for p in owned))


class StrictAttributeOSS(OSS):
    """fairseq's FairseqOSS: a subclass whose ``__getattr__`` raises for any unknown name."""

    @property
    def disable_mem_eff_fp16_loading_hack(self):
        return True

    def __getattr__(self, name):
        if name.startswith("supports") and hasattr(self.optim, name):
            return getattr(self.optim, name)
        raise AttributeError(f"'StrictAttributeOSS' object has no attribute {name!r}")


def check_fairseq_style_subclass():
    """fairseq builds ``FairseqOSS(torch_optimizer.param_groups, type(torch_optimizer),
    group=group, **config)``: the subclass trains, clips, consolidates and grows like OSS."""
    base = _mlp([4, 5, 3], seed=1)
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    user = torch.optim.Adam(model.parameters(), lr=0.01)
    opt = StrictAttributeOSS(user.param_groups, type(user), group=None, lr=0.01)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=0.01)
    for step in range(3):
        x = torch.randn(2, 4, generator=torch.Generator().manual_seed(step))
        for m, o in ((ref, ref_opt), (model, opt)):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            if o is opt:
                o.clip_grad_norm(1.0)
            else:
                torch.nn.utils.clip_grad_norm_(m.parameters(), 1.0)
            o.step()
    opt.load_state_dict(opt.state_dict(all_ranks=True))
    opt.add_param_group({"params": [torch.zeros(2, requires_grad=True)]})
    return max_diff(ref, model) <= TOL and opt.disable_mem_eff_fp16_loading_hack


def check_change_train_graph_without_refresh():
    """FairScale's test_ddp_parity(change_train_graph=True): after every step the first
    parameter flips between trainable and frozen, refresh_trainable() never called (its call
    is commented out there). A parameter trainable when OSS was built stays in the partition,
    so a frozen one is simply skipped and DDP + OSS follows DDP + Adam."""
    rank, _ = _rank_world()
    base = _mlp([4, 6, 6, 2], seed=1)
    ref, model = copy.deepcopy(base), copy.deepcopy(base)
    ref_opt = torch.optim.Adam(ref.parameters(), lr=1e-2)
    opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=1e-2)
    ref_ddp = DDP(ref, find_unused_parameters=True)
    ddp = DDP(model, find_unused_parameters=True)
    worst = 0.0
    for step in range(5):
        x = torch.randn(3, 4, generator=torch.Generator().manual_seed(step + 10 * rank))
        for m, o in ((ref_ddp, ref_opt), (ddp, opt)):
            o.zero_grad()
            m(x).pow(2).sum().backward()
            o.step()
        worst = max(worst, max_diff(ref, model))
        for m in (ref, model):
            first = next(m.parameters())
            first.requires_grad_(not first.requires_grad)
    return worst


# ---------------------------------------------------------------------- the tests


@pytest.fixture(params=[1, 2, 4], ids=lambda n: f"world{n}")
def world(request):
    return request.getfixturevalue(f"world{request.param}")


def test_create_with_plain_tensor(world):
    assert all(world.run(check_create_with_plain_tensor))


def test_state_dict_exact_numbers(world):
    results = world.run(check_state_dict_exact_numbers)
    owners = [r for r in results if r["momentum"] is not None]
    assert len(owners) == 1, results
    for r in results:
        assert r["after_step"] == pytest.approx(0.9)
        assert r["keys"] == ["param_groups", "state"]
        assert r["hyper"] == (0.1, 0.9, False, 0.0, 0.0)
        assert r["groups_in_sync"] and r["device"]
        assert r["loaded_lr"] == 0.1
        assert r["second_step"] == pytest.approx(0.71)
    assert owners[0]["momentum"] == pytest.approx(1.0)
    assert owners[0]["loaded_momentum"] == pytest.approx(1.0)
    assert owners[0]["second_momentum"] == pytest.approx(1.9)


def test_lr_scheduler_matches_torch(world):
    for trace in world.run(check_lr_scheduler_matches_torch):
        for x, x2, lr, lr2 in trace:
            assert x == x2 and lr == lr2


def test_step_kwargs_extra_keys_and_no_closure(world):
    for r in world.run(check_step_variants):
        assert r["kwarg"][0] == [5] and r["kwarg"][1] == pytest.approx(0.9)
        assert r["kwarg_buckets"][0] == [5]  # once, however many buckets (2 at world 2)
        assert r["kwarg_buckets"][2] == pytest.approx([0.9] * 4)
        assert r["new_key"][0] == 0.1 and r["new_key"][1] == pytest.approx(0.9)
        assert r["no_closure"] == pytest.approx(0.9)


def test_state_dict_before_consolidation_raises(world):
    assert world.run(check_state_dict_needs_consolidation) == [True] * world.world_size


def test_add_param_group_balance(world):
    for r in world.run(check_add_param_group_balance):
        assert r["all_trainable"] == (1, 2, 2, 24)
        assert r["some_trainable"] == (1, 2, 2)


def test_sharding_balance(world):
    assert world.run(check_sharding_balance) == [24] * world.world_size


def test_partition_views(world):
    assert all(world.run(check_partition_views))


def test_zero_grad(world):
    assert all(world.run(check_zero_grad))


def test_empty_shard(world):
    assert all(d <= TOL for d in world.run(check_empty_shard_steps))


def test_step_exact_numbers(world):
    assert all(world.run(check_step_exact_numbers))


def test_step_with_closure_exact_numbers(world):
    for loss, dw, db in world.run(check_step_with_closure_exact_numbers):
        assert loss == pytest.approx(1.0) and dw == 0.0 and db == 0.0


@pytest.fixture(scope="module")
def parity(request):
    return {n: request.getfixturevalue(f"world{n}").run(check_parity_grid) for n in (1, 2, 4)}


@pytest.mark.parametrize("n", [1, 2, 4])
@pytest.mark.parametrize("name", [
    "adam", "sgd_momentum", "rmsprop", "adam_interleaved_groups",
    "sgd_interleaved_groups_closure", "adam_accumulate_3", "sgd_param_without_grad",
    "adam_param_without_grad", "adam_frozen_layer", "sgd_frozen_layer_interleaved_groups",
    "clip_norm_inf", "clip_norm_1", "clip_norm_1.0", "clip_norm_2",
    "clip_norm_3.0"])
def test_parity_with_ddp_and_torch_optimizer(parity, n, name):
    results = [r[name] for r in parity[n]]  # each rank: its own data, so its own losses
    for params, losses in results:
        assert params <= TOL and losses <= TOL, f"{name} at world {n}: {results}"


def test_clip_grad_norm_every_norm_type(world):
    for r in world.run(check_clip_returns_torch_norm_and_clips_owned):
        assert set(r) == {"1.0", "2.0", "1", "2", "3", "inf"}
        assert all(all(v) for v in r.values()), r


@pytest.mark.parametrize("recipient", [0, 1])
def test_collect_shards(world, recipient):
    assert world.run(check_collect_shards, recipient) == [(True, True, True, True)] * \
        world.world_size


@pytest.mark.parametrize("broadcast_fp16", [False, True])
def test_reproducibility(world, broadcast_fp16):
    assert world.run(check_reproducibility, broadcast_fp16) == [(True, True)] * world.world_size


def test_state_dict_distributed(world):
    for worst, groups_ok, lr in world.run(check_state_dict_distributed):
        assert worst <= TOL and groups_ok and lr == 0.1


@pytest.mark.parametrize("optim_cls", [torch.optim.Adam, torch.optim.SGD],
                         ids=["adam", "sgd"])
def test_cross_load_with_torch(world, optim_cls):
    worst = world.run(check_cross_load_with_torch, optim_cls)
    assert all(w <= TOL for w in worst), worst


def test_sub_groups(world4):
    for r in world4.run(check_sub_groups):
        for agree, worst, size_ok, rank_ok in r.values():
            assert agree and worst <= TOL and size_ok and rank_ok


def test_sub_group_with_idle_ranks(world4):
    assert all(world4.run(check_sub_group_with_idle_ranks))


def test_broadcast_fp16(world):
    for worst, fp32 in world.run(check_broadcast_fp16):
        assert worst <= (TOL if world.world_size == 1 else 5e-3) and fp32


def test_refresh_trainable(world):
    # 6 at the freeze too: the frozen weight still holds its last gradient at that refresh
    # (zero_grad comes after it), and a torch optimizer steps every parameter holding one, so
    # OSS keeps it in the partition until a refresh finds its gradient None on every rank
    for worst, partitions in world.run(check_refresh_trainable):
        assert worst <= TOL and partitions == [6, 6]


def test_trainable_again_without_refresh_is_refused(world):
    assert world.run(check_frozen_then_trainable_without_refresh_is_refused) == \
        [True] * world.world_size


def test_fairscale_positional_arguments(world):
    for r in world.run(check_fairscale_positional_arguments):
        assert r == {"fp16": True, "lr": 0.1, "bool_4th": True, "twice": True,
                     "warned": ["OSS(broadcast_buffer_size", "OSS(force_broadcast_object"]}, r


def test_step_with_closure_as_fairscale_wrote_it(world):
    for loss, weight, bias, owners in world.run(check_step_with_closure_as_fairscale_wrote_it):
        assert loss == pytest.approx(1.0)
        if world.world_size > 1:
            assert owners == [0, 1] and (weight, bias) == (1.1, 2.1)


@pytest.fixture(scope="module")
def saved_by_world(world1, world2, world4):
    out = {}
    for w in (world1, world2, world4):
        found = [r for r in w.run(check_save_for_other_worlds) if r is not None]
        assert len(found) == 1
        assert found[0][3] <= TOL
        out[w.world_size] = found[0]
    return out


@pytest.mark.parametrize("saved_at", [1, 2, 4])
def test_state_dict_moves_between_world_sizes(world, saved_by_world, saved_at):
    for worst, lrs in world.run(check_load_from_other_world, saved_by_world[saved_at]):
        assert worst <= TOL and lrs == [1e-2, 1e-1]


def test_add_param_group_while_training(world):
    for worst, lrs in world.run(check_add_param_group_while_training):
        assert worst <= TOL and lrs == [1e-2, 5e-2]


def test_world_group_objects(world):
    assert world.run(check_world_group_objects) == \
        [[(True, True, world.world_size)] * 2] * world.world_size


def test_broadcast_fp16_owner_exact_others_rounded(world):
    assert world.run(check_broadcast_fp16_replicas) == [(True, True)] * world.world_size


def test_optimizer_factories(world):
    for r in world.run(check_optimizer_factories):
        assert r == {"partial": (True, "SGD", 4), "factory": (True, "Adam", 4),
                     "classy": (True, "SGD", 4)}, r


def test_optimizer_factory_errors(world):
    for r in world.run(check_optimizer_factory_errors):
        assert "positional" in r["positional"] and "OSS(optim=" in r["positional"], r
        assert "returned NoneType" in r["returns_none"], r


def test_local_shard_state_dict(world):
    assert world.run(check_local_shard_state_dict) == [(True, True, True)] * world.world_size


def test_fairseq_style_subclass(world):
    assert all(world.run(check_fairseq_style_subclass))


def test_change_train_graph_without_refresh(world):
    assert all(w <= TOL for w in world.run(check_change_train_graph_without_refresh))
