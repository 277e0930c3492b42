"""FSDP takes the checkpoints the unwrapped model takes.

A module's load pre-hook that renames a checkpoint's old keys (``register_load_state_dict_pre_
hook`` / ``_register_load_state_dict_pre_hook``, as Hugging Face and timm map old names) and an
old-version BatchNorm dict without ``num_batches_tracked`` (``_metadata`` version 1, as
torchvision's old weights) both load into the plain model; FSDP's own key check used to run
before those hooks and refuse them. Checked for the root unit, an inner unit and a plain parent
holding a unit, under FULL, SHARDED and LOCAL state dicts, strict and not: the same missing /
unexpected keys as the plain model, then training parity with the plain model that loaded the
same dict (every rank, several steps). A bad dict still raises on every rank and loads nothing.
One World(2).
"""

from collections import OrderedDict

import pytest
import torch
import torch.nn as nn

from shardkit import distributed as skd
from shardkit.testing import world_fixture

world2 = world_fixture(2, timeout=240)

WHERE = ["root", "inner", "plain parent"]
KINDS = ["FULL_STATE_DICT", "SHARDED_STATE_DICT", "LOCAL_STATE_DICT"]
OLD_NAMES = (("head.", "fc."), ("block.lin.", "block.old_lin."))
STEPS = 2


def _rename(state_dict, prefix: str, old: str, new: str) -> None:
    for key in [k for k in state_dict if k.startswith(prefix + old)]:
        state_dict[prefix + new + key[len(prefix + old):]] = state_dict.pop(key)


class _Block(nn.Module):
    """7 rows over 2 ranks (padded shards); its old checkpoints call ``lin`` ``old_lin``."""

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 7)
        self.bn = nn.BatchNorm1d(7)
        self._register_load_state_dict_pre_hook(
            lambda sd, prefix, *_: _rename(sd, prefix, "old_lin.", "lin."))

    def forward(self, x):
        return self.bn(torch.tanh(self.lin(x)))


class _Trunk(nn.Module):
    """``emb`` (4 -> 5), ``make_block()`` (5 -> 7), ``head`` (7 -> 3), built in that order."""

    def __init__(self, make_block):
        super().__init__()
        self.emb = nn.Linear(4, 5)
        self.block = make_block()
        self.head = nn.Linear(7, 3)

    def forward(self, x):
        return self.head(self.block(self.emb(x)))


class _Net(_Trunk):
    """Its old checkpoints call ``head`` ``fc`` (the public hook, with the module)."""

    def __init__(self):
        super().__init__(_Block)
        self.register_load_state_dict_pre_hook(
            lambda module, sd, prefix, *_: _rename(sd, prefix, "fc.", "head."))


def _as_old(state: dict) -> OrderedDict:
    """``state`` as an old checkpoint: old names, no num_batches_tracked, BatchNorm version 1."""
    old = OrderedDict()
    for key, value in state.items():
        if key.endswith("num_batches_tracked"):
            continue
        for new, before in OLD_NAMES:
            key = key.replace(new, before) if key.startswith(new) else key
        old[key] = value
    old._metadata = OrderedDict((k, dict(v)) for k, v in state._metadata.items())
    old._metadata["block.bn"]["version"] = 1
    return old


def _build(where: str, seed: int):
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    torch.manual_seed(seed)
    net = _Net()
    with torch.no_grad():  # running stats that a load visibly changes
        net.block.bn.running_mean.uniform_(-1, 1)
        net.block.bn.running_var.uniform_(0.5, 2)
    if where == "root":
        return FSDP(net)
    net.block = FSDP(net.block)
    return FSDP(net) if where == "inner" else net


def _state_type(model, kind: str):
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel import StateDictType
    return FSDP.state_dict_type(model, StateDictType[kind])


def _old_dict(where: str, kind: str) -> OrderedDict:
    """An old checkpoint of the model built with seed 7, in ``kind`` (LOCAL: this rank's)."""
    source = _build(where, seed=7)
    with _state_type(source, kind):
        return _as_old(source.state_dict())


