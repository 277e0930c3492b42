"""On-disk layout of a resharding checkpoint, its atomic commit, and reading it back.

Layout (``DIR`` is the save directory, ``TAG`` one checkpoint)::

    DIR/latest                 text: the tag of the newest complete checkpoint
    DIR/zero_to_fp32.py        engine saves: DeepSpeed's recovery script (shardkit.utils)
    DIR/TAG/metadata.json      rank 0: format, world size, stage, counters, who holds which name
    DIR/TAG/engine.pt          rank 0: optimizer param groups, scheduler, loss scaler, client state
    DIR/TAG/rank_00003.pt      rank 3: {"params": {name: fp32}, "optim": {name: state},
                                        "row_blocks": {name: block}, "rng": ...}

The stored form does not depend on the world size or the ZeRO stage that wrote it. A parameter
is stored under its name in the unwrapped model, in fp32, with its optimizer state beside it,
either whole in exactly one rank file (``params``), or, when it was sharded on dim 0 across the
ranks that wrote it (FSDP), as every rank's block of rows (``row_blocks``, and row blocks of
its optimizer state), which :func:`read_checkpoint` joins to the full shape listed in the
metadata (``row_sharded``) with :mod:`shardkit.checkpoint.resharding`, the cut FSDP itself
uses. Loading at another world size or stage only needs a different split of the same full
tensors; a reader that is itself row sharded (ZeRO-3) passes ``keep_rows`` and keeps, from each
file as it is read, only its own row block of each tensor, never the full tensors.

Safety: every file is read with ``torch.load(weights_only=True)`` (tensors, numbers, strings and
plain containers only; RNG states are stored as tensors), so a crafted checkpoint cannot run code
when loaded, and ``metadata.json`` lists each file's size and sha256 (``files``), checked before
the file is unpickled: a truncated or altered file is a :class:`CheckpointError` naming the
file and what is wrong, never a pickle traceback.

Atomicity: ranks write into ``DIR/.tmp-TAG``; the ranks then agree (one all-reduce) that every
file is complete; rank 0 writes the metadata, renames the directory to ``DIR/TAG`` and finally
replaces ``DIR/latest`` with ``os.replace``. A save that fails or is killed at any point leaves
``latest`` naming the previous complete checkpoint; a failure on any one rank, from building its
part (rank 0's scheduler state) to publishing, raises a :class:`CheckpointError` on every rank,
none waiting in a collective for it, and so does a rank dying mid-save on the ranks left (rank 0
then removes the staging directory). What a killed save leaves (``.tmp-TAG``, or a retired
``.old-TAG`` beside its published re-save: :func:`abandoned_saves`) is named by a warning when the
directory is loaded, and removed by the next save into it. A staging directory carries an owner
marker (:mod:`shardkit.checkpoint.save_owner`) and counts as abandoned only once its owner
provably no longer runs, so a save of another job into the same directory is never removed
under it. A shared filesystem is assumed across nodes.
"""

from __future__ import annotations

import collections
import contextlib
import hashlib
import io
import json
import os
import pickle
import re
import shutil
import sys
import threading
import warnings
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch

from shardkit import distributed
from shardkit.checkpoint.file_writes import save_torch_file
from shardkit.checkpoint.optimizer_state import ELEMENTWISE_STATE, per_element
from shardkit.checkpoint.resharding import (ParamLayout, copy_rows_into, join_row_blocks,
                                            join_row_state)
from shardkit.checkpoint.save_owner import (LOCK_FILE, OWNER_FILE, create_owned_dir,
                                            describe_owner, is_private_name, is_this_process,
                                            owner_is_gone, read_owner, release_owned_dir)

__all__ = ["FORMAT", "CheckpointError", "RankShard", "LoadedCheckpoint", "RowsWanted",
           "commit_checkpoint", "agreement_device", "read_latest_tag", "write_latest_tag",
           "read_checkpoint", "rank_file_name", "resolve_checkpoint_dir", "check_tag",
           "load_checkpoint_file", "file_digest", "plain_numbers", "check_loads_back",
           "abandoned_saves", "remove_own_staging", "remove_abandoned_parts"]

FORMAT = "shardkit-resharding-v1"
LATEST = "latest"
METADATA = "metadata.json"
# in a tensor-parallel checkpoint's TAG directory: how the mp_rank_XX slices join
TENSOR_PARALLEL_LAYOUT = "tensor_parallel.json"
ENGINE_FILE = "engine.pt"
DIGEST_SUFFIX = ".sha256"  # a rank's checksum of its file, folded into the metadata by rank 0


class CheckpointError(RuntimeError):
    """A checkpoint could not be written or read; the message says which file and why."""


@dataclass
class RankShard:
    """What one rank writes: whole fp32 tensors by name, optimizer state by name, RNG."""

    params: dict = field(default_factory=dict)
    optim: dict = field(default_factory=dict)
    row_blocks: dict = field(default_factory=dict)
    rng: dict = field(default_factory=dict)


@dataclass
class LoadedCheckpoint:
    """Every rank file merged: the world-size-independent state of a checkpoint.

    ``params``/``optim`` hold full tensors, except for the names a ``keep_rows`` reader asked
    rows of: there they hold that reader's padded row block. ``shapes`` is the full saved
    shape of every tensor read, by name (also of those whose rows could not be kept because the
    shape is not the reader's)."""

    path: str
    metadata: dict
    params: dict
    optim: dict
    rng_by_rank: dict
    engine: dict
    shapes: dict = field(default_factory=dict)


RowsWanted = Callable[[str], Optional[tuple]]
"""``name -> (ParamLayout, rank)``: keep only ``rank``'s padded row block of that tensor when
cut as ``layout`` says (the full shape and the reader's world size); ``None``: keep it whole."""


