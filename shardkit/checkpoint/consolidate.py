"""Consolidate a resharding checkpoint into one plain fp32 ``state_dict``.

``python -m shardkit consolidate DIR OUT.pt [--tag TAG]`` reads every rank file of the
checkpoint ``DIR/TAG`` (default: the one ``DIR/latest`` names) and writes a ``state_dict`` that
``model.load_state_dict`` of the unwrapped model accepts. Runs in one process, no process group;
memory: the full fp32 model on CPU (optimizer state is not read). Every file is checked against
the sha256 in the metadata and read with ``torch.load(weights_only=True)``: a checkpoint from
someone else cannot run code here.

With ``--hf-config CONFIG`` (a Hugging Face ``config.json`` or the directory holding it) the
output is instead a directory written by ``save_pretrained`` (safetensors weights and the
config): the model class (``--hf-model-class``, else the config's ``architectures[0]``, else
``AutoModelForCausalLM``) is built from the config, loads the state dict with ``strict=True``
and saves itself, tied weights once. Memory: the full fp32 model twice (state dict and model).

A checkpoint of a tensor-parallel engine (``initialize(mpu=...)``: ``TAG/mp_rank_XX`` and
``TAG/tensor_parallel.json``) consolidates to the unsplit model: each ``mp_rank_XX`` part is
read as above and every split parameter joined along its split dimension.
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import Optional

import torch

from shardkit.checkpoint.file_writes import save_torch_file
from shardkit.checkpoint.sharded import (LATEST, METADATA, TENSOR_PARALLEL_LAYOUT,
                                         CheckpointError, read_checkpoint, read_latest_tag,
                                         resolve_checkpoint_dir)

__all__ = ["consolidate_checkpoint", "save_hf_pretrained", "main", "tags_found",
           "is_tag_directory"]


def consolidate_checkpoint(checkpoint_dir: str, tag: Optional[str] = None) -> dict:
    """The full fp32 model ``state_dict`` of a checkpoint, keys in the unwrapped model's order
    as saved (sorted by name). A tensor-parallel engine's checkpoint (``TAG/mp_rank_XX``) gives
    the unsplit model: each rank's slices joined as its ``tensor_parallel.json`` says."""
    from shardkit.model_parallel_unit import read_tensor_parallel_layout
    resolved = tag if tag is not None else read_latest_tag(checkpoint_dir)
    layout = None if resolved is None else \
        read_tensor_parallel_layout(os.path.join(checkpoint_dir, resolved))
    if layout is not None:
        return _joined_tensor_parallel_state(os.path.join(checkpoint_dir, resolved), *layout)
    path = resolve_checkpoint_dir(checkpoint_dir, tag)
    if path is None:
        raise CheckpointError(_no_latest_message(checkpoint_dir))
    return _plain_state(path)


def _no_latest_message(checkpoint_dir: str) -> str:
    """Why ``checkpoint_dir`` names no checkpoint, and what to give instead: for one tag's own
    directory (the easy slip: ``consolidate ckpt/global_step100``) its parent and tag, else
    the tags present, if any."""
    if is_tag_directory(checkpoint_dir):
        parent, tag = os.path.split(os.path.normpath(checkpoint_dir))
        return (f"consolidate: {checkpoint_dir} is one checkpoint's own directory, not the "
                f"directory given to save_checkpoint: pass {parent or '.'} with --tag {tag}")
    tags = tags_found(checkpoint_dir)
    if tags:
        return (f"consolidate: {checkpoint_dir} has no 'latest' file; pass --tag (checkpoints "
                f"there: {', '.join(tags)})")
    return (f"consolidate: {checkpoint_dir} holds no checkpoint written by "
            f"engine.save_checkpoint (no 'latest' file, no tag directory with {METADATA})")


def tags_found(checkpoint_dir: str) -> list:
    """The tags in ``checkpoint_dir`` that hold a complete checkpoint (tensor-parallel ones
    included). Reads the directory listing only."""
    if not os.path.isdir(checkpoint_dir):
        return []
    return sorted(d for d in os.listdir(checkpoint_dir) if not d.startswith(".") and any(
        os.path.isfile(os.path.join(checkpoint_dir, d, f))
        for f in (METADATA, TENSOR_PARALLEL_LAYOUT)))


def is_tag_directory(path: str) -> bool:
    """Whether ``path`` is itself one tag's checkpoint (``DIR/TAG``, what users pass by
    mistake for ``DIR``): its files, and no ``latest`` beside them."""
    return not os.path.isfile(os.path.join(path, LATEST)) and any(
        os.path.isfile(os.path.join(path, f)) for f in (METADATA, TENSOR_PARALLEL_LAYOUT))


def _plain_state(path: str) -> dict:
    loaded = read_checkpoint(path, with_optimizer=False)
    return {name: loaded.params[name] for name in loaded.metadata["param_names"]}


def _joined_tensor_parallel_state(tag_dir: str, size: int, splits: dict) -> dict:
    """Every ``mp_rank_XX`` part consolidated, split parameters joined (memory: the full model
    plus one tensor-parallel rank's part)."""
    from shardkit.nn.model_parallel.utils import join_shards
    parts = []
    for rank in range(size):
        part = os.path.join(tag_dir, f"mp_rank_{rank:02d}")
        if not os.path.isdir(part):
            raise CheckpointError(f"consolidate: {tag_dir} was written at tensor-parallel size "
                                  f"{size} but has no {os.path.basename(part)}")
        parts.append(_plain_state(part))
    return {name: join_shards([p[name] for p in parts], *splits[name]) if name in splits
            else tensor for name, tensor in parts[0].items()}


