"""FSDP forward/backward core as torch FSDP2 / single-process users drive it:

- a unit kept gathered after its forward (the root; ``reshard_after_forward=False``) left its
  compute views as the module attributes until the backward or the next forward, so
  ``model.emb.weight`` read there was a view, not the parameter:
  ``loss.backward(inputs=[model.emb.weight])`` filled the view's ``.grad`` and left the
  parameter's ``None`` (silently: the optimizer skipped it), and a ``requires_grad_(False)``
  made between a forward and the next one raised torch's "you can only change requires_grad
  flags of leaf variables";
- ``optimizer.zero_grad()`` between micro-batches of a ``no_sync`` cycle (a skipped
  micro-batch) did not discard what the cycle had accumulated (held outside ``.grad``): the
  next synchronising backward added it to the new gradients (only ``model.zero_grad()``
  dropped it), where one process, DDP and FairScale's / torch's FSDP1 step with the new
  gradients only; and ``.grad`` changed in place inside the cycle without clearing it (a
  ``clip_grad_norm_`` or an unscale between micro-batches) must keep what it accumulated.

One world of 2.
"""

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed as skdist
from shardkit.testing import world_fixture

world2 = world_fixture(2)


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.a = nn.Linear(8, 16)
        self.b = nn.Linear(16, 8)

    def forward(self, x):
        return x + self.b(torch.tanh(self.a(x)))


class TiedNet(nn.Module):
    """Tied embedding and head in the root unit, two blocks as inner units."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 11, bias=False)
        self.head.weight = self.emb.weight
        self.skip_last_block = False

    def forward(self, idx):
        h = self.emb(idx)
        for block in self.blocks[:1] if self.skip_last_block else self.blocks:
            h = block(h)
        return self.head(h)


def _local(t: torch.Tensor) -> torch.Tensor:
    per = t.shape[0] // skdist.get_world_size()
    return t[skdist.get_rank() * per:(skdist.get_rank() + 1) * per]


def _batch(step: int) -> tuple:
    g = torch.Generator().manual_seed(100 + step)
    return torch.randint(0, 11, (8, 5), generator=g), torch.randint(0, 11, (8, 5), generator=g)


def _loss(model, idx, target) -> torch.Tensor:
    return F.cross_entropy(model(idx).reshape(-1, 11), target.reshape(-1))


def _wrapped(reshard_after_forward: bool):
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    torch.manual_seed(0)
    reference = TiedNet()
    model = copy.deepcopy(reference)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = FSDP(block, reshard_after_forward=reshard_after_forward)
    return reference, FSDP(model, reshard_after_forward=reshard_after_forward)


def _shard_grad_error(model, reference, name: str) -> float:
    """Largest difference between ``name``'s gradient shard and its rows of the reference's
    gradient (inf when exactly one of the two is ``None``)."""
    from shardkit.nn.data_parallel.flat_param import shard_rows
    mine = dict(model.named_parameters())
    mine = {n.replace("_fsdp_wrapped_module.", ""): p for n, p in mine.items()}[name]
    theirs = dict(reference.named_parameters())[name].grad
    if mine.grad is None or theirs is None:
        return 0.0 if mine.grad is None and theirs is None else float("inf")
    expected = shard_rows(theirs, model._param_layouts()[id(mine)], model.rank)
    return (mine.grad - expected).abs().max().item()


def _backward_with_inputs_read_from_the_modules(reshard_after_forward: bool) -> dict:
    reference, model = _wrapped(reshard_after_forward)
    idx, target = _batch(0)
    ref_loss = _loss(reference, idx, target)
    ref_loss.backward(inputs=[reference.emb.weight, reference.blocks[1].a.weight])
    loss = _loss(model, _local(idx), _local(target))
    inner = model.module
    read = {"emb": inner.emb.weight, "blocks.1": inner.blocks[1].module.a.weight}
    loss.backward(inputs=[read["emb"], read["blocks.1"]])
    owned = {"emb": model.module.emb._parameters["weight"],
             "blocks.1": inner.blocks[1].module.a._parameters["weight"]}
    out = {f"{k} read is the parameter": read[k] is owned[k] for k in read}
    for name in ("emb.weight", "blocks.1.a.weight", "blocks.0.a.weight", "blocks.1.b.bias"):
        out[name] = _shard_grad_error(model, reference, name) < 1e-6
    return out


def test_backward_inputs_read_between_forward_and_backward_get_their_gradients(world2):
    """Regression: ``model.emb.weight`` read after the forward of a unit kept gathered (the
    root, and every unit with ``reshard_after_forward=False``) was the unit's compute view, so
    ``loss.backward(inputs=[model.emb.weight, ...])`` gave the tied embedding no gradient
    (``.grad`` None, as for a parameter left out) while one process gives it one; now the read
    is the parameter and its gradient shard is the reference's rows."""
    for keep in (True, False):
        for out in world2.run(_backward_with_inputs_read_from_the_modules, not keep):
            assert all(out.values()), (keep, {k: v for k, v in out.items() if not v})


