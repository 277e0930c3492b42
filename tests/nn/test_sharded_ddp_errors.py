"""ShardedDataParallel: bad input rejected at wrap time before any collective, start-up and
buffer broadcasts, and loss scaling with ShardedGradScaler across ranks."""

import torch
import torch.nn as nn
import torch.utils.checkpoint

from shardkit import distributed as skdist
from shardkit.nn.data_parallel import ShardedDataParallel
from shardkit.optim import OSS
from shardkit.optim.grad_scaler import ShardedGradScaler
from shardkit.testing import world_fixture


world2 = world_fixture(2)


def _error_of(build) -> tuple:
    """(exception type name, message, collectives issued while wrapping)."""
    with skdist.CommCounter() as comm:
        try:
            build()
        except (TypeError, ValueError) as e:
            return type(e).__name__, str(e), len(comm.calls)
    return None, "", len(comm.calls)


def _check_bad_inputs():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    stranger = nn.Linear(4, 4)
    oss = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    oss_elsewhere = OSS(stranger.parameters(), optim=torch.optim.SGD, lr=0.1)
    oss_partial = OSS(model[0].parameters(), optim=torch.optim.SGD, lr=0.1)
    only_rank0 = skdist.new_group([0])
    mixed = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, device="meta"))
    mixed[1].requires_grad_(False)
    oss_mixed = OSS(mixed[0].parameters(), optim=torch.optim.SGD, lr=0.1)
    oss_lbfgs = OSS(model.parameters(), optim=torch.optim.LBFGS, lr=0.1)
    cases = {
        "plain_optimizer": lambda: ShardedDataParallel(
            model, torch.optim.SGD(model.parameters(), lr=0.1)),
        "foreign_params": lambda: ShardedDataParallel(model, oss_elsewhere),
        "other_group": lambda: ShardedDataParallel(model, oss, process_group=only_rank0),
        "uncovered_trainable": lambda: ShardedDataParallel(model, oss_partial),
        "bucket_size": lambda: ShardedDataParallel(model, oss, reduce_buffer_size=-1),
        "reduce_fp16": lambda: ShardedDataParallel(model, oss, reduce_fp16="yes"),
        "comm": lambda: ShardedDataParallel(model, oss, comm="gloo"),
        "max_inflight_bytes": lambda: ShardedDataParallel(model, oss, max_inflight_bytes=-5),
        "empty_list": lambda: ShardedDataParallel(model, []),
        "not_a_module": lambda: ShardedDataParallel(lambda x: x, oss),
        "mixed_device_types": lambda: ShardedDataParallel(mixed, oss_mixed),
        "step_in_backward_flag": lambda: ShardedDataParallel(model, oss, step_in_backward=1),
        "step_in_backward_lbfgs": lambda: ShardedDataParallel(model, oss_lbfgs,
                                                              step_in_backward=True),
        # a string would read as True and silently turn the option on
        "broadcast_buffers_str": lambda: ShardedDataParallel(model, oss, broadcast_buffers="no"),
        "sync_at_startup_str": lambda: ShardedDataParallel(model, oss,
                                                           sync_models_at_startup="no"),
        "auto_refresh_none": lambda: ShardedDataParallel(model, oss, auto_refresh_trainable=None),
    }
    return {name: _error_of(build) for name, build in cases.items()}


