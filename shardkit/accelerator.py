"""DeepSpeed's ``get_accelerator()`` for the calls training scripts make on it
(``deepspeed.accelerator.get_accelerator`` becomes ``shardkit.accelerator.get_accelerator``): the
CUDA device when torch sees one, else the CPU. Local; no communication."""

from __future__ import annotations

from typing import Optional

import torch

__all__ = ["Accelerator", "get_accelerator"]


class Accelerator:
    """What DeepSpeed's ``get_accelerator()`` returns, for the calls training scripts make:
    the CUDA device when torch sees one, else the CPU (DeepSpeed's CPU accelerator: device
    name ``"cpu"`` whatever the index, ``set_device`` does nothing, backend gloo). Local; no
    communication."""

    def __init__(self, device_type: Optional[str] = None):
        if device_type is None:
            device_type = "cuda" if torch.cuda.is_available() else "cpu"
        if device_type not in ("cuda", "cpu"):
            raise ValueError(f"Accelerator(device_type={device_type!r}): expected 'cuda' or "
                             f"'cpu'")
        self._name = device_type
        self._cuda = device_type == "cuda"

    def device_name(self, device_index: Optional[int] = None) -> str:
        """The device's name: ``"cuda:i"`` for an index on CUDA, else ``"cuda"`` / ``"cpu"``."""
        if not self._cuda or device_index is None:
            return self._name
        return f"cuda:{device_index}"

    def current_device_name(self) -> str:
        """This process's current device as a string (``"cuda:i"`` or ``"cpu"``)."""
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def current_device(self) -> int:
        """This process's current device index (0 on the CPU)."""
        return torch.cuda.current_device() if self._cuda else 0

    def device(self, device_index: Optional[int] = None) -> torch.device:
        """The ``torch.device`` of :meth:`device_name`."""
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index: int) -> None:
        """Make ``device_index`` this process's CUDA device; nothing on the CPU."""
        if self._cuda:
            torch.cuda.set_device(device_index)

    def is_available(self) -> bool:
        """Always True: the CPU always is, and CUDA is chosen only when torch sees a GPU."""
        return True

    def device_count(self) -> int:
        """How many devices this process sees (1 on the CPU)."""
        return torch.cuda.device_count() if self._cuda else 1

    def communication_backend_name(self) -> str:
        """The torch.distributed backend for this device: nccl or gloo."""
        return "nccl" if self._cuda else "gloo"

    def is_bf16_supported(self) -> bool:
        """Whether bf16 computes here (always on the CPU)."""
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        """Whether fp16 computes here (torch runs it on CPU and CUDA)."""
        return True

    def synchronize(self, device_index: Optional[int] = None) -> None:
        """Wait for the device's queued work (CUDA); nothing on the CPU."""
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def manual_seed(self, seed: int) -> None:
        """Seed this device's random generator (the CPU's on the CPU)."""
        if self._cuda:
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        """Seed every device's random generator (the CPU's on the CPU)."""
        if self._cuda:
            torch.cuda.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)

    def empty_cache(self) -> None:
        """Give CUDA's cached free memory back; nothing on the CPU."""
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: Optional[int] = None) -> int:
        """CUDA bytes held by tensors now; 0 on the CPU (no device allocator)."""
        return torch.cuda.memory_allocated(device_index) if self._cuda else 0

    def max_memory_allocated(self, device_index: Optional[int] = None) -> int:
        """CUDA's peak of :meth:`memory_allocated`; 0 on the CPU."""
        return torch.cuda.max_memory_allocated(device_index) if self._cuda else 0

    def reset_peak_memory_stats(self, device_index: Optional[int] = None) -> None:
        """Restart CUDA's peak counters; nothing on the CPU."""
        if self._cuda:
            torch.cuda.reset_peak_memory_stats(device_index)


_ACCELERATOR: Optional[Accelerator] = None


def get_accelerator() -> Accelerator:
    """DeepSpeed's ``get_accelerator()``: one :class:`Accelerator` per process (CUDA when
    torch sees a GPU, else CPU)."""
    global _ACCELERATOR
    if _ACCELERATOR is None:
        _ACCELERATOR = Accelerator()
    return _ACCELERATOR