def save_hf_pretrained(state: dict, hf_config: str, output_dir: str,
                       model_class: Optional[str] = None):
    """Build the Hugging Face model of ``hf_config`` (a ``config.json`` path or its directory),
    load ``state`` into it with ``strict=True`` and ``save_pretrained(output_dir)``
    (safetensors). Returns the model. Needs ``transformers``; reads nothing from the network.

    ``model_class``: a class name in ``transformers`` (e.g. ``"LlamaForCausalLM"``); default the
    config's ``architectures[0]``, else ``AutoModelForCausalLM``.
    """
    try:
        import transformers
    except ImportError as e:
        raise CheckpointError("consolidate --hf-config needs the transformers package "
                              "(pip install transformers)") from e
    if not os.path.exists(hf_config):
        raise CheckpointError(f"consolidate --hf-config {hf_config}: no such file or directory")
    config_dir = hf_config if os.path.isdir(hf_config) else os.path.dirname(hf_config) or "."
    source = hf_config if os.path.isfile(hf_config) and \
        os.path.basename(hf_config) != "config.json" else config_dir
    try:
        config = transformers.AutoConfig.from_pretrained(source, local_files_only=True)
    except (OSError, ValueError) as e:
        raise CheckpointError(f"consolidate --hf-config {hf_config}: no usable Hugging Face "
                              f"config there ({e}); give the folder holding the model's "
                              f"config.json, or that file") from e
    name = model_class or ((getattr(config, "architectures", None) or [None])[0])
    if name is None:
        model = transformers.AutoModelForCausalLM.from_config(config)
    else:
        cls = getattr(transformers, name, None)
        if cls is None:
            raise CheckpointError(f"consolidate --hf-model-class {name}: transformers has no "
                                  f"class of that name (e.g. LlamaForCausalLM, GPT2LMHeadModel)")
        model = cls(config)
    try:
        model.load_state_dict(state, strict=True)
    except RuntimeError as e:
        raise CheckpointError(f"consolidate: the checkpoint does not match "
                              f"{type(model).__name__} built from {hf_config}: {e}") from e
    model.save_pretrained(output_dir)
    return model


def main(argv: Optional[list] = None) -> int:
    """``python -m shardkit consolidate``: write a checkpoint directory's plain fp32 state
    dict (``torch.save``, or a Hugging Face folder with ``--hf-config``); returns the exit
    status. Memory: the full fp32 model on CPU. No communication (one process)."""
    parser = argparse.ArgumentParser(
        prog="python -m shardkit consolidate",
        description="Write a plain fp32 state_dict from a shardkit checkpoint directory.")
    parser.add_argument("checkpoint_dir", help="the directory given to engine.save_checkpoint")
    parser.add_argument("output", help="where to write the state_dict (torch.save), or the "
                        "save_pretrained directory with --hf-config")
    parser.add_argument("--tag", default=None, help="checkpoint tag (default: 'latest')")
    parser.add_argument("--hf-config", default=None, help="a Hugging Face config.json (or its "
                        "directory): write OUTPUT as a save_pretrained directory (safetensors)")
    parser.add_argument("--hf-model-class", default=None, help="transformers class to build "
                        "(default: the config's architectures[0], else AutoModelForCausalLM)")
    args = parser.parse_args(argv)
    if not os.path.isdir(args.checkpoint_dir):
        print(f"consolidate: {args.checkpoint_dir} is not a directory", file=sys.stderr)
        return 2
    try:
        state = consolidate_checkpoint(args.checkpoint_dir, args.tag)
        numel = sum(t.numel() for t in state.values() if isinstance(t, torch.Tensor))
        if args.hf_config is not None:
            model = save_hf_pretrained(state, args.hf_config, args.output, args.hf_model_class)
            print(f"consolidate: wrote {type(model).__name__} ({len(state)} tensors, {numel} "
                  f"elements) with save_pretrained to {args.output}")
            return 0
    except CheckpointError as e:
        message = str(e)  # most already say "consolidate: ..."; say it once
        print(message if message.startswith("consolidate") else f"consolidate: {message}",
              file=sys.stderr)
        return 2
    try:
        _save_atomically(state, args.output)
    except (OSError, RuntimeError) as e:  # torch.save reports a missing directory as the latter
        print(f"consolidate: cannot write {args.output} ({type(e).__name__}: {e}); nothing was "
              f"written there", file=sys.stderr)
        return 2
    print(f"consolidate: wrote {len(state)} tensors ({numel} elements) to {args.output}")
    return 0


def _save_atomically(state: dict, output: str, save=save_torch_file) -> None:
    """``save(state, path)`` (``torch.save`` by default, a full disk an ``OSError`` naming
    it) into a temporary file beside ``output``, then rename it: a full disk or a killed
    process never leaves a truncated ``output``."""
    pending = f"{output}.tmp-{os.getpid()}"
    try:
        save(state, pending)
        os.replace(pending, output)
    finally:
        if os.path.exists(pending):
            os.remove(pending)


if __name__ == "__main__":
    sys.exit(main())
