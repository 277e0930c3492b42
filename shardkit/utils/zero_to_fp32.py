"""DeepSpeed's ``deepspeed.utils.zero_to_fp32`` over shardkit's checkpoints.

A DeepSpeed user recovers a plain fp32 ``state_dict`` from a ZeRO checkpoint with
:func:`get_fp32_state_dict_from_zero_checkpoint`, :func:`load_state_dict_from_zero_checkpoint`
or :func:`convert_zero_checkpoint_to_fp32_state_dict`, or with the ``zero_to_fp32.py`` script
that ``engine.save_checkpoint`` leaves beside ``latest``::

    python zero_to_fp32.py . pytorch_model.bin          # one file (DeepSpeed before 0.15)
    python zero_to_fp32.py . out_dir/ --safe_serialization  # a directory, sharded as HF reads

The same names and arguments work here, over shardkit's own consolidation
(:func:`shardkit.checkpoint.consolidate.consolidate_checkpoint`): a checkpoint of any ZeRO stage
(0-3), any world size, with or without tensor parallelism (``TAG/mp_rank_XX``), read in one
process without ``torch.distributed``, every file checked against its sha256 and read with
``torch.load(weights_only=True)``. Memory: the full fp32 model on CPU (no optimizer state).

The state dict has ``model.state_dict()``'s semantics: a tied parameter appears under each of
its names and, for checkpoints that record ties (written by this shardkit), every name holds the
same tensor. Differences from DeepSpeed: ``load_state_dict_from_zero_checkpoint`` loads strictly
(only parameters the checkpoint left out as frozen may be missing) and checks names and shapes
before changing the model (DeepSpeed: ``strict=False``); ``max_shard_size`` needs no
``huggingface_hub``; an output path ending in ``.bin``, ``.pt``, ``.pth`` or ``.safetensors``
that is not a directory is written as one file (DeepSpeed before 0.15 took ``output_file``;
later versions make a directory of that name).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from typing import Optional, Union

import torch

from shardkit.checkpoint.consolidate import _save_atomically, consolidate_checkpoint
from shardkit.checkpoint.consolidate import is_tag_directory as _is_tag_directory
from shardkit.checkpoint.consolidate import tags_found as _tags_found
from shardkit.checkpoint.sharded import (LATEST, METADATA, RECOVERY_SCRIPT,
                                         TENSOR_PARALLEL_LAYOUT, CheckpointError,
                                         check_tag, read_latest_tag, read_metadata)

__all__ = ["get_fp32_state_dict_from_zero_checkpoint", "load_state_dict_from_zero_checkpoint",
           "convert_zero_checkpoint_to_fp32_state_dict", "main", "RECOVERY_SCRIPT",
           "write_recovery_script", "parse_shard_size", "CheckpointNotFound"]

_FILE_SUFFIXES = (".bin", ".pt", ".pth", ".safetensors")

_SCRIPT_TEXT = '''#!/usr/bin/env python
"""Recover a plain fp32 state_dict from the shardkit checkpoints in this directory.

Written by shardkit's engine.save_checkpoint, as DeepSpeed writes its zero_to_fp32.py:

    python zero_to_fp32.py . pytorch_model.bin
    python zero_to_fp32.py . output_dir/ [-t TAG] [--exclude_frozen_parameters]
                                         [--safe_serialization] [--max_shard_size 5GB]

