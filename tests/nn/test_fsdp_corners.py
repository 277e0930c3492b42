"""FSDP corner cases a user of torch DDP / FSDP relies on, each against one process (fp32, step
by step, every rank): tensor hooks on parameters (``p.register_hook``, e.g. a pruning mask on
the gradient); a unit whose output is an object FSDP cannot look into (a
``torch.distributions.Normal`` from an actor network); indexing a wrapped ``nn.Sequential``
(FairScale's and torch FSDP1's ``__getitem__``); a parent reading a unit's parameters in its
forward (a tied output projection, a ``cls_token``); a unit run both plainly and inside a
reentrant activation checkpoint."""

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as skdist
from shardkit.nn.data_parallel.flat_param import gathered_param_bytes
from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP
from shardkit.testing import world_fixture
from tests.utils.compare import max_diff

world2 = world_fixture(2)


def _local(t: torch.Tensor) -> torch.Tensor:
    n, r = skdist.get_world_size(), skdist.get_rank()
    per = t.shape[0] // n
    return t[r * per:(r + 1) * per]


def _batch(step: int, n: int = 8, width: int = 6):
    gen = torch.Generator().manual_seed(100 + step)
    return torch.randn(n, width, generator=gen), torch.randn(n, width, generator=gen)


def _full_diff(model, oracle) -> float:
    full = model.state_dict()
    return max(max_diff(full[k], v) for k, v in oracle.state_dict().items())


class _SharedBlock(nn.Module):
    """An input layer, a block applied twice (one unit used twice per backward), a head."""

    def __init__(self):
        super().__init__()
        self.inp = nn.Linear(6, 6)
        self.block = nn.Linear(6, 6)
        self.head = nn.Linear(6, 6)

    def forward(self, x):
        h = self.inp(x)
        for _ in range(2):
            h = torch.tanh(self.block(h))
        return self.head(h)


def _tensor_hooks_on_parameters(when: str):
    torch.manual_seed(0)
    oracle = _SharedBlock()
    source = copy.deepcopy(oracle)
    mask = (torch.arange(36).view(6, 6) % 3 != 0).float()  # a pruning mask, rows differ
    calls = {"oracle": [], "fsdp": []}

    def hook_on(model, who):
        def masked(grad):
            calls[who].append(tuple(grad.shape))
            return grad * mask
        model.block.weight.register_hook(masked)
        model.head.bias.register_hook(lambda g: calls[who].append(tuple(g.shape)))  # logs only

    hook_on(oracle, "oracle")
    if when == "before":
        hook_on(source, "fsdp")
    source.block = FSDP(source.block)
    model = FSDP(source)
    if when == "after":
        hook_on(model.module, "fsdp")
    o_opt = torch.optim.SGD(oracle.parameters(), lr=0.1, momentum=0.9)
    m_opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    diffs = []
    for step in range(3):
        x, y = _batch(step)
        F.mse_loss(oracle(x), y).backward()
        o_opt.step()
        o_opt.zero_grad()
        # two micro-batches, the first inside no_sync: hooks run once per backward
        for i, (xs, ys) in enumerate(zip(_local(x).chunk(2), _local(y).chunk(2))):
            ctx = model.no_sync() if i == 0 else torch.enable_grad()
            with ctx:
                (F.mse_loss(model(xs), ys) / 2).backward()
        m_opt.step()
        m_opt.zero_grad()
        diffs.append(_full_diff(model, oracle))
    # a hook returning another shape is refused, as autograd refuses it
    calls["fsdp"], trained = [], calls["fsdp"]
    model.module.block.module.weight.register_hook(lambda g: g.sum())
    x, y = _batch(0)
    try:
        F.mse_loss(model(_local(x)), _local(y)).backward()
        calls["bad_hook"] = "no error"
    except RuntimeError as error:
        calls["bad_hook"] = str(error)
    model.zero_grad()
    calls["fsdp"] = trained
    return diffs, calls


def test_tensor_hooks_on_parameters_run_like_ddp(world2):
    """Regression: hooks registered with ``p.register_hook`` on a sharded parameter were
    never called (the module computes with views of the gathered buffer), so a gradient mask
    was silently dropped and training diverged from one process."""
    for when in ("before", "after"):
        for diffs, calls in world2.run(_tensor_hooks_on_parameters, when):
            assert max(diffs) < 1e-6, (when, diffs)
            # once per backward with the full-shape gradient: 1 backward per step in one
            # process, 2 (micro-batches) under FSDP
            assert calls["oracle"] == [(6,), (6, 6)] * 3, calls
            assert sorted(calls["fsdp"]) == sorted([(6,), (6, 6)] * 6), (when, calls)
            assert "has changed the size of value" in calls["bad_hook"], calls["bad_hook"]


