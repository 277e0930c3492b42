"""DeepSpeed's script-level helpers, so that ``import shardkit as deepspeed`` runs a DeepSpeed
training script unchanged: :func:`add_config_arguments` (the ``--deepspeed_config`` option that
``initialize(args=args)`` reads) and :func:`init_distributed` (DeepSpeed's spelling and keywords
over :func:`shardkit.distributed.init_distributed`).

Process groups come from torchrun's environment only (DESIGN.md: no home-made launcher): MPI
discovery, ``init_method``, and explicit ``rank`` / ``world_size`` are refused by name. Outside
torchrun (no ``RANK`` in the environment) a one-rank group is started, so a script also runs as
plain ``python train.py``.
"""

from __future__ import annotations

import argparse
import datetime
import functools
import os
import types
from typing import Optional

import torch

from shardkit import distributed
from shardkit.accelerator import get_accelerator  # noqa: F401 - DeepSpeed's name here too

__all__ = ["add_config_arguments", "init_distributed", "ensure_process_group",
           "get_accelerator", "comm"]


def add_config_arguments(parser: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """Add DeepSpeed's command-line options to ``parser`` and return it: ``--deepspeed`` (a
    flag scripts test), ``--deepspeed_config PATH`` (the JSON config that
    ``shardkit.initialize(args=args)`` reads when no ``config`` is passed), and DeepSpeed's
    deprecated ``--deepscale`` / ``--deepscale_config`` (read with a warning). An option the
    parser already has is argparse's usual conflict error. Local; no communication."""
    if not isinstance(parser, argparse.ArgumentParser):
        raise TypeError(f"add_config_arguments(parser={parser!r}): expected an "
                        f"argparse.ArgumentParser")
    group = parser.add_argument_group("shardkit (DeepSpeed-style)",
                                      "DeepSpeed's options, read by shardkit.initialize(args=...)")
    group.add_argument("--deepspeed", default=False, action="store_true",
                       help="train with shardkit.initialize (accepted for DeepSpeed scripts)")
    group.add_argument("--deepspeed_config", default=None, type=str,
                       help="path of the DeepSpeed-style JSON config")
    group.add_argument("--deepscale", default=False, action="store_true",
                       help="deprecated DeepSpeed spelling of --deepspeed")
    group.add_argument("--deepscale_config", default=None, type=str,
                       help="deprecated DeepSpeed spelling of --deepspeed_config")
    return parser


def init_distributed(dist_backend: Optional[str] = None, auto_mpi_discovery: bool = True,
                     distributed_port: Optional[int] = None, verbose: bool = True,
                     timeout: Optional[datetime.timedelta] = None, init_method=None,
                     dist_init_required: Optional[bool] = None, config=None, rank: int = -1,
                     world_size: int = -1) -> None:
    """DeepSpeed's ``init_distributed``: join torchrun's process group (``dist_backend``:
    ``"gloo"``, ``"nccl"`` or ``None`` for nccl with CUDA, else gloo; ``distributed_port``
    fills in a missing ``MASTER_PORT``; ``timeout`` a ``timedelta``, default 300 s), or start a
    one-rank group outside torchrun. Idempotent. ``dist_init_required=False`` does nothing;
    ``verbose``, ``auto_mpi_discovery`` and ``config`` are accepted and change nothing (no MPI
    discovery: the environment is torchrun's). Costs what
    :func:`shardkit.distributed.init_distributed` costs.

    Raises:
        ValueError: ``init_method``, ``rank`` or ``world_size`` given (torchrun's environment
            names them), a ``timeout`` that is not a positive ``timedelta``, an unknown backend.
    """
    for name, value, unset in (("init_method", init_method, None), ("rank", rank, -1),
                               ("world_size", world_size, -1)):
        if value != unset:
            raise ValueError(f"init_distributed({name}={value!r}): shardkit takes the process "
                             f"group from torchrun's environment (RANK, WORLD_SIZE, MASTER_ADDR, "
                             f"MASTER_PORT); launch with torchrun and leave {name} unset")
    if timeout is not None and (not isinstance(timeout, datetime.timedelta)
                                or timeout.total_seconds() <= 0):
        raise ValueError(f"init_distributed(timeout={timeout!r}): expected a positive "
                         f"datetime.timedelta")
    if dist_init_required is False:
        return
    ensure_process_group(distributed_port, dist_backend,
                         300.0 if timeout is None else timeout.total_seconds())


def ensure_process_group(port: Optional[int] = None, backend: Optional[str] = None,
                         timeout_s: float = 300.0) -> None:
    """Join torchrun's group (its environment names the rendezvous; ``port`` fills in a
    missing ``MASTER_PORT``, as DeepSpeed's ``distributed_port``); outside torchrun start a
    one-rank group (:func:`shardkit.distributed.init_single_process`). A no-op when a group
    exists (whose backend must then be ``backend``, when given)."""
    if distributed.is_initialized() or "RANK" in os.environ:
        if port is not None and "MASTER_PORT" not in os.environ:
            os.environ["MASTER_PORT"] = str(port)
        distributed.init_distributed(backend, timeout_s=timeout_s)  # idempotent
        return
    distributed.init_single_process(backend)


def _local_rank() -> int:
    return int(os.environ.get("LOCAL_RANK", "0"))


# the handle of a collective that finished before it was returned (``async_op=True`` where
# the call ran synchronously)
_Done = distributed._Finished


def _get_global_rank(group=None, group_rank: int = 0) -> int:
    """DeepSpeed's ``get_global_rank(group=None, group_rank=0)``. Local."""
    return distributed.get_global_rank(group, group_rank)


def _get_world_group():
    """DeepSpeed's ``get_world_group()``: the default group (``torch.distributed.group.WORLD``).
    Local."""
    return distributed.resolved_group(None)


def _get_all_ranks_from_group(group=None) -> list:
    """DeepSpeed's ``get_all_ranks_from_group(group=None)``: the group's global ranks, in
    group-rank order. Local."""
    return distributed.group_ranks(group)


def _barrier(group=None, async_op: bool = False, device_ids=None):
    """DeepSpeed's ``barrier(group=None, async_op=False, device_ids=None)``: a blocking barrier
    (``device_ids`` is NCCL's hint, not needed); with ``async_op`` a finished handle."""
    distributed.barrier(group)
    return _Done() if async_op else None


def _all_gather(tensor_list, tensor, group=None, async_op: bool = False):
    """DeepSpeed's (torch's) ``all_gather(tensor_list, tensor, group=None, async_op=False)``."""
    return distributed.all_gather(tensor_list, tensor, group=group, async_op=async_op)


def _all_gather_into_tensor(output_tensor, tensor, group=None, async_op: bool = False):
    """DeepSpeed's ``all_gather_into_tensor(output_tensor, tensor, group=None,
    async_op=False)``."""
    return distributed.all_gather_into_tensor(output_tensor, tensor, group=group,
                                              async_op=async_op)


def _reduce_scatter_tensor(output_tensor, tensor, op=distributed.ReduceOp.SUM, group=None,
                           async_op: bool = False):
    """DeepSpeed's ``reduce_scatter_tensor(output_tensor, tensor, op=ReduceOp.SUM, group=None,
    async_op=False)``."""
    return distributed.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group,
                                             async_op=async_op)


