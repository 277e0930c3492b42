"""DeepSpeed's zero_to_fp32 over shardkit's checkpoints (shardkit.utils.zero_to_fp32 and the
``zero_to_fp32.py`` script that ``engine.save_checkpoint`` writes beside ``latest``).

A small GPT with tied embeddings, a frozen parameter and a buffer trains two steps with
``shardkit.initialize`` at each ZeRO stage (world 2), at stage 3 on world 4 and with tensor
parallelism 2 x data parallelism 2 (world 4), and saves. This process (no process group) then
recovers the fp32 state dict with each function and with the script run as a subprocess: it
must equal the engine's ``module_state_dict()`` exactly and load strictly into a fresh model.
"""

import json
import os
import subprocess
import sys

import pytest
import torch
import torch.nn as nn

import shardkit
from shardkit import distributed
from shardkit.checkpoint.sharded import CheckpointError
from shardkit.models import GPT, GPTConfig, synthetic_batch
from shardkit.testing import world_fixture
from shardkit.utils.zero_to_fp32 import (CheckpointNotFound,
                                         convert_zero_checkpoint_to_fp32_state_dict,
                                         get_fp32_state_dict_from_zero_checkpoint,
                                         load_state_dict_from_zero_checkpoint, main)

CFG = GPTConfig(vocab_size=32, n_layer=1, n_head=2, d_model=16, seq_len=8, tie_weights=True)
FROZEN = "pos_emb.weight"
TAG = "global_step2"

world2 = world_fixture(2)


world4 = world_fixture(4)


class TiedGPT(GPT):
    """GPT with tied embeddings (``head.weight`` is ``tok_emb.weight``) and a buffer."""

    def __init__(self):
        super().__init__(CFG)
        self.register_buffer("scale", torch.arange(3.0))


def _model() -> nn.Module:
    torch.manual_seed(0)
    model = TiedGPT()
    model.pos_emb.weight.requires_grad_(False)
    return model


def _config(stage: int) -> dict:
    return {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 1,
            "steps_per_print": 1000, "zero_optimization": {"stage": stage},
            "optimizer": {"type": "AdamW", "params": {"lr": 1e-2, "eps": 1e-6}}}


def _train(engine, steps: int = 2) -> None:
    for step in range(steps):
        x, y = synthetic_batch(CFG, 2, step, seed=10 * distributed.get_rank())
        loss = nn.functional.cross_entropy(engine(x).flatten(0, 1), y.flatten())
        engine.backward(loss)
        engine.step()


# ----------------------------------------------------------------------------- rank side


def _save(stage: int, save_dir: str) -> dict:
    """Train, save (``TAG``, and ``excluded`` without the frozen parameter), try the tag the
    script's file name takes, reload; rank 0 returns what the checks need."""
    engine, *_ = shardkit.initialize(model=_model(), config=_config(stage))
    _train(engine)
    ref = {k: v.detach().clone() for k, v in engine.module_state_dict().items()}
    engine.save_checkpoint(save_dir)
    engine.save_checkpoint(save_dir, tag="excluded", exclude_frozen_parameters=True,
                           save_latest=False)
    try:
        engine.save_checkpoint(save_dir, tag="zero_to_fp32.py")
        refused = None
    except CheckpointError as error:
        refused = str(error)
    restored, *_ = shardkit.initialize(model=TiedGPT(), config=_config(stage))
    restored.load_checkpoint(save_dir)  # the script beside 'latest' changes nothing here
    reloaded = restored.module_state_dict()
    same = all(torch.equal(reloaded[k], v) for k, v in ref.items())
    return {"ref": ref, "refused": refused, "reloaded_equal": same} \
        if distributed.get_rank() == 0 else None


