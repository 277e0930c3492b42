"""Tensor-parallel corners a Megatron/FairScale user met.

- ``RowParallelLinear`` under ``torch.autocast`` returned an fp32 output where ``nn.Linear``
  returns bf16/fp16: the fp32 bias promoted the low-precision sum, so every activation after it
  (the residual branch, the next LayerNorm's input) was twice the size.
- ``engine.load_checkpoint(dir, tag=...)`` under tensor parallelism, for a tag that does not
  exist (a typo) or whose save was interrupted before its ``tensor_parallel.json``, said the
  checkpoint "was saved at tensor-parallel size 1"; it now names the missing tag (and those
  present) or the interrupted save.
"""

import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit.checkpoint import CheckpointError
from shardkit.checkpoint.sharded import METADATA, write_latest_tag
from shardkit.model_parallel_unit import (ModelParallelGroups, checkpoint_location,
                                          mp_rank_name, write_tensor_parallel_layout)
from shardkit.nn import model_parallel as mp
from shardkit.testing import world_fixture

TP = 2

world2 = world_fixture(2)


def _mlp_under_autocast() -> dict:
    """A column- then row-parallel MLP and the same unsplit ``nn.Linear`` pair under autocast:
    the output dtype of each, the largest difference, and the row layer's bias gradient dtype
    (and with ``skip_bias_add``, the bias returned untouched)."""
    if mp.model_parallel_is_initialized():
        mp.destroy_model_parallel()
    mp.initialize_model_parallel(TP)
    try:
        torch.manual_seed(0)
        col = mp.ColumnParallelLinear(8, 4 * TP, gather_output=False)
        row = mp.RowParallelLinear(4 * TP, 8, input_is_parallel=True)
        skip = mp.RowParallelLinear(4 * TP, 8, input_is_parallel=True, skip_bias_add=True)
        ref_col, ref_row = nn.Linear(8, 4 * TP), nn.Linear(4 * TP, 8)
        with torch.no_grad():
            row.bias.uniform_(-1, 1, generator=torch.Generator().manual_seed(1))
            ref_col.load_state_dict(col.full_state_dict())
            ref_row.load_state_dict(row.full_state_dict())
        x = torch.randn(3, 8, generator=torch.Generator().manual_seed(2))
        result = {}
        for dtype in (torch.bfloat16, torch.float16):
            row.zero_grad()
            with torch.autocast("cpu", dtype=dtype):
                y = row(F.gelu(col(x)))
                want = ref_row(F.gelu(ref_col(x)))
                _, bias = skip(F.gelu(col(x)))
            y.float().sum().backward()
            result[str(dtype)] = {"dtype": y.dtype, "want": want.dtype,
                                  "close": (y.float() - want.float()).abs().max().item() < 2e-2,
                                  "bias_grad": row.bias.grad.dtype, "skipped_bias": bias.dtype}
        return result
    finally:
        mp.destroy_model_parallel()


def test_row_parallel_output_keeps_the_autocast_dtype_as_nn_linear(world2):
    for result in world2.run(_mlp_under_autocast):
        for dtype in (torch.bfloat16, torch.float16):
            assert result[str(dtype)] == {"dtype": dtype, "want": dtype, "close": True,
                                          "bias_grad": torch.float32,
                                          "skipped_bias": torch.float32}, result


def _full_state_of_a_module_named_like_a_wrapper_level() -> dict:
    """``full_model_state_dict`` of a tensor-parallel layer inside a module merely named like
    torch's wrapper level (``my_checkpoint_wrapped_module``): the split weight must be gathered
    whole (the name was cut, the key not found, and this rank's slice returned)."""
    from shardkit.nn.model_parallel.full_state import full_model_state_dict
    if mp.model_parallel_is_initialized():
        mp.destroy_model_parallel()
    mp.initialize_model_parallel(TP)
    try:
        torch.manual_seed(0)
        model = nn.Module()
        model.my_checkpoint_wrapped_module = mp.ColumnParallelLinear(8, 4 * TP,
                                                                     gather_output=False)
        full = full_model_state_dict(model)
        return {k: tuple(v.shape) for k, v in full.items()}
    finally:
        mp.destroy_model_parallel()


def test_full_state_keeps_names_merely_like_a_wrapper_level(world2):
    for shapes in world2.run(_full_state_of_a_module_named_like_a_wrapper_level):
        assert shapes == {"my_checkpoint_wrapped_module.weight": (4 * TP, 8),
                          "my_checkpoint_wrapped_module.bias": (4 * TP,)}, shapes


# ----------------------------------------------------------------------------- checkpoint tags


def _tensor_parallel_tag(load_dir, tag: str, size: int = TP, layout: bool = True) -> None:
    """A tag as a tensor-parallel engine writes it: one mp_rank_XX directory per tensor-parallel
    rank, then (unless the save was cut short) the layout file."""
    for rank in range(size):
        os.makedirs(os.path.join(load_dir, tag, mp_rank_name(rank)))
    if layout:
        write_tensor_parallel_layout(os.path.join(load_dir, tag), size, {"0.weight": (0, 1)})


def _plain_tag(load_dir, tag: str) -> None:
    """A tag written without tensor parallelism: its metadata directly in the tag directory."""
    os.makedirs(os.path.join(load_dir, tag))
    with open(os.path.join(load_dir, tag, METADATA), "w") as f:
        f.write("{}")


def _groups(size: int = TP) -> ModelParallelGroups:
    return ModelParallelGroups(None, tuple(range(size)), None, (0,))


def _refusal(load_dir, tag, parallel) -> str:
    with pytest.raises(CheckpointError) as info:
        checkpoint_location(str(load_dir), tag, parallel)
    return str(info.value)


def test_a_missing_tag_is_named_as_missing_not_as_another_size(tmp_path):
    _tensor_parallel_tag(tmp_path, "step2")
    _plain_tag(tmp_path, "plain")
    message = _refusal(tmp_path, "step3", _groups())
    assert f"{tmp_path / 'step3'} does not exist; tags present: ['plain', 'step2']" in message
    assert "tensor-parallel size" not in message
    write_latest_tag(str(tmp_path), "gone")  # latest naming a deleted tag: the same
    assert f"{tmp_path / 'gone'} does not exist" in _refusal(tmp_path, None, _groups())


def test_an_interrupted_tensor_parallel_save_is_named_as_such(tmp_path):
    _tensor_parallel_tag(tmp_path, "cut", layout=False)
    message = _refusal(tmp_path, "cut", _groups())
    assert "holds mp_rank_XX slices but no tensor_parallel.json" in message, message
    assert "the save was interrupted" in message and "size 1" not in message


def test_size_mismatches_and_readable_tags_behave_as_before(tmp_path):
    _tensor_parallel_tag(tmp_path, "tp")
    _plain_tag(tmp_path, "plain")
    assert "saved at tensor-parallel size 1, this engine runs tensor-parallel size 2" in \
        _refusal(tmp_path, "plain", _groups())
    assert "saved at tensor-parallel size 2, this engine runs tensor-parallel size 1" in \
        _refusal(tmp_path, "tp", None)
    assert checkpoint_location(str(tmp_path), "tp", _groups()) == \
        (str(tmp_path / "tp"), "mp_rank_00")
    assert checkpoint_location(str(tmp_path), "plain", None) == (str(tmp_path), "plain")
    # without tensor parallelism a missing tag is left to the reader, which names it
    assert checkpoint_location(str(tmp_path), "nothing", None) == (str(tmp_path), "nothing")
    assert checkpoint_location(str(tmp_path / "empty"), None, _groups()) == \
        (str(tmp_path / "empty"), None)
