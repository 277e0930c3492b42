"""Pipe (GPipe in one process): parity with the plain Sequential, skips, recomputation, BN."""

import copy

import pytest
import torch
import torch.nn as nn

from shardkit.nn import Pipe
from shardkit.nn.pipe import is_checkpointing, is_recomputing
from shardkit.nn.pipe.pipe import clock_cycles
from shardkit.nn.pipe.skip import Namespace, pop, skippable, stash, verify_skippables
from tests.utils.compare import max_diff


def _sequential(seed=0, width=12):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(width, width), nn.GELU(), nn.Linear(width, width), nn.Tanh(),
                         nn.Linear(width, width), nn.GELU(), nn.Linear(width, 3))


def _outputs_and_grads(model, x):
    x = x.clone().requires_grad_(True)
    out = model(x)
    (out.square().mean() + out.mean()).backward()
    return [out.detach(), x.grad] + [p.grad for p in model.parameters()]


def test_clock_order_is_gpipe():
    assert clock_cycles(3, 2) == [[(0, 0)], [(1, 0), (0, 1)], [(2, 0), (1, 1)], [(2, 1)]]


@pytest.mark.parametrize("checkpoint", ["always", "except_last", "never"])
@pytest.mark.parametrize("chunks", [1, 4, 8])
def test_parity_with_sequential(chunks, checkpoint):
    ref = _sequential()
    pipe = Pipe(copy.deepcopy(ref), balance=[2, 3, 2], devices=["cpu"] * 3, chunks=chunks,
                checkpoint=checkpoint)
    x = torch.randn(16, 12)
    assert max_diff(_outputs_and_grads(ref, x), _outputs_and_grads(pipe, x)) <= 1e-6
    assert list(pipe.state_dict()) == _pipe_keys(ref.state_dict(), [2, 3, 2])
    assert len(pipe) == len(ref) and pipe[0] is pipe.partitions[0][0]
    assert isinstance(pipe[-1], nn.Linear) and pipe[-1].out_features == 3


def _pipe_keys(sequential_state, balance):
    """FairScale's Pipe keys: ``partitions.<j>.<layer name>.<rest>``."""
    owner = [j for j, size in enumerate(balance) for _ in range(size)]
    return [f"partitions.{owner[int(k.split('.')[0])]}.{k}" for k in sequential_state]


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
    assert max_diff(_outputs_and_grads(ref, x), _outputs_and_grads(pipe, x)) <= 1e-6
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
    assert max_diff(_outputs_and_grads(ref, x), _outputs_and_grads(pipe, x)) <= 1e-6


def test_namespaces_compare_hash_and_order_by_value():
    import pickle

    ns, other = Namespace(), Namespace()
    for twin in (copy.copy(ns), copy.deepcopy(ns), pickle.loads(pickle.dumps(ns))):
        assert twin == ns and hash(twin) == hash(ns) and twin is not ns
        assert not twin < ns and not ns < twin
    assert ns != other and len({ns, other, copy.deepcopy(ns)}) == 2
    assert sorted([ns, other]) == sorted([other, ns])  # a total order, as skip layouts need
    assert ns != "ns" and (ns < other) != (other < ns)
    # a layer copied on its own keeps its namespace, so its pop still finds the stash
    layer = StashInput().isolate(ns)
    assert copy.deepcopy(layer).namespaced("skip") == layer.namespaced("skip")


@skippable(stash=["same"], pop=["same"])
class StashAndPop(nn.Module):
    def forward(self, x):
        yield stash("same", x)
        return (yield pop("same"))


def test_a_layer_that_stashes_and_pops_one_name_is_refused():
    with pytest.raises(TypeError, match="'1' declared 'same' both as stashable and as poppable"):
        verify_skippables(nn.Sequential(nn.Identity(), StashAndPop()))
    with pytest.raises(TypeError, match="both as stashable and as poppable"):
        Pipe(nn.Sequential(StashAndPop()), [1])


