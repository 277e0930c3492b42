"""FairScale's ``fairscale.nn.misc`` path for :func:`checkpoint_wrapper`. (FairScale's
``FlattenParamsWrapper`` has no counterpart: shardkit's FSDP flattens each unit itself.)"""

from shardkit.nn.checkpoint import checkpoint_wrapper

__all__ = ["checkpoint_wrapper"]