def rank_file_name(rank: int) -> str:
    """The name of rank ``rank``'s file inside a checkpoint directory."""
    return f"rank_{rank:05d}.pt"


def _write_rank_file(path: str, shard: RankShard) -> None:
    """Write one rank's shard (a separate function so tests can inject a crash here); a full
    disk is an ``OSError`` naming it and the file."""
    save_torch_file({"params": shard.params, "optim": shard.optim,
                     "row_blocks": shard.row_blocks, "rng": shard.rng}, path)


def _fsync(path: str) -> None:
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def file_digest(path: str) -> dict:
    """``{"bytes": size, "sha256": hex}`` of the file at ``path`` (reads it once)."""
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
            size += len(block)
    return {"bytes": size, "sha256": h.hexdigest()}


def _write_rank_file_and_digest(path: str, shard: RankShard) -> None:
    _write_rank_file(path, shard)
    with open(path + DIGEST_SUFFIX, "w") as f:
        json.dump(file_digest(path), f)


def staging_dir(save_dir: str, tag: str) -> str:
    """The hidden directory the ranks write checkpoint ``tag`` into before it is published."""
    return os.path.join(save_dir, f".tmp-{tag}")


def commit_checkpoint(save_dir: str, tag: str, shard: RankShard,
                      metadata: Optional[dict], engine_payload: Optional[dict],
                      save_latest: bool = True, group=None,
                      prepare_error: Optional[BaseException] = None,
                      recovery_script_dir: Optional[str] = None) -> str:
    """Write this rank's shard and, on rank 0, the metadata; then publish atomically.

    Must be called on every rank (``metadata``/``engine_payload`` are used on rank 0 only),
    also by a rank that failed to build its part: it passes that exception as
    ``prepare_error``, and every rank then raises before anything is written (rather than the
    others waiting for it in the first agreement).
    Communication: one barrier and three one-element all-reduces (one more barrier on
    failure), on ``group`` (default: the default group; an asynchronous save passes its own,
    so that its agreement never interleaves with the training loop's collectives). Raises
    :class:`CheckpointError` on every rank if any rank failed; ``latest`` is then untouched.
    ``recovery_script_dir`` (the engine's, on the rank that writes it): rank 0 writes
    DeepSpeed's ``zero_to_fp32.py`` there while publishing, before ``latest`` moves; failing
    to is a failed save like any other.
    """
    check_tag(tag)
    rank = distributed.get_rank(group)  # files are numbered within the group that writes them
    staging = staging_dir(save_dir, tag)
    published = []  # rank 0 notes here that it published (before the last agreement)
    made = []  # rank 0 notes here that it made the staging directory (see _commit)
    with _staging_in_use(staging):  # until ownership ends: another commit may then take it
        try:
            return _commit(save_dir, tag, shard, metadata, engine_payload, save_latest, group,
                           prepare_error, recovery_script_dir, rank, published, made)
        except CheckpointError:
            raise
        except Exception as error:  # the agreement itself broke off: a rank died, a group went
            if made and not published:
                remove_own_staging(staging)
            raise CheckpointError(
                f"save_checkpoint of {os.path.join(save_dir, tag)} failed: the ranks' "
                f"agreement broke off ({type(error).__name__}: {_first_words(error)}), e.g. "
                f"another rank died mid-save; {_outcome(save_dir, rank, published)}") from error
        finally:
            if made:  # only the commit that made it owns it: a refused one leaves it held
                release_owned_dir(staging)


def _first_words(error: BaseException, limit: int = 300) -> str:
    """``error``'s first line, cut within ``limit`` characters (at a word boundary when one is
    near the cut, else mid-word; an ellipsis marks the cut): the whole error stays attached as
    the cause."""
    line = (str(error).splitlines() or [""])[0]
    if len(line) <= limit:
        return line
    cut = line[:limit]
    space = cut.rfind(" ")
    return (cut[:space] if space >= limit - 40 else cut) + " ..."


def _outcome(save_dir: str, rank: int, published: list) -> str:
    """What a rank can tell of a save whose agreement broke off: rank 0 knows whether it
    published; another rank does not (rank 0 may have published, then died before the last
    agreement)."""
    if published:
        return "rank 0 had published it"
    if rank == 0:
        return "'latest' still names the previous checkpoint"
    return (f"rank 0 may have published it before the agreement broke off: "
            f"{os.path.join(save_dir, LATEST)} names the last complete checkpoint")


def _commit(save_dir, tag, shard, metadata, engine_payload, save_latest, group, prepare_error,
            recovery_script_dir, rank, published, made) -> str:
    """:func:`commit_checkpoint`'s agreements and writes. Only the commit that made the
    staging directory removes it on failure: one refused because another save of this
    process writes into it must leave it alone."""
    final = os.path.join(save_dir, tag)
    staging = staging_dir(save_dir, tag)
    error = prepare_error
    if error is None and rank == 0:
        whole_world = distributed.get_world_size(group) == distributed.get_world_size()
        error = _attempt(lambda: _make_staging(save_dir, staging, whole_world))
        if error is None:
            made.append(staging)
    _agree_or_raise(error, "building this rank's part of the checkpoint"
                    if prepare_error is not None
                    else f"building each rank's part and creating {staging}", made, group)
    error = _attempt(lambda: _write_rank_file_and_digest(
        os.path.join(staging, rank_file_name(rank)), shard))
    _agree_or_raise(error, f"writing the ranks' files into {staging}", made, group)
    error = None
    if rank == 0:
        error = _attempt(lambda: _publish(save_dir, tag, staging, final, metadata,
                                          engine_payload, save_latest, recovery_script_dir))
        if error is None:
            published.append(final)
    _agree_or_raise(error, f"publishing {final}", made, group)
    distributed.barrier(group)
    return final


