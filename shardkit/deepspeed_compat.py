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


# DeepSpeed's ``deepspeed.comm``: torch.distributed's calls, through shardkit.distributed (so
# CommCounter counts them)
comm = types.ModuleType("shardkit.comm", "DeepSpeed's deepspeed.comm over shardkit.distributed")
comm.init_distributed = init_distributed
comm.is_initialized = distributed.is_initialized
comm.get_rank = distributed.get_rank
comm.get_world_size = distributed.get_world_size
comm.get_global_rank = distributed.get_global_rank
comm.get_local_rank = _local_rank
comm.new_group = distributed.new_group
comm.barrier = distributed.barrier
comm.all_reduce = distributed.all_reduce
comm.broadcast = distributed.broadcast
comm.all_gather = distributed.all_gather
comm.all_gather_into_tensor = distributed.all_gather_into_tensor
comm.reduce = distributed.reduce
comm.reduce_scatter_tensor = distributed.reduce_scatter_tensor
comm.ReduceOp = distributed.ReduceOp
# DeepSpeed's inference path all-reduces in place through its own kernel where it has one;
# through torch's collective it is the same sum
comm.inference_all_reduce = distributed.all_reduce
comm.all_to_all_single = distributed.all_to_all_single
comm.send = distributed.send
comm.recv = distributed.recv
comm.isend = distributed.isend
comm.irecv = distributed.irecv
comm.all_gather_object = distributed.all_gather_object
comm.is_available = torch.distributed.is_available
comm.get_backend = distributed.backend_of
