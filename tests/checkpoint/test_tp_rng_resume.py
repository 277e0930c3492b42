"""The RNG states an engine checkpoint carries across a resume (tensor-parallel review 60):

- the model-parallel streams of ``get_cuda_rng_tracker()`` are saved and restored (Megatron's
  ``rng_tracker_states``): dropout inside ``tracker.fork()`` after a resume draws the masks the
  uninterrupted run draws, and the weights after more steps are the same, at TP 2 x DP 2 and
  TP 2, ZeRO stages 0-2, also with ``load_optimizer_states=False`` /
  ``load_lr_scheduler_states=False`` (before: the streams went on from the seed);
- a checkpoint written without the streams still loads, with one warning, and leaves the
  tracker's streams as seeded;
- at another world size, rank ``r`` resumes saved rank ``r % saved_world``'s states: exact when
  the saved ranks' states are equal (a tensor-parallel run's data-parallel replicas), a warning
  when they differ (ranks seeded apart), rather than repeating draws silently.

One world of 4 gloo ranks (tensor groups [0,1] [2,3]) and one of 2.
"""

import warnings
from unittest import mock

import pytest
import torch
import torch.nn as nn

import shardkit
from shardkit.checkpoint import engine_state
from shardkit.nn import model_parallel as mp
from shardkit.nn.model_parallel.full_state import full_model_state_dict
from shardkit.testing import world_fixture

WIDTH, SEED = 8, 1234

world4 = world_fixture(4)
world2 = world_fixture(2)


class _DropoutBlock(nn.Module):
    """Column- then row-parallel linear with dropout on the sharded activation (inside the
    tracker's fork) and on the replicated one (the default generator)."""

    def __init__(self):
        super().__init__()
        self.up = mp.ColumnParallelLinear(WIDTH, 4 * WIDTH, gather_output=False)
        self.down = mp.RowParallelLinear(4 * WIDTH, WIDTH, input_is_parallel=True)
        self.head = nn.Linear(WIDTH, 2)

    def forward(self, x):
        h = self.up(x)
        with mp.get_cuda_rng_tracker().fork():
            h = nn.functional.dropout(h, 0.5)
        return self.head(nn.functional.dropout(self.down(h), 0.5))


def _engine(stage: int):
    torch.manual_seed(0)  # the same master weights on every rank: each keeps its slices
    model = _DropoutBlock()
    config = {"train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}},  # stateless: see below
              "zero_optimization": {"stage": stage}}
    return shardkit.initialize(model=model, config=config, mpu=mp.initialize)[0]


def _train(engine, first: int, steps: int) -> list:
    """The outputs (dropout masks included) of ``steps`` steps from step ``first``."""
    outputs = []
    for step in range(first, first + steps):
        g = torch.Generator().manual_seed(10 * step + mp.get_data_parallel_rank())
        out = engine(torch.randn(2, WIDTH, generator=g))
        outputs.append(out.detach().clone())
        engine.backward(out.pow(2).mean())
        engine.step()
    return outputs


def _loaded_with_warnings(engine, load_dir: str, **kwargs) -> list:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine.load_checkpoint(load_dir, **kwargs)
    return [str(w.message) for w in caught if "RNG" in str(w.message)]


def _with_tp2(fn, *args):
    mp.initialize_model_parallel(2)
    try:
        return fn(*args)
    finally:
        mp.destroy_model_parallel()


def _resume_continues(save_dir: str) -> dict:
    """For each stage (and stage 1 loading neither the optimizer nor the scheduler states):
    whether the resumed run's next outputs and weights equal the uninterrupted run's."""
    results = {}
    for stage, kwargs in ((0, {}), (1, {}), (2, {}),
                          (1, dict(load_optimizer_states=False, load_lr_scheduler_states=False))):
        mp.model_parallel_cuda_manual_seed(SEED)
        engine = _engine(stage)
        _train(engine, 0, 2)
        directory = f"{save_dir}/{stage}-{len(kwargs)}"
        engine.save_checkpoint(directory)
        expected = _train(engine, 2, 2)
        expected_weights = full_model_state_dict(engine.module)
        mp.model_parallel_cuda_manual_seed(SEED)  # a restarted script seeds again, then loads
        resumed = _engine(stage)
        rng_warnings = _loaded_with_warnings(resumed, directory, **kwargs)
        outputs = _train(resumed, 2, 2)
        weights = full_model_state_dict(resumed.module)
        results[(stage, len(kwargs))] = {
            "outputs": all(torch.equal(a, b) for a, b in zip(expected, outputs)),
            "weights": all(torch.equal(weights[k], expected_weights[k]) for k in weights),
            "warnings": rng_warnings}
    return results


