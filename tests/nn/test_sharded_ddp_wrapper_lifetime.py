"""ShardedDataParallel's hooks live as long as the wrapper is the one in use, as FairScale's
ShardedDDP and torch DDP's do.

A module wrapped by a second ShardedDataParallel while the user keeps it (a new optimizer for a
fine-tuning stage, a resume, Lightning re-wrapping at each ``fit()``, ``shardkit.initialize``
called again at ZeRO stage 2) trains exactly as one process on the global batch: the earlier
wrapper, kept or dropped, reduces nothing more. A wrapper the user dropped is freed, so a
backward through the kept module afterwards (rank 0 alone computing input gradients, or the
module re-wrapped in torch DDP) runs no collective of its."""

import gc
import weakref

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as skdist
from shardkit.nn.data_parallel import ShardedDataParallel
from shardkit.optim import OSS
from shardkit.testing import world_fixture

LOCAL_BATCH = 4

world2 = world_fixture(2)


def _model():
    torch.manual_seed(3)
    return nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3))


def _step(model, optimizer, step: int, local: bool) -> None:
    """One step on the global batch (``local=False``) or on this rank's slice of it."""
    rank, world = skdist.get_rank(), skdist.get_world_size()
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(LOCAL_BATCH * world, 6, generator=gen)
    y = torch.randn(LOCAL_BATCH * world, 3, generator=gen)
    if local:
        mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
        x, y = x[mine], y[mine]
    optimizer.zero_grad()
    F.mse_loss(model(x), y).backward()
    optimizer.step()


def _max_diff(model, oracle) -> float:
    return max((a - b).abs().max().item() for a, b in zip(model.parameters(),
                                                          oracle.parameters()))


def _rewrap(keep_first: str):
    """Three steps under one wrapper, then three under a new one (and a new OSS); with
    ``keep_first == "forward_again"`` the first wrapper then trains once more."""
    oracle, model = _model(), _model()
    ref = torch.optim.SGD(oracle.parameters(), lr=0.1, momentum=0.9)
    first_opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    first = ShardedDataParallel(model, first_opt)
    worst, step = 0.0, 0
    for _ in range(3):
        _step(oracle, ref, step, local=False)
        _step(first, first_opt, step, local=True)
        step += 1
    first_opt.consolidate_state_dict(recipient_rank=-1)
    state = first_opt.state_dict()
    second_opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    second_opt.load_state_dict(state)
    first_alive = weakref.ref(first)
    if keep_first == "dropped":
        del first, first_opt
        gc.collect()
    second = ShardedDataParallel(model, second_opt)
    for _ in range(3):
        _step(oracle, ref, step, local=False)
        _step(second, second_opt, step, local=True)
        worst = max(worst, _max_diff(model, oracle))
        step += 1
    if keep_first == "forward_again":  # the wrapper whose forward runs reduces, alone
        second_opt.consolidate_state_dict(recipient_rank=-1)
        first_opt.load_state_dict(second_opt.state_dict())
        _step(oracle, ref, step, local=False)
        _step(first, first_opt, step, local=True)
        worst = max(worst, _max_diff(model, oracle))
    return worst, first_alive() is None


def test_second_wrapper_of_a_kept_module_trains_as_one_process(world2):
    for keep_first in ("kept", "dropped", "forward_again"):
        for worst, first_freed in world2.run(_rewrap, keep_first):
            assert worst < 1e-6, (keep_first, worst)
            if keep_first == "dropped":  # its hooks no longer keep it (and its buckets) alive
                assert first_freed


def _train_then_drop():
    """Two ShardedDDP steps, then the wrapper and its optimizer are dropped; the model is kept."""
    model = _model()
    optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    wrapped = ShardedDataParallel(model, optimizer)
    for step in range(2):
        _step(wrapped, optimizer, step, local=True)
    freed = weakref.ref(wrapped)
    del wrapped, optimizer
    gc.collect()
    return model, freed() is None


def _dropped_wrapper_is_freed():
    return _train_then_drop()[1]


def _one_rank_backward_after_drop():
    model, _ = _train_then_drop()
    if skdist.get_rank() != 0:
        return None
    x = torch.randn(2, 6, requires_grad=True)
    model(x).sum().backward()  # rank 0 alone: no collective may wait for rank 1
    return all(p.grad is not None for p in model.parameters())