def _script_write_fails(save_dir: str) -> dict:
    """A save whose ``zero_to_fp32.py`` cannot be written (rank 0) fails on every rank and
    leaves ``latest`` and the directory as the previous save left them."""
    from shardkit.utils import zero_to_fp32

    def refuse(directory):
        raise OSError(f"{directory}: read-only file system")

    engine, *_ = shardkit.initialize(model=_model(), config=_config(0))
    engine.save_checkpoint(save_dir, tag="good")
    original, zero_to_fp32.write_recovery_script = zero_to_fp32.write_recovery_script, refuse
    try:
        engine.save_checkpoint(save_dir, tag="bad")
        error = None
    except CheckpointError as e:
        error = str(e)
    finally:
        zero_to_fp32.write_recovery_script = original
    return {"error": error, "latest": open(os.path.join(save_dir, "latest")).read(),
            "listing": sorted(os.listdir(save_dir))}


def _tp_model() -> nn.Module:
    from shardkit.nn import model_parallel as mp
    torch.manual_seed(0)
    return nn.Sequential(mp.ColumnParallelLinear(8, 16, gather_output=False), nn.GELU(),
                         mp.RowParallelLinear(16, 8, input_is_parallel=True), nn.LayerNorm(8))


def _save_tensor_parallel(save_dir: str) -> dict:
    from shardkit.nn import model_parallel as mp
    from shardkit.nn.model_parallel.full_state import full_model_state_dict
    mp.initialize_model_parallel(2)
    try:
        engine, *_ = shardkit.initialize(model=_tp_model(), config=_config(1), mpu=mp.initialize)
        g = torch.Generator().manual_seed(mp.get_data_parallel_rank())
        x, y = torch.randn(2, 8, generator=g), torch.randn(2, 8, generator=g)
        engine.backward(((engine(x) - y) ** 2).mean())
        engine.step()
        ref = full_model_state_dict(engine.module)
        engine.save_checkpoint(save_dir)
    finally:
        mp.destroy_model_parallel()
    return {"ref": ref} if distributed.get_rank() == 0 else None


# ----------------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def saved(world2, tmp_path_factory):
    """``{stage: (save_dir, rank 0's result)}`` for stages 0-3 at world 2."""
    root = tmp_path_factory.mktemp("zero_to_fp32")
    out = {}
    for stage in range(4):
        save_dir = str(root / f"stage{stage}")
        out[stage] = (save_dir, world2.run(_save, stage, save_dir)[0])
    return out


def _assert_equal(state: dict, ref: dict, without=()) -> None:
    expected = {k: v for k, v in ref.items() if k not in without}
    assert sorted(state) == sorted(expected)
    for key, value in expected.items():
        assert state[key].dtype == torch.float32 and torch.equal(state[key], value), key


def _fresh_strict(state: dict) -> nn.Module:
    model = TiedGPT()
    model.load_state_dict(state, strict=True)
    return model


def _run_script(save_dir: str, *args: str) -> subprocess.Popen:
    """``python zero_to_fp32.py . ARGS`` in ``save_dir``, as DeepSpeed's users run it."""
    return subprocess.Popen([sys.executable, "zero_to_fp32.py", ".", *args], cwd=save_dir,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


# ----------------------------------------------------------------------------- checks


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_functions_recover_the_engine_state(saved, stage, tmp_path):
    save_dir, result = saved[stage]
    ref = result["ref"]
    assert result["reloaded_equal"]
    assert "zero_to_fp32.py" in result["refused"]
    assert open(os.path.join(save_dir, "latest")).read() == TAG
    assert not torch.distributed.is_initialized()

    state = get_fp32_state_dict_from_zero_checkpoint(save_dir)
    _assert_equal(state, ref)
    assert state["head.weight"] is state["tok_emb.weight"]  # tied, as model.state_dict()
    _fresh_strict(state)
    _assert_equal(get_fp32_state_dict_from_zero_checkpoint(save_dir, TAG,
                                                           exclude_frozen_parameters=True),
                  ref, without=[FROZEN])
    _assert_equal(get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="excluded"),
                  ref, without=[FROZEN])

    fresh = TiedGPT()
    assert load_state_dict_from_zero_checkpoint(fresh, save_dir) is fresh
    _assert_equal(fresh.state_dict(), ref)
    partial = TiedGPT()
    initial = partial.pos_emb.weight.detach().clone()
    load_state_dict_from_zero_checkpoint(partial, save_dir, tag="excluded")
    assert torch.equal(partial.pos_emb.weight, initial)  # left out: the model's own value
    _assert_equal({k: v for k, v in partial.state_dict().items() if k != FROZEN}, ref,
                  without=[FROZEN])

    written = convert_zero_checkpoint_to_fp32_state_dict(save_dir, str(tmp_path / "out"))
    assert written == [str(tmp_path / "out" / "pytorch_model.bin")]
    _assert_equal(torch.load(written[0], weights_only=True), ref)
    convert_zero_checkpoint_to_fp32_state_dict(save_dir, output_file=str(tmp_path / "sd.pt"))
    _fresh_strict(torch.load(tmp_path / "sd.pt", weights_only=True))
    assert not torch.distributed.is_initialized()