Needs shardkit (and torch) in the Python that runs it; no process group.
"""

import sys

from shardkit.utils.zero_to_fp32 import main

if __name__ == "__main__":
    sys.exit(main())
'''


class CheckpointNotFound(CheckpointError, FileNotFoundError):
    """The checkpoint directory, its ``latest`` file or the tag's directory does not exist
    (a :class:`~shardkit.checkpoint.sharded.CheckpointError` and, as in DeepSpeed, a
    ``FileNotFoundError``)."""


def write_recovery_script(directory: str) -> str:
    """Write ``directory/zero_to_fp32.py`` (executable) through a temporary file renamed into
    place, so a reader never sees half a script. Returns its path; raises ``OSError``."""
    path = os.path.join(directory, RECOVERY_SCRIPT)
    pending = os.path.join(directory, f".{RECOVERY_SCRIPT}.tmp-{os.getpid()}")
    try:
        with open(pending, "w") as f:
            f.write(_SCRIPT_TEXT)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(pending, 0o755)
        os.replace(pending, path)
    finally:
        if os.path.exists(pending):
            os.remove(pending)
    return path


# ----------------------------------------------------------------------------- reading


def _resolve_tag(checkpoint_dir, tag, caller: str) -> str:
    """The tag to read (``tag``, else the one ``latest`` names), checked to exist: a missing
    directory, ``latest`` or tag is a :class:`CheckpointNotFound` naming it and the tags
    found."""
    if not isinstance(checkpoint_dir, (str, os.PathLike)) or not os.fspath(checkpoint_dir):
        raise TypeError(f"{caller}(checkpoint_dir={checkpoint_dir!r}): expected the directory "
                        f"given to engine.save_checkpoint (a str or os.PathLike)")
    checkpoint_dir = os.fspath(checkpoint_dir)
    if not os.path.isdir(checkpoint_dir):
        raise CheckpointNotFound(f"{caller}: checkpoint_dir {checkpoint_dir!r} is not a "
                                 f"directory")
    if _is_tag_directory(checkpoint_dir):
        parent, name = os.path.split(os.path.abspath(checkpoint_dir))
        raise CheckpointNotFound(
            f"{caller}: checkpoint_dir {checkpoint_dir!r} is the checkpoint of one tag, not "
            f"the directory given to engine.save_checkpoint; pass that directory and the "
            f"tag: checkpoint_dir={parent!r}, tag={name!r}")
    if tag is None:
        tag = read_latest_tag(checkpoint_dir)
        if tag is None:
            raise CheckpointNotFound(
                f"{caller}: no '{LATEST}' file in {checkpoint_dir!r}; pass tag= (-t) with one "
                f"of the tags found: {_tags_found(checkpoint_dir)}")
    elif isinstance(tag, bool) or not isinstance(tag, (str, int)):
        raise TypeError(f"{caller}(tag={tag!r}): expected a checkpoint tag (a str, e.g. "
                        f"'global_step14'), or None for the one '{LATEST}' names")
    tag = str(tag)  # DeepSpeed's save_checkpoint takes numbers as tags
    check_tag(tag, saving=False)
    tag_dir = os.path.join(checkpoint_dir, tag)
    if tag not in _tags_found(checkpoint_dir) and not os.path.isdir(
            os.path.join(checkpoint_dir, f".old-{tag}")):  # a re-save of tag interrupted
        raise CheckpointNotFound(f"{caller}: tag {tag!r}: {tag_dir!r} is not a complete "
                                 f"shardkit checkpoint; tags found in {checkpoint_dir!r}: "
                                 f"{_tags_found(checkpoint_dir)}")
    return tag


def _checkpoint_metadata(checkpoint_dir: str, tag: str) -> dict:
    """The metadata of the tag (a tensor-parallel checkpoint's first part's: every part lists
    the same names)."""
    tag_dir = os.path.join(checkpoint_dir, tag)
    if not os.path.isdir(tag_dir):
        tag_dir = os.path.join(checkpoint_dir, f".old-{tag}")
    if os.path.isfile(os.path.join(tag_dir, TENSOR_PARALLEL_LAYOUT)):
        tag_dir = os.path.join(tag_dir, "mp_rank_00")
    metadata = read_metadata(tag_dir)
    tied, frozen = metadata.get("tied", {}), metadata.get("frozen", [])
    if not isinstance(tied, dict) or not all(
            isinstance(k, str) and isinstance(v, str) for k, v in tied.items()) \
            or not isinstance(frozen, list) or not all(isinstance(n, str) for n in frozen):
        raise CheckpointError(f"{os.path.join(tag_dir, METADATA)}: fields 'tied' ({{alias: "
                              f"name}}) or 'frozen' (a list of names) are damaged or were "
                              f"edited")
    return metadata


def _frozen_names(metadata: dict, path: str) -> set:
    if "frozen" in metadata:
        return set(metadata["frozen"]) | set(metadata.get("excluded_frozen", []))
    if metadata.get("excluded_frozen"):
        return set(metadata["excluded_frozen"])
    raise CheckpointError(f"exclude_frozen_parameters=True: the checkpoint {path!r} does not "
                          f"record which parameters were frozen (written by an older shardkit); "
                          f"load it with exclude_frozen_parameters=False and drop them yourself")


def get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag=None,
                                             exclude_frozen_parameters: bool = False,
                                             lazy_mode: bool = False) -> dict:
    """The full fp32 ``state_dict`` of the unwrapped model from the checkpoint
    ``checkpoint_dir/tag`` (default: the tag the ``latest`` file names), as
    ``model.state_dict()`` holds it (buffers included; tied parameters under each name, the
    same tensor). ``exclude_frozen_parameters``: leave out the parameters that did not require
    grad when the checkpoint was saved. ``lazy_mode`` is accepted for DeepSpeed's signature;
    the tensors are always real CPU tensors (their ``.contiguous()`` is themselves).

    Runs in this process alone (no ``torch.distributed``); memory: the full fp32 model."""
    caller = "get_fp32_state_dict_from_zero_checkpoint"
    if not isinstance(exclude_frozen_parameters, bool):
        raise TypeError(f"{caller}(exclude_frozen_parameters={exclude_frozen_parameters!r}): "
                        f"expected True or False")
    if not isinstance(lazy_mode, bool):
        raise TypeError(f"{caller}(lazy_mode={lazy_mode!r}): expected True or False")
    tag = _resolve_tag(checkpoint_dir, tag, caller)
    checkpoint_dir = os.fspath(checkpoint_dir)
    metadata = _checkpoint_metadata(checkpoint_dir, tag)
    state = consolidate_checkpoint(checkpoint_dir, tag)
    for alias, name in metadata.get("tied", {}).items():  # model.state_dict(): one tensor
        if alias in state and name in state:
            state[alias] = state[name]
    if exclude_frozen_parameters:
        frozen = _frozen_names(metadata, os.path.join(checkpoint_dir, tag))
        state = {k: v for k, v in state.items() if k not in frozen}
    return state


def load_state_dict_from_zero_checkpoint(model: torch.nn.Module, checkpoint_dir, tag=None):
    """Move ``model`` to the CPU, load the checkpoint's fp32 weights into it and return it
    (DeepSpeed's). The names and shapes are checked before anything is loaded: a key the model
    does not have, a shape that differs, or a missing key other than a frozen parameter the
    checkpoint left out (``exclude_frozen_parameters``) is a ``RuntimeError`` naming them, the
    model unchanged. Memory: the full fp32 model twice (the state dict and the model)."""
    caller = "load_state_dict_from_zero_checkpoint"
    if not isinstance(model, torch.nn.Module):
        raise TypeError(f"{caller}(model={type(model).__name__}): expected the unwrapped "
                        f"torch.nn.Module the checkpoint was saved from")
    if getattr(model, "_zero3_placeholder_state_dict", False):
        raise RuntimeError(
            f"{caller}(model={type(model).__name__}): this is a ZeRO stage-3 engine's model "
            f"(engine.module), whose parameters are this rank's row shards and whose "
            f"state_dict() holds empty placeholders; load the checkpoint into the engine with "
            f"engine.load_checkpoint({os.fspath(checkpoint_dir)!r}), or pass a model built "
            f"like it outside the engine")
    tag = _resolve_tag(checkpoint_dir, tag, caller)
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag)
    metadata = _checkpoint_metadata(os.fspath(checkpoint_dir), tag)
    own = model.state_dict()
    missing = sorted(set(own) - set(state) - set(metadata.get("excluded_frozen", [])))
    unexpected = sorted(set(state) - set(own))
    shapes = sorted(f"{k}: checkpoint {_kind(v)}, model {_kind(own[k])}"
                    for k, v in state.items() if k in own and not _is_extra_state(k)
                    and _kind(v) != _kind(own[k]))
    if missing or unexpected or shapes:
        raise RuntimeError(f"{caller}: the checkpoint in {os.fspath(checkpoint_dir)!r} does not "
                           f"match {type(model).__name__}: missing keys {missing[:8]}, "
                           f"unexpected keys {unexpected[:8]}, shapes {shapes[:8]}; nothing "
                           f"was loaded")
    model = model.cpu()
    model.load_state_dict(state, strict=False)
    return model


def _kind(value):
    """What a state dict entry is, for comparing a checkpoint with a model: a tensor's shape,
    else its type's name."""
    return tuple(value.shape) if isinstance(value, torch.Tensor) else type(value).__name__


def _is_extra_state(key: str) -> bool:
    """Whether ``key`` holds a module's ``get_extra_state()``: any object, tensors of any
    shape included, that ``load_state_dict`` hands to ``set_extra_state`` unchecked (a dict
    there made the shape check raise AttributeError)."""
    return key.rsplit(".", 1)[-1] == "_extra_state"


# ----------------------------------------------------------------------------- writing


_UNITS = {"": 1, "B": 1, "KB": 10 ** 3, "MB": 10 ** 6, "GB": 10 ** 9, "TB": 10 ** 12,
          "KIB": 2 ** 10, "MIB": 2 ** 20, "GIB": 2 ** 30, "TIB": 2 ** 40}


def parse_shard_size(max_shard_size: Union[int, str, None]) -> Optional[int]:
    """``max_shard_size`` in bytes, as Hugging Face reads it: an int of bytes, or a string of
    digits and a unit (``"5GB"`` = 5e9 bytes, ``"500MiB"`` = 500 * 2**20); ``None``: no
    sharding. Anything else is a ValueError naming the value and the valid forms."""
    if max_shard_size is None:
        return None
    if isinstance(max_shard_size, int) and not isinstance(max_shard_size, bool) \
            and max_shard_size > 0:
        return max_shard_size
    match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B)?\s*", str(max_shard_size),
                         re.IGNORECASE) if isinstance(max_shard_size, str) else None
    size = None if match is None else \
        int(float(match.group(1)) * _UNITS[(match.group(2) or "").upper()])
    if size is None or size <= 0:  # "0.5B" is 0 bytes: one tensor per file, silently
        raise ValueError(f"max_shard_size={max_shard_size!r}: expected a positive number of "
                         f"bytes (an int) or a size such as '5GB', '500MB', '2GiB', or None "
                         f"for one file (a checkpoint tag goes by keyword: tag=...)")
    return size


