"""torch FSDP1's ``state_dict_type`` settings for FullyShardedDataParallel.

torch's FSDP1 users pick what ``model.state_dict()`` returns with::

    with FSDP.state_dict_type(model, StateDictType.FULL_STATE_DICT,
                              FullStateDictConfig(offload_to_cpu=True, rank0_only=True)):
        state = model.state_dict()

The same names work here: ``FULL_STATE_DICT`` is
:meth:`~shardkit.nn.data_parallel.FullyShardedDataParallel.state_dict` (full values, original keys;
``offload_to_cpu`` puts them in CPU memory, ``rank0_only`` returns them on the group's first rank
and ``{}`` elsewhere), ``LOCAL_STATE_DICT`` is
:meth:`~shardkit.nn.data_parallel.FullyShardedDataParallel.local_state_dict` (this rank's padded
rows as plain tensors; ``load_state_dict`` then loads such a dict; for ``torch.save``, one file per
rank: torch.distributed.checkpoint refuses them with a clear error), ``SHARDED_STATE_DICT`` gives
each parameter as a ``Shard(0)`` DTensor of its full shape holding this rank's real rows, for
``torch.distributed.checkpoint`` (which reshards them to any world size on load), with
``FSDP.optim_state_dict`` giving the optimizer's per-element state the same way.
The settings also hold where a plain module holds the units (``model.encoder =
FSDP(model.encoder)``, torch's ``checkpoint_wrapper(FSDP(model))``): ``FSDP.state_dict_type(
model, ...)`` sets every unit in ``model``, and ``model.state_dict()`` / ``load_state_dict()``
then give and take, for each outermost unit, what its settings say (full tensors by default,
so every rank must call them), as under torch FSDP1.
torch's own ``StateDictType`` members and ``*StateDictConfig`` objects are taken too (read by
name and fields), so a script or config that keeps ``from torch.distributed.fsdp import
StateDictType`` works. The settings are plain attributes of each unit: setting them costs
nothing and communicates nothing.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass
from enum import Enum, auto
from typing import NamedTuple, Optional

__all__ = ["StateDictType", "StateDictConfig", "FullStateDictConfig", "LocalStateDictConfig",
           "ShardedStateDictConfig", "OptimStateDictConfig", "FullOptimStateDictConfig",
           "LocalOptimStateDictConfig", "ShardedOptimStateDictConfig",
           "StateDictSettings", "OptimStateKeyType", "state_dict_type",
           "set_state_dict_type", "get_state_dict_type"]


class StateDictType(Enum):
    """What ``state_dict()`` / ``load_state_dict()`` of a unit handle (torch's names)."""

    FULL_STATE_DICT = auto()
    LOCAL_STATE_DICT = auto()
    SHARDED_STATE_DICT = auto()


class OptimStateKeyType(Enum):
    """How :meth:`~shardkit.nn.data_parallel.FullyShardedDataParallel.rekey_optim_state_dict` keys
    an optimizer state dict (torch FSDP1's names; torch's own members are taken too): by parameter
    name or by the parameter's index in the optimizer's param groups (``optim.state_dict()``'s
    ids)."""

    PARAM_NAME = auto()
    PARAM_ID = auto()


@dataclass
class StateDictConfig:
    """``offload_to_cpu``: return the state dict's tensors in CPU memory."""

    offload_to_cpu: bool = False


@dataclass
class FullStateDictConfig(StateDictConfig):
    """``rank0_only``: only the group's first rank gets the full dict (others ``{}``)."""

    rank0_only: bool = False


@dataclass
class LocalStateDictConfig(StateDictConfig):
    """Settings of ``LOCAL_STATE_DICT`` (none beyond ``offload_to_cpu``)."""


@dataclass
class ShardedStateDictConfig(StateDictConfig):
    """Settings of ``SHARDED_STATE_DICT`` (none beyond ``offload_to_cpu``: the DTensors' local
    rows are then CPU copies)."""


@dataclass
class OptimStateDictConfig:
    """torch's optimizer-state setting; stored, and read back by :func:`get_state_dict_type`
    (``FullOptimStateDictConfig.rank0_only`` is used by ``FSDP.optim_state_dict`` and
    ``FSDP.optim_state_dict_to_load``)."""

    offload_to_cpu: bool = True


@dataclass
class FullOptimStateDictConfig(OptimStateDictConfig):
    """torch's name: the full optimizer state, on every rank or (``rank0_only``) on rank 0
    alone, where the others get an empty dict."""

    rank0_only: bool = False


@dataclass
class LocalOptimStateDictConfig(OptimStateDictConfig):
    """torch's name; the optimizer state under ``LOCAL_STATE_DICT`` is this rank's flat
    shards, left on their device."""

    offload_to_cpu: bool = False


@dataclass
class ShardedOptimStateDictConfig(OptimStateDictConfig):
    """torch's name; the optimizer state under ``SHARDED_STATE_DICT`` is this rank's rows."""


class StateDictSettings(NamedTuple):
    """What ``FSDP.get_state_dict_type(module)`` returns (torch's name): the state-dict type
    in force and its model and optimizer configs."""

    state_dict_type: StateDictType
    state_dict_config: StateDictConfig
    optim_state_dict_config: OptimStateDictConfig


_CONFIG_OF = {StateDictType.FULL_STATE_DICT: FullStateDictConfig,
              StateDictType.LOCAL_STATE_DICT: LocalStateDictConfig,
              StateDictType.SHARDED_STATE_DICT: ShardedStateDictConfig}

DEFAULT_SETTINGS = StateDictSettings(StateDictType.FULL_STATE_DICT, FullStateDictConfig(),
                                     OptimStateDictConfig())


def _from_torch(kind, config, optim_config) -> tuple:
    """torch FSDP1's own ``StateDictType`` member and config objects (``from
    torch.distributed.fsdp import StateDictType, FullStateDictConfig``, left unchanged in a
    script or config file that only switched the FSDP class) as this module's, read by name and
    fields, as ``sharding_strategy`` reads torch's ``ShardingStrategy``. Anything else is
    returned as given, for :func:`_check_settings` to judge. Local."""
    if isinstance(kind, Enum) and not isinstance(kind, StateDictType) \
            and type(kind).__name__ == "StateDictType" and kind.name in StateDictType.__members__:
        kind = StateDictType[kind.name]
    return kind, _config_from_torch(config, StateDictConfig), \
        _config_from_torch(optim_config, OptimStateDictConfig)


def _config_from_torch(config, base: type):
    """A torch ``*StateDictConfig`` object as the same-named class here, with its
    ``offload_to_cpu`` / ``rank0_only`` (torch's private fields are left out)."""
    if config is None or isinstance(config, base) or \
            not type(config).__module__.startswith("torch.distributed"):
        return config
    ours = {c.__name__: c for c in (StateDictConfig, FullStateDictConfig, LocalStateDictConfig,
                                    ShardedStateDictConfig, OptimStateDictConfig,
                                    FullOptimStateDictConfig, LocalOptimStateDictConfig,
                                    ShardedOptimStateDictConfig)}
    cls = ours.get(type(config).__name__)
    if cls is None or not issubclass(cls, base):
        return config
    return cls(**{name: getattr(config, name) for name in cls.__dataclass_fields__
                  if hasattr(config, name)})


def _check_settings(kind, config, optim_config) -> StateDictSettings:
    """The settings as given, checked (a ``ValueError`` naming the argument otherwise)."""
    kind, config, optim_config = _from_torch(kind, config, optim_config)
    if not isinstance(kind, StateDictType):
        raise ValueError(f"FSDP.state_dict_type(state_dict_type={kind!r}): expected "
                         f"StateDictType.FULL_STATE_DICT, LOCAL_STATE_DICT or SHARDED_STATE_DICT "
                         f"(shardkit.nn.data_parallel.StateDictType)")
    wanted = _CONFIG_OF[kind]
    config = wanted() if config is None else config
    if type(config) not in (wanted, StateDictConfig):
        raise ValueError(f"FSDP.state_dict_type(..., state_dict_config={config!r}): "
                         f"{kind.name} takes a {wanted.__name__}")
    if not isinstance(config.offload_to_cpu, bool) or \
            not isinstance(getattr(config, "rank0_only", False), bool):
        raise ValueError(f"FSDP.state_dict_type(..., state_dict_config={config!r}): its "
                         f"offload_to_cpu and rank0_only must be True or False")
    optim_config = OptimStateDictConfig() if optim_config is None else optim_config
    if not isinstance(optim_config, OptimStateDictConfig):
        raise ValueError(f"FSDP.state_dict_type(..., optim_state_dict_config={optim_config!r}):"
                         f" expected an OptimStateDictConfig or None")
    return StateDictSettings(kind, config, optim_config)


def _units_of(module) -> list:
    from shardkit.nn.data_parallel.fully_sharded import FullyShardedDataParallel
    units = [m for m in module.modules() if isinstance(m, FullyShardedDataParallel)]
    if not units:
        raise ValueError(f"FSDP.state_dict_type(module={type(module).__name__}): the module "
                         f"holds no FullyShardedDataParallel unit")
    return units


def set_state_dict_type(module, state_dict_type: StateDictType,
                        state_dict_config: Optional[StateDictConfig] = None,
                        optim_state_dict_config: Optional[OptimStateDictConfig] = None
                        ) -> StateDictSettings:
    """Set the state-dict settings of every unit in ``module``; return the previous settings
    of the first one (torch's ``FSDP.set_state_dict_type``). Local."""
    settings = _check_settings(state_dict_type, state_dict_config, optim_state_dict_config)
    units = _units_of(module)
    previous = units[0]._state_dict_settings
    for unit in units:
        unit._state_dict_settings = settings
    return previous


def get_state_dict_type(module) -> StateDictSettings:
    """The state-dict settings of the units in ``module`` (torch's ``FSDP.get_state_dict_type``;
    an error if they differ). Local."""
    settings = {id(u._state_dict_settings): u._state_dict_settings for u in _units_of(module)}
    if len(settings) > 1:
        raise ValueError("FSDP.get_state_dict_type(): the units of this module have different "
                         "state-dict settings; set them with FSDP.set_state_dict_type(root, ...)")
    return next(iter(settings.values()))


@contextlib.contextmanager
def state_dict_type(module, state_dict_type: StateDictType,
                    state_dict_config: Optional[StateDictConfig] = None,
                    optim_state_dict_config: Optional[OptimStateDictConfig] = None):
    """Inside the block every unit of ``module`` uses these settings; on exit each unit gets its
    previous ones back (torch's ``FSDP.state_dict_type``). Local."""
    settings = _check_settings(state_dict_type, state_dict_config, optim_state_dict_config)
    units = _units_of(module)
    previous = [u._state_dict_settings for u in units]
    for unit in units:
        unit._state_dict_settings = settings
    try:
        yield
    finally:
        for unit, before in zip(units, previous):
            unit._state_dict_settings = before
