"""An FSDP unit held by a plain module: the parent's ``state_dict()`` / ``load_state_dict()``.

torch FSDP1 (on CPU with ``device_id=torch.device("cpu")``) is the oracle: the same model
wrapped the same way under both libraries, compared key by key (order, shapes, values, types)
at several nestings: a plain root over one unit, over two sibling units, torch's
``checkpoint_wrapper`` around a unit, a unit with auto-wrapped inner units. The unit holds a
BatchNorm (buffers), a tied embedding/head pair and rows that do not divide 2 (padded shards);
the parent has a parameter and a buffer of its own. Also: ``keep_vars=True``; ``rank0_only`` and
``offload_to_cpu``; ``LOCAL_STATE_DICT`` and ``SHARDED_STATE_DICT`` set on the plain root; load
round trips and torch's strict-load errors. One World(2).
"""

import functools

import pytest
import torch
import torch.nn as nn

from shardkit import distributed as skd
from shardkit.distributed import CommCounter
from shardkit.nn.data_parallel import FullStateDictConfig, StateDictType
from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
from shardkit.testing import world_fixture

world2 = world_fixture(2, timeout=240)

ARRANGEMENTS = ["one unit", "two sibling units", "checkpoint_wrapper(unit)", "auto-wrapped"]
UNITS = {"one unit": 1, "two sibling units": 2, "checkpoint_wrapper(unit)": 1, "auto-wrapped": 3}


