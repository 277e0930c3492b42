"""``from shardkit.checkpoint.state_dict import get_state_dict, ...``: the same import path
as ``torch.distributed.checkpoint.state_dict``, for shardkit's wrappers (see
:mod:`shardkit.checkpoint.torch_state_dict`)."""

from shardkit.checkpoint.torch_state_dict import (  # noqa: F401
    StateDictOptions, get_model_state_dict, get_optimizer_state_dict, get_state_dict,
    mark_sharded_state_for_dcp, set_model_state_dict, set_optimizer_state_dict, set_state_dict)

__all__ = ["StateDictOptions", "get_model_state_dict", "get_optimizer_state_dict",
           "get_state_dict", "set_model_state_dict", "set_optimizer_state_dict",
           "set_state_dict", "mark_sharded_state_for_dcp"]