def test_verify_skippables_reports_every_problem():
    with pytest.raises(TypeError, match=r"'1' redeclared 'skip' as stashable \(already stashed "
                                        r"by layer '0'"):
        verify_skippables(nn.Sequential(StashInput(), StashInput(), PopAndAdd()))
    with pytest.raises(TypeError, match="'0' declared 'skip' as poppable but it was not stashed"):
        verify_skippables(nn.Sequential(PopAndAdd(), StashInput()))
    with pytest.raises(TypeError, match=r"no module declared 'skip' as poppable but stashed "
                                        r"\(stashed by layer '0'"):
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
    assert max_diff(a, b) <= 1e-6  # a different mask in recomputation would change the grads
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
    assert list(pipe_sd) == _pipe_keys(ref_sd, [2, 2])
    for key in ("1.running_mean", "1.running_var", "1.num_batches_tracked"):
        assert torch.allclose(ref_sd[key].double(), pipe_sd["partitions.0." + key].double(),
                              atol=1e-6, rtol=1e-6), key
    # eval mode uses the committed running statistics, as the unsplit model does
    x = torch.randn(8, 5)
    with torch.no_grad():
        assert torch.allclose(ref.eval()(x), pipe.eval()(x), atol=1e-5)


def test_deferred_batch_norm_alone_commits_every_chunks_micro_batches():
    """FairScale's standalone use: DeferredBatchNorm(chunks=k) fed a batch's k micro-batches
    holds the running statistics of the unsplit BatchNorm; converting keeps a layer that already
    has the same chunks and replaces one with other chunks."""
    from shardkit.nn.pipe import DeferredBatchNorm
    for momentum in (0.1, None):
        bn = nn.BatchNorm2d(3, momentum=momentum)
        dbn = DeferredBatchNorm.convert_deferred_batch_norm(copy.deepcopy(bn), chunks=4)
        assert isinstance(dbn, DeferredBatchNorm) and dbn.chunks == 4
        for step in range(2):
            x = torch.rand(16, 3, 5, 5) * (step + 2) + step
            bn(x)
            for part in x.chunk(4):
                dbn(part)
            assert dbn.tracked_chunks == 0  # committed after the fourth
            assert torch.allclose(bn.running_mean, dbn.running_mean, atol=1e-5)
            assert torch.allclose(bn.running_var, dbn.running_var, atol=1e-5)
        assert int(dbn.num_batches_tracked) == 2
    assert DeferredBatchNorm.convert_deferred_batch_norm(dbn, chunks=4) is dbn
    other = DeferredBatchNorm.convert_deferred_batch_norm(dbn, chunks=2)
    assert other is not dbn and other.chunks == 2
    plain = nn.BatchNorm2d(3, track_running_stats=False)
    assert DeferredBatchNorm.convert_deferred_batch_norm(plain, chunks=4) is plain
    with pytest.raises(ValueError, match="chunks=0"):
        DeferredBatchNorm(3, chunks=0)


def test_skippable_repr_names_the_decorator():
    assert repr(StashInput()).startswith("@skippable(StashInput(")


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
    with pytest.raises(IndexError, match="need at least 2 devices"):
        Pipe(seq, [3, 4], devices=["cpu"])
    with pytest.raises(ValueError, match="balance=None"):
        Pipe(seq)
    with pytest.raises(ValueError, match="chunks='many'"):
        Pipe(seq, [3, 4], chunks="many")


class _ReturnsText(nn.Module):
    def forward(self, x):
        return (x, "hello")


class _Mean(nn.Module):
    def forward(self, x):
        return x.mean()


def test_a_partition_returning_a_non_tensor_gets_a_type_error_naming_it():
    # FairScale raises TypeError; before, a middle partition's str crashed in `.to(device)`
    # with "AttributeError: 'str' object has no attribute 'to'".
    for layers, balance in [((_ReturnsText(), nn.Identity()), [1, 1]), ((_ReturnsText(),), [1])]:
        pipe = Pipe(nn.Sequential(*layers), balance, devices=["cpu"] * len(balance), chunks=2)
        with pytest.raises(TypeError, match=r"partition 0 returned \['Tensor', 'str'\]"):
            pipe(torch.randn(4, 3))
    scalar = Pipe(nn.Sequential(nn.Linear(3, 3), _Mean()), [1, 1], devices=["cpu"] * 2, chunks=2)
    with pytest.raises(TypeError, match="last partition returned a 0-dim tensor"):
        scalar(torch.randn(4, 3))


