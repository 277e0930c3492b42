"""A checkpoint disk that refuses writes is named as such, on every rank.

torch.save reports a write the file system refused (a full disk, a quota, a file size limit)
as ``RuntimeError: [enforce fail at inline_container.cc:...] . unexpected pos 64 vs 0``; the
save was refused cleanly, but no rank said why, and the ranks that did not fail named their
own file as the one that could not be written. The refusal is simulated with a file size
limit (``RLIMIT_FSIZE``, ``EFBIG``: "File too large"), which reaches torch's own C++ writes as
a full disk does, on one rank only. The save must fail on every rank naming the rank, the file
and the reason, leave ``latest`` and the previous checkpoint loadable and nothing of the
failed save behind; the offline tools (``zero_to_fp32``, ``python -m shardkit consolidate``)
must end with the reason and leave no file. One world of 2 gloo ranks.

From a review:

From a review of e41356d (checkpoint files written by ``save_torch_file``):

- a state of many small tensors (optimizer state of a deep model) was written with about five
  ``os.write`` system calls per tensor (torch hands over each zip header, padding and record
  separately), slower than ``torch.save(path)``; small records are now gathered into writes
  of about 1 MiB, large ones still written as they come; the file holds the same records as
  ``torch.save``'s and loads with ``mmap=True`` and ``weights_only=True``;
- the files were created with mode ``0o644`` whatever the umask (``torch.save`` gives
  ``0o666`` less the umask: group-writable under ``umask 002``).

A full disk is simulated with a file size limit (``RLIMIT_FSIZE``: EFBIG, "File too
large"). No process group.
"""

import contextlib
import os
import resource
import signal
import zipfile

import torch
import torch.nn as nn

import shardkit
from shardkit import distributed
from shardkit.checkpoint import CheckpointError, read_latest_tag
from shardkit.checkpoint.file_writes import save_torch_file
from shardkit.testing import world_fixture

world2 = world_fixture(2)

SMALL_FILE_LIMIT = 4096  # bytes: each rank's file of the model below is ~10 KB
REASON = os.strerror(27)  # EFBIG: "File too large"


@contextlib.contextmanager
def file_size_limit(limit: int):
    """Writes past ``limit`` bytes of any file fail with EFBIG in this process (SIGXFSZ, which
    would kill it, ignored) until the block ends."""
    soft, hard = resource.getrlimit(resource.RLIMIT_FSIZE)
    previous = signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (limit, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_FSIZE, (soft, hard))
        signal.signal(signal.SIGXFSZ, previous)


def _engine():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(40, 40), nn.Linear(40, 1))
    engine, *_ = shardkit.initialize(model=model, config={
        "train_batch_size": 2 * distributed.get_world_size(), "steps_per_print": 1000,
        "optimizer": {"type": "Adam", "params": {"lr": 0.01}},
        "zero_optimization": {"stage": 3}})
    return engine


def _step(engine, seed):
    x = torch.randn(2, 40, generator=torch.Generator().manual_seed(seed))
    engine.backward(engine(x).pow(2).mean())
    engine.step()


def _full_state(engine):
    return {k: v.clone() for k, v in engine.wrapped.state_dict().items()}


def _save_on_a_refusing_disk(save_dir):
    engine = _engine()
    _step(engine, 0)
    engine.save_checkpoint(save_dir)
    good = _full_state(engine)
    _step(engine, 1)
    refusing = distributed.get_rank() == 1
    try:
        with file_size_limit(SMALL_FILE_LIMIT) if refusing else contextlib.nullcontext():
            engine.save_checkpoint(save_dir)
        error = None
    except CheckpointError as e:
        error = str(e)
    listing = sorted(os.listdir(save_dir))
    resumed = _engine()
    path, _ = resumed.load_checkpoint(save_dir)
    restored = max(float((v - good[k]).abs().max()) for k, v in _full_state(resumed).items())
    engine.save_checkpoint(save_dir)  # the disk has room again: the next save goes through
    return {"error": error, "listing": listing, "loaded": path, "restored_diff": restored,
            "latest_after": read_latest_tag(save_dir)}


def test_a_full_disk_on_one_rank_names_the_rank_file_and_reason_everywhere(world2, tmp_path):
    save_dir = str(tmp_path / "ckpt")
    rank0, rank1 = world2.run(_save_on_a_refusing_disk, save_dir)
    # the rank whose disk refused: the reason and its file (was torch's "unexpected pos")
    assert REASON in rank1["error"] and "rank_00001.pt" in rank1["error"], rank1["error"]
    assert "unexpected pos" not in rank1["error"]
    # the other rank: which rank failed, and why (it named its own file, "see its error")
    assert "on another rank" in rank0["error"] and "rank 1: OSError" in rank0["error"] \
        and REASON in rank0["error"], rank0["error"]
    assert "rank_00000.pt" not in rank0["error"]
    for r in (rank0, rank1):
        assert "'latest' still names the previous checkpoint" in r["error"]
        assert r["listing"] == ["global_step1", "latest", "zero_to_fp32.py"]
        assert r["loaded"] == os.path.join(save_dir, "global_step1")
        assert r["restored_diff"] == 0.0 and r["latest_after"] == "global_step2"


def _saved_once(save_dir):
    engine = _engine()
    _step(engine, 0)
    engine.save_checkpoint(save_dir)


