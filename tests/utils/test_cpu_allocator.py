"""tune_cpu_allocator: opt-in, each setting applied and reported on its own, nothing implicit."""

import json
import platform
import subprocess
import sys

import pytest

from shardkit.utils.cpu_allocator import tune_cpu_allocator

# Runs in a fresh process (the settings are process-wide): an 8 MiB malloc is mmapped by
# default (above glibc's 128 KiB threshold); after tuning, the same request is served from the
# heap, its free keeps the memory (no trim), and the next request reuses it without growing.
SNIPPET = """
import ctypes, ctypes.util, json
from shardkit.nn.data_parallel import FullyShardedDataParallel  # importing changes nothing
from shardkit.utils.cpu_allocator import tune_cpu_allocator

class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in ("arena", "ordblks", "smblks", "hblks", "hblkhd",
                                                "usmblks", "fsmblks", "uordblks", "fordblks",
                                                "keepcost")]

libc = ctypes.CDLL(ctypes.util.find_library("c"))
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
info, size, out = libc.mallinfo2, 8 << 20, {}
before = info().hblks
kept = libc.malloc(size)
out["untuned_mmapped"] = info().hblks - before
out["settings"] = tune_cpu_allocator(mmap_threshold=16 << 20, trim_threshold=1 << 30,
                                     top_pad=None)
before, in_use = info().hblks, info().uordblks
block = libc.malloc(size)
out["tuned_mmapped"], out["heap_in_use_grew"] = info().hblks - before, info().uordblks - in_use
libc.free(block)
out["free_bytes_kept"], arena = info().fordblks, info().arena
again = libc.malloc(size)
out["reuse_grew"] = info().arena - arena
libc.free(again)
libc.free(kept)
print(json.dumps(out))
"""


def _glibc_at_least(major: int, minor: int) -> bool:
    lib, version = platform.libc_ver()
    parts = tuple(int(x) for x in version.split(".")[:2]) if version else (0, 0)
    return lib == "glibc" and parts >= (major, minor)


@pytest.mark.skipif(not _glibc_at_least(2, 33), reason="glibc >= 2.33 (mallinfo2)")
def test_tuned_blocks_come_from_and_return_to_the_heap():
    proc = subprocess.run([sys.executable, "-c", SNIPPET], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    got = json.loads(proc.stdout)
    assert got["settings"] == {"mmap_threshold": True, "trim_threshold": True}
    assert got["untuned_mmapped"] == 1        # glibc's default: a fresh mapping
    assert got["tuned_mmapped"] == 0          # tuned: from the heap ...
    assert got["heap_in_use_grew"] >= 8 << 20
    assert got["free_bytes_kept"] >= 8 << 20  # ... kept there when freed (no trim) ...
    assert got["reuse_grew"] == 0             # ... and reused by the next request


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