def plain_numbers(value):
    """``value`` with every NumPy scalar (an ``np.float64`` learning rate from a schedule
    computed with NumPy) replaced by the Python number it holds, inside dicts, lists and
    tuples; the safe loader (``weights_only=True``) refuses NumPy scalars. Other values are
    returned as they are (no copy of tensors)."""
    numpy = sys.modules.get("numpy")
    if numpy is not None and isinstance(value, numpy.generic):
        return value.item()
    if type(value) in (dict, OrderedDict):
        return type(value)((k, plain_numbers(v)) for k, v in value.items())
    if type(value) in (list, tuple):
        return type(value)(plain_numbers(v) for v in value)
    return value


def check_loads_back(payload: dict, caller: str) -> None:
    """A TypeError naming the first entry of ``payload`` that ``torch.load(weights_only=True)``
    would refuse (a checkpoint that saves but can never be loaded). Local; memory: one
    serialized copy of ``payload``."""
    if _load_back_error(payload) is None:
        return
    for key, value in payload.items():
        error = _load_back_error({key: value})
        if error is not None:
            raise TypeError(f"{caller}: the {key} state ({type(value).__name__}) would not load "
                            f"back: {error}. Checkpoints are read with torch.load("
                            f"weights_only=True): tensors, numbers, strings, bools, None and "
                            f"lists/tuples/dicts of them; nothing was written")


def _load_back_error(obj) -> Optional[str]:
    buffer = io.BytesIO()
    try:
        torch.save(obj, buffer)
        buffer.seek(0)
        torch.load(buffer, weights_only=True)
    except Exception as error:  # a pickling error or the safe loader's refusal
        refused = re.search(r"GLOBAL ([\w.]+)", str(error))
        if refused:
            return f"the safe loader refuses {refused.group(1)}"
        return f"{type(error).__name__}: {str(error).splitlines()[0][:200]}"
    return None


def _make_staging(save_dir: str, staging: str, whole_world: bool) -> None:
    """Rank 0: an empty staging directory holding this process's owner marker (a ``save_dir``
    that is a file or cannot be written to fails here, and every rank then raises rather than
    waiting for rank 0). First it removes what crashed saves left in ``save_dir``
    (:func:`abandoned_saves`), with a warning naming it: a save by the whole world all of it; a
    save by a sub-group (tensor parallelism: the groups stage their ``mp_rank_XX`` parts side
    by side) only the staging directories whose owner provably ended, and its own tag's
    retired copy. A staging directory of the same tag still being written by another save is
    an error naming its owner, never removed."""
    os.makedirs(save_dir, exist_ok=True)
    tag = os.path.basename(staging)[len(".tmp-"):]
    _remove_abandoned_saves(save_dir, proven_only=not whole_world, own_tag=tag)
    _clear_own_staging(staging, tag)
    try:
        create_owned_dir(staging)
    except FileExistsError:
        raise _staging_taken(staging, tag, read_owner(staging)) from None
    except OSError as error:
        if os.path.isdir(staging):  # created meanwhile by another save (not empty)
            raise _staging_taken(staging, tag, read_owner(staging)) from None
        raise error


def _clear_own_staging(staging: str, tag: str) -> None:
    """Remove ``staging`` (this save's) when an earlier save of ``tag`` left it; raise when a
    save still under way writes into it (another job's, or another of this process)."""
    if not os.path.lexists(staging):
        return
    with _staging_lock:
        others_here = _stagings_under_way[_same_place(staging)] > 1
    owner = read_owner(staging)
    if others_here or not _is_abandoned_staging(staging, owner):
        raise _staging_taken(staging, tag, owner)
    shutil.rmtree(staging, ignore_errors=True)


def remove_own_staging(staging: str) -> None:
    """Remove the staging directory of a failed save, if this process created it (not when the
    save failed because another save owns it)."""
    if is_this_process(read_owner(staging)):
        release_owned_dir(staging)
        shutil.rmtree(staging, ignore_errors=True)


def _staging_taken(staging: str, tag: str, owner: Optional[dict]) -> CheckpointError:
    return CheckpointError(
        f"{staging}: another save of tag {tag!r} is writing into it "
        f"({describe_owner(owner, staging)}; not provably ended: see "
        f"shardkit.checkpoint.save_owner); two saves of one tag into one directory would "
        f"overwrite each other. Save under another tag or directory, wait for that save to "
        f"end, or, if it is dead, remove {staging}")


def _is_abandoned_staging(path: str, owner: Optional[dict]) -> bool:
    """Whether staging directory ``path``, not a save of this process under way, was left by
    a save that ended: its marker's process provably no longer runs, or it is this process
    (whose saves under way are registered), or it has no marker (written by a shardkit from
    before the markers: every staging directory is now born with its marker)."""
    if owner is None:
        return True
    return is_this_process(owner) or owner_is_gone(owner, path)


def abandoned_saves(save_dir: str, proven_only: bool = False,
                    own_tag: Optional[str] = None) -> list:
    """The directories in ``save_dir`` that a save killed before it ended left behind: a
    staging directory ``.tmp-TAG`` (ranks' files, never published) whose owner provably no
    longer runs (:func:`_is_abandoned_staging`), and a retired copy ``.old-TAG`` whose re-save
    did publish ``TAG`` (without ``TAG`` the retired copy is the checkpoint, and is kept). Only
    directories holding nothing but the files a save writes count (a user's own ``.tmp-cache``
    is not a save's), and the staging directories of this process's saves still under way (an
    asynchronous one, say) are not among them. ``proven_only``: only staging directories with
    an owner marker, and only ``own_tag``'s retired copy. Sorted paths; reads the directory
    listings and the owner markers."""
    if not os.path.isdir(save_dir):
        return []
    names = sorted(os.listdir(save_dir))
    with _staging_lock:  # read after the listing: a commit registers before it creates its dir
        under_way = set(_stagings_under_way)
    found = []
    for name in names:
        path = os.path.join(save_dir, name)
        if not os.path.isdir(path) or os.path.islink(path) or _same_place(path) in under_way \
                or not _holds_only_checkpoint_files(path):
            continue
        if _is_tag_after(".tmp-", name):
            if _is_left_staging(path, proven_only):
                found.append(path)
        elif _is_tag_after(".old-", name) and (not proven_only or name == f".old-{own_tag}") \
                and os.path.isfile(os.path.join(save_dir, name[len(".old-"):], METADATA)):
            found.append(path)
    return found


