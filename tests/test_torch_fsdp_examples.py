"""pytorch/examples' FSDP T5 recipe (distributed/FSDP) with shardkit's FSDP.

The recipe's call patterns, small: a tiny Hugging Face T5 wrapped one unit per ``T5Block``
(``policies/wrapping.py``), trained and validated with the loops of ``utils/train_utils.py``,
under the sharding strategies of ``configs/fsdp.py`` and the ``bfSixteen`` /
``bfSixteen_mixed`` policies of ``policies/mixed_precision.py``, activation checkpointing as
``policies/activation_checkpointing_functions.py`` applies it, and the save/load paths of
``model_checkpointing/checkpoint_handler.py``. Where the recipe imports a name from
``torch.distributed.fsdp`` that shardkit has too, the shardkit name is used; where shardkit has
no such name (``MixedPrecision``) or a config file keeps torch's (``StateDictType``,
``ShardingStrategy`` in ``configs/fsdp.py``), torch's object is passed as the recipe has it.

fp32 training matches one process on the global batch step by step on every rank; bf16 stays
close to it. One world of 2 gloo ranks for the module.
"""

import functools
import os

import pytest
import torch
import torch.distributed as dist

from shardkit import distributed as skd
from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
from shardkit.nn.data_parallel import (FullStateDictConfig, MixedPrecisionPolicy,
                                       StateDictType)
from shardkit.nn.wrap import (auto_wrap, size_based_auto_wrap_policy,
                              transformer_auto_wrap_policy)
from shardkit.testing import world_fixture
from tests.hf.hf_common import SEQ, VOCAB, tiny_t5

from transformers.models.t5.modeling_t5 import T5Block  # noqa: E402  (after hf_common's env)

LOCAL_BATCH = 2
LR = 2e-3
STEPS = 3
TOL = 1e-5

world2 = world_fixture(2, timeout=240)


# ---------------------------------------------------------------------- rank-side helpers


def _global_batch(step: int, world: int) -> dict:
    """The recipe's batch keys (summarization_dataset.py): source ids and mask, target ids."""
    gen = torch.Generator().manual_seed(500 + step)
    n = LOCAL_BATCH * world
    mask = torch.ones(n, SEQ, dtype=torch.long)
    mask[:, -2:] = (torch.rand(n, 2, generator=gen) > 0.5).long()
    return {"source_ids": torch.randint(2, VOCAB, (n, SEQ), generator=gen),
            "source_mask": mask,
            "target_ids": torch.randint(2, VOCAB, (n, SEQ), generator=gen)}


def _my_rows(batch: dict) -> dict:
    rank = skd.get_rank()
    return {k: v[rank * LOCAL_BATCH:(rank + 1) * LOCAL_BATCH] for k, v in batch.items()}


def _loss(model, batch: dict) -> torch.Tensor:
    output = model(input_ids=batch["source_ids"], attention_mask=batch["source_mask"],
                   labels=batch["target_ids"])
    return output["loss"]


def _t5_policy():
    """policies/wrapping.py's get_t5_wrapper()."""
    return functools.partial(transformer_auto_wrap_policy, transformer_layer_cls={T5Block})


def _wrap(model, policy=None, **fsdp_kwargs):
    """T5_training.py's ``FSDP(model, auto_wrap_policy=..., ...)``, spelled as shardkit takes it:
    the policy goes to ``auto_wrap`` with the same FSDP arguments."""
    wrapped = auto_wrap(model, auto_wrap_policy=policy or _t5_policy(), **fsdp_kwargs)
    # a size policy selects the root too: auto_wrap's result is then the root already
    return wrapped if isinstance(wrapped, FSDP) else FSDP(wrapped, **fsdp_kwargs)


def _full_state(model) -> dict:
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=False)):
        return model.state_dict()


def _max_diff(a: dict, b: dict) -> float:
    assert set(a) == set(b), sorted(set(a) ^ set(b))[:6]
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


