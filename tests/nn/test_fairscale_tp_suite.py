"""FairScale's model-parallel tests (tests/nn/model_parallel/test_{initialize,layers,random,
cross_entropy}.py), re-expressed for shardkit on CPU/gloo.

A FairScale user changes ``fairscale`` to ``shardkit`` in the imports and nothing else, so every
check below is written against FairScale's promises: the group layout and getters, layer
initialisation from a master weight seeded identically on every rank (``init_method``,
``keep_master_weight_for_test``, ``get_master_weight``, ``stride``), the gradients of
``ColumnParallelLinear`` / ``RowParallelLinear`` / the two embeddings against the unsplit
layer, ``vocab_parallel_cross_entropy`` against ``F.cross_entropy`` (loss and gradient), the
mappings' forward/backward pairs, the RNG tracker (CPU generator in place of CUDA's) and the
helpers in ``utils`` that Megatron-style model code imports.

One world per world size (1, 2, 4); inside it, every configuration (tensor-parallel size,
pipeline length) runs every check and returns the list of what went wrong on that rank.
"""

import math

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import torch.nn.init as init
from torch.utils.checkpoint import checkpoint as torch_checkpoint

from shardkit import checkpointing as ds_checkpointing, distributed
from shardkit.nn.model_parallel import initialize as mpu
from shardkit.nn.model_parallel import layers, random as mp_random, utils as mp_utils
from shardkit.nn.model_parallel.cross_entropy import vocab_parallel_cross_entropy
from shardkit.nn.model_parallel.mappings import (
    copy_to_model_parallel_region, gather_from_model_parallel_region,
    reduce_from_model_parallel_region, scatter_to_model_parallel_region)
from shardkit.testing import world_fixture

TOL = 1e-6

world1 = world_fixture(1)
world2 = world_fixture(2)
world4 = world_fixture(4)


def _err(a, b) -> float:
    return (a.detach().double() - b.detach().double()).abs().max().item()


class _Problems(list):
    def close(self, name, a, b, tol=TOL):
        err = _err(a, b)
        if not err <= tol:
            self.append(f"{name}: max error {err:.3g} > {tol}")

    def true(self, name, cond, detail=""):
        if not cond:
            self.append(f"{name}: {detail}")


# ----------------------------------------------------------------------------- initialize