EXPECTED = {
    "plain_optimizer": ("TypeError", "sharded_optimizer=<torch.optim.sgd.SGD>"),
    "foreign_params": ("ValueError", "is not a parameter of the wrapped module"),
    "other_group": ("ValueError", "optimizer's group has ranks [0, 1]"),
    "uncovered_trainable": ("ValueError", "['1.weight', '1.bias']"),
    "bucket_size": ("ValueError", "reduce_buffer_size=-1"),
    "reduce_fp16": ("ValueError", "reduce_fp16='yes'"),
    "comm": ("TypeError", "comm='gloo'"),
    "max_inflight_bytes": ("ValueError", "max_inflight_bytes=-5"),
    "empty_list": ("ValueError", "sharded_optimizer=[]"),
    "not_a_module": ("TypeError", "expected an nn.Module"),
    "mixed_device_types": ("ValueError", "several types ['cpu', 'meta']"),
    "step_in_backward_flag": ("TypeError", "step_in_backward=1"),
    "step_in_backward_lbfgs": ("ValueError", "the optimizer LBFGS does not update each"),
    "broadcast_buffers_str": ("TypeError", "broadcast_buffers='no'): expected True or False"),
    "sync_at_startup_str": ("TypeError", "sync_models_at_startup='no'): expected True or"),
    "auto_refresh_none": ("TypeError", "auto_refresh_trainable=None): expected True or"),
}


def test_bad_input_is_rejected_before_any_collective(world2):
    for per_rank in world2.run(_check_bad_inputs):
        for name, (kind, fragment) in EXPECTED.items():
            got_kind, message, collectives = per_rank[name]
            assert got_kind == kind, (name, got_kind, message)
            assert fragment in message, (name, message)
            assert collectives == 0, (name, collectives)


