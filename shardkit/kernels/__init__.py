"""Hot loops of sharded training, behind one dispatch road.

``shardkit.kernels`` is the only place with Triton code. Each public function picks its
implementation with :func:`backend_for`: Triton kernels for CUDA tensors when Triton imports,
torch's fused/foreach ops or a vectorised torch path for CPU tensors, and the Triton code on CPU
when ``SHARDKIT_KERNELS=triton`` (with ``TRITON_INTERPRET=1``: how the tests check the kernels).

Public functions:
    pack_rank_major / unpack_rank_major / shard_views: the reduce-scatter packing.
    adamw_step / sgd_step: fused optimizer steps over flat buffers.
    adamw_step_many: the AdamW step over a list of tensors (one param group) in one launch.
    quant_layout / quantize_pack / dequantize_unpack / dequantize_sum: block-wise int8/int4
        quantization fused with the rank-major packing (compressed collectives).
"""

from shardkit.kernels.dispatch import backend_for, triton_available
from shardkit.kernels.packing import (chunk_numels_for, pack_rank_major, shard_views,
                                      unpack_rank_major, unpack_shard)
from shardkit.kernels.optim_step import adamw_step, adamw_step_many, sgd_step
from shardkit.kernels.quantize import (DEFAULT_BLOCK, QuantLayout, dequantize_sum,
                                       dequantize_unpack, quant_layout, quantize_pack)

__all__ = ["backend_for", "triton_available", "pack_rank_major", "unpack_rank_major",
           "unpack_shard", "shard_views", "chunk_numels_for", "adamw_step", "adamw_step_many",
           "sgd_step", "QuantLayout", "quant_layout", "quantize_pack", "dequantize_unpack",
           "dequantize_sum", "DEFAULT_BLOCK"]