def test_dropped_wrapper_is_freed_and_a_one_rank_backward_runs_no_collective(world2):
    # checked first: a wrapper still alive would hang the one-rank backward below
    assert world2.run(_dropped_wrapper_is_freed) == [True, True]
    assert world2.run(_one_rank_backward_after_drop) == [True, None]


def _initialize_twice_at_stage_2():
    """``shardkit.initialize`` at ZeRO stage 2, two steps, then again on the same model with a
    new optimizer (a second training phase, as a trainer that re-initializes does): the second
    engine trains as one process."""
    import shardkit
    rank, world = skdist.get_rank(), skdist.get_world_size()
    config = {"train_micro_batch_size_per_gpu": LOCAL_BATCH, "steps_per_print": 1000,
              "zero_optimization": {"stage": 2}}
    oracle, model = _model(), _model()
    ref = torch.optim.SGD(oracle.parameters(), lr=0.1)
    mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    for phase, lr in enumerate((0.1, 0.05)):
        engine, *_ = shardkit.initialize(
            model=model, optimizer=torch.optim.SGD(model.parameters(), lr=lr), config=config)
        for group in ref.param_groups:
            group["lr"] = lr
        for step in range(2 * phase, 2 * phase + 2):
            gen = torch.Generator().manual_seed(step)
            x = torch.randn(LOCAL_BATCH * world, 6, generator=gen)
            y = torch.randn(LOCAL_BATCH * world, 3, generator=gen)
            engine.backward(F.mse_loss(engine(x[mine]), y[mine]))
            engine.step()
            ref.zero_grad()
            F.mse_loss(oracle(x), y).backward()
            ref.step()
    return _max_diff(model, oracle)


def test_initialize_again_on_the_same_model_at_stage_2_trains_as_one_process(world2):
    for worst in world2.run(_initialize_twice_at_stage_2):
        assert worst < 1e-6, worst


def _no_grad_forward_of_another_wrapper_before_backward(which: str):
    """Three steps of the newest wrapper, each with a forward under ``torch.no_grad()`` of an
    earlier wrapper of the same parameters between its forward and its backward: the one kept
    from a first phase (``"kept"``), or one of the encoder alone (``"encoder"``, a target or
    feature pass as in MoCo-style training)."""
    oracle, model = _model(), _model()
    ref = torch.optim.SGD(oracle.parameters(), lr=0.1, momentum=0.9)
    part = model if which == "kept" else model[0]
    other = ShardedDataParallel(part, OSS(part.parameters(), optim=torch.optim.SGD, lr=0.1))
    optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    wrapped = ShardedDataParallel(model, optimizer)
    worst = 0.0
    for step in range(3):
        _step(oracle, ref, step, local=False)
        x, y = _batch(step)
        optimizer.zero_grad()
        loss = F.mse_loss(wrapped(x), y)
        with torch.no_grad():  # arms nothing: no backward of this forward will follow
            other(x)
        loss.backward()
        optimizer.step()
        worst = max(worst, _max_diff(model, oracle))
    return worst


def _batch(step: int):
    """This rank's slice of ``_step``'s global batch ``step``."""
    rank, world = skdist.get_rank(), skdist.get_world_size()
    gen = torch.Generator().manual_seed(100 + step)
    x = torch.randn(LOCAL_BATCH * world, 6, generator=gen)
    y = torch.randn(LOCAL_BATCH * world, 3, generator=gen)
    mine = slice(rank * LOCAL_BATCH, (rank + 1) * LOCAL_BATCH)
    return x[mine], y[mine]


def test_no_grad_forward_of_an_earlier_wrapper_leaves_the_newest_one_reducing(world2):
    """Only a forward with gradients enabled takes the hooks back, as only such a forward arms
    torch DDP's reducer. Before: any forward of an earlier wrapper took every hook of the
    newest one's, and its backward then reduced nothing: each owner stepped on its own rank's
    gradients, silently."""
    for which in ("kept", "encoder"):
        for worst in world2.run(_no_grad_forward_of_another_wrapper_before_backward, which):
            assert worst < 1e-6, (which, worst)