def _train_epoch(model, loader, optimizer, after_step=None) -> torch.Tensor:
    """utils/train_utils.py's train(): zero_grad, forward with labels, backward, step; the
    summed losses all-reduced at the end (its ``len(batch)`` counts the batch's keys)."""
    model.train()
    fsdp_loss = torch.zeros(2)
    for batch in loader:
        optimizer.zero_grad()
        loss = _loss(model, batch)
        loss.backward()
        optimizer.step()
        fsdp_loss[0] += loss.item()
        fsdp_loss[1] += len(batch)
        if after_step is not None:
            after_step(loss.detach())
    dist.all_reduce(fsdp_loss, op=dist.ReduceOp.SUM)
    return fsdp_loss[0] / fsdp_loss[1]


def _validation(model, loader) -> torch.Tensor:
    """utils/train_utils.py's validation(): eval mode, no grad, losses all-reduced."""
    model.eval()
    fsdp_loss = torch.zeros(3)
    with torch.no_grad():
        for batch in loader:
            fsdp_loss[0] += _loss(model, batch).item()
            fsdp_loss[1] += len(batch)
    dist.all_reduce(fsdp_loss, op=dist.ReduceOp.SUM)
    return fsdp_loss[0] / fsdp_loss[1]


def _fsdp_kwargs(strategy: str, mixed_precision) -> dict:
    """configs/fsdp.py keeps torch's ShardingStrategy; shardkit reads torch's members."""
    from torch.distributed.fsdp import ShardingStrategy as TorchStrategy
    kwargs = {"sharding_strategy": TorchStrategy[strategy]}
    if mixed_precision is not None:  # "none": T5_training.py's mp_policy without bf16
        kwargs["mixed_precision"] = None if mixed_precision == "none" else mixed_precision
    if strategy == "HYBRID_SHARD":  # at world 2: shard inside a "node" of 1, replicate over 2
        kwargs["process_group"] = skd.groups_of_nodes(list(range(skd.get_world_size())),
                                                      per_node=1)
    return kwargs


def _apply_recipe_checkpointing(model) -> None:
    """policies/activation_checkpointing_functions.py's apply_fsdp_checkpointing()."""
    from shardkit.nn.checkpoint import (CheckpointImpl, apply_activation_checkpointing,
                                        checkpoint_wrapper)
    non_reentrant_wrapper = functools.partial(checkpoint_wrapper, offload_to_cpu=False,
                                              checkpoint_impl=CheckpointImpl.NO_REENTRANT)
    apply_activation_checkpointing(model, checkpoint_wrapper_fn=non_reentrant_wrapper,
                                   check_fn=lambda submodule: isinstance(submodule, T5Block))


def _train_against_oracle(strategy: str = "FULL_SHARD", mixed_precision=None,
                          checkpointing: bool = False, policy: str = "t5") -> dict:
    """The recipe's epoch (train then validation, StepLR after it) on every rank beside one
    process training on the global batch; per step: the global mean loss and the largest
    parameter difference."""
    world = skd.get_world_size()
    oracle = tiny_t5(0)
    wrap_policy = (functools.partial(size_based_auto_wrap_policy, min_num_params=100)
                   if policy.startswith("size") else None)  # FSDP_mnist's policy
    fsdp_kwargs = _fsdp_kwargs(strategy, mixed_precision)
    if policy == "size, below root":  # what FSDP(model, auto_wrap_policy=...) would run
        from shardkit.nn.wrap.auto_wrap import wrap_below_root
        model = FSDP(wrap_below_root(tiny_t5(0), wrap_policy, **fsdp_kwargs), **fsdp_kwargs)
    else:
        model = _wrap(tiny_t5(0), wrap_policy, **fsdp_kwargs)
    if checkpointing:
        _apply_recipe_checkpointing(model)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    scheduler = torch.optim.lr_scheduler.StepLR(optimizer, step_size=1, gamma=0.7)
    oracle_opt = torch.optim.AdamW(oracle.parameters(), lr=LR)
    oracle_sched = torch.optim.lr_scheduler.StepLR(oracle_opt, step_size=1, gamma=0.7)
    batches = [_global_batch(s, world) for s in range(STEPS)]
    out = {"loss": [], "params": [], "dtypes": set()}
    step = iter(batches * 2)

    def after_step(loss):
        oracle.train()
        oracle_opt.zero_grad()
        oracle_loss = _loss(oracle, next(step))
        oracle_loss.backward()
        oracle_opt.step()
        mean = loss.clone()
        dist.all_reduce(mean)
        out["loss"].append(abs(mean.item() / world - oracle_loss.item()))
        full = _full_state(model)
        out["dtypes"] |= {str(v.dtype) for v in full.values()}
        out["params"].append(_max_diff(full, oracle.state_dict()))

    for epoch in range(2):
        _train_epoch(model, [_my_rows(b) for b in batches], optimizer, after_step)
        val = [_global_batch(100 + s, world) for s in range(2)]
        got = _validation(model, [_my_rows(b) for b in val]).item()
        oracle.eval()
        with torch.no_grad():
            want = sum(_loss(oracle, b).item() for b in val) * world / (3 * 2 * world)
        out.setdefault("validation", []).append(abs(got - want))
        scheduler.step()
        oracle_sched.step()
    out["dtypes"] = sorted(out["dtypes"])
    out["units"] = sum(isinstance(m, FSDP) for m in model.modules())
    return out