def _max_diff(a: dict, b: dict) -> float:
    if list(a) != list(b):
        return float("inf")
    pairs = zip(a.values(), b.values())
    return max((x.double() - y.double()).abs().max().item() for x, y in pairs)


def _full(model) -> dict:
    return {k: v.clone() for k, v in model.state_dict().items()}


def _outside_units(model) -> list:
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    if isinstance(model, FSDP):
        return []
    inside = {id(p) for m in model.modules() if isinstance(m, FSDP) for p in m.parameters()}
    return [p for p in model.parameters() if id(p) not in inside]


def _trains_like_plain(model, plain) -> list:
    """Largest difference of the full state dicts after the load and each SGD step (each rank
    its half of the global batch; BatchNorm on its running stats, as loaded; a plain parent's
    own parameters' gradients averaged over the ranks)."""
    rank, world = skd.get_rank(), skd.get_world_size()
    diffs = [_max_diff(_full(model), plain.state_dict())]
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ref = torch.optim.SGD(plain.parameters(), lr=0.1)
    model.eval()
    plain.eval()
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(4 * world, 4, generator=gen), torch.randn(4 * world, 3, generator=gen)
        opt.zero_grad()
        ref.zero_grad()
        half = slice(4 * rank, 4 * rank + 4)
        nn.functional.mse_loss(model(x[half]), y[half]).backward()
        nn.functional.mse_loss(plain(x), y).backward()
        for p in _outside_units(model):  # a plain parent's own parameters: averaged as DDP
            torch.distributed.all_reduce(p.grad)
            p.grad /= world
        opt.step()
        ref.step()
        diffs.append(_max_diff(_full(model), plain.state_dict()))
    return diffs


def _loads_old_dicts(where: str, kind: str) -> dict:
    out = {}
    for strict in (True, False):
        plain = _Net()
        full_old = _as_old(_build("root", seed=7).state_dict())
        expected = plain.load_state_dict(full_old, strict=strict)
        model = _build(where, seed=0)
        old = _old_dict(where, kind)
        with _state_type(model, kind):
            result = model.load_state_dict(old, strict=strict)
        out[strict] = {"result": (result.missing_keys, result.unexpected_keys),
                       "expected": (expected.missing_keys, expected.unexpected_keys),
                       "num_batches_tracked": int(_full(model)["block.bn.num_batches_tracked"]),
                       "diffs": _trains_like_plain(model, plain)}
    return out


def _refuses_bad_dicts(where: str, kind: str) -> dict:
    """An old dict with a mis-shaped renamed tensor, and (strict) one with an unknown key and a
    missing one, refused after the hooks ran (original names), nothing loaded; with
    strict=False the missing/unexpected keys are the plain model's."""
    out = {}
    good = _old_dict(where, kind)
    bad_shape = OrderedDict(good)
    bad_shape._metadata = good._metadata
    bad_shape["fc.weight"] = torch.zeros(3, 9)
    bad_keys = OrderedDict((k, v) for k, v in good.items() if k != "block.old_lin.bias")
    bad_keys._metadata = good._metadata
    bad_keys["block.old_lin.extra"] = torch.zeros(2)
    for name, bad, strict in (("shape", bad_shape, True), ("keys", bad_keys, True),
                              ("keys non-strict", bad_keys, False)):
        model = _build(where, seed=0)
        before = _full(model)
        try:
            with _state_type(model, kind):
                result = model.load_state_dict(bad, strict=strict)
            out[name] = (sorted(result.missing_keys), sorted(result.unexpected_keys))
        except RuntimeError as error:
            out[name] = str(error)
        out[name + " changed"] = _max_diff(_full(model), before)
    plain = _Net()
    full_bad = _as_old(_build("root", seed=7).state_dict())
    del full_bad["block.old_lin.bias"]
    full_bad["block.old_lin.extra"] = torch.zeros(2)
    expected = plain.load_state_dict(full_bad, strict=False)
    out["plain non-strict"] = (sorted(expected.missing_keys), sorted(expected.unexpected_keys))
    return out