def _parameters_swapped_by_load_state_dict() -> bool:
    """``load_state_dict`` through torch's ``swap_tensors`` (the path of
    ``torch.__future__.set_swap_module_params_on_conversion(True)``, which the engine's HF
    reloads take) on a wrapped module: torch refuses a tensor with a weak reference to it
    ("Cannot swap t1 because it has weakref associated with it"), so the wrapper must hold
    none."""
    model = _model()
    ShardedDataParallel(model, OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1))
    state = {k: v.clone() + 1 for k, v in model.state_dict().items()}
    _load_swapping(model, state)
    return all(torch.equal(model.state_dict()[k], v) for k, v in state.items())


def test_parameters_of_a_wrapped_module_can_be_swapped(world2):
    assert all(world2.run(_parameters_swapped_by_load_state_dict))


def _load_swapping(module: nn.Module, state: dict) -> None:
    """``module.load_state_dict(state)`` through ``torch.utils.swap_tensors``."""
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        module.load_state_dict(state)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)


def _trained_after_swapped_load(how: str):
    """Two steps, then ``load_state_dict`` through ``swap_tensors`` of the one-process model's
    values (equal to the wrapped ones), then four more steps: the largest difference from one
    process after them. ``how``: ``"kept"`` (the same wrapper trains on), ``"rewrapped"`` (the
    wrapper is dropped before the load and a new one wraps the module after it),
    ``"twice"`` (two swapped loads in a row, so the second may reuse the first's memory)."""
    oracle, model = _model(), _model()
    ref = torch.optim.SGD(oracle.parameters(), lr=0.1, momentum=0.9)
    optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
    wrapped = ShardedDataParallel(model, optimizer)
    for step in range(2):
        _step(oracle, ref, step, local=False)
        _step(wrapped, optimizer, step, local=True)
    if how == "rewrapped":
        optimizer.consolidate_state_dict(recipient_rank=-1)
        optimizer_state = optimizer.state_dict()
        del wrapped, optimizer
        gc.collect()
    for _ in range(2 if how == "twice" else 1):
        _load_swapping(model, {k: v.clone() for k, v in oracle.state_dict().items()})
    if how == "rewrapped":
        optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1, momentum=0.9)
        optimizer.load_state_dict(optimizer_state)
        wrapped = ShardedDataParallel(model, optimizer)
    worst = 0.0
    for step in range(2, 6):
        _step(oracle, ref, step, local=False)
        _step(wrapped, optimizer, step, local=True)
        worst = max(worst, _max_diff(model, oracle))
    return worst


def test_a_module_loaded_through_swap_tensors_trains_as_one_process(world2):
    """``swap_tensors`` gives each Parameter object another tensor; torch runs the gradient
    hooks attached to the old one only, so the wrapper reduced no gradient after such a load
    and every owner stepped on its own rank's (0.03 off after one step, 0.14 after four)."""
    for how in ("kept", "rewrapped", "twice"):
        for worst in world2.run(_trained_after_swapped_load, how):
            assert worst < 1e-6, (how, worst)


def _user_hook_after_swapped_load():
    """A hook the user registers on a parameter after a swapped load runs once per backward,
    beside the wrapper's (which the wrapper attaches to the new tensor)."""
    model = _model()
    optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    wrapped = ShardedDataParallel(model, optimizer)
    _step(wrapped, optimizer, 0, local=True)
    _load_swapping(model, {k: v.clone() for k, v in model.state_dict().items()})
    calls = []
    model[0].weight.register_hook(lambda grad: calls.append(1))
    _step(wrapped, optimizer, 1, local=True)
    return len(calls)


def test_a_users_hook_registered_after_a_swapped_load_runs(world2):
    assert world2.run(_user_hook_after_swapped_load) == [1, 1]


