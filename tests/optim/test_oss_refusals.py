"""OSS as a torch / FairScale user meets it: refusals on every rank, and what ``p.grad`` holds
after ``clip_grad_norm`` (one world of 2 ranks).

Regressions:

- a step the optimizer refuses (``SparseAdam`` given a dense gradient; ``Adam(capturable=True)``
  over CPU parameters with ``foreach`` or ``fused=False`` given) raised on the owner only,
  while a rank owning nothing waited in the parameter sync until the collective timed out;
  ``Adam(capturable=True)`` left to OSS's choice of torch's fused kernel stepped silently,
  where torch's Adam refuses it. Every rank now raises the same RuntimeError before any
  collective (from backward under ``ShardedDataParallel(step_in_backward=True)``), with no
  parameter changed;
- ``clip_grad_norm`` scaled the gradients of the parameters each rank owns only: under DDP,
  ``p.grad`` of the others read unclipped (and differently on each rank);
- under a default dtype other than fp32 (``torch.set_default_dtype``), ``clip_grad_norm`` on a
  rank with no gradient among the parameters it owns aborted a rank in the norm's all-reduce;
- a torch LR scheduler built on the optimizer that ``OSS(existing)`` took over warned, at the
  first step, that ``lr_scheduler.step()`` came before ``optimizer.step()``.
"""

import copy

import torch
import torch.nn as nn
import torch.nn.functional as F

from shardkit.nn.data_parallel import ShardedDataParallel
from shardkit.optim import OSS
from shardkit.testing import world_fixture

# short: on the old code a rank waited in the sync until this ran out
world2 = world_fixture(2, timeout=60)


def _one_weight():
    """One parameter in all: rank 1 owns nothing (it only waits in the sync)."""
    torch.manual_seed(0)
    return nn.Linear(4, 2, bias=False)


def _refused_step(optim_cls, **hyper):
    model = _one_weight()
    opt = OSS(model.parameters(), optim=optim_cls, lr=0.1, **hyper)
    before = model.weight.detach().clone()
    F.mse_loss(model(torch.ones(3, 4)), torch.zeros(3, 2)).backward()
    try:
        opt.step()
        message = None
    except RuntimeError as error:
        message = str(error)
    return message, torch.equal(before, model.weight)


def _sparse_adam_still_steps():
    """SparseAdam over an embedding: a sparse gradient steps, and one with no gradient this
    step (an unused embedding) is no refusal."""
    torch.manual_seed(0)
    used, unused = nn.Embedding(10, 3, sparse=True), nn.Embedding(10, 3, sparse=True)
    oracle = copy.deepcopy(used)
    opt = OSS(list(used.parameters()) + list(unused.parameters()),
              optim=torch.optim.SparseAdam, lr=0.1)
    ref = torch.optim.SparseAdam(oracle.parameters(), lr=0.1)
    for m, o in ((used, opt), (oracle, ref)):
        m(torch.tensor([1, 2, 2])).sum().backward()
        o.step()
    return float((used.weight - oracle.weight).abs().max())


def _refused_in_backward():
    """ShardedDataParallel(step_in_backward=True), whose backward steps the owners: the same
    refusal from backward on every rank, nothing stepped, and training goes on once the
    setting is fixed."""
    model = _one_weight()
    opt = OSS(model.parameters(), optim=torch.optim.Adam, lr=0.1, capturable=True)
    ddp = ShardedDataParallel(model, opt, step_in_backward=True)
    before = model.weight.detach().clone()
    try:
        ddp(torch.ones(3, 4)).sum().backward()
        message = None
    except RuntimeError as error:
        message = str(error)
    unchanged = torch.equal(before, model.weight)
    opt.param_groups[0]["capturable"] = False
    opt.zero_grad()
    ddp(torch.ones(3, 4)).sum().backward()
    opt.step()
    opt.wait_for_sync()  # step_in_backward leaves the last all-gathers in flight
    return message, unchanged, not torch.equal(before, model.weight)


