"""Megatron-style tensor parallelism: process groups for 3D parallelism, tensor-parallel layers,
the autograd mappings between parallel regions, vocabulary-parallel cross-entropy, RNG streams,
sequence parallelism, gradient clipping by the whole model's norm (``.grad_norm``) and the
broadcast of a batch over the tensor-parallel group (``.data``). FairScale's module paths
(``shardkit.nn.model_parallel.initialize``, ``.layers``, ``.mappings``, ``.cross_entropy``,
``.random``, ``.data``); the common names are re-exported here.

Usage::

    from shardkit.nn import model_parallel as mp
    mp.initialize_model_parallel(2, pipeline_length=2)     # every rank
    mp.model_parallel_manual_seed(0)
    fc = mp.ColumnParallelLinear(512, 2048, gather_output=False)
    out = mp.RowParallelLinear(2048, 512, input_is_parallel=True)
    y = out(torch.nn.functional.gelu(fc(x)))              # one all-reduce forward, one backward
"""

from shardkit.nn.model_parallel import initialize
from shardkit.nn.model_parallel.cross_entropy import vocab_parallel_cross_entropy
from shardkit.nn.model_parallel.data import broadcast_data
from shardkit.nn.model_parallel.full_state import sync_module_states
from shardkit.nn.model_parallel.grad_norm import clip_grad_norm
from shardkit.nn.model_parallel.initialize import (
    ParallelLayout, destroy_model_parallel, get_context_parallel_group,
    get_context_parallel_rank, get_context_parallel_ranks, get_context_parallel_world_size,
    get_data_parallel_group, get_data_parallel_rank,
    get_data_parallel_ranks, get_data_parallel_world_size, get_model_parallel_group,
    get_model_parallel_rank, get_model_parallel_ranks, get_model_parallel_src_rank,
    get_model_parallel_world_size, get_parallel_layout, get_pipeline_parallel_group,
    get_pipeline_parallel_rank, get_pipeline_parallel_ranks, get_pipeline_parallel_world_size,
    initialize_model_parallel, model_parallel_is_initialized)
from shardkit.nn.model_parallel.layers import (
    ColumnParallelLinear, ParallelEmbedding, RowParallelLinear, TensorParallelModule,
    VocabParallelEmbedding, local_construction)
from shardkit.nn.model_parallel.mappings import (
    copy_to_model_parallel_region, gather_from_model_parallel_region,
    gather_from_sequence_parallel_region, reduce_from_model_parallel_region,
    reduce_scatter_to_sequence_parallel_region, scatter_to_model_parallel_region,
    scatter_to_sequence_parallel_region)
from shardkit.nn.model_parallel.random import (
    CudaRNGStatesTracker, RNGStatesTracker, get_cuda_rng_tracker, get_model_parallel_rng_tracker,
    model_parallel_cuda_manual_seed, model_parallel_manual_seed)
from shardkit.nn.model_parallel.sequence_parallel import (
    mark_sequence_parallel, reduce_sequence_parallel_grads)

__all__ = [
    *initialize.__all__,
    "ColumnParallelLinear", "RowParallelLinear", "VocabParallelEmbedding", "ParallelEmbedding",
    "TensorParallelModule", "local_construction",
    "copy_to_model_parallel_region", "reduce_from_model_parallel_region",
    "scatter_to_model_parallel_region", "gather_from_model_parallel_region",
    "scatter_to_sequence_parallel_region", "gather_from_sequence_parallel_region",
    "reduce_scatter_to_sequence_parallel_region",
    "vocab_parallel_cross_entropy", "clip_grad_norm", "broadcast_data",
    "RNGStatesTracker", "get_model_parallel_rng_tracker", "model_parallel_manual_seed",
    "CudaRNGStatesTracker", "get_cuda_rng_tracker", "model_parallel_cuda_manual_seed",
    "mark_sequence_parallel", "reduce_sequence_parallel_grads", "sync_module_states",
]