def _nbytes(tensor) -> int:
    """A tensor's bytes; 0 for a module's extra state that is not a tensor (a dict)."""
    if not isinstance(tensor, torch.Tensor):
        return 0
    return tensor.numel() * tensor.element_size()


def _split_into_shards(state: dict, limit: Optional[int]) -> list:
    """Lists of names, in order, each list's tensors at most ``limit`` bytes (a larger tensor
    alone in its own), as Hugging Face cuts ``save_pretrained`` shards; a tied alias goes in the
    shard of the name it shares a tensor with and is counted once."""
    if limit is None:
        return [list(state)]
    shards, current, size, shard_of = [], [], 0, {}
    for name, tensor in state.items():
        if id(tensor) in shard_of:  # a tied alias: in its name's shard, counted there once
            shard_of[id(tensor)].append(name)
            continue
        if current and size + _nbytes(tensor) > limit:
            shards.append(current)
            current, size = [], 0
        current.append(name)
        shard_of[id(tensor)] = current
        size += _nbytes(tensor)
    if current:
        shards.append(current)
    return shards


def _safetensors_save():
    try:
        from safetensors.torch import save_file
    except ImportError as e:
        raise ImportError("safe_serialization=True needs the safetensors package (pip install "
                          "safetensors); or pass safe_serialization=False for torch.save "
                          "files") from e
    return save_file