def _refusals():
    return {"sparse_adam_dense": _refused_step(torch.optim.SparseAdam),
            "capturable": _refused_step(torch.optim.Adam, capturable=True),
            "capturable_foreach": _refused_step(torch.optim.Adam, capturable=True,
                                                foreach=False),
            "sparse_adam_sparse": _sparse_adam_still_steps(),
            "in_backward": _refused_in_backward()}


def test_refused_steps_fail_on_every_rank_before_the_sync(world2):
    for rank, r in enumerate(world2.run(_refusals)):
        message, unchanged = r["sparse_adam_dense"]
        assert message is not None and message.startswith(
            "OSS.step: parameter 0 of param group 0 (shape (2, 4)) has a dense gradient, "
            "which SparseAdam"), (rank, message)
        assert unchanged, rank
        for name in ("capturable", "capturable_foreach"):
            message, unchanged = r[name]
            assert message is not None and "Adam with these settings cannot step parameter 0" \
                in message and "capturable=False" in message, (name, rank, message)
            assert unchanged, (name, rank)
        assert r["sparse_adam_sparse"] <= 1e-6
        message, unchanged, stepped_after = r["in_backward"]
        assert message is not None and message.startswith(
            "ShardedDataParallel(step_in_backward=True) stepping OSS: Adam with these settings "
            "cannot step parameter 0"), (rank, message)
        assert unchanged and stepped_after, rank


def _clipped_gradients():
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 2))
    oracle = copy.deepcopy(model)
    opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
    x = torch.randn(8, 4)
    for m in (model, oracle):
        F.mse_loss(m(x), torch.zeros(8, 2)).backward()
    norm = opt.clip_grad_norm(0.01)
    expected = torch.nn.utils.clip_grad_norm_(oracle.parameters(), 0.01)
    return (abs(float(norm - expected)),
            max(float((a.grad - b.grad).abs().max())
                for a, b in zip(model.parameters(), oracle.parameters())))


def test_clip_grad_norm_scales_every_gradient_a_rank_holds(world2):
    for norm_diff, grad_diff in world2.run(_clipped_gradients):
        assert norm_diff <= 1e-5
        assert grad_diff <= 1e-7  # owned or not, p.grad reads as after torch's clip_grad_norm_


def _adagrad_groups(groups):
    """Adagrad over one parameter per param group, ``groups`` giving each one's gradient
    (``"dense"``: a linear weight's; ``"sparse"``: an ``nn.Embedding(sparse=True)`` weight's)
    and weight decay; one step against torch's Adagrad: ``(None, largest difference)``, or
    ``(the error, None)``."""
    torch.manual_seed(0)
    built = [{"params": [nn.Parameter(torch.randn(6, 3))], "weight_decay": wd}
             for _, wd in groups]
    ref_groups = copy.deepcopy(built)
    opt = OSS(built, optim=torch.optim.Adagrad, lr=0.1)
    ref = torch.optim.Adagrad(ref_groups, lr=0.1)
    for o in (opt, ref):
        for g, (layout, _) in zip(o.param_groups, groups):
            p = g["params"][0]
            p.grad = torch.full_like(p, 2.0) if layout == "dense" else torch.sparse_coo_tensor(
                torch.tensor([[1, 4]]), torch.ones(2, 3), (6, 3))
    try:
        opt.step()
    except RuntimeError as error:
        return str(error), None
    ref.step()
    return None, max(float((a["params"][0] - b["params"][0]).abs().max())
                     for a, b in zip(opt.param_groups, ref.param_groups))


def _sparse_adam_with_a_scalar():
    """SparseAdam over an embedding and a learned 0-dim scale (owned by rank 1), whose dense
    gradient it refuses: the error, or None."""
    torch.manual_seed(0)
    embedding, scale = nn.Embedding(10, 3, sparse=True), nn.Parameter(torch.tensor(1.0))
    opt = OSS([embedding.weight, scale], optim=torch.optim.SparseAdam, lr=0.1)
    (embedding(torch.tensor([1, 2])) * scale).sum().backward()
    try:
        opt.step()
    except RuntimeError as error:
        return str(error)
    return None


