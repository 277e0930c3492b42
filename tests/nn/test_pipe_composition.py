"""Every schedule under a data-parallel wrapper on each stage's replica group (2 pipelines x 2
ranks): OSS with the stage's all-reduce, ShardedDDP + OSS, torch DDP (its forwards inside
``no_sync()``, then the stage's all-reduce), and FSDP (with ZB-H1 and ZBV too, whose
backward is split into B and W; FSDP's sharded gradients checked as well, and ``no_sync``
accumulation, bf16 mixed precision). Parity with one process training on the whole batch, per
step."""

import contextlib

import torch
import torch.nn.functional as F

from shardkit import distributed as dist
from shardkit.models import MLP
from shardkit.nn.data_parallel.mixed_precision import MixedPrecisionPolicy
from shardkit.nn.pipe import PipelineStage, Schedule1F1B, ScheduleGPipe, split_sequential
from shardkit.nn.pipe.stage import stage_rank
from shardkit.checkpoint.resharding import ParamLayout, shard_rows
from shardkit.testing import world_fixture
from tests.nn.test_pipe_zero_bubble import (MODELS, SCHEDULES as ZERO_BUBBLE_SCHEDULES, _even,
                                            _gpt_layers)

BATCH, STEPS, CHUNKS = 16, 2, 4
world4 = world_fixture(4)

# name -> (schedule class, stages per pipeline rank, placement): the zero-bubble tests' table
# plus GPipe
SCHEDULES = {"GPipe": (ScheduleGPipe, 1, "loop"), **ZERO_BUBBLE_SCHEDULES}


def _batch(step):
    g = torch.Generator().manual_seed(100 + step)
    return torch.randn(BATCH, 16, generator=g), torch.randn(BATCH, 4, generator=g)