def _splits(sizes, tensor, n: int, argument: str) -> list:
    """Row counts per rank along dim 0 (``None``: equal), checked against ``tensor``."""
    rows = tensor.shape[0] if tensor.dim() else 1
    if sizes is None:
        if rows % n:
            raise ValueError(f"all_to_all_single({argument}=None): {rows} rows do not split "
                             f"equally over {n} ranks; give {argument}")
        return [rows // n] * n
    sizes = list(sizes)
    if len(sizes) != n or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 0
                                  for k in sizes) or sum(sizes) != rows:
        raise ValueError(f"all_to_all_single({argument}={sizes!r}): expected {n} ints >= 0 "
                         f"(one per rank of the group) summing to the tensor's {rows} rows "
                         f"(dim 0)")
    return sizes


def _all_to_all_single(output, tensor, output_split_sizes=None, input_split_sizes=None,
                       group=None, async_op: bool = False):
    """DeepSpeed's ``all_to_all_single(output, tensor, output_split_sizes=None,
    input_split_sizes=None, group=None, async_op=False)``: rows (dim 0) ``input_split_sizes[j]``
    go to rank ``j``, rows from rank ``j`` land in ``output_split_sizes[j]``. No split sizes
    (on any rank of the group: every rank passes split sizes or none does): one all-to-all.
    With split sizes: one all-gather of every rank's split sizes (``2n`` ints), checked on
    every rank (a bad or inconsistent split raises the same ValueError on every rank, before
    any data moves), then one all-to-all: of the splits as given when they are all equal, else
    of the splits padded to the largest (its padding on the wire too), the handle then a
    finished one."""
    if output_split_sizes is None and input_split_sizes is None:
        return distributed.all_to_all_single(output, tensor, group=group, async_op=async_op)
    if distributed._not_a_member(group):  # torch skips the op there
        return _Done() if async_op else None
    n = distributed.get_world_size(group)
    problem = None
    try:
        sends = _splits(input_split_sizes, tensor, n, "input_split_sizes")
        takes = _splits(output_split_sizes, output, n, "output_split_sizes")
        if tensor.shape[1:] != output.shape[1:] or tensor.dtype != output.dtype:
            raise ValueError(f"all_to_all_single: the tensor {tuple(tensor.shape)} "
                             f"{tensor.dtype} and the output {tuple(output.shape)} "
                             f"{output.dtype} must have one dtype and the same sizes beyond "
                             f"dim 0")
    except ValueError as error:
        problem, sends, takes = error, [0] * n, [0] * n
    # every rank's [ok, sends, takes]: every rank then decides (and raises) alike
    mine = torch.tensor([int(problem is None)] + sends + takes, dtype=torch.int64,
                        device=tensor.device)
    every = torch.empty(n * mine.numel(), dtype=torch.int64, device=tensor.device)
    distributed.all_gather_into_tensor(every, mine, group=group)
    every = every.view(n, 2 * n + 1).tolist()
    if problem is not None:
        raise problem
    failed = [r for r in range(n) if not every[r][0]]
    if failed:
        raise ValueError(f"all_to_all_single: group rank(s) {failed} were given split sizes "
                         f"or tensors that do not fit (their ValueError says which); nothing "
                         f"was exchanged")
    sent = [row[1:n + 1] for row in every]
    for i in range(n):
        for j in range(n):
            if sent[i][j] != every[j][n + 1 + i]:
                raise ValueError(
                    f"all_to_all_single: group rank {i} sends {sent[i][j]} rows to group rank "
                    f"{j} (its input_split_sizes[{j}]), which expects {every[j][n + 1 + i]} "
                    f"(its output_split_sizes[{i}]); nothing was exchanged")
    width = max(max(row) for row in sent)
    if all(k == width for row in sent for k in row):
        return distributed.all_to_all_single(output, tensor, group=group, async_op=async_op)
    padded = tensor.new_zeros((n * width,) + tuple(tensor.shape[1:]))
    for j, chunk in enumerate(torch.split(tensor, sends)):
        padded[j * width:j * width + sends[j]] = chunk
    received = torch.empty_like(padded)
    distributed.all_to_all_single(received, padded, group=group)
    for j, chunk in enumerate(torch.split(output, takes)):
        chunk.copy_(received[j * width:j * width + takes[j]])
    return _Done() if async_op else None