def _bf16_policies():
    """policies/mixed_precision.py's bfSixteen and bfSixteen_mixed, built with torch's
    MixedPrecision as the recipe builds them."""
    from torch.distributed.fsdp import MixedPrecision
    return {"bfSixteen": MixedPrecision(param_dtype=torch.bfloat16,
                                        reduce_dtype=torch.bfloat16,
                                        buffer_dtype=torch.bfloat16),
            "bfSixteen_mixed": MixedPrecision(param_dtype=torch.float32,
                                              reduce_dtype=torch.bfloat16,
                                              buffer_dtype=torch.bfloat16)}


def _mixed_precision_run(name: str, torch_object: bool) -> dict:
    policy = _bf16_policies()[name]
    if not torch_object:
        policy = MixedPrecisionPolicy(param_dtype=policy.param_dtype,
                                      reduce_dtype=policy.reduce_dtype,
                                      buffer_dtype=policy.buffer_dtype)
    return _train_against_oracle("FULL_SHARD", policy)


def _trained(steps: int = 2, **fsdp_kwargs):
    world = skd.get_world_size()
    model = _wrap(tiny_t5(0), **fsdp_kwargs)
    optimizer = torch.optim.AdamW(model.parameters(), lr=LR)
    _train_epoch(model, [_my_rows(_global_batch(s, world)) for s in range(steps)], optimizer)
    return model, optimizer


def _full_checkpoint(folder: str, torch_names: bool) -> dict:
    """checkpoint_handler.py's save_model_checkpoint (FULL_STATE_DICT, rank-0 CPU streaming)
    and load_model_checkpoint (rank 0 loads into the model before wrapping), with the
    StateDictType / FullStateDictConfig of shardkit or, as configs/fsdp.py keeps them,
    torch's."""
    if torch_names:
        from torch.distributed.fsdp import FullStateDictConfig as Config
        from torch.distributed.fsdp import StateDictType as Kind
    else:
        Config, Kind = FullStateDictConfig, StateDictType
    rank, world = skd.get_rank(), skd.get_world_size()
    model, _ = _trained()
    fullstate_save_policy = Config(offload_to_cpu=True, rank0_only=True)
    with FSDP.state_dict_type(model, Kind.FULL_STATE_DICT, fullstate_save_policy):
        cpu_state = model.state_dict()
    out = {"keys": len(cpu_state), "devices": sorted({str(v.device) for v in cpu_state.values()})}
    path = os.path.join(folder, "T5-model-1.pt")
    if rank == 0:
        torch.save(cpu_state, path)
    dist.barrier()
    plain = tiny_t5(5)
    out["strict"] = str(plain.load_state_dict(torch.load(path), strict=True))
    batch = _global_batch(50, world)
    model.eval()
    plain.eval()
    with torch.no_grad():
        out["loss diff"] = abs(_loss(model, batch).item() - _loss(plain, batch).item())
    fresh = tiny_t5(7)
    if rank == 0:
        fresh.load_state_dict(torch.load(path))
    fresh = _wrap(fresh, sync_module_states=True)
    out["reloaded diff"] = _max_diff(_full_state(fresh), torch.load(path))
    return out