def _bad_on_one_rank(kind: str) -> dict:
    """At the root: the dict is bad on rank 1 only (after its hooks: a mis-shaped tensor, a
    missing key), or a pre-hook raises there: both ranks raise (no rank left waiting), rank 0
    naming rank 1 and the key, neither loads anything. SHARDED and LOCAL loads used to check
    each rank's own dict only: rank 0 loaded, rank 1 did not, and the ranks diverged."""
    model = _build("root", seed=0)
    before = _full(model)
    out = {}
    for case in ("shape", "missing"):
        old = _old_dict("root", kind)
        if skd.get_rank() == 1 and case == "shape":
            old["fc.bias"] = torch.zeros(4)
        elif skd.get_rank() == 1:
            del old["fc.bias"]
        out[case] = _load_error(model, old, kind)
        out[case + " changed"] = _max_diff(_full(model), before)
    old = _old_dict("root", kind)  # a pre-hook raising on rank 1 only
    model.module.block.register_load_state_dict_pre_hook(_refuse_poison)
    if skd.get_rank() == 1:
        old["block.poison"] = torch.zeros(1)
    out["hook"] = _load_error(model, old, kind)
    out["hook changed"] = _max_diff(_full(model), before)
    return out


def _load_error(model, state_dict, kind: str = "FULL_STATE_DICT"):
    """The RuntimeError's text of ``model.load_state_dict(state_dict)`` under ``kind``,
    ``None`` if it loads."""
    try:
        with _state_type(model, kind):
            model.load_state_dict(state_dict)
    except RuntimeError as error:
        return str(error)
    return None


def _refuse_poison(module, state_dict, prefix, *_) -> None:
    if prefix + "poison" in state_dict:
        raise KeyError(f"{prefix}poison: not a checkpoint of this model")


def _run(fn, *args):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn(*args)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", WHERE)
def test_old_checkpoints_load_and_train_like_the_plain_model(world2, where, kind):
    for rank, r in enumerate(world2.run(_run, _loads_old_dicts, where, kind)):
        for strict, mine in r.items():
            assert mine["result"] == mine["expected"] == ([], []), (rank, strict, mine)
            assert mine["num_batches_tracked"] == 0, (rank, strict, mine)  # filled by BatchNorm
            assert max(mine["diffs"]) < 1e-5, (rank, strict, mine["diffs"])


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", WHERE)
def test_bad_old_checkpoints_are_refused_under_the_original_names(world2, where, kind):
    for rank, r in enumerate(world2.run(_run, _refuses_bad_dicts, where, kind)):
        assert isinstance(r["shape"], str) and "size mismatch for head.weight" in r["shape"], r
        assert isinstance(r["keys"], str), r
        assert 'Missing key(s) in state_dict: "block.lin.bias"' in r["keys"], r["keys"]
        assert 'Unexpected key(s) in state_dict: "block.lin.extra"' in r["keys"], r["keys"]
        assert "_fsdp_wrapped_module" not in r["keys"] + r["shape"], r
        assert r["keys non-strict"] == r["plain non-strict"], r
        if where != "plain parent":  # torch's own walk copies what fits: so does a plain parent
            assert r["shape changed"] == r["keys changed"] == 0.0, (rank, r)


@pytest.mark.parametrize("kind", ["FULL_STATE_DICT", "SHARDED_STATE_DICT"])
def test_a_dict_bad_on_one_rank_is_refused_on_every_rank(world2, kind):
    for rank, r in enumerate(world2.run(_run, _bad_on_one_rank, kind)):
        for case, key in (("shape", "size mismatch for head.bias"),
                          ("missing", 'Missing key(s) in state_dict: "head.bias"'),
                          ("hook", "block.poison")):
            assert r[case] is not None and "nothing was loaded" in r[case], (rank, case, r)
            assert key in r[case], (rank, case, r[case])
            assert rank == 1 or "on rank 1: " in r[case], (case, r[case])  # rank 0 names it
            assert r[case + " changed"] == 0.0, (rank, case, r)


