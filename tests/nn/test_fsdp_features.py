"""FSDP features users rely on: summon_full_params (write-back), unfreezing mid-run, an
optimizer built before wrapping, evaluation under no_grad, CPU offload, no_sync memory and the
original parameter names; the user's own hooks (backward pre-hooks included), gradient penalties
(create_graph), backward(inputs=...), losses that reach a unit through a stored value, zero_grad
inside an accumulation cycle, training on after a backward that raised; a plain module's state
dict inside summon_full_params, and torch FSDP1's summon / state_dict_type / optimizer-state
spellings."""

import collections
import copy
import dataclasses

import pytest
import torch
import torch.nn.utils.prune

from shardkit import distributed as skdist
from shardkit.testing import world_fixture
from shardkit.utils.memory import model_state_bytes
from tests.nn.fsdp_common import (EPS, GLOBAL_BATCH, LR, TINY, build_gpt, local_slice,
                                  make_optimizer, max_diff, train_step, wrap_gpt)
from shardkit.models import synthetic_batch


world2 = world_fixture(2)


def _summon_and_names():
    reference = build_gpt()
    model = wrap_gpt(build_gpt())
    out = {"names": [n for n, _ in model.named_parameters()] ==
           [n for n, _ in reference.named_parameters()]}
    with model.summon_full_params(), torch.no_grad():
        out["full_shape"] = tuple(model.module.blocks[0].fc.weight.shape)
        model.module.blocks[0].fc.weight.fill_(0.25)
    with model.summon_full_params(writeback=False), torch.no_grad():
        out["written_back"] = bool((model.module.blocks[0].fc.weight == 0.25).all())
        model.module.blocks[0].fc.bias.fill_(7.0)
    out["shard_shape"] = tuple(model.module.blocks[0].fc.weight.shape)
    sd = model.state_dict()
    out["discarded"] = not bool((sd["blocks.0.fc.bias"] == 7.0).any())
    # nested: state_dict() (itself a summon) and a second summon inside the block; the
    # outermost block alone writes back and reshards
    with model.summon_full_params(), torch.no_grad():
        inside = model.state_dict()  # views of the summoned parameters, as in torch
        out["nested_state_dict"] = all(torch.equal(inside[k], v) for k, v in sd.items())
        with model.summon_full_params(writeback=False):
            model.module.blocks[0].fc.bias.fill_(3.0)
        out["nested_keeps_full"] = tuple(model.module.blocks[0].fc.weight.shape)
    out["nested_edit_kept"] = bool((model.state_dict()["blocks.0.fc.bias"] == 3.0).all())
    out["nested_reshards"] = tuple(model.module.blocks[0].fc.weight.shape)
    out["edit_trains"] = bool(torch.isfinite(train_step(model, make_optimizer(model), 0)[0]))
    return out