def _freeze_between_forwards() -> dict:
    """A forward with gradients and no backward (a metric on the training batch), then the
    head frozen by attribute, then a training step: the frozen weight must not move."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    reference, model = _wrapped(True)
    optims = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (reference, model)]
    idx, target = _batch(1)
    for m, x in ((reference, idx), (model, _local(idx))):
        m(x)  # no backward
        inner = m.module if isinstance(m, FSDP) else m
        inner.head.weight.requires_grad_(False)  # the tied embedding too
    for (m, x, y), optim in zip(((reference, idx, target),
                                 (model, _local(idx), _local(target))), optims):
        _loss(m, x, y).backward()
        optim.step()
    with FSDP.summon_full_params(model):
        mine = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                for n, p in model.named_parameters()}
    return {name: (mine[name] - p.detach()).abs().max().item() < 1e-6
            for name, p in reference.named_parameters()}


def test_requires_grad_off_after_a_forward_without_backward_freezes_the_parameter(world2):
    """Regression: after a forward with no backward, ``model.head.weight.requires_grad_(False)``
    reached the root's kept view, not the parameter (torch: "you can only change requires_grad
    flags of leaf variables"); now it freezes the parameter, as in one process, and the next
    step leaves the tied embedding as it was."""
    for out in world2.run(_freeze_between_forwards):
        assert all(out.values()), {k: v for k, v in out.items() if not v}


def _optimizer_zero_grad_inside_no_sync(set_to_none: bool) -> dict:
    """Micro-batch 0 inside ``no_sync`` (every block), ``optimizer.zero_grad()``, micro-batch
    1 synchronising (the last block skipped), a step: against one process doing the same."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    reference, model = _wrapped(True)
    optims = [torch.optim.SGD(m.parameters(), lr=0.5) for m in (reference, model)]
    (idx0, target0), (idx1, target1) = _batch(2), _batch(3)
    _loss(reference, idx0, target0).backward()
    with model.no_sync():
        _loss(model, _local(idx0), _local(target0)).backward()
    for optim in optims:
        optim.zero_grad(set_to_none=set_to_none)
    reference.skip_last_block = model.module.skip_last_block = True
    _loss(reference, idx1, target1).backward()
    _loss(model, _local(idx1), _local(target1)).backward()
    out = {f"{name} grad": _shard_grad_error(model, reference, name) < 1e-6
           for name, _ in reference.named_parameters()}
    for optim in optims:
        optim.step()
    with FSDP.summon_full_params(model):
        mine = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                for n, p in model.named_parameters()}
    out.update({name: (mine[name] - p.detach()).abs().max().item() < 1e-6
                for name, p in reference.named_parameters()})
    return out


def test_optimizer_zero_grad_inside_no_sync_discards_the_accumulated_gradients(world2):
    """Regression: ``optimizer.zero_grad()`` after a backward inside ``no_sync`` left the
    held gradients in place, and the next synchronising backward reduced them with its own
    (every parameter off from one process, the skipped block given the discarded micro-batch's
    gradient instead of none); now they are dropped, with ``set_to_none`` True or False."""
    for set_to_none in (True, False):
        for out in world2.run(_optimizer_zero_grad_inside_no_sync, set_to_none):
            assert all(out.values()), (set_to_none, {k: v for k, v in out.items() if not v})


class Expert(Block):
    """A block that raises when told to (an out-of-memory error, a bad batch)."""

    fail = False

    def forward(self, x):
        out = super().forward(x)
        if Expert.fail:
            raise FloatingPointError("caught and skipped by the training loop")
        return out


class Experts(nn.Module):
    """Three experts, each its own unit; ``use`` picks those a forward runs."""

    def __init__(self):
        super().__init__()
        self.emb = nn.Embedding(11, 8)
        self.experts = nn.ModuleList([Expert() for _ in range(3)])
        self.head = nn.Linear(8, 11)
        self.use = (0, 1, 2)

    def forward(self, idx):
        h = self.emb(idx)
        return self.head(sum(self.experts[e](h) for e in self.use))