def _user_hooks_across_a_swap(how: str):
    """A hook the user registered on every parameter before a swapped load (one that returns
    None, changing nothing): how many times each ran, and the largest difference from one
    process, over ``how``: ``"rewrapped"`` (a step under a first wrapper, one under a second
    that is then dropped, the swapped load, three more under the first again) or ``"before"``
    (the swapped load before the module is wrapped, then three steps)."""
    oracle, model = _model(), _model()
    ref = torch.optim.SGD(oracle.parameters(), lr=0.1)
    calls = [0] * len(ref.param_groups[0]["params"])
    for i, p in enumerate(model.parameters()):
        p.register_hook(lambda grad, i=i: calls.__setitem__(i, calls[i] + 1))
    if how == "before":
        _load_swapping(model, {k: v.clone() for k, v in oracle.state_dict().items()})
    first_opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    first = ShardedDataParallel(model, first_opt)
    if how == "rewrapped":
        _step(oracle, ref, 0, local=False)
        _step(first, first_opt, 0, local=True)
        second_opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
        _step(oracle, ref, 1, local=False)
        _step(ShardedDataParallel(model, second_opt), second_opt, 1, local=True)
        _load_swapping(model, {k: v.clone() for k, v in oracle.state_dict().items()})
    worst = 0.0
    for step in range(2, 5):
        _step(oracle, ref, step, local=False)
        _step(first, first_opt, step, local=True)
        worst = max(worst, _max_diff(model, oracle))
    return calls, worst


def test_users_hooks_across_a_swap_run_once_and_training_matches_one_process(world2):
    """Hooking a parameter, the wrapper looked for a swap by the token of the wrapper whose
    hooks it carried: none past a dropped second wrapper (its hooks and tokens went with it),
    nor before the first wrap. Where the user had a hook on a parameter, the wrapper's hooks
    then went into the user's hook dict, still attached to the old tensor: autograd ran neither
    (each user hook ran 2 times in 5 backwards, 0 in 3), and with one on every parameter no
    gradient was reduced (0.05 off one process)."""
    for how, backwards in (("rewrapped", 5), ("before", 3)):
        for calls, worst in world2.run(_user_hooks_across_a_swap, how):
            assert calls == [backwards] * 4 and worst < 1e-6, (how, calls, worst)


def _converted_with_live_gradients():
    """A step, then ``.to(torch.float64)`` through ``swap_tensors`` while the reduced
    gradients are still in ``.grad`` (no ``zero_grad()`` yet), on the wrapper and on the
    one-process model alike, then three more steps, the first adding its gradients to those
    kept: the largest difference from one process and the dtypes of the kept gradients after
    the conversion."""
    oracle, model = _model(), _model()
    ref = torch.optim.SGD(oracle.parameters(), lr=0.1)
    optimizer = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    wrapped = ShardedDataParallel(model, optimizer)
    _step(oracle, ref, 0, local=False)
    _step(wrapped, optimizer, 0, local=True)
    previous = torch.__future__.get_swap_module_params_on_conversion()
    torch.__future__.set_swap_module_params_on_conversion(True)
    try:
        oracle.to(torch.float64)
        wrapped.to(torch.float64)
    finally:
        torch.__future__.set_swap_module_params_on_conversion(previous)
    dtypes = {p.grad.dtype for p in model.parameters() if p.grad is not None}
    worst = 0.0
    for step in range(1, 4):
        gen = torch.Generator().manual_seed(100 + step)
        x = torch.randn(LOCAL_BATCH * 2, 6, generator=gen, dtype=torch.float64)
        y = torch.randn(LOCAL_BATCH * 2, 3, generator=gen, dtype=torch.float64)
        mine = slice(skdist.get_rank() * LOCAL_BATCH, (skdist.get_rank() + 1) * LOCAL_BATCH)
        for net, opt, xs, ys in ((oracle, ref, x, y), (wrapped, optimizer, x[mine], y[mine])):
            if step > 1:
                opt.zero_grad()
            F.mse_loss(net(xs), ys).backward()
            opt.step()
        worst = max(worst, _max_diff(model, oracle))
    return worst, sorted(map(str, dtypes))


def test_conversion_through_swap_tensors_with_live_gradients(world2):
    """Before: the wrapper kept a weak reference to each reduced gradient it put in ``.grad``
    (to tell whether the next backward accumulates onto it), and ``swap_tensors`` refuses a
    tensor that has one: ``wrapped.to(torch.float64)`` under
    ``set_swap_module_params_on_conversion(True)`` raised before ``zero_grad()``."""
    for worst, dtypes in world2.run(_converted_with_live_gradients):
        assert worst < 1e-6 and dtypes in ([], ["torch.float64"]), (worst, dtypes)
