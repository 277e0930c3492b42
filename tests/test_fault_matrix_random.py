"""Seeded randomized fault and checkpoint-safety checks, beyond the fixed cases of
``test_fault_matrix.py`` and ``tests/checkpoint/``.

- Resume: for configurations drawn from ``SEED`` (ZeRO stage 0-3, fp32 or fp16 with a loss
  scale that overflows and skips steps, a warmup-decay schedule, dropout, a synchronous or an
  asynchronous save at a drawn step), a fresh engine that loads the checkpoint and trains on
  ends bit-identical to the uninterrupted run: weights, loss scaler, learning rate, skipped
  steps and the RNG stream.
- Damage: drawn truncations, byte flips and appended bytes of every file of a checkpoint, and
  drawn edits of its ``metadata.json`` that keep it valid JSON, are each a ``CheckpointError``
  naming the file (and the field), never a ``KeyError``/``TypeError`` from inside the reader.
- The collective debug mode compares whole fingerprints whatever the call site's path or the
  group's size (a non-ASCII path or a large group used to overflow the fixed-size fingerprint:
  a correct program was reported as a mismatch, or every check silently passed).
"""

import json
import os
import random
import shutil

import pytest
import torch
import torch.nn.functional as F

from shardkit.checkpoint import CheckpointError, consolidate_checkpoint
from shardkit.checkpoint.sharded import file_digest
from shardkit.testing import world_fixture

SEED = 20261204
world2 = world_fixture(2)


def _draw_resume_cases():
    """Every stage once; fp16 and asynchronous saves each on two of the four, drawn."""
    rng = random.Random(SEED)
    fp16, asynchronous = [False, False, True, True], [False, False, True, True]
    rng.shuffle(fp16)
    rng.shuffle(asynchronous)
    return [(stage, fp16[stage], asynchronous[stage], rng.choice([1, 2, 3]))
            for stage in (0, 1, 2, 3)]


RESUME_CASES = _draw_resume_cases()
TOTAL_STEPS = 5


def _tiny():
    from shardkit.models import GPTConfig
    return GPTConfig(vocab_size=32, n_layer=1, n_head=2, d_model=16, seq_len=8, dropout=0.1)


def _engine(stage, fp16):
    import shardkit
    from shardkit.models import GPT
    config = {"train_batch_size": 8, "train_micro_batch_size_per_gpu": 2,
              "steps_per_print": 10 ** 6, "gradient_clipping": 1.0,
              "optimizer": {"type": "AdamW", "params": {"lr": 3e-3, "eps": 1e-6}},
              "scheduler": {"type": "WarmupDecayLR", "params": {
                  "warmup_max_lr": 3e-3, "warmup_num_steps": 2, "total_num_steps": 10}},
              "zero_optimization": {"stage": stage}}
    if fp16:  # 2**20 overflows fp16 gradients at first: skipped steps, a moving scale
        config["fp16"] = {"enabled": True, "initial_scale_power": 20, "loss_scale_window": 2,
                          "hysteresis": 1}
    engine, _, _, scheduler = shardkit.initialize(model=GPT(_tiny(), seed=0), config=config)
    return engine, scheduler


def _train_until(engine, total):
    from shardkit import distributed
    from shardkit.models import synthetic_batch
    rank, world = distributed.get_rank(), distributed.get_world_size()
    per_rank = 8 // world
    while engine.global_steps < total:
        idx, tgt = synthetic_batch(_tiny(), 8, engine.global_steps)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        for x, y in zip(idx[mine].split(2), tgt[mine].split(2)):
            loss = F.cross_entropy(engine(x).float().reshape(-1, 32), y.reshape(-1))
            engine.backward(loss)
            engine.step()


def _final(engine, scheduler):
    return {"state": {k: v.clone() for k, v in engine.module_state_dict().items()},
            "scaler": engine.loss_scaler.state_dict() if engine.loss_scaler else None,
            "lr": [g["lr"] for g in engine.optimizer.param_groups],
            "scheduler": scheduler.state_dict(), "skipped": engine.skipped_steps,
            "steps": engine.global_steps, "rng": torch.rand(4)}


def _resume_matches_uninterrupted(stage, fp16, async_save, save_at, save_dir):
    """Uninterrupted run with a save at ``save_at``; then a fresh engine (other initial RNG)
    loads that checkpoint and trains to the end. Returns the differences found."""
    from shardkit import distributed
    torch.manual_seed(100 + distributed.get_rank())
    engine, scheduler = _engine(stage, fp16)
    _train_until(engine, save_at)
    engine.save_checkpoint(save_dir, async_save=async_save)
    _train_until(engine, TOTAL_STEPS)  # the asynchronous save is written meanwhile
    engine.wait_for_checkpoint()
    reference = _final(engine, scheduler)

    torch.manual_seed(999)  # the resumed run must not depend on the process's RNG
    resumed, resumed_scheduler = _engine(stage, fp16)
    path, _ = resumed.load_checkpoint(save_dir)
    assert path.endswith(f"global_step{save_at}"), path
    _train_until(resumed, TOTAL_STEPS)
    got = _final(resumed, resumed_scheduler)
    diffs = [k for k in reference["state"]
             if not torch.equal(reference["state"][k], got["state"][k])]
    diffs += [k for k in ("scaler", "lr", "scheduler", "skipped", "steps")
              if repr(reference[k]) != repr(got[k])]
    if not torch.equal(reference["rng"], got["rng"]):
        diffs.append("rng")
    return diffs, reference["skipped"]