# --------------------------------------------------------------------------- FairScale behaviours


def test_the_same_layer_twice_is_refused():
    conv = nn.Linear(4, 4)
    with pytest.raises(ValueError, match="layer '1' is the same module object as layer '0'"):
        Pipe(nn.Sequential(conv, conv), [1, 1])
    with pytest.raises(ValueError, match="same module object"):
        Pipe(nn.Sequential(conv, nn.ReLU(), conv), [3])


def test_a_parameter_shared_across_devices_is_refused():
    a, b = nn.Linear(4, 4), nn.Linear(4, 4)
    b.weight = a.weight
    with pytest.raises(ValueError, match=r"shared by partitions 0 \(cpu\) and 1 \(meta\)"):
        Pipe(nn.Sequential(a, b), [1, 1], devices=["cpu", "meta"])
    pipe = Pipe(nn.Sequential(a, b), [1, 1], devices=["cpu", "cpu"])  # one device: fine
    assert pipe[1].weight is pipe[0].weight


def test_partitions_are_a_module_list_and_a_fairscale_checkpoint_loads():
    ref = _sequential()
    pipe = Pipe(copy.deepcopy(ref), [3, 4], chunks=2)
    assert isinstance(pipe.partitions, nn.ModuleList) and len(pipe.partitions) == 2
    assert [n for n, _ in pipe.named_parameters()][:2] == ["partitions.0.0.weight",
                                                           "partitions.0.0.bias"]
    # a checkpoint written by FairScale's Pipe has these keys; loading it changes the weights
    fairscale_sd = {key: torch.full_like(v, 0.5)
                    for key, v in zip(_pipe_keys(ref.state_dict(), [3, 4]),
                                      ref.state_dict().values())}
    pipe.load_state_dict(fairscale_sd)
    assert all(torch.equal(p, torch.full_like(p, 0.5)) for p in pipe.parameters())


def test_moving_a_pipe_is_refused_but_dtype_is_not():
    pipe = Pipe(_sequential(), [3, 4])
    for move in (lambda: pipe.cuda(), lambda: pipe.cpu(), lambda: pipe.to("cpu"),
                 lambda: pipe.to(torch.device("cpu")), lambda: pipe.to(0),
                 lambda: pipe.to(device="cpu"), lambda: pipe.to(torch.zeros(1))):
        with pytest.raises(TypeError, match="Pipe places each partition"):
            move()
    assert pipe.to(torch.float64) is pipe and pipe[0].weight.dtype == torch.float64


def test_chunks_and_checkpoint_are_coerced_and_small_batches_run():
    ref = _sequential()
    pipe = Pipe(copy.deepcopy(ref), [3, 4], chunks=8.0, checkpoint=_Mode("always"))
    assert pipe.chunks == 8 and pipe.checkpoint == "always"
    x = torch.randn(5, 12)  # 5 samples, 8 chunks: 5 micro-batches of one sample
    assert max_diff(_outputs_and_grads(ref, x), _outputs_and_grads(pipe, x)) <= 1e-6
    assert Pipe(_sequential(), [7], chunks="3").chunks == 3


class _Mode:
    """An object whose str() is a checkpoint mode (FairScale takes ``str(checkpoint)``)."""

    def __init__(self, mode):
        self.mode = mode

    def __str__(self):
        return self.mode


def test_empty_sequential_is_the_identity():
    pipe = Pipe(nn.Sequential(), balance=[], chunks=4)
    x = torch.randn(3, 2)
    assert pipe(x) is x and len(pipe) == 0 and list(pipe) == []
    assert pipe((x, x)) == (x, x)
    assert pipe(torch.tensor(42)) == torch.tensor(42)  # no batch dimension needed
    with pytest.raises(TypeError, match="tensor or a tuple of tensors"):
        pipe(42)


