"""The engine's resharding checkpoints (:class:`CheckpointMethods`, mixed into
:class:`shardkit.engine.ShardedEngine`): ``save_checkpoint()`` (tags agreed across ranks,
``client_state`` checked first, tensor-parallel slices under ``TAG/mp_rank_XX``),
``load_checkpoint()`` (``load_module_only`` keeps the training position), and the asynchronous
save's ``wait_for_checkpoint()``. The writing itself is
:mod:`shardkit.checkpoint.engine_state`'s; memory and communication are listed on each method.
"""

from __future__ import annotations

import contextlib
import logging
import os
from typing import Optional

from shardkit import distributed
from shardkit.engine_client_state import _client_state_problem, _raise_client_state_problem
from shardkit.model_parallel_unit import (checkpoint_location, mp_rank_name,
                                          write_tensor_parallel_layout)

logger = logging.getLogger("shardkit")


def _refuse_non_bool_switches(call: str, outcome: str, **switches) -> None:
    """A ValueError naming the first of ``switches`` that is not a bool: a string such as
    ``"False"`` (read from a command line) is truthy and would silently do the opposite of what
    was asked. Raised before any collective, so on every rank given the same arguments.
    Local."""
    for name, value in switches.items():
        if not isinstance(value, bool):
            raise ValueError(f"engine.{call}({name}={value!r}): expected True or False; "
                             f"{outcome}")


def _refuse_different_async_save(flags: list) -> None:
    """A ``CheckpointError`` (on every rank: each holds every rank's flag) unless every rank
    passed the same ``async_save``. Local."""
    if len(set(flags)) == 1:
        return
    from shardkit.checkpoint import CheckpointError
    on = [r for r, flag in enumerate(flags) if flag]
    off = [r for r, flag in enumerate(flags) if not flag]
    raise CheckpointError(f"save_checkpoint: async_save=True on rank(s) {on} and False on rank(s) "
                          f"{off}; a save is collective, so pass the same async_save on every "
                          f"rank; nothing was written")


class NoOptimizer:
    """What the checkpoint writer sees of a forward-only engine's optimizer: no param groups,
    no state (see :meth:`~shardkit.engine.ShardedEngine._optimizer_state_for_checkpoint`)."""

    def __init__(self):
        self.param_groups: list = []
        self.state: dict = {}


