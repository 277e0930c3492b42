"""FSDP as a FairScale / torch FSDP1 user drives it: a parameter registered inside a unit after
wrapping (refused at the next forward, on every rank, instead of training each rank's own copy),
forward inputs held in dataclasses (cast under mixed precision and ``force_input_to_fp32``, as
FairScale and torch FSDP1 cast them), and torch FSDP1's static ``FSDP.summon_full_params(model)``
on a plain model holding units."""

import dataclasses

import torch
import torch.nn as nn

from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP
from shardkit.testing import world_fixture
from tests.nn.fsdp_common import local_slice

world2 = world_fixture(2)


class Net(nn.Module):
    def __init__(self, out_bias: bool = True):
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(5, 8)
        self.block = nn.Sequential(nn.Linear(8, 8), nn.ReLU(), nn.Linear(8, 6))
        self.out = nn.Linear(6, 3, bias=out_bias)

    def forward(self, x):
        return self.out(self.block(self.inp(x)))


def _wrapped(out_bias: bool = True, **kwargs) -> FSDP:
    model = Net(out_bias)
    model.block = FSDP(model.block, **kwargs)
    return FSDP(model, **kwargs)


def _batch(step: int):
    g = torch.Generator().manual_seed(step)
    return torch.randn(8, 5, generator=g), torch.randn(8, 3, generator=g)


def _message_of(fn) -> str:
    try:
        fn()
    except RuntimeError as error:
        return str(error)
    return "no error"


def _step(model, optim, step: int, add=None) -> None:
    x, y = (local_slice(t) for t in _batch(step))
    out = model(x)
    loss = nn.functional.mse_loss(out if add is None else out + add(), y)
    loss.backward()
    optim.step()
    optim.zero_grad()


def _parameters_registered_after_wrapping():
    out = {}
    # an adapter added inside the inner unit after wrapping: it was whole on every rank and
    # trained on each rank's own gradient (never reduced), so the ranks' copies drifted apart
    model = _wrapped()
    adapter = model.module.block.module[2]
    adapter.scale = nn.Parameter(torch.ones(6))
    forward = adapter.forward
    adapter.forward = lambda h: forward(h) * adapter.scale
    out["adapter"] = _message_of(lambda: _step(model, torch.optim.SGD(model.parameters(), 0.1),
                                               0))
    # removed again, the model trains on, and a second forward after a registration elsewhere
    # (another model built) needs no change
    del adapter.scale
    adapter.forward = forward
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, optim, 1)
    nn.Linear(2, 2)
    _step(model, optim, 2)
    with model.summon_full_params(writeback=False):
        out["trained"] = model.module.out.weight.detach().clone()
    # a bias given after wrapping to a layer built without one
    model = _wrapped(out_bias=False)
    model.module.out.bias = None
    out["bias_none_ok"] = _message_of(lambda: model(torch.randn(2, 5)))
    model.module.out.bias = nn.Parameter(torch.zeros(3))
    out["bias"] = _message_of(lambda: model(torch.randn(2, 5)))
    # a tie made after wrapping: the root's layer would read the inner unit's row block
    model = _wrapped()
    model.module.inp.weight2 = model.module.block.module[0].weight
    out["tie"] = _message_of(lambda: model(torch.randn(2, 5)))
    # an ignored module is the user's: a parameter added to it is accepted
    model = Net()
    model = FSDP(model, ignored_modules=[model.out])
    model.module.out.extra = nn.Parameter(torch.zeros(3))
    out["ignored"] = _message_of(lambda: model(torch.randn(2, 5)))
    return out


def test_parameter_registered_after_wrapping_is_refused(world2):
    results = world2.run(_parameters_registered_after_wrapping)
    for r in results:
        assert "block.2.scale" in r["adapter"] and "after wrapping" in r["adapter"], r["adapter"]
        assert "never reduced" in r["adapter"] and "before wrapping" in r["adapter"]
        assert r["bias_none_ok"] == "no error" and r["ignored"] == "no error", r
        assert "out.bias" in r["bias"] and "after wrapping" in r["bias"], r["bias"]
        assert "inp.weight2" in r["tie"] and "Tie parameters before wrapping" in r["tie"], r
    assert torch.equal(results[0]["trained"], results[1]["trained"])


@dataclasses.dataclass
class Batch:
    x: torch.Tensor
    scale: float = 1.0