def _is_left_staging(path: str, proven_only: bool) -> bool:
    """Whether ``path``, a ``.tmp-`` directory not registered as a save of this process under
    way, is a staging directory a save left behind (:func:`abandoned_saves`). A staging
    directory still being created under its private name (:func:`create_owned_dir`, of this
    process or another) is left only once its marker's owner provably ended: it is not
    registered, and holds no marker for a moment."""
    owner = read_owner(path)
    if is_private_name(os.path.basename(path)):
        return bool(owner) and owner_is_gone(owner, path)
    return (owner is not None or not proven_only) and _is_abandoned_staging(path, owner)


_CHECKPOINT_FILE = re.compile(r"(rank_\d{5,}\.pt(%s)?|%s|%s|%s|%s)" % (
    re.escape(DIGEST_SUFFIX), re.escape(ENGINE_FILE), re.escape(METADATA), re.escape(OWNER_FILE),
    re.escape(LOCK_FILE)))


def _holds_only_checkpoint_files(path: str) -> bool:
    """Whether every entry of directory ``path`` is a plain file a save writes into its staging
    directory (rank files, their checksums, the engine file, the metadata)."""
    try:
        entries = list(os.scandir(path))
    except OSError:
        return False
    return all(entry.is_file(follow_symlinks=False) and _CHECKPOINT_FILE.fullmatch(entry.name)
               for entry in entries)


def _is_tag_after(prefix: str, name: str) -> bool:
    """Whether ``name`` is ``prefix`` followed by a name :func:`check_tag` takes."""
    if not name.startswith(prefix):
        return False
    try:
        check_tag(name[len(prefix):], saving=False)
    except CheckpointError:
        return False
    return True


def _same_place(path: str) -> str:
    """``path`` resolved (absolute, symbolic links followed), so that one directory named
    relatively, absolutely or through a link compares equal."""
    return os.path.realpath(path)


# The staging directories (resolved) of this process's commits in progress, synchronous or
# asynchronous (a background save's thread commits while the training loop may save again,
# e.g. with a second engine, into the same directory): never taken for abandoned.
_stagings_under_way: collections.Counter = collections.Counter()
_staging_lock = threading.Lock()


@contextlib.contextmanager
def _staging_in_use(staging: str):
    """Mark ``staging`` as a commit's own for the block (it is registered before it exists).
    The commit that made it releases its ownership (:func:`commit_checkpoint`), not this
    block: a commit refused because another of this process writes ``staging`` also ends
    here."""
    key = _same_place(staging)
    with _staging_lock:
        _stagings_under_way[key] += 1
    try:
        yield
    finally:
        with _staging_lock:
            _stagings_under_way[key] -= 1
            if not _stagings_under_way[key]:
                del _stagings_under_way[key]


def _remove_abandoned_saves(save_dir: str, proven_only: bool = False,
                            own_tag: Optional[str] = None) -> None:
    """Remove :func:`abandoned_saves` of ``save_dir``, warning with their names. A staging
    directory's owner is checked again just before it is removed."""
    leftovers = [path for path in abandoned_saves(save_dir, proven_only, own_tag)
                 if not os.path.basename(path).startswith(".tmp-")
                 or _is_left_staging(path, proven_only)]
    for path in leftovers:
        shutil.rmtree(path, ignore_errors=True)
    if leftovers:
        warnings.warn(f"save_checkpoint: removed {_names(leftovers)} from {save_dir}: what "
                      f"earlier saves left when they were killed midway (never named by "
                      f"'latest')", stacklevel=2)


def remove_abandoned_parts(parent_dir: str, part: str) -> None:
    """For saves that write part ``part`` of each checkpoint into ``parent_dir/TAG/part`` (a
    tensor-parallel engine's groups, one ``mp_rank_XX`` part each): remove, in every tag
    directory of ``parent_dir``, the staging directories whose owner provably ended and
    ``part``'s retired copy beside its published one, warning with their names. Another tag's
    directory is never cleaned by that tag's own saves, so a part killed midway would stay.
    Errors are ignored (a cleanup never fails a save). Reads the directory listings."""
    try:
        tag_dirs = sorted(os.scandir(parent_dir), key=lambda entry: entry.name)
    except OSError:
        return
    for entry in tag_dirs:
        if entry.is_dir(follow_symlinks=False) and not entry.name.startswith("."):
            _remove_abandoned_saves(entry.path, proven_only=True, own_tag=part)


def _names(paths: list) -> str:
    shown = ", ".join(os.path.basename(p) for p in paths[:4])
    return shown + (f" and {len(paths) - 4} more" if len(paths) > 4 else "")


def _attempt(action) -> Optional[BaseException]:
    try:
        action()
    except Exception as e:  # reported on every rank by _agree_or_raise
        return e
    return None


def agreement_device(group=None) -> Optional[torch.device]:
    """Where a one-element agreement all-reduce over ``group`` must live: this process's CUDA
    device for an NCCL group (NCCL reduces CUDA tensors only), else the CPU, read ``None``
    (the default device of ``torch.tensor``). The choice is
    :func:`shardkit.distributed._control_device`'s, for every control message alike."""
    device = distributed._control_device(group)
    return None if device.type == "cpu" else device