def _between_backward_and_step(extra_forward: str) -> list:
    """Per step: a training forward and backward over every expert, then ``extra_forward``
    (a forward that raises in expert 1, caught; or one under ``no_grad`` that runs expert 0
    only), then the optimizer step: the largest difference from one process after each."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    torch.manual_seed(0)
    reference = Experts()
    model = copy.deepcopy(reference)
    for i, expert in enumerate(model.experts):
        model.experts[i] = FSDP(expert)
    model = FSDP(model)
    optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (reference, model)]
    worst = []
    for step in range(3):
        idx, target = _batch(step)
        for m, x, y in ((reference, idx, target), (model, _local(idx), _local(target))):
            inner = m.module if isinstance(m, FSDP) else m
            inner.use = (0, 1, 2)
            _loss(m, x, y).backward()
            if extra_forward == "raising":
                Expert.fail = True
                try:
                    m(x)
                except FloatingPointError:
                    pass
                finally:
                    Expert.fail = False
            else:
                inner.use = (0,)
                with torch.no_grad():
                    m(x)
        for optim in optims:
            optim.step()
            optim.zero_grad()
        with FSDP.summon_full_params(model):
            mine = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                    for n, p in model.named_parameters()}
        worst.append(max((mine[n] - p.detach()).abs().max().item()
                         for n, p in reference.named_parameters()))
    return worst


def test_units_left_gathered_by_an_unfinished_forward_are_gathered_afresh(world2):
    """Regression: a unit a forward gathered and never finished with (the forward raised in
    it and the loop skipped the batch; or, under ``no_grad``, the prefetch of an expert that
    forward did not run) kept that ``full``; after the optimizer step the next forward computed
    with the old weights (off from one process by ~1e-3 after one step, silently); now the
    root frees such units as a forward starts, and they are gathered afresh."""
    for extra_forward in ("raising", "no_grad, expert 0 only"):
        for worst in world2.run(_between_backward_and_step, extra_forward):
            assert max(worst) < 1e-6, (extra_forward, worst)

# ----------------------------------------------------------------------------- .grad touched
# in place inside no_sync: ``clip_grad_norm_`` (its ``_foreach_mul_`` runs even when nothing is
# clipped) or a GradScaler-style unscale is no clearing: the gradient accumulated so far must
# still reach the step, as in one process, while a zeroing still discards it


class HeadNet(nn.Module):
    """A root holding a linear head, two blocks as inner units."""

    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([Block(), Block()])
        self.head = nn.Linear(8, 3)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _float_batch(i: int) -> tuple:
    g = torch.Generator().manual_seed(30 + i)
    return torch.randn(8, 8, generator=g), torch.randint(0, 3, (8,), generator=g)


def _touch_grads_in_place(model: nn.Module, how: str) -> None:
    params = [p for p in model.parameters() if p.grad is not None]
    if how == "clip":  # a norm far above the gradients': the coefficient is clamped to 1
        torch.nn.utils.clip_grad_norm_(params, max_norm=1e6)
    elif how == "unscale":  # GradScaler's unscale at a scale of 1
        with torch.no_grad():
            torch._foreach_mul_([p.grad for p in params], 1.0)
    elif how == "zero":
        for p in params:
            p.grad.zero_()


def _accumulate_touching_grads(how: str, keep: bool) -> dict:
    """Three micro-batches (two inside ``no_sync``), ``.grad`` touched in place after the
    first: the gradient of every parameter against one process doing the same."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    from shardkit.nn.data_parallel.flat_param import shard_rows
    torch.manual_seed(0)
    reference = HeadNet()
    model = copy.deepcopy(reference)
    for i, block in enumerate(model.blocks):
        model.blocks[i] = FSDP(block, reshard_after_forward=not keep)
    model = FSDP(model, reshard_after_forward=not keep)
    for micro in range(3):
        x, y = _float_batch(micro)
        F.cross_entropy(reference(x), y).backward()
        if micro < 2:
            with model.no_sync():
                F.cross_entropy(model(_local(x)), _local(y)).backward()
        else:
            F.cross_entropy(model(_local(x)), _local(y)).backward()
        if micro == 0:
            _touch_grads_in_place(reference, how)
            _touch_grads_in_place(model, how)
    mine = {n.replace("_fsdp_wrapped_module.", ""): p for n, p in model.named_parameters()}
    out = {}
    for name, p in reference.named_parameters():
        expected = shard_rows(p.grad, model._param_layouts()[id(mine[name])], model.rank)
        out[name] = (mine[name].grad - expected).abs().max().item() < 1e-6
    return out


def test_grads_read_in_place_inside_no_sync_keep_the_accumulated_gradient(world2):
    """Regression: after a backward inside ``no_sync``, any in-place operation on ``.grad``
    (bumping its version) was taken for ``optimizer.zero_grad()`` and dropped the gradient
    held for the next reduce: ``clip_grad_norm_`` that clipped nothing or an unscale by 1
    between micro-batches made every parameter's step miss the first micro-batch. A zeroing
    still drops it."""
    for how in ("clip", "unscale", "zero"):
        for keep in (False, True):
            for out in world2.run(_accumulate_touching_grads, how, keep):
                assert all(out.values()), (how, keep, {k: v for k, v in out.items() if not v})