class _Actor(nn.Module):
    """A trunk, then a policy head unit returning a ``torch.distributions.Normal``."""

    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.mu = nn.Linear(6, 6)
            self.log_std = nn.Parameter(torch.full((6,), -0.5))

        def forward(self, h):
            return torch.distributions.Normal(self.mu(h), self.log_std.exp())

    def __init__(self):
        super().__init__()
        self.trunk = nn.Linear(6, 6)  # needs the head's weights for its input gradient
        self.head = _Actor.Head()

    def forward(self, x):
        return self.head(torch.tanh(self.trunk(x)))


def _unit_returning_a_distribution(reshard: bool):
    torch.manual_seed(0)
    oracle = _Actor()
    source = copy.deepcopy(oracle)
    source.head = FSDP(source.head, reshard_after_forward=reshard)
    model = FSDP(source)
    o_opt = torch.optim.Adam(oracle.parameters(), lr=0.01)
    m_opt = torch.optim.Adam(model.parameters(), lr=0.01)
    diffs, left_gathered = [], []
    for step in range(3):
        x, action = _batch(step)
        (-oracle(x).log_prob(action).mean()).backward()
        o_opt.step()
        o_opt.zero_grad()
        (-model(_local(x)).log_prob(_local(action)).mean()).backward()
        left_gathered.append(gathered_param_bytes().live)
        m_opt.step()
        m_opt.zero_grad()
        diffs.append(_full_diff(model, oracle))
    with torch.no_grad():  # a rollout: nothing kept for a backward
        model(_local(x))
    return diffs, left_gathered


def test_a_unit_returning_a_distribution_trains(world2):
    """Regression: an inner unit whose forward returned a ``torch.distributions`` object freed
    its parameters after forward without a pre-backward hook (no tensor it could see), so the
    backward through its weights failed ("setStorage: ... out of bounds for storage of size
    0")."""
    for reshard in (True, False):
        for diffs, left_gathered in world2.run(_unit_returning_a_distribution, reshard):
            assert max(diffs) < 1e-6, (reshard, diffs)
            assert left_gathered == [0, 0, 0], left_gathered  # backward freed every unit


def _indexing_a_wrapped_sequential():
    inner = FSDP(nn.Linear(6, 6))
    model = FSDP(nn.Sequential(inner, nn.ReLU(), nn.Linear(6, 6)))
    out = {"first": model[0] is inner, "last": isinstance(model[-1], nn.Linear),
           "slice": isinstance(model[1:], nn.Sequential) and len(model[1:]) == 2,
           "children": [type(c).__name__ for c in model]}
    try:
        FSDP(nn.Linear(6, 6))[0]
    except TypeError as error:
        out["not_subscriptable"] = str(error)
    return out


def test_indexing_a_wrapped_sequential_reaches_its_layers(world2):
    """Regression: ``FSDP(nn.Sequential(...))[0]`` (FairScale's and torch FSDP1's
    ``__getitem__``, e.g. ``model[-1]`` for the head) raised "'FullyShardedDataParallel'
    object is not subscriptable"."""
    for r in world2.run(_indexing_a_wrapped_sequential):
        assert r["first"] and r["last"] and r["slice"], r
        assert r["children"] == ["FullyShardedDataParallel", "ReLU", "Linear"], r
        assert "Linear is not subscriptable" in r["not_subscriptable"], r


def _torch_fsdp1_tree_names():
    inner = FSDP(nn.Linear(6, 6))
    model = nn.Sequential(FSDP(nn.Sequential(inner, nn.ReLU())), FSDP(nn.Linear(6, 6)))
    roots = FSDP.fsdp_modules(model, root_only=True)
    return {"all": len(FSDP.fsdp_modules(model)),
            "roots": [r is model[i] for i, r in enumerate(roots)],
            "is_root": [model[0].check_is_root(), inner.check_is_root(),
                        model[1].check_is_root()]}


def test_torch_fsdp1_fsdp_modules_and_check_is_root(world2):
    """torch FSDP1's ``FSDP.fsdp_modules(module, root_only=)`` and ``check_is_root()`` (they
    were AttributeErrors)."""
    for r in world2.run(_torch_fsdp1_tree_names):
        assert r == {"all": 3, "roots": [True, True], "is_root": [True, False, True]}, r


def _hook_registered_between_forward_and_backward():
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(FSDP(nn.Linear(6, 6)), nn.Tanh(), nn.Linear(6, 6)))
    x, y = _batch(0)
    out = model(_local(x))
    model.module[0].module.weight.register_hook(lambda g: g * 2)  # after the forward
    try:
        F.mse_loss(out, _local(y)).backward()
        return "no error"
    except RuntimeError as error:
        return str(error)