class Named(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.greeting = "hello"
        self.register_buffer("count", torch.zeros(1))

    def forward(self, x):
        return self.lin(x)

    def twice(self, x):
        return 2 * x


def _check_ddp_attributes_and_double_backward():
    torch.manual_seed(0)
    model = Named()
    oss = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    wrapped = ShardedDataParallel(model, oss)
    attrs = dict(device_type=wrapped.device_type, multi=wrapped.is_multi_device_module,
                 device_ids=wrapped.device_ids, output_device=wrapped.output_device,
                 dim=wrapped.dim, sync=wrapped.require_backward_grad_sync,
                 cap=wrapped.bucket_bytes_cap, greeting=wrapped.greeting,
                 twice=wrapped.twice(3), lin=wrapped.lin is model.lin,
                 fairscale=(wrapped.sharded_optimizers == [oss], wrapped.reduce_fp16,
                            wrapped.reduce_buffer_size, wrapped.auto_refresh_trainable))
    with wrapped.no_sync():
        attrs["sync_inside_no_sync"] = wrapped.require_backward_grad_sync
    try:
        wrapped.not_there
    except AttributeError as e:
        attrs["missing"] = str(e)
    model.count.fill_(skdist.get_rank() + 5)
    wrapped.sync_buffers(blocking=True)
    attrs["synced_buffer"] = model.count.item()
    x = torch.randn(2, 3, generator=torch.Generator().manual_seed(skdist.get_rank()))
    errors = {}
    loss = wrapped(x).pow(2).sum()
    with skdist.CommCounter() as comm:
        try:  # a gradient penalty: the first backward builds a graph of the gradients
            torch.autograd.backward(loss, create_graph=True)
        except RuntimeError as e:
            errors["create_graph"] = str(e)
    errors["collectives"] = len(comm.calls)
    oss.zero_grad()
    with wrapped.no_sync():  # no reduction: a create_graph backward is fine here
        torch.autograd.backward(wrapped(x).pow(2).sum(), create_graph=True)
    try:  # the next synchronised forward refuses gradients that are part of a graph
        wrapped(x)
    except RuntimeError as e:
        errors["forward"] = str(e)
    oss.zero_grad()
    wrapped(x).sum().backward()  # an ordinary step still works afterwards
    oss.step()
    weights = skdist.all_gather_object(model.lin.weight.detach().clone())
    return attrs, errors, torch.equal(*weights)


def test_ddp_attributes_forwarding_and_double_backward_error(world2):
    for attrs, errors, same in world2.run(_check_ddp_attributes_and_double_backward):
        assert attrs["device_type"] == "cpu" and attrs["multi"] is False
        assert attrs["device_ids"] is None and attrs["output_device"] is None
        assert attrs["dim"] == 0 and attrs["sync"] is True and attrs["sync_inside_no_sync"] is False
        assert attrs["cap"] == 2 ** 23 and attrs["greeting"] == "hello" and attrs["twice"] == 6
        assert attrs["lin"] and "not_there" in attrs["missing"] and attrs["synced_buffer"] == 5
        assert attrs["fairscale"] == (True, False, 2 ** 23, True), attrs
        assert "double backward through the gradient reduction" in errors["create_graph"]
        assert errors["collectives"] == 0
        assert "requires grad" in errors["forward"]
        assert same


class WithBuffer(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(3, 3)
        self.register_buffer("running", torch.zeros(3))

    def forward(self, x):
        return self.lin(x) + self.running


def _check_broadcasts():
    rank = skdist.get_rank()
    out = {}
    for sync, broadcast in ((True, True), (False, False)):
        torch.manual_seed(rank)  # different weights on every rank
        model = WithBuffer()
        model.running.fill_(float(rank + 1))
        oss = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
        wrapped = ShardedDataParallel(model, oss, broadcast_buffers=broadcast,
                                      sync_models_at_startup=sync)
        weights_at_wrap = skdist.all_gather_object(model.lin.weight.detach().clone())
        model.running.fill_(float(10 + rank))
        wrapped(torch.ones(1, 3))
        out[sync] = dict(same_weights=torch.equal(*weights_at_wrap),
                         buffer=model.running.tolist())
    return out


def test_startup_sync_and_buffer_broadcast(world2):
    for rank, r in enumerate(world2.run(_check_broadcasts)):
        assert r[True]["same_weights"] and r[True]["buffer"] == [10.0] * 3
        assert not r[False]["same_weights"] and r[False]["buffer"] == [10.0 + rank] * 3


def _check_scaler_with_sharded_grads():
    """Only the owner sees a parameter's (reduced) gradient; an inf produced on one rank must
    still make every rank skip, and a clean step must then update every rank alike."""
    rank = skdist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    oss = OSS(model.parameters(), optim=torch.optim.AdamW, lr=1e-2)
    wrapped = ShardedDataParallel(model, oss)
    scaler = ShardedGradScaler("cpu", init_scale=2.0 ** 10)
    before = [p.detach().clone() for p in model.parameters()]
    results = []
    for poison in (True, False):
        oss.zero_grad()
        x = torch.ones(2, 4)
        if poison and rank == 1:
            x[0, 0] = float("inf")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            loss = wrapped(x).float().pow(2).mean()
        scaler.scale(loss).backward()
        scaler.step(oss)
        scaler.update()
        unchanged = all(torch.equal(a, b) for a, b in zip(before, model.parameters()))
        results.append((unchanged, scaler.get_scale()))
    weights = skdist.all_gather_object([p.detach().clone() for p in model.parameters()])
    same = all(torch.equal(a, b) for a, b in zip(*weights))
    return results, same


def test_grad_scaler_skips_on_every_rank_with_sharded_grads(world2):
    for results, same_everywhere in world2.run(_check_scaler_with_sharded_grads):
        assert results == [(True, 512.0), (False, 512.0)]
        assert same_everywhere


class _FailInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        raise RuntimeError("planned failure in backward")


def _check_recovery_after_failed_backward():
    """A backward that raises half-way (same on every rank) leaves no stale state: the next
    step reduces normally and matches the single-process oracle."""
    rank, n = skdist.get_rank(), skdist.get_world_size()
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Tanh(), nn.Linear(8, 2))
    oss = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    wrapped = ShardedDataParallel(model, oss, reduce_buffer_size=0)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(rank))
    failed = False
    try:  # the last layer's gradients are launched, then backward raises
        model[2](_FailInBackward.apply(model[1](model[0](x)))).sum().backward()
    except RuntimeError as e:
        failed = "planned failure" in str(e)
    oss.zero_grad()
    wrapped(x).sum().backward()
    oss.step()
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for r in range(n):
        xr = torch.randn(2, 4, generator=torch.Generator().manual_seed(r))
        (ref(xr).sum() / n).backward()
    ref_opt.step()
    diff = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), model.parameters()))
    return failed, diff


