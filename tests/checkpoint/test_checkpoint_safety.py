"""Checkpoints cannot run code when loaded, and damaged files are named, not unpickled.

Every file a save writes loads with ``torch.load(weights_only=True)``; a rank file whose pickle
would call ``os.system`` is refused (even when the metadata's checksum matches it, as a forger
would arrange); a truncated or altered file fails its size or sha256 check with an error naming
the file; ``python -m shardkit consolidate`` goes through the same checks."""

import json
import os
import shutil

import pytest
import torch

import shardkit
from shardkit.checkpoint import CheckpointError, consolidate_checkpoint
from shardkit.checkpoint.sharded import file_digest
from shardkit.testing import world_fixture

world2 = world_fixture(2)


def _save_two_checkpoints(save_dir):
    engine, _, _, _ = shardkit.initialize(model=torch.nn.Linear(4, 3), config={
        "train_batch_size": 4, "optimizer": {"type": "AdamW", "params": {"lr": 0.1}},
        "fp16": {"enabled": True}, "scheduler": {"type": "WarmupLR", "params": {}},
        "zero_optimization": {"stage": 2}})
    for tag in ("a", "b"):
        engine.backward(engine(torch.ones(2, 4)).float().sum())
        engine.step()
        engine.save_checkpoint(save_dir, tag=tag, client_state={"epoch": 3, "note": "x"})
    return True


@pytest.fixture(scope="module")
def saved(world2, tmp_path_factory):
    save_dir = str(tmp_path_factory.mktemp("safety") / "ckpt")
    assert world2.run(_save_two_checkpoints, save_dir) == [True, True]
    return save_dir


class _RunsCode:
    """Unpickling this calls os.system: what a malicious checkpoint would carry."""

    def __init__(self, marker):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _copy(saved, tmp_path, tag="b"):
    """A private copy of checkpoint ``tag`` (as the only, latest one)."""
    dst = str(tmp_path / "copy")
    shutil.copytree(os.path.join(saved, tag), os.path.join(dst, tag))
    with open(os.path.join(dst, "latest"), "w") as f:
        f.write(tag)
    return dst, os.path.join(dst, tag)


def _rewrite_metadata(path, edit):
    meta_file = os.path.join(path, "metadata.json")
    with open(meta_file) as f:
        meta = json.load(f)
    edit(meta)
    with open(meta_file, "w") as f:
        json.dump(meta, f)


def test_every_file_loads_weights_only_and_is_checksummed(saved):
    path = os.path.join(saved, "b")
    with open(os.path.join(path, "metadata.json")) as f:
        meta = json.load(f)
    assert sorted(meta["files"]) == ["engine.pt", "rank_00000.pt", "rank_00001.pt"]
    for name, digest in meta["files"].items():
        assert file_digest(os.path.join(path, name)) == digest
        torch.load(os.path.join(path, name), weights_only=True)  # raises if unsafe
    assert not [f for f in os.listdir(path) if f.endswith(".sha256")]  # folded into metadata
    state = consolidate_checkpoint(saved)
    assert set(state) == {"weight", "bias"}


def test_checkpoint_whose_pickle_runs_code_is_refused(saved, tmp_path, capsys):
    root, path = _copy(saved, tmp_path)
    marker = str(tmp_path / "code-ran")
    victim = os.path.join(path, "rank_00000.pt")
    shard = torch.load(victim, weights_only=True)
    shard["rng"]["python"] = _RunsCode(marker)
    torch.save(shard, victim)
    # A forger controls the metadata too: make the checksum agree with the crafted file.
    _rewrite_metadata(path, lambda m: m["files"].update({"rank_00000.pt": file_digest(victim)}))
    with pytest.raises(CheckpointError) as err:
        consolidate_checkpoint(root)
    assert f"refused to load {victim}" in str(err.value) and "system" in str(err.value)
    assert "weights_only=True" in str(err.value)
    from shardkit.__main__ import main
    assert main(["consolidate", root, str(tmp_path / "out.pt")]) == 2
    assert "refused to load" in capsys.readouterr().err
    assert not os.path.exists(marker) and not os.path.exists(tmp_path / "out.pt")


def test_truncated_altered_and_unlisted_damage_name_the_file(saved, tmp_path):
    root, path = _copy(saved, tmp_path)
    victim = os.path.join(path, "rank_00001.pt")
    data = open(victim, "rb").read()

    with open(victim, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(CheckpointError, match="truncated") as err:
        consolidate_checkpoint(root)
    assert victim in str(err.value) and f"lists {len(data)}" in str(err.value)

    flipped = bytearray(data)
    flipped[len(data) // 2] ^= 0xFF
    with open(victim, "wb") as f:
        f.write(bytes(flipped))
    with pytest.raises(CheckpointError, match="sha256") as err:
        consolidate_checkpoint(root)
    assert victim in str(err.value) and "corrupted or was modified" in str(err.value)

    # Without a checksum to compare (metadata edited too), torch's reader still fails clearly.
    with open(victim, "wb") as f:
        f.write(data[: len(data) // 2])
    _rewrite_metadata(path, lambda m: m.pop("files"))
    with pytest.raises(CheckpointError, match="not a readable torch file") as err:
        consolidate_checkpoint(root)
    assert victim in str(err.value)

    with open(os.path.join(path, "metadata.json"), "w") as f:
        f.write('{"format": "shardkit-resh')
    with pytest.raises(CheckpointError, match="cannot be read as JSON") as err:
        consolidate_checkpoint(root)
    assert os.path.join(path, "metadata.json") in str(err.value)


def test_the_previous_checkpoint_is_untouched(saved):
    state = consolidate_checkpoint(saved, tag="a")
    assert set(state) == {"weight", "bias"}


def test_consolidate_given_a_tag_directory_says_which_parent_and_tag(saved, tmp_path, capsys):
    """``consolidate ckpt/b out.pt`` (the tag's own directory, the easy slip) names the parent
    and ``--tag`` to give, once prefixed (it printed "consolidate: consolidate: ... has no
    'latest' file; pass --tag", and --tag alone could not help); elsewhere, the tags present."""
    from shardkit.__main__ import main
    out = str(tmp_path / "out.pt")
    assert main(["consolidate", os.path.join(saved, "b"), out]) == 2
    assert capsys.readouterr().err == (
        f"consolidate: {os.path.join(saved, 'b')} is one checkpoint's own directory, not the "
        f"directory given to save_checkpoint: pass {saved} with --tag b\n")
    assert main(["consolidate", str(tmp_path), out]) == 2
    assert capsys.readouterr().err == (
        f"consolidate: {tmp_path} holds no checkpoint written by engine.save_checkpoint (no "
        f"'latest' file, no tag directory with metadata.json)\n")
    untagged = tmp_path / "untagged"
    shutil.copytree(os.path.join(saved, "b"), untagged / "b")
    assert main(["consolidate", str(untagged), out]) == 2
    assert capsys.readouterr().err == (
        f"consolidate: {untagged} has no 'latest' file; pass --tag (checkpoints there: b)\n")
    assert main(["consolidate", saved, out, "--tag", "b"]) == 0 and os.path.isfile(out)
