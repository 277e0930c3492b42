"""The model's weights as DeepSpeed scripts read and write them (:class:`ModelWeights`, mixed
into :class:`shardkit.engine.ShardedEngine`): ``module_state_dict()`` and
``load_module_state_dict()``, and the 16-bit export ``save_16bit_model()`` (written by rank 0
through a temporary file renamed into place). Stage 3 and tensor parallelism gather the full
weights (a collective on every rank, the full model in memory); elsewhere local.
"""

from __future__ import annotations

import os
from typing import Callable, Optional

import torch

from shardkit import distributed, engine_export


def _write_atomically(state: dict, path: str) -> Optional[str]:
    """``torch.save`` of ``state`` (tensors on CPU; a module's ``get_extra_state()`` object
    as it is, as torch's ``state_dict`` holds it) to ``path`` through a temporary file renamed
    into place; returns the error's text instead of raising (any error: the caller's other
    ranks wait to hear the outcome), and leaves no temporary behind."""
    from shardkit.checkpoint.file_writes import save_torch_file
    staging = f"{path}.tmp{os.getpid()}"
    try:
        os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
        save_torch_file({k: v.detach().cpu() if isinstance(v, torch.Tensor) else v
                         for k, v in state.items()}, staging)  # a full disk named as such
        os.replace(staging, path)
        return None
    except Exception as error:  # noqa: BLE001 - an unpicklable extra state too, not only I/O
        return f"{type(error).__name__}: {error}"
    finally:
        if os.path.exists(staging):
            os.remove(staging)


def _is_floating_weight(name: str, value) -> bool:
    """A floating parameter or buffer of a ``state_dict``, which the 16-bit export casts; not a
    module's ``get_extra_state()`` object, even a float tensor (its own format, which
    ``set_extra_state`` reads back, as DeepSpeed writes it)."""
    return isinstance(value, torch.Tensor) and value.is_floating_point() \
        and not name.endswith("_extra_state")