def _step_check_cases():
    return {"decayed_dense_then_sparse": _adagrad_groups([("dense", 0.01), ("sparse", 0.0)]),
            "sparse_then_decayed_sparse": _adagrad_groups([("sparse", 0.0), ("sparse", 0.1)]),
            "sparse_adam_scalar": _sparse_adam_with_a_scalar()}


def test_step_check_tells_param_groups_by_their_numbers_and_scalars(world2):
    """Adagrad steps a sparse gradient with ``weight_decay=0`` only, the usual split being a
    decayed group of dense weights and an undecayed one of sparse embeddings. The throwaway
    check cached its answer by the switches alone (weight decay being a number): after a
    decayed group of dense gradients, the undecayed embeddings were refused on every rank;
    after an undecayed one, a decayed group of embeddings was not refused, and its owner
    raised while the other rank hung in the sync. A 0-dim parameter was not checked at all:
    SparseAdam given a learned scale's dense gradient raised on its owner alone."""
    for rank, r in enumerate(world2.run(_step_check_cases)):
        message, diff = r["decayed_dense_then_sparse"]
        assert message is None and diff <= 1e-6, (rank, message, diff)
        message, diff = r["sparse_then_decayed_sparse"]
        assert message is not None and message.startswith(
            "OSS.step: parameter 0 of param group 1 (shape (6, 3)) has a sparse gradient"), \
            (rank, message)
        assert "weight_decay" in message, (rank, message)
        message = r["sparse_adam_scalar"]
        assert message is not None and message.startswith(
            "OSS.step: parameter 1 of param group 0 (shape ()) has a dense gradient, which "
            "SparseAdam"), (rank, message)


def _copies_refused() -> dict:
    """What copying an OSS after a step does: ``copy.deepcopy`` and ``pickle`` of the optimizer,
    ``copy.deepcopy`` of a ShardedDataParallel holding one, ``AveragedModel`` of the wrapper;
    then the original still steps (wrapped), and ``AveragedModel(wrapped.module)`` (what the
    error advises) averages the live weights."""
    import pickle
    model = nn.Linear(4, 4)
    optimizer = OSS(model.parameters(), optim=torch.optim.Adam, lr=0.1)
    model(torch.ones(2, 4)).sum().backward()
    optimizer.step()
    said = {}
    for name, copier in (("deepcopy", copy.deepcopy), ("pickle", pickle.dumps),
                         ("sdp", lambda o: copy.deepcopy(ShardedDataParallel(model, o)))):
        try:
            copier(optimizer)
            said[name] = "copied"
        except TypeError as error:
            said[name] = str(error)
    wrapped = ShardedDataParallel(model, optimizer)
    average = torch.optim.swa_utils.AveragedModel(wrapped.module)  # the advised EMA/SWA copy
    try:
        torch.optim.swa_utils.AveragedModel(wrapped)
        said["averaged sdp"] = "copied"
    except TypeError as error:
        said["averaged sdp"] = str(error)
    before = [p.detach().clone() for p in model.parameters()]
    seen = []
    for _ in range(2):
        wrapped(torch.ones(2, 4)).sum().backward()
        optimizer.step()
        optimizer.zero_grad()
        average.update_parameters(wrapped)
        seen.append([p.detach().clone() for p in model.parameters()])
    after = list(model.parameters())
    said["averaged"] = all(torch.allclose(a, (p1 + p2) / 2) for a, p1, p2 in zip(
        average.module.parameters(), *seen))
    said["original steps"] = all(not torch.equal(a, p) for a, p in zip(before, after))
    return said


def test_copying_an_oss_is_refused_naming_what_to_save(world2):
    """Before: ``copy.deepcopy`` and ``pickle`` went through torch's ``Optimizer.__getstate__``
    (defaults, state and groups only) and gave an OSS that failed at its first step with
    "AttributeError: 'OSS' object has no attribute '_found_inf_agreed'"."""
    for said in world2.run(_copies_refused):
        for name in ("deepcopy", "pickle"):
            assert said[name].startswith("OSS cannot be pickled or copied"), (name, said)
            assert "consolidate_state_dict()" in said[name], said
        for name in ("sdp", "averaged sdp"):
            assert said[name].startswith("ShardedDataParallel cannot be pickled or copied"), said
            assert "copy.deepcopy(model.module)" in said[name], said
        assert said["original steps"] and said["averaged"], said


