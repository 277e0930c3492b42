"""torch FSDP1's own objects given to shardkit's FSDP train as torch FSDP1 trains them.

torch FSDP1 runs on CPU with ``device_id=torch.device("cpu")``, so it is the oracle here: the
same model, batches and optimizer under both, compared loss by loss. One world of 2 gloo
ranks for the module.
"""

import functools

import pytest
import torch
import torch.distributed as dist
import torch.nn as nn

from shardkit import distributed as skd
from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
from shardkit.testing import world_fixture
from tests.hf.hf_common import SEQ, VOCAB, tiny_t5

from transformers.models.t5.modeling_t5 import T5Block  # noqa: E402  (after hf_common's env)

world2 = world_fixture(2, timeout=240)


def _batchnorm_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.BatchNorm1d(8), nn.ReLU(),
                         nn.Sequential(nn.Linear(8, 8), nn.ReLU()), nn.Linear(8, 3))


def _policy(kind: str):
    from torch.distributed.fsdp.wrap import ModuleWrapPolicy, lambda_auto_wrap_policy
    if kind == "ModuleWrapPolicy":
        return ModuleWrapPolicy({nn.Linear})
    return functools.partial(lambda_auto_wrap_policy,
                             lambda_fn=lambda m: isinstance(m, nn.Sequential) and len(m) == 2)


def _bf16_batchnorm_run(which: str, kind: str, buffers_too: bool) -> dict:
    """torch's MixedPrecision (bf16 parameters; bf16 reductions and buffers too, as the T5
    recipe's bfSixteen) with an auto_wrap_policy on a model with a BatchNorm: torch gives the
    BatchNorm a full-precision unit of its own (``_module_classes_to_ignore``)."""
    from torch.distributed.fsdp import FullyShardedDataParallel as TorchFSDP
    from torch.distributed.fsdp import MixedPrecision
    rank, world = skd.get_rank(), skd.get_world_size()
    mp = MixedPrecision(param_dtype=torch.bfloat16)
    if buffers_too:
        mp = MixedPrecision(param_dtype=torch.bfloat16, reduce_dtype=torch.bfloat16,
                            buffer_dtype=torch.bfloat16)
    if which == "torch":
        model = TorchFSDP(_batchnorm_model(), auto_wrap_policy=_policy(kind), mixed_precision=mp,
                          device_id=torch.device("cpu"))
    else:
        model = FSDP(_batchnorm_model(), auto_wrap_policy=_policy(kind), mixed_precision=mp)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    losses = []
    for step in range(3):
        gen = torch.Generator().manual_seed(10 + step)
        x = torch.randn(4 * world, 6, generator=gen) * 3 + 1
        y = torch.randn(4 * world, 3, generator=gen)
        x, y = x[rank * 4:(rank + 1) * 4], y[rank * 4:(rank + 1) * 4]
        optimizer.zero_grad()
        loss = ((model(x).float() - y) ** 2).mean()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    units = sum(type(m).__name__ == "FullyShardedDataParallel" for m in model.modules())
    return {"losses": losses, "units": units}


def _torch_checkpoint_wrapper_run(plain: bool) -> dict:
    """policies/activation_checkpointing_functions.py with its own imports (torch's
    checkpoint_wrapper and CheckpointImpl) handed to shardkit's apply_activation_checkpointing:
    training matches one process on the global batch."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import (CheckpointImpl,
                                                                             checkpoint_wrapper)
    from shardkit.nn.checkpoint import apply_activation_checkpointing
    from shardkit.nn.wrap import transformer_auto_wrap_policy
    rank, world = skd.get_rank(), skd.get_world_size()
    oracle = tiny_t5(0)
    model = FSDP(tiny_t5(0), auto_wrap_policy=functools.partial(
        transformer_auto_wrap_policy, transformer_layer_cls={T5Block}))
    wrapper = checkpoint_wrapper if plain else functools.partial(
        checkpoint_wrapper, offload_to_cpu=False, checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=wrapper,
                                   check_fn=lambda m: isinstance(m, T5Block))
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3)
    oracle_optimizer = torch.optim.AdamW(oracle.parameters(), lr=2e-3)
    diffs = []
    for step in range(2):
        gen = torch.Generator().manual_seed(500 + step)
        ids = torch.randint(2, VOCAB, (2 * world, SEQ), generator=gen)
        labels = torch.randint(2, VOCAB, (2 * world, SEQ), generator=gen)
        mine = slice(rank * 2, (rank + 1) * 2)
        optimizer.zero_grad()
        loss = model(input_ids=ids[mine], labels=labels[mine])["loss"]
        loss.backward()
        optimizer.step()
        oracle_optimizer.zero_grad()
        oracle_loss = oracle(input_ids=ids, labels=labels)["loss"]
        oracle_loss.backward()
        oracle_optimizer.step()
        mean = loss.detach().clone()
        dist.all_reduce(mean)
        diffs.append(abs(mean.item() / world - oracle_loss.item()))
    with FSDP.summon_full_params(model):
        full = {n.replace("_fsdp_wrapped_module.", ""): p.detach().clone()
                for n, p in model.named_parameters()}
    reference = dict(oracle.named_parameters())
    diffs.append(max((full[n] - reference[n]).abs().max().item() for n in reference))
    return {"diffs": diffs}


def _fp64_reduce_only_run() -> dict:
    """torch's MixedPrecision naming only reduce_dtype on an fp64 model: torch computes in
    the parameters' own dtype (fp64)."""
    from torch.distributed.fsdp import MixedPrecision
    rank, world = skd.get_rank(), skd.get_world_size()
    oracle = _batchnorm_model().double()
    model = FSDP(_batchnorm_model().double(),
                 mixed_precision=MixedPrecision(reduce_dtype=torch.float32))
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(4 * world, 6, generator=gen, dtype=torch.float64)
    out = model(x[rank * 4:(rank + 1) * 4])
    want = oracle(x[rank * 4:(rank + 1) * 4])  # BatchNorm: this rank's batch statistics
    return {"dtype": str(out.dtype), "diff": (out - want).abs().max().item()}