def _all_to_all(output_tensor_list, input_tensor_list, group=None, async_op: bool = False):
    """DeepSpeed's (torch's) ``all_to_all(output_tensor_list, input_tensor_list, group=None,
    async_op=False)``: ``input_tensor_list[j]`` goes to group rank ``j``, group rank ``j``'s
    item for this rank lands in ``output_tensor_list[j]`` (items of any sizes, one dtype).
    Runs as :func:`all_to_all_single` of the lists flattened (their sizes as split sizes: one
    all-gather of the sizes, checked on every rank, then one all-to-all); with ``async_op`` a
    finished handle. gloo has no list all-to-all of its own."""
    what = "all_to_all"
    if distributed._not_a_member(group):
        return _Done() if async_op else None
    n = distributed.get_world_size(group)
    for name, items in (("output_tensor_list", output_tensor_list),
                        ("input_tensor_list", input_tensor_list)):
        if not isinstance(items, (list, tuple)) or len(items) != n or not all(
                isinstance(t, torch.Tensor) for t in items):
            raise ValueError(f"{what}({name}=...): expected a list of {n} tensors (one per rank "
                             f"of the group), got {type(items).__name__}"
                             + (f" of {len(items)}" if isinstance(items, (list, tuple)) else ""))
    dtypes = {t.dtype for t in (*output_tensor_list, *input_tensor_list)}
    if len(dtypes) > 1:
        raise ValueError(f"{what}: the tensors of both lists must have one dtype, got "
                         f"{sorted(str(d) for d in dtypes)}")
    sends = torch.cat([t.reshape(-1) for t in input_tensor_list])
    got = sends.new_empty(sum(t.numel() for t in output_tensor_list))
    _all_to_all_single(got, sends, output_split_sizes=[t.numel() for t in output_tensor_list],
                       input_split_sizes=[t.numel() for t in input_tensor_list], group=group)
    sizes = [t.numel() for t in output_tensor_list]
    for out, part in zip(output_tensor_list, torch.split(got, sizes)):
        out.copy_(part.view(out.shape))
    return _Done() if async_op else None