class CheckpointMethods:
    """Mixed into :class:`shardkit.engine.ShardedEngine`; needs ``self.optimizer``,
    ``self.config``, ``self.model_parallel``, ``self.module``, ``self.loss_scaler``, the step
    counters, ``self._pending_save``, ``self._weights_version``, ``tp_split_specs``,
    ``zero_stage``, ``mp_world_size``, ``_publish_loss_scale`` and the step agreement
    (:class:`~shardkit.engine_step_agreement.StepAgreement`)."""

    def save_checkpoint(self, save_dir: str, tag: Optional[str] = None,
                        client_state: Optional[dict] = None, save_latest: bool = True,
                        exclude_frozen_parameters: bool = False,
                        async_save: bool = False) -> str:
        """Write a resharding checkpoint under ``save_dir/tag`` (default ``global_step<N>``) and
        point ``save_dir/latest`` at it, atomically. Must be called on every rank.

        With ``async_save=True`` only the copy of this rank's share into host memory happens
        here; a background thread writes and commits it (:mod:`shardkit.checkpoint.async_save`)
        and the next ``save_checkpoint``, ``load_checkpoint``, :meth:`wait_for_checkpoint` or
        the end of the process waits for it (raising its error, if any).

        Each rank writes the fp32 parameters and optimizer state it owns (stage 3: its dim-0
        row block of each), keyed by parameter name; rank 0 adds metadata, scheduler, loss
        scaler and ``client_state``. A ``tag`` that is not a string (an epoch, a loss) is
        used as ``str(tag)``, as DeepSpeed does. Memory: a CPU copy of this rank's share.
        Communication: the tags compared across ranks (one small all-gather, unless the
        config's ``checkpoint.tag_validation`` is ``"Ignore"``: then a small broadcast), three
        one-element all-reduces and one barrier. A rank that ran a backward it has not stepped
        for first joins the step agreement
        (:meth:`~shardkit.engine.ShardedEngine._agree_on_step_skipped`): when other ranks stepped
        meanwhile (a step skipped behind a rank-local check of the loss), every rank raises a
        RuntimeError and nothing is written, as at a forward; likewise in :meth:`load_checkpoint`
        and :meth:`~shardkit.engine.ShardedEngine.save_16bit_model`.

        ``client_state`` must load back: checkpoints are read with
        ``torch.load(weights_only=True)`` (tensors, numbers, strings, bools, None and
        lists/tuples/dicts of them). Rank 0's (the one written) is tried in memory first; any
        other object (an ``argparse.Namespace``, a NumPy scalar) is a ``TypeError`` on every rank
        naming its key, before anything is written, rather than a checkpoint that cannot be
        resumed from.
        ``exclude_frozen_parameters=True`` (DeepSpeed's, in its position) leaves the parameters
        that do not require grad out of the saved weights (a fine-tuned adapter's checkpoint
        without the frozen base); loading it keeps the model's own values of those parameters
        (and needs no ``load_module_strict=False``).

        Returns the checkpoint directory (when ``async_save``, where it will be once written).
        """
        from shardkit.checkpoint.engine_state import save_engine_checkpoint
        _refuse_non_bool_switches("save_checkpoint", "nothing was written",
                                  save_latest=save_latest,
                                  exclude_frozen_parameters=exclude_frozen_parameters,
                                  async_save=async_save)
        if not isinstance(save_dir, (str, os.PathLike)) or not os.fspath(save_dir):
            raise ValueError(f"engine.save_checkpoint(save_dir={save_dir!r}): expected a "
                             f"non-empty directory path (a str or os.PathLike); nothing was "
                             f"written")
        save_dir = os.fspath(save_dir)
        self._agree_on_step_skipped("engine.save_checkpoint()", keeps_step_owed=True)
        self.wait_for_checkpoint()
        tag = None if tag is None else str(tag)  # DeepSpeed's: an epoch or a loss names a tag
        tag = self._validate_tag(tag, client_state, bool(async_save))
        if self.model_parallel is not None and async_save:  # on every rank: the ranks agree
            raise ValueError(
                f"engine.save_checkpoint(async_save=True): not with tensor parallelism "
                f"(tensor-parallel size {self.mp_world_size}); save with async_save=False")
        if self.model_parallel is not None:
            return self._save_tensor_parallel_checkpoint(save_dir, tag, client_state,
                                                         save_latest, exclude_frozen_parameters)
        with self._optimizer_state_for_checkpoint():
            result = save_engine_checkpoint(self, save_dir, tag, client_state, save_latest,
                                            async_save=async_save,
                                            exclude_frozen_parameters=exclude_frozen_parameters)
        if not async_save:
            return result
        self._pending_save = result
        return result.path

    def _save_tensor_parallel_checkpoint(self, save_dir: str, tag: Optional[str],
                                         client_state, save_latest: bool,
                                         exclude_frozen_parameters: bool = False) -> str:
        """Each tensor-parallel rank's data-parallel group writes a complete resharding
        checkpoint of its slices into ``save_dir/TAG/mp_rank_XX`` (as DeepSpeed's
        ``mp_rank_XX`` files); once every group has committed (one one-element all-reduce
        over the world), rank 0 points ``save_dir/latest`` at ``TAG`` (one more, to agree that
        it could). A failure in any group raises :class:`~shardkit.checkpoint.CheckpointError` on
        every rank and leaves ``latest`` as it was."""
        from shardkit.checkpoint.engine_state import save_engine_checkpoint
        from shardkit.checkpoint.sharded import write_latest_tag
        from shardkit.nn.model_parallel.full_state import split_specs
        tag = f"global_step{self.global_steps}" if tag is None else tag
        path, error = os.path.join(save_dir, tag), None
        try:
            with self._optimizer_state_for_checkpoint():
                save_engine_checkpoint(self, path,
                                       mp_rank_name(self.model_parallel.tensor_rank),
                                       client_state, save_latest=False,
                                       exclude_frozen_parameters=exclude_frozen_parameters)
            if distributed.get_rank() == 0:  # how to join the slices offline (consolidate)
                # stage 3: the model's own state_dict() is refused (FSDP row shards), the
                # split of each key was read unwrapped by initialize
                specs = self.tp_split_specs if self.zero_stage == 3 else split_specs(self.module)
                write_tensor_parallel_layout(path, self.mp_world_size, specs)
        except Exception as e:  # the other groups must learn of it rather than go on
            error = e
        self._agree_on_save(error, save_dir, tag)  # every group saved: only now move latest
        if save_latest and distributed.get_rank() == 0:
            try:
                write_latest_tag(save_dir, tag)
            except OSError as e:
                error = e
        self._agree_on_save(error, save_dir, tag)
        return path

    @contextlib.contextmanager
    def _optimizer_state_for_checkpoint(self):
        """Without an optimizer, the checkpoint writer sees an empty one (no param groups, no
        state) for the duration of the save, so a forward-only engine writes its weights,
        counters and RNG only (what DeepSpeed's writes: the model states, optimizer ``None``);
        its metadata names the optimizer class ``NoOptimizer``. Local; the shares are copied
        before this returns (an asynchronous save writes copies)."""
        if self.optimizer is not None:
            yield
            return
        self.optimizer = NoOptimizer()
        try:
            yield
        finally:
            self.optimizer = None

    @staticmethod
    def _agree_on_save(error: Optional[BaseException], save_dir: str, tag: str) -> None:
        """:class:`~shardkit.checkpoint.CheckpointError` on every rank when ``error`` happened on
        any (one one-element all-reduce over the world)."""
        from shardkit.checkpoint import CheckpointError
        if distributed.any_rank(error is not None):
            raise CheckpointError(f"save_checkpoint({save_dir!r}, tag={tag!r}) failed"
                                  f"{f': {error}' if error else ' on another rank'}; "
                                  f"'latest' still names the previous checkpoint") from error

    def _validate_tag(self, tag: Optional[str], client_state=None,
                      async_save: bool = False) -> Optional[str]:
        """What every rank must agree on before a save writes anything: rank 0's
        ``client_state`` loads back (else a ``TypeError`` on every rank), ``async_save`` is
        the same on every rank (else a ``CheckpointError`` on every rank: the asynchronous
        ranks would wait in a collective the others never issue), and the config's
        ``checkpoint.tag_validation``: unless ``"ignore"``, the tag is compared across ranks
        and a difference raises on every rank with ``"fail"``, or with ``"warn"`` warns. Returns
        the tag to save under: rank 0's on every rank (with ``"warn"`` and ``"ignore"`` the
        save goes on, as in DeepSpeed, into one checkpoint that loads, rather than a share of
        it in each rank's own directory). Communication: one small all-gather; none at world
        1."""
        mode = self.config.checkpoint_tag_validation
        problem = _client_state_problem(client_state) if distributed.get_rank() == 0 else None
        if distributed.get_world_size() == 1:
            _raise_client_state_problem(problem)
            return tag
        gathered = distributed.all_gather_object((tag, problem, async_save))
        _raise_client_state_problem(gathered[0][1])
        _refuse_different_async_save([flag for *_, flag in gathered])
        if mode == "ignore":
            return gathered[0][0]
        tags = [t for t, *_ in gathered]
        if len(set(tags)) == 1:
            return tag
        message = f"save_checkpoint: the ranks passed different tags {tags}"
        if mode == "fail":
            from shardkit.checkpoint import CheckpointError
            raise CheckpointError(message + "; each rank would write into its own directory "
                                  "(checkpoint.tag_validation='Fail'); nothing was written")
        if distributed.get_rank() == 0:
            logger.warning("%s; every rank saves under rank 0's tag %r "
                           "(checkpoint.tag_validation='Warn')", message, tags[0])
        return tags[0]

    def destroy(self) -> None:
        """DeepSpeed's end-of-training call: finish a pending asynchronous save. The wrappers
        hold no other resources (no hooks or threads outlive the engine). No communication."""
        self.wait_for_checkpoint()

    def wait_for_checkpoint(self) -> Optional[str]:
        """Wait for this engine's asynchronous save, if one is under way; return its directory
        (``None`` when there was none) or raise its error. Must be called on every rank."""
        pending, self._pending_save = getattr(self, "_pending_save", None), None
        return pending.wait() if pending is not None else None

    def load_checkpoint(self, load_dir: str, tag: Optional[str] = None,
                        load_module_strict: bool = True,
                        load_optimizer_states: bool = True,
                        load_lr_scheduler_states: bool = True,
                        load_module_only: bool = False, custom_load_fn=None):
        """Restore model, optimizer, scheduler, loss scaler, counters and RNG from a checkpoint
        written at any world size and ZeRO stage. Returns ``(path, client_state)``, or
        ``(None, None)`` when ``load_dir`` holds no checkpoint. Must be called on every rank.

        The arguments are DeepSpeed's, in its order. ``load_module_strict=False`` has torch's
        ``strict=False`` meaning (Hugging Face's Trainer passes it to resume a PEFT model): the
        model's tensors the checkpoint lacks keep their values, the checkpoint's tensors the
        model lacks are ignored, shapes must still match; the optimizer state loads when the
        saving optimizer stepped the parameters this one steps (by name; buffers and frozen
        parameters may differ), else it is refused (``load_optimizer_states=False`` loads the
        rest). A ``custom_load_fn`` (DeepSpeed's hook that loads the module's weights in place
        of ``load_state_dict``) is refused with a ``ValueError`` before anything is read.

        ``load_module_only=True`` is DeepSpeed's warm start: the weights only; the step
        counters (``global_steps``, ``skipped_steps``), the loss scale, the scheduler and this
        process's RNG stay as they are (a fine-tuning run starts at step 0).
        Without an optimizer (a forward-only engine) the optimizer state is never read: a
        training run's checkpoint gives a reference model its weights.
        Memory, on each rank's CPU while loading: stages 0-2, the full fp32 weights and the
        optimizer state this rank's optimizer keeps (stages 1-2: its OSS share; stage 0: the
        whole); stage 3, only this rank's row blocks of both (``1/N``)."""
        from shardkit.checkpoint.engine_state import load_engine_checkpoint
        _refuse_non_bool_switches("load_checkpoint", "nothing was loaded",
                                  load_module_strict=load_module_strict,
                                  load_optimizer_states=load_optimizer_states,
                                  load_lr_scheduler_states=load_lr_scheduler_states,
                                  load_module_only=load_module_only)
        if custom_load_fn is not None:
            raise ValueError(
                "engine.load_checkpoint(custom_load_fn=...): not supported; write the "
                "checkpoint's weights with `python -m shardkit consolidate DIR model.pt` and "
                "load them into the model with your function before shardkit.initialize")
        self._agree_on_step_skipped("engine.load_checkpoint()", keeps_step_owed=True)
        self.wait_for_checkpoint()
        tag = None if tag is None else str(tag)
        load_dir, tag = checkpoint_location(load_dir, tag, self.model_parallel)
        kept = self._training_position() if load_module_only else None
        result = load_engine_checkpoint(self, load_dir, tag,
                                        load_optimizer_states=load_optimizer_states
                                        and not load_module_only and self.optimizer is not None,
                                        load_lr_scheduler_states=load_lr_scheduler_states
                                        and not load_module_only, strict=load_module_strict,
                                        load_rng_state=not load_module_only)
        if kept is not None:
            self._restore_training_position(kept)
        self._publish_loss_scale()
        self._weights_version += 1
        return result

    def _training_position(self) -> dict:
        """Where this run stands apart from its weights: step counters, loss scaler, RNG.
        A few numbers plus the RNG states; no communication."""
        from shardkit.checkpoint.engine_state import rng_state
        return {"global_steps": self.global_steps, "skipped_steps": self.skipped_steps,
                "micro_steps": self.micro_steps, "rng": rng_state(),
                "resized_at": (self._samples_before_resize, self._steps_before_resize),
                "loss_scaler": None if self.loss_scaler is None
                else self.loss_scaler.state_dict()}

    def _restore_training_position(self, kept: dict) -> None:
        """Undo what a checkpoint load changed besides the weights (see
        :meth:`_training_position`). No communication."""
        from shardkit.checkpoint.engine_state import set_rng_state
        self.global_steps = kept["global_steps"]
        self.skipped_steps = kept["skipped_steps"]
        self.micro_steps = kept["micro_steps"]
        self._samples_before_resize, self._steps_before_resize = kept["resized_at"]
        set_rng_state(kept["rng"])
        if self.loss_scaler is not None:
            self.loss_scaler.load_state_dict(kept["loss_scaler"])