def test_recovers_after_a_failed_backward(world2):
    for failed, diff in world2.run(_check_recovery_after_failed_backward):
        assert failed and diff <= 1e-6


class SharedAcrossReentrantCheckpoint(nn.Module):
    """``mid`` runs inside a reentrant checkpoint and again outside it: its gradient is
    accumulated twice in one backward (the second time by the checkpoint's own backward)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.mid, self.b = nn.Linear(4, 6), nn.Linear(6, 6), nn.Linear(6, 2)

    def forward(self, x):
        h = torch.utils.checkpoint.checkpoint(lambda t: torch.tanh(self.mid(t)),
                                              torch.tanh(self.a(x)), use_reentrant=True)
        return self.b(torch.tanh(self.mid(h)))


def _check_gradient_arriving_twice():
    """Refused on every rank (as torch DDP refuses it) instead of leaving the second part of
    the gradient unreduced; the advised no_sync() + reduce() then trains like one process."""
    rank, n = skdist.get_rank(), skdist.get_world_size()
    model, ref = SharedAcrossReentrantCheckpoint(), SharedAcrossReentrantCheckpoint()
    oss = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    wrapped = ShardedDataParallel(model, oss, reduce_buffer_size=0)
    x = [torch.randn(3, 4, generator=torch.Generator().manual_seed(r)) for r in range(n)]
    error = ""
    try:
        wrapped(x[rank]).sum().backward()
    except RuntimeError as e:
        error = str(e)
    for _ in range(2):
        oss.zero_grad()
        with wrapped.no_sync():
            wrapped(x[rank]).sum().backward()
        wrapped.reduce()
        oss.step()
        ref_opt.zero_grad()
        for xr in x:
            (ref(xr).sum() / n).backward()
        ref_opt.step()
    diff = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), model.parameters()))
    return error, diff


def test_gradient_arriving_twice_in_one_backward_is_refused(world2):
    for error, diff in world2.run(_check_gradient_arriving_twice):
        assert "twice in one backward" in error and "mid." in error, error
        assert diff <= 1e-6


class Reversed(nn.Module):
    """Registered c, b, a but used a -> b -> c: registration order is not backward order."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.c = nn.Linear(6, 2)
        self.b = nn.Linear(6, 6)
        self.a = nn.Linear(3, 6)

    def forward(self, x):
        return self.c(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _check_bucket_order_is_learned():
    rank, n = skdist.get_rank(), skdist.get_world_size()
    model, ref = Reversed(), Reversed()
    oss = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1, momentum=0.9)
    wrapped = ShardedDataParallel(model, oss, reduce_buffer_size=0)
    names = {p: name for name, p in model.named_parameters()}
    planned = [names[b.params[0]].split(".")[0] for b in wrapped.buckets]
    for step in range(3):
        x = [torch.randn(4, 3, generator=torch.Generator().manual_seed(10 * step + r))
             for r in range(n)]
        oss.zero_grad()
        wrapped(x[rank]).sum().backward()
        oss.step()
        ref_opt.zero_grad()
        for xr in x:
            (ref(xr).sum() / n).backward()
        ref_opt.step()
    learned = [names[b.params[0]].split(".")[0] for b in wrapped.buckets]
    diff = max((a - b).abs().max().item() for a, b in zip(ref.parameters(), model.parameters()))
    return planned, learned, diff