def _agree_or_raise(error: Optional[BaseException], what: str, made: list,
                    group=None) -> None:
    """Raise on every rank when any rank has an ``error``, once the staging directory this
    commit made (``made``: on rank 0, once made) is removed."""
    if not distributed.any_rank(error is not None, group, device=agreement_device(group)):
        return
    failures = _failures_of_every_rank(error, group)
    for staging in made:
        remove_own_staging(staging)
    distributed.barrier(group)  # every rank raises only once the staging directory is gone
    detail = f": {type(error).__name__}: {error}" if error is not None else \
        f" on another rank ({failures})"
    raise CheckpointError(f"save_checkpoint failed {what}{detail}; 'latest' still names the "
                          f"previous checkpoint") from error


_REPORT_CHARS = 400  # of each failed rank's error, in the other ranks' messages


def _failures_of_every_rank(error: Optional[BaseException], group) -> str:
    """``"rank 1: OSError: [Errno 28] No space left on device: '...'"`` for each group rank
    whose ``error`` is set, so that a rank that did not fail can say what failed where (its
    own log is often the only one read). One ``all_gather_object`` of a short string, on the
    failure path only."""
    mine = None if error is None else f"{type(error).__name__}: {error}"[:_REPORT_CHARS]
    reports = distributed.all_gather_object(mine, group, counted=False,
                                            operation="save_checkpoint's failure report")
    return "; ".join(f"rank {r}: {text}" for r, text in enumerate(reports) if text is not None)


def _publish(save_dir, tag, staging, final, metadata, engine_payload, save_latest,
             recovery_script_dir=None) -> None:
    if recovery_script_dir is not None:
        from shardkit.utils.zero_to_fp32 import write_recovery_script
        write_recovery_script(recovery_script_dir)
    engine_path = os.path.join(staging, ENGINE_FILE)
    save_torch_file(engine_payload, engine_path)
    metadata = dict(metadata, files=_collect_digests(staging, metadata["world_size"]))
    meta_path = os.path.join(staging, METADATA)
    with open(meta_path, "w") as f:
        json.dump(metadata, f, indent=1, sort_keys=True)
    _fsync(meta_path)
    if os.path.exists(final):  # re-saving a tag: keep the old one until the new one is in
        retired = os.path.join(save_dir, f".old-{tag}")
        shutil.rmtree(retired, ignore_errors=True)
        os.replace(final, retired)
        os.replace(staging, final)
        shutil.rmtree(retired, ignore_errors=True)
    else:
        os.replace(staging, final)
    for owner_file in (OWNER_FILE, LOCK_FILE):  # a published checkpoint has no owner
        with contextlib.suppress(OSError):
            os.remove(os.path.join(final, owner_file))
    if save_latest:
        write_latest_tag(save_dir, tag)


def write_latest_tag(save_dir: str, tag: str) -> None:
    """Point ``save_dir/latest`` at ``tag``: written to a temporary file, synced, renamed into
    place, so a crash leaves the old ``latest`` or the new one. Raises ``OSError``."""
    pending = os.path.join(save_dir, f".{LATEST}.tmp")
    with open(pending, "w") as f:
        f.write(tag)
        f.flush()
        os.fsync(f.fileno())
    os.replace(pending, os.path.join(save_dir, LATEST))


def _collect_digests(staging: str, world_size: int) -> dict:
    """Every rank's checksum file (removed once read) and the engine file's, by file name."""
    files = {ENGINE_FILE: file_digest(os.path.join(staging, ENGINE_FILE))}
    for rank in range(world_size):
        sidecar = os.path.join(staging, rank_file_name(rank) + DIGEST_SUFFIX)
        with open(sidecar) as f:
            files[rank_file_name(rank)] = json.load(f)
        os.remove(sidecar)
    return files


RECOVERY_SCRIPT = "zero_to_fp32.py"  # written beside ``latest`` by engine saves (DeepSpeed's)


def check_tag(tag: str, saving: bool = True) -> None:
    """Raise :class:`CheckpointError` unless ``tag`` is a plain directory name (not ``latest``
    nor the recovery script's name, the files beside the tags); for a save, one that ``latest``
    can name too: no whitespace at either end, which :func:`read_latest_tag` strips as
    DeepSpeed does (``saving=False``: a tag to read, which earlier versions may have saved)."""
    if not isinstance(tag, str) or not tag or tag.startswith(".") or os.sep in tag \
            or tag in (LATEST, RECOVERY_SCRIPT) or (saving and tag != tag.strip()):
        spaces = (f" without whitespace at either end (the '{LATEST}' file is read "
                  f"stripped)," if saving else "")
        raise CheckpointError(f"checkpoint tag={tag!r}: must be a non-empty name without "
                              f"'{os.sep}', not starting with '.',{spaces} and neither "
                              f"{LATEST!r} nor {RECOVERY_SCRIPT!r}")


def read_latest_tag(load_dir: str) -> Optional[str]:
    """The tag ``latest`` names, or ``None`` when there is no ``latest`` file."""
    path = os.path.join(load_dir, LATEST)
    if not os.path.isfile(path):
        return None
    try:
        with open(path) as f:
            tag = f.read().strip()
        check_tag(tag)
    except (OSError, UnicodeDecodeError, CheckpointError) as e:
        # Note: save_checkpoint writes only plain tags; anything else (empty, '../x', binary)
        # was damaged or edited, and must not send the loader to another directory.
        detail = e if not isinstance(e, CheckpointError) else f"it holds {tag[:80]!r}"
        raise CheckpointError(f"{path}: not the name of a checkpoint in {load_dir} ({detail}); "
                              f"fix or remove it, or load with an explicit tag") from None
    return tag


