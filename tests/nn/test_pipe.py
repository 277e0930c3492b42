"""Pipe (GPipe in one process): parity with the plain Sequential, skips, recomputation, BN."""

import copy

import pytest
import torch
import torch.nn as nn

from shardkit.nn import Pipe
from shardkit.nn.pipe import is_checkpointing, is_recomputing
from shardkit.nn.pipe.pipe import clock_cycles
from shardkit.nn.pipe.skip import Namespace, pop, skippable, stash, verify_skippables


def _sequential(seed=0, width=12):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, width), nn.GELU(), nn.Linear(width, 3))


def _outputs_and_grads(model, x):
    x = x.clone().requires_grad_(True)
    out = model(x)
    (out.square().mean() + out.mean()).backward()
    return [out.detach(), x.grad] + [p.grad for p in model.parameters()]


def _max_diff(xs, ys):
    assert len(xs) == len(ys)
    return max((a - b).abs().max().item() for a, b in zip(xs, ys))


def test_clock_order_is_gpipe():
    assert clock_cycles(3, 2) == [[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(2, 1)]]


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("chunks", [1, 4, 8])
def test_parity_with_sequential(chunks, checkpoint):
    ref = _sequential()
    pipe = Pipe(copy.deepcopy(ref), balance=[2, 3, 2], devices=["cpu"] * 3, chunks=chunks,
                checkpoint=checkpoint)
    x = torch.randn(16, 12)
    assert _max_diff(_outputs_and_grads(ref, x), _outputs_and_grads(pipe, x)) <= 1e-6
    assert list(pipe.state_dict()) == list(ref.state_dict())
    assert len(pipe) == len(ref) and pipe[0] is pipe.partitions[0][0]


class TwoInputs(nn.Module):
    def forward(self, xy):
        x, y = xy
        return x * 2, x + y