def _costly_model():
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(64, 64), nn.Linear(64, 512), nn.Linear(512, 512),
                         nn.Linear(512, 64), nn.ReLU(), nn.Linear(64, 8))


def test_balance_helpers_propose_a_valid_balance():
    from shardkit.nn.pipe.balance import balance_by_size, balance_by_time, balance_cost

    assert balance_cost([1, 1, 1, 1], 2) == [2, 2]
    assert balance_cost([10, 1, 1, 1, 1], 2) == [1, 4]
    assert balance_cost([1, 2, 3], 3) == [1, 1, 1]
    with pytest.raises(ValueError, match="partitions=4"):
        balance_cost([1, 2, 3], 4)
    model = _costly_model()
    before = copy.deepcopy(model.state_dict())
    x = torch.randn(32, 64)
    by_size = balance_by_size(2, model, x, chunks=4, param_scale=4.0)
    # the 512x512 layer holds 76% of the parameters, so a cut falls right before or after it
    assert sum(by_size) == 6 and len(by_size) == 2 and by_size in ([3, 3], [2, 4])
    by_time = balance_by_time(3, model, x, timeout=0.01)
    assert sum(by_time) == 6 and len(by_time) == 3 and min(by_time) >= 1
    assert all(torch.equal(v, before[k]) for k, v in model.state_dict().items())  # untouched
    assert all(p.grad is None for p in model.parameters())
    Pipe(model, by_size, chunks=4)(x).sum().backward()
    with pytest.raises(ValueError, match="already has a gradient"):
        balance_by_time(2, model, x)


class _FakeClock:
    """A ``time.perf_counter`` that only the layers advance, so the test does not depend on
    how busy the machine is (real 10-60 ms sleeps overshoot by tens of ms under load)."""

    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def __deepcopy__(self, memo):  # balance_by_time times copies of the layers: one clock
        return self


class _Delay(nn.Module):
    def __init__(self, seconds: float, clock: _FakeClock):
        super().__init__()
        self.seconds = seconds
        self.clock = clock

    def forward(self, x):
        self.clock.now += self.seconds
        return x


def test_balance_by_time_follows_the_layers_costs(monkeypatch):
    """FairScale's test: layers taking 10-60 ms cut as [4, 2] (the sample keeps its
    requires_grad=False)."""
    from shardkit.nn.pipe import balance
    clock = _FakeClock()
    monkeypatch.setattr(balance.time, "perf_counter", clock)
    model = nn.Sequential(*[_Delay(i / 100, clock) for i in range(1, 7)])
    assert balance.balance_by_time(2, model, torch.rand(1), timeout=0.4) == [4, 2]


class _Expand(nn.Module):
    """Adds ``times`` fresh tensors that require grad: nothing is saved for backward, but the
    graph keeps each of them alive."""

    def __init__(self, times):
        super().__init__()
        self.times = times

    def forward(self, x):
        for _ in range(self.times):
            x = x + torch.rand_like(x, requires_grad=True)
        return x


def test_balance_by_size_counts_tensors_the_graph_keeps_alive():
    # FairScale's test: latent sizes 1..6 cut as [4, 2] (and 6..1 as [2, 4]); before, only
    # tensors saved for backward were counted, every layer cost the same and both gave [3, 3].
    from shardkit.nn.pipe.balance import balance_by_size
    sample = torch.rand(10, 100, 100)
    rising = nn.Sequential(*[_Expand(i) for i in [1, 2, 3, 4, 5, 6]])
    falling = nn.Sequential(*[_Expand(i) for i in [6, 5, 4, 3, 2, 1]])
    assert balance_by_size(2, rising, sample) == [4, 2]
    assert balance_by_size(2, falling, sample) == [2, 4]


