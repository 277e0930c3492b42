"""Kernel tests run the Triton code on CPU through Triton's interpreter.

Triton reads ``TRITON_INTERPRET`` when a ``@triton.jit`` function is created, so it is set here,
before any test module imports ``shardkit.kernels.triton_*`` (the dispatch imports them lazily).
"""

import os

import pytest
import torch

os.environ.setdefault("TRITON_INTERPRET", "1")
torch.set_num_threads(1)  # one core each: the test machine is shared

BACKENDS = ("triton", "torch")


@pytest.fixture(params=BACKENDS)
def backend(request, monkeypatch):
    """Run the test once with the Triton kernels (interpreted) and once with the CPU path."""
    monkeypatch.setenv("SHARDKIT_KERNELS", request.param)
    return request.param