# ---------------------------------------------------------------- each hook once per load
# FSDP's loads used to walk the modules' loads twice (a dry run, then the load): a pre-hook
# that upgrades an old checkpoint in place divided twice, and hooks were counted twice.

CALLS: list = []


class _Upgraded(nn.Module):
    """Its version-1 checkpoints hold ``lin.weight`` doubled: a pre-hook halves it in place (as
    some converters do); every pre- and post-hook call is counted in ``CALLS``."""

    _version = 2

    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(5, 7)
        self._register_load_state_dict_pre_hook(self._upgrade)
        self.register_load_state_dict_post_hook(lambda *_: CALLS.append("post"))

    def _upgrade(self, state_dict, prefix, local_metadata, *_):
        CALLS.append("pre")
        if local_metadata.get("version", 2) < 2 and prefix + "lin.weight" in state_dict:
            state_dict[prefix + "lin.weight"].div_(2)

    def forward(self, x):
        return torch.tanh(self.lin(x))


def _HookNet() -> _Trunk:
    """A trunk whose block is :class:`_Upgraded`."""
    return _Trunk(_Upgraded)


def _QNet() -> _Trunk:
    """torch's FakeQuantize in the block: its ``_load_from_state_dict`` resizes scale /
    zero_point."""
    return _Trunk(lambda: nn.Sequential(nn.Linear(5, 7),
                                        torch.ao.quantization.FakeQuantize()))


def _wrap(net, where: str):
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    if where == "root":
        return FSDP(net)
    net.block = FSDP(net.block)
    return FSDP(net) if where == "inner" else net


def _as_version_1(state: dict) -> dict:
    """``state`` as an old checkpoint of :class:`_HookNet`: ``block.lin.weight`` doubled."""
    old = OrderedDict((k, v * 2 if k == "block.lin.weight" else v) for k, v in state.items())
    old._metadata = OrderedDict((k, dict(v)) for k, v in state._metadata.items())
    old._metadata["block"]["version"] = 1
    return old


def _hooks_run_once(where: str, kind: str) -> dict:
    torch.manual_seed(7)
    source = _HookNet()
    full = source.state_dict()
    full_old = _as_version_1(full)  # a new lin.weight: the hook halves it, not ``full``'s
    source = _wrap(source, where)
    with _state_type(source, kind):
        old = _as_version_1(source.state_dict())
    torch.manual_seed(0)
    plain = _HookNet()
    CALLS.clear()
    plain.load_state_dict(full_old)
    expected_calls = list(CALLS)
    torch.manual_seed(0)
    model = _wrap(_HookNet(), where)
    CALLS.clear()
    with _state_type(model, kind):
        model.load_state_dict(old)
    out = {"calls": list(CALLS), "expected calls": expected_calls,
           "diff": _max_diff(_full(model), plain.state_dict())}
    if kind == "FULL_STATE_DICT" and where != "plain parent":  # into the summoned parameters
        torch.manual_seed(0)
        model = _wrap(_HookNet(), where)
        CALLS.clear()
        with model.summon_full_params(writeback=True):
            model.load_state_dict(_as_version_1(full))
        out["summoned calls"] = list(CALLS)
        out["summoned diff"] = _max_diff(_full(model), plain.state_dict())
    # torch's FakeQuantize (resize_ in its load) after a forward: the model takes its own dict
    torch.manual_seed(3)
    source = _wrap(_QNet(), where)
    source(torch.randn(6, 4, generator=torch.Generator().manual_seed(1)))
    with _state_type(source, kind):
        saved = source.state_dict()
    torch.manual_seed(4)
    model = _wrap(_QNet(), where)
    with _state_type(model, kind):
        result = model.load_state_dict(saved)
    out["fake quantize"] = (result.missing_keys, result.unexpected_keys)
    out["fake quantize diff"] = _max_diff(_full(model), _full(source))
    return out


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("where", WHERE)
def test_each_load_hook_runs_once_as_in_torch(world2, where, kind):
    for rank, r in enumerate(world2.run(_run, _hooks_run_once, where, kind)):
        assert r["expected calls"] == ["pre", "post"], r
        assert r["calls"] == r["expected calls"], (rank, r)
        assert r["diff"] < 1e-6, (rank, r)  # the in-place upgrade halved the weight once
        assert r.get("summoned calls", ["pre", "post"]) == ["pre", "post"], (rank, r)
        assert r.get("summoned diff", 0.0) < 1e-6, (rank, r)
        assert r["fake quantize"] == ([], []), (rank, r)
        assert r["fake quantize diff"] == 0.0, (rank, r)