@pytest.mark.parametrize("kind, buffers_too", [("lambda_auto_wrap_policy", True),
                                               ("ModuleWrapPolicy", False)],
                         ids=["bfSixteen-lambda", "param-only-ModuleWrapPolicy"])
def test_torch_mixed_precision_runs_batchnorm_in_its_own_fp32_unit(world2, kind, buffers_too):
    """Before: with bf16 buffers the BatchNorm computed in bf16 inside its parent's unit and
    training differed from torch's without an error; with fp32 buffers (torch's None) the
    constructor refused a model torch trains."""
    theirs = world2.run(_bf16_batchnorm_run, "torch", kind, buffers_too)
    ours = world2.run(_bf16_batchnorm_run, "shardkit", kind, buffers_too)
    for t, o in zip(theirs, ours):
        assert o["units"] == t["units"], (o, t)
        assert max(abs(a - b) for a, b in zip(o["losses"], t["losses"])) < 1e-6, (o, t)


@pytest.mark.parametrize("plain", [False, True], ids=["recipe-partial", "plain"])
def test_torch_checkpoint_wrapper_fn_trains_as_one_process(world2, plain):
    """Before: torch.utils.checkpoint.CheckpointError at the first backward."""
    for r in world2.run(_torch_checkpoint_wrapper_run, plain):
        assert max(r["diffs"]) < 1e-5, r


def test_torch_checkpoint_wrapper_fn_with_other_arguments_is_refused():
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from shardkit.nn.checkpoint import apply_activation_checkpointing
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match="checkpoint_wrapper_fn=.*preserve_rng_state"):
        apply_activation_checkpointing(
            model, checkpoint_wrapper_fn=functools.partial(checkpoint_wrapper,
                                                           preserve_rng_state=False),
            check_fn=lambda m: isinstance(m, nn.Linear))


@pytest.mark.parametrize("torch_wrapper", [True, False])
def test_wrapper_in_torchs_positional_place_is_refused(torch_wrapper):
    """torch's order ``apply_activation_checkpointing(model, checkpoint_wrapper_fn)``: here the
    second place is the policy, and a wrapper there used to checkpoint every child silently."""
    from torch.distributed.algorithms._checkpoint import checkpoint_wrapper as torch_module
    from shardkit.nn.checkpoint import apply_activation_checkpointing, checkpoint_wrapper
    wrapper = torch_module.checkpoint_wrapper if torch_wrapper else checkpoint_wrapper
    model = nn.Sequential(nn.Linear(2, 2), nn.Linear(2, 2))
    with pytest.raises(ValueError, match="checkpoint_wrapper_fn="):
        apply_activation_checkpointing(model, functools.partial(wrapper))
    assert all(type(m) is nn.Linear for m in model)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only message")
@pytest.mark.parametrize("device_id", [0, "cuda", torch.device("cuda", 0), -1])
def test_device_id_without_cuda_names_the_argument(device_id):
    """T5_training.py's ``device_id=torch.cuda.current_device()`` on a CPU-only machine. Before:
    torch's AssertionError ("Torch not compiled with CUDA enabled"), or a RuntimeError for -1."""
    with pytest.raises(ValueError, match="device_id="):
        FSDP(nn.Linear(2, 2), device_id=device_id)


def test_torch_mixed_precision_without_param_dtype_computes_in_the_parameters_dtype(world2):
    """Before: an fp64 model computed in fp32 (param_dtype None was read as fp32)."""
    for r in world2.run(_fp64_reduce_only_run):
        assert r["dtype"] == "torch.float64" and r["diff"] < 1e-12, r
