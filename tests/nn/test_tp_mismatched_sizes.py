"""Tensor-parallel layers built or fed with sizes that differ across the ranks of a
tensor-parallel group, in one world of 2 gloo ranks (tensor-parallel size 2).

Before, ``ColumnParallelLinear(64, 128)`` on rank 0 beside ``(64, 96)`` on rank 1 made gloo
abort rank 1 in the first forward ("op.preamble.length <= op.nbytes. 512 vs 384") while rank 0
returned garbage; ``RowParallelLinear`` of another ``in_features`` and ``VocabParallelEmbedding``
of another vocabulary ran on without an error (the all-reduced sizes happened to fit);
inputs whose batch or sequence length differ across the ranks aborted gloo (the linear layers,
the sequence-parallel mappings) or hung (``vocab_parallel_cross_entropy``); an argument refused
on one rank alone (``out_features=97``) raised there while the others went on.

Now every rank raises the same clear error, before any collective of the layer: at
construction a ``ValueError`` naming each differing argument with every rank's value, or one
rank's refusal on every rank; in forward, in the collective debug mode
(``SHARDKIT_DEBUG_COLLECTIVES=1``), a ``ValueError`` with every rank's input shape. After each
error the world still works and correct layers still compute what the unsplit layers do. The
agreement costs one control all-gather per construction, and per forward in the debug mode
only (not counted by ``CommCounter``); the counted traffic is unchanged.
"""

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit import distributed
from shardkit.distributed import CommCounter, set_debug_collectives
from shardkit.nn import model_parallel as mp
from shardkit.testing import CountedControlGathers, world_fixture

TP = 2
TOL = 1e-5

world2 = world_fixture(2, timeout=120)


def _setup() -> int:
    if mp.model_parallel_is_initialized():
        mp.destroy_model_parallel()
    mp.initialize_model_parallel(TP)
    return mp.get_model_parallel_rank()


def _outcome(call) -> tuple:
    """``(error class name, message)``, or ``("ok", None)`` when ``call()`` raised nothing."""
    try:
        call()
    except Exception as error:  # what the user sees
        return type(error).__name__, str(error)
    return "ok", None


def _world_works() -> bool:
    t = torch.ones(1)
    distributed.all_reduce(t)
    return t.item() == float(distributed.get_world_size())


def _parity_of_correct_layers(rank: int) -> float:
    """A correct Column -> gelu -> Row pair against the unsplit ``nn.Linear`` pair, forward and
    input gradient: the largest difference."""
    torch.manual_seed(0)
    ref = nn.Sequential(nn.Linear(8, 16), nn.GELU(), nn.Linear(16, 8))
    fc = mp.ColumnParallelLinear(8, 16, gather_output=False)
    out = mp.RowParallelLinear(16, 8, input_is_parallel=True)
    fc.load_full_state_dict(ref[0].state_dict())
    out.load_full_state_dict(ref[2].state_dict())
    x = torch.randn(3, 8, generator=torch.Generator().manual_seed(1))
    x_ref, x_tp = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_ref, y_tp = ref(x_ref), out(F.gelu(fc(x_tp)))
    y_ref.sum().backward()
    y_tp.sum().backward()
    return max((y_ref - y_tp).abs().max().item(), (x_ref.grad - x_tp.grad).abs().max().item())


# ----------------------------------------------------------------------------- construction

