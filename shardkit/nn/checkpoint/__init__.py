"""Activation checkpointing (implemented in :mod:`shardkit.nn.checkpoint.checkpoint_activations`,
FairScale's module path, so both ``from shardkit.nn.checkpoint import checkpoint_wrapper`` and
``from shardkit.nn.checkpoint.checkpoint_activations import checkpoint_wrapper`` work)."""

from shardkit.nn.checkpoint.checkpoint_activations import (CheckpointImpl,
                                                           apply_activation_checkpointing,
                                                           checkpoint_wrapper,
                                                           checkpointed_call,
                                                           disable_checkpointing,
                                                           is_checkpoint_wrapped,
                                                           is_checkpointing, is_recomputing)

__all__ = ["checkpoint_wrapper", "disable_checkpointing", "is_checkpointing", "is_recomputing",
           "checkpointed_call", "apply_activation_checkpointing", "is_checkpoint_wrapped",
           "CheckpointImpl"]