class _Body(nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(7, 5)
        self.lin = nn.Linear(5, 5)
        self.bn = nn.BatchNorm1d(5)
        self.head = nn.Linear(5, 7, bias=False)
        self.head.weight = self.emb.weight  # tied

    def forward(self, idx):
        return self.head(torch.tanh(self.bn(self.lin(self.emb(idx)))))


def _inner_unit(module: nn.Module) -> bool:
    """lin and bn: not head, whose weight is emb's (torch FSDP1 trains a parameter shared
    across units wrongly)."""
    return isinstance(module, nn.BatchNorm1d) or \
        (isinstance(module, nn.Linear) and module.bias is not None)


class _Root(nn.Module):
    def __init__(self, siblings: bool):
        super().__init__()
        self.body = _Body()
        self.mid = nn.Linear(7, 7) if siblings else None
        self.out = nn.Linear(7, 3)
        self.register_buffer("scale", torch.linspace(0.5, 1.5, 3))

    def forward(self, idx):
        h = self.body(idx)
        return self.out(h if self.mid is None else torch.relu(self.mid(h))) * self.scale


def _wrap(lib: str, module: nn.Module, **kwargs) -> nn.Module:
    if lib == "torch":
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
        return TorchFSDP(module, device_id=torch.device("cpu"), **kwargs)
    return FSDP(module, **kwargs)


def _build(lib: str, arrangement: str, seed: int = 0) -> tuple:
    """(the model with its units, the same model unwrapped)."""
    torch.manual_seed(seed)
    root = _Root(siblings=arrangement == "two sibling units")
    reference = _Root(siblings=arrangement == "two sibling units")
    reference.load_state_dict(root.state_dict())
    if arrangement == "auto-wrapped":  # inner units for lin and bn (head's weight is tied)
        from torch.distributed.fsdp.wrap import lambda_auto_wrap_policy
        policy = functools.partial(lambda_auto_wrap_policy, lambda_fn=_inner_unit)
        root.body = _wrap(lib, root.body, auto_wrap_policy=policy)
    else:
        root.body = _wrap(lib, root.body)
    if arrangement == "two sibling units":
        root.mid = _wrap(lib, root.mid)
    if arrangement == "checkpoint_wrapper(unit)":
        from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
        root.body = checkpoint_wrapper(root.body)
    return root, reference


def _sd_type(lib: str, model, kind: str, config=None):
    if lib == "torch":
        from torch.distributed.fsdp import FullStateDictConfig as TorchConfig
        from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
        from torch.distributed.fsdp import StateDictType as TorchType
        torch_config = None if config is None else TorchConfig(**config)
        return TorchFSDP.state_dict_type(model, TorchType[kind], torch_config)
    return FSDP.state_dict_type(model, StateDictType[kind],
                                None if config is None else FullStateDictConfig(**config))


def _train(model, steps: int = 2) -> None:
    rank = skd.get_rank()
    optim = torch.optim.SGD(model.parameters(), lr=0.2)
    for step in range(steps):
        idx = torch.randint(0, 7, (8,), generator=torch.Generator().manual_seed(step))
        optim.zero_grad()
        model(idx[4 * rank:4 * rank + 4]).square().mean().backward()
        optim.step()


def _described(state: dict) -> list:
    return [(k, type(v).__name__, tuple(v.shape), v.requires_grad) for k, v in state.items()]


def _max_diff(a: dict, b: dict) -> float:
    if list(a) != list(b):
        return float("inf")
    return max(((x.float() - y.float()).abs().max().item() if x.shape == y.shape
                else float("inf")) for x, y in zip(a.values(), b.values()))


def _with_silenced_torch_warnings(fn):
    import warnings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fn()


def _state_dicts(arrangement: str) -> dict:
    """Full (default, keep_vars, after training, rank0_only, offload) under both libraries."""
    out = {}
    for lib in ("torch", "shardkit"):
        model, reference = _build(lib, arrangement)
        first = model.state_dict()
        units = [m for m in model.modules() if type(m).__name__ == "FullyShardedDataParallel"]
        with CommCounter() as counter:
            model.state_dict()
        mine = {"keys": list(first), "at init": _max_diff(first, reference.state_dict()),
                "units": len(units), "calls": dict(counter.calls_by_op),
                "keep_vars": _described(model.state_dict(keep_vars=True))}
        _train(model)
        mine["trained"] = {k: v.clone() for k, v in model.state_dict().items()}
        with _sd_type(lib, model, "FULL_STATE_DICT", {"rank0_only": True}):
            mine["rank0_only"] = _described(model.state_dict())
        if lib == "shardkit":  # torch FSDP1's offload_to_cpu fails on a CPU model
            offload = {"offload_to_cpu": True, "rank0_only": False}
            with _sd_type(lib, model, "FULL_STATE_DICT", offload):
                offloaded = model.state_dict()
            mine["offload"] = (_max_diff(offloaded, mine["trained"]),
                               {v.device.type for v in offloaded.values()})
        out[lib] = mine
    t, s = out["torch"], out["shardkit"]
    return {"keys": (t["keys"], s["keys"]), "at init": (t["at init"], s["at init"]),
            "keep_vars": (t["keep_vars"], s["keep_vars"]),
            "trained": _max_diff(t["trained"], s["trained"]),
            "rank0_only": (t["rank0_only"], s["rank0_only"]), "offload": s["offload"],
            "units": (t["units"], s["units"]), "calls": s["calls"]}


def _loads(arrangement: str) -> dict:
    """The parent's load_state_dict: a full dict of another unwrapped model, then strict and
    non-strict loads of a dict with a missing, an unexpected and a mis-shaped key."""
    _, other = _build("torch", arrangement, seed=5)
    full = other.state_dict()
    bad = dict(full)
    del bad["body.lin.bias"]
    bad["body.extra"] = torch.zeros(2)
    bad["body.lin.weight"] = torch.zeros(4, 5)
    out = {}
    for lib in ("torch", "shardkit"):
        model, _ = _build(lib, arrangement)
        with CommCounter() as counter:
            mine = {"result": str(model.load_state_dict(full))}
        mine["calls"] = counter.calls
        mine["loaded"] = _max_diff(model.state_dict(), full)
        try:
            model.load_state_dict(bad)
            mine["strict"] = None
        except RuntimeError as error:
            mine["strict"] = str(error)
        model, _ = _build(lib, arrangement)
        before = {k: v.clone() for k, v in model.state_dict().items()}
        try:
            mine["non-strict"] = model.load_state_dict(bad, strict=False)
            mine["non-strict"] = (sorted(mine["non-strict"].missing_keys),
                                  sorted(mine["non-strict"].unexpected_keys))
        except RuntimeError as error:  # the size mismatch: torch raises with strict=False too
            mine["non-strict"] = str(error)
        after = model.state_dict()
        mine["kept"] = (after["body.lin.weight"].equal(before["body.lin.weight"]),
                        after["body.lin.bias"].equal(before["body.lin.bias"]))
        out[lib] = mine
    return out


def _other_types(arrangement: str) -> dict:
    """LOCAL_STATE_DICT and SHARDED_STATE_DICT set on the plain root."""
    out = {}
    model, _ = _build("shardkit", arrangement)
    _train(model)
    full = model.state_dict()
    units = [m for m in model.modules() if isinstance(m, FSDP) and m._outermost() is m]
    local = {}
    for unit in units:
        prefix = next(n for n, m in model.named_modules() if m is unit)
        prefix = prefix.replace("._checkpoint_wrapped_module", "")
        local.update({f"{prefix}.{k}": v for k, v in unit.local_state_dict().items()})
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT), \
            CommCounter() as counter:
        mine = model.state_dict()
    out["local calls"] = counter.calls
    out["local"] = (list(mine) == list(full),
                    all(mine[k].equal(v) for k, v in local.items()),
                    all(k in local or mine[k].equal(full[k]) for k in mine))
    fresh, _ = _build("shardkit", arrangement, seed=5)
    with FSDP.state_dict_type(fresh, StateDictType.LOCAL_STATE_DICT):
        out["local load"] = str(fresh.load_state_dict(mine))
    out["local round trip"] = _max_diff(fresh.state_dict(), full)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT), \
            CommCounter() as counter:
        sharded = model.state_dict()
    out["sharded calls"] = counter.calls
    torch_model, _ = _build("torch", arrangement)
    with _sd_type("torch", torch_model, "SHARDED_STATE_DICT"):
        torch_sharded = torch_model.state_dict()
    out["sharded keys"] = (list(torch_sharded), list(sharded))
    out["sharded shapes"] = ([tuple(v.shape) for v in torch_sharded.values()],
                             [tuple(v.shape) for v in sharded.values()])
    out["sharded values"] = _max_diff({k: v.full_tensor() if hasattr(v, "full_tensor") else v
                                       for k, v in sharded.items()}, full)
    fresh, _ = _build("shardkit", arrangement, seed=5)
    with FSDP.state_dict_type(fresh, StateDictType.SHARDED_STATE_DICT):
        out["sharded load"] = str(fresh.load_state_dict(sharded))
    out["sharded round trip"] = _max_diff(fresh.state_dict(), full)
    return out