def test_a_hook_registered_after_the_forward_is_refused_clearly(world2):
    """Autograd calls a hook registered after the forward with ``None`` at the sharded
    parameter's empty accumulation (a mask hook failed with "unsupported operand type(s) for
    *: 'NoneType'"): refused, naming what to do."""
    for message in world2.run(_hook_registered_between_forward_and_backward):
        assert "before the forward" in message, message


def _distribution_head_reshards(alias: bool):
    class Head(nn.Module):
        def __init__(self):
            super().__init__()
            self.mu = nn.Linear(6, 6)
            self.std = nn.Parameter(torch.full((6,), 0.7))

        def forward(self, h):
            scale = self.std if alias else self.std * 1.0
            return torch.distributions.Normal(self.mu(h), scale)

    torch.manual_seed(0)
    model = FSDP(nn.Sequential(nn.Linear(6, 6), FSDP(Head())))
    head = model.module[1]._shard
    x, action = _batch(0)
    dist = model(_local(x))
    kept = head.gathered
    (-dist.log_prob(_local(action)).mean()).backward()
    return kept, head.gathered


def test_a_distribution_head_reshards_after_forward_unless_it_holds_its_weights(world2):
    """Tensors inside an object of the output (a ``Normal``'s ``loc``/``scale``) get the
    pre-backward gather, so the unit reshards after forward as usual; only a view of the
    gathered weights inside it keeps the unit gathered until backward."""
    for alias in (False, True):
        for kept, left in world2.run(_distribution_head_reshards, alias):
            assert kept == alias and not left, (alias, kept, left)


def _iterating_a_wrapped_module_dict():
    model = FSDP(nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.Linear(2, 2)}))
    return list(model), "a" in model


def test_iterating_a_wrapped_module_dict(world2):
    for keys, found in world2.run(_iterating_a_wrapped_module_dict):
        assert keys == ["a", "b"] and found


def _nonlinear_hooks_against_ddp(inplace: bool):
    from torch.nn.parallel import DistributedDataParallel as DDP
    torch.manual_seed(0)
    base = _SharedBlock()
    d_src, f_src = copy.deepcopy(base), copy.deepcopy(base)

    def clip(grad):  # nonlinear: tells the local gradient from the reduced one
        if inplace:
            grad.clamp_(-0.02, 0.02)
            return None
        return grad.clamp(-0.02, 0.02)

    for m in (d_src, f_src):
        m.block.weight.register_hook(clip)
        m.inp.weight.register_hook(clip)
    ddp = DDP(d_src)
    f_src.block = FSDP(f_src.block)
    fsdp = FSDP(f_src)
    opts = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (ddp, fsdp)]
    diffs = []
    for step in range(3):
        x, y = _batch(step)
        for model, opt in zip((ddp, fsdp), opts):
            for i, (xs, ys) in enumerate(zip(_local(x).chunk(2), _local(y).chunk(2))):
                with model.no_sync() if i == 0 else torch.enable_grad():
                    (F.mse_loss(model(xs), ys) / 2).backward()
            opt.step()
            opt.zero_grad()
        diffs.append(_full_diff(fsdp, ddp.module))
    return diffs


def test_nonlinear_tensor_hooks_see_the_local_gradient_as_under_ddp(world2):
    for inplace in (False, True):
        for diffs in world2.run(_nonlinear_hooks_against_ddp, inplace):
            assert max(diffs) < 1e-6, (inplace, diffs)