def _write_file(tensors: dict, path: str, safe: bool) -> None:
    """Write ``tensors`` to ``path`` through a temporary file renamed into place. safetensors
    refuses tensors that share memory: tied names get their own copies there (torch.save keeps
    one storage)."""
    if not safe:
        _save_atomically(tensors, path)
        return
    seen, own = set(), {}
    for name, tensor in tensors.items():
        own[name] = tensor.contiguous() if id(tensor) not in seen else tensor.clone()
        seen.add(id(tensor))
    save_file = _safetensors_save()
    _save_atomically(own, path, lambda state, f: save_file(state, f, metadata={"format": "pt"}))


def _is_file_output(output: str) -> bool:
    return not os.path.isdir(output) and output.lower().endswith(_FILE_SUFFIXES)


def convert_zero_checkpoint_to_fp32_state_dict(checkpoint_dir, output_dir=None,
                                               max_shard_size="5GB",
                                               safe_serialization: bool = False, tag=None,
                                               exclude_frozen_parameters: bool = False,
                                               output_file=None) -> list:
    """Write the checkpoint's fp32 ``state_dict`` (see
    :func:`get_fp32_state_dict_from_zero_checkpoint`) where DeepSpeed writes it, and return the
    paths written.

    ``output_dir``: a directory (created if needed) that receives ``pytorch_model.bin`` (or
    ``model.safetensors`` with ``safe_serialization=True``), or, when the model is larger than
    ``max_shard_size`` (``"5GB"``; an int of bytes; ``None``: never cut), the shards
    ``pytorch_model-00001-of-0000N.bin`` ... and the index ``pytorch_model.bin.index.json``
    (``model.safetensors.index.json``) that Hugging Face's ``from_pretrained`` reads. A path
    ending in ``.bin``/``.pt``/``.pth``/``.safetensors`` that is not a directory, or
    ``output_file=`` (DeepSpeed's earlier keyword), is one file with the whole state dict
    (safetensors for a ``.safetensors`` name). Each file is written to a temporary name and
    renamed, the index last; shards are renamed only once all are written, after removing an
    earlier conversion's index of the same name, so a failed or killed conversion never leaves
    an index over a mix of its shards and an earlier conversion's. Nothing is written when the
    checkpoint cannot be read."""
    caller = "convert_zero_checkpoint_to_fp32_state_dict"
    if (output_dir is None) == (output_file is None):
        raise TypeError(f"{caller}: give the output directory (output_dir=) or file "
                        f"(output_file=), one of them")
    output = output_dir if output_file is None else output_file
    if not isinstance(output, (str, os.PathLike)) or not os.fspath(output):
        raise TypeError(f"{caller}(output_dir={output!r}): expected a path (a str or "
                        f"os.PathLike)")
    if not isinstance(safe_serialization, bool):
        raise TypeError(f"{caller}(safe_serialization={safe_serialization!r}): expected True "
                        f"or False")
    output = os.fspath(output)
    one_file = output_file is not None or _is_file_output(output)
    safe = safe_serialization or (one_file and output.lower().endswith(".safetensors"))
    if one_file and safe_serialization and not output.lower().endswith(".safetensors"):
        raise ValueError(f"{caller}: safe_serialization=True writes safetensors, but the output "
                         f"{output!r} is a file name not ending in .safetensors; give a "
                         f"directory or a name ending in .safetensors")
    limit = parse_shard_size(max_shard_size)  # checked for a file too: an old positional tag
    limit = None if one_file else limit
    if safe:
        _safetensors_save()  # before reading a checkpoint that could not be written
    tag = _resolve_tag(checkpoint_dir, tag, caller)  # errors name this function
    state = get_fp32_state_dict_from_zero_checkpoint(checkpoint_dir, tag,
                                                     exclude_frozen_parameters)
    objects = [k for k, v in state.items() if not isinstance(v, torch.Tensor)]
    if safe and objects:
        raise ValueError(f"{caller}: safetensors holds tensors only, and the checkpoint's "
                         f"{objects[:4]} are modules' extra state (get_extra_state) of other "
                         f"types; write torch.save files (safe_serialization=False, a .bin "
                         f"name); nothing was written")
    if one_file:
        parent = os.path.dirname(output)
        if parent:
            os.makedirs(parent, exist_ok=True)
        _write_file(state, output, safe)
        return [output]
    os.makedirs(output, exist_ok=True)
    weights = "model.safetensors" if safe else "pytorch_model.bin"
    stem, ext = os.path.splitext(weights)
    shards = _split_into_shards(state, limit)
    if len(shards) == 1:
        path = os.path.join(output, weights)
        _write_file(state, path, safe)
        _remove_stale_weights(output, [path])
        return [path]
    written, weight_map, staged = [], {}, {}
    index = os.path.join(output, f"{weights}.index.json")
    try:  # every shard under a temporary name first: a failure leaves the old files as they were
        for i, names in enumerate(shards, 1):
            file = f"{stem}-{i:05d}-of-{len(shards):05d}{ext}"
            staged[file] = os.path.join(output, f".{file}.pending-{os.getpid()}")
            _write_file({n: state[n] for n in names}, staged[file], safe)
            weight_map.update((n, file) for n in names)
        # an earlier conversion's index would name our shards among its own (same names):
        # gone before they move in, so a process killed among the renames leaves no index
        if os.path.exists(index):
            os.remove(index)
        for file, path in staged.items():
            os.replace(path, os.path.join(output, file))
            written.append(os.path.join(output, file))
    finally:
        for path in staged.values():
            if os.path.exists(path):
                os.remove(path)
    total = sum(_nbytes(t) for t in {id(t): t for t in state.values()}.values())
    _write_index(index, {"metadata": {"total_size": total}, "weight_map": weight_map})
    _remove_stale_weights(output, written + [index])
    return written + [index]