# ---------------------------------------------------------------- torch features inside a load


_SWAP_SEEN: list = []  # the swap setting as _FillsFromCurrent's pre-hook saw it


class _FillsFromCurrent(nn.Module):
    """Its pre-hook keeps the current value of what an older checkpoint lacks: the buffer
    ``stat`` (computed from the module's tensor) and, given ``with_param``, the parameter
    ``scale`` (sharded by FSDP)."""

    def __init__(self, with_param: bool):
        super().__init__()
        self.lin = nn.Linear(5, 7)
        self.scale = nn.Parameter(torch.rand(7))
        self.register_buffer("stat", torch.rand(7))
        self.with_param = with_param
        self._register_load_state_dict_pre_hook(self._keep_current)

    def _keep_current(self, state_dict, prefix, *_):
        _SWAP_SEEN.append(torch.__future__.get_swap_module_params_on_conversion())
        state_dict.setdefault(prefix + "stat", self.stat * 1)
        if self.with_param:
            state_dict.setdefault(prefix + "scale", self.scale.detach().clone())

    def forward(self, x):
        return torch.tanh(self.lin(x)) * self.scale + self.stat


def _torch_features_in_loads() -> dict:
    """For every place and kind: (1) a load with torch.__future__'s
    swap_module_params_on_conversion on (it used to fail: torch swapped FSDP's stand-ins)
    gives the source's weights, leaves the setting on and never turns it off meanwhile (a
    pre-hook, or another thread, used to see it off during the load); (2) a pre-hook
    filling a missing key from the module's current buffer (it used to fail: any read of a
    module's tensor raised) loads what the plain model loads; reading a parameter FSDP
    shards is a clear error naming it, except under LOCAL (the shard is the value) and
    inside summon_full_params."""
    out = {}
    for where in WHERE:
        for kind in KINDS:
            torch.manual_seed(0)
            source = _wrap(_Trunk(lambda: _FillsFromCurrent(False)), where)
            with _state_type(source, kind):
                saved = source.state_dict()
            torch.manual_seed(1)
            model = _wrap(_Trunk(lambda: _FillsFromCurrent(False)), where)
            torch.__future__.set_swap_module_params_on_conversion(True)
            try:
                _SWAP_SEEN.clear()
                with _state_type(model, kind):
                    model.load_state_dict(saved)
                out[where, kind, "swap seen"] = list(set(_SWAP_SEEN))
                out[where, kind, "swap"] = _max_diff(_full(model), _full(source))
                out[where, kind, "swap kept"] = \
                    torch.__future__.get_swap_module_params_on_conversion()
            finally:
                torch.__future__.set_swap_module_params_on_conversion(False)
            for with_param in (False, True):
                torch.manual_seed(2)
                plain = _Trunk(lambda: _FillsFromCurrent(with_param))
                torch.manual_seed(2)
                model = _wrap(_Trunk(lambda: _FillsFromCurrent(with_param)), where)
                dropped = ("block.stat", "block.scale") if with_param else ("block.stat",)
                kept = OrderedDict((k, v) for k, v in saved.items() if k not in dropped)
                kept._metadata = saved._metadata
                plain.load_state_dict({k: v for k, v in _full(source).items()
                                       if k not in dropped})
                try:
                    with _state_type(model, kind):
                        model.load_state_dict(kept)
                    out[where, kind, with_param] = _max_diff(_full(model), plain.state_dict())
                except RuntimeError as error:
                    out[where, kind, with_param] = str(error)
    torch.manual_seed(2)
    model = _wrap(_Trunk(lambda: _FillsFromCurrent(True)), "root")
    with model.summon_full_params(writeback=True):  # the full values: the hook reads them
        model.load_state_dict({k: v for k, v in _full(source).items() if k not in dropped})
    out["summoned"] = _max_diff(_full(model), plain.state_dict())
    return out