def _allgather_fn(output_tensor, input_tensor, group=None, async_op: bool = False, debug=None):
    """DeepSpeed's ``allgather_fn(output_tensor, input_tensor, group=None, async_op=False)``:
    :func:`all_gather_into_tensor` (the flat all-gather, which torch always has here)."""
    return distributed.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                              async_op=async_op)


def _reduce_scatter_fn(output_tensor, tensor, op=distributed.ReduceOp.SUM, group=None,
                       async_op: bool = False, prof: bool = False, debug=None):
    """DeepSpeed's ``reduce_scatter_fn(output_tensor, tensor, op=ReduceOp.SUM, group=None,
    async_op=False)``: :func:`reduce_scatter_tensor`."""
    return distributed.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group,
                                             async_op=async_op)


def _all_gather_object(object_list, obj, group=None) -> None:
    """DeepSpeed's (torch's) ``all_gather_object(object_list, obj, group=None)``: fills
    ``object_list`` (one slot per rank of the group) with every rank's ``obj``. A rank outside
    ``group`` returns at once, as torch's does. A list of the wrong length on any rank raises
    the same ValueError on every rank, after the one all-gather (which carries each rank's
    list length with its object), so no rank is left waiting."""
    if distributed._not_a_member(group):
        return
    n = distributed.get_world_size(group)
    slots = len(object_list) if isinstance(object_list, list) else None
    every = distributed.all_gather_object((slots, obj), group=group)
    wrong = [(r, k) for r, (k, _) in enumerate(every) if k != n]
    if wrong:
        raise ValueError(f"all_gather_object(object_list=...): expected a list of {n} slots "
                         f"(one per rank of the group) on every rank; (group rank, slots): "
                         f"{wrong} (None: not a list)")
    object_list[:] = [o for _, o in every]


def _broadcast_object_list(object_list, src, group=None, device=None) -> None:
    """DeepSpeed's (torch's) ``broadcast_object_list(object_list, src, group=None,
    device=None)``: every rank's ``object_list`` takes rank ``src``'s items (lists of the
    same length on every rank). After the object broadcast, one small all-gather (four ints a
    rank, not counted; on ``device``, else the CUDA device under NCCL, else the CPU) checks
    the lengths, so a list of another length than ``src``'s on any rank raises a ValueError
    on every rank (``src`` included) and every list is left as it was."""
    if not isinstance(object_list, list):
        raise ValueError(f"broadcast_object_list(object_list=...): expected a list, got "
                         f"{type(object_list).__name__}")
    sent = distributed.broadcast_object(list(object_list), src=src, group=group)
    if distributed._not_a_member(group):
        return
    problem = None
    if len(sent) != len(object_list):
        problem = (f"broadcast_object_list(object_list=...): rank {src} sent {len(sent)} "
                   f"objects, this rank's list has {len(object_list)} slots")
    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) \
            if distributed.backend_of(group) == "nccl" else torch.device("cpu")
    distributed._agree_on_root("broadcast_object_list", "src", src, problem, group, device,
                               outcome="no list was changed")
    object_list[:] = sent