def test_summon_full_params_and_names(world2):
    for r in world2.run(_summon_and_names):
        n = 2
        assert r["names"] and r["written_back"] and r["discarded"] and r["edit_trains"], r
        assert r["full_shape"] == (4 * TINY.d_model, TINY.d_model)
        assert r["shard_shape"] == (4 * TINY.d_model // n, TINY.d_model)
        assert r["nested_state_dict"] and r["nested_edit_kept"], r
        assert r["nested_keeps_full"] == (4 * TINY.d_model, TINY.d_model)
        assert r["nested_reshards"] == r["shard_shape"]


def _forward_inside_summon():
    """What generation scripts do: forward (under no_grad) inside summon_full_params, with every
    unit summoned or only the root, in fp32 and under bf16 mixed precision; a backward through
    such a forward is refused; training goes on afterwards."""
    reference = build_gpt()
    idx, target = synthetic_batch(TINY, 2, 0)
    with torch.no_grad():
        expected = reference(idx)
    out = {}
    for name, kwargs in (("fp32", {}), ("bf16", {"compute_dtype": torch.bfloat16})):
        model = wrap_gpt(build_gpt(), **kwargs)
        for recurse in (True, False):
            try:
                with model.summon_full_params(recurse=recurse), torch.no_grad():
                    out[f"{name} recurse={recurse}"] = max_diff(model(idx), expected)
            except RuntimeError as error:
                out[f"{name} recurse={recurse}"] = str(error)
        out[f"{name} resharded"] = tuple(model.module.blocks[0].fc.weight.shape)
    try:
        with model.summon_full_params():
            model.loss(idx, target).backward()
        out["backward"] = "accepted"
    except RuntimeError as error:
        out["backward"] = str(error)
    model.zero_grad(set_to_none=True)
    out["trains after"] = bool(torch.isfinite(train_step(model, make_optimizer(model), 0)[0]))
    return out


def test_forward_inside_summon_full_params(world2):
    for r in world2.run(_forward_inside_summon):
        assert r["fp32 recurse=True"] < 1e-5 and r["fp32 recurse=False"] < 1e-5, r
        # every unit summoned: fp32 masters, fp32 compute; the root alone would meet the
        # blocks' bf16 activations with fp32 weights
        assert r["bf16 recurse=True"] < 1e-5, r
        assert "needs every unit summoned" in r["bf16 recurse=False"], r
        assert r["fp32 resharded"] == r["bf16 resharded"] == (4 * TINY.d_model // 2,
                                                              TINY.d_model), r
        assert "inside summon_full_params() is not supported" in r["backward"], r
        assert r["trains after"], r


def _summon_after_a_forward_without_backward():
    """A forward with gradients that no backward follows (a metric) leaves the root gathered
    for its backward; ``summon_full_params`` then must still show the summoned fp32 parameters
    as the module attributes, and edits made through them must be written back."""
    reference, model = build_gpt(), wrap_gpt(build_gpt())
    ref_opt, opt = make_optimizer(reference), make_optimizer(model)
    out = {"trained": 0.0}
    for step in range(2):
        idx, target = synthetic_batch(TINY, GLOBAL_BATCH, step)
        model.loss(local_slice(idx), local_slice(target))  # no backward
        with model.summon_full_params(), torch.no_grad():
            model.module.ln_f.weight.mul_(0.5)
            model.module.tok_emb.weight.add_(0.01)
        with torch.no_grad():
            reference.ln_f.weight.mul_(0.5)
            reference.tok_emb.weight.add_(0.01)
        out["edited"] = max_diff(model.state_dict(), reference.state_dict())
        train_step(reference, ref_opt, step, local=False)
        train_step(model, opt, step)
        out["trained"] = max(out["trained"], max_diff(model.state_dict(), reference.state_dict()))
    bf16 = wrap_gpt(build_gpt(), compute_dtype=torch.bfloat16)
    bf16.loss(local_slice(idx), local_slice(target))
    with bf16.summon_full_params():
        out["summoned dtype"] = bf16.module.ln_f.weight.dtype
    bf16.reshard()  # the process-wide count of gathered bytes is read by later tests
    return out


def test_summon_full_params_after_a_forward_without_backward(world2):
    for r in world2.run(_summon_after_a_forward_without_backward):
        assert r["edited"] < 1e-6 and r["trained"] < 1e-5, r
        assert r["summoned dtype"] == torch.float32, r


def _direct_calls():
    """Code that calls a submodule holding a unit's parameters outside that unit's forward
    (an encoder-decoder's ``generate()`` runs the encoder, which reads the root's embedding):
    refused with gradients, gathered and kept under no_grad, reused by the next forward and
    freed by it; training still matches the oracle afterwards."""
    reference, model = build_gpt(), wrap_gpt(build_gpt())
    idx, _ = synthetic_batch(TINY, 2, 0)
    out = {}
    try:
        model.module.tok_emb(idx)
        out["with grad"] = "accepted"
    except RuntimeError as error:
        out["with grad"] = str(error)
    with skdist.CommCounter() as comm, torch.no_grad():
        out["embedding"] = max_diff(model.module.tok_emb(idx), reference.tok_emb(idx))
        out["block"] = max_diff(model.module.blocks[1].fc(reference.tok_emb(idx)),
                                reference.blocks[1].fc(reference.tok_emb(idx)))
        out["direct gathers"] = comm.calls_by_op.get("all_gather", 0)
        out["logits"] = max_diff(model(idx), reference(idx))
    out["root freed"] = not model._shard.gathered
    ref_opt, opt = make_optimizer(reference), make_optimizer(model)
    for step in range(2):
        train_step(reference, ref_opt, step, local=False)
        train_step(model, opt, step)
    out["trained"] = max_diff(model.state_dict(), reference.state_dict())
    return out


def test_direct_calls_of_submodules(world2):
    for r in world2.run(_direct_calls):
        assert "ran outside that unit's forward, with gradients" in r["with grad"], r
        assert r["embedding"] == 0.0 and r["block"] < 1e-6 and r["logits"] < 1e-5, r
        assert r["direct gathers"] == 2, r  # the root once (kept), the block's unit once
        assert r["root freed"] and r["trained"] < 1e-5, r


FROZEN_AT_START = ("blocks.1.fc.weight", "blocks.0.attn.qkv.weight", "blocks.0.attn.qkv.bias",
                   "blocks.0.attn.proj.weight", "blocks.0.attn.proj.bias")


def _unfreeze_midrun():
    """A parameter mixed into a trainable unit and a whole unit start frozen and are unfrozen
    after step 2 (added to the optimizer); the oracle does the same."""
    def run(model, local):
        optim = make_optimizer(model)
        for step in range(5):
            if step == 2:
                params = dict(model.named_parameters())
                new = [params[n].requires_grad_(True) for n in FROZEN_AT_START]
                optim.add_param_group({"params": new})
            train_step(model, optim, step, local=local)
        return model

    reference = run(build_gpt(freeze=FROZEN_AT_START), local=False)
    model = run(wrap_gpt(build_gpt(freeze=FROZEN_AT_START)), local=True)
    frozen_grads = []
    check = wrap_gpt(build_gpt(freeze=FROZEN_AT_START))
    optim = make_optimizer(check)
    train_step(check, optim, 0)
    params = dict(check.named_parameters())
    frozen_state = [params[n] in optim.state for n in FROZEN_AT_START]
    loss = check.loss(*synthetic_batch(TINY, 2, 0))
    loss.backward()
    frozen_grads = [params[n].grad is not None for n in FROZEN_AT_START]
    return {"diff": max_diff(model.state_dict(), reference.state_dict()),
            "frozen_grads": frozen_grads, "frozen_state": frozen_state}


def test_unfreeze_midrun(world2):
    for r in world2.run(_unfreeze_midrun):
        assert r["diff"] <= 1e-5, r
        assert not any(r["frozen_grads"]) and not any(r["frozen_state"]), r


def _optimizer_before_wrapping_and_offload():
    reference = build_gpt()
    ref_optim = make_optimizer(reference)
    early = build_gpt()
    early_optim = make_optimizer(early)  # holds the original parameter objects
    early = wrap_gpt(early)
    offload = wrap_gpt(build_gpt(), move_params_to_cpu=True)
    # offloaded shards step with the fused CPU AdamW (torch.optim.AdamW semantics)
    from shardkit.optim.fused import FusedAdamW
    offload_optim = FusedAdamW([p for p in offload.parameters() if p.requires_grad], lr=LR,
                               eps=EPS, weight_decay=0.01)
    for step in range(4):
        train_step(reference, ref_optim, step, local=False)
        train_step(early, early_optim, step)
        train_step(offload, offload_optim, step)
    return {"early": max_diff(early.state_dict(), reference.state_dict()),
            "offload": max_diff(offload.state_dict(), reference.state_dict()),
            "offload_device": {p.device.type for p in offload.parameters()}}


def test_optimizer_built_before_wrapping_and_cpu_offload(world2):
    for r in world2.run(_optimizer_before_wrapping_and_offload):
        assert r["early"] <= 1e-5 and r["offload"] <= 1e-5, r
        assert r["offload_device"] == {"cpu"}


def _discarded_models_are_collected():
    """A model discarded after a forward that no backward followed (its root, and units with
    ``reshard_after_forward=False``, kept gathered) or after a training step is garbage
    collected, and the gathered bytes are counted off. Two cycles through torch's C++ kept it
    alive for good: the unit's post-accumulate-grad hook (every FSDP model, even unused) and
    the autograd node whose output views sit in the modules while gathered."""
    import gc
    import weakref
    from shardkit.nn.data_parallel.flat_param import gathered_param_bytes
    gc.collect()
    before = gathered_param_bytes().live
    out = {}
    for case in ("wrapped", "forward", "step"):
        model = wrap_gpt(build_gpt(), reshard_after_forward=False)
        if case == "forward":
            idx, _ = synthetic_batch(TINY, GLOBAL_BATCH, 0)
            model(local_slice(idx))
        elif case == "step":
            optim = make_optimizer(model)
            train_step(model, optim, 0)
            del optim
        held = gathered_param_bytes().live - before
        alive = weakref.ref(model)
        del model
        gc.collect()
        out[case] = (alive() is not None, held, gathered_param_bytes().live - before)
    return out


def test_discarded_models_are_collected_and_counted_off(world2):
    for r in world2.run(_discarded_models_are_collected):
        assert [alive for alive, _, _ in r.values()] == [False] * 3, r
        assert r["forward"][1] > 0, r  # the root stayed gathered after the forward
        assert [left for _, _, left in r.values()] == [0] * 3, r


def _eval_and_no_sync_memory():
    reference = build_gpt()
    model = wrap_gpt(build_gpt())
    idx, _ = synthetic_batch(TINY, GLOBAL_BATCH, 0)
    with torch.no_grad():
        expected = reference(local_slice(idx))
        got = model(local_slice(idx))
    live_after_eval = model.gathered_param_bytes().live
    optim = make_optimizer(model)
    x, y = synthetic_batch(TINY, GLOBAL_BATCH, 1)
    x, y = local_slice(x), local_slice(y)
    synced = model_state_bytes(model).grads
    with model.no_sync():
        model.loss(x, y).backward()
    accumulating = model_state_bytes(model).grads
    model.loss(x, y).backward()
    after_sync = model_state_bytes(model).grads
    optim.step()
    return {"eval_diff": (expected - got).abs().max().item(), "live_after_eval": live_after_eval,
            "synced": synced, "accumulating": accumulating, "after_sync": after_sync,
            "shard_bytes": sum(p.numel() * 4 for p in model.parameters()),
            "full_bytes": sum(p.numel() * 4 for p in reference.parameters())}


def test_eval_and_no_sync_memory(world2):
    for r in world2.run(_eval_and_no_sync_memory):
        assert r["eval_diff"] <= 1e-5 and r["live_after_eval"] == 0, r
        assert r["synced"] == 0
        # inside no_sync every unit keeps its unsharded gradient (the full model's worth)
        assert r["accumulating"] >= r["full_bytes"] - 4 * TINY.vocab_size * TINY.d_model, r
        # after the synchronising backward only the 1/N gradient shards remain
        assert r["after_sync"] <= r["shard_bytes"], r


def _nested_linear(reshard: bool):
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    torch.manual_seed(0)
    return FSDP(torch.nn.Sequential(FSDP(torch.nn.Linear(4, 4), reshard_after_forward=reshard),
                                    torch.nn.ReLU(), torch.nn.Linear(4, 4)),
                reshard_after_forward=reshard)


def _no_sync_keeps_gathered_units():
    """Inside no_sync the units that stay gathered from forward to backward stay gathered
    between micro-batches too (FairScale's rule): counted all-gathers per accumulation cycle,
    the gradients of plain accumulation, and a shard changed inside the block re-gathered."""
    from shardkit.distributed import CommCounter
    from shardkit.nn.data_parallel.flat_param import gathered_param_bytes
    out = {}
    before = gathered_param_bytes().live  # the process-wide count (other tests' models)
    torch.manual_seed(1)
    xs = [torch.randn(3, 4) for _ in range(4)]
    for reshard in (False, True):
        model, plain = _nested_linear(reshard), _nested_linear(reshard)
        with CommCounter() as counter:
            for x in xs[:-1]:
                with model.no_sync():
                    model(x).pow(2).sum().backward()
            out[f"live_inside_{reshard}"] = gathered_param_bytes().live - before
            model(xs[-1]).pow(2).sum().backward()
        out[f"live_after_{reshard}"] = gathered_param_bytes().live - before
        ops = [r.op for r in counter.calls]
        out[f"calls_{reshard}"] = (ops.count("all_gather"), ops.count("reduce_scatter"))
        for x in xs:
            plain(x).pow(2).sum().backward()
        out[f"grads_{reshard}"] = max_diff([p.grad for p in model.parameters()],
                                           [p.grad for p in plain.parameters()])
    # a step between micro-batches (not what no_sync is for) must not leave stale weights
    model, fresh = _nested_linear(False), _nested_linear(False)
    for m in (model, fresh):
        with m.no_sync():
            m(xs[0]).sum().backward()
        with torch.no_grad():
            for p in m.parameters():
                p.add_(1.0)
    fresh.reshard()
    with model.no_sync():
        out["after_step"] = (model(xs[1]) - fresh(xs[1])).abs().max().item()
    model.reshard()
    fresh.reshard()
    return out


def test_no_sync_keeps_gathered_units(world2):
    for r in world2.run(_no_sync_keeps_gathered_units):
        # reshard_after_forward=False: both units gathered once for the whole cycle
        assert r["calls_False"] == (2, 2), r
        # True: the root gathered once, the inner unit in each forward and backward
        assert r["calls_True"] == (1 + 2 * 4, 2), r
        assert r["live_inside_False"] > r["live_inside_True"] > 0, r
        assert r["live_after_False"] == r["live_after_True"] == 0, r
        assert r["grads_False"] <= 1e-6 and r["grads_True"] <= 1e-6, r
        assert r["after_step"] <= 1e-6, r


class _OutputDict(dict):
    pass


@dataclasses.dataclass
class _Output:
    hidden: torch.Tensor
    extra: tuple


def _wrap_output(kind: str, y: torch.Tensor):
    if kind == "dict subclass":
        return _OutputDict(y=y)
    if kind == "ordered dict subclass":
        return type("Ordered", (collections.OrderedDict,), {})(y=y)
    return _Output(hidden=y, extra=(y * 0,))


class _Returns(torch.nn.Sequential):
    """A block whose forward returns its output inside a container of the given kind."""

    def __init__(self, kind: str):
        torch.manual_seed(3)
        super().__init__(torch.nn.Linear(4, 4), torch.nn.Tanh(), torch.nn.Linear(4, 4))
        self.kind = kind

    def forward(self, x):
        return _wrap_output(self.kind, super().forward(x))


def _outputs_in_custom_containers():
    """An inner unit (resharded after forward) whose output sits in a dict subclass, an
    OrderedDict subclass (old transformers ModelOutput) or a dataclass is gathered again for
    backward: its gradients match the unwrapped module's."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    out = {}
    x = torch.randn(3, 4)
    for kind in ("dict subclass", "ordered dict subclass", "dataclass"):
        plain, inner = _Returns(kind), _Returns(kind)
        model = FSDP(torch.nn.Sequential(FSDP(inner)))

        def first(o):
            return o.hidden if isinstance(o, _Output) else o["y"]
        for m in (model, plain):
            sgd = torch.optim.SGD(m.parameters(), lr=0.1)
            first(m(x)).pow(2).sum().backward()
            sgd.step()
        out[kind] = max_diff(list(model.state_dict().values()), list(plain.state_dict().values()))
        out[f"{kind} moved"] = max_diff(list(plain.state_dict().values()),
                                        list(_Returns(kind).state_dict().values()))
    return out


def test_outputs_in_custom_containers(world2):
    for r in world2.run(_outputs_in_custom_containers):
        for kind in ("dict subclass", "ordered dict subclass", "dataclass"):
            assert r[kind] <= 1e-6 < r[f"{kind} moved"], r


def _kept_units_after_a_forward_without_backward():
    """The root stays gathered after its forward (FairScale's default) and every unit does with
    reshard_after_forward=False. A forward that no backward follows, then an optimizer step, must
    not leave the next forward computing with the old weights; two forwards before their
    backwards (a pipeline's micro-batches) still reuse what is kept; reshard() frees it all."""
    from shardkit.nn.data_parallel.flat_param import gathered_param_bytes
    out = {}
    idx, target = synthetic_batch(TINY, GLOBAL_BATCH, 0)
    idx = local_slice(idx)
    for name, kwargs in (("root kept", {}), ("no reshard", {"reshard_after_forward": False})):
        model = wrap_gpt(build_gpt(), **kwargs)
        optim = make_optimizer(model)
        train_step(model, optim, 0)
        model(idx)  # with gradients, no backward: kept units stay gathered
        train_step(model, optim, 1)  # backward of another batch, then a step
        model(idx)
        for p in model.parameters():  # a step with hand-made gradients, no backward before it
            p.grad = torch.ones_like(p) if p.requires_grad else None
        optim.step()
        logits = model(idx)
        with torch.no_grad():
            model.reshard()
            fresh = model(idx)  # gathered afresh from the current shards
        out[name] = max_diff({"l": logits.detach()}, {"l": fresh})
    # a module called twice before one backward (two views of a batch, a siamese loss): each
    # unit's gradient is reduced once, whole, and matches single-process training
    model, reference = wrap_gpt(build_gpt()), build_gpt()
    sgd = torch.optim.SGD([p for p in model.parameters() if p.requires_grad], lr=0.5)
    ref_sgd = torch.optim.SGD([p for p in reference.parameters() if p.requires_grad], lr=0.5)
    other, other_target = synthetic_batch(TINY, GLOBAL_BATCH, 5)
    first = model.loss(idx, local_slice(target))
    with skdist.CommCounter() as second_forward:
        second = model.loss(local_slice(other), local_slice(other_target))
    with skdist.CommCounter() as two_backward:
        (first + 0.5 * second).backward()
    sgd.step()
    ref_idx, ref_target = synthetic_batch(TINY, GLOBAL_BATCH, 0)
    (reference.loss(ref_idx, ref_target) + 0.5 * reference.loss(other, other_target)).backward()
    ref_sgd.step()
    out["two_forwards_diff"] = max_diff(model.state_dict(), reference.state_dict())
    out["reduce_scatters"] = two_backward.by_op.get("reduce_scatter", 0)
    out["second_forward_gathers"] = second_forward.by_op.get("all_gather", 0)
    with skdist.CommCounter() as first_forward:
        loss = model.loss(idx, local_slice(target))
    with skdist.CommCounter() as one_backward:
        loss.backward()
    out["first_forward_gathers"] = first_forward.by_op.get("all_gather", 0)
    out["one_backward_reduce_scatters"] = one_backward.by_op.get("reduce_scatter", 0)
    model(idx)
    kept = gathered_param_bytes().live
    model.reshard()
    out["reshard"] = (kept > 0, gathered_param_bytes().live)
    return out


def test_kept_units_follow_an_optimizer_step(world2):
    for r in world2.run(_kept_units_after_a_forward_without_backward):
        assert r["root kept"] == 0.0 and r["no reshard"] == 0.0, r
        # the root (embeddings, head) reused: the second forward gathers only the blocks
        assert 0 < r["second_forward_gathers"] < r["first_forward_gathers"], r
        assert r["two_forwards_diff"] <= 1e-5, r
        assert r["reduce_scatters"] == r["one_backward_reduce_scatters"] > 0, r
        assert r["reshard"] == (True, 0), r


class _SharedBlock(torch.nn.Module):
    """ALBERT-style: one block applied three times per forward, and a layer used on odd steps."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.inp = torch.nn.Linear(4, 8)
        self.block = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.Tanh())
        self.sometimes = torch.nn.Linear(8, 8)
        self.out = torch.nn.Linear(8, 1)

    def forward(self, x, use_sometimes=False):
        h = self.inp(x)
        for _ in range(3):
            h = self.block(h) + h
        return self.out(self.sometimes(h) if use_sometimes else h)


def _unit_applied_several_times():
    from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP
    reference, model = _SharedBlock(), _SharedBlock()
    model.block, model.sometimes = FSDP(model.block), FSDP(model.sometimes)
    model = FSDP(model)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    for step in range(4):
        x = torch.randn(8, 4, generator=gen)
        optim.zero_grad()
        model(local_slice(x), use_sometimes=step % 2 == 1).pow(2).mean().backward()
        optim.step()
        ref_optim.zero_grad()
        reference(x, use_sometimes=step % 2 == 1).pow(2).mean().backward()
        ref_optim.step()
        with model.summon_full_params():
            worst = max(worst, max((a - b).abs().max().item()
                                   for a, b in zip(model.parameters(), reference.parameters())))
    return worst


def test_a_unit_applied_several_times_in_one_forward(world2):
    assert all(worst <= 1e-6 for worst in world2.run(_unit_applied_several_times))


class _TwoLayers(torch.nn.Module):
    """A tiny MLP whose first layer becomes an inner unit, seeded alike on every rank."""

    def __init__(self, prune_first: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.l1, self.l2 = torch.nn.Linear(6, 6), torch.nn.Linear(6, 3)
        if prune_first:  # a forward pre-hook registered before wrapping reads weight_orig
            torch.nn.utils.prune.l1_unstructured(self.l1, "weight", amount=0.5)

    def forward(self, x):
        return self.l2(torch.tanh(self.l1(x)))


def _wrap_two_layers(model):
    from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP
    model.l1 = FSDP(model.l1)
    return FSDP(model)


def _sharded_grad_diff(model, reference) -> float:
    """Largest difference between this rank's gradient shards and the oracle's gradients
    (infinite where one of them is None and the other is not)."""
    from shardkit.checkpoint.resharding import ParamLayout, shard_rows
    ref = dict(reference.named_parameters())
    n, r = skdist.get_world_size(), skdist.get_rank()
    worst = 0.0
    for k, p in model.named_parameters():
        expected = ref[k].grad
        if p.grad is None or expected is None:
            worst = worst if p.grad is None and expected is None else float("inf")
            continue
        expected = shard_rows(expected, ParamLayout(expected.shape, n), r)
        worst = max(worst, (p.grad - expected).abs().max().item())
    return worst


def _gradient_penalty():
    """WGAN-GP / R1: ``torch.autograd.grad(out, x, create_graph=True)`` then a backward through
    the loss plus the penalty (the graph autograd.grad built reads the gathered weights)."""
    reference, model = _TwoLayers(), _wrap_two_layers(_TwoLayers())
    gen = torch.Generator().manual_seed(1)
    worst = 0.0
    for _ in range(2):
        x = torch.randn(8, 6, generator=gen)
        for net, inputs in ((reference, x), (model, local_slice(x))):
            inputs = inputs.clone().requires_grad_(True)
            out = net(inputs)
            grad, = torch.autograd.grad(out.sum(), inputs, create_graph=True)
            (out.pow(2).mean() + grad.pow(2).sum() / len(inputs)).backward()
        worst = max(worst, _sharded_grad_diff(model, reference))
        reference.zero_grad(), model.zero_grad()
    return {"worst": worst, "freed": [u._shard.gathered for u in model.sharded_units()]}


def test_gradient_penalty_with_create_graph(world2):
    for r in world2.run(_gradient_penalty):
        assert r["worst"] < 1e-6 and r["freed"] == [False, False], r


def _user_hooks_on_wrapped_modules():
    """Hooks of the user's on a wrapped module see the gathered parameters, as under torch's
    FSDP: torch.nn.utils.prune's pre-hook (registered before wrapping, it reads weight_orig)
    and a forward hook registered after wrapping (it reads the bias)."""
    reference, model = _TwoLayers(prune_first=True), _wrap_two_layers(_TwoLayers(True))
    seen = {}
    for name, net in (("reference", reference.l1), ("fsdp", model.module.l1.module)):
        net.register_forward_hook(lambda m, i, o, name=name: seen.__setitem__(
            name, (tuple(m.bias.shape), m.bias.detach().sum().item())))
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(2))
    reference(x).pow(2).mean().backward()
    model(local_slice(x)).pow(2).mean().backward()
    return {"seen": seen, "grads": _sharded_grad_diff(model, reference)}


def test_user_hooks_on_wrapped_modules_see_full_parameters(world2):
    for r in world2.run(_user_hooks_on_wrapped_modules):
        assert r["seen"]["fsdp"][0] == (6,), r
        assert abs(r["seen"]["fsdp"][1] - r["seen"]["reference"][1]) < 1e-6, r
        assert r["grads"] < 1e-6, r


def _optimizer_in_backward():
    """torchtune's optimizer-in-backward: a post-accumulate-grad hook on every parameter steps
    it and clears its gradient; the hooks run once the reduced shard is in ``p.grad``."""
    reference, model = _TwoLayers(), _wrap_two_layers(_TwoLayers())
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    optims = {p: torch.optim.SGD([p], lr=0.1) for p in model.parameters()}
    calls = []

    def step_now(p):
        calls.append(tuple(p.grad.shape))
        optims[p].step()
        optims[p].zero_grad()

    for p in model.parameters():
        p.register_post_accumulate_grad_hook(step_now)
    gen = torch.Generator().manual_seed(3)
    for _ in range(2):
        x = torch.randn(8, 6, generator=gen)
        reference(x).pow(2).mean().backward()
        ref_optim.step()
        ref_optim.zero_grad()
        model(local_slice(x)).pow(2).mean().backward()
    with model.summon_full_params():
        worst = max((a - b).abs().max().item()
                    for a, b in zip(model.parameters(), reference.parameters()))
    return {"worst": worst, "calls": calls,
            "grads left": [p.grad is not None for p in model.parameters()]}


def test_post_accumulate_grad_hooks_run_on_the_shards(world2):
    for r in world2.run(_optimizer_in_backward):
        assert r["worst"] < 1e-6 and not any(r["grads left"]), r
        assert r["calls"] == [(3, 6), (3,), (2, 6), (2,)] * 2, r


class _RouterWithAuxLoss(torch.nn.Module):
    """An MoE-style layer that stores its router's auxiliary loss on itself."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.router, self.fc = torch.nn.Linear(6, 2), torch.nn.Linear(6, 6)

    def forward(self, x):
        self.aux_loss = self.router(x).softmax(-1).pow(2).mean()
        return torch.tanh(self.fc(x))


def _loss_reaching_a_unit_only_through_a_stored_value():
    """A backward of the stored auxiliary loss alone reaches the unit's router through no
    output of the unit: its gradient must still land in .grad in that backward (it used to be
    left in flight, ``.grad`` None, and added to the next step's gradient)."""
    from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP
    reference = torch.nn.Sequential(_RouterWithAuxLoss(), torch.nn.Linear(6, 3))
    model = torch.nn.Sequential(_RouterWithAuxLoss(), torch.nn.Linear(6, 3))
    model[0] = FSDP(model[0])
    model = FSDP(model)
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(4))
    out = {}
    for step, whole_loss in enumerate((False, True)):
        for net, inputs, layer in ((reference, x, reference[0]),
                                   (model, local_slice(x), model.module[0].module)):
            y = net(inputs)
            (y.pow(2).mean() + layer.aux_loss if whole_loss else layer.aux_loss).backward()
        out[step] = _sharded_grad_diff(model, reference)
        reference.zero_grad(), model.zero_grad()
    return out


def test_loss_reaching_a_unit_only_through_a_stored_value(world2):
    for r in world2.run(_loss_reaching_a_unit_only_through_a_stored_value):
        assert r[0] < 1e-6 and r[1] < 1e-6, r


def _zero_grad_discards_no_sync_gradients():
    """A micro-batch accumulated inside no_sync, then discarded with ``model.zero_grad()`` (a
    skipped accumulation cycle): the next step's gradient is that step's alone, as in one
    process (the accumulated gradient used to be added to it)."""
    reference, model = _TwoLayers(), _wrap_two_layers(_TwoLayers())
    gen = torch.Generator().manual_seed(5)
    first, second = torch.randn(8, 6, generator=gen), torch.randn(8, 6, generator=gen)
    reference(first).pow(2).mean().backward()
    with model.no_sync():
        model(local_slice(first)).pow(2).mean().backward()
    reference.zero_grad()
    model.zero_grad()
    reference(second).pow(2).mean().backward()
    model(local_slice(second)).pow(2).mean().backward()
    return _sharded_grad_diff(model, reference)


def test_zero_grad_discards_gradients_accumulated_in_no_sync(world2):
    assert all(worst < 1e-6 for worst in world2.run(_zero_grad_discards_no_sync_gradients))


def _direct_call_after_a_step():
    """backward, then a forward with gradients that no backward follows (a logged metric: the
    root stays gathered), then ``optimizer.step()``, then a direct call of a submodule of the
    root (what ``generate()`` does with an encoder): it must compute with the stepped weights
    (it used to reuse the gathered pre-step ones)."""
    reference, model = _TwoLayers(), _wrap_two_layers(_TwoLayers())
    gen = torch.Generator().manual_seed(6)
    x, probe = torch.randn(8, 6, generator=gen), torch.randn(2, 6, generator=gen)
    for net, inputs in ((reference, x), (model, local_slice(x))):
        optim = torch.optim.SGD(net.parameters(), lr=0.5)
        net(inputs).pow(2).mean().backward()
        net(inputs)  # no backward
        optim.step()
    with torch.no_grad():
        return (model.module.l2(probe) - reference.l2(probe)).abs().max().item()


def test_direct_call_after_a_step_uses_the_stepped_weights(world2):
    assert all(diff < 1e-6 for diff in world2.run(_direct_call_after_a_step))


def _backward_with_inputs():
    """``loss.backward(inputs=params)`` (all of them, or the root's two only) gives the
    gradients one process gives (the others stay None; it used to leave every ``.grad`` None),
    and ``torch.autograd.grad`` over a unit's parameters is refused with a clear error."""
    reference, model = _TwoLayers(), _wrap_two_layers(_TwoLayers())
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(4))
    out = {}
    for case, names in (("all", None), ("l2", ("l2.weight", "l2.bias"))):
        for net, inputs in ((reference, x), (model, local_slice(x))):
            params = dict(net.named_parameters())
            chosen = list(params.values()) if names is None else [params[n] for n in names]
            net(inputs).pow(2).mean().backward(inputs=chosen)
        out[case] = _sharded_grad_diff(model, reference)
        out[f"{case} with grad"] = [n for n, p in model.named_parameters() if p.grad is not None]
        reference.zero_grad(), model.zero_grad()
    out["freed"] = [u._shard.gathered for u in model.sharded_units()]
    try:
        torch.autograd.grad(model(local_slice(x)).pow(2).mean(), list(model.parameters()))
        out["autograd.grad"] = None
    except RuntimeError as error:
        out["autograd.grad"] = str(error)
    return out


def test_backward_with_inputs_reaches_the_parameters(world2):
    for r in world2.run(_backward_with_inputs):
        assert r["all"] < 1e-6 and r["l2"] < 1e-6, r
        assert r["all with grad"] == ["l1.weight", "l1.bias", "l2.weight", "l2.bias"], r
        assert r["l2 with grad"] == ["l2.weight", "l2.bias"], r
        assert r["freed"] == [False, False], r
        assert "torch.autograd.grad(..., inputs=...)" in r["autograd.grad"], r


def _backward_pre_hooks():
    """Full backward pre-hooks of the user's, on a wrapped module and on an inner FSDP unit
    (registered after wrapping), read the gathered weight, as in one process (they read the
    shard); gradients are unchanged."""
    reference, model = _TwoLayers(), _wrap_two_layers(_TwoLayers())
    seen = []
    for net, where in ((reference.l1, "reference"), (model.module.l1.module, "wrapped module"),
                       (model.module.l1, "unit")):
        net.register_full_backward_pre_hook(lambda m, g, where=where: seen.append(
            (where, tuple(m.weight.shape), round(m.weight.detach().sum().item(), 5))))
    x = torch.randn(8, 6, generator=torch.Generator().manual_seed(5))
    for _ in range(2):
        reference(x).pow(2).mean().backward()
        model(local_slice(x)).pow(2).mean().backward()
    return {"seen": seen, "grads": _sharded_grad_diff(model, reference)}


def test_backward_pre_hooks_see_the_gathered_parameters(world2):
    for r in world2.run(_backward_pre_hooks):
        expected = [w for w in r["seen"] if w[0] == "reference"][0]
        assert len(r["seen"]) == 6 and r["grads"] < 1e-6, r
        assert all(w[1:] == expected[1:] for w in r["seen"]), r


def _plain_state_dict_inside_summon():
    """What ``model.save_pretrained(dir)`` does inside ``summon_full_params``: the wrapped
    module's own ``state_dict()``; its keys are the unwrapped model's (they had
    ``_fsdp_wrapped_module.`` in them), and the same module's ``load_state_dict`` takes them."""
    reference, model = _TwoLayers(), _wrap_two_layers(_TwoLayers())
    with model.summon_full_params():
        state = model.module.state_dict()
        out = {"keys": list(state), "expected": list(reference.state_dict()),
               "equal": all(torch.equal(state[k], v) for k, v in reference.state_dict().items())}
        out["load"] = str(model.module.load_state_dict({k: v * 2 for k, v in state.items()}))
    doubled = model.state_dict()
    out["doubled"] = all(torch.equal(doubled[k], 2 * v) for k, v in reference.state_dict().items())
    out["root keys"] = list(doubled)
    return out


def test_plain_state_dict_inside_summon_has_the_unwrapped_keys(world2):
    for r in world2.run(_plain_state_dict_inside_summon):
        assert r["keys"] == r["expected"] == r["root keys"] and r["equal"], r
        assert r["load"] == "<All keys matched successfully>" and r["doubled"], r


def _torch_fsdp1_state_dict_options():
    """torch FSDP1's spellings: ``summon_full_params(rank0_only=..., offload_to_cpu=...)`` and
    ``FSDP.state_dict_type(model, StateDictType..., FullStateDictConfig(...))``."""
    from shardkit.nn.data_parallel import (FSDP, FullStateDictConfig, StateDictType)
    reference, model = _TwoLayers(), _wrap_two_layers(_TwoLayers())
    expected = reference.state_dict()
    out = {}
    with model.summon_full_params(rank0_only=True, writeback=False, offload_to_cpu=True):
        out["rank0_only"] = tuple(model.module.l1.module.weight.shape)
    with model.summon_full_params(offload_to_cpu=True), torch.no_grad():
        model.module.l2.weight.add_(1.0)
    out["written back"] = torch.equal(model.state_dict()["l2.weight"], expected["l2.weight"] + 1)
    for kwargs in ({"rank0_only": True}, {"with_grads": True}, {"offload_to_cpu": 1}):
        try:
            with model.summon_full_params(**kwargs):
                pass
        except ValueError as error:
            out[str(kwargs)] = str(error)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        out["full keys"] = list(model.state_dict())
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        local = model.state_dict()
        model.load_state_dict({k: torch.zeros_like(v) for k, v in local.items()})
    out["local"] = {k: tuple(v.shape) for k, v in local.items()}
    out["zeroed"] = all(not v.any() for v in model.state_dict().values())
    out["after"] = FSDP.get_state_dict_type(model).state_dict_type.name
    try:
        FSDP.set_state_dict_type(model, "SHARDED")
    except ValueError as error:
        out["sharded"] = str(error)
    return out


def test_torch_fsdp1_state_dict_options(world2):
    rank0, rank1 = world2.run(_torch_fsdp1_state_dict_options)
    assert rank0["rank0_only"] == (6, 6) and rank1["rank0_only"] == (3, 6)
    assert rank0["full keys"] == ["l1.weight", "l1.bias", "l2.weight", "l2.bias"]
    assert rank1["full keys"] == []
    for r in (rank0, rank1):
        assert r["written back"] and r["zeroed"] and r["after"] == "FULL_STATE_DICT", r
        assert r["local"] == {"l1.weight": (3, 6), "l1.bias": (3,), "l2.weight": (2, 6),
                              "l2.bias": (2,)}, r
        assert "needs writeback=False" in r["{'rank0_only': True}"]
        assert "with_grads=True) is not supported" in r["{'with_grads': True}"]
        assert "offload_to_cpu=1): must be True or False" in r["{'offload_to_cpu': 1}"]
        assert "LOCAL_STATE_DICT" in r["sharded"]


def _torch_fsdp1_optimizer_state():
    """torch FSDP1's ``FSDP.optim_state_dict`` (keyed by parameter names) and
    ``FSDP.optim_state_dict_to_load``, and ``full_optim_state_dict`` /
    ``shard_full_optim_state_dict``: a fresh model and optimizer resume as one process does."""
    from shardkit.nn.data_parallel import FSDP, FullOptimStateDictConfig, StateDictType
    gen = torch.Generator().manual_seed(7)
    batches = [torch.randn(8, 6, generator=gen) for _ in range(3)]
    reference, model = _TwoLayers(), _wrap_two_layers(_TwoLayers())
    nets = [(reference, torch.optim.Adam(reference.parameters(), lr=0.1), lambda x: x),
            (model, torch.optim.Adam(model.parameters(), lr=0.1), local_slice)]
    for x in batches[:2]:
        for net, optim, part in nets:
            net(part(x)).pow(2).mean().backward()
            optim.step()
            optim.zero_grad()
    optim = nets[1][1]
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT, None,
                              FullOptimStateDictConfig(rank0_only=False)):
        named = FSDP.optim_state_dict(model, optim)
        weights = model.state_dict()
    expected = nets[0][1].state_dict()
    ref_names = [n for n, _ in reference.named_parameters()]
    out = {"names": sorted(named["state"]),
           "moments": max((named["state"][n]["exp_avg"] - expected["state"][i]["exp_avg"])
                          .abs().max().item() for i, n in enumerate(ref_names)),
           "rank0_only": len(FSDP.full_optim_state_dict(model, optim))}
    resumed = {}
    for how in ("named", "ids"):
        fresh = _wrap_two_layers(_TwoLayers())
        fresh.load_state_dict(weights)
        fresh_optim = torch.optim.Adam(fresh.parameters(), lr=0.1)
        if how == "named":
            fresh_optim.load_state_dict(FSDP.optim_state_dict_to_load(fresh, fresh_optim, named))
        else:
            full = FSDP.full_optim_state_dict(model, optim, rank0_only=False)
            fresh_optim.load_state_dict(FSDP.shard_full_optim_state_dict(full, fresh))
        fresh(local_slice(batches[2])).pow(2).mean().backward()
        fresh_optim.step()
        resumed[how] = fresh
    reference(batches[2]).pow(2).mean().backward()
    nets[0][1].step()
    for how, fresh in resumed.items():
        with fresh.summon_full_params():
            out[how] = max((a - b).abs().max().item()
                           for a, b in zip(fresh.parameters(), reference.parameters()))
    return out


