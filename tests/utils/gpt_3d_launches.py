"""Several command lines of examples/gpt_3d.py in one torchrun job, one after the other:
``torchrun --nproc_per_node 4 tests/utils/gpt_3d_launches.py NAME=ARGS NAME=ARGS ...`` (ARGS
the example's arguments joined by spaces). Each runs the example's own ``main(argv)``; what a
separate launch would cost again (torchrun, four torch imports, the first step's warm-up) is
paid once. tests/test_gpt_3d_example.py runs its layouts this way.

Between two command lines every rank waits at a barrier, so the ``=== NAME ...`` marker lines
that rank 0 prints split the job's output into the lines of each command line; the one after
each ends with the exit status that its ``main`` gave (0, or its ``sys.exit`` code). The
process group stays up across them (the example's ``distributed.destroy()`` is held back until
the last one): re-creating the default group in one process would reuse its store keys."""

import importlib.util
import os
import sys

EXAMPLE = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__)))), "examples", "gpt_3d.py")


def _load_example():
    spec = importlib.util.spec_from_file_location("gpt_3d_example", EXAMPLE)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _exit_status(code) -> int:
    if code is None:
        return 0
    return code if isinstance(code, int) else 1  # SystemExit("message"): status 1, as python's


def main(specs) -> int:
    example = _load_example()
    distributed = example.distributed
    destroy = distributed.destroy
    distributed.destroy = lambda: None  # held back: the next command line reuses the group
    worst = 0
    try:
        for spec in specs:
            name, _, argv = spec.partition("=")
            if distributed.is_initialized():
                distributed.barrier()
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"=== {name} start", flush=True)
            try:
                example.main(argv.split())
                status = 0
            except SystemExit as stop:
                status = _exit_status(stop.code)
                if not isinstance(stop.code, (int, type(None))):
                    print(stop.code, file=sys.stderr, flush=True)
            if distributed.is_initialized():
                distributed.barrier()
            if int(os.environ.get("RANK", "0")) == 0:
                print(f"=== {name} exit {status}", flush=True)
            worst = max(worst, status)
    finally:
        distributed.destroy = destroy
    destroy()
    return worst


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