class ModelWeights:
    """Mixed into :class:`shardkit.engine.ShardedEngine`; needs ``self.module``,
    ``self.wrapped``, ``self.model_parallel``, ``self._state_names``, ``self._autocast_dtype``,
    ``self._export_serial``, ``self._weights_version``, ``self._save_calls``, ``zero_stage`` and
    the step agreement (:class:`~shardkit.engine_step_agreement.StepAgreement`)."""

    def module_state_dict(self, destination: Optional[dict] = None, prefix: str = "",
                          keep_vars: bool = False, exclude_frozen_parameters: bool = False) -> dict:
        """The unwrapped model's full ``state_dict``, in the model's dtype (fp32; with
        fp16/bf16 at stages 0-2 the 16-bit weights, as DeepSpeed's, whose fp32 masters
        ``safe_get_full_fp32_param`` and checkpoints give) (stage 3: fp32, gathered by FSDP, a
        collective on every rank; memory: the full model on each rank). Under tensor
        parallelism the unsplit model's (:func:`shardkit.nn.model_parallel.full_state.
        full_model_state_dict`: one all-gather per split parameter over the tensor-parallel
        group, on every rank). DeepSpeed's arguments: ``prefix`` goes before every key,
        ``destination`` (a dict) receives the entries and is returned, ``keep_vars`` is
        ``nn.Module.state_dict``'s at stages 0-2 without tensor parallelism (elsewhere the
        values are gathered copies whatever it says), ``exclude_frozen_parameters`` leaves out
        the parameters that do not require grad. A bad argument is a ValueError on every rank
        before any collective. Where it gathers (stage 3, tensor parallelism), a rank owing a
        step first joins the step agreement, as
        :meth:`~shardkit.engine.ShardedEngine.save_checkpoint` does."""
        return self._module_state_dict_for("engine.module_state_dict()", destination, prefix,
                                           keep_vars, exclude_frozen_parameters)

    def _module_state_dict_for(self, call: Optional[str], destination: Optional[dict] = None,
                               prefix: str = "", keep_vars: bool = False,
                               exclude_frozen_parameters: bool = False) -> dict:
        """:meth:`module_state_dict`, which ``call`` asked for: where the state is gathered,
        ``call`` joins the step agreement first
        (:meth:`~shardkit.engine.ShardedEngine._agree_on_step_skipped`), unless it is None (its
        caller joined it already)."""
        if destination is not None and not isinstance(destination, dict):
            raise ValueError(f"engine.module_state_dict(destination={type(destination).__name__}"
                             f"): expected a dict (it receives the entries) or None")
        if not isinstance(prefix, str):
            raise ValueError(f"engine.module_state_dict(prefix={prefix!r}): expected a str")
        for name, value in (("keep_vars", keep_vars),
                            ("exclude_frozen_parameters", exclude_frozen_parameters)):
            if not isinstance(value, bool):
                raise ValueError(f"engine.module_state_dict({name}={value!r}): expected True "
                                 f"or False")
        excluded = frozenset()
        if exclude_frozen_parameters:
            from shardkit.checkpoint.engine_state import _frozen_state_names
            excluded = _frozen_state_names(self)
        # the gather would meet a stepping rank's agreement
        if self._gathers_full_weights and call is not None:
            self._agree_on_step_skipped(call, keeps_step_owed=True)
        if self.model_parallel is not None:
            from shardkit.nn.model_parallel.full_state import full_model_state_dict
            state = full_model_state_dict(self.wrapped if self.zero_stage == 3 else self.module)
        elif self.zero_stage == 3:
            state = self.wrapped.state_dict()
        else:
            state = self.module.state_dict(keep_vars=keep_vars)
        out = destination if destination is not None else type(state)()
        for key, value in state.items():
            if key not in excluded:
                out[prefix + key] = value
        return out

    def load_module_state_dict(self, checkpoint: dict, strict: bool = True,
                               custom_load_fn: Optional[Callable] = None,
                               fetch_z3_params: bool = False, z3_params_to_fetch=None,
                               allowed_missing_keys=None):
        """DeepSpeed's: load ``checkpoint["module"]`` (a full ``state_dict`` of the unwrapped
        model, as :meth:`module_state_dict` returns) into the model on every rank: at stage 3
        each rank keeps its shard of every tensor, under tensor parallelism its slices.
        ``strict`` is torch's; ``allowed_missing_keys`` (an iterable of keys) may be missing
        from a strict load. ``custom_load_fn(src=state, dst=engine.module)`` replaces the load
        at stages 0-2 (stage 3: a ValueError, the module holds shards there).
        ``fetch_z3_params`` / ``z3_params_to_fetch`` are accepted and have no effect (the load
        already writes whole tensors). Keys are checked on every rank before any collective: a
        missing or unexpected key under ``strict`` is a RuntimeError naming them. Collective at
        stage 3 (FSDP's load) and under tensor parallelism; memory: the state given."""
        del fetch_z3_params, z3_params_to_fetch  # DeepSpeed's ZeRO-3 gather: nothing to do
        if not isinstance(checkpoint, dict) or not isinstance(checkpoint.get("module"), dict):
            raise ValueError("engine.load_module_state_dict(checkpoint=...): expected a dict "
                             "whose 'module' entry is the model's state_dict (DeepSpeed's "
                             "layout, e.g. {'module': engine.module_state_dict()})")
        if not isinstance(strict, bool):
            raise ValueError(f"engine.load_module_state_dict(strict={strict!r}): expected True "
                             f"or False")
        state = checkpoint["module"]
        if custom_load_fn is not None:
            if self.zero_stage == 3:
                raise ValueError("engine.load_module_state_dict(custom_load_fn=...): not "
                                 "supported at zero_optimization.stage=3, where engine.module "
                                 "holds parameter shards; load a full state_dict without it")
            custom_load_fn(src=state, dst=self.module)
            return None
        allowed = set(allowed_missing_keys or ())
        own = set(self.module_state_names())
        missing = sorted(own - set(state) - allowed)
        unexpected = sorted(set(state) - own)
        if strict and (missing or unexpected):
            raise RuntimeError(f"engine.load_module_state_dict: the checkpoint's module state "
                               f"does not match the model: missing keys {missing[:8]}"
                               f"{' ...' if len(missing) > 8 else ''}, unexpected keys "
                               f"{unexpected[:8]}{' ...' if len(unexpected) > 8 else ''}")
        if self.model_parallel is not None:
            from shardkit.nn.model_parallel.full_state import load_full_model_state_dict
            if set(state) != own:
                raise RuntimeError("engine.load_module_state_dict: under tensor parallelism "
                                   "the module state must hold exactly the model's keys")
            load_full_model_state_dict(self.wrapped if self.zero_stage == 3 else self.module,
                                       state)
            return None
        target = self.wrapped if self.zero_stage == 3 else self.module
        return target.load_state_dict(state, strict=strict and not allowed)

    def module_state_names(self) -> list[str]:
        """The ``state_dict`` keys of the unwrapped model (what a checkpoint stores)."""
        return list(self._state_names)

    def save_16bit_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                         exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's export: the unwrapped model's full ``state_dict`` (gathered at stage 3;
        under tensor parallelism the unsplit model's, see :meth:`module_state_dict`), floating
        tensors in the compute dtype (fp16/bf16; fp32 without mixed precision), written by rank
        0 to ``save_dir/save_filename`` through a temporary file renamed into place, so a crash
        leaves no partial file; a failure to write raises ``RuntimeError`` on every rank that
        calls it. ``exclude_frozen_parameters`` drops parameters that do not require grad.

        Stage 3 and tensor parallelism gather the weights: every rank must call it (a rank
        owing a step joins the step agreement first). At stages 0-2 without tensor parallelism
        it makes no collective, so rank 0 may call it alone (``if rank == 0:``, as DeepSpeed
        scripts do), also between backward and step; the other ranks, when they call it, learn
        rank 0's outcome from the store (:mod:`shardkit.engine_export`). Memory: the full
        model on each rank at stage 3 (rank 0 elsewhere)."""
        if not isinstance(save_filename, str) or not save_filename or os.sep in save_filename:
            raise ValueError(f"engine.save_16bit_model(save_filename={save_filename!r}): must be "
                             f"a file name (no directory part)")
        path = os.path.join(save_dir, save_filename)
        if not self._gathers_full_weights:
            return self._save_16bit_model_locally(path, exclude_frozen_parameters)
        self._agree_on_step_skipped("engine.save_16bit_model()", keeps_step_owed=True)
        state = self._16bit_state_dict(exclude_frozen_parameters, call=None)
        error = _write_atomically(state, path) if distributed.get_rank() == 0 else None
        if distributed.is_initialized():  # every rank learns the outcome: none waits on a failure
            error = distributed.broadcast_object(error, src=0)
        if error is not None:
            raise RuntimeError(f"engine.save_16bit_model: rank 0 could not write {path}: {error}")
        return True

    @property
    def _gathers_full_weights(self) -> bool:
        """Whether the full weights are gathered (stage 3, tensor parallelism): a collective."""
        return self.model_parallel is not None or self.zero_stage == 3

    def _save_16bit_model_locally(self, path: str, exclude_frozen_parameters: bool) -> bool:
        """:meth:`save_16bit_model` where every rank holds the whole model: rank 0 writes and
        posts its outcome on the store; the other ranks read it there (no collective)."""
        rank = distributed.get_rank() if distributed.is_initialized() else 0
        call = self._save_calls.count(self._weights_version)
        error = None
        if rank == 0:
            state = self._16bit_state_dict(exclude_frozen_parameters, call=None)
            error = _write_atomically(state, path)
        if distributed.get_world_size() > 1:
            key = engine_export.outcome_key(self._export_serial, self._weights_version, call)
            if rank == 0:
                engine_export.post_outcome(key, error)
            else:
                error = engine_export.await_outcome(key, path)
        if error is not None:
            raise RuntimeError(f"engine.save_16bit_model: rank 0 could not write {path}: {error}")
        return True

    def _16bit_state_dict(self, exclude_frozen_parameters: bool, call: Optional[str]) -> dict:
        """:meth:`module_state_dict` with floating tensors in the compute dtype (other entries,
        such as a module's ``get_extra_state()`` object, as they are); ``call`` as in
        :meth:`_module_state_dict_for`."""
        state = self._module_state_dict_for(
            call, exclude_frozen_parameters=exclude_frozen_parameters)
        dtype = self._autocast_dtype
        if dtype is not None:
            state = {k: v.to(dtype) if _is_floating_weight(k, v) else v
                     for k, v in state.items()}
        return state

    def _zero3_consolidated_16bit_state_dict(self, exclude_frozen_parameters: bool = False
                                             ) -> Optional[dict]:
        """What :meth:`save_16bit_model` writes, returned instead: the full ``state_dict`` in the
        compute dtype on rank 0, ``None`` on the other ranks (DeepSpeed's name, which HF
        Accelerate-style save code calls at stage 3; any stage works here). Collective; the
        memory and communication of :meth:`module_state_dict`."""
        state = self._16bit_state_dict(exclude_frozen_parameters,
                                       call="engine._zero3_consolidated_16bit_state_dict()")
        return state if distributed.get_rank() == 0 else None

    def save_fp16_model(self, save_dir: str, save_filename: str = "pytorch_model.bin",
                        exclude_frozen_parameters: bool = False) -> bool:
        """DeepSpeed's older name of :meth:`save_16bit_model` (same file, same costs)."""
        return self.save_16bit_model(save_dir, save_filename, exclude_frozen_parameters)