def _wrap(part, wrapper, replicas, **fsdp_options):
    """The stage module and the optimizer stepping its parameters, for one stage."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel, ShardedDataParallel
    from shardkit.optim import OSS

    if wrapper == "ddp":  # torch DDP: forwards in no_sync(), one flat all-reduce per step
        return (torch.nn.parallel.DistributedDataParallel(part, process_group=replicas),
                torch.optim.SGD(part.parameters(), lr=0.1))
    if wrapper == "fsdp":  # GPT stages: a root unit over one unit per Block (resharded)
        from shardkit.models import Block
        from shardkit.nn.wrap import auto_wrap, enable_wrap, transformer_auto_wrap_policy

        with enable_wrap(wrapper_cls=FullyShardedDataParallel, process_group=replicas,
                         **fsdp_options):
            module = FullyShardedDataParallel(
                auto_wrap(part, transformer_auto_wrap_policy({Block})), process_group=replicas,
                **fsdp_options)
        return module, torch.optim.SGD(module.parameters(), lr=0.1)
    opt = OSS(part.parameters(), optim=torch.optim.SGD, group=replicas, lr=0.1)
    if wrapper == "sharded_ddp":
        return ShardedDataParallel(part, opt, process_group=replicas), opt
    return part, opt  # "oss": the stage all-reduces its gradients over data_parallel_group


def _train(schedule_name, wrapper, model="mlp", accumulate=False, **fsdp_options):
    """Worst |weight - reference weight| over this rank's stages after each step, and under FSDP
    worst |gradient shard - the reference gradient's rows| before each optimizer step. With
    ``accumulate``, each optimizer step follows two schedule steps, the first inside every
    stage's ``no_sync()`` (FSDP and torch DDP). Also the bytes of gathered parameters and unsharded
    gradients FSDP still held after the synchronised steps (all must be released)."""
    rank = dist.get_rank()
    pipelines = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replica_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pipeline, pipe_rank = rank // 2, rank % 2
    replicas = replica_groups[pipe_rank]
    cls, per_rank, placement = SCHEDULES[schedule_name]
    num_stages = 2 * per_rank
    make, batch, loss_fn = (lambda: MLP(16, 8, out=4, seed=0), _batch, F.mse_loss) \
        if model == "mlp" else (_gpt_layers, MODELS["gpt"][1], MODELS["gpt"][2])
    reference = make()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    ref_parts = split_sequential(reference, _even(len(reference), num_stages))
    parts = split_sequential(make(), _even(len(reference), num_stages))
    mine = [s for s in range(num_stages) if stage_rank(s, num_stages, 2, placement) == pipe_rank]
    stages, opts = [], []
    for s in mine:
        module, opt = _wrap(parts[s], wrapper, replicas, **fsdp_options)
        stages.append(PipelineStage(module, s, num_stages, group=pipelines[pipeline],
                                    data_parallel_group=replicas if wrapper == "oss" else None,
                                    placement=placement))
        opts.append(opt)
    arg = stages[0] if cls in (ScheduleGPipe, Schedule1F1B) else stages
    schedule = cls(arg, CHUNKS, loss_fn)
    half = slice(pipeline * BATCH // 2, (pipeline + 1) * BATCH // 2)
    worst, left = 0.0, 0
    for step in range(STEPS):
        batches = [batch(2 * step), batch(2 * step + 1)] if accumulate else [batch(step)]
        ref_opt.zero_grad()
        for x, y in batches:
            loss_fn(reference(x), y).backward()
        for opt in opts:
            opt.zero_grad()
        for k, (x, y) in enumerate(batches):
            with contextlib.ExitStack() as local:
                if k < len(batches) - 1:
                    for stage in stages:
                        local.enter_context(stage.module.no_sync())
                schedule.step(x[half], target=y[half])
        if wrapper == "fsdp":
            left += _fsdp_bytes_held([st.module for st in stages])
            worst = max([worst] + [_shard_grad_error(parts[s], ref_parts[s])
                                   for s in mine])
        ref_opt.step()
        for opt in opts:
            opt.step()
        for s in mine:
            worst = max([worst] + [(a - b).abs().max().item() for a, b in zip(
                _full_params(stages[mine.index(s)].module, parts[s]), ref_parts[s].parameters())])
    return worst, left


def _fsdp_bytes_held(modules):
    from shardkit.nn.data_parallel import FullyShardedDataParallel

    grads = sum(t.numel() * t.element_size() for m in modules for unit in m.sharded_units()
                for kind, t in unit.model_state_tensors() if kind == "grads")
    return FullyShardedDataParallel.gathered_param_bytes().live + grads


def _shard_grad_error(part, ref_part):
    """Worst |FSDP gradient shard - this data-parallel rank's rows of the reference gradient|."""
    dp_rank, dp_size = dist.get_rank() // 2, 2  # replica groups [0, 2] and [1, 3]
    return max((p.grad - shard_rows(r.grad, ParamLayout(r.shape, dp_size), dp_rank)).abs().max()
               .item() for p, r in zip(part.parameters(), ref_part.parameters()))