def test_script_in_a_subprocess(saved, world4, tmp_path):
    """The script DeepSpeed users run, at every stage, world 2 and world 4, and tensor
    parallel: ``python zero_to_fp32.py . pytorch_model.bin`` (one file, DeepSpeed before 0.15)
    and ``. out_dir --safe_serialization`` (a directory); all run at once."""
    cases = {f"stage{s}": saved[s] for s in range(4)}
    cases["w4stage3"] = (str(tmp_path / "w4"), world4.run(_save, 3, str(tmp_path / "w4"))[0])
    cases["tp"] = (str(tmp_path / "tp"), world4.run(_save_tensor_parallel, str(tmp_path / "tp"))[0])
    assert not os.path.exists(os.path.join(tmp_path, "tp", TAG, "zero_to_fp32.py"))
    runs = {name: _run_script(save_dir, "pytorch_model.bin")
            for name, (save_dir, _) in cases.items()}
    runs["safe"] = _run_script(cases["stage3"][0], str(tmp_path / "safe"), "--safe_serialization",
                               "-t", "excluded", "--exclude_frozen_parameters")
    for name, run in runs.items():
        out, err = run.communicate(timeout=300)
        assert run.returncode == 0, (name, out, err)
    for name, (save_dir, result) in cases.items():
        state = torch.load(os.path.join(save_dir, "pytorch_model.bin"), weights_only=True)
        _assert_equal(state, result["ref"])
        if name != "tp":
            assert state["head.weight"].data_ptr() == state["tok_emb.weight"].data_ptr()
            _fresh_strict(state)
    safetensors = pytest.importorskip("safetensors.torch")
    _assert_equal(safetensors.load_file(str(tmp_path / "safe" / "model.safetensors")),
                  cases["stage3"][1]["ref"], without=[FROZEN])


def test_safetensors_shards_read_by_hugging_face(saved, tmp_path):
    pytest.importorskip("safetensors")
    hub = pytest.importorskip("huggingface_hub")
    save_dir, result = saved[3]
    out = tmp_path / "hf"
    written = convert_zero_checkpoint_to_fp32_state_dict(save_dir, str(out),
                                                         max_shard_size="3KB",
                                                         safe_serialization=True)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(set(index["weight_map"].values()))
    assert len(shards) > 2 and shards[0] == f"model-00001-of-{len(shards):05d}.safetensors"
    assert sorted(written) == sorted([str(out / f) for f in shards] +
                                     [str(out / "model.safetensors.index.json")])
    assert sorted(index["weight_map"]) == sorted(result["ref"])
    model = TiedGPT()
    hub.load_torch_model(model, str(out), strict=True)  # what from_pretrained reads
    _assert_equal(model.state_dict(), result["ref"])
    bins = convert_zero_checkpoint_to_fp32_state_dict(save_dir, str(tmp_path / "bin"),
                                                      max_shard_size=3000)
    assert bins[-1].endswith("pytorch_model.bin.index.json") and len(bins) > 3
    model = TiedGPT()
    hub.load_torch_model(model, str(tmp_path / "bin"), strict=True, safe=False)
    _assert_equal(model.state_dict(), result["ref"])