def test_torch_fsdp1_optimizer_state_functions(world2):
    rank0, rank1 = world2.run(_torch_fsdp1_optimizer_state)
    assert rank0["rank0_only"] > 0 and rank1["rank0_only"] == 0
    for r in (rank0, rank1):
        assert r["names"] == ["l1.bias", "l1.weight", "l2.bias", "l2.weight"], r
        assert r["moments"] < 1e-7 and r["named"] < 1e-6 and r["ids"] < 1e-6, r


def _training_goes_on_after_a_backward_that_raised():
    """A training loop that skips a batch whose backward raised (fairseq's out-of-memory
    recovery: catch, zero_grad, next batch), here a hook of the user's raising half-way through
    backward after the root's reduce-scatter was issued. The next steps used to compute no
    gradient at all (the units still looked mid-backward); they must train as one process that
    skipped the batch."""
    reference, model = _TwoLayers(), _wrap_two_layers(_TwoLayers())
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1)
    optim = torch.optim.SGD(model.parameters(), lr=0.1)
    failing = {"now": False}

    def out_of_memory(module, grad_output):
        if failing["now"]:
            raise RuntimeError("simulated out of memory")

    model.module.l1.register_full_backward_pre_hook(out_of_memory)
    gen = torch.Generator().manual_seed(8)
    skipped = []
    for step in range(4):
        x = torch.randn(8, 6, generator=gen)
        failing["now"] = step == 1
        try:
            model(local_slice(x)).pow(2).mean().backward()
            optim.step()
        except RuntimeError as error:
            skipped.append(str(error))
        optim.zero_grad()
        if step != 1:
            reference(x).pow(2).mean().backward()
            ref_optim.step()
            ref_optim.zero_grad()
    with model.summon_full_params():
        worst = max((a - b).abs().max().item()
                    for a, b in zip(model.parameters(), reference.parameters()))
    return {"worst": worst, "skipped": skipped,
            "gathered": [u._shard.gathered for u in model.sharded_units()]}


