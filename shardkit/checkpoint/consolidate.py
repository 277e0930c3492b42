"""Consolidate a resharding checkpoint into one plain fp32 ``state_dict``.

``python -m shardkit consolidate DIR OUT.pt [--tag TAG]`` reads every rank file of the
checkpoint ``DIR/TAG`` (default: the one ``DIR/latest`` names) and writes a ``state_dict`` that
``model.load_state_dict`` of the unwrapped model accepts. Runs in one process, no process group;
memory: the full fp32 model on CPU (optimizer state is not read). Every file is checked against
the sha256 in the metadata and read with ``torch.load(weights_only=True)``: a checkpoint from
someone else cannot run code here.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

import torch

from shardkit.checkpoint.sharded import CheckpointError, read_checkpoint, resolve_checkpoint_dir

__all__ = ["consolidate_checkpoint", "main"]


def consolidate_checkpoint(checkpoint_dir: str, tag: Optional[str] = None) -> dict:
    """The full fp32 model ``state_dict`` of a checkpoint, keys in the unwrapped model's order
    as saved (sorted by name)."""
    path = resolve_checkpoint_dir(checkpoint_dir, tag)
    if path is None:
        raise CheckpointError(f"consolidate: {checkpoint_dir} has no 'latest' file; pass --tag")
    loaded = read_checkpoint(path, with_optimizer=False)
    return {name: loaded.params[name] for name in loaded.metadata["param_names"]}


def main(argv: Optional[list] = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m shardkit consolidate",
        description="Write a plain fp32 state_dict from a shardkit checkpoint directory.")
    parser.add_argument("checkpoint_dir", help="the directory given to engine.save_checkpoint")
    parser.add_argument("output", help="where to write the state_dict (torch.save)")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: 'latest')")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.checkpoint_dir):
        print(f"consolidate: {args.checkpoint_dir} is not a directory", file=sys.stderr)
        return 2
    try:
        state = consolidate_checkpoint(args.checkpoint_dir, args.tag)
    except CheckpointError as e:
        print(f"consolidate: {e}", file=sys.stderr)
        return 2
    torch.save(state, args.output)
    numel = sum(t.numel() for t in state.values())
    print(f"consolidate: wrote {len(state)} tensors ({numel} elements) to {args.output}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
