"""DeepSpeed's ``deepspeed.runtime`` names that training scripts import, so that
``from shardkit.runtime.utils import see_memory_usage`` and
``from shardkit.runtime.zero.partition_parameters import ZeroParamStatus`` work as DeepSpeed's
do: this module, and its ``utils``, ``zero`` and ``zero.partition_parameters``, are replaced
by :data:`shardkit.deepspeed_compat.runtime`'s namespaces (the same objects as
``shardkit.runtime`` reached as an attribute)."""

import sys

from shardkit.deepspeed_compat import runtime as _runtime

sys.modules[__name__] = _runtime
sys.modules[__name__ + ".utils"] = _runtime.utils
sys.modules[__name__ + ".zero"] = _runtime.zero
sys.modules[__name__ + ".zero.partition_parameters"] = _runtime.zero.partition_parameters
