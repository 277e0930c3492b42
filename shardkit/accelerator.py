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
        if not self._cuda or device_index is None:
            return self._name
        return f"cuda:{device_index}"

    def current_device_name(self) -> str:
        return f"cuda:{torch.cuda.current_device()}" if self._cuda else "cpu"

    def current_device(self) -> int:
        return torch.cuda.current_device() if self._cuda else 0

    def device(self, device_index: Optional[int] = None) -> torch.device:
        return torch.device(self.device_name(device_index))

    def set_device(self, device_index: int) -> None:
        if self._cuda:
            torch.cuda.set_device(device_index)

    def is_available(self) -> bool:
        return True  # the CPU always is; "cuda" is chosen only when torch sees a GPU

    def device_count(self) -> int:
        return torch.cuda.device_count() if self._cuda else 1

    def communication_backend_name(self) -> str:
        return "nccl" if self._cuda else "gloo"

    def is_bf16_supported(self) -> bool:
        return torch.cuda.is_bf16_supported() if self._cuda else True

    def is_fp16_supported(self) -> bool:
        return True

    def synchronize(self, device_index: Optional[int] = None) -> None:
        if self._cuda:
            torch.cuda.synchronize(device_index)

    def manual_seed(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed(seed)
        else:
            torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        if self._cuda:
            torch.cuda.manual_seed_all(seed)
        else:
            torch.manual_seed(seed)

    def empty_cache(self) -> None:
        if self._cuda:
            torch.cuda.empty_cache()

    def memory_allocated(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.memory_allocated(device_index) if self._cuda else 0

    def max_memory_allocated(self, device_index: Optional[int] = None) -> int:
        return torch.cuda.max_memory_allocated(device_index) if self._cuda else 0

    def reset_peak_memory_stats(self, device_index: Optional[int] = None) -> None:
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