# name -> builder(rank): each rank builds the layer with its own arguments
_MISMATCHED_LAYERS = {
    "Column out_features": lambda r: mp.ColumnParallelLinear(64, 128 if r == 0 else 96),
    "Column in_features": lambda r: mp.ColumnParallelLinear(64 if r == 0 else 32, 16),
    "Column gather_output": lambda r: mp.ColumnParallelLinear(8, 16, gather_output=r == 0),
    "Column bias": lambda r: mp.ColumnParallelLinear(8, 16, bias=r == 0),
    "Column stride": lambda r: mp.ColumnParallelLinear(8, 12, stride=1 if r == 0 else 3),
    "Column sequence_parallel": lambda r: mp.ColumnParallelLinear(
        8, 16, gather_output=False, sequence_parallel=r == 1),
    "Row in_features": lambda r: mp.RowParallelLinear(64 if r == 0 else 32, 16),
    "Row input_is_parallel": lambda r: mp.RowParallelLinear(16, 8, input_is_parallel=r == 0),
    "Row skip_bias_add": lambda r: mp.RowParallelLinear(16, 8, skip_bias_add=r == 1),
    "Vocab num_embeddings": lambda r: mp.VocabParallelEmbedding(100 if r == 0 else 50, 8),
    "Vocab padding_idx": lambda r: mp.VocabParallelEmbedding(10, 8, padding_idx=r),
    "Vocab max_norm": lambda r: mp.VocabParallelEmbedding(10, 8, max_norm=1.0 + r),
    "ParallelEmbedding embedding_dim": lambda r: mp.ParallelEmbedding(10, 8 if r == 0 else 4),
    "different layers": lambda r: (mp.ColumnParallelLinear(8, 16) if r == 0
                                   else mp.RowParallelLinear(8, 16)),
}
# name -> the fragments every rank's message must hold
_EXPECTED = {
    "Column out_features": ["ColumnParallelLinear", "out_features per tensor-parallel rank: "
                            "[128, 96]"],
    "Column in_features": ["in_features per tensor-parallel rank: [64, 32]"],
    "Column gather_output": ["gather_output per tensor-parallel rank: [True, False]"],
    "Column bias": ["bias per tensor-parallel rank: [True, False]"],
    "Column stride": ["stride per tensor-parallel rank: [1, 3]"],
    "Column sequence_parallel": ["sequence_parallel per tensor-parallel rank: [False, True]"],
    "Row in_features": ["RowParallelLinear", "in_features per tensor-parallel rank: [64, 32]"],
    "Row input_is_parallel": ["input_is_parallel per tensor-parallel rank: [True, False]"],
    "Row skip_bias_add": ["skip_bias_add per tensor-parallel rank: [False, True]"],
    "Vocab num_embeddings": ["VocabParallelEmbedding",
                             "num_embeddings per tensor-parallel rank: [100, 50]"],
    "Vocab padding_idx": ["padding_idx per tensor-parallel rank: [0, 1]"],
    "Vocab max_norm": ["max_norm per tensor-parallel rank: [1.0, 2.0]"],
    "ParallelEmbedding embedding_dim": ["embedding_dim per tensor-parallel rank: [8, 4]"],
    "different layers": ["layer per tensor-parallel rank: ['ColumnParallelLinear', "
                         "'RowParallelLinear']"],
}
_RULE = "every rank of a tensor-parallel group must build each tensor-parallel layer"


def _build_mismatched_layers() -> dict:
    rank = _setup()
    out = {name: _outcome(lambda: build(rank)) for name, build in _MISMATCHED_LAYERS.items()}
    # the same, under torch.device("meta") (a model built to be materialized later)
    with torch.device("meta"):
        out["meta Column out_features"] = _outcome(
            lambda: _MISMATCHED_LAYERS["Column out_features"](rank))
    out["world works"] = _world_works()
    out["parity after"] = _parity_of_correct_layers(rank)
    return out


def test_layers_built_with_different_arguments_raise_on_every_rank(world2):
    per_rank = world2.run(_build_mismatched_layers)
    for rank_out in per_rank:
        assert rank_out.pop("world works"), "the world did not work after the errors"
        assert rank_out.pop("parity after") <= TOL
    _EXPECTED["meta Column out_features"] = _EXPECTED["Column out_features"]
    problems = []
    for name, fragments in _EXPECTED.items():
        results = [rank_out[name] for rank_out in per_rank]
        kind, text = results[0]
        if kind != "ValueError":
            problems.append(f"{name}: {results}")
            continue
        missing = [f for f in [*fragments, _RULE] if f not in text]
        if missing or results[1] != results[0]:
            problems.append(f"{name}: lacks {missing} or differs across ranks: {results}")
    assert not problems, "\n".join(problems)