def _run(fn, arrangement):
    return _with_silenced_torch_warnings(lambda: fn(arrangement))


@pytest.mark.parametrize("arrangement", ARRANGEMENTS)
def test_full_state_dict_from_a_plain_parent_matches_torch_fsdp1(world2, arrangement):
    for rank, r in enumerate(world2.run(_run, _state_dicts, arrangement)):
        torch_keys, keys = r["keys"]
        assert keys == torch_keys, r["keys"]
        assert r["units"][1] == r["units"][0] == UNITS[arrangement], r["units"]
        assert r["calls"] == {"all_gather": UNITS[arrangement]}, r["calls"]  # one per unit
        assert r["at init"] == (0.0, 0.0), r["at init"]
        assert r["keep_vars"][1] == r["keep_vars"][0], r["keep_vars"]
        assert r["trained"] < 1e-6, r["trained"]
        assert r["rank0_only"][1] == r["rank0_only"][0], (rank, r["rank0_only"])
        assert r["offload"] == (0.0, {"cpu"}), r["offload"]


@pytest.mark.parametrize("arrangement", ARRANGEMENTS)
def test_load_into_a_plain_parent_matches_torch_fsdp1(world2, arrangement):
    for r in world2.run(_run, _loads, arrangement):
        theirs, mine = r["torch"], r["shardkit"]
        assert mine["result"] == theirs["result"] == "<All keys matched successfully>", r
        assert mine["loaded"] == theirs["loaded"] == 0.0, r
        assert mine["calls"] == 0, r  # each rank cuts its own rows
        for line in ('Missing key(s) in state_dict: "body.lin.bias"',
                     'Unexpected key(s) in state_dict: "body.extra"',
                     "size mismatch for body.lin.weight: copying a param with shape "
                     "torch.Size([4, 5]) from checkpoint, the shape in current model is "
                     "torch.Size([5, 5])"):
            assert line in mine["strict"], (line, mine["strict"], theirs["strict"])
        assert mine["non-strict"].split(":", 1)[0] == theirs["non-strict"].split(":", 1)[0], r
        assert mine["kept"] == (True, True), r


@pytest.mark.parametrize("arrangement", ["one unit", "auto-wrapped"])
def test_local_and_sharded_types_set_on_the_plain_parent(world2, arrangement):
    for r in world2.run(_run, _other_types, arrangement):
        assert r["local"] == (True, True, True), r
        assert r["local calls"] == r["sharded calls"] == 0, r
        assert r["local load"] == "<All keys matched successfully>", r
        assert r["local round trip"] == 0.0, r
        assert r["sharded keys"][1] == r["sharded keys"][0], r["sharded keys"]
        assert r["sharded shapes"][1] == r["sharded shapes"][0], r["sharded shapes"]
        assert r["sharded values"] == 0.0, r
        assert r["sharded load"] == "<All keys matched successfully>", r
        assert r["sharded round trip"] == 0.0, r


def _initialize_over_user_units() -> int:
    """``shardkit.initialize`` at stage 3 over a plain module holding the user's own units reads
    the model's key names; it must not gather every unit for that (the plain parent's
    ``state_dict()`` is FULL by default: the whole model on every rank at start-up)."""
    import shardkit
    from shardkit.nn.data_parallel.fsdp_state_dict import FSDPStateDictMixin
    calls = []
    original = FSDPStateDictMixin._full_params_unit_by_unit

    def counted(self, *args, **kwargs):
        calls.append(1)
        return original(self, *args, **kwargs)

    FSDPStateDictMixin._full_params_unit_by_unit = counted
    try:
        torch.manual_seed(0)
        model = nn.Sequential(*[FSDP(nn.Linear(6, 6)) for _ in range(4)])
        shardkit.initialize(model=model, config={
            "train_micro_batch_size_per_gpu": 2, "zero_optimization": {"stage": 3},
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    finally:
        FSDPStateDictMixin._full_params_unit_by_unit = original
    return len(calls)


def test_initialize_reads_key_names_without_gathering(world2):
    assert world2.run(_initialize_over_user_units) == [0, 0]