class _ReadsItsUnit(nn.Module):
    """A parent whose forward reads an inner unit's parameters without calling it: a one-row
    ``cls`` parameter added to every position, and the unit's weight as a tied output
    projection (GPT's ``F.linear(h, self.wte.weight)``)."""

    class Embed(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(6, 6)
            self.cls = nn.Parameter(torch.randn(1, 6))

        def forward(self, x):
            return self.proj(x)

    def __init__(self, checkpointed: bool = False):
        super().__init__()
        self.embed = _ReadsItsUnit.Embed()
        self.mid = nn.Linear(6, 6)
        self.checkpointed = checkpointed  # the cls read inside a reentrant checkpoint

    def add_cls(self, h):
        return h + self.embed.cls

    def forward(self, x):
        with torch.no_grad():  # a read without gradients first (a logged norm)
            self.cls_norm = self.embed.cls.norm()
        h = self.embed(x + self.embed.cls)  # read with gradients before the unit runs
        if self.checkpointed:
            h = torch.utils.checkpoint.checkpoint(self.add_cls, h, use_reentrant=True)
        else:
            h = self.add_cls(h)
        return F.linear(torch.tanh(self.mid(h)), self.embed.proj.weight)


def _parent_reading_a_unit(reshard: bool, checkpointed: bool):
    torch.manual_seed(0)
    oracle = _ReadsItsUnit()
    source = _ReadsItsUnit(checkpointed)
    source.load_state_dict(oracle.state_dict())
    source.embed = FSDP(source.embed, reshard_after_forward=reshard)
    model = FSDP(source)
    o_opt = torch.optim.SGD(oracle.parameters(), lr=0.1, momentum=0.9)
    m_opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    diffs = []
    for step in range(3):
        x, y = _batch(step)
        F.mse_loss(oracle(x), y).backward()
        o_opt.step()
        o_opt.zero_grad()
        try:
            F.mse_loss(model(_local(x)), _local(y)).backward()
        except RuntimeError as error:  # before: a shape error (this rank's rows of the weight)
            return [str(error)], None, None
        m_opt.step()
        m_opt.zero_grad()
        # the no_grad read (a logged norm) saw the whole one-row parameter too
        diffs.append(max(_full_diff(model, oracle),
                         abs(source.cls_norm.item() - oracle.cls_norm.item())))
    left_after_backward = [u._shard.gathered for u in model.sharded_units()]
    x, _ = _batch(9)
    with torch.no_grad():
        evaluated = max_diff(model(_local(x)), oracle(_local(x)))
    left_after_backward += [u._shard.gathered for u in model.sharded_units()]
    model.reshard()
    return diffs, evaluated, left_after_backward


def test_a_parent_reading_a_units_parameters_gets_the_whole_parameters(world2):
    """Regression: a parent's forward reading an inner unit's parameters without calling the
    unit (``self.embed.cls``, ``F.linear(h, self.embed.proj.weight)``) read this rank's row
    block: a shape error for the weight, and for the one-row ``cls`` the right shape with
    zero padding on rank 1, silently (also when read again by a reentrant checkpoint's
    recomputation in backward). The unit is now gathered for the read."""
    for reshard, checkpointed in ((True, False), (False, False), (True, True)):
        for diffs, evaluated, left in world2.run(_parent_reading_a_unit, reshard, checkpointed):
            assert not isinstance(diffs[0], str) and max(diffs) < 1e-6, (reshard, diffs)
            assert evaluated < 1e-6, evaluated
            # backward freed what the read gathered, and so did the end of the no_grad forward
            assert left == [False] * 4, left


class _PlainAndCheckpointed(nn.Module):
    """A unit run plainly and, in the same forward, inside a reentrant activation checkpoint
    (a block shared by two layers, one of them checkpointed), in either order."""

    def __init__(self, order: str):
        super().__init__()
        self.inp = nn.Linear(6, 6)
        self.block = nn.Linear(6, 6)
        self.order = order

    def forward(self, x, checkpointed: bool = True):
        def again(h):
            if not checkpointed:
                return self.block(h)
            return torch.utils.checkpoint.checkpoint(self.block, h, use_reentrant=True)
        h = self.inp(x)
        if self.order == "plain first":
            return again(torch.tanh(self.block(h)))
        return self.block(torch.tanh(again(h)))


def _plain_and_checkpointed(order: str):
    torch.manual_seed(0)
    oracle = _PlainAndCheckpointed(order)
    source = copy.deepcopy(oracle)
    source.block = FSDP(source.block)
    model = FSDP(source)
    o_opt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    m_opt = torch.optim.SGD(model.parameters(), lr=0.1)
    diffs = []
    for step in range(3):
        x, y = _batch(step)
        F.mse_loss(oracle(x, checkpointed=False), y).backward()
        o_opt.step()
        o_opt.zero_grad()
        try:
            F.mse_loss(model(_local(x)), _local(y)).backward()
        except RuntimeError as error:
            return [str(error)]
        m_opt.step()
        m_opt.zero_grad()
        diffs.append(_full_diff(model, oracle))
    return diffs


def test_a_unit_run_plainly_and_in_a_reentrant_checkpoint(world2):
    """Regression: the checkpoint's backward (a graph task of its own) gathered, reduced and
    freed the unit and marked its pre-backward done, so the plain use's backward found its
    weights freed ("setStorage: ... out of bounds for storage of size 0")."""
    for order in ("plain first", "checkpointed first"):
        for diffs in world2.run(_plain_and_checkpointed, order):
            assert not isinstance(diffs[0], str) and max(diffs) < 1e-6, (order, diffs)
