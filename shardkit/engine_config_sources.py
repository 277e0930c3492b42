"""Which config :func:`shardkit.initialize` reads (``config``, its alias ``config_params``, or
DeepSpeed's ``args.deepspeed_config``), and the flat form of it the ranks compare before
composing (:func:`_flat_config`, without the sections a rank may set on its own). Local: no
communication.
"""

from __future__ import annotations

import hashlib
import logging
import os
from typing import Mapping

from shardkit.config import ConfigError
from shardkit.recipes import stable_repr

logger = logging.getLogger("shardkit")


def _config_source(config, config_params, args):
    """The one config given: ``config``, its alias ``config_params``, or DeepSpeed's
    ``args.deepspeed_config`` (``--deepspeed_config``). Two of them is a :class:`ConfigError`,
    as in DeepSpeed: which one the run follows would otherwise be a silent choice."""
    if config is not None and config_params is not None:
        raise ConfigError("initialize: config and config_params are aliases; pass only one")
    given = config if config is not None else config_params
    from_args = _config_from_args(args)
    if given is not None and from_args is not None:
        raise ConfigError(
            f"initialize: a config was given both as args.deepspeed_config={from_args!r} "
            f"(--deepspeed_config) and as config=...; pass only one (drop the command-line "
            f"flag or the config argument)")
    if given is None and isinstance(from_args, (str, os.PathLike)) \
            and not os.path.isfile(from_args):
        flag = "deepspeed_config" if getattr(args, "deepspeed_config", None) is not None \
            else "deepscale_config"
        raise ConfigError(f"initialize: args.{flag}={os.fspath(from_args)!r} (--{flag}): no "
                          f"such file; pass the path of a JSON config file")
    return given if given is not None else from_args


def _config_from_args(args):
    """``args.deepspeed_config``, or DeepSpeed's deprecated ``args.deepscale_config`` (read with
    a warning, as DeepSpeed does; both set is a :class:`ConfigError`)."""
    if args is None:
        return None
    current = getattr(args, "deepspeed_config", None)
    old = getattr(args, "deepscale_config", None)
    if old is None:
        return current
    if current is not None:
        raise ConfigError(f"initialize: args has both deepspeed_config={current!r} and the "
                          f"deprecated deepscale_config={old!r}; pass only --deepspeed_config")
    logger.warning("args.deepscale_config (--deepscale_config) is deprecated, as in DeepSpeed; "
                   "use --deepspeed_config")
    return old


# Config sections that only log or profile: a rank may name its own output there.
_PER_RANK_SECTIONS = frozenset({"tensorboard", "wandb", "csv_monitor", "comms_logger",
                                "flops_profiler", "wall_clock_breakdown", "steps_per_print",
                                "autotuning", "memory_breakdown", "dump_state"})
# Leaf keys a rank may set to its own value anywhere in the config: accepted without effect
# (offload to NVMe is refused; with device "cpu" a per-node or per-rank nvme_path is common).
_PER_RANK_KEYS = frozenset({"nvme_path"})


def _flat_config(raw, prefix: str = "config") -> dict:
    """``{"config.a.b": repr(value)}`` for every leaf of the config the caller gave, to compare
    between ranks (lists as one leaf; long values shortened to a digest), without the
    logging and profiling sections (:data:`_PER_RANK_SECTIONS`). Local."""
    out: dict = {}
    for key, value in (raw or {}).items():
        if prefix == "config" and key in _PER_RANK_SECTIONS:
            continue
        if key in _PER_RANK_KEYS:
            continue
        name = f"{prefix}.{key}"
        if isinstance(value, Mapping):
            out.update(_flat_config(value, name))
            continue
        text = stable_repr(value)
        if len(text) > 120:
            text = f"{text[:80]}... (sha1 {hashlib.sha1(text.encode()).hexdigest()[:12]})"
        out[name] = text
    return out