def _write_index(index: str, content: dict) -> None:
    """Write the shards' index through a temporary file renamed into place; one that cannot be
    written (a full disk) leaves no temporary file behind."""
    pending = f"{index}.tmp-{os.getpid()}"
    try:
        with open(pending, "w", encoding="utf-8") as f:
            f.write(json.dumps(content, indent=2, sort_keys=True) + "\n")
        os.replace(pending, index)
    finally:
        if os.path.exists(pending):
            os.remove(pending)


# what Hugging Face's from_pretrained reads in a directory (safetensors first, then the
# single file before its index): an earlier conversion's files would be loaded instead of ours
_WEIGHT_FILES = re.compile(r"(pytorch_model(-\d{5}-of-\d{5})?\.bin|pytorch_model\.bin\.index"
                           r"\.json|model(-\d{5}-of-\d{5})?\.safetensors|model\.safetensors"
                           r"\.index\.json)")


_STAGED = re.compile(r"\.(.+)\.pending-\d+(\.tmp-\d+)?")


def _remove_stale_weights(output: str, written: list) -> None:
    """Delete the weight files and indexes an earlier conversion left in ``output`` that this
    one did not write (after ours are in place), so ``from_pretrained`` reads ours."""
    keep = {os.path.basename(path) for path in written}
    for name in os.listdir(output):
        # and the shards a killed conversion staged (.NAME.pending-PID[.tmp-PID]), full size
        staged = _STAGED.fullmatch(name)
        if name not in keep and (_WEIGHT_FILES.fullmatch(name) or (
                staged and _WEIGHT_FILES.fullmatch(staged.group(1)))) \
                and os.path.isfile(os.path.join(output, name)):
            os.remove(os.path.join(output, name))