# name -> builder(rank) refused on some ranks only (or all), and the message every rank sees
_REFUSED_LAYERS = {
    # one rank alone: its error on every rank, with where it was refused and the values
    "out_features=97 on rank 1": (
        lambda r: mp.ColumnParallelLinear(64, 128 if r == 0 else 97),
        ["ColumnParallelLinear: out_features=97 is not divisible by tensor-parallel size 2; use "
         "a multiple of 2", "refused on global rank(s) [1], not on [0]",
         "out_features per tensor-parallel rank: [128, 97]"]),
    "gather_output='no' on rank 0": (
        lambda r: mp.ColumnParallelLinear(8, 16, gather_output="no" if r == 0 else True),
        ["gather_output='no'", "it must be a bool", "refused on global rank(s) [0], not on [1]"]),
    "vocabulary 33 on rank 0": (
        lambda r: mp.VocabParallelEmbedding(33 if r == 0 else 32, 8),
        ["num_embeddings (vocabulary)=33 is not divisible by tensor-parallel size 2"]),
}
# every rank refused alike: exactly the error a world of 1 with these arguments raises
_REFUSED_EVERYWHERE = {
    "ColumnParallelLinear(64, 97)": (
        lambda r: mp.ColumnParallelLinear(64, 97),
        "ColumnParallelLinear: out_features=97 is not divisible by tensor-parallel size 2; "
        "use a multiple of 2"),
    "ColumnParallelLinear(8, 8, stride=3)": (
        lambda r: mp.ColumnParallelLinear(8, 8, stride=3),
        "ColumnParallelLinear: out_features=8 is not divisible by tensor-parallel size 2 × "
        "stride 3 = 6; use a multiple of 6"),
    "RowParallelLinear(33, 8)": (
        lambda r: mp.RowParallelLinear(33, 8),
        "RowParallelLinear: in_features=33 is not divisible by tensor-parallel size 2; use a "
        "multiple of 2"),
    "VocabParallelEmbedding(33, 8)": (
        lambda r: mp.VocabParallelEmbedding(33, 8),
        "VocabParallelEmbedding: num_embeddings (vocabulary)=33 is not divisible by "
        "tensor-parallel size 2; use a multiple of 2"),
    "ParallelEmbedding(10, 5)": (
        lambda r: mp.ParallelEmbedding(10, 5),
        "ParallelEmbedding: embedding_dim=5 is not divisible by tensor-parallel size 2; use a "
        "multiple of 2"),
}


def _build_refused_layers() -> dict:
    rank = _setup()
    out = {name: _outcome(lambda: build(rank)) for name, (build, _) in _REFUSED_LAYERS.items()}
    out.update({name: _outcome(lambda: build(rank))
                for name, (build, _) in _REFUSED_EVERYWHERE.items()})
    with CommCounter() as comm, CountedControlGathers() as gathers:
        mp.ColumnParallelLinear(8, 16)
    out["construction"] = (len(comm.calls), gathers.count)
    out["world works"] = _world_works()
    out["parity after"] = _parity_of_correct_layers(rank)
    return out


def test_arguments_refused_on_some_ranks_raise_on_every_rank(world2):
    per_rank = world2.run(_build_refused_layers)
    for rank_out in per_rank:
        assert rank_out.pop("world works")
        assert rank_out.pop("parity after") <= TOL
    for name, (_, fragments) in _REFUSED_LAYERS.items():
        results = [rank_out[name] for rank_out in per_rank]
        kind, text = results[0]
        expected_kind = "TypeError" if "gather_output" in name else "ValueError"
        assert kind == expected_kind and results[1] == results[0], (name, results)
        assert all(f in text for f in fragments), (name, text)
    for name, (_, text) in _REFUSED_EVERYWHERE.items():
        assert [rank_out[name] for rank_out in per_rank] == [("ValueError", text)] * TP, name
    # a correct layer's construction: one control gather to agree, nothing counted
    assert [rank_out["construction"] for rank_out in per_rank] == [(0, 1)] * TP