def test_training_goes_on_after_a_backward_that_raised(world2):
    for r in world2.run(_training_goes_on_after_a_backward_that_raised):
        assert r["skipped"] == ["simulated out of memory"], r
        assert r["worst"] < 1e-6 and r["gathered"] == [False, False], r


class _GatedLookup(torch.nn.Module):
    """An MoE-style conditional layer: the embedding and its gate run only where the caller
    says (a data-dependent branch). The forward looks up rows 0-3 only, so at 2 ranks the
    rows rank 1 owns (4-7) get an exactly zero gradient, and the gate's weight (one row) is
    only padding there."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.emb, self.gate = torch.nn.Embedding(8, 4), torch.nn.Linear(4, 1)
        self.out = torch.nn.Linear(4, 2)

    def forward(self, idx, use_branch: bool):
        h = torch.ones(len(idx), 4)
        if use_branch:
            e = self.emb(idx)
            h = h + e * torch.sigmoid(self.gate(e))
        return self.out(h)


def _parameters_used_on_some_ranks_only(quantize_gradients: bool = False):
    """AdamW with weight decay, against one process on the global batch, step by step: the
    branch runs on rank 0 only (4 steps), then on no rank (1 step). Where it ran somewhere,
    every rank must hold a gradient shard (zeros on rank 1) and step it, as one process does
    (rank 1 used to keep ``grad None``, skip the step, and drift by 0.055; under qgZ too until
    the use counts went through the lossless transport there); where it ran nowhere,
    ``.grad`` stays None everywhere, as in one process."""
    from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP
    rank, n = skdist.get_rank(), skdist.get_world_size()
    reference = _GatedLookup()  # every rank runs the unit below
    model = FSDP(_GatedLookup(), quantize_gradients=quantize_gradients)
    hyper = dict(lr=0.05, weight_decay=0.1)
    ref_optim = torch.optim.AdamW(reference.parameters(), **hyper)
    optim = torch.optim.AdamW(model.parameters(), **hyper)
    gen = torch.Generator().manual_seed(9)
    out = {"worst": [], "without_grad": [], "ref_without_grad": []}
    for step in range(5):
        idx, y = torch.randint(0, 4, (4 * n,), generator=gen), torch.randn(4 * n, 2, generator=gen)
        users = [0] if step < 4 else []
        for r in range(n):
            rows = slice(4 * r, 4 * r + 4)
            loss = torch.nn.functional.mse_loss(reference(idx[rows], r in users), y[rows])
            (loss / n).backward()
        mine = slice(4 * rank, 4 * rank + 4)
        torch.nn.functional.mse_loss(model(idx[mine], rank in users), y[mine]).backward()
        out["without_grad"].append(sorted(k for k, p in model.named_parameters()
                                          if p.grad is None))
        out["ref_without_grad"].append(sorted(k for k, p in reference.named_parameters()
                                              if p.grad is None))
        for opt in (ref_optim, optim):
            opt.step()
            opt.zero_grad()
        with model.summon_full_params():
            out["worst"].append(max((a - b).abs().max().item()
                                    for a, b in zip(model.parameters(), reference.parameters())))
    out["optimizer_state"] = sorted(k for k, p in model.named_parameters() if optim.state[p])
    return out


@pytest.mark.parametrize("quantize_gradients", [False, True])
def test_parameters_used_on_some_ranks_only_step_on_every_rank(world2, quantize_gradients):
    for r in world2.run(_parameters_used_on_some_ranks_only, quantize_gradients):
        # int4 gradients (qgZ) round the reduced values: parity within the blocks' scales
        assert max(r["worst"]) < (2e-3 if quantize_gradients else 1e-6), r
        assert r["without_grad"] == r["ref_without_grad"], r
        assert r["without_grad"][-1] == ["emb.weight", "gate.bias", "gate.weight"], r
        assert len(r["optimizer_state"]) == 5, r


def _overflowing_loss(y: torch.Tensor, rank: int, overflow: bool) -> torch.Tensor:
    """A loss whose gradient is inf, when ``overflow``, in one output column only: column 3 on
    rank 0, column 0 on rank 1, so that at 2 ranks the inf rows of the weight's gradient are
    the ones the *other* rank owns after the reduce-scatter (rows 2-3 live on rank 1)."""
    column = 3 if rank == 0 else 0
    return (y * y).mean() + (y[:, column] * (float("inf") if overflow else 1.0)).mean()


def _torch_grad_scaler_sees_an_overflow_on_every_rank(quantize_gradients: bool):
    """``torch.amp.GradScaler`` (not the sharded one) with FSDP, against one process on the
    global batch: at steps 1 and 3 one rank's loss overflows (rank 0, then rank 1) in rows
    that the other rank owns. Every rank must skip those steps and back off its scale, as
    the one process does: before, only the owner of the inf rows saw it, skipped alone, and
    the ranks' scales moved apart (512 vs 2048 after one step), silently."""
    from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP
    rank, n = skdist.get_rank(), skdist.get_world_size()
    torch.manual_seed(0)
    reference = torch.nn.Linear(4, 4)
    model = FSDP(copy.deepcopy(reference), quantize_gradients=quantize_gradients)
    ref_optim = torch.optim.SGD(reference.parameters(), lr=0.1, momentum=0.9)
    optim = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    ref_scaler, scaler = (torch.amp.GradScaler("cpu", init_scale=1024.0, growth_interval=1)
                          for _ in range(2))
    gen = torch.Generator().manual_seed(3)
    out = {"scales": [], "ref_scales": [], "worst": []}
    for step in range(5):
        x = torch.randn(2 * n, 4, generator=gen)
        overflowing = {1: 0, 3: 1}.get(step)
        for r in range(n):
            loss = _overflowing_loss(reference(x[2 * r:2 * r + 2]), r, r == overflowing)
            ref_scaler.scale(loss / n).backward()
        mine = x[2 * rank:2 * rank + 2]
        scaler.scale(_overflowing_loss(model(mine), rank, rank == overflowing)).backward()
        for s, opt in ((ref_scaler, ref_optim), (scaler, optim)):
            s.step(opt)
            s.update()
            opt.zero_grad()
        out["scales"].append(scaler.get_scale())
        out["ref_scales"].append(ref_scaler.get_scale())
        with model.summon_full_params():
            out["worst"].append(max((a - b).abs().max().item()
                                    for a, b in zip(model.parameters(), reference.parameters())))
    return out