def test_buckets_follow_the_observed_backward_order(world2):
    for planned, learned, diff in world2.run(_check_bucket_order_is_learned):
        assert planned == ["a", "a", "b", "b", "c", "c"]  # reverse registration, before
        assert learned == ["c", "c", "b", "b", "a", "a"]  # the order gradients arrived
        assert diff <= 1e-6


def _check_step_in_backward_refusals():
    """After a backward that already stepped (step_in_backward=True), clipping, a step with a
    closure, a manual reduce() and ShardedGradScaler's or torch's GradScaler's step are refused
    by name instead of acting on gradients already applied."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
    oss = OSS(model.parameters(), optim=torch.optim.AdamW, lr=0.1)
    wrapped = ShardedDataParallel(model, oss, step_in_backward=True)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(skdist.get_rank()))
    wrapped(x).sum().backward()
    errors = {}
    try:
        oss.clip_grad_norm(1.0)
    except RuntimeError as e:
        errors["clip"] = str(e)
    try:
        oss.step(closure=lambda: 0.0)
    except ValueError as e:
        errors["closure"] = str(e)
    try:  # a manual reduction would step the owners a second time
        wrapped.reduce()
    except RuntimeError as e:
        errors["reduce"] = str(e)
    try:  # a second reducing backward would step the owners again
        wrapped(x).sum().backward()
    except RuntimeError as e:
        errors["second backward"] = str(e)
    oss.step()  # nothing left to do
    scaler = ShardedGradScaler("cpu", init_scale=4.0)
    oss.zero_grad()
    scaler.scale(wrapped(x).sum()).backward()  # stepped with the scaled gradients already
    try:
        scaler.step(oss)
    except RuntimeError as e:
        errors["scaler"] = str(e)
    oss.step()
    torch_scaler = torch.amp.GradScaler("cpu", init_scale=4.0)  # torch's own, too
    oss.zero_grad()
    torch_scaler.scale(wrapped(x).sum()).backward()
    try:
        torch_scaler.step(oss)
    except RuntimeError as e:
        errors["torch scaler"] = str(e)
    oss.step()  # the next iteration runs as usual
    oss.zero_grad()
    wrapped(x).sum().backward()
    oss.step()
    oss.wait_for_sync()
    weights = skdist.all_gather_object([p.detach().clone() for p in model.parameters()])
    return errors, all(torch.equal(a, b) for a, b in zip(*weights))


def test_step_in_backward_refuses_clipping_closures_and_loss_scaling(world2):
    for errors, same_weights in world2.run(_check_step_in_backward_refusals):
        assert "already stepped" in errors["clip"], errors
        assert "call optimizer.step() bare" in errors["closure"], errors
        assert "already stepped on the last reduction" in errors["reduce"], errors
        assert "would step them again" in errors["second backward"], errors
        assert "step_in_backward=False to use loss scaling" in errors["scaler"], errors
        assert "step_in_backward=False to use loss scaling" in errors["torch scaler"], errors
        assert same_weights


def _stale_plan_warning():
    import warnings
    torch.manual_seed(0)
    out = {}
    for warn in (True, False):
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        model[0].requires_grad_(False)
        oss = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
        ddp = ShardedDataParallel(model, oss, auto_refresh_trainable=False,
                                  warn_on_trainable_params_changed=warn)
        x = torch.randn(3, 4)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            ddp(x).sum().backward()          # planned as built: no warning
            model[0].requires_grad_(True)
            ddp(x).sum().backward()          # stale: one warning
            ddp(x).sum().backward()          # the same change: no second warning
        stale = [str(w.message) for w in caught if "refresh_trainable" in str(w.message)]
        ddp.refresh_trainable()
        ddp.zero_grad()
        with warnings.catch_warnings(record=True) as after:
            warnings.simplefilter("always")
            ddp(x).sum().backward()
        out[warn] = (len(stale), sum("refresh_trainable" in str(w.message) for w in after))
    return out


def test_stale_trainable_set_warns_once_without_auto_refresh(world2):
    """FairScale's ``warn_on_trainable_params_changed``: with ``auto_refresh_trainable=False`` a
    newly trainable parameter would go unreduced until ``refresh_trainable()``; forward says so
    once per change (and stays quiet when asked to, or once refreshed)."""
    for r in world2.run(_stale_plan_warning):
        assert r[True] == (1, 0), r
        assert r[False] == (0, 0), r


def _param_added_outside_the_module():
    """A parameter that is not the module's (a learnable loss temperature) added to OSS after
    wrapping: no hook would ever average its gradient, so its owner would step it with its own
    batch's gradient alone. Refused at the next forward (or refresh_trainable) on every rank,
    before any of the wrapper's collectives, as at construction."""
    out = {}
    for auto in (True, False):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 2))
        oss = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
        ddp = ShardedDataParallel(model, oss, auto_refresh_trainable=auto)
        temperature = nn.Parameter(torch.ones(()))
        oss.add_param_group({"params": [temperature]})
        with skdist.CommCounter() as comm:
            try:
                ddp(torch.ones(2, 4)) if auto else ddp.refresh_trainable()
                out[auto] = None
            except ValueError as e:
                out[auto] = (str(e), len(comm.calls))
    return out