def _optimizer_resume(folder: str, how: str) -> dict:
    """checkpoint_handler.py's save_optimizer_checkpoint (FSDP.full_optim_state_dict, saved by
    rank 0) and load_optimizer_checkpoint (rank 0 loads, FSDP.scatter_full_optim_state_dict
    hands each rank its part), or llama-recipes' FSDP.optim_state_dict /
    optim_state_dict_to_load: a fresh model and optimizer resume exactly where the trained ones
    are."""
    rank, world = skd.get_rank(), skd.get_world_size()
    model, optimizer = _trained()
    path = os.path.join(folder, f"optimizer-{how}.pt")
    if how == "scatter":
        optim_state = FSDP.full_optim_state_dict(model, optimizer)
    else:
        optim_state = FSDP.optim_state_dict(model, optimizer)
    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        cpu_state = model.state_dict()
    if rank == 0:
        torch.save(optim_state, path)
        torch.save(cpu_state, path + ".model")
    dist.barrier()
    fresh = tiny_t5(7)
    if rank == 0:
        fresh.load_state_dict(torch.load(path + ".model"))
    fresh = _wrap(fresh, sync_module_states=True)
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=LR)
    if how == "scatter":
        full_osd = torch.load(path) if rank == 0 else None
        sharded_osd = FSDP.scatter_full_optim_state_dict(full_osd, fresh)
        fresh_optimizer.load_state_dict(sharded_osd)
    else:
        FSDP.optim_state_dict_to_load(fresh, fresh_optimizer, torch.load(path),
                                      load_directly=True)
    later = [_my_rows(_global_batch(s, world)) for s in range(2, 4)]
    _train_epoch(model, later, optimizer)
    _train_epoch(fresh, later, fresh_optimizer)
    return {"resumed diff": _max_diff(_full_state(model), _full_state(fresh))}


def _scatter_without_dict() -> dict:
    model = _wrap(tiny_t5(0))
    out = {}
    try:
        FSDP.scatter_full_optim_state_dict({"not": "a state dict"} if skd.get_rank() else None,
                                           model)
    except ValueError as error:
        out["error"] = str(error)
    alive = torch.ones(1)
    dist.all_reduce(alive)
    out["after"] = alive.item()
    return out


def _sharded_state_dict(folder: str) -> dict:
    """checkpoint_handler.py's save_model_and_optimizer_sharded and load_model_sharded
    (SHARDED_STATE_DICT with torch.distributed.checkpoint), the optimizer loaded back with
    FSDP.optim_state_dict_to_load; one more step matches the saved run's."""
    import torch.distributed.checkpoint as dist_cp
    from shardkit.checkpoint.dtensor_state import init_optimizer_state
    world = skd.get_world_size()
    model, optimizer = _trained(steps=1)
    with FSDP.state_dict_type(model, StateDictType.SHARDED_STATE_DICT):
        state_dict = {"model": model.state_dict(),
                      "optim": FSDP.optim_state_dict(model, optimizer)}
        dist_cp.save(state_dict, storage_writer=dist_cp.FileSystemWriter(folder))
    dist.barrier()
    fresh = _wrap(tiny_t5(3))
    fresh_optimizer = torch.optim.AdamW(fresh.parameters(), lr=LR)
    init_optimizer_state(fresh_optimizer)
    with FSDP.state_dict_type(fresh, StateDictType.SHARDED_STATE_DICT):
        checkpoint = {"model": fresh.state_dict(),
                      "optim": FSDP.optim_state_dict(fresh, fresh_optimizer)}
        dist_cp.load(checkpoint, storage_reader=dist_cp.FileSystemReader(folder))
        fresh.load_state_dict(checkpoint["model"])
        fresh_optimizer.load_state_dict(
            FSDP.optim_state_dict_to_load(fresh, fresh_optimizer, checkpoint["optim"]))
    out = {"loaded diff": _max_diff(_full_state(model), _full_state(fresh))}
    batch = [_my_rows(_global_batch(1, world))]
    _train_epoch(model, batch, optimizer)
    _train_epoch(fresh, batch, fresh_optimizer)
    out["step diff"] = _max_diff(_full_state(model), _full_state(fresh))
    return out


