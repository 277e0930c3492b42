"""DeepSpeed's script-level helpers, so that ``import shardkit as deepspeed`` runs a DeepSpeed
training script unchanged: :func:`add_config_arguments` (the ``--deepspeed_config`` option that
``initialize(args=args)`` reads) and :func:`init_distributed` (DeepSpeed's spelling and keywords
over :func:`shardkit.distributed.init_distributed`).

Process groups come from torchrun's environment only (DESIGN.md: no home-made launcher): MPI
discovery, ``init_method``, and explicit ``rank`` / ``world_size`` are refused by name. Outside
torchrun (no ``RANK`` in the environment) a one-rank group is started, so a script also runs as
plain ``python train.py``.

Also DeepSpeed's script-side names: ``deepspeed.utils.logger`` / ``log_dist`` (:data:`logger`,
:func:`log_dist`), ``deepspeed.runtime.utils.see_memory_usage`` (:func:`see_memory_usage`) and
``deepspeed.runtime.zero.partition_parameters`` (:data:`runtime`).
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import functools
import gc
import importlib.machinery
import logging
import os
import sys
import types
from typing import Optional

import torch

from shardkit import distributed
from shardkit.accelerator import get_accelerator  # noqa: F401 - DeepSpeed's name here too

__all__ = ["add_config_arguments", "init_distributed", "ensure_process_group",
           "get_accelerator", "comm", "logger", "log_dist", "see_memory_usage", "runtime"]


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


def _polled(work, group, device=None):
    """An async reduce-scatter's handle whose ``is_completed()`` is a true poll: gloo's work
    reads ``False`` forever, even after ``wait()`` (a loop polling it never ended), so on
    gloo a background thread waits for it (``wait()`` then returns ``True``). Other backends'
    works as they are."""
    if work is None or not distributed._completes_when_waited(group, device):
        return work
    return distributed._ThenCopy([work], None, watched=True)


def _reduce_scatter_tensor(output_tensor, tensor, op=distributed.ReduceOp.SUM, group=None,
                           async_op: bool = False):
    """DeepSpeed's ``reduce_scatter_tensor(output_tensor, tensor, op=ReduceOp.SUM, group=None,
    async_op=False)`` (with ``async_op`` on gloo a handle whose ``is_completed()`` polls, as
    torch's gloo work's does not)."""
    work = distributed.reduce_scatter_tensor(output_tensor, tensor, op=op, group=group,
                                             async_op=async_op)
    return _polled(work, group, output_tensor.device) if async_op else work


def _splits(sizes, tensor, n: int, argument: str) -> list:
    """Row counts per rank along dim 0 (``None``: equal), checked against ``tensor``."""
    rows = tensor.shape[0] if tensor.dim() else 1
    if sizes is None:
        if rows % n:
            raise ValueError(f"all_to_all_single({argument}=None): {rows} rows do not split "
                             f"equally over {n} ranks; give {argument}")
        return [rows // n] * n
    try:
        listed = list(sizes)
    except TypeError:  # not a sequence (an int, say): refused below like any other misfit
        listed = []
    if len(listed) != n or not all(isinstance(k, int) and not isinstance(k, bool) and k >= 0
                                   for k in listed) or sum(listed) != rows:
        raise ValueError(f"all_to_all_single({argument}={sizes!r}): expected {n} ints >= 0 "
                         f"(one per rank of the group) summing to the tensor's {rows} rows "
                         f"(dim 0)")
    return listed


def _all_to_all_single(output, tensor, output_split_sizes=None, input_split_sizes=None,
                       group=None, async_op: bool = False):
    """DeepSpeed's ``all_to_all_single(output, tensor, output_split_sizes=None,
    input_split_sizes=None, group=None, async_op=False)``: rows (dim 0) ``input_split_sizes[j]``
    go to rank ``j``, rows from rank ``j`` land in ``output_split_sizes[j]``. No split sizes
    (on any rank of the group: every rank passes split sizes or none does): one all-to-all.
    With split sizes: one all-gather of every rank's split sizes and dtype (``2n + 2`` int64s a
    rank, ``8n(2n + 2)`` bytes gathered, not counted by CommCounter), checked on every rank
    (a bad or inconsistent split, or a dtype that differs between ranks, raises the same
    ValueError on every rank, before any data moves), then one all-to-all: of the splits as
    given when they are all equal, else of the splits padded to the largest (its padding on
    the wire too), the handle then a finished one."""
    if output_split_sizes is None and input_split_sizes is None:
        return distributed.all_to_all_single(output, tensor, group=group, async_op=async_op)
    return _all_to_all_split(output, tensor, output_split_sizes, input_split_sizes, group,
                             async_op, "all_to_all_single")


def _check_tensors(what: str, **tensors) -> None:
    """Raise a TypeError naming the first of ``tensors`` (argument name: value) that is not a
    torch.Tensor."""
    for name, value in tensors.items():
        if not isinstance(value, torch.Tensor):
            raise TypeError(f"{what}({name}=...): expected a torch.Tensor, got "
                            f"{type(value).__name__}")


def _all_to_all_split(output, tensor, output_split_sizes, input_split_sizes, group,
                      async_op: bool, what: str, problem: Optional[Exception] = None):
    """:func:`_all_to_all_single` with split sizes; ``problem``: what the caller already
    found wrong on this rank (raised here after the agreement, so no rank is left
    waiting)."""
    if distributed._not_a_member(group):  # torch skips the op there
        return _Done() if async_op else None
    n = distributed.get_world_size(group)
    sends, takes = [0] * n, [0] * n
    if problem is None:
        try:
            _check_tensors(what, tensor=tensor, output=output)
            sends = _splits(input_split_sizes, tensor, n, "input_split_sizes")
            takes = _splits(output_split_sizes, output, n, "output_split_sizes")
            if tensor.shape[1:] != output.shape[1:] or tensor.dtype != output.dtype:
                raise ValueError(f"all_to_all_single: the tensor {tuple(tensor.shape)} "
                                 f"{tensor.dtype} and the output {tuple(output.shape)} "
                                 f"{output.dtype} must have one dtype and the same sizes "
                                 f"beyond dim 0")
        except (TypeError, ValueError) as error:
            problem, sends, takes = error, [0] * n, [0] * n
    # every rank's [ok, sends, takes, dtype]: every rank then decides (and raises) alike
    device = distributed._control_device(group, tensor)
    code = distributed._dtype_code(tensor.dtype) if isinstance(tensor, torch.Tensor) else -1
    every = distributed._agree_on_call(what, problem, sends + takes + [code], group, device,
                                       outcome="nothing was exchanged")
    codes = [row[2 * n] for row in every]
    if len(set(codes)) > 1:
        raise ValueError(f"{what}: the ranks' tensors differ in dtype (per group rank: "
                         f"{[distributed._dtype_name(c) for c in codes]}); every rank must "
                         f"exchange one dtype; nothing was exchanged")
    sent = [row[:n] for row in every]
    for i in range(n):
        for j in range(n):
            if sent[i][j] != every[j][n + i]:
                raise ValueError(
                    f"{what}: group rank {i} sends {sent[i][j]} rows to group rank "
                    f"{j} (its input_split_sizes[{j}]), which expects {every[j][n + i]} "
                    f"(its output_split_sizes[{i}]); nothing was exchanged")
    width = max(max(row) for row in sent)
    # the ranks agreed above: the exchange itself needs no second agreement
    if all(k == width for row in sent for k in row):
        return distributed.all_to_all_single(output, tensor, group=group, async_op=async_op,
                                             check_ranks=False)
    padded = tensor.new_zeros((n * width,) + tuple(tensor.shape[1:]))
    for j, chunk in enumerate(torch.split(tensor, sends)):
        padded[j * width:j * width + sends[j]] = chunk
    received = torch.empty_like(padded)
    distributed.all_to_all_single(received, padded, group=group, check_ranks=False)
    for j, chunk in enumerate(torch.split(output, takes)):
        chunk.copy_(received[j * width:j * width + takes[j]])
    return _Done() if async_op else None


def _all_to_all(output_tensor_list, input_tensor_list, group=None, async_op: bool = False):
    """DeepSpeed's (torch's) ``all_to_all(output_tensor_list, input_tensor_list, group=None,
    async_op=False)``: ``input_tensor_list[j]`` goes to group rank ``j``, group rank ``j``'s
    item for this rank lands in ``output_tensor_list[j]`` (items of any sizes, one dtype).
    Runs as :func:`~shardkit.distributed.all_to_all_single` of the lists flattened (their sizes as
    split sizes: one all-gather of the sizes, ``2n + 2`` int64s a rank, not counted by CommCounter,
    checked on every rank, then one all-to-all); with ``async_op`` a finished handle. A list of the
    wrong length or of mixed dtypes on one rank raises a ValueError on every rank (that
    rank's names the list), before any data moves. gloo has no list all-to-all of its own."""
    what = "all_to_all"
    distributed._check_call(what, group)
    if distributed._not_a_member(group):
        return _Done() if async_op else None
    n = distributed.get_world_size(group)
    problem = None
    for name, items in (("output_tensor_list", output_tensor_list),
                        ("input_tensor_list", input_tensor_list)):
        if problem is None and (not isinstance(items, (list, tuple)) or len(items) != n or not all(
                isinstance(t, torch.Tensor) for t in items)):
            problem = ValueError(
                f"{what}({name}=...): expected a list of {n} tensors (one per rank of the "
                f"group), got {type(items).__name__}"
                + (f" of {len(items)}" if isinstance(items, (list, tuple)) else ""))
    if problem is None:
        dtypes = {t.dtype for t in (*output_tensor_list, *input_tensor_list)}
        if len(dtypes) > 1:
            problem = ValueError(f"{what}: the tensors of both lists must have one dtype, got "
                                 f"{sorted(str(d) for d in dtypes)}")
    if problem is not None:  # the agreement's all-gather still runs, so no rank waits
        lists = [items for items in (input_tensor_list, output_tensor_list)
                 if isinstance(items, (list, tuple))]
        empty = torch.empty(0, device=distributed._control_device(
            group, *(t for items in lists for t in items)))
        _all_to_all_split(empty, empty, [0] * n, [0] * n, group, False, what, problem)
    sends = torch.cat([t.reshape(-1) for t in input_tensor_list])
    got = sends.new_empty(sum(t.numel() for t in output_tensor_list))
    _all_to_all_split(got, sends, [t.numel() for t in output_tensor_list],
                      [t.numel() for t in input_tensor_list], group, False, what)
    sizes = [t.numel() for t in output_tensor_list]
    for out, part in zip(output_tensor_list, torch.split(got, sizes)):
        out.copy_(part.view(out.shape))
    return _Done() if async_op else None


def _allgather_fn(output_tensor, input_tensor, group=None, async_op: bool = False, debug=None):
    """DeepSpeed's ``allgather_fn(output_tensor, input_tensor, group=None, async_op=False)``:
    :func:`~shardkit.distributed.all_gather_into_tensor` (the flat all-gather, which torch always
    has here)."""
    return distributed.all_gather_into_tensor(output_tensor, input_tensor, group=group,
                                              async_op=async_op)


def _reduce_scatter_fn(output_tensor, tensor, op=distributed.ReduceOp.SUM, group=None,
                       async_op: bool = False, prof: bool = False, debug=None):
    """DeepSpeed's ``reduce_scatter_fn(output_tensor, tensor, op=ReduceOp.SUM, group=None,
    async_op=False)``: :func:`~shardkit.distributed.reduce_scatter_tensor`."""
    return _reduce_scatter_tensor(output_tensor, tensor, op=op, group=group, async_op=async_op)


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
        device = distributed._control_device(group)
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
# DeepSpeed's timed collectives also take these (its communication logger's): shardkit's
# logger (configure / log_summary below) reads prof= and log_name=
_PROFILING_KEYWORDS = ("prof", "log_name", "debug")


class _CommsLog:
    """DeepSpeed's communication logger over :class:`shardkit.distributed.CommCounter`: the
    same switches (``enabled``, ``prof_all``, ``prof_ops``, ``verbose``, ``debug``), the
    records CommCounter makes (op name, logical size, bus bytes), no latencies."""

    def __init__(self):
        self.enabled, self.prof_all, self.prof_ops = False, True, []
        self.verbose = self.debug = False
        self.counter = distributed.CommCounter()
        self._entered = False

    def sync(self) -> None:
        """Count every collective of this process while ``enabled`` and ``prof_all``."""
        want = self.enabled and self.prof_all
        if want and not self._entered:
            self.counter.__enter__()
        elif self._entered and not want:
            self.counter.__exit__(None, None, None)
        self._entered = want

    def selects(self, prof, log_name) -> bool:
        """Whether a call with ``prof=`` / ``log_name=`` is logged (DeepSpeed's rule: every
        call under ``prof_all``, else when ``prof`` is true or ``log_name`` is in
        ``prof_ops``)."""
        return self.enabled and (self.prof_all or bool(prof) or log_name in self.prof_ops)

    def take(self, records, log_name: str, selected: bool) -> None:
        """Log a ``shardkit.comm`` call's ``records`` under its ``log_name``, as DeepSpeed
        keys its summary (``prof_all`` already counted them under CommCounter's op names:
        those are replaced); an all-gather's message size is its input's, as DeepSpeed's."""
        calls, k = self.counter.calls, len(records)
        if k and self._entered and len(calls) >= k and \
                all(a is b for a, b in zip(calls[-k:], records)):
            del calls[-k:]
        if selected:
            calls.extend(dataclasses.replace(
                r, op=log_name,
                numel=r.numel // r.group_size if r.op == "all_gather" else r.numel)
                for r in records)


_comms_log = _CommsLog()


def _takes_profiling_keywords(fn, log_name: str):
    """``fn`` also taking DeepSpeed's profiling keywords by keyword: ``prof=`` and
    ``log_name=`` (default ``log_name``, DeepSpeed's for this call) choose, as DeepSpeed's do,
    whether the call is logged when the logger is on with ``prof_all`` off; ``debug=`` is
    accepted and ignored."""
    @functools.wraps(fn)
    def call(*args, **kwargs):
        prof = kwargs.pop("prof", False)
        name = kwargs.pop("log_name", log_name)
        kwargs.pop("debug", None)
        if not _comms_log.enabled:
            return fn(*args, **kwargs)
        with distributed.CommCounter() as counter:
            try:
                return fn(*args, **kwargs)
            finally:
                _comms_log.take(counter.calls, name, _comms_log.selects(prof, name))
    return call


def _configure(deepspeed_config=None, enabled=None, prof_all=None, prof_ops=None,
               verbose=None, debug=None) -> None:
    """DeepSpeed's ``deepspeed.comm.configure(deepspeed_config=None, enabled=None,
    prof_all=None, prof_ops=None, verbose=None, debug=None)``: switch the communication
    logger that :func:`_log_summary` reports. ``deepspeed_config``: a DeepSpeed-style config
    (a dict, or an object with DeepSpeed's ``comms_config``) whose ``comms_logger`` section
    sets the switches first (``enabled`` as written there, default false); the keywords then
    override them. While enabled, ``prof_all=True`` (the default) logs every collective this
    process issues through shardkit (the wrappers' included); ``prof_all=False`` logs the
    ``shardkit.comm`` calls given ``prof=True`` or a ``log_name`` in ``prof_ops`` (their
    default names are DeepSpeed's: ``"all_reduce"``, ``"all_gather_into_tensor"``, ...).
    What is logged is what :class:`shardkit.distributed.CommCounter` records, keyed as
    DeepSpeed keys it: a ``shardkit.comm`` call under its ``log_name`` with DeepSpeed's
    message size (the tensor argument's bytes: an all-gather's input), other collectives
    (the wrappers') under CommCounter's op name and logical size (for a transport that
    moves bytes itself, what it moved); bus bytes; no latencies (shardkit does not time
    collectives).
    ``verbose`` and ``debug`` are kept and change nothing. Local; no communication.

    Raises:
        ValueError: a switch of the wrong type, or a ``comms_logger`` section that is not a
            JSON object.
    """
    section = None
    if isinstance(deepspeed_config, dict):
        section = deepspeed_config.get("comms_logger")
    elif deepspeed_config is not None:
        comms = getattr(deepspeed_config, "comms_config", deepspeed_config)
        section = getattr(comms, "comms_logger", None)
        if section is not None and not isinstance(section, dict):
            section = {key: getattr(section, key) for key in
                       ("enabled", "prof_all", "prof_ops", "verbose", "debug")
                       if hasattr(section, key)}
    if section is not None and not isinstance(section, dict):
        raise ValueError(f"configure(deepspeed_config=...): its comms_logger section is "
                         f"{type(section).__name__}; expected a JSON object such as "
                         f'{{"enabled": true, "prof_all": true}}')
    settings = dict(section or {})
    given = {"enabled": enabled, "prof_all": prof_all, "prof_ops": prof_ops,
             "verbose": verbose, "debug": debug}
    settings.update({key: value for key, value in given.items() if value is not None})
    for key, value in settings.items():
        if key not in given:
            continue  # DeepSpeed's section has no other keys; shardkit's config checks them
        valid = isinstance(value, list) and all(isinstance(v, str) for v in value) \
            if key == "prof_ops" else isinstance(value, bool)
        if not valid:
            want = "a list of log names (str)" if key == "prof_ops" else "True or False"
            raise ValueError(f"configure({key}={value!r}): expected {want}")
        setattr(_comms_log, key, list(value) if key == "prof_ops" else value)
    _comms_log.sync()


def _summary() -> dict:
    """``{op: {message bytes: {count, msg_size_bytes, msg_size_str, total_bus_bytes}}}``."""
    summary: dict = {}
    for record in _comms_log.counter.calls:
        size = record.numel * distributed.comm_counter.element_size(record.dtype)
        entry = summary.setdefault(record.op, {}).setdefault(size, {
            "count": 0, "msg_size_bytes": size, "msg_size_str": _size_words(size),
            "total_bus_bytes": 0.0})
        entry["count"] += 1
        entry["total_bus_bytes"] += record.bytes
    return summary


def _size_words(size: float) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if size < 1024 or unit == "GB":
            return f"{size:.2f} {unit}" if unit != "B" else f"{int(size)} B"
        size /= 1024
    return ""


def _log_summary(show_straggler: bool = False, return_dict: bool = False):
    """DeepSpeed's ``deepspeed.comm.log_summary(show_straggler=False, return_dict=False)``:
    rank 0 prints, per op and message size, the number of calls the logger saw (see
    :func:`_configure`) and their bus bytes under CommCounter's convention (DeepSpeed's
    latency and bandwidth columns are not measured: shardkit does not time collectives);
    with ``return_dict`` every rank returns its own ``{"summary": {op: {msg_size: {"count",
    "msg_size_bytes", "msg_size_str", "total_bus_bytes"}}}, "straggler_analysis": None,
    "metadata": {"world_size", "rank", "timestamp"}}``. ``show_straggler`` needs latencies:
    accepted, and its analysis is ``None`` (with a warning). Local; no communication (no
    barriers: nothing is timed)."""
    import datetime as _datetime
    import warnings
    if show_straggler:
        warnings.warn("log_summary(show_straggler=True): shardkit's communication logger "
                      "records no latencies, so there is no straggler analysis (None)",
                      stacklevel=2)
    summary = _summary()
    rank = distributed.get_rank()
    if rank == 0:
        lines = [f"{'Comm. Op':<24}{'Message Size':>16}{'Count':>10}{'Bus bytes (total)':>20}"]
        for op, sizes in summary.items():
            lines.append(op)
            for size, entry in sorted(sizes.items()):
                lines.append(f"{'':<24}{entry['msg_size_str']:>16}{entry['count']:>10}"
                             f"{entry['total_bus_bytes']:>20.0f}")
        if not summary:
            lines.append("(no communication logged: deepspeed.comm.configure(enabled=True) "
                         "or a config with comms_logger.enabled=true turns the logger on)")
        print("\n".join(lines), flush=True)
    if not return_dict:
        return None
    return {"summary": summary, "straggler_analysis": None,
            "metadata": {"world_size": distributed.get_world_size(), "rank": rank,
                         "timestamp": _datetime.datetime.now().isoformat()}}


def _reset_log() -> None:
    """DeepSpeed's ``reset_log()``: forget what the logger recorded (it keeps logging)."""
    _comms_log.counter.reset()


def _has_comm_data() -> bool:
    """DeepSpeed's ``has_comm_data()``: whether the logger recorded any collective."""
    return bool(_comms_log.counter.calls)


def _get_comm_operation_count() -> int:
    """DeepSpeed's ``get_comm_operation_count()``: collectives the logger recorded."""
    return len(_comms_log.counter.calls)


def _get_logged_comm_ops() -> list:
    """DeepSpeed's ``get_logged_comm_ops()``: the op names logged, in order of first call."""
    return list(dict.fromkeys(r.op for r in _comms_log.counter.calls))


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
# DeepSpeed's default log_name of each timed call (its op's name, but for these)
_LOG_NAMES = {"inference_all_reduce": "all_reduce", "all_reduce_coalesced": "all_reduce",
              # DeepSpeed's logs the timed call inside: all_gather_into_tensor /
              # reduce_scatter_tensor under their own default names
              "allgather_fn": "all_gather_into_tensor",
              "reduce_scatter_fn": "reduce_scatter_tensor"}
for _name in ("barrier", "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor",
              "reduce", "reduce_scatter_tensor", "inference_all_reduce", "all_to_all_single",
              "send", "recv", "isend", "irecv", "gather", "scatter", "monitored_barrier",
              "all_reduce_coalesced", "reduce_scatter", "reduce_scatter_fn",
              "all_gather_object", "all_to_all", "all_gather_coalesced", "allgather_fn"):
    setattr(comm, _name, _takes_profiling_keywords(getattr(comm, _name),
                                                   _LOG_NAMES.get(_name, _name)))
comm.configure = _configure
comm.log_summary = _log_summary
comm.reset_log = _reset_log
comm.has_comm_data = _has_comm_data
comm.get_comm_operation_count = _get_comm_operation_count
comm.get_logged_comm_ops = _get_logged_comm_ops
comm.is_available = torch.distributed.is_available
comm.get_backend = distributed.backend_of


# ----------------------------------------------------------------------------- script logging

_LOG_FORMAT = "[%(asctime)s] [%(levelname)s] [%(filename)s:%(lineno)d:%(funcName)s] %(message)s"


_HANDLER_NAME = "shardkit.scripts.stdout"


class _StdoutHandler(logging.StreamHandler):
    """Writes to the ``sys.stdout`` of the moment (a script or test that redirects stdout
    after import still gets the lines)."""

    def __init__(self):
        super().__init__()
        self.setFormatter(logging.Formatter(_LOG_FORMAT))

    @property
    def stream(self):
        return sys.stdout

    @stream.setter
    def stream(self, _value):  # logging.StreamHandler.__init__ assigns it
        pass


def _script_logger() -> logging.Logger:
    """DeepSpeed's ``deepspeed.utils.logger``: INFO and above printed on stdout in DeepSpeed's
    format on every rank, and not passed on to the root logger (a script that configures
    ``logging`` itself would print each line twice). Its ``warning_once`` warns once per
    message, as DeepSpeed's."""
    log = logging.getLogger("shardkit.scripts")
    # by name, not class: a reloaded module (a notebook's autoreload) has a new class, and a
    # second handler would print every line twice
    if not any(h.get_name() == _HANDLER_NAME for h in log.handlers):
        handler = _StdoutHandler()
        handler.set_name(_HANDLER_NAME)
        log.addHandler(handler)
        log.setLevel(logging.INFO)
        log.propagate = False
    log.warning_once = functools.lru_cache(None)(log.warning)
    return log


logger = _script_logger()


def log_dist(message, ranks=None, level: int = logging.INFO) -> None:
    """DeepSpeed's ``log_dist``: log ``"[Rank R] message"`` with :data:`logger` at ``level``
    on the ranks listed in ``ranks`` (``[-1]``: every rank); without a process group it logs
    (rank ``-1``), and ``ranks=None`` in a group logs nowhere, as DeepSpeed's does. Local."""
    if ranks is not None and not isinstance(ranks, (list, tuple, set, range)):
        raise ValueError(f"log_dist(ranks={ranks!r}): expected a list of ranks (e.g. [0], or "
                         f"[-1] for every rank) or None")
    ranks = list(ranks or [])
    rank = distributed.get_rank() if distributed.is_initialized() else -1
    if rank == -1 or (ranks and (ranks[0] == -1 or rank in ranks)):
        logger.log(level, f"[Rank {rank}] {message}")


def _gigabytes(size: float) -> float:
    return round(size / 2 ** 30, 2)


def _host_memory_line() -> Optional[str]:
    """The host's used memory and its share, as DeepSpeed prints them (used = total -
    available, from ``/proc/meminfo``); ``None`` where there is no such file."""
    try:
        with open("/proc/meminfo") as f:
            fields = dict(line.split(":", 1) for line in f if ":" in line)
        total = int(fields["MemTotal"].split()[0]) * 1024
        available = int(fields["MemAvailable"].split()[0]) * 1024
    except (OSError, KeyError, ValueError):
        return None
    used = total - available
    return (f"CPU Virtual Memory:  used = {_gigabytes(used)} GB, percent = "
            f"{round(100.0 * used / total, 1)}%")


def see_memory_usage(message: str, force: bool = False) -> None:
    """DeepSpeed's ``deepspeed.runtime.utils.see_memory_usage``: with ``force=True``, on rank 0
    (or without a process group), log ``message``, the accelerator's allocated and cached
    bytes with their peaks (``MA``, ``Max_MA``, ``CA``, ``Max_CA``, in GB; 0 on the CPU) and
    the host's used memory, then restart the peak counters. ``force=False`` does nothing, as
    in DeepSpeed (scripts leave the calls in and switch them on). Local; a ``gc.collect()``
    first, as DeepSpeed's."""
    if not force:
        return
    if distributed.is_initialized() and distributed.get_rank() != 0:
        return
    gc.collect()
    accelerator = get_accelerator()
    on_cuda = accelerator.device_name().startswith("cuda")
    cached = torch.cuda.memory_reserved() if on_cuda else 0
    max_cached = torch.cuda.max_memory_reserved() if on_cuda else 0
    logger.info(message)
    logger.info(f"MA {_gigabytes(accelerator.memory_allocated())} GB         "
                f"Max_MA {_gigabytes(accelerator.max_memory_allocated())} GB         "
                f"CA {_gigabytes(cached)} GB         Max_CA {_gigabytes(max_cached)} GB ")
    host = _host_memory_line()
    if host is not None:
        logger.info(host)
    accelerator.reset_peak_memory_stats()


def _namespace(name: str, doc: str, **members) -> types.ModuleType:
    """A module object ``name`` holding ``members``, with a spec as an imported module has
    (``importlib.util.find_spec`` and tools built on it raise on a module without one)."""
    module = types.ModuleType(name, doc)
    module.__spec__ = importlib.machinery.ModuleSpec(name, None)
    for key, value in members.items():
        setattr(module, key, value)
    return module


def _deepspeed_runtime() -> types.ModuleType:
    """``deepspeed.runtime``'s names that training scripts import: ``runtime.utils.
    see_memory_usage`` and ``runtime.zero.partition_parameters`` (``ZeroParamStatus``,
    ``GatheredParameters``, ``Init``, from :mod:`shardkit.zero`)."""
    from shardkit import zero
    partition_parameters = _namespace(
        "shardkit.runtime.zero.partition_parameters",
        "DeepSpeed's deepspeed.runtime.zero.partition_parameters names",
        ZeroParamStatus=zero.ZeroParamStatus, GatheredParameters=zero.GatheredParameters,
        Init=zero.Init)
    return _namespace(
        "shardkit.runtime", "DeepSpeed's deepspeed.runtime names that scripts import",
        utils=_namespace("shardkit.runtime.utils", "DeepSpeed's deepspeed.runtime.utils names",
                         see_memory_usage=see_memory_usage),
        zero=_namespace("shardkit.runtime.zero", "DeepSpeed's deepspeed.runtime.zero names",
                        partition_parameters=partition_parameters,
                        GatheredParameters=zero.GatheredParameters, Init=zero.Init))


runtime = _deepspeed_runtime()