def test_offline_tools_on_a_full_disk_end_with_the_reason_and_no_file(world2, tmp_path,
                                                                      capsys):
    from shardkit.__main__ import main as shardkit_main
    from shardkit.utils.zero_to_fp32 import main as zero_to_fp32
    save_dir = str(tmp_path / "ckpt")
    world2.run(_saved_once, save_dir)
    out = tmp_path / "out"
    with file_size_limit(SMALL_FILE_LIMIT):  # the fp32 model is ~7 KB
        script_status = zero_to_fp32([save_dir, str(out)])  # raised torch's RuntimeError
        consolidate_status = shardkit_main(["consolidate", save_dir, str(tmp_path / "m.pt")])
    errors = capsys.readouterr().err
    assert script_status == 2 and consolidate_status == 2, errors
    assert errors.count(REASON) == 2 and "unexpected pos" not in errors, errors
    assert os.listdir(out) == [] and sorted(os.listdir(tmp_path)) == ["ckpt", "out"]


def test_a_shard_index_that_cannot_be_written_leaves_no_temporary_file(world2, tmp_path,
                                                                       monkeypatch):
    from shardkit.utils import zero_to_fp32
    save_dir = str(tmp_path / "ckpt")
    world2.run(_saved_once, save_dir)
    out = tmp_path / "out"
    real_replace = os.replace

    def index_refused(src, dst):
        if str(dst).endswith(".index.json"):
            raise OSError(28, os.strerror(28), str(dst))
        return real_replace(src, dst)

    monkeypatch.setattr(zero_to_fp32.os, "replace", index_refused)
    assert zero_to_fp32.main([save_dir, str(out), "--max_shard_size", "2000"]) == 2
    assert not [n for n in os.listdir(out) if ".index.json" in n], os.listdir(out)


def _save_16bit_model_on_a_refusing_disk(out_dir):
    engine = _engine()
    _step(engine, 0)
    try:
        with file_size_limit(SMALL_FILE_LIMIT) if distributed.get_rank() == 0 \
                else contextlib.nullcontext():
            engine.save_16bit_model(out_dir)
        return None
    except RuntimeError as error:
        return str(error)


def test_save_16bit_model_on_a_full_disk_names_the_reason_on_every_rank(world2, tmp_path):
    """Rank 0 writes the model; its refused write was torch's "unexpected pos" text."""
    out_dir = str(tmp_path / "model")
    for error in world2.run(_save_16bit_model_on_a_refusing_disk, out_dir):
        assert error is not None and REASON in error and "unexpected pos" not in error, error
    assert os.listdir(out_dir) == []


def _records(path: str) -> dict:
    """The zip records of a torch.save file, by name below the archive's folder."""
    with zipfile.ZipFile(path) as archive:
        return {name.split("/", 1)[1]: archive.read(name) for name in archive.namelist()}


def _state_of_many_small_tensors_and_views() -> dict:
    generator = torch.Generator().manual_seed(0)
    big = torch.randn(1024, 1024, generator=generator)  # 4 MiB: written as it comes
    state = {f"p{i}": torch.randn(16, generator=generator) for i in range(3000)}
    state.update(big=big, rows=big[10:20], columns=big.t()[::3],  # views sharing big's storage
                 half=torch.randn(7, 5, generator=generator).bfloat16(), empty=torch.empty(0),
                 step=torch.tensor(12), meta={"lr": 0.01, "names": ["a", None]})
    return state


def test_many_small_tensors_take_few_writes_and_equal_torch_saves_file(tmp_path, monkeypatch):
    state = _state_of_many_small_tensors_and_views()
    writes = []
    real_write = os.write

    def counted_write(fd, data):
        writes.append(len(data))
        return real_write(fd, data)

    monkeypatch.setattr(os, "write", counted_write)
    save_torch_file(state, str(tmp_path / "ours.pt"))
    monkeypatch.setattr(os, "write", real_write)
    # ~3000 small records and one of 4 MiB: was ~15000 system calls
    assert len(writes) <= 8, (len(writes), writes[:20])
    torch.save(state, str(tmp_path / "torch.pt"))
    assert _records(str(tmp_path / "ours.pt")) == _records(str(tmp_path / "torch.pt"))
    for options in ({"mmap": True, "weights_only": True}, {"weights_only": False}):
        loaded = torch.load(str(tmp_path / "ours.pt"), **options)
        for key, value in state.items():
            if isinstance(value, torch.Tensor):
                assert loaded[key].dtype == value.dtype and torch.equal(loaded[key], value), key
        assert loaded["meta"] == state["meta"]
        assert loaded["rows"].untyped_storage().data_ptr() == \
            loaded["big"].untyped_storage().data_ptr()  # one storage, as saved


def test_a_refused_gathered_write_is_the_oserror_and_the_files_mode_is_torch_saves(tmp_path):
    state = {f"p{i}": torch.randn(16) for i in range(200)}  # ~40 KB, all gathered
    with file_size_limit(8192):
        try:
            save_torch_file(state, str(tmp_path / "refused.pt"))
            raise AssertionError("a write past the file size limit went through")
        except OSError as error:
            assert error.errno == 27 and error.filename == str(tmp_path / "refused.pt"), error
    previous = os.umask(0o002)
    try:
        save_torch_file(state, str(tmp_path / "ours.pt"))
        torch.save(state, str(tmp_path / "torch.pt"))
    finally:
        os.umask(previous)
    modes = [os.stat(tmp_path / name).st_mode & 0o777 for name in ("ours.pt", "torch.pt")]
    assert modes == [0o664, 0o664], [oct(m) for m in modes]
