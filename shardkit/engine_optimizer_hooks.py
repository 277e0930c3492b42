"""What the engine sets on the optimizer it steps: a step pre-hook that gives a script's direct
``engine.optimizer.step()`` the step agreement and ``engine.step()``'s work on the gradients (or
refuses it with gradient accumulation), and DeepSpeed's ``optimizer.offload_states`` /
``reload_states`` forwarded to the engine. The registries here (latest engine per optimizer,
engine steps in progress) are the only copies; engines are held weakly. The hook's communication
is the step agreement's (:mod:`shardkit.engine_step_agreement`).
"""

from __future__ import annotations

import weakref
from typing import Optional

import torch
from torch.utils.weak import WeakIdKeyDictionary

from shardkit import engine_direct_step


# optimizer -> weak reference to the latest engine built over it, read by the one step pre-hook
# each optimizer gets (see _guard_direct_steps)
_STEP_OWNERS = WeakIdKeyDictionary()
# optimizer -> how many engine.step() calls are inside its step() now (any engine over it, not
# only the latest: an earlier engine over a shared optimizer steps it legitimately too)
_ENGINE_STEPPING = WeakIdKeyDictionary()


def _guard_direct_steps(engine) -> None:
    """Make ``engine.optimizer.step()`` called by the script (not by ``engine.step()``) a
    RuntimeError while ``gradient_accumulation_steps > 1``: the engine reduces gradients only in
    the boundary micro-batch's ``engine.backward`` and counts micro-batches in ``engine.step()``,
    so a loop of ``loss.backward()`` and ``optimizer.step()`` (nanoGPT's) never reduces and
    would step on each rank's own gradients, silently. Raised on every rank that steps, before
    the optimizer's collectives. One pre-hook per optimizer, reading the latest engine built
    over it (a weak reference: the hook keeps no engine alive). With one micro-batch per step,
    calling the optimizer directly keeps working, with ``engine.step()``'s work on the
    gradients done first (unscaled, an overflow skipped, clipped:
    :mod:`shardkit.engine_direct_step`), but it is collective, as ``engine.step()`` is: the
    ranks first agree that all of them step and none holds its state offloaded (one
    all-gather of 16 int64s a rank over the world, see ``ShardedEngine._agree_on_step``), so
    a step called on some ranks only is a RuntimeError on every rank, the ranks that skipped
    it raising at their next training forward."""
    optimizer = engine.optimizer
    if not isinstance(optimizer, torch.optim.Optimizer):
        return
    if optimizer not in _STEP_OWNERS:
        optimizer.register_step_pre_hook(_refuse_direct_step)
        optimizer.register_step_post_hook(engine_direct_step.close_carried_step)
    _STEP_OWNERS[optimizer] = weakref.ref(engine)


def _expose_offload_on_optimizer(engine) -> None:
    """DeepSpeed's ZeRO optimizers have ``offload_states`` / ``reload_states``, and OpenRLHF
    calls them there (``engine.optimizer.offload_states(include=...)``): set on the engine's
    optimizer, forwarding to this engine (held weakly), unless the optimizer's class defines
    the name itself. Costs nothing."""
    optimizer = engine.optimizer
    if optimizer is None:
        return
    owner = weakref.ref(engine)
    for name in ("offload_states", "reload_states"):
        if not hasattr(type(optimizer), name):
            setattr(optimizer, name, _ForwardedToEngine(owner, name))


class _ForwardedToEngine:
    """``optimizer.<name>(...)`` calling the engine's method of that name, through a weak
    reference (the optimizer keeps no engine alive).

    Note: an optimizer whose ``__getstate__`` keeps its ``__dict__`` pickles and copies this
    too: the copy is bound to no engine (a copied or loaded optimizer is not the one the
    engine steps, and an engine does not pickle), so calling it raises as when the engine is
    gone. A plain closure here made ``pickle.dumps(optimizer)`` fail."""

    def __init__(self, owner: Optional[weakref.ref], name: str):
        self.owner, self.__name__ = owner, name
        self.__doc__ = f"The engine's :meth:`ShardedEngine.{name}` (DeepSpeed's optimizer call)."

    def __call__(self, *args, **kwargs):
        engine = self.owner() if self.owner is not None else None
        if engine is None:
            raise RuntimeError(f"optimizer.{self.__name__}(): the engine this optimizer was "
                               f"built into no longer exists, or this optimizer is a copy "
                               f"(pickled or deep-copied) of the engine's; call "
                               f"engine.{self.__name__}() on the engine")
        return getattr(engine, self.__name__)(*args, **kwargs)

    def __reduce__(self):
        return _ForwardedToEngine, (None, self.__name__)


def _refuse_direct_step(optimizer, args, kwargs) -> None:
    """The step pre-hook of the engine's optimizer: a direct ``engine.optimizer.step()`` (not
    ``engine.step()``'s) agrees on the step, is refused with accumulation, and otherwise gets
    ``engine.step()``'s work on the gradients first (:func:`engine_direct_step.prepare`)."""
    owner = _STEP_OWNERS.get(optimizer)
    engine = owner() if owner is not None else None
    if engine is None or _ENGINE_STEPPING.get(optimizer, 0) > 0:
        return None
    # as engine.step(): on a GPU torch's AdamW would count the step on its (host) step
    # tensors, then fail on the moments, so the bias correction would drift by one
    agreed = engine._agree_on_step("engine.optimizer.step()", carry=engine._oss_calls_to_carry())
    engine._weights_version += 1
    steps = engine.config.gradient_accumulation_steps
    if steps == 1:
        engine_direct_step.prepare(engine, optimizer, agreed, args, kwargs)
        return None
    raise RuntimeError(
        f"engine.optimizer.step() was called directly with gradient_accumulation_steps={steps}: "
        f"the engine averages gradients over the ranks only in engine.backward(loss) of the "
        f"accumulation boundary and counts micro-batches in engine.step(), so this step would "
        f"apply this rank's own gradients; call engine.backward(loss) and engine.step() for "
        f"every micro-batch (engine.step() runs the optimizer at the boundary)")
