"""Review of the tensor-parallel RNG streams in engine checkpoints:

- the warning about a resume at another world size names the ranks whose draws are repeated
  correctly when the new world is more than twice the saved one (rank ``r`` takes saved rank
  ``r % saved_world``'s states, so only saved ranks ``0..saved_world-1`` are ever repeated;
  before, it named ranks that do not exist in the checkpoint);
- the RNG warnings point at the caller's ``engine.load_checkpoint(...)`` line, not at a line
  inside shardkit.

One world of 1 gloo rank.
"""

import warnings
from types import SimpleNamespace
from unittest import mock

import torch
import torch.nn as nn

import shardkit
from shardkit.checkpoint import engine_state
from shardkit.nn import model_parallel as mp
from shardkit.testing import world_fixture

world1 = world_fixture(1)


def _resize_warning(saved_world: int, world: int) -> str:
    """The warning rank 0 gives when ``world`` ranks load a checkpoint whose ``saved_world``
    ranks saved different torch generator states."""
    ckpt = SimpleNamespace(path="ckpt", metadata={"world_size": saved_world},
                           rng_by_rank={r: {"torch": torch.full((4,), r, dtype=torch.uint8),
                                            "model_parallel": {}}
                                        for r in range(saved_world)})
    with mock.patch.object(engine_state.distributed, "get_rank", return_value=0), \
            mock.patch.object(engine_state, "_rank_and_world", return_value=(0, world)), \
            warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        engine_state._warn_about_rng_not_continued(None, ckpt, ckpt.rng_by_rank[0])
    [message] = [str(w.message) for w in caught]
    return message


def test_resize_warning_names_the_saved_ranks_that_are_repeated():
    assert "ranks 2..4 repeat the draws (dropout masks) of ranks 0..1;" in _resize_warning(2, 5)
    assert "ranks 4..5 repeat the draws (dropout masks) of ranks 0..1;" in _resize_warning(4, 6)
    assert "ranks 2..3 repeat the draws (dropout masks) of ranks 0..1;" in _resize_warning(2, 4)
    assert "the draws of saved ranks 2..3 are not continued;" in _resize_warning(4, 2)


def _old_checkpoint_warning_location(save_dir: str):
    """Where (file, function) the warning about a checkpoint without the model-parallel
    streams points."""
    def engine():
        torch.manual_seed(0)
        return shardkit.initialize(model=nn.Linear(4, 4), config={
            "train_micro_batch_size_per_gpu": 2, "steps_per_print": 1000,
            "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}, mpu=mp.initialize)[0]

    def without_streams():
        state = rng_state()
        state.pop("model_parallel")
        return state

    rng_state = engine_state.rng_state
    mp.initialize_model_parallel(1)
    try:
        mp.model_parallel_cuda_manual_seed(1)
        with mock.patch.object(engine_state, "rng_state", without_streams):
            engine().save_checkpoint(save_dir)
        loading = engine()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            loading.load_checkpoint(save_dir)
        return [(w.filename, w.lineno) for w in caught if "RNG" in str(w.message)]
    finally:
        mp.destroy_model_parallel()


def test_rng_warnings_point_at_the_callers_load_checkpoint(world1, tmp_path):
    [(filename, lineno)] = world1.run(_old_checkpoint_warning_location, str(tmp_path))[0]
    assert filename == __file__, filename