def _local_state_dict(folder: str, dcp: bool) -> dict:
    """checkpoint_handler.py's save_distributed_model_checkpoint /
    load_distributed_model_checkpoint (LOCAL_STATE_DICT): with torch.distributed.checkpoint as
    the recipe does, or one torch.save file per rank (what shardkit's error for
    SHARDED_STATE_DICT recommends)."""
    import torch.distributed.checkpoint as dist_cp
    rank = skd.get_rank()
    model, _ = _trained(steps=1)
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        state_dict = model.state_dict()
    saved = {k: v.clone() for k, v in state_dict.items()}
    if dcp:
        dist_cp.save(state_dict, storage_writer=dist_cp.FileSystemWriter(folder))
    else:
        torch.save(state_dict, os.path.join(folder, f"local-{rank}.pt"))
    dist.barrier()
    fresh = _wrap(tiny_t5(3))
    with FSDP.state_dict_type(fresh, StateDictType.LOCAL_STATE_DICT):
        if dcp:
            state_dict = fresh.state_dict()
            dist_cp.load(state_dict, storage_reader=dist_cp.FileSystemReader(folder))
        else:
            state_dict = torch.load(os.path.join(folder, f"local-{rank}.pt"))
        fresh.load_state_dict(state_dict)
        loaded = fresh.state_dict()
    return {"diff": _max_diff(saved, loaded),
            "full diff": _max_diff(_full_state(model), _full_state(fresh))}


def _local_state_dict_through_dcp_refused(folder: str) -> dict:
    """load/save_distributed_model_checkpoint's LOCAL_STATE_DICT with dist_cp: refused."""
    import torch.distributed.checkpoint as dist_cp
    model, _ = _trained(steps=1)
    out = {}
    with FSDP.state_dict_type(model, StateDictType.LOCAL_STATE_DICT):
        try:
            dist_cp.save(model.state_dict(),
                         storage_writer=dist_cp.FileSystemWriter(folder + "/local"))
        except dist_cp.api.CheckpointException as error:
            out["save"] = str(error)
        out["metadata written"] = os.path.exists(folder + "/local/.metadata")
        # a checkpoint written from such plain tensors (as dcp wrote them before)
        plain = {k: v.clone() for k, v in model.state_dict().items()}
        dist_cp.save(plain, storage_writer=dist_cp.FileSystemWriter(folder + "/plain"))
        fresh = _wrap(tiny_t5(3))
        before = _full_state(fresh)
        with FSDP.state_dict_type(fresh, StateDictType.LOCAL_STATE_DICT):
            try:
                state_dict = fresh.state_dict()
                dist_cp.load(state_dict, storage_reader=dist_cp.FileSystemReader(
                    folder + "/plain"))
                fresh.load_state_dict(state_dict)
            except dist_cp.api.CheckpointException as error:
                out["load"] = str(error)
    alive = torch.ones(1)
    dist.all_reduce(alive)
    out["after"] = alive.item()
    out["unchanged"] = _max_diff(before, _full_state(fresh))
    return out


def _t5_training_call() -> dict:
    """T5_training.py's own call: ``FSDP(model, auto_wrap_policy=..., mixed_precision=None,
    device_id=...)`` (``mp_policy`` is None where bf16 is not ready; CPU: no device id)."""
    try:
        model = FSDP(tiny_t5(0), auto_wrap_policy=_t5_policy(), mixed_precision=None,
                     device_id=None)
    except TypeError as error:  # every rank alike, before any collective
        return {"TypeError": str(error)}
    units = sum(isinstance(m, FSDP) for m in model.modules())
    reference = _wrap(tiny_t5(0))
    return {"units": units, "reference units": sum(isinstance(m, FSDP)
                                                   for m in reference.modules()),
            "diff": _max_diff(_full_state(model), _full_state(reference))}


def _cpu_offload_object() -> dict:
    """wrapping.py's import list: torch's CPUOffload(offload_params=True)."""
    from torch.distributed.fsdp import CPUOffload
    world = skd.get_world_size()
    oracle = tiny_t5(0)
    try:
        model = _wrap(tiny_t5(0), cpu_offload=CPUOffload(offload_params=True))
    except ValueError as error:  # every rank alike, before any collective
        return {"ValueError": str(error)}
    for m, rows in ((model, _my_rows), (oracle, lambda b: b)):
        optimizer = torch.optim.AdamW(m.parameters(), lr=LR)
        _train_epoch(m, [rows(_global_batch(0, world))], optimizer)
    return {"diff": _max_diff(_full_state(model), oracle.state_dict())}