class Merge(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(4, 4)

    def forward(self, ab):
        a, b = ab
        return self.lin(a) * b


def test_several_inputs_and_outputs_between_partitions():
    torch.manual_seed(0)
    ref = nn.Sequential(TwoInputs(), Merge())
    pipe = Pipe(copy.deepcopy(ref), [1, 1], chunks=3)
    x, y = torch.randn(6, 4), torch.randn(6, 4)
    assert torch.allclose(pipe(x, y), ref((x, y)), atol=1e-6)
    assert torch.allclose(pipe((x, y)), ref((x, y)), atol=1e-6)


# --------------------------------------------------------------------------- skip connections


@skippable(stash=["skip"])
class StashInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        yield stash("skip", x)
        return torch.tanh(self.lin(x))


@skippable(pop=["skip"])
class PopAndAdd(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(6, 6)

    def forward(self, x):
        skip = yield pop("skip")
        return self.lin(x) + skip


def _skip_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(StashInput(), nn.Linear(6, 6), nn.GELU(), PopAndAdd(), nn.Linear(6, 2))


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
def test_skip_connection_across_partitions(checkpoint):
    ref = _skip_model()  # runs as a plain Sequential too
    pipe = Pipe(copy.deepcopy(ref), [2, 2, 1], chunks=4, checkpoint=checkpoint)
    x = torch.randn(8, 6)
    assert _max_diff(_outputs_and_grads(ref, x), _outputs_and_grads(pipe, x)) <= 1e-6
    assert isinstance(pipe[0], StashInput) and isinstance(pipe[0], nn.Module)


def test_namespaces_isolate_repeated_skip_names():
    torch.manual_seed(0)
    ns1, ns2 = Namespace(), Namespace()
    layers = [StashInput().isolate(ns1), PopAndAdd().isolate(ns1),
              StashInput().isolate(ns2), PopAndAdd().isolate(ns2)]
    ref = nn.Sequential(*layers)
    verify_skippables(ref)
    pipe = Pipe(copy.deepcopy(ref), [1, 2, 1], chunks=2, checkpoint="always")
    x = torch.randn(4, 6)
    assert _max_diff(_outputs_and_grads(ref, x), _outputs_and_grads(pipe, x)) <= 1e-6


def test_verify_skippables_reports_every_problem():
    with pytest.raises(TypeError, match="'skip' is stashed by layer 0 and again by layer 1"):
        verify_skippables(nn.Sequential(StashInput(), StashInput(), PopAndAdd()))
    with pytest.raises(TypeError, match="popped by layer 0 but not stashed"):
        verify_skippables(nn.Sequential(PopAndAdd(), StashInput()))
    with pytest.raises(TypeError, match="stashed by layer 0 but never popped"):
        Pipe(nn.Sequential(StashInput(), nn.Linear(6, 6)), [1, 1])


# --------------------------------------------------------------------------- recomputation


class FlagRecorder(nn.Module):
    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append((is_checkpointing(), is_recomputing()))
        return x


def _dropout_model(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(10, 10), nn.Dropout(0.5), FlagRecorder(), nn.Linear(10, 10),
                         nn.Dropout(0.3))


def test_dropout_same_mask_in_recomputation_and_flags():
    x = torch.randn(8, 10)
    kept = Pipe(_dropout_model(), [4, 1], chunks=4, checkpoint="never")
    recomputed = Pipe(_dropout_model(), [4, 1], chunks=4, checkpoint="always")
    torch.manual_seed(7)
    a = _outputs_and_grads(kept, x)
    torch.manual_seed(7)
    b = _outputs_and_grads(recomputed, x)
    assert _max_diff(a, b) <= 1e-6  # a different mask in recomputation would change the grads
    assert recomputed[2].seen.count((True, False)) == 4  # first forward of each micro-batch
    assert recomputed[2].seen.count((False, True)) == 4  # each recomputation
    assert kept[2].seen == [(False, False)] * 4


def test_eval_mode_does_not_checkpoint():
    pipe = Pipe(_dropout_model(), [2, 3], chunks=2, checkpoint="always").eval()
    pipe(torch.randn(4, 10, requires_grad=True)).sum().backward()
    assert pipe[2].seen == [(False, False)] * 2


# --------------------------------------------------------------------------- deferred batch norm


def _bn_model(momentum, seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6, momentum=momentum), nn.ReLU(),
                         nn.Linear(6, 6))


@pytest.mark.parametrize("momentum", [0.1, None])
@pytest.mark.parametrize("checkpoint", ["always", "never"])
def test_deferred_batch_norm_stats_equal_unsplit(checkpoint, momentum):
    ref = _bn_model(momentum)
    pipe = Pipe(_bn_model(momentum), [2, 2], chunks=4, checkpoint=checkpoint,
                deferred_batch_norm=True)
    for step in range(3):
        x = torch.randn(32, 5) * (step + 1) + step
        ref(x).sum().backward()
        pipe(x).sum().backward()
    ref_sd, pipe_sd = ref.state_dict(), pipe.state_dict()
    assert list(ref_sd) == list(pipe_sd)
    for key in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
        assert torch.allclose(ref_sd[key].double(), pipe_sd[key].double(), atol=1e-6,
                              rtol=1e-6), key
    # eval mode uses the committed running statistics, as the unsplit model does
    x = torch.randn(8, 5)
    with torch.no_grad():
        assert torch.allclose(ref.eval()(x), pipe.eval()(x), atol=1e-5)


# --------------------------------------------------------------------------- bad input


def test_bad_input_errors():
    seq = _sequential()
    with pytest.raises(TypeError, match=r"Pipe\(module=ModuleList\).*Sequential"):
        Pipe(nn.ModuleList(list(seq)), [3, 4])
    with pytest.raises(ValueError, match=r"balance=\[3, 3\].*sum to 6.*7 layers"):
        Pipe(seq, [3, 3])
    with pytest.raises(ValueError, match=r"balance=\[0, 7\]"):
        Pipe(seq, [0, 7])
    with pytest.raises(ValueError, match="checkpoint='sometimes'"):
        Pipe(seq, [3, 4], checkpoint="sometimes")
    with pytest.raises(ValueError, match="chunks=0"):
        Pipe(seq, [3, 4], chunks=0)
    with pytest.raises(ValueError, match="need at least 2 devices"):
        Pipe(seq, [3, 4], devices=["cpu"])
    pipe = Pipe(seq, [3, 4], chunks=8)
    with pytest.raises(ValueError, match="chunks=8 is larger than the batch size 5"):
        pipe(torch.randn(5, 12))