# ----------------------------------------------------------------------------- forward


def _rows(rank: int, *shape: int) -> torch.Tensor:
    """A random input of ``shape``, whose first dimension is one smaller on rank 1."""
    return torch.randn(shape[0] - rank, *shape[1:])


def _forward_mismatches(rank: int) -> dict:
    """Every tensor-parallel forward whose input differs across the ranks; name -> call."""
    col_gather = mp.ColumnParallelLinear(8, 16)
    col_split = mp.ColumnParallelLinear(8, 16, gather_output=False)
    row = mp.RowParallelLinear(16, 8, input_is_parallel=True)
    row_whole = mp.RowParallelLinear(16, 8)
    col_sp = mp.ColumnParallelLinear(8, 16, gather_output=False, sequence_parallel=True)
    row_sp = mp.RowParallelLinear(16, 8, input_is_parallel=True, sequence_parallel=True)
    vocab = mp.VocabParallelEmbedding(10, 8)
    vocab_sp = mp.VocabParallelEmbedding(10, 8, sequence_parallel=True)
    columns = mp.ParallelEmbedding(10, 8)
    renormed = mp.ParallelEmbedding(10, 8, max_norm=1.0)
    seq = 4 + 2 * rank  # [batch, seq, hidden]: another sequence length on rank 1
    return {
        "Column gather_output batch": lambda: col_gather(_rows(rank, 4, 8)),
        "Column split batch": lambda: col_split(_rows(rank, 4, 8)),
        "Row input_is_parallel batch": lambda: row(_rows(rank, 4, 8)),
        "Row whole input batch": lambda: row_whole(_rows(rank, 4, 16)),
        "Row dtype": lambda: row(torch.randn(4, 8, dtype=torch.float64 if rank else None)),
        "Column sequence_parallel seq": lambda: col_sp(torch.randn(2, seq, 8)),
        "Row sequence_parallel seq": lambda: row_sp(torch.randn(2, seq, 8)),
        "Vocab batch": lambda: vocab(torch.zeros(4 - rank, 3, dtype=torch.long)),
        "Vocab sequence_parallel seq": lambda: vocab_sp(torch.zeros(2, seq, dtype=torch.long)),
        "ParallelEmbedding batch": lambda: columns(torch.zeros(4 - rank, dtype=torch.long)),
        "ParallelEmbedding max_norm distinct ids": lambda: renormed(
            torch.tensor([0, 1, 2, 3]) if rank == 0 else torch.tensor([0, 0, 2, 2])),
        "cross-entropy tokens": lambda: mp.vocab_parallel_cross_entropy(
            _rows(rank, 4, 5), torch.zeros(4 - rank, dtype=torch.long)),
        "cross-entropy vocabulary slice": lambda: mp.vocab_parallel_cross_entropy(
            torch.randn(4, 5 + rank), torch.zeros(4, dtype=torch.long)),
        "cross-entropy label_smoothing": lambda: mp.vocab_parallel_cross_entropy(
            torch.randn(4, 5), torch.zeros(4, dtype=torch.long), label_smoothing=0.1 * rank),
        "reduce_from": lambda: mp.reduce_from_model_parallel_region(_rows(rank, 4, 8)),
        "gather_from": lambda: mp.gather_from_model_parallel_region(_rows(rank, 4, 8)),
        "scatter_to_sequence": lambda: mp.scatter_to_sequence_parallel_region(
            torch.randn(2, 4 + rank, 8)),
        "gather_from_sequence": lambda: mp.gather_from_sequence_parallel_region(
            torch.randn(2, seq, 8)),
        "reduce_scatter_to_sequence": lambda: mp.reduce_scatter_to_sequence_parallel_region(
            torch.randn(2, seq, 8)),
    }