def _old_checkpoint_loads(save_dir: str) -> dict:
    """A checkpoint whose RNG state lacks the tracker's streams (written before they were
    saved) loads; the streams keep the state they were seeded with."""
    def without_streams():
        state = rng_state()
        state.pop("model_parallel", None)
        return state

    rng_state = engine_state.rng_state
    mp.model_parallel_cuda_manual_seed(SEED)
    engine = _engine(1)
    _train(engine, 0, 1)
    with mock.patch.object(engine_state, "rng_state", without_streams):
        engine.save_checkpoint(save_dir)
    mp.model_parallel_cuda_manual_seed(SEED)
    seeded = mp.get_cuda_rng_tracker().get_states()
    resumed = _engine(1)
    rng_warnings = _loaded_with_warnings(resumed, save_dir)
    after = mp.get_cuda_rng_tracker().get_states()
    return {"warnings": rng_warnings, "steps": resumed.global_steps,
            "streams_as_seeded": after.keys() == seeded.keys()
            and all(torch.equal(after[k], seeded[k]) for k in seeded)}


def _unusable_streams_fail_before_loading(save_dir: str) -> dict:
    """A checkpoint whose saved stream is no generator state: refused on every rank before
    any weight is written (rather than after, half loaded)."""
    def with_bad_stream():
        return {**rng_state(), "model_parallel": {"model-parallel-rng": torch.zeros(3)}}

    rng_state = engine_state.rng_state
    mp.model_parallel_cuda_manual_seed(SEED)
    engine = _engine(0)
    _train(engine, 0, 1)
    with mock.patch.object(engine_state, "rng_state", with_bad_stream):
        engine.save_checkpoint(save_dir)
    fresh = _engine(0)
    before = {k: v.clone() for k, v in fresh.module.state_dict().items()}
    try:
        fresh.load_checkpoint(save_dir)
        error = None
    except Exception as e:  # noqa: BLE001 - the type is asserted by the test
        error = f"{type(e).__name__}: {e}"
    return {"error": error, "steps": fresh.global_steps,
            "unchanged": all(torch.equal(v, before[k])
                             for k, v in fresh.module.state_dict().items())}


def test_resumed_tp_dropout_continues_as_the_uninterrupted_run(world4, world2, tmp_path):
    for world, name in ((world4, "tp2-dp2"), (world2, "tp2")):
        for rank, r in enumerate(world.run(_with_tp2, _resume_continues, str(tmp_path / name))):
            for case, result in r.items():
                assert result["outputs"] and result["weights"], (name, rank, case, result)
                assert result["warnings"] == [], (name, rank, case, result)
    results = world2.run(_with_tp2, _old_checkpoint_loads, str(tmp_path / "old"))
    assert all(r["steps"] == 1 and r["streams_as_seeded"] for r in results), results
    assert results[1]["warnings"] == [], results  # once: rank 0 warns
    [message] = results[0]["warnings"]
    assert "holds no model-parallel RNG streams" in message and \
        "'model-parallel-rng'" in message, message
    for r in world2.run(_with_tp2, _unusable_streams_fail_before_loading,
                        str(tmp_path / "bad")):
        assert r["error"] is not None and r["error"].startswith("CheckpointError"), r
        assert "model-parallel RNG streams cannot be restored" in r["error"] and \
            "'model-parallel-rng'" in r["error"], r
        assert r["unchanged"] and r["steps"] == 0, r


# ----------------------------------------------------------------------------- world sizes


def _save_tp2_dp2(save_dir: str):
    mp.model_parallel_cuda_manual_seed(SEED)
    engine = _engine(1)
    _train(engine, 0, 2)
    engine.save_checkpoint(save_dir)
    return mp.get_cuda_rng_tracker().get_states(), torch.get_rng_state()