def test_loads_take_torch_swap_setting_and_hooks_reading_current_values(world2):
    for rank, r in enumerate(world2.run(_run, _torch_features_in_loads)):
        for where in WHERE:
            for kind in KINDS:
                assert r[where, kind, "swap"] < 1e-7, (rank, where, kind, r)
                assert r[where, kind, "swap kept"] is True, (rank, where, kind)
                assert r[where, kind, "swap seen"] == [True], (rank, where, kind, r)
                assert r[where, kind, False] == 0.0, (rank, where, kind, r)
                mine = r[where, kind, True]
                if kind == "LOCAL_STATE_DICT":
                    assert mine == 0.0, (rank, where, kind, mine)
                else:
                    assert isinstance(mine, str) and "block.scale" in mine \
                        and "summon_full_params" in mine, (rank, where, kind, mine)
        assert r["summoned"] == 0.0, (rank, r)


def _local_reload_on_one_rank_and_shape_reads() -> dict:
    """A LOCAL load on rank 0 alone (FairScale / torch FSDP1: local) loads there and leaves the
    next collective alone; a pre-hook filling a missing key with ``zeros_like`` of a sharded
    parameter loads what the plain model loads; a pre-hook's exception is the cause of the
    agreed error on its rank."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    out = {}
    model = _build("root", seed=0)
    saved = {k: v.clone() for k, v in model.local_state_dict().items()}
    with torch.no_grad():
        for p in model.parameters():
            p.add_(1.0)
    if skd.get_rank() == 0:
        model.load_local_state_dict(saved)
    flag = torch.ones(1)
    skd.all_reduce(flag)
    out["flag"] = flag.item()
    mine = {k: v for k, v in model.local_state_dict().items() if torch.is_tensor(v)}
    out["local diff"] = max((mine[k] - saved[k]).abs().max().item() for k in mine)

    def fill(module, sd, prefix, *_):
        sd.setdefault(prefix + "bias", torch.zeros_like(module.bias))

    def build(wrap):
        torch.manual_seed(0)
        m = nn.Sequential(nn.Linear(4, 7), nn.Linear(7, 3))
        m[0].register_load_state_dict_pre_hook(fill)
        return FSDP(nn.Sequential(FSDP(m[0]), m[1])) if wrap else m
    sd = build(False).state_dict()
    sd.pop("0.bias")
    plain, wrapped = build(False), build(True)
    plain.load_state_dict(sd)
    wrapped.load_state_dict(sd)
    out["zeros_like"] = _max_diff(_full(wrapped), plain.state_dict())
    model = _build("root", seed=0)
    model.module.block.register_load_state_dict_pre_hook(_refuse_poison)
    old = _old_dict("root", "FULL_STATE_DICT")
    old["block.poison"] = torch.zeros(1)
    try:
        model.load_state_dict(old)
    except RuntimeError as error:
        out["cause"] = type(error.__cause__).__name__
    return out


def test_local_load_on_one_rank_and_shape_reads_in_pre_hooks(world2):
    for rank, r in enumerate(world2.run(_run, _local_reload_on_one_rank_and_shape_reads)):
        assert r["flag"] == 2.0, (rank, r)
        assert r["local diff"] == (0.0 if rank == 0 else r["local diff"]) and \
            (rank == 0 or r["local diff"] > 0.5), (rank, r)
        assert r["zeros_like"] == 0.0, (rank, r)
        assert r["cause"] == "KeyError", (rank, r)
