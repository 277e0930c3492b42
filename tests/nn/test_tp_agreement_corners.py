"""Corners of the tensor-parallel ranks' agreement (construction and forward) and of the
pipeline replicas' agreement, from a review, as a Megatron / FairScale user drives them: worlds
of 2 (tensor-parallel size 2) and 4 (tensor-parallel size 2 beside data or pipeline
parallelism; two pipelines of two stages).

Found and fixed:

- Equal arguments of other numeric types (``out_features=np.int64(16)`` on one rank, ``16`` on
  the other; ``max_norm=1`` beside ``1.0``) were refused at construction as "built with
  different arguments: out_features per tensor-parallel rank: [16, np.int64(16)]", a layer
  that works; the ranks now compare numbers by value.
- A model built on some ranks only (rank 0 counting the parameters under ``torch.device("meta")``,
  a common log line) now joins the construction agreement: rank 0's meta layers paired with
  the other rank's real ones, and the next layer rank 0 built waited forever (the world's
  timeout), where it ran before. Construction stays collective (a warning says so); built in
  ``model_parallel.local_construction()``, layers agree at their first forward instead.
- A frozen stage put in ``eval()`` on purpose (no parameter requiring grad) made every rank of
  the pipeline warn that its stage modules are in different modes; it is now left out.

Checked and held (no change): the agreement runs over the tensor-parallel group only (data- and
pipeline-parallel peers build other layers), activation checkpointing (reentrant and not)
recomputing a forward in the collective debug mode, ``deepcopy`` of a layer (no new agreement).
"""

import copy
import warnings

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed
from shardkit.collective_check import set_debug_collectives
from shardkit.nn import model_parallel as mp
from shardkit.testing import world_fixture

world2 = world_fixture(2, timeout=60)  # a hang fails its test in a minute
world4 = world_fixture(4, timeout=90)

TOL = 1e-5


def _setup(tp: int, pp: int = 1) -> None:
    if mp.model_parallel_is_initialized():
        mp.destroy_model_parallel()
    mp.initialize_model_parallel(tp, pp)


def _outcome(call) -> tuple:
    """``("ok", what call() returned)`` or ``(error class name, message)``."""
    try:
        return "ok", call()
    except Exception as error:  # what the user sees
        return type(error).__name__, str(error)


class _Block(nn.Module):
    """A Megatron MLP block: column-parallel up, row-parallel down."""

    def __init__(self, hidden: int = 16):
        super().__init__()
        self.up = mp.ColumnParallelLinear(8, hidden, gather_output=False)
        self.down = mp.RowParallelLinear(hidden, 8, input_is_parallel=True)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


def _numeric_types() -> dict:
    """Layers whose arguments are equal in value but of another type on rank 1."""
    _setup(2)
    odd = distributed.get_rank() % 2 == 1
    found = {}
    found["np.int64 out_features"] = _outcome(lambda: tuple(mp.ColumnParallelLinear(
        8, np.int64(16) if odd else 16, gather_output=True)(torch.ones(2, 8)).shape))
    found["max_norm 1 / 1.0"] = _outcome(lambda: tuple(mp.ParallelEmbedding(
        10, 8, max_norm=1 if odd else 1.0)(torch.tensor([[1, 2]])).shape))
    found["np.int32 num_embeddings"] = _outcome(lambda: tuple(mp.VocabParallelEmbedding(
        np.int32(10) if odd else 10, 4)(torch.tensor([[1, 9]])).shape))
    # still refused: another value, shown as the number it is
    found["np.int64(32) vs 16"] = _outcome(lambda: mp.ColumnParallelLinear(
        8, np.int64(32) if odd else 16))
    return found


def test_equal_arguments_of_other_numeric_types_agree(world2):
    """Was: ``ValueError: ColumnParallelLinear: the tensor-parallel ranks (global ranks [0, 1])
    were built with different arguments: out_features per tensor-parallel rank: [16,
    np.int64(16)]`` (and ``max_norm ...: [1.0, 1]``) on every rank, for layers that work. Now
    numbers compare by value; a different value is still refused, with every rank's value."""
    for rank, found in enumerate(world2.run(_numeric_types)):
        assert found["np.int64 out_features"] == ("ok", (2, 16)), (rank, found)
        assert found["max_norm 1 / 1.0"] == ("ok", (1, 2, 8)), (rank, found)
        assert found["np.int32 num_embeddings"] == ("ok", (1, 2, 4)), (rank, found)
        kind, message = found["np.int64(32) vs 16"]
        assert kind == "ValueError", (rank, found)
        assert "out_features per tensor-parallel rank: [16, 32]" in message, (rank, message)


def _meta_models() -> dict:
    """Construction in ``local_construction()``: on rank 0 only (on meta); on every rank (on
    meta), then materialised; on every rank with other sizes; a deep copy of one still to
    agree."""
    _setup(2)
    rank = distributed.get_rank()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(1))
    found = {}
    if rank == 0:  # rank 0 logs the model's size, built where nothing is allocated
        with torch.device("meta"), mp.local_construction():
            found["counted"] = sum(p.numel() for p in _Block().parameters())
    torch.manual_seed(0)
    real = _Block()
    found["real"] = real(x).detach()
    torch.manual_seed(0)
    with torch.device("meta"), mp.local_construction():
        lazy = _Block()
    lazy.to_empty(device="cpu")
    torch.manual_seed(0)
    lazy.up.reset_parameters()
    lazy.down.reset_parameters()
    twin = copy.deepcopy(lazy)  # still to agree: its own first forward does
    found["materialised"] = lazy(x).detach()
    found["twin"] = twin(x).detach()
    with mp.local_construction():
        other = _Block(hidden=16 if rank == 0 else 32)
    found["other sizes"] = _outcome(lambda: other(x))
    found["other sizes again"] = _outcome(lambda: other(x))  # asked again, raised again
    return found