# ----------------------------------------------------------------------------- CLI


def main(argv: Optional[list] = None) -> int:
    """DeepSpeed's ``zero_to_fp32.py`` command line (what the script written beside the
    checkpoints runs). Returns the exit status: 0, or 2 with the reason on stderr."""
    parser = argparse.ArgumentParser(
        prog="zero_to_fp32.py",
        description="Write a plain fp32 state_dict from the shardkit checkpoints in a directory.")
    parser.add_argument("checkpoint_dir", help="the directory given to engine.save_checkpoint "
                        "(the one holding 'latest'), e.g. '.'")
    parser.add_argument("output_dir", help="a directory for pytorch_model.bin / "
                        "model.safetensors (sharded by --max_shard_size), or one file name "
                        "ending in .bin, .pt, .pth or .safetensors")
    parser.add_argument("--max_shard_size", default="5GB", help="largest shard, e.g. 5GB, "
                        "500MB, 2GiB (default 5GB)")
    parser.add_argument("--safe_serialization", action="store_true",
                        help="write safetensors rather than torch.save pickles")
    parser.add_argument("-t", "--tag", default=None, help="checkpoint tag, e.g. global_step14 "
                        "(default: the one 'latest' names)")
    parser.add_argument("--exclude_frozen_parameters", action="store_true",
                        help="leave out parameters that did not require grad")
    parser.add_argument("-d", "--debug", action="store_true", help="accepted (DeepSpeed's)")
    args = parser.parse_args(argv)
    try:
        written = convert_zero_checkpoint_to_fp32_state_dict(
            args.checkpoint_dir, args.output_dir, max_shard_size=args.max_shard_size,
            safe_serialization=args.safe_serialization, tag=args.tag,
            exclude_frozen_parameters=args.exclude_frozen_parameters)
    except (CheckpointError, OSError, ValueError, TypeError, ImportError) as e:
        print(f"zero_to_fp32: {e}", file=sys.stderr)
        return 2
    print(f"zero_to_fp32: wrote {', '.join(written)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
