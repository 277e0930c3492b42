"""FSDP bad input: clear errors naming the argument, the value and the fix, raised before any
collective starts (so every rank raises the same error and none hangs)."""

import copy
import io
import pickle

import pytest
import torch
import torch.nn as nn
import torch.nn.utils.prune  # noqa: F401 - torch.nn.utils.prune below

from shardkit.models import MLP
from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel as FSDP
from shardkit.testing import world_fixture
from tests.nn.fsdp_common import build_gpt, make_optimizer, train_step, wrap_gpt


world2 = world_fixture(2)


def _raises(fn, exc, *fragments):
    try:
        fn()
    except exc as e:
        text = str(e)
        missing = [f for f in fragments if f not in text]
        return f"message lacks {missing}: {text}" if missing else "ok"
    return f"no {exc.__name__} raised"


def _torch_save(module):
    torch.save(module, io.BytesIO())


def _error_cases():
    results = {}
    mlp = MLP(8, 2)
    wrapped = FSDP(mlp)
    results["wrap_wrapper"] = _raises(lambda: FSDP(wrapped), ValueError,
                                      "already a FullyShardedDataParallel", "wrap each module once")
    results["wrap_module_twice"] = _raises(lambda: FSDP(mlp), ValueError,
                                           "already wrapped", "wrap each module once")
    results["bad_flag"] = _raises(lambda: FSDP(MLP(8, 2), reshard_after_forward="yes"),
                                  ValueError, "reshard_after_forward='yes'", "True or False")
    results["bad_mixed_precision"] = _raises(lambda: FSDP(MLP(8, 2), mixed_precision="bf16"),
                                             ValueError, "mixed_precision='bf16'",
                                             "MixedPrecisionPolicy")
    results["fp32_rs_without_mp"] = _raises(lambda: FSDP(MLP(8, 2), fp32_reduce_scatter=True),
                                            ValueError, "fp32_reduce_scatter", "mixed_precision")
    results["not_a_module"] = _raises(lambda: FSDP("model"), ValueError, "nn.Module")
    with_grad = MLP(8, 2)
    with_grad(torch.randn(3, 8)).sum().backward()
    results["stale_grad"] = _raises(lambda: FSDP(with_grad), ValueError, "already has a .grad",
                                    "zero_grad(set_to_none=True)")

    # nn.Embedding(max_norm=) writes into its weight in forward: before, autograd's "a view
    # ... has been modified inplace" at the first forward (the write could not reach the shard)
    renorming = nn.Sequential(nn.Linear(4, 4), nn.Sequential(nn.Embedding(10, 4, max_norm=1.0)))
    results["embedding_max_norm"] = _raises(lambda: FSDP(renorming), ValueError,
                                            "1.0 is nn.Embedding(max_norm=1.0)",
                                            "max_norm=None")

    shared = nn.Linear(4, 4)
    outer = nn.Sequential(nn.Sequential(shared), nn.Linear(4, 4))
    outer[1].weight = shared.weight  # shared across what will become two units
    outer[0] = FSDP(outer[0])
    results["shared_across_units"] = _raises(lambda: FSDP(outer), ValueError,
                                             "already sharded", "lowest module")

    # a weight tied to a module outside the unit, no FSDP root: the outside module read this
    # rank's rows (a shape error, silently wrong for a one-row parameter); refused at the
    # first forward, on every rank, before any collective
    tied = nn.Sequential(nn.Linear(4, 4), nn.Linear(4, 4, bias=False))
    tied[1].weight = tied[0].weight
    tied[0] = FSDP(tied[0])
    results["tied_outside_the_unit"] = _raises(
        lambda: tied(torch.randn(2, 4)), RuntimeError, "Sequential.1.weight",
        "outside every FSDP unit", "must stay inside one unit")
    # torch.nn.utils.prune after wrapping: the mask had the shard's shape and the forward
    # failed with "The expanded size of the tensor (2) must match the existing size (4)"
    pruned = FSDP(nn.Linear(4, 4))
    torch.nn.utils.prune.l1_unstructured(pruned.module, "weight", amount=0.5)
    results["pruned_after_wrapping"] = _raises(
        lambda: pruned(torch.randn(2, 4)), RuntimeError, "Linear.weight", "after wrapping",
        "torch.nn.utils.prune", "before wrapping")

    model = wrap_gpt(build_gpt())
    optim = make_optimizer(model)
    train_step(model, optim, 0)
    inner = model.sharded_units()[1]

    def inner_no_sync():
        with inner.no_sync():
            pass

    results["no_sync_inner"] = _raises(inner_no_sync, RuntimeError, "inner", "root")
    results["clip_inner"] = _raises(lambda: inner.clip_grad_norm_(1.0), RuntimeError, "root")
    results["recipient"] = _raises(lambda: model.gather_full_optim_state_dict(optim, 5),
                                   ValueError, "recipient_rank=5", "0..1")
    own = model.local_state_dict()
    other_world = dict(model.local_metadata_dict(), world_size=3)
    results["local_from_other_world"] = _raises(
        lambda: model.load_local_state_dict(own, metadata=other_world), ValueError,
        "world of 3", "list of all 3")
    results["reshard_without_metadata"] = _raises(
        lambda: model.load_local_state_dict([own, own]), ValueError, "metadata=")
    # another model's (or an already sharded) optimizer state: refused before it is loaded,
    # not a shape error at the next step
    other = torch.optim.AdamW(MLP(8, 2).parameters())
    other.state = {p: {"step": torch.tensor(1.0), "exp_avg": torch.zeros(p.shape),
                       "exp_avg_sq": torch.zeros(p.shape)}
                   for g in other.param_groups for p in g["params"]}
    results["optim_of_other_model"] = _raises(
        lambda: model.get_shard_from_optim_state_dict(other.state_dict()), ValueError,
        "state 'exp_avg' of parameter 0 has shape", "full shape")
    # a full state dict with one tensor of another shape: torch's size-mismatch error, and not
    # one shard written (torch's own load copies the tensors that fit first)
    full = {k: v + 1 for k, v in model.state_dict().items()}
    name = next(k for k, v in full.items() if v.dim() == 2)
    full[name] = torch.zeros(full[name].shape[0] + 1, full[name].shape[1])
    before = model.local_state_dict()
    results["load_other_shapes"] = _raises(lambda: model.load_state_dict(full), RuntimeError,
                                           f"size mismatch for {name}", "nothing was loaded")
    results["load_other_shapes_wrote"] = "ok" if all(
        torch.equal(a, b) for a, b in zip(before.values(), model.local_state_dict().values())) \
        else "shards changed"
    results["assign"] = _raises(lambda: model.load_state_dict({}, assign=True), ValueError,
                                "assign=True")
    results["norm_type"] = _raises(lambda: model.clip_grad_norm_(1.0, norm_type=-1),
                                   ValueError, "norm_type=-1")
    # a BatchNorm in a bf16 unit with fp32 buffers: torch's batch_norm used to fail at the
    # first forward ("expected scalar type BFloat16 but found Float")
    bn_model = nn.Sequential(nn.Linear(4, 4), nn.BatchNorm1d(4))
    results["batchnorm_buffer_dtype"] = _raises(
        lambda: FSDP(bn_model, compute_dtype=torch.bfloat16, buffer_dtype=torch.float32),
        ValueError, "buffer_dtype=torch.float32", "BatchNorm1d", "auto_wrap_bn(model)")
    results["summon_with_grads"] = _raises(
        lambda: model.summon_full_params(with_grads=True).__enter__(), ValueError,
        "with_grads=True")
    # FairScale's second positional argument is volatile, torch's writeback: opposite meanings
    results["summon_positional"] = _raises(
        lambda: model.summon_full_params(True, True).__enter__(), TypeError,
        "volatile=", "writeback=", "by keyword")
    results["summon_recurse_not_bool"] = _raises(
        lambda: model.summon_full_params(recurse="yes").__enter__(), ValueError,
        "recurse='yes'", "True or False")
    for name, copy_it in (("deepcopy", copy.deepcopy), ("torch_save", _torch_save),
                          ("pickle", pickle.dumps)):
        results[name] = _raises(lambda: copy_it(model), TypeError, "cannot be pickled or copied",
                                "state_dict()")
    # a plain module holding units (no root unit) refuses too
    results["deepcopy_holder"] = _raises(lambda: copy.deepcopy(nn.Sequential(FSDP(MLP(8, 2)))),
                                         TypeError, "cannot be pickled or copied")
    # a dtype or device change after wrapping: refused before any tensor changes (it used to
    # cast the buffers, be undone on the shards at the next gather and fail in the forward
    # with "mat1 and mat2 must have the same dtype")
    for name, convert in (("half", lambda: model.half()),
                          ("to_double", lambda: model.to(torch.float64))):
        results[name] = _raises(convert, RuntimeError, "after wrapping", "float32",
                                "before wrapping", "compute_dtype=")
    dtypes = {t.dtype for t in list(model.parameters()) + list(model.buffers())
              if t.is_floating_point()}
    results["half_changed_nothing"] = "ok" if dtypes == {torch.float32} else str(dtypes)
    results["no_op_conversions"] = "ok" if model.to("cpu").float().cpu() is model else "refused"
    # the world is still usable: every rank raised before any collective
    train_step(model, optim, 1)
    return results


def test_bad_input_errors(world2):
    for results in world2.run(_error_cases):
        bad = {k: v for k, v in results.items() if v != "ok"}
        assert not bad, bad


def test_no_process_group():
    with pytest.raises(RuntimeError, match="init_distributed"):
        FSDP(MLP(8, 2))
