"""DeepSpeed's ``deepspeed.comm``, so that ``import shardkit.comm as dist`` works as
``import deepspeed.comm as dist`` does: this module is replaced by
:data:`shardkit.deepspeed_compat.comm` (the same object as ``shardkit.comm`` reached as an
attribute). Its functions are :mod:`shardkit.distributed`'s."""

import sys

from shardkit.deepspeed_compat import comm as _comm

sys.modules[__name__] = _comm