@pytest.mark.parametrize("quantize_gradients", [False, True])
def test_torch_grad_scaler_skips_an_overflow_on_every_rank(world2, quantize_gradients):
    for r in world2.run(_torch_grad_scaler_sees_an_overflow_on_every_rank, quantize_gradients):
        assert r["scales"] == r["ref_scales"] == [2048.0, 1024.0, 2048.0, 1024.0, 2048.0], r
        worst = r["worst"]
        assert worst[1] == worst[0] and worst[3] == worst[2], r  # the skipped steps changed nothing
        # int4 gradients (qgZ) of the scaled loss round the update: parity within their scales
        assert max(worst) < (0.05 if quantize_gradients else 1e-6), r


class _ConditionalUnit(torch.nn.Module):
    """``a -> (cond) -> b``, three units of one size; ``cond`` runs where the caller says."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.a, self.cond, self.b = (torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x, use_cond: bool):
        h = self.a(x)
        return self.b(self.cond(h) if use_cond else h)


def _unit_skipped_on_one_rank():
    """A whole unit whose forward runs on rank 0 only (after a first step on both, which
    records the prefetch order, so every forward gather still pairs up). Its reduce-scatter
    then pairs with another unit's on rank 1: rank 1 used to finish with a gradient mixed from
    two units and rank 0 to hang. Both ranks must raise, naming their unit. On a group of its
    own: the rank that raised first leaves a receive that nothing will match."""
    from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP
    group = skdist.new_group([0, 1])
    model = _ConditionalUnit()
    for name in ("a", "cond", "b"):
        setattr(model, name, FSDP(getattr(model, name), process_group=group,
                                  reshard_after_forward=False))
    model = FSDP(model, process_group=group)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(10))
    model(x, True).sum().backward()
    try:
        model(x, skdist.get_rank() == 0).sum().backward()
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_a_unit_run_on_some_ranks_only_raises_on_every_rank(world2):
    rank0, rank1 = world2.run(_unit_skipped_on_one_rank)
    for error in (rank0, rank1):
        assert "reduce-scatters are out of step" in error, error
        assert "a branch that runs a whole unit on some ranks only" in error, error
    assert "this rank reduced unit 'cond (Linear)'" in rank0, rank0
    assert "this rank reduced unit 'a (Linear)'" in rank1, rank1


class _SkippableChain(torch.nn.Module):
    """18 linears of one size in a chain; ``skip`` names the ones left out of a forward."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = torch.nn.ModuleList(torch.nn.Linear(4, 4) for _ in range(18))

    def forward(self, x, skip=()):
        for i, layer in enumerate(self.layers):
            if i not in skip:
                x = layer(x)
        return x