# ---------------------------------------------------------------------- tests


@pytest.mark.parametrize("strategy", ["FULL_SHARD", "SHARD_GRAD_OP", "NO_SHARD", "HYBRID_SHARD"])
def test_train_and_validation_loops_match_one_process(world2, strategy):
    """train_utils.py's train()/validation() loops with configs/fsdp.py's strategies (torch's
    ShardingStrategy members): every rank's parameters equal one process's step by step."""
    for rank, r in enumerate(world2.run(_train_against_oracle, strategy)):
        assert r["dtypes"] == ["torch.float32"]
        assert max(r["params"]) < TOL, (rank, r["params"])
        assert max(r["loss"]) < TOL, (rank, r["loss"])
        assert max(r["validation"]) < TOL, (rank, r["validation"])


def test_mixed_precision_none_trains_in_fp32(world2):
    """T5_training.py: ``mixed_precision=mp_policy``, None where bf16 is not ready (torch's
    default; before: a ValueError)."""
    for r in world2.run(_train_against_oracle, "FULL_SHARD", "none"):
        assert max(r["params"]) < TOL and max(r["loss"]) < TOL, r


@pytest.mark.parametrize("how", ["size", "size, below root"])
def test_size_based_policy_matches_one_process(world2, how):
    """FSDP_mnist's ``size_based_auto_wrap_policy(min_num_params=100)`` on the T5, through
    ``auto_wrap`` (whose result is the root: the policy selects it) or ``wrap_below_root``
    (torch's constructor rule: the root is the caller's own FSDP)."""
    for r in world2.run(_train_against_oracle, "FULL_SHARD", None, False, how):
        assert max(r["params"]) < TOL and max(r["loss"]) < TOL, r
        assert r["units"] > 1, r


def test_recipe_activation_checkpointing_matches_one_process(world2):
    """apply_fsdp_checkpointing: apply_activation_checkpointing(model, checkpoint_wrapper_fn=
    partial(checkpoint_wrapper, offload_to_cpu=False, checkpoint_impl=CheckpointImpl.
    NO_REENTRANT), check_fn=isinstance T5Block) after wrapping; training is unchanged."""
    for r in world2.run(_train_against_oracle, "FULL_SHARD", None, True):
        assert max(r["params"]) < TOL and max(r["loss"]) < TOL, r


def test_checkpoint_impl_reentrant_is_refused_by_name():
    from shardkit.nn.checkpoint import CheckpointImpl, checkpoint_wrapper
    with pytest.raises(ValueError, match="checkpoint_impl=.*NO_REENTRANT"):
        checkpoint_wrapper(torch.nn.Linear(2, 2), checkpoint_impl=CheckpointImpl.REENTRANT)


@pytest.mark.parametrize("name", ["bfSixteen", "bfSixteen_mixed"])
def test_bf16_policies_stay_close_to_fp32(world2, name):
    """The recipe's bf16 policies (torch's MixedPrecision objects): the ranks agree, masters
    stay fp32, and the loss stays close to fp32 training's (bfSixteen computes in bf16, so its
    first loss differs; bfSixteen_mixed computes in fp32 and only reduces in bf16)."""
    first, second = world2.run(_mixed_precision_run, name, True)
    assert first == second
    assert first["dtypes"] == ["torch.float32"]
    if name == "bfSixteen":
        assert 1e-6 < first["loss"][0] < 5e-2, first["loss"]
        assert max(first["loss"]) < 1e-1, first["loss"]
    else:
        assert first["loss"][0] < TOL, first["loss"]
        assert max(first["loss"]) < 2e-3, first["loss"]
    assert max(first["validation"]) < 1e-1, first["validation"]


def test_torch_mixed_precision_object_equals_shardkit_policy(world2):
    """torch's MixedPrecision(bf16, bf16, bf16) trains exactly as MixedPrecisionPolicy with the
    same dtypes (before: a ValueError for torch's object)."""
    as_torch = world2.run(_mixed_precision_run, "bfSixteen", True)
    as_policy = world2.run(_mixed_precision_run, "bfSixteen", False)
    assert as_torch == as_policy


