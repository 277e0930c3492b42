"""DeepSpeed's data loader factory (:class:`DeepSpeedIO`, mixed into
:class:`shardkit.engine.ShardedEngine`): a ``DataLoader`` over this data-parallel rank's share
of a dataset, as ``initialize(training_data=...)`` and ``engine.deepspeed_io()`` return it.
Local: no communication.
"""

from __future__ import annotations

from typing import Optional

import torch

from shardkit import distributed
from shardkit.config import EngineConfig
from shardkit.model_parallel_unit import ModelParallelGroups


def _data_loader(dataset, cfg: EngineConfig, collate_fn,
                 parallel: Optional[ModelParallelGroups] = None, batch_size: Optional[int] = None,
                 shuffle: bool = True, sampler=None, pin_memory: bool = False,
                 num_workers: int = 0):
    """The micro-batch loader over this rank's share of ``dataset``: split over the
    data-parallel ranks (a ``DistributedSampler``, shuffled with its seed unless ``shuffle``
    is false; ``sampler`` replaces it), so the tensor-parallel ranks of one replica read the
    same samples. ``batch_size``: default the config's micro-batch size."""
    from torch.utils.data import DataLoader, DistributedSampler
    replicas, index = ((distributed.get_world_size(), distributed.get_rank()) if parallel is None
                       else (parallel.data_size, parallel.data_rank))
    if sampler is None:
        sampler = DistributedSampler(dataset, num_replicas=replicas, rank=index, shuffle=shuffle)
    return DataLoader(dataset, batch_size=batch_size or cfg.train_micro_batch_size_per_gpu,
                      sampler=sampler, collate_fn=collate_fn, drop_last=cfg.dataloader_drop_last,
                      pin_memory=pin_memory, num_workers=num_workers)


def _check_dataset(dataset, where: str, sampler=None) -> None:
    """A ValueError (``where`` names the argument) unless ``dataset`` can be split over the
    data-parallel ranks by a sampler: a map-style ``Dataset`` or a sequence of samples (not an
    ``IterableDataset``: torch's ``DataLoader`` refuses any sampler with one). Local."""
    from torch.utils.data import Dataset, IterableDataset
    if isinstance(dataset, IterableDataset):
        raise ValueError(f"{where}<{type(dataset).__name__}>): an IterableDataset cannot be "
                         f"split over the data-parallel ranks by a sampler (torch's DataLoader "
                         f"takes no sampler with one, data_sampler= included); give each rank "
                         f"its own share (e.g. from engine.global_rank) and build a "
                         f"DataLoader over it")
    elif not isinstance(dataset, Dataset) and not (hasattr(dataset, "__len__")
                                                   and hasattr(dataset, "__getitem__")):
        raise ValueError(f"{where}<{type(dataset).__name__}>): expected a "
                         f"torch.utils.data.Dataset (or a sequence of samples)")


# DeepSpeed's deepspeed_io routes (deepspeed.runtime.constants.ROUTE_*): "eval" and "predict"
# read the data in order, "train" and "encode" shuffled
_IO_ROUTES = ("train", "eval", "predict", "encode")


class DeepSpeedIO:
    """Mixed into :class:`shardkit.engine.ShardedEngine`; needs ``self.config``,
    ``self.model_parallel`` and the ``collate_fn`` given to ``initialize`` (in
    ``self.__dict__``)."""

    def deepspeed_io(self, dataset, batch_size: Optional[int] = None, route: str = "train",
                     pin_memory: bool = True, data_sampler=None, collate_fn=None,
                     num_local_io_workers: Optional[int] = None):
        """DeepSpeed's loader factory (what ``initialize(training_data=...)`` returns, and
        what scripts call for their evaluation data): a ``torch.utils.data.DataLoader`` over
        this data-parallel rank's share of ``dataset`` (a ``DistributedSampler`` over the
        data-parallel ranks; the tensor-parallel ranks of a replica read the same samples),
        ``batch_size`` samples a batch (default ``train_micro_batch_size_per_gpu``), the
        config's ``dataloader_drop_last``. As in DeepSpeed, ``route`` ``"eval"`` and
        ``"predict"`` read in order (``shuffle=False``), ``"train"`` and ``"encode"`` shuffled
        (the sampler's seed, the same order each epoch unless ``loader.sampler.set_epoch``);
        ``data_sampler`` replaces the sampler; ``collate_fn`` defaults to the one given to
        ``initialize``. ``pin_memory`` applies with CUDA only; ``num_local_io_workers`` is
        the loader's ``num_workers`` (default 0: loading in this process, where DeepSpeed
        starts 2 workers). A bad argument is a ValueError naming it. Local: no
        communication."""
        _check_dataset(dataset, "engine.deepspeed_io(dataset=", data_sampler)
        if route not in _IO_ROUTES:
            raise ValueError(f"engine.deepspeed_io(route={route!r}): valid routes are "
                             f"{list(_IO_ROUTES)}")
        if batch_size is not None and (isinstance(batch_size, bool)
                                       or not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"engine.deepspeed_io(batch_size={batch_size!r}): expected an "
                             f"integer >= 1, or None for train_micro_batch_size_per_gpu")
        workers = 0 if num_local_io_workers is None else num_local_io_workers
        if isinstance(workers, bool) or not isinstance(workers, int) or workers < 0:
            raise ValueError(f"engine.deepspeed_io(num_local_io_workers="
                             f"{num_local_io_workers!r}): expected an integer >= 0 or None")
        if collate_fn is None:
            collate_fn = self.__dict__.get("collate_fn")
        return _data_loader(dataset, self.config, collate_fn,
                            self.model_parallel, batch_size=batch_size,
                            shuffle=route not in ("eval", "predict"), sampler=data_sampler,
                            pin_memory=bool(pin_memory) and torch.cuda.is_available(),
                            num_workers=workers)