def _units_sixteen_apart_out_of_step():
    """Rank 1 leaves 16 consecutive units out of its second forward (after a no_sync
    micro-batch that kept every unit gathered, so no forward gather pairs up wrongly). The
    first reduce-scatters out of step pair ``layers.16`` with ``layers.0``, 16 positions
    apart, which carried the same tag when tags went 1 to 16: that pair went through (one
    mixed gradient) and the error came one unit later, at ``layers.15``. Tags now go up to
    4096 in fp32: the first mismatched pair raises. Own group, as above."""
    from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP
    group = skdist.new_group([0, 1])
    model = _SkippableChain()
    for i, layer in enumerate(model.layers):
        model.layers[i] = FSDP(layer, process_group=group, reshard_after_forward=False)
    model = FSDP(model, process_group=group)
    x = torch.randn(2, 4, generator=torch.Generator().manual_seed(10))
    with model.no_sync():  # every unit stays gathered: the next forward gathers nothing
        model(x).sum().backward()
    skip = range(1, 17) if skdist.get_rank() == 1 else ()
    try:
        model(x, skip).sum().backward()
    except RuntimeError as error:
        return str(error)
    return "no error"


def test_units_sixteen_positions_apart_out_of_step_raise(world2):
    # reduce-scatters finish in the order they were issued: each rank names the unit it
    # reduced in the first mismatched pair (rank 1 skipped layers 1-16)
    for rank, error in enumerate(world2.run(_units_sixteen_apart_out_of_step)):
        assert "reduce-scatters are out of step" in error, error
        unit = "layers.16" if rank == 0 else "layers.0"
        assert f"this rank reduced unit '{unit} (Linear)'" in error, error