def test_parameter_added_outside_the_module_is_refused(world2):
    for r in world2.run(_param_added_outside_the_module):
        for auto in (True, False):
            assert r[auto] is not None, "a parameter outside the module was accepted"
            message, collectives = r[auto]
            assert "param_groups[1]['params'][0] (shape ()) is not a parameter of the wrapped " \
                   "module (its gradient would never be averaged)" in message, message
            assert collectives == 0


def _requires_grad_changed_on_one_rank():
    """``requires_grad`` changed on rank 1 only: the forward (auto_refresh_trainable) and
    ``reduce()`` raise on every rank alike instead of one rank re-planning alone and the other
    hanging in its collectives, also inside an accumulation window (the reducing backward and
    ``reduce()`` agree with the rank that agreed at its forward); nothing is re-planned, so
    once the flag is restored training goes on in step on every rank."""
    rank = skdist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4), nn.Linear(4, 2))
    oss = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    ddp = ShardedDataParallel(model, oss)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))
    out = {}

    def attempt(name, fn):
        try:
            fn()
            out[name] = None
        except (ValueError, RuntimeError) as e:
            out[name] = f"{type(e).__name__}: {e}"

    ddp(x).sum().backward()
    oss.step()
    oss.zero_grad()
    model[1].weight.requires_grad_(rank != 1)
    attempt("forward", lambda: ddp(x))
    model[1].weight.requires_grad_(True)
    with ddp.no_sync():
        ddp(x).sum().backward()
    model[2].bias.requires_grad_(rank != 1)
    attempt("reduce", ddp.reduce)
    model[2].bias.requires_grad_(True)
    ddp.reduce()
    oss.step()
    oss.zero_grad()
    # inside an accumulation window (after a no_sync() backward) on rank 1 only: rank 1 agrees
    # at its forward, rank 0 at the start of its reducing backward, or at reduce() (hung)
    for end in ("backward", "reduce"):
        with ddp.no_sync():
            ddp(x).sum().backward()
        model[1].bias.requires_grad_(rank != 1)

        def finish_window():
            loss = ddp(x).sum()
            if end == "reduce":
                with ddp.no_sync():
                    loss.backward()
                ddp.reduce()
            else:
                loss.backward()
        attempt(f"window_{end}", finish_window)
        model[1].bias.requires_grad_(True)
        ddp.zero_grad()
    # frozen inside a window on every rank while holding the window's gradient: one process
    # would still step it with that gradient; ShardedDDP would neither reduce nor step it
    with ddp.no_sync():
        ddp(x).sum().backward()
    model[0].weight.requires_grad_(False)
    attempt("frozen_holding_grad", lambda: ddp(x))
    model[0].weight.requires_grad_(True)
    ddp.zero_grad()
    ddp(x).sum().backward()
    oss.step()
    weights = skdist.all_gather_object([p.detach().clone() for p in model.parameters()])
    out["in_step"] = all(torch.equal(a, b) for a, b in zip(*weights))
    return out