def resolve_checkpoint_dir(load_dir: str, tag: Optional[str]) -> Optional[str]:
    """The directory of ``tag`` (default: ``latest``), ``None`` when there is no checkpoint.
    On rank 0, a warning names what crashed saves left in ``load_dir`` (:func:`abandoned_saves`:
    a newer save that never completed is not what is loaded)."""
    _warn_of_abandoned_saves(load_dir)
    if tag is None:
        tag = read_latest_tag(load_dir)
        if tag is None:
            return None
    path = os.path.join(load_dir, tag)
    if not os.path.isdir(path):
        retired = os.path.join(load_dir, f".old-{tag}")  # a re-save of tag was interrupted
        if os.path.isdir(retired):
            return retired
        what = "does not exist" if not os.path.exists(path) else "is not a checkpoint directory"
        if tag == LATEST and os.path.isfile(path):
            what += " (the file naming the last tag: leave tag=None to load the tag it names)"
        raise CheckpointError(f"load_checkpoint: {path} {what}; tags present: "
                              f"{_tags(load_dir)}")
    if not os.path.isfile(os.path.join(path, METADATA)):
        raise CheckpointError(f"load_checkpoint: {path} has no {METADATA}; it is not a complete "
                              f"shardkit checkpoint")
    return path


def _warn_of_abandoned_saves(load_dir: str) -> None:
    if distributed.get_rank() != 0:
        return
    leftovers = abandoned_saves(load_dir)
    if leftovers:
        warnings.warn(f"load_checkpoint: {load_dir} holds {_names(leftovers)}: what saves left "
                      f"when they were killed midway (not loaded; 'latest' and the "
                      f"tags are complete checkpoints). The next save_checkpoint into it "
                      f"removes them", stacklevel=3)


def _tags(load_dir: str) -> list:
    if not os.path.isdir(load_dir):
        return []
    return sorted(d for d in os.listdir(load_dir)
                  if os.path.isfile(os.path.join(load_dir, d, METADATA)))


def read_metadata(path: str) -> dict:
    """The ``metadata.json`` of checkpoint directory ``path``, checked (format and the fields
    the readers use); a :class:`CheckpointError` naming the file when it is unreadable or
    damaged. Reads that one file; no communication."""
    file = os.path.join(path, METADATA)
    try:
        with open(file) as f:
            metadata = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file}: cannot be read as JSON ({type(e).__name__}: {e}); the "
                              f"checkpoint is corrupted") from None
    if not isinstance(metadata, dict):
        raise CheckpointError(f"{file}: holds a {type(metadata).__name__}, not a JSON object")
    if metadata.get("format") != FORMAT:
        raise CheckpointError(f"{path}: format {metadata.get('format')!r}; this shardkit reads "
                              f"{FORMAT!r}")
    _check_metadata_fields(file, metadata)
    return metadata


def _is_count(value, least: int = 0) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= least


def _check_metadata_fields(file: str, metadata: dict) -> None:
    """A :class:`CheckpointError` naming ``file``, the field, its value and what is valid when
    a field the readers use has the wrong type (an edited or damaged ``metadata.json`` that is
    still JSON: the metadata itself carries no checksum), rather than a ``KeyError`` or
    ``TypeError`` from deep inside the reader. Local."""
    def bad(field_name: str, expected: str) -> CheckpointError:
        value = repr(metadata.get(field_name, "(absent)"))
        return CheckpointError(f"{file}: field {field_name!r} is {value[:120]}; expected "
                               f"{expected}; the checkpoint's metadata is damaged or was edited")

    if not _is_count(metadata.get("world_size"), 1):
        raise bad("world_size", "the number of ranks that wrote the checkpoint (an int >= 1)")
    names = metadata.get("param_names")
    if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
        raise bad("param_names", "a list of tensor names (strings)")
    for counter in ("global_steps", "skipped_steps", "zero_stage", "global_samples"):
        if counter in metadata and not _is_count(metadata[counter]):
            raise bad(counter, "an int >= 0")
    files = metadata.get("files", {})
    if not isinstance(files, dict) or not all(
            isinstance(d, dict) and _is_count(d.get("bytes"))
            and isinstance(d.get("sha256"), str) for d in files.values()):
        raise bad("files", 'a {file name: {"bytes": int, "sha256": hex string}} object')
    rows = metadata.get("row_sharded", {})
    if not isinstance(rows, dict) or not all(
            isinstance(shape, list) and all(_is_count(n) for n in shape)
            for shape in rows.values()):
        raise bad("row_sharded", "a {tensor name: full shape (a list of ints)} object")


def read_checkpoint(path: str, with_optimizer: bool = True,
                    keep_optim: Optional[Callable[[str], bool]] = None,
                    keep_rows: Optional[RowsWanted] = None) -> LoadedCheckpoint:
    """Merge every rank file of the checkpoint at ``path``, one file at a time.

    Memory: without ``keep_rows``, the full fp32 weights, and the optimizer state of the
    parameters ``keep_optim(name)`` accepts (default: all); the rest is dropped file by file,
    so a rank that keeps a share never holds the whole. With ``keep_rows`` (see
    :data:`RowsWanted`; ZeRO-3 readers), each tensor it gives a layout for, and the optimizer
    state tensors of that tensor's shape, are kept as the reader's padded row block only,
    copied out of each file as it is read, whatever world size or stage wrote it: the reader
    holds ``1/N`` of the weights and of the kept optimizer state (plus padding) and never a
    full tensor; the file being read is memory-mapped, so its other rows stay in the OS page
    cache, not in this process. Scalars (Adam's ``step``) are kept as saved.

    Reads files only; no communication."""
    def kept(name: str) -> bool:
        return with_optimizer and (keep_optim is None or keep_optim(name))

    metadata = read_metadata(path)
    merge = _FullMerge(metadata, kept) if keep_rows is None else \
        _RowMerge(metadata, kept, keep_rows)
    rng: dict = {}
    for rank in range(metadata["world_size"]):
        file = os.path.join(path, rank_file_name(rank))
        if not os.path.isfile(file):
            raise CheckpointError(f"{path}: {rank_file_name(rank)} is missing; the checkpoint "
                                  f"was written by {metadata['world_size']} ranks")
        shard = load_checkpoint_file(path, rank_file_name(rank), metadata,
                                     mmap=keep_rows is not None)
        merge.add(shard, rank)
        rng[rank] = shard["rng"]
    merge.finish(path)
    missing = [name for name in metadata["param_names"]
               if name not in merge.params and name not in merge.shapes]
    if missing:
        raise CheckpointError(f"{path}: no rank file holds {missing[:5]}")
    engine = load_checkpoint_file(path, ENGINE_FILE, metadata)
    return LoadedCheckpoint(path, metadata, merge.params, merge.optim, rng, engine,
                            merge.shapes)