@pytest.mark.parametrize("torch_names", [False, True], ids=["shardkit-names", "torch-names"])
def test_full_state_dict_checkpoint(world2, tmp_path, torch_names):
    """save_model_checkpoint / load_model_checkpoint: rank 0 alone gets the full CPU state,
    which loads strictly into a plain T5 with the same loss, and into a fresh model on rank 0
    before wrapping (``sync_module_states=True`` gives it to the other rank). With torch's
    StateDictType / FullStateDictConfig (configs/fsdp.py's import) too."""
    first, second = world2.run(_full_checkpoint, str(tmp_path), torch_names)
    assert first["keys"] == len(tiny_t5(0).state_dict()) and first["devices"] == ["cpu"]
    assert second["keys"] == 0
    for r in (first, second):
        assert r["strict"] == "<All keys matched successfully>"
        assert r["loss diff"] < 1e-6 and r["reloaded diff"] == 0.0, r


@pytest.mark.parametrize("how", ["scatter", "optim_state_dict"])
def test_optimizer_checkpoint_resumes_exactly(world2, tmp_path, how):
    """save_optimizer_checkpoint / load_optimizer_checkpoint (full_optim_state_dict on rank 0,
    scatter_full_optim_state_dict) and llama-recipes' optim_state_dict /
    optim_state_dict_to_load: the resumed model trains exactly as the uninterrupted one."""
    for r in world2.run(_optimizer_resume, str(tmp_path), how):
        assert r["resumed diff"] == 0.0, r


def test_scatter_full_optim_state_dict_without_a_dict_on_rank0(world2):
    """Rank 0 passing None: the same ValueError on every rank, and no rank is left waiting."""
    for r in world2.run(_scatter_without_dict):
        assert "scatter_full_optim_state_dict(full_optim_state_dict=None) on rank 0" in \
            r["error"]
        assert r["after"] == 2.0


def test_sharded_state_dict_with_distributed_checkpoint(world2, tmp_path):
    """save_model_and_optimizer_sharded / load_model_sharded: SHARDED_STATE_DICT through
    dist_cp; the resumed run continues exactly."""
    for r in world2.run(_sharded_state_dict, str(tmp_path)):
        assert r["loaded diff"] == 0.0 and r["step diff"] == 0.0, r


def test_local_state_dict_one_file_per_rank(world2, tmp_path):
    for r in world2.run(_local_state_dict, str(tmp_path), False):
        assert r["diff"] == 0.0 and r["full diff"] == 0.0, r


def test_local_state_dict_with_distributed_checkpoint(world2, tmp_path):
    """save/load_distributed_model_checkpoint: LOCAL_STATE_DICT through dist_cp. Its values are
    plain tensors of each rank's padded rows (FairScale's contract, for torch.save), which dcp
    would take for replicated tensors (one rank's rows written and loaded on every rank): a
    documented limitation, refused on every rank with a message naming SHARDED_STATE_DICT,
    before anything is written (save) or loaded (load of a checkpoint written from such plain
    tensors); no rank is left in a collective."""
    for r in world2.run(_local_state_dict_through_dcp_refused, str(tmp_path)):
        for side in ("save", "load"):
            assert "LOCAL_STATE_DICT" in r[side] and "SHARDED_STATE_DICT" in r[side], r
            assert "ranks:dict_keys([0, 1])" in r[side], r
        assert not r["metadata written"] and r["after"] == 2.0 and r["unchanged"] == 0.0, r


def test_t5_training_constructor_call(world2):
    results = world2.run(_t5_training_call)
    if "TypeError" in results[0]:
        raise TypeError(results[0]["TypeError"])
    for r in results:
        assert r["units"] == r["reference units"] == 5 and r["diff"] == 0.0, r


def test_torch_cpu_offload_object(world2):
    results = world2.run(_cpu_offload_object)
    if "ValueError" in results[0]:
        raise ValueError(results[0]["ValueError"])
    for r in results:
        assert r["diff"] < TOL, r