_FORWARD_EXPECTED = {
    "Column gather_output batch": "input shape per tensor-parallel rank: [(4, 8), (3, 8)]",
    "Column split batch": "input shape per tensor-parallel rank: [(4, 8), (3, 8)]",
    "Row input_is_parallel batch": "input shape per tensor-parallel rank: [(4, 8), (3, 8)]",
    "Row whole input batch": "input shape per tensor-parallel rank: [(4, 16), (3, 16)]",
    "Row dtype": "input dtype per tensor-parallel rank: [torch.float32, torch.float64]",
    "Column sequence_parallel seq":
        "input shape per tensor-parallel rank: [(2, 4, 8), (2, 6, 8)]",
    "Row sequence_parallel seq": "input shape per tensor-parallel rank: [(2, 4, 8), (2, 6, 8)]",
    "Vocab batch": "input shape per tensor-parallel rank: [(4, 3), (3, 3)]",
    "Vocab sequence_parallel seq": "input shape per tensor-parallel rank: [(2, 4), (2, 6)]",
    "ParallelEmbedding batch": "input shape per tensor-parallel rank: [(4,), (3,)]",
    "ParallelEmbedding max_norm distinct ids": "distinct token ids per tensor-parallel rank: "
                                               "[4, 2]",
    "cross-entropy tokens": "target shape per tensor-parallel rank: [(4,), (3,)]",
    "cross-entropy vocabulary slice":
        "vocab_parallel_logits shape per tensor-parallel rank: [(4, 5), (4, 6)]",
    "cross-entropy label_smoothing": "label_smoothing per tensor-parallel rank: [0.0, 0.1]",
    "reduce_from": "input shape per tensor-parallel rank: [(4, 8), (3, 8)]",
    "gather_from": "input shape per tensor-parallel rank: [(4, 8), (3, 8)]",
    "scatter_to_sequence": "input shape per tensor-parallel rank: [(2, 4, 8), (2, 5, 8)]",
    "gather_from_sequence": "input shape per tensor-parallel rank: [(2, 4, 8), (2, 6, 8)]",
    "reduce_scatter_to_sequence": "input shape per tensor-parallel rank: [(2, 4, 8), (2, 6, 8)]",
}
_INPUT_RULE = "every rank of a tensor-parallel group must pass inputs of the same shape"


@contextlib.contextmanager
def _debug_collectives():
    """The forward's agreement runs in the collective debug mode only (a host sync per layer
    forward otherwise)."""
    set_debug_collectives(True)
    try:
        yield
    finally:
        set_debug_collectives(False)


def _run_forward_mismatches() -> dict:
    rank = _setup()
    torch.manual_seed(rank)
    with _debug_collectives():
        out = {name: _outcome(call) for name, call in _forward_mismatches(rank).items()}
    out["world works"] = _world_works()
    out["parity after"] = _parity_of_correct_layers(rank)
    return out


def test_forward_inputs_that_differ_across_ranks_raise_on_every_rank(world2):
    per_rank = world2.run(_run_forward_mismatches)
    for rank_out in per_rank:
        assert rank_out.pop("world works")
        assert rank_out.pop("parity after") <= TOL
    problems = []
    for name, fragment in _FORWARD_EXPECTED.items():
        results = [rank_out[name] for rank_out in per_rank]
        kind, text = results[0]
        if kind != "ValueError" or results[1] != results[0] or fragment not in text \
                or _INPUT_RULE not in text:
            problems.append(f"{name}: {results}")
    assert not problems, "\n".join(problems)


def _input_refused_on_one_rank() -> dict:
    """A local input check that fails on one rank alone is that rank's error on every rank;
    one that fails on every rank, the same error everywhere."""
    with _debug_collectives():
        return _refused_on_one_rank()