def _full_params(module, part):
    """The stage's parameters in the reference's order (FSDP: gathered)."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel

    if isinstance(module, FullyShardedDataParallel):
        with module.summon_full_params():
            return [p.detach().clone() for p in part.parameters()]
    return list(part.parameters())


def _grid():
    out = {(wrapper, name, "mlp"): _train(name, wrapper)
           for wrapper in ("oss", "sharded_ddp", "fsdp", "ddp") for name in SCHEDULES}
    out[("ddp", "ZBV", "mlp, no_sync")] = _train("ZBV", "ddp", accumulate=True)
    # LayerNorms, attention, embeddings (W gathers the weights of the units it needs), on 4 GPT
    # stages; no_sync accumulation over two steps (the same path under ZBV)
    out[("fsdp", "ZBV", "gpt")] = _train("ZBV", "fsdp", model="gpt")
    out[("fsdp", "ZeroBubble", "mlp, no_sync")] = _train("ZeroBubble", "fsdp", accumulate=True)
    # bf16 gathers and compute, fp32 reduce-scatter and master weights: bf16's tolerance
    out[("fsdp", "ZeroBubble", "mlp, bf16")] = _train("ZeroBubble", "fsdp", mixed_precision=(
        MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)))
    return out


def test_every_schedule_under_each_data_parallel_wrapper(world4):
    for rank, results in enumerate(world4.run(_grid)):
        for key, (worst, left) in results.items():
            assert worst <= (2e-3 if "bf16" in key[2] else 1e-5), (key, rank, worst)
            assert left == 0, (key, rank, left)


class _RaiseIn(torch.nn.Module):
    """Identity, except that its forward raises while ``armed`` (one pipeline's batch that
    its first stage cannot take)."""

    armed = False

    def forward(self, x):
        if _RaiseIn.armed:
            raise RuntimeError("this pipeline's first stage refuses the batch")
        return x


def _one_pipeline_fails(wrapper):
    """Steps 0 and 2 train; in step 1 the first stage of pipeline 0 raises, pipeline 1 runs
    well. Returns what each step gave (``"ok"`` or the ValueError's problem lines) and the
    worst |weight - reference| after step 2, the reference trained on steps 0 and 2 only."""
    rank = dist.get_rank()
    pipelines = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replica_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pipeline, pipe_rank = rank // 2, rank % 2
    replicas = replica_groups[pipe_rank]
    make = lambda: torch.nn.Sequential(_RaiseIn(), *MLP(16, 4, out=4, seed=0))  # noqa: E731
    part = split_sequential(make(), [5, 5])[pipe_rank]
    reference = split_sequential(make(), [5, 5])
    module, opt = _wrap(part, wrapper, replicas)
    stage = PipelineStage(module, pipe_rank, 2, group=pipelines[pipeline],
                          data_parallel_group=replicas if wrapper == "oss" else None)
    schedule = Schedule1F1B(stage, 2, F.mse_loss)
    ref_opt = torch.optim.SGD([p for r in reference for p in r.parameters()], lr=0.1)
    half = slice(pipeline * BATCH // 2, (pipeline + 1) * BATCH // 2)
    outcomes = []
    for step in range(3):
        x, y = _batch(step)
        _RaiseIn.armed = step == 1 and pipeline == 0
        opt.zero_grad()
        try:
            schedule.step(x[half], target=y[half])
        except ValueError as err:
            outcomes.append(str(err).splitlines()[1:-1])
            continue
        finally:
            _RaiseIn.armed = False
        outcomes.append("ok")
        opt.step()
        ref_opt.zero_grad()
        F.mse_loss(reference[1](reference[0](x)), y).backward()
        ref_opt.step()
    worst = max((a - b).abs().max().item()
                for a, b in zip(part.parameters(), reference[pipe_rank].parameters()))
    return outcomes, worst


def test_a_step_failing_in_one_pipeline_fails_in_every_pipeline(world4):
    """The replicas' gradient all-reduce carries the step's verdict: a forward raising in one
    pipeline is a ValueError on all four ranks (none waits in the all-reduce, none averages
    with the next step's gradients), and training goes on as in one process."""
    for wrapper in ("oss", "ddp"):
        for rank, (outcomes, worst) in enumerate(world4.run(_one_pipeline_fails, wrapper)):
            assert outcomes[0] == "ok" and outcomes[2] == "ok", (wrapper, rank, outcomes)
            problems = " ".join(outcomes[1])
            if rank < 2:
                assert "stage 0, micro-batch 0: its forward raised RuntimeError: this " \
                    "pipeline's first stage refuses the batch" in problems, (wrapper, problems)
            else:
                assert "the step failed in another pipeline" in problems, (wrapper, problems)
            assert worst <= 1e-5, (wrapper, rank, worst)


def _refused_double_reduction(wrapper):
    """A ShardedDDP or FSDP stage given data_parallel_group over the wrapper's own ranks: the
    stage's all-reduce would average reduced gradients with zeros (ShardedDDP's non-owners) or
    with other ranks' shards (FSDP); ``"ddp_static"``: a torch DDP stage with static_graph;
    ``"ddp_hook"``: one with a communication hook, which the stage's own all-reduce skips.
    The error, or None."""
    rank = dist.get_rank()
    pipelines = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replica_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pipeline, pipe_rank = rank // 2, rank % 2
    replicas = replica_groups[pipe_rank]
    part = split_sequential(MLP(16, 4, out=4, seed=0), [5, 4])[pipe_rank]
    if wrapper == "ddp_static":
        module = torch.nn.parallel.DistributedDataParallel(part, process_group=replicas,
                                                           static_graph=True)
    elif wrapper == "ddp_hook":
        from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import fp16_compress_hook

        module = torch.nn.parallel.DistributedDataParallel(part, process_group=replicas)
        module.register_comm_hook(replicas, fp16_compress_hook)
    else:
        module, _ = _wrap(part, wrapper, replicas)
    try:
        PipelineStage(module, pipe_rank, 2, group=pipelines[pipeline],
                      data_parallel_group=replicas)
    except ValueError as err:
        return str(err)
    return None


def test_data_parallel_group_beside_a_reducing_wrapper_is_refused(world4):
    for wrapper, name in (("sharded_ddp", "ShardedDataParallel"),
                          ("fsdp", "FullyShardedDataParallel")):
        for rank, error in enumerate(world4.run(_refused_double_reduction, wrapper)):
            replicas = [rank % 2, rank % 2 + 2]
            assert error is not None and f"data_parallel_group (ranks {replicas}) shares ranks " \
                f"{replicas} with the stage module's {name}" in error, (wrapper, rank, error)
            assert "Pass data_parallel_group=None" in error
    # torch DDP's static graph delays its all-reduce into a backward the pipeline runs inside
    # no_sync(): its reducer asserts on some ranks, and the others wait
    for error in world4.run(_refused_double_reduction, "ddp_static"):
        assert error is not None and "the stage module is DistributedDataParallel(" \
            "static_graph=True)" in error and "static_graph=False" in error, error
    # a DDP comm hook (fp16 compression, PowerSGD) would be skipped by the pipeline's own
    # plain all-reduce: refused by name rather than silently not run
    for error in world4.run(_refused_double_reduction, "ddp_hook"):
        assert error is not None and "communication hook (fp16_compress_hook)" in error and \
            "without register_comm_hook" in error, error


def _adamw_stage(part, wrapper, replicas):
    from shardkit.nn.data_parallel import FullyShardedDataParallel, ShardedDataParallel
    from shardkit.optim import OSS

    options = dict(lr=0.1, weight_decay=0.1)
    if wrapper == "fsdp":
        module = FullyShardedDataParallel(part, process_group=replicas)
        return module, torch.optim.AdamW(
            [p for p in module.parameters() if p.requires_grad], **options)
    opt = OSS([p for p in part.parameters() if p.requires_grad], optim=torch.optim.AdamW,
              group=replicas, **options)
    return ShardedDataParallel(part, opt, process_group=replicas), opt


def _unused_outputs_under(wrapper, schedule_name, routes, kind="fork", nested=False,
                          batch_grad=False):
    """AdamW (weight decay) on ``_Fork`` / ``_Join`` stages under ShardedDDP or FSDP, 2
    pipelines x 2 ranks, whose next stage ignores or detaches some outputs (``routes``: per
    step, each pipeline's ``use`` per micro-batch, see ``_route``), beside one process on the
    whole batch: the worst |weight - reference| after each step. With ``batch_grad``, each
    pipeline's batch requires grad, and the worst |its .grad - the reference's| is returned
    instead (``inf`` where it is ``None`` on one side only)."""
    from tests.nn.test_torch_pipelining_suite import SCHEDULES as TORCH_SCHEDULES

    rank, chunks, rows = dist.get_rank(), 2, 8
    pipelines = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    replica_groups = [dist.new_group([0, 2]), dist.new_group([1, 3])]
    pipeline, pipe_rank = rank // 2, rank % 2
    cls, per_rank, placement = TORCH_SCHEDULES[schedule_name]
    n = 2 * per_rank
    mine = [s for s in range(n) if stage_rank(s, n, 2, placement) == pipe_rank]
    ref, parts = _stage_modules(kind, n), _stage_modules(kind, n)
    modules, opts, stages = {}, [], []
    for s in mine:
        if nested:  # one FSDP unit per child, under the stage's root unit
            from shardkit.nn.data_parallel import FullyShardedDataParallel
            for name, child in list(parts[s].named_children()):
                setattr(parts[s], name, FullyShardedDataParallel(
                    child, process_group=replica_groups[pipe_rank]))
        modules[s], opt = _adamw_stage(parts[s], wrapper, replica_groups[pipe_rank])
        opts.append(opt)
        stages.append(PipelineStage(modules[s], s, n, group=pipelines[pipeline],
                                    placement=placement))
    schedule = cls(stages[0] if per_rank == 1 else stages, chunks, F.mse_loss)
    ref_opt = torch.optim.AdamW([q for m in ref for q in m.parameters() if q.requires_grad],
                                lr=0.1, weight_decay=0.1)
    half = slice(pipeline * rows // 2, (pipeline + 1) * rows // 2)
    worst, batch_worst = 0.0, 0.0
    for step, route in enumerate(routes):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(rows, ref[-1].lin.in_features, generator=g), \
            torch.randn(rows, ref[-1].lin.in_features, generator=g)
        use = torch.tensor(route[0] + route[1]).repeat_interleave(rows // 2 // chunks)
        for opt in opts:
            opt.zero_grad()
        ref_opt.zero_grad()
        mine_x = x[half].clone().requires_grad_(batch_grad)
        halves = [h.clone().requires_grad_(batch_grad) for h in x.tensor_split(2)]
        schedule.step(*((mine_x,) if 0 in mine else ()),
                      target=y[half] if n - 1 in mine else None, use=use[half])
        loss = 0
        for xi, yi, ui in zip([xi for h in halves for xi in h.tensor_split(chunks)],
                              y.tensor_split(2 * chunks),
                              use.tensor_split(2 * chunks)):
            h = xi
            for module in ref:
                h = module(h, ui)
            loss = loss + F.mse_loss(h, yi) / (2 * chunks)
        loss.backward()
        if batch_grad and 0 in mine:
            # one process on this pipeline's half alone: its mean loss, twice the reference's
            got, want = mine_x.grad, halves[pipeline].grad
            want = None if want is None else 2 * want
            batch_worst = max(batch_worst, float("inf") if (got is None) != (want is None)
                              else 0.0 if got is None else (got - want).abs().max().item())
        for opt in opts:
            opt.step()
        ref_opt.step()
        worst = max([worst] + [(a - b).abs().max().item() for s in mine for a, b in zip(
            _full_params(modules[s], parts[s]), ref[s].parameters())])
    return batch_worst if batch_grad else worst


class _FrozenFork(torch.nn.Module):
    """``(tanh(t(h)), f(t(h)))`` with ``f`` frozen: under FSDP ``f``'s unit has no gradient
    but a backward reaching its output gathers it (input gradient)."""

    def __init__(self):
        super().__init__()
        from tests.nn.test_pipe_forward_only import D
        self.t, self.f = torch.nn.Linear(D, D), torch.nn.Linear(D, D)
        self.f.requires_grad_(False)

    def forward(self, x, use):
        from tests.nn.test_pipe_forward_only import _route
        h = self.t(_route(x, use))
        return torch.tanh(h), self.f(h)


class _Crossed(torch.nn.Module):
    """``(c1(c2(h)), c2(c1(h)))``: both outputs reach both units, in opposite orders."""

    def __init__(self):
        super().__init__()
        from tests.nn.test_pipe_forward_only import D
        self.c1, self.c2 = torch.nn.Linear(D, D), torch.nn.Linear(D, D)

    def forward(self, x, use):
        from tests.nn.test_pipe_forward_only import _route
        h = _route(x, use)
        return torch.tanh(self.c1(torch.tanh(self.c2(h)))), self.c2(torch.tanh(self.c1(h)))


def _stage_modules(kind, n):
    from tests.nn.test_pipe_forward_only import _fork_modules, _Join

    if kind == "fork":
        return _fork_modules(n)
    torch.manual_seed(0)
    return [{"frozen": _FrozenFork, "crossed": _Crossed}[kind]() for _ in range(n - 1)] + \
        [_Join()]


# per step, (pipeline 0's, pipeline 1's) ``use`` per micro-batch: 0 the second output unused,
# 1 both used, 2 the first unused, 4 the second detached; the same in both pipelines or not
_PARTLY_UNUSED = [[[0, 0], [0, 0]], [[0, 1], [0, 2]], [[0, 0], [1, 1]], [[2, 4], [2, 4]]]


def test_an_output_no_later_stage_uses_gets_no_gradient_under_sharded_ddp_and_fsdp(world4):
    """A ShardedDDP or FSDP stage backpropagated zeros for an output the next stage ignored, so
    AdamW decayed and moved the weights only that output depends on (one process: ``.grad``
    ``None``, unchanged), in both pipelines. The output is now left out wherever the stage's
    reductions stay those of its replicas (plain backward), and an FSDP stage's split W hands
    its units only the gradients real output gradients reached, outputs unused on every
    micro-batch (3) included."""
    cases = [("sharded_ddp", "GPipe"), ("sharded_ddp", "ZB-H1"), ("fsdp", "1F1B"),
             ("fsdp", "ZB-H1"), ("fsdp", "ZBV")]
    for wrapper, name in cases:
        routes = _PARTLY_UNUSED + ([[[3, 3], [3, 3]]] if name in ("ZB-H1", "ZBV") and
                                   wrapper == "fsdp" else [])
        for rank, worst in enumerate(world4.run(_unused_outputs_under, wrapper, name, routes)):
            assert worst < 1e-5, (wrapper, name, rank, worst)


def test_fsdp_units_replicas_reach_alike_whatever_output_is_used(world4):
    """Nested FSDP units (plain backward: GPipe, 1F1B) whose replicas use different outputs:
    a frozen unit that only the unused output's backward gathers (one replica gathered it, the
    other not: gloo aborted), and two units both outputs reach in opposite orders (the
    reduce-scatters paired different units). Every replica now runs the whole graph (zeros for
    the unused output, whose views get None), and matches one process; an output no replica
    uses leaves its weights alone."""
    routes = {"frozen": [[[0, 0], [1, 1]], [[1, 1], [0, 0]], [[0, 1], [1, 0]], [[0, 0], [0, 0]]],
              "crossed": [[[0, 0], [2, 2]], [[2, 2], [0, 0]], [[0, 2], [2, 0]], [[3, 3], [0, 0]]]}
    for kind, name in [("frozen", "GPipe"), ("crossed", "1F1B")]:
        for rank, worst in enumerate(world4.run(_unused_outputs_under, "fsdp", name,
                                                routes[kind], kind, True)):
            assert worst < 1e-5, (kind, name, rank, worst)


def test_a_batch_no_later_stage_uses_keeps_grad_none_under_sharded_ddp_and_fsdp(world4):
    """A first stage under ShardedDDP or FSDP backpropagates zeros for an output the next
    stage ignored (its replicas' reductions must pair), and under GPipe / 1F1B that plain
    backward ran into the batch itself: a batch requiring grad that no later stage used got
    ``.grad`` zeros (one process: ``None``). Now only real output gradients reach it."""
    # last: no replica uses stage 0's outputs (ShardedDDP's stage then gets zeros, not None)
    routes = [[[3, 1], [1, 3]], [[3, 3], [1, 1]], [[3, 3], [3, 3]]]
    for wrapper, name in [("sharded_ddp", "GPipe"), ("fsdp", "1F1B")]:
        for rank, worst in enumerate(world4.run(_unused_outputs_under, wrapper, name, routes,
                                                batch_grad=True)):
            assert worst < 1e-5, (wrapper, name, rank, worst)


def test_fsdp_zero_bubble_last_stage_ignoring_its_input_on_one_replica_only(world4):
    """ZB-H1 under FSDP whose last stage ignores its input in one pipeline and uses it in the
    other (``use`` 3 against 1 or 2): its B reached no unit there, so FSDP's hooks neither
    gathered nor freed, and the root unit stayed gathered from its forward; the next forward's
    check of kept units (an all-reduce) met the other replica's all-gather, a hang. Such a B
    now walks the units as the other replica's did; flat and nested units match one process."""
    routes = [[[3, 3], [1, 1]], [[1, 3], [3, 1]], [[0, 3], [3, 2]]]
    for nested in (False, True):
        for rank, worst in enumerate(world4.run(_unused_outputs_under, "fsdp", "ZB-H1", routes,
                                                "fork", nested)):
            assert worst < 1e-5, (nested, rank, worst)