def test_balance_by_size_with_batchnorm_leaves_running_stats_alone():
    """Profiled on a micro-batch of at least 2 rows (BatchNorm cannot train on one), on copies
    of the layers: the model's running statistics are untouched."""
    from shardkit.nn.pipe.balance import balance_by_size
    model = nn.Sequential(nn.Linear(16, 16), nn.BatchNorm1d(16), nn.Tanh(), nn.Linear(16, 4))
    before = {k: v.clone() for k, v in model.state_dict().items()}
    balance = balance_by_size(2, model, torch.randn(8, 16), chunks=2)
    assert sum(balance) == len(model) and len(balance) == 2
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@skippable(stash=["skip"])
class _StashScaled(nn.Module):
    """Stashes a tensor computed from its own ``width``-sized parameter, and returns a function
    of it (so the layer's backward frees the graph the stashed tensor hangs from)."""

    def __init__(self, width):
        super().__init__()
        self.scale = nn.Parameter(torch.full((width,), 1.0 / width))

    def forward(self, x):
        scaled = x * self.scale.sum()
        yield stash("skip", scaled)
        return torch.tanh(scaled)


def test_balance_helpers_profile_skip_connections_layer_by_layer(monkeypatch):
    """A popped skip tensor reaches the profiled layer detached, as its input does: before,
    balance_by_time's backward of the popping layer ran into the stashing layer's freed graph
    (RuntimeError, leaving the stash in the thread's table) and balance_by_size charged the
    popping layer with the stashing layer's parameter and input."""
    from shardkit.nn.pipe import balance
    from shardkit.nn.pipe.skip import _tracker
    costs = []
    real_cost = balance.balance_cost
    monkeypatch.setattr(balance, "balance_cost", lambda c, n: costs.append(c) or real_cost(c, n))
    x = torch.randn(8, 6)
    for width in (10, 10000):
        torch.manual_seed(0)
        model = nn.Sequential(_StashScaled(width), nn.Linear(6, 6), PopAndAdd(), nn.Linear(6, 2))
        proposed = balance.balance_by_time(2, model, x, timeout=0.0)
        assert len(proposed) == 2 and sum(proposed) == 4 and not _tracker.current.tensors
        assert all(p.grad is None for p in model.parameters())
        balance.balance_by_size(2, model, x, param_scale=0.0)
        assert not _tracker.current.tensors
    by_size_narrow, by_size_wide = costs[1], costs[3]
    assert by_size_narrow[2] == by_size_wide[2]  # the popping layer's own activations only


def test_empty_batch_runs_like_the_sequential_and_no_input_is_a_type_error():
    """A batch of 0 samples (FairScale cuts it into empty micro-batches) runs as one empty
    micro-batch; before, it failed in torch.tensor_split. ``pipe()`` named no input; before,
    an IndexError."""
    ref = _sequential()
    x = torch.randn(0, 12)
    ref(x).sum().backward()
    for checkpoint in ("always", "except_last", "never"):
        pipe = Pipe(copy.deepcopy(ref), [3, 4], chunks=4, checkpoint=checkpoint)
        pipe.zero_grad()
        out = pipe(x)
        assert out.shape == (0, 3)
        out.sum().backward()
        assert all(torch.equal(p.grad, q.grad) for p, q in zip(ref.parameters(),
                                                               pipe.parameters()))
        assert pipe.eval()(x).shape == (0, 3)
    both = Pipe(nn.Sequential(TwoInputs()), [1], chunks=4)((x, x))
    assert isinstance(both, tuple) and [t.shape for t in both] == [(0, 12), (0, 12)]
    with pytest.raises(TypeError, match="Pipe.forward: expected a tensor or a tuple of "
                                        "tensors, got no input"):
        pipe()