def _refused_on_one_rank() -> dict:
    rank = _setup()
    col = mp.ColumnParallelLinear(8, 16, gather_output=False)
    row = mp.RowParallelLinear(16, 8, input_is_parallel=True)
    vocab = mp.VocabParallelEmbedding(10, 8)
    out = {
        "Column width": _outcome(lambda: col(torch.randn(4, 8 if rank == 0 else 6))),
        "Row width": _outcome(lambda: row(torch.randn(4, 8 if rank == 0 else 16))),
        "Vocab token id": _outcome(lambda: vocab(torch.tensor([1, 10 if rank else 2]))),
        "cross-entropy target": _outcome(lambda: mp.vocab_parallel_cross_entropy(
            torch.randn(2, 5), torch.tensor([0, 10 if rank else 1]))),
    }
    # a sequence length that does not divide by the tensor-parallel size, on every rank
    row_sp = mp.RowParallelLinear(16, 8, input_is_parallel=True, sequence_parallel=True)
    vocab_sp = mp.VocabParallelEmbedding(10, 8, sequence_parallel=True)
    out["Row sequence_parallel seq 5"] = _outcome(lambda: row_sp(torch.randn(2, 5, 8)))
    out["Vocab sequence_parallel seq 5"] = _outcome(
        lambda: vocab_sp(torch.zeros(2, 5, dtype=torch.long)))
    out["world works"] = _world_works()
    out["parity after"] = _parity_of_correct_layers(rank)
    return out


def test_an_input_refused_on_one_rank_raises_on_every_rank(world2):
    per_rank = world2.run(_input_refused_on_one_rank)
    for rank_out in per_rank:
        assert rank_out.pop("world works")
        assert rank_out.pop("parity after") <= TOL
    expected = {
        "Column width": ("ValueError", ["ColumnParallelLinear: the input has shape (4, 6); its "
                                        "last dimension must be 8", "refused on global rank(s) "
                                        "[1], not on [0]", "[(4, 8), (4, 6)]"]),
        "Row width": ("ValueError", ["its last dimension must be 8", "refused on global rank(s) "
                                     "[1], not on [0]"]),
        "Vocab token id": ("IndexError", ["VocabParallelEmbedding: token id 10 is outside",
                                          "refused on global rank(s) [1], not on [0]"]),
        "cross-entropy target": ("IndexError", ["vocab_parallel_cross_entropy: target 10",
                                                "refused on global rank(s) [1], not on [0]"]),
        "Row sequence_parallel seq 5": ("ValueError", ["dimension 1 of the activation (2, 5, 8)",
                                                       "is not divisible by 2"]),
        "Vocab sequence_parallel seq 5": ("ValueError", ["dimension 1 of the activation "
                                                         "(2, 5, 8)", "is not divisible by 2"]),
    }
    for name, (kind, fragments) in expected.items():
        results = [rank_out[name] for rank_out in per_rank]
        assert results[0][0] == kind and results[1] == results[0], (name, results)
        assert all(f in results[0][1] for f in fragments), (name, results[0][1])


# ----------------------------------------------------------------------------- cost


def _cost_of_a_forward(debug: bool) -> dict:
    """A Column -> Row forward and backward: in the collective debug mode one control gather
    per layer forward, none in backward, and none at all by default; the counted traffic is
    the layers' own (one all-reduce forward, one backward)."""
    _setup()
    if debug:
        with _debug_collectives():
            return _forward_and_backward_counted()
    return _forward_and_backward_counted()


def _forward_and_backward_counted() -> dict:
    fc = mp.ColumnParallelLinear(8, 16, gather_output=False)
    out = mp.RowParallelLinear(16, 8, input_is_parallel=True)
    x = torch.randn(3, 8, requires_grad=True)
    with CommCounter() as comm, CountedControlGathers() as forward:
        y = out(F.gelu(fc(x)))
    with CountedControlGathers() as backward:
        y.sum().backward()
    return {"forward gathers": forward.count, "backward gathers": backward.count,
            "counted forward": [(c.op, c.numel) for c in comm.calls]}


def test_the_agreement_costs_one_control_gather_per_forward_in_debug_mode_only(world2):
    for result in world2.run(_cost_of_a_forward, True):
        assert result == {"forward gathers": 2, "backward gathers": 0,
                          "counted forward": [("all_reduce", 3 * 8)]}, result
    for result in world2.run(_cost_of_a_forward, False):
        assert result == {"forward gathers": 0, "backward gathers": 0,
                          "counted forward": [("all_reduce", 3 * 8)]}, result