@pytest.mark.parametrize("stage,fp16,async_save,save_at", RESUME_CASES)
def test_drawn_resume_is_bit_identical(world2, tmp_path, stage, fp16, async_save, save_at):
    results = world2.run(_resume_matches_uninterrupted, stage, fp16, async_save, save_at,
                         str(tmp_path / "ckpt"))
    for diffs, skipped in results:
        assert diffs == [], (stage, fp16, async_save, save_at, diffs)
        if fp16:
            assert skipped > 0  # the case did exercise the loss scaler's skips


def _save_one(save_dir):
    engine, _ = _engine(2, True)
    _train_until(engine, 2)
    engine.save_checkpoint(save_dir, tag="t")
    return True


@pytest.fixture(scope="module")
def saved(world2, tmp_path_factory):
    save_dir = str(tmp_path_factory.mktemp("damage") / "ckpt")
    assert world2.run(_save_one, save_dir) == [True, True]
    return save_dir


def _private_copy(saved, where):
    shutil.rmtree(where, ignore_errors=True)
    shutil.copytree(saved, where)
    return os.path.join(where, "t")


def test_drawn_byte_damage_is_named(saved, tmp_path):
    rng = random.Random(SEED + 1)
    names = ["engine.pt", "rank_00000.pt", "rank_00001.pt"]
    for trial in range(12):
        path = _private_copy(saved, str(tmp_path / f"copy{trial}"))
        name = rng.choice(names)
        victim = os.path.join(path, name)
        data = bytearray(open(victim, "rb").read())
        how = rng.choice(["truncate", "flip", "append", "zero"])
        if how == "truncate":
            data = data[:rng.randrange(len(data))]
        elif how == "flip":
            data[rng.randrange(len(data))] ^= 1 << rng.randrange(8)
        elif how == "append":
            data += bytes(rng.randrange(256) for _ in range(rng.randrange(1, 64)))
        else:
            data = bytearray(len(data))
        with open(victim, "wb") as f:
            f.write(bytes(data))
        with pytest.raises(CheckpointError) as err:
            consolidate_checkpoint(os.path.dirname(path))
        assert victim in str(err.value), (how, name, str(err.value))


METADATA_EDITS = [
    ("world_size", "2"), ("world_size", None), ("world_size", 0), ("world_size", True),
    ("param_names", "weight"), ("param_names", None), ("files", [1, 2]),
    ("files", {"rank_00000.pt": "0f"}), ("files", {"rank_00000.pt": {"sha256": "00"}}),
    ("row_sharded", ["x"]), ("row_sharded", {"x": "3"}), ("global_steps", "7"),
    ("skipped_steps", -1),
]


def test_drawn_metadata_edits_that_stay_json_are_named(saved, tmp_path):
    """Before, a damaged field (the metadata has no checksum of its own) surfaced as a KeyError
    or TypeError from inside the reader, or for global_steps as a ValueError while loading."""
    edits = random.Random(SEED + 2).sample(METADATA_EDITS, len(METADATA_EDITS))
    for trial, (field, value) in enumerate(edits):
        path = _private_copy(saved, str(tmp_path / f"meta{trial}"))
        meta_file = os.path.join(path, "metadata.json")
        with open(meta_file) as f:
            meta = json.load(f)
        if value is None:
            del meta[field]
        else:
            meta[field] = value
        with open(meta_file, "w") as f:
            json.dump(meta, f)
        with pytest.raises(CheckpointError) as err:
            consolidate_checkpoint(os.path.dirname(path))
        message = str(err.value)
        assert meta_file in message and f"field {field!r}" in message, (field, value, message)
        assert "expected" in message


def test_a_latest_file_that_names_no_plain_tag_is_refused(saved, tmp_path):
    """Before, ``latest`` was joined to the directory as read: '../elsewhere/t' loaded another
    directory's checkpoint without a word, and an empty one read the save directory itself."""
    _private_copy(saved, str(tmp_path / "elsewhere"))
    root = str(tmp_path / "run")
    _private_copy(saved, root)
    for content in ("../elsewhere/t", "", ".tmp-t", "latest"):
        with open(os.path.join(root, "latest"), "w") as f:
            f.write(content)
        with pytest.raises(CheckpointError) as err:
            consolidate_checkpoint(root)
        assert os.path.join(root, "latest") in str(err.value), (content, str(err.value))
        assert "not the name of a checkpoint" in str(err.value)
    assert set(consolidate_checkpoint(root, tag="t"))  # an explicit tag still loads