def test_a_conversion_into_a_used_directory_leaves_only_its_own_weights(saved, tmp_path):
    """Hugging Face reads model.safetensors before pytorch_model.bin, and a single file before
    an index: weights an earlier conversion left in the directory must not stay beside ours."""
    pytest.importorskip("safetensors")
    save_dir, result = saved[3]
    out = tmp_path / "out"
    runs = [dict(safe_serialization=True), dict(), dict(max_shard_size="3KB"),
            dict(max_shard_size="3KB", safe_serialization=True), dict()]
    for kwargs in runs:
        written = convert_zero_checkpoint_to_fp32_state_dict(save_dir, str(out), **kwargs)
        assert sorted(os.listdir(out)) == sorted(os.path.basename(w) for w in written), kwargs
    (out / "config.json").write_text("{}")  # not a weight file: kept
    convert_zero_checkpoint_to_fp32_state_dict(save_dir, str(out), safe_serialization=True)
    assert sorted(os.listdir(out)) == ["config.json", "model.safetensors"]
    with pytest.raises(ValueError, match="max_shard_size='0.5B'"):  # 0 bytes
        convert_zero_checkpoint_to_fp32_state_dict(save_dir, str(out), max_shard_size="0.5B")


def test_bad_inputs_are_clear_errors(saved, tmp_path):
    save_dir, _ = saved[1]
    with pytest.raises(FileNotFoundError, match="nowhere.*not a directory"):
        get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "nowhere"))
    with pytest.raises(CheckpointNotFound, match=r"global_step9.*tags found.*excluded.*"
                                                 r"global_step2"):
        get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="global_step9")
    os.makedirs(tmp_path / "empty")
    with pytest.raises(CheckpointNotFound, match="no 'latest' file.*tag="):
        get_fp32_state_dict_from_zero_checkpoint(str(tmp_path / "empty"))
    with pytest.raises(CheckpointError, match="tag='../x'"):
        get_fp32_state_dict_from_zero_checkpoint(save_dir, tag="../x")
    with pytest.raises(TypeError, match="exclude_frozen_parameters='yes'"):
        get_fp32_state_dict_from_zero_checkpoint(save_dir, exclude_frozen_parameters="yes")
    with pytest.raises(ValueError, match="max_shard_size='5 apples'.*'5GB'"):
        convert_zero_checkpoint_to_fp32_state_dict(save_dir, str(tmp_path / "o"),
                                                   max_shard_size="5 apples")
    with pytest.raises(ValueError, match="max_shard_size='global_step2'.*tag="):
        # DeepSpeed < 0.15's positional tag, which later versions read as max_shard_size
        convert_zero_checkpoint_to_fp32_state_dict(save_dir, str(tmp_path / "sd.bin"), TAG)
    with pytest.raises(ValueError, match="safe_serialization=True.*sd.bin"):
        convert_zero_checkpoint_to_fp32_state_dict(save_dir, str(tmp_path / "sd.bin"),
                                                   safe_serialization=True)
    assert not os.path.exists(tmp_path / "o") and not os.path.exists(tmp_path / "sd.bin")
    wrong = nn.Linear(3, 3)
    before = {k: v.clone() for k, v in wrong.state_dict().items()}
    with pytest.raises(RuntimeError, match=r"missing keys \['bias', 'weight'\].*unexpected"):
        load_state_dict_from_zero_checkpoint(wrong, save_dir)
    assert all(torch.equal(wrong.state_dict()[k], v) for k, v in before.items())
    assert main([save_dir, str(tmp_path / "x.bin"), "-t", "nope"]) == 2
    assert not os.path.exists(tmp_path / "x.bin")


def test_script_write_failure_fails_the_save(world2, tmp_path):
    for r in world2.run(_script_write_fails, str(tmp_path / "ro")):
        assert r["error"] and ("read-only" in r["error"] or "on another rank" in r["error"])
        assert "'latest' still names the previous" in r["error"]
        assert r["latest"] == "good" and r["listing"] == ["good", "latest", "zero_to_fp32.py"]


def test_tied_alias_is_written_in_its_names_shard():
    """A tied alias goes into the shard of the name it shares a tensor with (it went into the
    current shard, which then stored the tensor again past max_shard_size)."""
    from shardkit.utils import zero_to_fp32
    a, b = torch.zeros(100), torch.zeros(100)
    shards = zero_to_fp32._split_into_shards({"a": a, "b": b, "c": a}, 400)
    assert shards == [["a", "c"], ["b"]]
