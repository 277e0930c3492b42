"""Review of 5937b6a (tensor parallelism): the engine's sum of sequence-parallel gradients.

The engine sums the gradients of marked (sequence-parallel) parameters over the tensor-parallel
group before its step, "not again where the script summed them itself". It told the two apart
by the gradient's version counter, which any in-place change moves. So a Megatron-style script
that summed them, then clipped (``mp.clip_grad_norm`` or torch's ``clip_grad_norm_``, which
scale in place even when nothing is clipped) had them summed twice; and one that summed some
of them (one submodule's) had those summed twice, since the engine summed all of them once
any was due. Both stepped silently off the model without sequence parallelism (0.07 after 2
SGD steps). Now a hook sees each backward's accumulation: clipping keeps a gradient
summed, and the engine sums only the gradients still due.

``broadcast_data`` of an int16 batch (or uint16/32/64) raised gloo's "Invalid scalar type" on
every rank, naming nothing (NCCL has no int16 either); the flat buffer now travels as bytes.
"""

import torch
import torch.nn as nn

import shardkit
from shardkit.nn import model_parallel as mp
from shardkit.nn.model_parallel.data import broadcast_data
from shardkit.nn.model_parallel.full_state import full_model_state_dict
from shardkit.testing import world_fixture

TP, DP = 2, 2
WIDTH, OUT, SEQ, MICRO, GAS = 8, 4, 4, 2, 2

world4 = world_fixture(4)


def _model(sequence_parallel: bool) -> nn.Module:
    """Column -> GELU -> Row, then a LayerNorm and a head that run on this rank's part of the
    sequence (marked) when ``sequence_parallel``."""
    torch.manual_seed(0)
    model = nn.Sequential(
        mp.ColumnParallelLinear(WIDTH, 2 * WIDTH, gather_output=False,
                                sequence_parallel=sequence_parallel),
        nn.GELU(), mp.RowParallelLinear(2 * WIDTH, WIDTH, input_is_parallel=True,
                                        sequence_parallel=sequence_parallel),
        nn.LayerNorm(WIDTH), nn.Linear(WIDTH, OUT))
    if sequence_parallel:
        mp.mark_sequence_parallel(model[3])
        mp.mark_sequence_parallel(model[4])
    return model


def _config(stage: int) -> dict:
    # SGD: a gradient summed twice moves the weights twice as far (Adam would hide it)
    return {"train_micro_batch_size_per_gpu": MICRO, "gradient_accumulation_steps": GAS,
            "steps_per_print": 1000, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "zero_optimization": {"stage": stage}}


def _script_sums(engine, how: str) -> None:
    """What the script does at the accumulation boundary, before ``engine.step()``."""
    if how == "sums_then_clips":  # Megatron's order: sum, then clip by the global norm
        mp.reduce_sequence_parallel_grads(engine.module)
        mp.clip_grad_norm(engine.module.parameters(), 1e9)
    elif how == "sums_then_torch_clip":
        mp.reduce_sequence_parallel_grads(engine.module)
        torch.nn.utils.clip_grad_norm_(engine.module.parameters(), 1e9)
    elif how == "sums_one_submodule":
        mp.reduce_sequence_parallel_grads(engine.module[3])


def _trained(stage: int, how: str) -> dict:
    """The unsplit weights after 2 steps; ``how`` "plain" is the model without sequence
    parallelism, the others sequence-parallel with the script's own sums."""
    sp = how != "plain"
    tp = mp.get_model_parallel_rank()
    mine = slice(tp * SEQ // TP, (tp + 1) * SEQ // TP)
    engine, *_ = shardkit.initialize(model=_model(sp), config=_config(stage), mpu=mp.initialize)
    rows = slice(mp.get_data_parallel_rank() * MICRO * GAS,
                 (mp.get_data_parallel_rank() + 1) * MICRO * GAS)
    for step in range(2):
        g = torch.Generator().manual_seed(300 + step)
        x = torch.randn(MICRO * GAS * DP, SEQ, WIDTH, generator=g)[rows]
        y = torch.randn(MICRO * GAS * DP, SEQ, OUT, generator=g)[rows]
        for xb, yb in zip(x.split(MICRO), y.split(MICRO)):
            if sp:  # this rank's part of the sequence, its share of the mean loss
                loss = ((engine(xb[:, mine]) - yb[:, mine]) ** 2).sum() / yb.numel()
            else:
                loss = ((engine(xb) - yb) ** 2).mean()
            engine.backward(loss)
            if engine.is_gradient_accumulation_boundary():
                _script_sums(engine, how)
            engine.step()
    return full_model_state_dict(engine.module)


def _distance_from_plain_training() -> dict:
    mp.initialize_model_parallel(TP)
    try:
        out = {}
        for stage in (0, 2):
            plain = _trained(stage, "plain")
            for how in ("sums_then_clips", "sums_then_torch_clip", "sums_one_submodule"):
                got = _trained(stage, how)
                out[(stage, how)] = max((got[k] - plain[k]).abs().max().item() for k in plain)
        return out
    finally:
        mp.destroy_model_parallel()


def test_the_engine_does_not_sum_again_what_the_script_summed_then_clipped(world4):
    """Before: 0.07 off after 2 SGD steps (summed, clipped, summed again by the engine; one
    submodule's gradients summed by the script, then all of them by the engine)."""
    for rank, distances in enumerate(world4.run(_distance_from_plain_training)):
        assert len(distances) == 6, distances
        for case, worst in distances.items():
            assert worst < 1e-5, (rank, case, worst)


def _batches_of_every_dtype_received() -> dict:
    """Per dtype, whether every rank got tensor-parallel rank 0's batch (odd shapes: a scalar,
    an empty and a transposed tensor), else the error."""
    mp.initialize_model_parallel(TP)
    try:
        source = mp.get_model_parallel_rank() == 0
        out = {}
        for dtype in (torch.int16, torch.uint16, torch.bool, torch.int64, torch.bfloat16,
                      torch.complex64):
            g = torch.Generator().manual_seed(1)
            batch = {"scalar": torch.tensor(7).to(dtype), "empty": torch.zeros(3, 0).to(dtype),
                     "text": (torch.randn(4, 5, generator=g) * 9).to(dtype).t()}
            try:
                got = broadcast_data(list(batch), batch if source else None, dtype)
                out[str(dtype)] = all(torch.equal(got[k], v) and got[k].dtype == dtype
                                      for k, v in batch.items())
            except RuntimeError as error:
                out[str(dtype)] = str(error)[:80]
        return out
    finally:
        mp.destroy_model_parallel()


def test_broadcast_data_sends_a_batch_of_any_dtype(world4):
    """Before: int16 and uint16 raised "Invalid scalar type" (gloo) on every rank."""
    for received in world4.run(_batches_of_every_dtype_received):
        assert received == dict.fromkeys(received, True) and len(received) == 6, received
