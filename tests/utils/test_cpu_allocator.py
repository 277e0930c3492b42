"""keep_freed_memory_for_reuse: applied once on glibc, skipped when the user opts out."""

import subprocess
import sys

SNIPPET = """
from shardkit.utils.cpu_allocator import keep_freed_memory_for_reuse
print(keep_freed_memory_for_reuse(), keep_freed_memory_for_reuse())
"""


def _run(env_value):
    import os
    env = dict(os.environ)
    env.pop("SHARDKIT_CPU_MALLOC", None)
    if env_value is not None:
        env["SHARDKIT_CPU_MALLOC"] = env_value
    proc = subprocess.run([sys.executable, "-c", SNIPPET], env=env, capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.split()


def test_applied_once_on_glibc():
    import platform
    expected = "True" if platform.libc_ver()[0] == "glibc" else "False"
    assert _run(None) == [expected, expected]


def test_opt_out():
    assert _run("default") == ["False", "False"]
