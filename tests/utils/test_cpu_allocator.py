"""tune_cpu_allocator: opt-in, each setting applied and reported on its own, nothing implicit."""

import platform
import subprocess
import sys

import pytest

from shardkit.utils.cpu_allocator import tune_cpu_allocator

SNIPPET = """
import json, torch
from shardkit.nn.data_parallel import FullyShardedDataParallel  # importing changes nothing
from shardkit.utils.cpu_allocator import tune_cpu_allocator
print(json.dumps(tune_cpu_allocator(mmap_threshold=16 << 20, trim_threshold=1 << 30,
                                    top_pad=None)))
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc only")
def test_each_setting_reported_separately():
    proc = subprocess.run([sys.executable, "-c", SNIPPET], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    import json
    assert json.loads(proc.stdout) == {"mmap_threshold": True, "trim_threshold": True}


def test_a_refused_setting_is_reported_alone(monkeypatch):
    from shardkit.utils import cpu_allocator
    refuse_trim = lambda option, value: 0 if option == -1 else 1  # noqa: E731
    monkeypatch.setattr(cpu_allocator, "_glibc_mallopt", lambda: refuse_trim)
    got = tune_cpu_allocator()
    assert got == {"mmap_threshold": True, "trim_threshold": False, "top_pad": True}
    assert got.failed == ["trim_threshold"]


def test_failed_lists_refused_settings():
    from shardkit.utils.cpu_allocator import AllocatorSettings
    assert AllocatorSettings(a=True, b=False).failed == ["b"]


@pytest.mark.parametrize("bad", [-1, 1.5, True, 2 ** 40])
def test_bad_values_are_errors(bad):
    with pytest.raises(ValueError, match="mmap_threshold"):
        tune_cpu_allocator(mmap_threshold=bad)


def test_nothing_in_shardkit_calls_it():
    import pathlib
    import shardkit
    root = pathlib.Path(shardkit.__file__).parent
    callers = [p for p in root.rglob("*.py") if "tune_cpu_allocator(" in p.read_text()
               and p.name != "cpu_allocator.py"]
    assert callers == []