class _FullMerge:
    """Rank files merged into full tensors: whole ones as saved, row blocks joined once every
    file is read. Memory: the full tensors kept, plus every block until it is joined."""

    def __init__(self, metadata: dict, kept: Callable[[str], bool]):
        self.metadata, self.kept = metadata, kept
        self.params: dict = {}
        self.optim: dict = {}
        self.shapes: dict = {}
        self.blocks: dict = {}  # name -> [(param block, optimizer-state block)] in rank order

    def add(self, shard: dict, saved_rank: int) -> None:
        """Take what the file of ``saved_rank`` holds."""
        row_blocks = shard.get("row_blocks", {})
        for name, value in shard["params"].items():
            self.add_whole(name, value, shard["optim"].get(name) if self.kept(name) else None)
        for name, state in shard["optim"].items():
            if name not in shard["params"] and name not in row_blocks and self.kept(name):
                self.add_whole_state(name, state)
        for name, block in row_blocks.items():
            state = shard["optim"].get(name, {}) if self.kept(name) else {}
            self.add_block(name, block, state, saved_rank)

    def add_whole(self, name: str, value, state: Optional[dict]) -> None:
        self.params[name] = value
        if isinstance(value, torch.Tensor):
            self.shapes[name] = tuple(value.shape)
        if state is not None:
            self.add_whole_state(name, state)

    def add_whole_state(self, name: str, state: dict) -> None:
        self.optim[name] = state

    def add_block(self, name: str, block: torch.Tensor, state: dict, saved_rank: int) -> None:
        self.blocks.setdefault(name, []).append((block, state))

    def finish(self, path: str) -> None:
        """Join the row blocks (checking that every saving rank wrote one)."""
        world = self.metadata["world_size"]
        for name, shape in self.metadata.get("row_sharded", {}).items():
            parts = self.blocks.pop(name, [])
            if name in self.shapes:  # already settled by _RowMerge: kept as rows, or foreign
                continue
            if len(parts) != world:
                raise CheckpointError(f"{path}: {name} has {len(parts)} row blocks; expected "
                                      f"one per rank ({world})")
            self.params[name] = join_row_blocks([b for b, _ in parts], shape)
            self.shapes[name] = tuple(shape)
            if parts[0][1]:
                self.optim[name] = join_row_state(parts, shape)


class _RowMerge(_FullMerge):
    """Rank files merged into one reader's row blocks: for each name ``keep_rows`` gives a
    layout for, the rows of that reader's block are copied out of every file that holds some
    of them (whole tensors or another world's blocks) into one zero-padded block, so no full
    tensor is ever built. Other names are merged as :class:`_FullMerge` does, copied out of the
    memory-mapped file. Memory: the blocks, and those other tensors."""

    def __init__(self, metadata: dict, kept: Callable[[str], bool], keep_rows: RowsWanted):
        super().__init__(metadata, kept)
        self.keep_rows = keep_rows
        self.rows: dict = {}  # name -> _RowBlock
        self.foreign: dict = {}  # name -> full shape: saved shape is not the reader's, not kept

    def _block_for(self, name: str, full_shape) -> Optional["_RowBlock"]:
        """The block collecting ``name``'s rows, ``None`` when ``name`` is kept whole; a name
        whose saved shape is not the reader's gets no block and is noted in ``foreign``."""
        wanted = self.keep_rows(name)
        if wanted is None:
            return None
        layout, rank = wanted
        if tuple(full_shape) != tuple(layout.shape):
            self.foreign[name] = tuple(full_shape)
            return None
        if name not in self.rows:
            self.rows[name] = _RowBlock(name, layout, rank)
        return self.rows[name]

    def add_whole(self, name: str, value, state: Optional[dict]) -> None:
        if not isinstance(value, torch.Tensor):
            return super().add_whole(name, value, state)
        block = self._block_for(name, value.shape)
        if block is not None:
            block.add(value, state, ParamLayout(torch.Size(value.shape), 1), 0)
            self.shapes[name] = tuple(value.shape)
        elif name in self.foreign:
            self.shapes[name] = tuple(value.shape)
        else:  # a buffer: the same on every rank, small
            super().add_whole(name, _copied(value), _copied(state))

    def add_whole_state(self, name: str, state: dict) -> None:
        wanted = self.keep_rows(name)
        if wanted is None or name in self.foreign:
            return super().add_whole_state(name, _copied(state))
        block = self._block_for(name, wanted[0].shape)
        block.add(None, state, ParamLayout(wanted[0].shape, 1), 0)

    def add_block(self, name: str, block: torch.Tensor, state: dict, saved_rank: int) -> None:
        full_shape = torch.Size(self.metadata["row_sharded"][name])
        rows = self._block_for(name, full_shape)
        if rows is not None:
            rows.add(block, state, ParamLayout(full_shape, self.metadata["world_size"]),
                     saved_rank)
        elif name not in self.foreign:
            super().add_block(name, _copied(block), _copied(state), saved_rank)

    def finish(self, path: str) -> None:
        world = self.metadata["world_size"]
        for name in self.metadata.get("row_sharded", {}):
            rows = self.rows.get(name)
            if rows is not None and rows.pieces != world:
                raise CheckpointError(f"{path}: {name} has {rows.pieces} row blocks; expected "
                                      f"one per rank ({world})")
        for name, shape in self.foreign.items():
            self.shapes[name] = shape
        for name, rows in self.rows.items():
            self.shapes[name] = tuple(rows.layout.shape)
            if rows.param is not None:
                self.params[name] = rows.param
            if rows.state:
                self.optim[name] = rows.state
        super().finish(path)