def _check_initialize(p, tp, pp):
    rank, world = distributed.get_rank(), distributed.get_world_size()
    p.true("initialized", mpu.model_parallel_is_initialized())
    tp_rank = rank % tp
    p.true("tp world", mpu.get_model_parallel_world_size() == tp)
    p.true("tp rank", mpu.get_model_parallel_rank() == tp_rank)
    group = mpu.get_model_parallel_group()
    p.true("tp group", distributed.get_world_size(group) == tp
           and distributed.get_rank(group) == tp_rank)
    # FairScale's formula and the test's: the global rank of tensor-parallel index 0
    p.true("src rank", mpu.get_model_parallel_src_rank() == rank - tp_rank == rank // tp * tp)
    dp = world // (tp * pp)
    p.true("dp world", mpu.get_data_parallel_world_size() == dp)
    p.true("dp rank", mpu.get_data_parallel_rank() == rank // (tp * pp))
    group = mpu.get_data_parallel_group()
    p.true("dp group", distributed.get_world_size(group) == dp
           and distributed.get_rank(group) == rank // (tp * pp))
    p.true("dp ranks", mpu.get_data_parallel_ranks()
           == [rank % (tp * pp) + k * tp * pp for k in range(dp)], mpu.get_data_parallel_ranks())
    stage_of = (rank // tp) % pp
    base = rank - stage_of * tp
    p.true("pipeline ranks", mpu.get_pipeline_parallel_ranks()
           == [base + s * tp for s in range(pp)], mpu.get_pipeline_parallel_ranks())
    group = mpu.get_pipeline_parallel_group()
    p.true("pipeline group", distributed.get_world_size(group) == pp
           and distributed.get_rank(group) == stage_of)
    # the groups are torch process groups: FairScale users call torch.distributed on them
    t = torch.ones(1)
    torch.distributed.all_reduce(t, group=mpu.get_model_parallel_group())
    p.true("torch collective on the tp group", t.item() == tp, t)


def _check_context_parallel(p, tp):
    """FairScale's context-parallel getters (shardkit provides context_parallel_size=1 only)."""
    rank = distributed.get_rank()
    p.true("cp getters", (mpu.get_context_parallel_world_size(), mpu.get_context_parallel_rank(),
                          mpu.get_context_parallel_ranks()) == (1, 0, [rank]))
    group = mpu.get_context_parallel_group()
    p.true("cp group", distributed.get_world_size(group) == 1 and distributed.get_rank(group) == 0)


# ----------------------------------------------------------------------------- layers


def _check_embeddings(p, tp):
    """FairScale's run_test_parallel_embedding: same seed, same weights as nn.Embedding."""
    batch, seq, vocab, hidden, seed = 17, 23, 48, 16, 1236
    torch.manual_seed(123)
    idx = torch.LongTensor(size=(batch, seq)).random_(0, vocab)
    loss_weight = torch.randn(batch, seq, hidden)
    torch.manual_seed(seed)
    ref = nn.Embedding(vocab, hidden)
    loss_ref = (ref(idx) * loss_weight).sum()
    loss_ref.backward()
    rank = mpu.get_model_parallel_rank()
    for name, cls, dim in (("ParallelEmbedding", layers.ParallelEmbedding, 1),
                           ("VocabParallelEmbedding", layers.VocabParallelEmbedding, 0)):
        torch.manual_seed(seed)
        emb = cls(vocab, hidden, init_method=init.normal_)
        loss = (emb(idx) * loss_weight).sum()
        loss.backward()
        p.close(f"{name} loss", loss, loss_ref, 1e-12)
        size = (hidden if dim else vocab) // tp
        p.close(f"{name} grad", emb.weight.grad, ref.weight.grad.split(size, dim)[rank], 1e-12)
        p.close(f"{name} weight", emb.weight, ref.weight.split(size, dim)[rank], 0.0)
        p.close(f"{name} get_master_weight", emb.get_master_weight(), ref.weight, 0.0)


def _check_affine_weight(p, tp):
    """FairScale's run_test_initialize_affine_weight, through the private helper and through
    the layers' ``init_method`` + ``keep_master_weight_for_test``."""
    seed, in_c, out_c = 12345, 13, 17
    in_f, out_f = in_c * tp, out_c * tp
    rank = mpu.get_model_parallel_rank()
    torch.manual_seed(seed)
    master = torch.empty(out_f, in_f)
    init.normal_(master)
    for dim, size, shape in ((0, out_c, (out_c, in_f)), (1, in_c, (out_f, in_c))):
        weight = torch.empty(shape)
        torch.manual_seed(seed)
        layers._initialize_affine_weight(weight, out_f, in_f, size, dim, init.normal_)
        p.close(f"_initialize_affine_weight dim {dim}", weight, master.split(size, dim)[rank], 0)
        torch.manual_seed(seed)
        kept = layers._initialize_affine_weight(torch.empty(shape), out_f, in_f, size, dim,
                                                init.normal_, return_master_weight=True)
        p.close(f"_initialize_affine_weight master {dim}", kept, master, 0)
    for name, cls, dim, size in (("Column", layers.ColumnParallelLinear, 0, out_c),
                                 ("Row", layers.RowParallelLinear, 1, in_c)):
        torch.manual_seed(seed)
        layer = cls(in_f, out_f, init_method=init.normal_, keep_master_weight_for_test=True)
        p.close(f"{name} weight", layer.weight, master.split(size, dim)[rank], 0)
        p.close(f"{name} master_weight", layer.master_weight, master, 0)
        p.close(f"{name} get_master_weight", layer.get_master_weight(), master, 0)
        p.true(f"{name} bias zero", not layer.bias.any())
    # strided: FairScale's blocks rank, rank + n, ... of stride * n
    stride = 3
    torch.manual_seed(seed)
    big = torch.empty(out_c * stride * tp, in_f)
    init.normal_(big)
    torch.manual_seed(seed)
    layer = layers.ColumnParallelLinear(in_f, out_c * stride * tp, stride=stride,
                                        init_method=init.normal_)
    blocks = big.split(out_c, 0)
    p.close("Column stride 3 weight", layer.weight, torch.cat(blocks[rank::tp]), 0)


def _identity_2d(m, n):
    weight = nn.Parameter(torch.empty(m, n))
    init.xavier_normal_(weight)
    return weight


def _check_linear(p, tp):
    """FairScale's run_test_column_parallel_linear and run_test_row_parallel_linear (the latter
    ran only under MPI there): gradients by the closed-form formulas."""
    rank = mpu.get_model_parallel_rank()
    in_c, out_c, batch = 13, 17, 7
    in_f, out_f = in_c * tp, out_c * tp
    for name, cls in (("Column", layers.ColumnParallelLinear), ("Row", layers.RowParallelLinear)):
        torch.manual_seed(12345)
        x = _identity_2d(batch, in_f)
        layer = cls(in_f, out_f, keep_master_weight_for_test=True)
        dy = torch.randn(batch, out_f)
        (layer(x) * dy).sum().backward()
        weight = layer.master_weight
        d_weight = dy.t() @ x.detach()
        d_bias = dy.sum(0)
        if name == "Column":
            p.close(f"{name} dLdA", layer.weight.grad, d_weight.split(out_c, 0)[rank])
            p.close(f"{name} dLdb", layer.bias.grad, d_bias.split(out_c, 0)[rank])
        else:
            p.close(f"{name} dLdA", layer.weight.grad, d_weight.split(in_c, 1)[rank])
            p.close(f"{name} dLdb", layer.bias.grad, d_bias)
        p.close(f"{name} dLdX", x.grad, dy @ weight, 1e-5)
        p.close(f"{name} output", layer(x), x @ weight.t(), 1e-5)


def _check_column_row_chain(p, tp):
    """Column(gather_output=False) -> Row(input_is_parallel=True), stride 1 and 3 (a fused
    q/k/v projection), against two nn.Linear of the master weights; no gradient on the way
    between them is communicated."""
    for stride in (1, 3):
        torch.manual_seed(7)
        col = layers.ColumnParallelLinear(8, 8 * stride, gather_output=False, stride=stride,
                                          keep_master_weight_for_test=True)
        row = layers.RowParallelLinear(8 * stride, 6, input_is_parallel=True, stride=stride,
                                       keep_master_weight_for_test=True)
        ref1, ref2 = nn.Linear(8, 8 * stride), nn.Linear(8 * stride, 6)
        with torch.no_grad():
            ref1.weight.copy_(col.master_weight)
            ref2.weight.copy_(row.master_weight)
            ref1.bias.zero_()
            ref2.bias.zero_()
        x = torch.randn(5, 8)
        xs = x.clone().requires_grad_()
        out = row(torch.tanh(col(xs)))
        xr = x.clone().requires_grad_()
        out_ref = ref2(torch.tanh(ref1(xr)))
        g = torch.randn_like(out_ref)
        out.backward(g)
        out_ref.backward(g)
        p.close(f"chain stride {stride} output", out, out_ref, 1e-5)
        p.close(f"chain stride {stride} dx", xs.grad, xr.grad, 1e-5)
        p.close(f"chain stride {stride} column full grad",
                col._join("weight", col.weight.grad), ref1.weight.grad, 1e-5)
        p.close(f"chain stride {stride} row full grad",
                row._join("weight", row.weight.grad), ref2.weight.grad, 1e-5)
        p.close(f"chain stride {stride} get_master_weight", col.get_master_weight(),
                col.master_weight, 0)


def _check_embedding_options(p, tp):
    """``nn.Embedding``'s options that FairScale forwards: ``padding_idx`` (a row in another
    rank's range too), ``sparse`` and, for ``ParallelEmbedding``, ``scale_grad_by_freq``;
    against ``nn.Embedding`` built after the same seed."""
    vocab, hidden = 16, 8
    rank = mpu.get_model_parallel_rank()
    torch.manual_seed(3)
    idx = torch.randint(0, vocab, (5, 7))
    idx[0, :3] = 13  # the padding row (in the last rank's vocabulary range)
    dy = torch.randn(5, 7, hidden)
    cases = [(layers.VocabParallelEmbedding, 0, dict(padding_idx=13)),
             (layers.ParallelEmbedding, 1, dict(padding_idx=13)),
             (layers.VocabParallelEmbedding, 0, dict(sparse=True)),
             (layers.ParallelEmbedding, 1, dict(sparse=True)),
             (layers.ParallelEmbedding, 1, dict(scale_grad_by_freq=True)),
             (layers.ParallelEmbedding, 1, dict(padding_idx=-3)),
             (layers.VocabParallelEmbedding, 0, dict(ids=torch.int32)),
             (layers.ParallelEmbedding, 1, dict(ids=torch.int32))]
    for cls, dim, options in cases:
        name = f"{cls.__name__}({options})"
        ids = idx.to(options.pop("ids", torch.long))
        torch.manual_seed(4)
        ref = nn.Embedding(vocab, hidden, **options)
        torch.manual_seed(4)
        emb = cls(vocab, hidden, init_method=init.normal_, **options)
        size = (hidden if dim else vocab) // tp
        p.close(f"{name} init", emb.weight, ref.weight.split(size, dim)[rank], 0)
        out, out_ref = emb(ids), ref(ids)
        out.backward(dy)
        out_ref.backward(dy)
        p.close(f"{name} output", out, out_ref, 0)
        grad, grad_ref = emb.weight.grad, ref.weight.grad
        p.true(f"{name} grad layout", grad.is_sparse == grad_ref.is_sparse, grad.layout)
        p.close(f"{name} grad", grad.to_dense(), grad_ref.to_dense().split(size, dim)[rank],
                1e-6)


def _check_layer_surface(p, tp):
    """What FairScale code touches besides forward: ``bias=False``, state-dict keys, 3-D
    inputs, the attributes FairScale sets, and a broadcast from the model-parallel source rank
    with torch.distributed (Megatron's way of feeding one batch to a tensor-parallel group)."""
    col = layers.ColumnParallelLinear(6, 4 * tp, bias=False)
    row = layers.RowParallelLinear(4 * tp, 6, bias=False)
    p.true("no bias", col.bias is None and row.bias is None)
    p.true("state_dict keys", list(col.state_dict()) == ["weight"]
           and list(layers.ColumnParallelLinear(6, 4 * tp).state_dict()) == ["weight", "bias"],
           list(col.state_dict()))
    rank = mpu.get_model_parallel_rank()
    vpe = layers.VocabParallelEmbedding(8 * tp, 4)
    pe = layers.ParallelEmbedding(4, 4 * tp)
    expected = [(col, "output_size_per_partition", 4), (row, "input_size_per_partition", 4),
                (col, "in_features", 6), (col, "out_features", 4 * tp),
                (row, "in_features", 4 * tp),
                (row, "out_features", 6), (col, "gather_output", True),
                (row, "input_is_parallel", False), (vpe, "vocab_start_index", 8 * rank),
                (vpe, "vocab_end_index", 8 * rank + 8), (vpe, "num_embeddings_per_partition", 8),
                (vpe, "num_embeddings", 8 * tp), (vpe, "embedding_dim", 4),
                (pe, "embedding_dim_per_partition", 4), (pe, "num_embeddings", 4),
                (pe, "embedding_dim", 4 * tp), (vpe, "padding_idx", None),
                (vpe, "max_norm", None), (vpe, "norm_type", 2.0), (pe, "sparse", False),
                (pe, "scale_grad_by_freq", False), (col, "master_weight", None)]
    for obj, attr, value in expected:
        got = getattr(obj, attr, "<missing>")
        p.true(f"{type(obj).__name__}.{attr}", got == value, f"{got!r}, FairScale: {value!r}")
    x = torch.randn(2, 3, 6)
    p.true("3-D input", row(col(x)).shape == (2, 3, 6))
    batch = torch.full((3,), float(distributed.get_rank()))
    torch.distributed.broadcast(batch, mpu.get_model_parallel_src_rank(),
                                group=mpu.get_model_parallel_group())
    p.true("broadcast from src rank", batch.eq(mpu.get_model_parallel_src_rank()).all(), batch)
    ids = torch.arange(3) + 10 * rank
    p.true("gather of token ids", torch.equal(
        gather_from_model_parallel_region(ids),
        torch.cat([torch.arange(3) + 10 * r for r in range(tp)])))


def _check_half_precision(p, tp):
    """fp16 and bf16 weights (``.half()`` after construction, as FairScale users do): the
    collectives carry them and the result is the fp32 one, rounded."""
    torch.manual_seed(5)
    col = layers.ColumnParallelLinear(8, 4 * tp, gather_output=False)
    row = layers.RowParallelLinear(4 * tp, 8, input_is_parallel=True)
    x = torch.randn(3, 8)
    exact = row(col(x))
    for dtype in (torch.float16, torch.bfloat16):
        c, r = col.to(dtype), row.to(dtype)
        out = r(c(x.to(dtype)))
        p.true(f"{dtype} output dtype", out.dtype == dtype, out.dtype)
        p.close(f"{dtype} output", out, exact, 0.05)
        logits = layers.ColumnParallelLinear(8, 4 * tp, gather_output=False).to(dtype)(
            x.to(dtype))
        loss = vocab_parallel_cross_entropy(logits, torch.zeros(3, dtype=torch.long))
        p.true(f"{dtype} cross-entropy finite", torch.isfinite(loss).all())
        col, row = col.float(), row.float()


def _check_default_dtype(p):
    """FairScale allocates the parameters with torch.empty: the default dtype."""
    before = torch.get_default_dtype()
    torch.set_default_dtype(torch.float64)
    try:
        made = [layers.ColumnParallelLinear(4, 8), layers.RowParallelLinear(8, 4),
                layers.VocabParallelEmbedding(8, 4), layers.ParallelEmbedding(8, 4)]
        for layer in made:
            for name, param in layer.named_parameters():
                p.true(f"{type(layer).__name__}.{name} dtype", param.dtype == torch.float64,
                       param.dtype)
        x = torch.randn(3, 4)
        p.true("fp64 forward", made[1](made[0](x)).dtype == torch.float64)
    finally:
        torch.set_default_dtype(before)


# ----------------------------------------------------------------------------- cross-entropy


def _check_cross_entropy(p, tp):
    """FairScale's run_test_cross_entropy (logits scaled by 1000), and at scale 1."""
    batch, seq, per_part, seed = 13, 17, 11, 1234
    vocab = per_part * tp
    for scale in (1000.0, 1.0):
        results = []
        for parallel in (False, True):
            torch.manual_seed(seed)
            weight = nn.Parameter(scale * torch.randn(batch, seq, vocab))
            target = torch.LongTensor(size=(batch, seq)).random_(0, vocab)
            logits = weight * 1.0
            if parallel:
                local = scatter_to_model_parallel_region(logits)
                before = local.detach().clone()
                loss = vocab_parallel_cross_entropy(local, target)
                # FairScale subtracts the maximum from its input in place; shardkit does not
                p.close("cross-entropy leaves its input alone", local, before, 0)
            else:
                loss = F.cross_entropy(logits.view(-1, vocab), target.view(-1),
                                       reduction="none").view_as(target)
            loss = loss.mean()
            loss.backward()
            results.append((loss, weight.grad))
        (loss_t, grad_t), (loss_m, grad_m) = results
        p.close(f"cross-entropy loss scale {scale}", loss_m, loss_t, 1e-6 * max(1.0, scale))
        p.close(f"cross-entropy grad scale {scale}", grad_m, grad_t)


# ----------------------------------------------------------------------------- mappings


def _per_rank(global_rank, *shape, offset=0):
    gen = torch.Generator().manual_seed(1000 * offset + global_rank)
    return torch.randn(*shape, generator=gen)


def _check_mappings(p, tp):
    rank = distributed.get_rank()
    peers = mpu.get_model_parallel_ranks()
    me = mpu.get_model_parallel_rank()
    width = 4 * tp

    x = _per_rank(rank, 3, width).requires_grad_()
    y = copy_to_model_parallel_region(x)
    y.backward(_per_rank(rank, 3, width, offset=1))
    p.close("copy forward", y, x, 0)
    p.close("copy backward", x.grad, sum(_per_rank(r, 3, width, offset=1) for r in peers), 1e-6)

    x = _per_rank(rank, 3, width).requires_grad_()
    y = reduce_from_model_parallel_region(x)
    g = _per_rank(rank, 3, width, offset=1)
    y.backward(g)
    p.close("reduce forward", y, sum(_per_rank(r, 3, width) for r in peers), 1e-6)
    p.close("reduce backward", x.grad, g, 0)

    full = _per_rank(0, 3, width).requires_grad_()  # the same input on every rank
    y = scatter_to_model_parallel_region(full)
    g = _per_rank(rank, 3, 4, offset=2)
    y.backward(g)
    p.close("scatter forward", y, full.split(4, -1)[me], 0)
    p.close("scatter backward", full.grad,
            torch.cat([_per_rank(r, 3, 4, offset=2) for r in peers], -1), 0)

    x = _per_rank(rank, 2, 3, 4).requires_grad_()
    y = gather_from_model_parallel_region(x)
    g = _per_rank(0, 2, 3, width, offset=3)
    y.backward(g)
    p.close("gather forward", y, torch.cat([_per_rank(r, 2, 3, 4) for r in peers], -1), 0)
    p.close("gather backward", x.grad, g.split(4, -1)[me], 0)


# ----------------------------------------------------------------------------- random


def _check_random(p, tp):
    tracker = mp_random.get_cuda_rng_tracker()
    tracker.reset()
    # run_test_set_cuda_rng_state, on the CPU generator
    size = 123
    torch.manual_seed(1234)
    state = torch.get_rng_state()
    copy = state.clone()
    first = [torch.randn(size) for _ in range(5)][-1]
    p.true("state untouched", torch.equal(state, copy))
    p.true("state moved", not torch.equal(torch.get_rng_state(), copy))
    torch.set_rng_state(state)
    again = [torch.randn(size) for _ in range(5)][-1]
    p.close("replayed draws", again, first, 0)

    # run_test_cuda_rng_tracker: interleaving a tracked stream leaves both sequences intact
    seed_1, seed_2, shape = 1234, 4321, (12, 21)
    torch.manual_seed(seed_1)
    t11, t12 = torch.randn(shape), torch.randn(shape)
    torch.manual_seed(seed_2)
    t21, t22 = torch.randn(shape), torch.randn(shape)
    torch.manual_seed(seed_1)
    tracker.add("test", seed_2)
    r11 = torch.randn(shape)
    with tracker.fork("test"):
        r21 = torch.randn(shape)
    r12 = torch.randn(shape)
    with tracker.fork("test"):
        r22 = torch.randn(shape)
    for name, a, b in (("11", r11, t11), ("12", r12, t12), ("21", r21, t21), ("22", r22, t22)):
        p.close(f"tracker stream {name}", a, b, 0)
    p.true("streams differ", not torch.equal(r11, r21))
    for bad in (lambda: tracker.add("test", 99), lambda: tracker.add("other", seed_2)):
        try:
            bad()
            p.append("tracker.add accepted a duplicate name or seed")
        except Exception as e:  # FairScale raises Exception
            p.true("duplicate error names it", "already" in str(e), e)
    try:
        with tracker.fork("missing"):
            pass
        p.append("fork of a missing stream did not raise")
    except Exception as e:
        p.true("missing stream error names it", "missing" in str(e), e)
    tracker.reset()

    # run_test_model_parallel_cuda_manual_seed, on CPU
    mp_random.model_parallel_cuda_manual_seed(12345)
    p.true("default seed", torch.initial_seed() == 12345, torch.initial_seed())
    with tracker.fork():
        expected = 12345 + 2718 + mpu.get_model_parallel_rank()
        p.true("model-parallel seed", torch.initial_seed() == expected, torch.initial_seed())
    p.true("default seed after fork", torch.initial_seed() == 12345)
    tracker.reset()
    if not torch.cuda.is_available():  # FairScale's helper needs CUDA: a clear error without
        _expect(p, "_set_cuda_rng_state on CPU", RuntimeError, ["torch.set_rng_state"],
                lambda: mp_random._set_cuda_rng_state(torch.get_rng_state()))


def _check_checkpoint(p, tp):
    """FairScale's ``model_parallel.random.checkpoint(function, *args)``, and
    ``torch.utils.checkpoint`` (reentrant or not): a block with dropout on split activations
    (inside ``fork()``) and on replicated ones gives the gradients of the plain run, though both
    streams move on between the forward and the backward; afterwards both streams are where the
    plain run left them."""
    tracker = mp_random.get_cuda_rng_tracker()
    torch.manual_seed(8)
    col = layers.ColumnParallelLinear(6, 4 * tp, gather_output=False)
    row = layers.RowParallelLinear(4 * tp, 6, input_is_parallel=True)
    x = torch.randn(5, 6)

    def block(inp):
        h = F.gelu(col(inp))
        with tracker.fork():
            h = F.dropout(h, 0.4)
        return F.dropout(row(h), 0.3)

    runs = []
    calls = (block, lambda inp: mp_random.checkpoint(block, inp),
             lambda inp: mp_random.CheckpointFunction.apply(block, inp),  # FairScale's spelling
             # torch's own, both kinds: the tracker replays its streams there too
             lambda inp: torch_checkpoint(block, inp, use_reentrant=True),
             lambda inp: torch_checkpoint(block, inp, use_reentrant=False),
             # nested: the inner region's first forward runs again inside the outer's
             # recomputation, and its own recomputation replays what it recorded then
             lambda inp: torch_checkpoint(lambda i: ds_checkpointing.checkpoint(block, i), inp,
                                          use_reentrant=True))
    for call in calls:
        mp_random.model_parallel_cuda_manual_seed(21)
        xi = x.clone().requires_grad_()
        out = call(xi)
        torch.rand(3)  # both streams move on before the backward
        with tracker.fork():
            torch.rand(3)
        out.sum().backward()
        with tracker.fork():
            after = torch.rand(4)
        grads = [xi.grad] + [t.grad.clone() for t in (col.weight, col.bias, row.weight)]
        for t in (col.weight, col.bias, row.weight, row.bias):
            t.grad = None
        runs.append((out, grads, after, torch.rand(4)))
    (out, grads, after, default) = runs[0]
    hows = ("checkpoint", "CheckpointFunction", "torch reentrant", "torch non-reentrant",
            "torch reentrant around deepspeed checkpointing")
    for how, (out_c, grads_c, after_c, default_c) in zip(hows, runs[1:]):
        p.close(f"{how} output", out_c, out, 0)
        for name, a, b in zip(("x", "column weight", "column bias", "row weight"), grads_c,
                              grads):
            p.close(f"{how} grad {name}", a, b, 1e-6)
        p.close(f"{how}: model-parallel stream after backward", after_c, after, 0)
        p.close(f"{how}: default stream after backward", default_c, default, 0)
    tracker.reset()


# ----------------------------------------------------------------------------- utils


def _check_utils(p, tp):
    """The helpers Megatron-style model code imports from fairscale.nn.model_parallel.utils."""
    mp_utils.ensure_divisibility(12, 4)
    p.true("divide_and_check_no_remainder", mp_utils.divide_and_check_no_remainder(12, 4) == 3)
    t = torch.arange(24.0).view(2, 12)
    chunks = mp_utils.split_tensor_along_last_dim(t, 3)
    p.true("split count", isinstance(chunks, tuple) and len(chunks) == 3)
    p.close("split values", torch.cat(chunks, -1), t, 0)
    p.true("split views", not chunks[1].is_contiguous())
    chunks = mp_utils.split_tensor_along_last_dim(t, 3, contiguous_split_chunks=True)
    p.true("split contiguous", all(c.is_contiguous() for c in chunks))
    rank = mpu.get_model_parallel_rank()
    p.true("vocab range", mp_utils.VocabUtility.vocab_range_from_global_vocab_size(48, rank, tp)
           == (rank * 48 // tp, (rank + 1) * 48 // tp))
    p.true("vocab range per partition",
           mp_utils.VocabUtility.vocab_range_from_per_partition_vocab_size(5, rank, tp)
           == (5 * rank, 5 * rank + 5))
    for bad in (lambda: mp_utils.ensure_divisibility(10, 4),
                lambda: mp_utils.divide_and_check_no_remainder(10, 4),
                lambda: mp_utils.split_tensor_along_last_dim(t, 5),
                lambda: mp_utils.VocabUtility.vocab_range_from_global_vocab_size(10, 0, 4)):
        try:
            bad()
            p.append("indivisible size accepted")
        except ValueError as e:
            p.true("indivisible error", "divisible" in str(e), e)


# ----------------------------------------------------------------------------- training


def _check_training(p, tp):
    """Column -> GeLU -> Row, three SGD steps, data parallel over the data-parallel group (each
    replica its slice of the global batch, gradients averaged): the unsplit model on the whole
    batch, step by step."""
    dp = mpu.get_data_parallel_world_size()
    dp_rank = mpu.get_data_parallel_rank()
    torch.manual_seed(11)
    col = layers.ColumnParallelLinear(6, 8, gather_output=False, keep_master_weight_for_test=True)
    row = layers.RowParallelLinear(8, 3, input_is_parallel=True, keep_master_weight_for_test=True)
    ref = nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.Linear(8, 3))
    with torch.no_grad():
        ref[0].weight.copy_(col.master_weight)
        ref[2].weight.copy_(row.master_weight)
        ref[0].bias.zero_()
        ref[2].bias.zero_()
    params = [col.weight, col.bias, row.weight, row.bias]
    opt = torch.optim.SGD(params, lr=0.1)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    for step in range(3):
        gen = torch.Generator().manual_seed(50 + step)
        x, y = torch.randn(4 * dp, 6, generator=gen), torch.randn(4 * dp, 3, generator=gen)
        mine = slice(4 * dp_rank, 4 * dp_rank + 4)
        F.mse_loss(row(F.gelu(col(x[mine]))), y[mine]).backward()
        for param in params:
            distributed.all_reduce(param.grad, group=mpu.get_data_parallel_group())
            param.grad.div_(dp)
        opt.step()
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        p.close(f"step {step} column weight", col.full_weight(), ref[0].weight, 1e-5)
        p.close(f"step {step} column bias", col.full_state_dict()["bias"], ref[0].bias, 1e-5)
        p.close(f"step {step} row weight", row.full_weight(), ref[2].weight, 1e-5)
        p.close(f"step {step} row bias", row.bias, ref[2].bias, 1e-5)


def _check_pipeline_training(p, tp):
    """With ``pipeline_length`` 2: each stage a Column -> GeLU -> Row block, activations and
    their gradients sent over send/recv to the same tensor-parallel index of the other stage
    (what the pipeline groups pair up), three SGD steps against the unsplit model."""
    stages = mpu.get_pipeline_parallel_world_size()
    if stages == 1:
        return
    peers, stage = mpu.get_pipeline_parallel_ranks(), mpu.get_pipeline_parallel_rank()
    blocks, refs = [], []
    for s in range(stages):  # every rank builds every stage's weights: one seed, one sequence
        torch.manual_seed(30 + s)
        col = layers.ColumnParallelLinear(6, 4 * tp, bias=False, gather_output=False,
                                          keep_master_weight_for_test=True)
        row = layers.RowParallelLinear(4 * tp, 6, bias=False, input_is_parallel=True,
                                       keep_master_weight_for_test=True)
        ref = nn.Sequential(nn.Linear(6, 4 * tp, bias=False), nn.GELU(),
                            nn.Linear(4 * tp, 6, bias=False))
        with torch.no_grad():
            ref[0].weight.copy_(col.master_weight)
            ref[2].weight.copy_(row.master_weight)
        blocks.append((col, row))
        refs.append(ref)
    col, row = blocks[stage]
    params = [col.weight, row.weight]
    opt = torch.optim.SGD(params, lr=0.1)
    ref = nn.Sequential(*refs)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.1)
    dp = mpu.get_data_parallel_world_size()
    for step in range(3):
        gen = torch.Generator().manual_seed(70 + step)
        x, y = torch.randn(4 * dp, 6, generator=gen), torch.randn(4 * dp, 6, generator=gen)
        mine = slice(4 * mpu.get_data_parallel_rank(), 4 * mpu.get_data_parallel_rank() + 4)
        if stage == 0:
            h = row(F.gelu(col(x[mine])))
            distributed.send(h.detach(), dst=peers[1])
            grad = torch.empty_like(h)
            distributed.recv(grad, src=peers[1])
            h.backward(grad)
        else:
            h = torch.empty(4, 6)
            distributed.recv(h, src=peers[0])
            h.requires_grad_()
            F.mse_loss(row(F.gelu(col(h))), y[mine]).backward()
            distributed.send(h.grad, dst=peers[0])
        for param in params:
            distributed.all_reduce(param.grad, group=mpu.get_data_parallel_group())
            param.grad.div_(dp)
        opt.step()
        opt.zero_grad()
        F.mse_loss(ref(x), y).backward()
        ref_opt.step()
        ref_opt.zero_grad()
        p.close(f"pipeline step {step} column", col.full_weight(), refs[stage][0].weight, 1e-5)
        p.close(f"pipeline step {step} row", row.full_weight(), refs[stage][2].weight, 1e-5)


# ----------------------------------------------------------------------------- errors


def _expect(p, name, exc, words, fn):
    try:
        fn()
    except exc as e:
        for word in words:
            p.true(f"{name} message", word in str(e), e)
    else:
        p.append(f"{name}: no {exc.__name__}")


def _check_errors_in_groups(p, tp):
    if tp == 1:
        return
    _expect(p, "Column out_features", ValueError, ["out_features", str(tp)],
            lambda: layers.ColumnParallelLinear(4, 4 * tp + 1))
    _expect(p, "Row in_features", ValueError, ["in_features"],
            lambda: layers.RowParallelLinear(4 * tp + 1, 4))
    _expect(p, "Vocab num_embeddings", ValueError, ["num_embeddings"],
            lambda: layers.VocabParallelEmbedding(4 * tp + 1, 4))
    _expect(p, "ParallelEmbedding embedding_dim", ValueError, ["embedding_dim"],
            lambda: layers.ParallelEmbedding(4, 4 * tp + 1))
    _expect(p, "Column input width", ValueError, ["in_features"],
            lambda: layers.ColumnParallelLinear(4, 4 * tp)(torch.randn(2, 5)))
    _expect(p, "second initialize", RuntimeError, ["destroy_model_parallel"],
            lambda: mpu.initialize_model_parallel(tp))


def _check_errors_without_groups(p):
    import numpy as np

    world = distributed.get_world_size()
    # integral sizes of any type (argparse, numpy), as FairScale's int(...) of them
    mpu.initialize_model_parallel(np.int64(1), pipeline_length=np.int32(1))
    p.true("numpy sizes", mpu.get_model_parallel_world_size() == 1)
    mpu.destroy_model_parallel()
    _expect(p, "float size", ValueError, ["model_parallel_size"],
            lambda: mpu.initialize_model_parallel(1.5))
    p.true("not initialized", not mpu.model_parallel_is_initialized())
    _expect(p, "layer before initialize", RuntimeError, ["initialize_model_parallel"],
            lambda: layers.ColumnParallelLinear(4, 4))
    _expect(p, "getter before initialize", RuntimeError, ["initialize_model_parallel"],
            mpu.get_model_parallel_world_size)
    # FairScale clamps a size larger than the world; shardkit refuses it (README)
    _expect(p, "model_parallel_size > world", ValueError,
            ["model_parallel_size", str(2 * world)],
            lambda: mpu.initialize_model_parallel(2 * world))
    if world == 4:
        _expect(p, "tp x pp not dividing the world", ValueError, ["pipeline_length"],
                lambda: mpu.initialize_model_parallel(2, pipeline_length=3))
    p.true("still not initialized", not mpu.model_parallel_is_initialized())


# ----------------------------------------------------------------------------- the suite

CHECKS = {
    "context_parallel": _check_context_parallel,
    "embeddings": _check_embeddings, "affine_weight": _check_affine_weight,
    "linear": _check_linear, "chain": _check_column_row_chain,
    "cross_entropy": _check_cross_entropy, "mappings": _check_mappings,
    "random": _check_random, "checkpoint": _check_checkpoint, "utils": _check_utils,
    "training": _check_training, "pipeline_training": _check_pipeline_training,
    "errors": _check_errors_in_groups, "embedding_options": _check_embedding_options,
    "layer_surface": _check_layer_surface, "half_precision": _check_half_precision,
    "default_dtype": lambda p, tp: _check_default_dtype(p),
}


def _run_check(found, name, check, *args):
    p = _Problems()
    try:
        check(p, *args)
    except Exception as e:  # noqa: BLE001 - reported with the check's name
        p.append(f"raised {type(e).__name__}: {e}")
    if p:
        found[name] = list(p)


def _suite(tp, pp):
    """Every check under ``initialize_model_parallel(tp, pp)``; {check: [problems]} with the
    failing ones only (a check that raises is a problem too)."""
    found = {}
    _run_check(found, "errors_without_groups", _check_errors_without_groups)
    mpu.destroy_model_parallel()  # in case a failed check left groups behind
    mpu.initialize_model_parallel(tp, pipeline_length=pp)
    try:
        _run_check(found, "initialize", _check_initialize, tp, pp)
        for name, check in CHECKS.items():
            _run_check(found, name, check, tp)
    finally:
        mpu.destroy_model_parallel()
        mp_random.get_cuda_rng_tracker().reset()
    return found


def _assert_clean(results, tp, pp):
    bad = {rank: found for rank, found in enumerate(results) if found}
    assert not bad, f"tp={tp} pp={pp}: " + "; ".join(
        f"rank {r}: {found}" for r, found in bad.items())


def test_fairscale_suite_world1(world1):
    _assert_clean(world1.run(_suite, 1, 1), 1, 1)


@pytest.mark.parametrize("tp,pp", [(1, 1), (2, 1), (1, 2)], ids=["dp2", "tp2", "pp2"])
def test_fairscale_suite_world2(world2, tp, pp):
    _assert_clean(world2.run(_suite, tp, pp), tp, pp)


@pytest.mark.parametrize("tp,pp", [(4, 1), (2, 1), (2, 2), (1, 2), (1, 1)],
                         ids=["tp4", "tp2xdp2", "tp2xpp2", "pp2xdp2", "dp4"])
def test_fairscale_suite_world4(world4, tp, pp):
    _assert_clean(world4.run(_suite, tp, pp), tp, pp)


def test_adjacency():
    """FairScale's test_adjacency, on the pure layout: 32 data x 8 pipeline x 4 tensor."""
    layout = mpu.ParallelLayout(32 * 8 * 4, 4, 8)
    tensor, pipeline, data = layout.tensor_groups(), layout.pipeline_groups(), layout.data_groups()
    assert {len(g) for g in tensor} == {4} and len(tensor) == 8 * 32
    assert {len(g) for g in pipeline} == {8} and len(pipeline) == 4 * 32
    assert {len(g) for g in data} == {32} and len(data) == 4 * 8
    for group in tensor:  # contiguous
        assert group == list(range(group[0], group[-1] + 1))
    for kind in (tensor, pipeline, data):  # every rank once per kind
        assert sorted(r for g in kind for r in g) == list(range(layout.world_size))
    assert math.prod(len(g) for g in (tensor[0], pipeline[0], data[0])) == layout.world_size