def test_requires_grad_changed_on_one_rank_raises_on_every_rank(world2):
    first, second = world2.run(_requires_grad_changed_on_one_rank)
    assert first == second, (first, second)
    assert first["forward"].startswith("ValueError: ShardedDataParallel: parameter '1.weight'"
                                       ".requires_grad is True on rank 0 of the group and False "
                                       "on rank 1; change requires_grad identically"), first
    assert first["reduce"].startswith("RuntimeError: ShardedDataParallel.reduce(): the "
                                      "trainable parameters changed"), first
    for end in ("backward", "reduce"):
        assert first[f"window_{end}"].startswith(
            "ValueError: ShardedDataParallel: parameter '1.bias'.requires_grad is True on rank 0 "
            "of the group and False on rank 1; change requires_grad identically"), first
    assert first["frozen_holding_grad"].startswith(
        "ValueError: ShardedDataParallel: requires_grad turned False on ['0.weight'] inside an "
        "accumulation window"), first
    assert first["in_step"]


def _rank0_evaluates_alone():
    """Rank 0 alone runs evaluation forwards with grad enabled (module.eval(), as after
    DeepSpeed's ``engine.eval()``), before the first step, between backward and step and after
    the last step: no collective, so the ranks stay in step (the agreement on the trainable set
    is made at training forwards only)."""
    rank = skdist.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.ReLU(), nn.Linear(8, 2))
    oss = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    ddp = ShardedDataParallel(model, oss)
    x = torch.randn(3, 4, generator=torch.Generator().manual_seed(rank))

    def evaluate():
        if rank == 0:
            ddp.eval()
            ddp(x).sum().item()
            ddp.train()
    evaluate()
    for _ in range(2):
        ddp(x).sum().backward()
        evaluate()
        oss.step()
        oss.zero_grad()
    evaluate()
    weights = skdist.all_gather_object([p.detach().clone() for p in model.parameters()])
    return all(torch.equal(a, b) for a, b in zip(*weights))


def test_one_rank_evaluating_with_grad_enabled_does_not_hang(world2):
    assert world2.run(_rank0_evaluates_alone) == [True, True]


def _step_skipped_on_one_rank():
    """Rank 1 skips one ``optimizer.step()`` (a loss it alone found bad) and goes on: its next
    forward's trainable-set agreement met rank 0's OSS step agreement, rows of 1 and 2 int64s
    (gloo aborted rank 1; rank 0 read the short row as a method code: a bare IndexError)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 4))
    optimizer = OSS(model.parameters(), lr=0.1)
    ddp = ShardedDataParallel(model, optimizer)
    rank = skdist.get_rank()
    try:
        for step in range(2):
            ddp(torch.ones(2, 4) * (rank + 1)).sum().backward()
            if not (step == 0 and rank == 1):
                optimizer.step()
            optimizer.zero_grad()
    except RuntimeError as error:
        message = str(error)
    else:
        message = "no error"
    # the check ran before anything else was sent: the ranks can agree again afterwards
    skdist.barrier()
    return message


def test_a_step_skipped_on_one_rank_names_where_each_rank_is(world2):
    oss, sdp = world2.run(_step_skipped_on_one_rank)
    for message in (oss, sdp):
        assert "the ranks of the group are not in the same collective call" in message, message
        assert "group rank(s) [0] in an OSS call's agreement (OSS.step," in message
        assert "group rank(s) [1] in ShardedDataParallel's agreement on the trainable" in message
    assert oss.startswith("OSS.step's agreement:")
    assert sdp.startswith("ShardedDataParallel (its ranks' agreement")