class _RowBlock:
    """One tensor's row block for one reader (``layout``, ``rank``), and the matching blocks
    of its optimizer state, filled from pieces: each piece is a saving rank's block of the
    tensor as cut by its own layout (a whole tensor is the one block of a world of one)."""

    def __init__(self, name: str, layout: ParamLayout, rank: int):
        self.name, self.layout, self.rank = name, layout, rank
        self.param: Optional[torch.Tensor] = None
        self.state: dict = {}
        self.pieces = 0  # how many saved blocks of the tensor were added

    def add(self, piece: Optional[torch.Tensor], state: Optional[dict],
            piece_layout: ParamLayout, piece_index: int) -> None:
        """Copy this reader's rows out of ``piece`` (the tensor's block ``piece_index`` under
        ``piece_layout``; ``None``: only its optimizer state) and out of the state tensors of
        the piece's shape; other state values (``step``) are taken from the first piece."""
        first_row = piece_index * piece_layout.rows_per_shard
        if piece is not None:
            self.pieces += 1
            self.param = self._copy_rows(self.param, piece, first_row)
        rows_shape = tuple(piece.shape) if piece is not None else tuple(piece_layout.shape)
        for key, value in (state or {}).items():
            if per_element(key, value) and tuple(value.shape) == rows_shape:
                self.state[key] = self._copy_rows(self.state.get(key), value, first_row)
            elif key in ELEMENTWISE_STATE and isinstance(value, torch.Tensor):
                raise CheckpointError(
                    f"optimizer state {key!r} of {self.name} has shape {tuple(value.shape)}, "
                    f"not that of the saved tensor ({rows_shape}); the checkpoint is damaged "
                    f"or of another model")
            elif key not in self.state:
                self.state[key] = _copied(value)

    def _copy_rows(self, block: Optional[torch.Tensor], piece: torch.Tensor,
                   first_row: int) -> torch.Tensor:
        """``block`` (a new zero-padded block when ``None``) with the rows of ``piece`` that
        fall into this reader's block copied in; ``piece`` holds full rows ``first_row...``."""
        if block is None:
            block = torch.zeros(self.layout.shard_shape, dtype=piece.dtype)
        copy_rows_into(block, piece, first_row, self.layout, self.rank)
        return block


def _copied(value):
    """``value`` with its tensors copied out of the memory-mapped file they were read from."""
    if isinstance(value, torch.Tensor):
        return value.clone()
    if isinstance(value, dict):
        return {k: _copied(v) for k, v in value.items()}
    return value


def load_checkpoint_file(path: str, name: str, metadata: dict, mmap: bool = False):
    """Load ``path/name`` safely: check its size and sha256 against ``metadata["files"]`` (when
    the checkpoint lists them), then ``torch.load(weights_only=True)`` on CPU. With ``mmap``
    the tensors are views of the memory-mapped file (copy-on-write), so the caller holds only
    what it copies out; otherwise the whole file is read into memory.

    Raises :class:`CheckpointError` naming the file when it is missing, truncated, altered,
    not a torch file, or holds objects that would need arbitrary code to unpickle."""
    file = os.path.join(path, name)
    if not os.path.isfile(file):
        raise CheckpointError(f"{file} is missing")
    expected = metadata.get("files", {}).get(name)
    if expected is not None:
        actual = file_digest(file)
        if actual["bytes"] != expected["bytes"]:
            raise CheckpointError(f"{file}: {actual['bytes']} bytes, but the checkpoint's "
                                  f"metadata lists {expected['bytes']}; the file is truncated "
                                  f"or was overwritten")
        if actual["sha256"] != expected["sha256"]:
            raise CheckpointError(f"{file}: sha256 {actual['sha256'][:16]}... does not match "
                                  f"{expected['sha256'][:16]}... in the checkpoint's metadata; "
                                  f"the file is corrupted or was modified")
    try:
        return torch.load(file, map_location="cpu", weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        raise CheckpointError(
            f"refused to load {file}: it holds Python objects other than tensors, numbers, "
            f"strings and plain containers ({_unsafe_detail(e)}). shardkit loads checkpoints "
            f"with torch.load(weights_only=True) so that loading cannot run code; if you wrote "
            f"this file yourself and trust it, load it with torch.load(weights_only=False)"
        ) from None
    except Exception as e:  # zip/storage errors of a damaged file
        raise CheckpointError(f"{file} is not a readable torch file ({type(e).__name__}: "
                              f"{str(e).splitlines()[0] if str(e) else ''}); it is truncated or "
                              f"corrupted") from None


def _unsafe_detail(error: Exception) -> str:
    """The line of torch's weights-only error that names the refused global."""
    lines = [ln.strip() for ln in str(error).splitlines()
             if "GLOBAL" in ln or "Unsupported" in ln or "unsupported" in ln]
    return lines[0] if lines else str(error).splitlines()[0]


def describe(metadata: dict) -> dict[str, Any]:
    """The few facts a person wants about a checkpoint (for logs and the CLI)."""
    return {k: metadata.get(k) for k in ("tag", "world_size", "zero_stage", "global_steps")}