def _load_tp2(save_dir: str):
    mp.model_parallel_cuda_manual_seed(SEED + 1)  # other streams: the load must replace them
    engine = _engine(1)
    rng_warnings = _loaded_with_warnings(engine, save_dir)
    return mp.get_cuda_rng_tracker().get_states(), torch.get_rng_state(), rng_warnings


def _save_seeded_apart(save_dir: str):
    """A data-parallel run whose ranks seed apart (``seed + rank``), saved at its world."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout(0.5))
    engine = shardkit.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})[0]
    torch.manual_seed(100 + torch.distributed.get_rank())
    engine.backward(engine(torch.randn(2, WIDTH)).sum())
    engine.step()
    engine.save_checkpoint(save_dir)
    return torch.get_rng_state()


def _load_seeded_apart(save_dir: str):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(WIDTH, WIDTH), nn.Dropout(0.5))
    engine = shardkit.initialize(model=model, config={
        "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
        "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})[0]
    rng_warnings = _loaded_with_warnings(engine, save_dir)
    loaded = torch.get_rng_state()
    # load_rng_state=False (what load_module_only wants): kept as it is, and no warning
    torch.manual_seed(7)
    kept = torch.get_rng_state()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine_state.load_engine_checkpoint(engine, save_dir, None, load_rng_state=False)
    unchanged = torch.equal(torch.get_rng_state(), kept) and \
        not [w for w in caught if "RNG" in str(w.message)]
    return loaded, rng_warnings, unchanged


def test_resume_at_another_world_size_warns_when_rng_cannot_continue(world4, world2, tmp_path):
    # TP2 x DP2 -> TP2 x DP1: the replicas' states were equal, each tensor-parallel rank
    # continues its own streams exactly, no warning
    saved = world4.run(_with_tp2, _save_tp2_dp2, str(tmp_path / "tp"))
    for rank, (streams, default, rng_warnings) in enumerate(
            world2.run(_with_tp2, _load_tp2, str(tmp_path / "tp"))):
        assert streams.keys() == saved[rank][0].keys(), rank
        assert all(torch.equal(v, saved[rank][0][k]) for k, v in streams.items()), rank
        assert torch.equal(default, saved[rank][1]) and rng_warnings == [], (rank, rng_warnings)
    # ranks seeded apart, 4 -> 2: rank r takes saved rank r's states, and rank 0 says that
    # the draws of saved ranks 2 and 3 are not continued
    saved = world4.run(_save_seeded_apart, str(tmp_path / "dp"))
    loaded = world2.run(_load_seeded_apart, str(tmp_path / "dp"))
    assert all(torch.equal(state, saved[rank]) for rank, (state, *_) in enumerate(loaded))
    assert all(unchanged for *_, unchanged in loaded)
    assert loaded[1][1] == [], loaded[1][1]
    [message] = loaded[0][1]
    assert "4 ranks saved different torch RNG states" in message and "2 ranks load it" in message \
        and "saved ranks 2..3 are not continued" in message, message


# ----------------------------------------------------------------------------- devices


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a process without CUDA")
def test_streams_saved_with_cuda_resume_on_a_cpu_only_process():
    # a GPU run's checkpoint holds each stream's CPU state then its CUDA state; a process
    # without CUDA continues the CPU part (as the default generators' "cuda" entry is skipped)
    # rather than refusing the whole load
    from shardkit.nn.model_parallel.random import RNGStatesTracker
    saving = RNGStatesTracker()
    saving.add("model-parallel-rng", SEED)
    with saving.fork():
        torch.rand(3)
    saved = {name: torch.cat([state, torch.arange(16, dtype=torch.uint8)])  # + a CUDA part
             for name, state in saving.get_states().items()}
    resumed = RNGStatesTracker()
    resumed.add("other-stream", SEED + 1)
    before = torch.get_rng_state()
    resumed.resume_states(saved)
    assert sorted(resumed.names()) == ["model-parallel-rng", "other-stream"]  # others kept
    with saving.fork():
        expected = torch.rand(5)
    with resumed.fork():
        assert torch.equal(torch.rand(5), expected)
    assert torch.equal(torch.get_rng_state(), before)