def test_files_of_the_saved_checkpoint_still_verify(saved):
    path = os.path.join(saved, "t")
    with open(os.path.join(path, "metadata.json")) as f:
        files = json.load(f)["files"]
    assert {n: file_digest(os.path.join(path, n)) for n in files} == files


# ----------------------------------------------------------------------------- debug mode


def _matching_collectives_under_a_long_non_ascii_path():
    """Rank 1's call site is a long path of non-ASCII directory names; the collectives match."""
    from shardkit import collective_check, distributed
    site = collective_check._call_site
    if distributed.get_rank() == 1:
        collective_check._call_site = lambda: "/home/ユーザー/実験/" * 40 + "train.py:7 in main"
    collective_check.set_debug_collectives(True)
    try:
        x = torch.ones(3)
        distributed.all_reduce(x)
        distributed.barrier()
        return x.tolist()
    except collective_check.CollectiveMismatchError as e:
        return str(e)
    finally:
        collective_check.set_debug_collectives(False)
        collective_check._call_site = site


def test_matching_collectives_under_a_non_ascii_path_are_not_a_mismatch(world2):
    """Before, the site was cut to 256 characters, but JSON escapes each non-ASCII one as six
    bytes; the fingerprint was cut at 512 bytes, did not decode, and the correct program was
    reported as a mismatch on every rank."""
    assert world2.run(_matching_collectives_under_a_long_non_ascii_path) == [[2.0] * 3] * 2


def _default_group_named_two_ways():
    import torch.distributed as dist
    from shardkit import collective_check, distributed
    collective_check.set_debug_collectives(True)
    try:
        x = torch.ones(2)
        distributed.all_reduce(x, group=None if distributed.get_rank() == 0 else dist.group.WORLD)
        distributed.all_reduce(x)
        return x.tolist()
    except collective_check.CollectiveMismatchError as e:
        return str(e)
    finally:
        collective_check.set_debug_collectives(False)


def test_default_group_passed_as_none_or_world_is_one_sequence(world2):
    """Before, None and dist.group.WORLD kept separate sequence numbers, so the second
    all-reduce was reported as a mismatch (#1 on rank 0, #0 on rank 1) in a correct program."""
    assert world2.run(_default_group_named_two_ways) == [[4.0, 4.0]] * 2


def test_fingerprint_of_a_large_group_keeps_every_compared_field():
    """Before, the fingerprint listed every rank of the group: above about 80 ranks it was cut at
    512 bytes and decoded as the same placeholder on every rank, so no mismatch was ever seen."""
    from shardkit.collective_check import FINGERPRINT_BYTES, _ranks_digest, encode_fingerprint
    for n in (2, 100, 4096):
        fingerprint = {"op": "all_gather", "seq": 123456, "shape": [n, 8192], "dtype": "bfloat16",
                       "ranks": _ranks_digest(tuple(range(n))), "rank": n - 1,
                       "site": "/données/" * 100 + "train.py:1 in main"}
        raw = encode_fingerprint(fingerprint)
        assert len(raw) <= FINGERPRINT_BYTES
        decoded = json.loads(raw.decode())
        for field in ("op", "seq", "shape", "dtype", "ranks", "rank"):
            assert decoded[field] == fingerprint[field], field
        assert decoded["site"].endswith("train.py:1 in main")
    assert _ranks_digest(tuple(range(100))) != _ranks_digest(tuple(range(1, 101)))


# ----------------------------------------------------------------------------- watchdog


def _finish_then_linger(rank, world, port, log_path, linger_s):
    """A rank of a healthy job: one collective, then rank 0 finishes (marks itself done, as the
    watchdog's atexit hook does, and leaves, taking the store it hosts along) while the others
    still do local work for ``linger_s``."""
    import sys
    import time
    log = open(log_path, "w")
    os.dup2(log.fileno(), 2)
    sys.stderr = log
    os.environ.update({"RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
                       "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1",
                       "MASTER_PORT": str(port)})
    from shardkit import distributed, fault
    distributed.init_distributed(backend="gloo", timeout_s=60)
    fault.watch_peers(1.0)
    distributed.all_reduce(torch.ones(2))
    if rank != 0:
        time.sleep(linger_s)
    fault.stop_watching()
    log.write(f"rank {rank} finished\n")
    log.flush()
    os._exit(0)


def test_store_host_finishing_first_does_not_stop_a_healthy_peer(tmp_path):
    """Before, the peer's watchdog took the store that vanished with rank 0's normal exit for
    rank 0's death and stopped the healthy peer with status 75 ("rank 0 of 2 is lost"), which
    under torchrun --max-restarts restarts a job that had finished."""
    from shardkit.testing import free_port, process_context
    ctx = process_context()
    port = free_port()
    logs = [str(tmp_path / f"rank{r}.log") for r in range(2)]
    procs = [ctx.Process(target=_finish_then_linger, args=(r, 2, port, logs[r], 4.0))
             for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(60)
        if p.is_alive():
            p.kill()
            p.join()
    outputs = [open(f).read() for f in logs]
    assert [p.exitcode for p in procs] == [0, 0], outputs
    assert "is lost" not in outputs[1] and "rank 1 finished" in outputs[1], outputs[1]