def _destroy_process_group(group=None) -> None:
    """DeepSpeed's ``destroy_process_group(group=None)``: the default group only (after a
    barrier, :func:`shardkit.distributed.destroy`)."""
    if group is not None and group is not distributed.resolved_group(None):
        raise ValueError("destroy_process_group(group=...): shardkit destroys the default "
                         "group only (group=None); a subgroup goes with it")
    distributed.destroy()


# DeepSpeed's ``deepspeed.comm``: torch.distributed's calls under DeepSpeed's signatures (its
# argument names and defaults), through shardkit.distributed (so CommCounter counts them)
# DeepSpeed's timed collectives also take these (its communication logger's); shardkit counts
# communication with CommCounter instead
_PROFILING_KEYWORDS = ("prof", "log_name", "debug")


def _takes_profiling_keywords(fn):
    """``fn`` also taking DeepSpeed's profiling keywords (``prof=``, ``log_name=``,
    ``debug=``) by keyword, accepted and ignored."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        for key in _PROFILING_KEYWORDS:
            kwargs.pop(key, None)
        return fn(*args, **kwargs)
    return call


comm = types.ModuleType("shardkit.comm", "DeepSpeed's deepspeed.comm over shardkit.distributed")
comm.init_distributed = init_distributed
comm.is_initialized = distributed.is_initialized
comm.get_rank = distributed.get_rank
comm.get_world_size = distributed.get_world_size
comm.get_global_rank = _get_global_rank
comm.get_world_group = _get_world_group
comm.get_all_ranks_from_group = _get_all_ranks_from_group
comm.destroy_process_group = _destroy_process_group
comm.get_local_rank = _local_rank
comm.new_group = distributed.new_group
comm.barrier = _barrier
comm.all_reduce = distributed.all_reduce
comm.broadcast = distributed.broadcast
comm.all_gather = _all_gather
comm.all_gather_into_tensor = _all_gather_into_tensor
comm.has_all_gather_into_tensor = lambda: True
comm.reduce = distributed.reduce
comm.reduce_scatter_tensor = _reduce_scatter_tensor
comm.has_reduce_scatter_tensor = lambda: True
comm.ReduceOp = distributed.ReduceOp
# DeepSpeed's inference path all-reduces in place through its own kernel where it has one;
# through torch's collective it is the same sum
comm.inference_all_reduce = distributed.all_reduce
comm.all_to_all_single = _all_to_all_single
comm.send = distributed.send
comm.recv = distributed.recv
comm.isend = distributed.isend
comm.irecv = distributed.irecv
comm.all_gather_object = _all_gather_object
comm.broadcast_object_list = _broadcast_object_list
# torch's rooted and list collectives and the coalesced ones of DeepSpeed's comm
comm.gather = distributed.gather
comm.scatter = distributed.scatter
comm.monitored_barrier = distributed.monitored_barrier
comm.all_reduce_coalesced = distributed.all_reduce_coalesced
comm.has_all_reduce_coalesced = lambda: True
comm.all_gather_coalesced = distributed.all_gather_coalesced
# DeepSpeed's backend answers whether it can coalesce ops under torch's coalescing manager;
# shardkit.comm offers none (its coalesced collectives pack into one buffer instead)
comm.has_coalescing_manager = lambda: False
comm.reduce_scatter = distributed.reduce_scatter
comm.all_to_all = _all_to_all
comm.allgather_fn = _allgather_fn
comm.reduce_scatter_fn = _reduce_scatter_fn
for _name in ("barrier", "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
              "reduce", "reduce_scatter_tensor", "inference_all_reduce", "all_to_all_single",
              "send", "recv", "isend", "irecv", "gather", "scatter", "monitored_barrier",
              "all_reduce_coalesced", "reduce_scatter", "reduce_scatter_fn",
              "all_gather_object"):
    setattr(comm, _name, _takes_profiling_keywords(getattr(comm, _name)))
comm.is_available = torch.distributed.is_available
comm.get_backend = distributed.backend_of