class _SkipsALayer(nn.Module):
    """Two layers, the second unused by the forward (an auxiliary head, an idle expert): its
    owner has no gradient to measure."""

    def __init__(self):
        super().__init__()
        self.used, self.skipped = nn.Linear(4, 4), nn.Linear(4, 4)

    def forward(self, x):
        return self.used(x)


def _clip_under_default_dtype(dtype):
    """Clip with torch's default dtype set to ``dtype`` (fp64 science code, a model built in
    bf16), under ShardedDataParallel: the norm, relative to torch's ``clip_grad_norm_`` in one
    process, and whether some rank owned no gradient."""
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        torch.manual_seed(0)
        model = _SkipsALayer()
        oracle = copy.deepcopy(model)
        opt = OSS(model.parameters(), optim=torch.optim.SGD, lr=0.1)
        x = torch.randn(2, 4)
        ShardedDataParallel(model, opt)(x).sum().backward()
        oracle(x).sum().backward()
        owned_none = all(p.grad is None for p in opt.optim.param_groups[0]["params"])
        norm = opt.clip_grad_norm(1.0)
        opt.step()
        expected = torch.nn.utils.clip_grad_norm_(oracle.parameters(), 1.0)
        return abs(float(norm) - float(expected)) / float(expected), owned_none
    finally:
        torch.set_default_dtype(previous)


def test_clip_grad_norm_with_another_default_dtype_and_a_rank_without_gradients(world2):
    """Before: the rank with nothing to measure contributed a 0-dim zero in the default dtype,
    the others an fp32 term, so the norm's all-reduce mixed sizes: gloo aborted one rank
    ("EnforceNotMet ... 8 vs 4" under fp64, "4 vs 2" under bf16)."""
    for dtype, tol in ((torch.float64, 1e-6), (torch.bfloat16, 1e-2)):
        results = world2.run(_clip_under_default_dtype, dtype)
        assert any(owned_none for _, owned_none in results), results  # the case is exercised
        for relative_error, _ in results:
            assert relative_error <= tol, (dtype, relative_error)


def _scheduler_built_before_the_takeover():
    """``StepLR`` built on a torch optimizer, then ``OSS(that_optimizer)``: the warnings torch's
    scheduler gives over 3 steps, and OSS's lr after each, against torch's own pair."""
    import warnings
    torch.manual_seed(0)
    model = nn.Linear(4, 4)
    oracle = copy.deepcopy(model)
    base = torch.optim.AdamW(model.parameters(), lr=0.1)
    schedule = torch.optim.lr_scheduler.StepLR(base, step_size=1, gamma=0.5)
    opt = OSS(base)
    oracle_opt = torch.optim.AdamW(oracle.parameters(), lr=0.1)
    oracle_schedule = torch.optim.lr_scheduler.StepLR(oracle_opt, step_size=1, gamma=0.5)
    lrs, want = [], []
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(3):
            for m, o, s in ((model, opt, schedule), (oracle, oracle_opt, oracle_schedule)):
                m(torch.ones(2, 4)).sum().backward()
                o.step()
                o.zero_grad()
                s.step()
            lrs.append(opt.param_groups[0]["lr"])
            want.append(oracle_opt.param_groups[0]["lr"])
    said = [str(w.message) for w in caught if "lr_scheduler" in str(w.message)]
    return said, lrs, want


def test_a_scheduler_built_before_the_takeover_sees_the_steps(world2):
    """Before: torch's scheduler, wrapped around the taken-over optimizer's ``step``, never saw
    a step (OSS steps its own local optimizer) and warned "Detected call of
    `lr_scheduler.step()` before `optimizer.step()`" at the first step, though the lr was
    right."""
    for said, lrs, want in world2.run(_scheduler_built_before_the_takeover):
        assert said == [], said
        assert lrs == want == [0.05, 0.025, 0.0125], (lrs, want)
