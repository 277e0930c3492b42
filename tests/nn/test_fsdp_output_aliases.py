"""An FSDP unit whose forward output shares storage with its own parameters, or is changed in
place by its caller, trains as one process does.

- A unit that returns a slice of its parameter (a learned position table, ``self.table[:n]``):
  the gathered parameters are freed after forward, so such an output is copied first (before:
  a segfault, reading released memory); the parameter itself gets no hook that outlives the step.
- A unit's output that the caller changes in place (``h[mask] = 0``, as HF Wav2Vec2 does) still
  gathers the unit for backward (also checked per model in ``tests/test_torch_blocks.py``).

One world of 2 gloo ranks for the module.
"""

import copy

import torch
import torch.nn as nn

from shardkit import distributed as skdist
from shardkit.nn import FullyShardedDataParallel as FSDP
from shardkit.testing import world_fixture
from tests.utils.compare import max_diff

world2 = world_fixture(2)

STEPS = 3


class Table(nn.Module):
    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(16, 8))

    def forward(self, n: int):
        return self.table[:n]


class Proj(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x)


class Net(nn.Module):
    """``pos`` returns a view of its parameter; ``proj``'s output is zeroed in place."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.pos = Table()
        self.proj = Proj()
        self.head = nn.Linear(8, 1)

    def forward(self, x):
        h = self.proj(x + self.pos(x.shape[1]))
        h[:, :2] = 0  # in place on a unit's output
        return self.head(h).sum()


def _wrapped(model: Net) -> FSDP:
    model.pos = FSDP(model.pos)
    model.proj = FSDP(model.proj)
    return FSDP(model)


def _batch(step: int) -> torch.Tensor:
    return torch.randn(4, 6, 8, generator=torch.Generator().manual_seed(step))


def _train_like_one_process() -> dict:
    rank, world = skdist.get_rank(), skdist.get_world_size()
    oracle = Net()
    model = _wrapped(copy.deepcopy(oracle))
    ref_opt = torch.optim.SGD(oracle.parameters(), lr=0.1)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    worst = 0.0
    for step in range(STEPS):
        x = _batch(step)
        (oracle(x) / world).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        model(x.chunk(world)[rank]).backward()
        opt.step()
        opt.zero_grad()
        worst = max(worst, max_diff(model.state_dict(), oracle.state_dict()))
    return {"worst": worst}


def _kept_unit_view_read_after_backward() -> list:
    """A unit kept gathered for backward (the root; reshard_after_forward=False) returning a
    view of its parameter: the output is read after backward freed ``full``, and no hook piles
    up on ``full`` over the steps."""
    sums = []
    for model in (FSDP(Table()), FSDP(nn.Sequential(FSDP(Table(), reshard_after_forward=False)))):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(STEPS):
            out = model(6)
            out.sum().backward()
            opt.step()
            opt.zero_grad()
            with model.summon_full_params():  # what the output held when it was made
                expected = float(sum(p.detach()[:6].sum() for p in model.parameters())) \
                    + 0.1 * 6 * 8  # SGD(lr=0.1) on d(sum)/dw = 1 moved each element by -0.1
            sums.append((out.untyped_storage().nbytes(), float(out.detach().sum()), expected))
    return sums


def test_kept_unit_view_outlives_backward(world2):
    for result in world2.run(_kept_unit_view_read_after_backward):
        for nbytes, got, expected in result:
            assert nbytes > 0 and abs(got - expected) < 1e-4, result


def test_views_and_in_place_outputs_train_like_one_process(world2):
    for result in world2.run(_train_like_one_process):
        assert result["worst"] < 1e-6, result


class _ViewOfIgnored(nn.Module):
    """A unit whose output is a view of a leaf it does not gather (an ignored parameter)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.lin = nn.Linear(8, 8)
        self.extra = nn.Parameter(torch.randn(16, 8))

    def forward(self, n: int):
        return self.extra[:n]


def _hooks_left_on_a_leaf_base() -> int:
    inner = _ViewOfIgnored()
    model = FSDP(nn.Sequential(FSDP(inner, ignored_states=[inner.extra])))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(STEPS):
        model(6).sum().backward()
        opt.step()
        opt.zero_grad()
    return len(inner.extra._backward_hooks or {})


def test_no_hook_piles_up_on_a_leaf_base(world2):
    """An output's base is hooked only when it is not a leaf: a leaf's hooks outlive the graph
    (one more per step). The outputs above are copies by then, so only a leaf the unit does not
    gather (an ignored parameter) reaches this."""
    assert world2.run(_hooks_left_on_a_leaf_base) == [0, 0]


class SparseTable(Table):
    def forward(self, n: int):
        return (self.table[:n] * 1).to_sparse()


def _sparse_output() -> float:
    torch.manual_seed(0)
    model = FSDP(nn.Sequential(FSDP(SparseTable())))
    out = model(6)
    out.to_dense().sum().backward()
    return float(out.to_dense().sum())


def test_sparse_output_passes_through(world2):
    """A sparse output has no storage to compare: it is returned as it is (the alias check
    raised NotImplementedError on it)."""
    torch.manual_seed(0)
    expected = float(Table().table[:6].sum())
    for value in world2.run(_sparse_output):
        assert abs(value - expected) < 1e-5
