"""``python -m shardkit COMMAND``: the command-line entry points.

Commands:
    bench        shardkit's wrappers against torch's, timed in one run (source checkout only)
    cluster      run a torchrun job on a simulated multi-node cluster (network namespaces)
    consolidate  write a plain fp32 state_dict from a shardkit.initialize checkpoint
    demo         multi-process CPU training that shows what each wrapper saves and costs
    plan         per-rank memory of ZeRO stages 0-3 for a parameter count or a model
"""

from __future__ import annotations

import argparse
import sys


def main(argv: list[str] | None = None) -> int:
    """Dispatch ``python -m shardkit COMMAND ...`` to the command's module; returns its exit
    code."""
    argv = list(sys.argv[1:] if argv is None else argv)
    commands = {"demo": "shardkit.demo", "plan": "shardkit.plan", "cluster": "shardkit.cluster",
                "consolidate": "shardkit.checkpoint.consolidate", "bench": "benchmarks.run"}
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in commands:
        parser = argparse.ArgumentParser(
            prog="python -m shardkit", description=__doc__.split("\n\n", 1)[1].strip(),
            formatter_class=argparse.RawDescriptionHelpFormatter,
            epilog="`python -m shardkit COMMAND --help` shows a command's options.")
        parser.add_argument("command", choices=sorted(commands))
        if not argv or argv[0] in ("-h", "--help"):
            parser.print_help()
            return 0
        parser.print_usage(sys.stderr)
        print(f"python -m shardkit: unknown command {argv[0]!r}; valid commands are "
              f"{sorted(commands)}", file=sys.stderr)
        return 2
    import importlib
    if argv[0] == "bench" and not _benchmarks_importable():
        print("python -m shardkit bench: the benchmarks ship with shardkit's source checkout, "
              "not with the installed package; run it from the repository root (where "
              "benchmarks/run.py is), e.g. `python -m shardkit bench --quick`", file=sys.stderr)
        return 2
    return importlib.import_module(commands[argv[0]]).main(argv[1:])


def _benchmarks_importable() -> bool:
    """Whether ``benchmarks.run`` (the repository's benchmark runner) can be imported here."""
    import importlib.util
    try:
        return importlib.util.find_spec("benchmarks.run") is not None
    except ModuleNotFoundError:
        return False


if __name__ == "__main__":
    sys.exit(main())