def test_deferred_batch_norm_keeps_the_batch_norms_parameters():
    """deferred_batch_norm=True holds the BatchNorms' own tensors, as FairScale's conversion:
    an optimizer built before the Pipe trains them, a frozen one stays frozen and a float64
    model stays float64. Before, the conversion made float32 copies that required grad: a
    float64 model failed ("mixed dtype") and the copies were not in the optimizer."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6), nn.Tanh(), nn.Linear(6, 6),
                        nn.BatchNorm1d(6), nn.Linear(6, 2)).double()
    ref[1].requires_grad_(False)
    model = copy.deepcopy(ref)
    frozen_weight = model[1].weight
    optimizers = [torch.optim.AdamW(m.parameters(), lr=0.1) for m in (ref, model)]
    pipe = Pipe(model, [3, 3], chunks=1, deferred_batch_norm=True)
    assert pipe[1].weight is frozen_weight and not frozen_weight.requires_grad
    for _ in range(3):
        x = torch.randn(8, 6, dtype=torch.float64)
        for m, opt in zip((ref, pipe), optimizers):
            m(x).square().mean().backward()
            opt.step()
            opt.zero_grad()
    ref_state = list(ref.state_dict().values())
    assert max_diff(ref_state, list(pipe.state_dict().values())) <= 1e-12
    assert all(v.dtype == torch.float64
               for v in pipe.state_dict().values() if v.is_floating_point())


def test_deferred_batch_norm_counts_an_empty_batch_and_refuses_what_it_would_drop():
    """An empty batch counts in num_batches_tracked, as in the Sequential (momentum=None
    averages over it); a BatchNorm subclass with state of its own is refused, not dropped."""
    from shardkit.nn.pipe import DeferredBatchNorm
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(6, 6), nn.BatchNorm1d(6, momentum=None), nn.Linear(6, 2))
    pipe = Pipe(copy.deepcopy(ref), [2, 1], chunks=2, deferred_batch_norm=True)
    for x in (torch.randn(0, 6), torch.randn(8, 6) + 3):
        ref(x)
        pipe(x)
    assert max_diff(list(ref.state_dict().values()), list(pipe.state_dict().values())) <= 1e-6

    class Scaled(nn.BatchNorm1d):
        def __init__(self, n):
            super().__init__(n)
            self.extra = nn.Parameter(torch.ones(n))

    with pytest.raises(ValueError, match="extra"):
        Pipe(nn.Sequential(nn.Linear(6, 6), Scaled(6)), [2], deferred_batch_norm=True)
    with pytest.raises(ValueError, match="no running statistics"):
        DeferredBatchNorm.from_batch_norm(nn.BatchNorm1d(6, track_running_stats=False))


class _Sizes(nn.Module):
    """Records the batch size of each micro-batch it sees."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def forward(self, x):
        self.seen.append(x.shape[0])
        return x


@pytest.mark.parametrize("rows,chunks,sizes", [(10, 4, [3, 3, 3, 1]), (6, 4, [2, 2, 2]),
                                               (16, 4, [4] * 4), (5, 8, [1] * 5)])
def test_micro_batches_are_cut_as_fairscale_cuts_them(rows, chunks, sizes):
    """FairScale's Pipe cuts a batch with ``torch.chunk`` (pieces of ceil(rows / chunks)
    samples, the last smaller, so fewer than ``chunks`` of them where that runs out). Before,
    ``torch.tensor_split``'s pieces ([3, 3, 2, 2] for 10 rows in 4)."""
    probe = _Sizes()
    pipe = Pipe(nn.Sequential(probe, nn.Linear(3, 3)), [1, 1], chunks=chunks)
    pipe(torch.randn(rows, 3))
    assert probe.seen == sizes


@pytest.mark.parametrize("rows", [14, 9])
def test_a_batch_norm_in_training_sees_fairscales_micro_batches(rows):
    """14 rows in 4 micro-batches: [4, 4, 4, 2] as in FairScale (not [4, 4, 3, 3]); 9 rows:
    [3, 3, 3], three micro-batches. Outputs and running statistics as the Sequential run on
    each of ``x.chunk(4)`` in turn."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(5, 6), nn.BatchNorm1d(6), nn.ReLU(), nn.Linear(6, 2))
    pipe = Pipe(copy.deepcopy(ref), [2, 2], chunks=4, checkpoint="never")
    x = torch.randn(rows, 5)
    expected = torch.cat([ref(part) for part in x.chunk(4)])
    assert torch.allclose(pipe(x), expected, atol=1e-6)
    pipe_state = pipe.state_dict()
    for key, value in ref.state_dict().items():
        mine = pipe_state[_pipe_keys({key: 0}, [2, 2])[0]]
        assert torch.allclose(value.double(), mine.double(), atol=1e-6), key