@dataclasses.dataclass(frozen=True)
class FrozenBatch:
    x: torch.Tensor


class TakesBatch(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(1)
        self.lin = nn.Linear(4, 3)

    def forward(self, batch):
        return self.lin(batch.x) * getattr(batch, "scale", 1.0)


class PassesBatch(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.pre = nn.Linear(4, 4)
        self.inner = TakesBatch()

    def forward(self, x):
        return self.inner(Batch(self.pre(x).float(), 2.0))


def _dataclass_inputs():
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(3))
    out = {}
    # the root and an inner unit given dataclasses: their fp32 tensors met bf16 weights ("mat1
    # and mat2 must have the same dtype"); each result equals the plain tensor path's
    root = FSDP(TakesBatch(), compute_dtype=torch.bfloat16)
    batch = Batch(x, 2.0)
    given = root(batch)
    out["root"] = (given.dtype, torch.equal(given, root(Batch(x.bfloat16(), 2.0))),
                   batch.x.dtype)  # the caller's object keeps its fp32 tensor
    out["frozen"] = root(FrozenBatch(x)).dtype
    nested = PassesBatch()
    nested.inner = FSDP(nested.inner, compute_dtype=torch.bfloat16)
    nested = FSDP(nested, compute_dtype=torch.bfloat16)
    loss = nested(local_slice(torch.randn(8, 4))).float().pow(2).mean()
    loss.backward()
    out["nested"] = all(p.grad is not None for p in nested.parameters())
    # force_input_to_fp32 widens an fp16 tensor inside a dataclass as well
    widened = FSDP(TakesBatch(), force_input_to_fp32=True)
    out["widened"] = widened(Batch(x.half())).dtype
    return out


def test_dataclass_inputs_are_cast(world2):
    for r in world2.run(_dataclass_inputs):
        assert r["root"] == (torch.bfloat16, True, torch.float32), r
        assert r["frozen"] == torch.bfloat16 and r["nested"], r
        assert r["widened"] == torch.float32, r


def _static_summon_on_a_plain_model():
    plain = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    plain[0] = FSDP(plain[0])
    with FSDP.summon_full_params(plain):
        shape = tuple(plain[0].module.weight.shape)
        with torch.no_grad():
            plain[0].module.weight.fill_(0.5)
    with FSDP.summon_full_params(plain, writeback=False):
        written = bool((plain[0].module.weight == 0.5).all())
    return shape, tuple(plain[0].module.weight.shape), written


def test_static_summon_full_params_on_a_plain_model(world2):
    for r in world2.run(_static_summon_on_a_plain_model):
        assert r == ((4, 4), (2, 4), True)


def _registrations_after_the_last_check():
    out = {}
    # a head built before a forward (its parameters counted then) and attached inside the
    # inner unit after it: the forward that followed trained it apart on each rank
    model = _wrapped()
    head = nn.Linear(6, 6)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, optim, 0)
    model.module.block.module.append(head)
    out["attached"] = _message_of(lambda: _step(model, optim, 1))
    # a parameter set on the FSDP wrapper itself (the root's), used in the loss
    model = _wrapped()
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, optim, 0)
    model.scale = nn.Parameter(torch.ones(3))
    out["on_wrapper"] = _message_of(lambda: _step(model, optim, 1, add=lambda: model.scale))
    # an ignored_states parameter given a new value at its place (load_state_dict(assign=True)
    # of the module holding it) stays the user's: training goes on with it
    net = Net()
    model = FSDP(net, ignored_states=[net.out.weight])
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    _step(model, optim, 0)
    net.out.load_state_dict({"weight": torch.full((3, 6), 0.25)}, strict=False, assign=True)
    out["ignored_replaced"] = _message_of(lambda: _step(model, optim, 1))
    out["ignored_value"] = net.out.weight.detach().clone()
    return out


def test_registrations_after_the_last_check_are_found(world2):
    for r in world2.run(_registrations_after_the_last_check):
        assert "block.3.weight" in r["attached"] and "after wrapping" in r["attached"], r
        assert "scale" in r["on_wrapper"] and "after wrapping" in r["on_wrapper"], r
        assert r["ignored_replaced"] == "no error", r["ignored_replaced"]
        # not refused, and untouched by SGD: the new parameter is not in the optimizer
        assert torch.equal(r["ignored_value"], torch.full((3, 6), 0.25))