def test_a_model_built_on_some_ranks_only_can_defer_its_agreement(world2):
    """Was: rank 0's meta layers (built to count parameters) joined the construction
    agreement of rank 1's real ones, and rank 0's next real layer waited forever (the world's
    timeout), where the same program ran before the agreement existed, with no way around.
    Now such a model is built in ``local_construction()``: its layers agree at their first
    forward, before any collective; materialised on every rank they compute what layers
    built outside do, and built with other sizes they raise one ValueError on every rank
    there, each time they are called."""
    results = world2.run(_meta_models)
    assert results[0]["counted"] == 8 * 8 + 8 + 8 * 8 + 8, results[0]["counted"]
    for rank, found in enumerate(results):
        assert torch.allclose(found["materialised"], found["real"], atol=TOL), rank
        assert torch.allclose(found["twin"], found["real"], atol=TOL), rank
        for key in ("other sizes", "other sizes again"):
            kind, message = found[key]
            assert kind == "ValueError", (rank, key, found[key])
            assert "out_features per tensor-parallel rank: [16, 32]" in message, (rank, message)
    assert torch.allclose(results[0]["real"], results[1]["real"], atol=TOL)


def _held_tp() -> dict:
    """Checks that held: activation checkpointing and deepcopy in the collective debug mode."""
    from torch.utils.checkpoint import checkpoint

    _setup(2)
    torch.manual_seed(0)
    block = _Block()
    x = torch.randn(4, 8, generator=torch.Generator().manual_seed(2))
    found = {}
    set_debug_collectives(True)
    try:
        for reentrant in (False, True):
            xs = x.clone().requires_grad_()
            checkpoint(block, xs, use_reentrant=reentrant).square().sum().backward()
            found[f"reentrant={reentrant}"] = xs.grad
        found["deepcopy"] = copy.deepcopy(block)(x).detach()
    finally:
        set_debug_collectives(False)
    xs = x.clone().requires_grad_()
    block(xs).square().sum().backward()
    found["plain"] = xs.grad
    found["plain out"] = block(x).detach()
    return found


def test_checkpointing_and_deepcopy_in_debug_mode_agree_alike(world2):
    """Recomputation re-runs each layer's forward agreement on every rank alike (no hang, the
    plain gradient); a deep copy computes what its original does without a new agreement."""
    for rank, found in enumerate(world2.run(_held_tp)):
        for key in ("reentrant=False", "reentrant=True"):
            assert torch.allclose(found[key], found["plain"], atol=TOL), (rank, key)
        assert torch.allclose(found["deepcopy"], found["plain out"], atol=TOL), rank


def _beside_other_parallelism() -> dict:
    """World 4, tensor-parallel size 2: data-parallel peers and pipeline stages build other
    layers than their neighbours' tensor-parallel group."""
    rank = distributed.get_rank()
    found = {}
    _setup(2)
    found["data"] = _outcome(lambda: tuple(mp.ColumnParallelLinear(
        8, 16 if rank < 2 else 32, gather_output=True)(torch.ones(3, 8)).shape))
    _setup(2, 2)
    if mp.get_pipeline_parallel_rank() == 0:
        found["pipeline"] = _outcome(lambda: tuple(mp.VocabParallelEmbedding(32, 8)(
            torch.zeros(2, 3, dtype=torch.long)).shape))
    else:
        found["pipeline"] = _outcome(lambda: tuple(mp.RowParallelLinear(
            8, 4, input_is_parallel=False)(torch.ones(2, 8)).shape))
    mp.destroy_model_parallel()
    return found


def _frozen_stage_modes() -> list:
    """Four stages: stage 0 frozen and in eval(); then stage 2 also in eval() with its
    parameters trainable. The mixed-mode warnings each schedule's first step gave."""
    from shardkit.nn.pipe import PipelineStage, Schedule1F1B, split_sequential

    rank = distributed.get_rank()
    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Sequential(nn.Linear(8, 8), nn.Dropout(0.0), nn.Tanh())
                            for _ in range(4)])
    module = split_sequential(model, [1, 1, 1, 1])[rank]
    if rank == 0:
        module.requires_grad_(False).eval()
    caught = []
    for second in (False, True):
        if second and rank == 2:
            module.eval()
        schedule = Schedule1F1B(PipelineStage(module, rank, 4), 2, F.mse_loss)
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(3))
        with warnings.catch_warnings(record=True) as seen:
            warnings.simplefilter("always")
            schedule.step(x, target=torch.zeros(4, 8))
        caught.append([str(w.message) for w in seen if "same mode" in str(w.message)])
    return caught


def test_tp_agreement_spans_the_tensor_group_and_a_frozen_stage_is_no_mixed_mode(world4):
    """Tensor-parallel agreement beside data and pipeline parallelism runs over the
    tensor-parallel group only (held). Was: a frozen first stage in eval() (no parameter
    requiring grad) while the others train made every rank warn "the pipeline's stage
    modules are not all in the same mode"; now it is left out, and a trainable stage in
    eval() beside training ones still warns on every rank."""
    for rank, found in enumerate(world4.run(_beside_other_parallelism)):
        assert found["data"] == ("ok", (3, 16 if rank < 2 else 32)), (rank, found)
        assert found["pipeline"] == ("ok", (2, 3, 8) if rank < 2 else (2, 4)), (rank, found)
    for rank, (frozen, mixed) in enumerate(world4.run(_frozen_stage_modes)):
        assert frozen == [], (rank, frozen)
        assert len(mixed) == 1 and "same mode" in mixed[0], (rank, mixed)
