"""DeepSpeed-Chat's training scripts (step 1 supervised fine-tuning, step 2 reward model) under
``import shardkit as deepspeed``.

The scripts' config (``dschat/utils/ds_utils.py``'s ``get_train_ds_config``) is rebuilt here
for stages 0-3, CPU offload on and off, fp16 and bf16, with its ``hybrid_engine`` and
``tensorboard`` sections; their helpers (``dschat/utils/utils.py``) are re-written below from
their behaviour: weight-decay / no-decay / LoRA param groups by name, ``get_all_reduce_mean``,
``print_rank_0``, ``save_hf_format``, ``save_zero_three_model`` (``hasattr(p, 'ds_id')``,
``ds_status``, ``GatheredParameters``) and ``moving_average`` (into an EMA engine built as
``rlhf_engine.py``'s ``_init_ema`` builds it: forward-only, the actor's dtype, so both are
16-bit at stages 0-2 under fp16/bf16). A tiny OPT causal LM (2 layers, hidden 32, vocab 128,
built from a config) with LoRA adapters trains with ``FusedAdam`` or ``DeepSpeedCPUAdam``
(``shardkit.ops.adam``), Hugging Face's cosine schedule, gradient accumulation from the
config, clipping 1.0, HF activation checkpointing switched on before ``initialize``;
``model.backward(loss)`` / ``model.step()`` and evaluation with ``model.eval()`` and
perplexity. In fp32 every rank's losses and parameters equal one-process training on the
global batch after every optimizer step, at every stage; the saved files equal the
one-process model. Under fp16/bf16 the fp32 weights (the optimizer's masters at stages 0-2)
stay close to it. One world of 2 gloo ranks.
"""

import argparse
import copy
import math
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers

import shardkit as deepspeed
from shardkit.config import ConfigError, load_config
from shardkit.ops.adam import DeepSpeedCPUAdam, FusedAdam
from shardkit.testing import world_fixture
from shardkit.zero import ZeroParamStatus
from tests.utils.master_weights import fp32_weights

VOCAB, SEQ, MICRO, GAS, STEPS = 128, 8, 2, 2, 3
LR, LORA_LR, DECAY = 2e-3, 5e-3, 0.1
TOL = 2e-5

world2 = world_fixture(2)


# ----------------------------------------------------------------------------- the script's parts

def chat_config(offload, dtype, stage, hybrid=False, tensorboard=False, micro=4, world=2, gas=1):
    """``get_train_ds_config(offload, dtype, stage, ...)`` as DeepSpeed-Chat builds it, then
    the batch sizes its main.py sets. ``dtype`` other than fp16/bf16: no precision section
    (fp32, for exact parity)."""
    device = "cpu" if offload else "none"
    config = {
        "train_batch_size": 32, "train_micro_batch_size_per_gpu": 4, "steps_per_print": 10,
        "zero_optimization": {
            "stage": stage, "overlap_comm": True, "offload_param": {"device": device},
            "offload_optimizer": {"device": device},
            "stage3_param_persistence_threshold": 1e4, "stage3_max_live_parameters": 3e7,
            "stage3_prefetch_bucket_size": 3e7, "memory_efficient_linear": False},
        "gradient_clipping": 1.0, "prescale_gradients": False, "wall_clock_breakdown": False,
        "hybrid_engine": {"enabled": hybrid, "max_out_tokens": 512, "inference_tp_size": 1,
                          "release_inference_cache": False, "pin_parameters": True,
                          "tp_gather_partition_size": 8},
        "tensorboard": {"enabled": tensorboard, "output_path": "step1_tensorboard/ds_logs/",
                        "job_name": "step1_model_tensorboard"},
    }
    if dtype == "fp16":
        config["fp16"] = {"enabled": True, "loss_scale_window": 100}
    elif dtype == "bf16":
        config["bfloat16"] = {"enabled": True}
    config["train_micro_batch_size_per_gpu"] = micro
    config["train_batch_size"] = micro * world * gas
    return config


class LoRALinear(nn.Module):
    """A linear layer with a low-rank adapter, parameters named as DeepSpeed-Chat's."""

    def __init__(self, base: nn.Linear, dim: int = 4):
        super().__init__()
        self.weight, self.bias = base.weight, base.bias
        self.lora_right_weight = nn.Parameter(torch.randn(base.in_features, dim) * 0.1)
        self.lora_left_weight = nn.Parameter(torch.randn(dim, base.out_features) * 0.1)

    def forward(self, x):
        return F.linear(x, self.weight, self.bias) + x @ self.lora_right_weight @ \
            self.lora_left_weight


def tiny_opt(lora=True, seed=0):
    torch.manual_seed(seed)
    cfg = transformers.OPTConfig(vocab_size=VOCAB, hidden_size=32, num_hidden_layers=2,
                                 ffn_dim=64, num_attention_heads=4, max_position_embeddings=32,
                                 word_embed_proj_dim=32, dropout=0.0, attention_dropout=0.0)
    cfg._attn_implementation = "eager"
    model = transformers.OPTForCausalLM(cfg)
    if lora:
        for layer in model.model.decoder.layers:
            layer.self_attn.q_proj = LoRALinear(layer.self_attn.q_proj)
    return model


NO_DECAY = ("bias", "layer_norm.weight", "layernorm.weight", "norm.weight", "ln_f.weight")
LORA = ("lora_right_weight", "lora_left_weight")


def grouped_parameters(model, weight_decay, lora_lr):
    """Decay, LoRA (own lr) and no-decay groups by name; empty groups dropped."""
    named = [(n.lower(), p) for n, p in model.named_parameters() if p.requires_grad]
    no_decay = [p for n, p in named if any(k in n for k in NO_DECAY)]
    lora = [p for n, p in named if not any(k in n for k in NO_DECAY) and any(k in n for k in LORA)]
    decay = [p for n, p in named
             if not any(k in n for k in NO_DECAY) and not any(k in n for k in LORA)]
    groups = [{"params": decay, "weight_decay": weight_decay},
              {"params": lora, "weight_decay": weight_decay, "lr": lora_lr},
              {"params": no_decay, "weight_decay": 0.0}]
    return [g for g in groups if g["params"]]


def all_reduce_mean(tensor):
    torch.distributed.all_reduce(tensor, op=torch.distributed.ReduceOp.SUM)
    return tensor / torch.distributed.get_world_size()


def print_rank_0(msg, rank=None):
    if (rank is not None and rank <= 0) or (rank is None and torch.distributed.get_rank() == 0):
        print(msg)


def save_hf_format(model, output_dir):
    """Rank 0 only, as the script calls it: the module's state_dict without LoRA keys."""
    inner = model.module if hasattr(model, "module") else model
    os.makedirs(output_dir, exist_ok=True)
    state = {k: v for k, v in inner.state_dict().items() if "lora" not in k}
    torch.save(state, os.path.join(output_dir, "pytorch_model.bin"))
    inner.config.to_json_file(os.path.join(output_dir, "config.json"))


def to_fetch(params):
    return [p for p in params
            if hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE]


def save_zero_three_model(model, rank, save_dir, zero_stage):
    os.makedirs(save_dir, exist_ok=True)
    path = os.path.join(save_dir, "pytorch_model.bin")
    inner = model.module if hasattr(model, "module") else model
    if zero_stage != 3:
        if rank == 0:
            torch.save(inner.state_dict(), path)
        return
    out = {}
    for name, p in inner.named_parameters():
        if hasattr(p, "ds_id"):
            with deepspeed.zero.GatheredParameters(to_fetch([p]), enabled=True):
                value = p.data.cpu()
        else:
            value = p.cpu()
        if rank == 0 and "lora" not in name:
            out[name] = value.clone()
    if rank == 0:
        torch.save(out, path)


def eval_ds_config(offload, dtype, stage, micro=4, world=2):
    """``get_eval_ds_config(offload, dtype, stage)``, the config of DeepSpeed-Chat's EMA (and
    reference) engines, with the batch sizes ``rlhf_engine.py`` sets; no optimizer, so
    ``initialize`` gives a forward-only engine. ``dtype`` other than fp16/bf16: no precision
    section."""
    precision = {"fp16": {"fp16": {"enabled": True}},
                 "bf16": {"bfloat16": {"enabled": True}}}.get(dtype, {})
    return {
        **precision,
        "train_batch_size": micro * world, "train_micro_batch_size_per_gpu": micro,
        "steps_per_print": 10,
        "zero_optimization": {"stage": stage, "stage3_param_persistence_threshold": 1e4,
                              "offload_param": {"device": "cpu" if offload else "none"},
                              "memory_efficient_linear": False},
        "gradient_clipping": 1.0, "prescale_gradients": False, "wall_clock_breakdown": False,
    }


def moving_average(model, model_ema, beta=0.992, zero_stage=0):
    with torch.no_grad():
        for p, p_ema in zip(model.parameters(), model_ema.parameters()):
            fetch = to_fetch([p, p_ema]) if zero_stage == 3 else []
            with deepspeed.zero.GatheredParameters(fetch, enabled=len(fetch) > 0):
                p_ema.data.copy_(torch.lerp(p.data, p_ema.data, beta))


# ----------------------------------------------------------------------------- data, oracle

def micro_batch(step, micro, rank):
    g = torch.Generator().manual_seed(10_000 + 100 * step + 10 * micro + rank)
    ids = torch.randint(0, VOCAB, (MICRO, SEQ), generator=g)
    return {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids.clone()}


def eval_batches(rank, n=2):
    return [micro_batch(1000 + i, 0, rank) for i in range(n)]


def _reference_groups(reference, model_groups, model):
    """The reference model's parameters in the same groups (matched by name)."""
    names = {id(p): n for n, p in model.named_parameters()}
    ref = dict(reference.named_parameters())
    return [{**{k: v for k, v in g.items() if k != "params"},
             "params": [ref[names[id(p)]] for p in g["params"]]} for g in model_groups]


def _full_parameters(model):
    """Every parameter's full value (stage 3: gathered), by name."""
    params = list(model.parameters())
    with deepspeed.zero.GatheredParameters(params):
        return {n: p.detach().clone() for n, p in model.named_parameters()}


WRAPPER_PREFIX = "_fsdp_wrapped_module."


def _clean(state):
    """Names without the stage-3 wrapper's prefix (see test_stage3_parameter_names_are_hf)."""
    return {k.replace(WRAPPER_PREFIX, ""): v for k, v in state.items()}


def _max_diff(a, b):
    a, b = _clean(a), _clean(b)
    assert a.keys() == b.keys(), sorted(set(a) ^ set(b))
    return max((a[k].float() - b[k].float()).abs().max().item() for k in a)


# ----------------------------------------------------------------------------- rank side

def _train_like_chat(stage, offload=False, dtype="fp32", checkpointing="before", save_dir=None,
                     adam_w_mode=True):
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    model = tiny_opt()
    if checkpointing == "before":
        model.gradient_checkpointing_enable(
            gradient_checkpointing_kwargs={"use_reentrant": False})
    reference = copy.deepcopy(model)
    ema = copy.deepcopy(model)
    ema_ref = copy.deepcopy(model)
    groups = grouped_parameters(model, DECAY, LORA_LR)
    ref_cls = torch.optim.AdamW if adam_w_mode else torch.optim.Adam
    ref_opt = ref_cls(_reference_groups(reference, groups, model), lr=LR, betas=(0.9, 0.95),
                      weight_decay=0.0)
    if offload:
        optimizer = DeepSpeedCPUAdam(groups, lr=LR, betas=(0.9, 0.95), adamw_mode=adam_w_mode)
    else:
        optimizer = FusedAdam(groups, lr=LR, betas=(0.9, 0.95), adam_w_mode=adam_w_mode)
    schedule = dict(name="cosine", num_warmup_steps=1, num_training_steps=STEPS)
    scheduler = transformers.get_scheduler(optimizer=optimizer, **schedule)
    ref_sched = transformers.get_scheduler(optimizer=ref_opt, **schedule)
    config = chat_config(offload, dtype, stage, micro=MICRO, world=world, gas=GAS)
    args = argparse.Namespace(local_rank=rank, deepspeed_config=None, deepspeed=False)
    model, optimizer, _, scheduler = deepspeed.initialize(
        model=model, optimizer=optimizer, args=args, config=config, lr_scheduler=scheduler,
        dist_init_required=True)
    # rlhf_engine.py's _init_ema: a forward-only engine of the same dtype (16-bit weights under
    # fp16/bf16, as the actor's), at ZeRO-3 only if the actor is
    ema, *_ = deepspeed.initialize(
        model=ema, config=eval_ds_config(False, dtype, stage if stage == 3 else 0, micro=MICRO,
                                         world=world))
    if checkpointing == "after":  # where main.py calls it, with Hugging Face's defaults
        model.gradient_checkpointing_enable()
        reference.gradient_checkpointing_enable()

    def evaluation(net, batches):
        net.eval()
        losses = 0
        for i, batch in enumerate(batches):
            with torch.no_grad():
                losses += net(**batch).loss.float()
        losses = all_reduce_mean(losses / (i + 1))
        return math.exp(losses.item()), losses.item()

    def reference_eval():
        reference.eval()
        with torch.no_grad():
            per_rank = [sum(reference(**b).loss.float() for b in eval_batches(r)) / 2
                        for r in range(world)]
        return sum(per_rank).item() / world

    report = {"loss_diff": 0.0, "param_diff": 0.0, "lr_diff": 0.0}
    ppl, eval_loss = evaluation(model, eval_batches(rank))
    report["eval_diff"] = abs(eval_loss - reference_eval())
    report["ppl"] = ppl
    for step in range(STEPS):
        model.train()
        reference.train()
        for micro in range(GAS):
            out = model(**micro_batch(step, micro, rank), use_cache=False)
            model.backward(out.loss)
            model.step()
            loss = all_reduce_mean(out.loss.detach().clone())
            ref_losses = [reference(**micro_batch(step, micro, r), use_cache=False).loss
                          for r in range(world)]
            ref_loss = sum(ref_losses) / world
            (ref_loss / GAS).backward()
            report["loss_diff"] = max(report["loss_diff"], abs(loss.item() - ref_loss.item()))
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step()
        ref_sched.step()
        ref_opt.zero_grad()
        full = fp32_weights(model)  # fp16/bf16 at stages 0-2: the fp32 masters
        report["param_diff"] = max(report["param_diff"],
                                   _max_diff(full, dict(reference.named_parameters())))
        report["lr_diff"] = max(report["lr_diff"], max(
            abs(a - b["lr"]) for a, b in zip(model.get_lr(), ref_opt.param_groups)))
        moving_average(model, ema, zero_stage=stage)
        moving_average(reference, ema_ref, zero_stage=0)
    report["ema_diff"] = _max_diff(_full_parameters(ema.module),
                                   dict(ema_ref.named_parameters()))
    ppl, eval_loss = evaluation(model, eval_batches(rank))
    report["eval_diff"] = max(report["eval_diff"], abs(eval_loss - reference_eval()))
    if save_dir is not None:
        print_rank_0("saving the final model ...", rank)
        if rank == 0:  # stage 3: DeepSpeed's placeholders, overwritten just below
            save_hf_format(model, save_dir)
        if stage == 3:
            save_zero_three_model(model, rank, save_dir, zero_stage=stage)
        torch.distributed.barrier()
        saved = torch.load(os.path.join(save_dir, "pytorch_model.bin"), weights_only=True)
        expected = {k: v for k, v in reference.state_dict().items() if "lora" not in k}
        if stage == 3:  # save_zero_three_model saves parameters only
            expected = {k: v for k, v in dict(reference.named_parameters()).items()
                        if "lora" not in k}
        report["saved_diff"] = _max_diff(saved, expected)
        report["saved_names_hf"] = sorted(saved) == sorted(expected)
    return report


def _engine_marks_stage3_parameters():
    """Whether initialize gives stage-3 parameters DeepSpeed's ds_id / ds_status."""
    model = tiny_opt(lora=False)
    optimizer = FusedAdam(model.parameters(), lr=LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                      config=chat_config(False, "fp32", 3, micro=MICRO))
    params = list(engine.module.parameters())
    return [hasattr(p, "ds_id") and p.ds_status == ZeroParamStatus.NOT_AVAILABLE
            and tuple(p.ds_shape) != tuple(p.shape) for p in params[:1]] + \
        [all(hasattr(p, "ds_id") for p in params)]


def _gathered_status():
    """ds_status inside and after GatheredParameters, and ds_shape/ds_numel, at stage 3."""
    model = tiny_opt(lora=False)
    full_shape = tuple(model.lm_head.weight.shape)
    engine, *_ = deepspeed.initialize(model=model, optimizer=FusedAdam(model.parameters()),
                                      config=chat_config(False, "fp32", 3, micro=MICRO))
    marked = deepspeed.zero.expose_ds_attributes(engine.module)
    p = engine.module.lm_head.weight
    before = (p.ds_status, tuple(p.shape), tuple(p.ds_shape), p.ds_numel)
    with deepspeed.zero.GatheredParameters(to_fetch([p])):
        inside = (p.ds_status, tuple(p.shape))
    after = p.ds_status
    return marked == len(list(engine.module.parameters())), before, inside, after, full_shape


class RewardModel(nn.Module):
    """Step 2's critic: the decoder, a one-output head, a pairwise loss over the chosen
    (first half of the batch) and rejected (second half) sequences' last-token scores."""

    def __init__(self, base):
        super().__init__()
        self.config = base.config
        self.rwtransformer = base.model
        self.v_head = nn.Linear(base.config.hidden_size, 1, bias=False)

    def forward(self, input_ids, attention_mask=None, use_cache=False):
        hidden = self.rwtransformer(input_ids, attention_mask=attention_mask,
                                    use_cache=use_cache).last_hidden_state
        scores = self.v_head(hidden).squeeze(-1)[:, -1]
        half = input_ids.shape[0] // 2
        chosen, rejected = scores[:half], scores[half:]
        return {"loss": -F.logsigmoid(chosen - rejected).mean(),
                "chosen_mean_scores": chosen, "rejected_mean_scores": rejected}


def _train_reward_model(stage):
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    torch.manual_seed(1)
    model = RewardModel(tiny_opt(lora=False))
    reference = copy.deepcopy(model)
    with torch.no_grad():
        reference.v_head.weight.fill_(0.05)
    # step 2's head reset: at stage 3 only rank 0 edits (DeepSpeed: the gathered values are
    # broadcast from modifier_rank 0; here initialize starts every rank from rank 0's model)
    with deepspeed.zero.GatheredParameters([model.v_head.weight], modifier_rank=0,
                                           enabled=stage == 3):
        if deepspeed.comm.get_rank() == 0 or stage != 3:
            with torch.no_grad():
                model.v_head.weight.fill_(0.05)
    groups = grouped_parameters(model, DECAY, LORA_LR)
    ref_opt = torch.optim.AdamW(_reference_groups(reference, groups, model), lr=LR,
                                betas=(0.9, 0.95), weight_decay=0.0)
    optimizer = FusedAdam(groups, lr=LR, betas=(0.9, 0.95))
    engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                      config=chat_config(False, "fp32", stage, micro=MICRO,
                                                         world=world, gas=1))
    diffs = [0.0, 0.0]
    for step in range(STEPS):
        out = engine(**{k: v for k, v in micro_batch(step, 0, rank).items() if k != "labels"},
                     use_cache=False)
        engine.backward(out["loss"])
        engine.step()
        loss = all_reduce_mean(out["loss"].detach().clone())
        ref_loss = sum(reference(micro_batch(step, 0, r)["input_ids"])["loss"]
                       for r in range(world)) / world
        ref_loss.backward()
        torch.nn.utils.clip_grad_norm_(reference.parameters(), 1.0)
        ref_opt.step()
        ref_opt.zero_grad()
        diffs[0] = max(diffs[0], abs(loss.item() - ref_loss.item()))
        diffs[1] = max(diffs[1], _max_diff(_full_parameters(engine.module),
                                           dict(reference.named_parameters())))
    engine.eval()
    with torch.no_grad():
        out = engine(micro_batch(99, 0, rank)["input_ids"])
    acc = all_reduce_mean((out["chosen_mean_scores"] > out["rejected_mean_scores"]).float()
                          .mean())
    return diffs, acc.item()


# ----------------------------------------------------------------------------- tests

@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("offload", [False, True])
@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
@pytest.mark.parametrize("hybrid", [False, True])
def test_train_config_accepted_as_built(stage, offload, dtype, hybrid):
    cfg = load_config(chat_config(offload, dtype, stage, hybrid=hybrid), 2)
    assert cfg.zero.stage == stage
    assert cfg.precision.dtype == dtype
    assert cfg.zero.offload_optimizer_device == ("cpu" if offload else "none")
    assert cfg.zero.offload_param_device == ("cpu" if offload and stage == 3 else "none")
    assert cfg.gradient_clipping == 1.0
    if dtype == "fp16":
        assert cfg.precision.loss_scale_window == 100
    assert any("hybrid_engine" in w for w in cfg.warnings) == hybrid
    assert cfg.checked["hybrid_engine"]["max_out_tokens"] == 512


@pytest.mark.parametrize("path, value, words", [
    (("hybrid_engine", "max_out_tokens"), 0, "hybrid_engine.max_out_tokens=0"),
    (("hybrid_engine", "inference_tp_size"), "2", "hybrid_engine.inference_tp_size='2'"),
    (("hybrid_engine", "enabled"), "yes", "hybrid_engine.enabled='yes'"),
    (("hybrid_engine", "max_out_token"), 512, "hybrid_engine.max_out_tokens"),
    (("zero_optimization", "memory_efficient_linear"), 1, "memory_efficient_linear=1"),
    (("zero_optimization", "zero_quantized_nontrainable_weights"), True,
     "zero_quantized_nontrainable_weights=True is not supported"),
    (("tensorboard", "enabled"), True, "tensorboard.enabled=True is not supported"),
])
def test_bad_chat_config_values_name_the_key(path, value, words):
    config = chat_config(False, "bf16", 3)
    config[path[0]][path[1]] = value
    with pytest.raises(ConfigError, match=words.replace(".", r"\.").replace("(", r"\(")):
        load_config(config, 2)


def test_ops_adam_reachable_through_the_alias():
    assert deepspeed.ops.adam.FusedAdam is FusedAdam
    assert deepspeed.ops.adam.DeepSpeedCPUAdam is DeepSpeedCPUAdam


@pytest.mark.parametrize("stage, offload", [(0, False), (1, False), (2, True), (3, False),
                                            (3, True)])
def test_chat_training_matches_one_process(world2, tmp_path, stage, offload):
    reports = world2.run(_train_like_chat, stage, offload=offload,
                         save_dir=str(tmp_path / "out"))
    for report in reports:
        assert report["loss_diff"] < TOL, report
        assert report["param_diff"] < TOL, report
        assert report["lr_diff"] < 1e-12, report
        assert report["eval_diff"] < TOL, report
        assert report["ema_diff"] < TOL, report
        assert report["saved_diff"] < TOL, report
        assert report["saved_names_hf"], report


def _stage3_names():
    model = tiny_opt(lora=False)
    model.register_buffer("steps_seen", torch.zeros(()))  # one buffer outside every unit
    names = [n for n, _ in model.named_parameters()]
    buffers = [n for n, _ in model.named_buffers()]
    cls = type(model)
    engine, *_ = deepspeed.initialize(model=model, optimizer=FusedAdam(model.parameters()),
                                      config=chat_config(False, "fp32", 3, micro=MICRO))
    inner = engine.module
    return dict(names=(names, [n for n, _ in inner.named_parameters()]),
                buffers=(buffers, [n for n, _ in inner.named_buffers()]),
                lookup=all(inner.get_parameter(n) is p for n, p in inner.named_parameters()),
                same_class=(isinstance(inner, cls), type(inner).__name__ == cls.__name__))


def test_stage3_parameter_names_are_hf(world2):
    """DeepSpeed keeps the module tree at stage 3, so save_zero_three_model keys its file by
    ``engine.module.named_parameters()``: the names must be the model's own, not FSDP's."""
    for report in world2.run(_stage3_names):
        assert report["names"][1] == report["names"][0], report
        assert report["buffers"][1] == report["buffers"][0], report
        assert report["lookup"] and report["same_class"] == (True, True), report


class _Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)
        self.scale = nn.Parameter(torch.ones(8))
        self.register_buffer("mask", torch.ones(8))

    def forward(self, x):
        return self.lin(x) * self.scale * self.mask


class _Net(nn.Module):
    def __init__(self):
        super().__init__()
        self.blocks = nn.ModuleList([_Block() for _ in range(3)])  # repeated: the units
        self.head = nn.Linear(8, 8)

    def forward(self, x):
        for block in self.blocks:
            x = block(x)
        return self.head(x)


def _stage3_lookups():
    torch.manual_seed(0)
    model = _Net()
    buffers = [n for n, _ in model.named_buffers()]
    engine, *_ = deepspeed.initialize(model=model, config={
        "train_batch_size": 4, "train_micro_batch_size_per_gpu": 2,
        "zero_optimization": {"stage": 3}, "optimizer": {"type": "SGD", "params": {"lr": 0.1}}})
    inner = engine.module
    found = []
    for name, b in inner.named_buffers():
        try:
            found.append(inner.get_buffer(name) is b)
        except AttributeError as e:
            found.append(str(e))
    return dict(buffers=(buffers, [n for n, _ in inner.named_buffers()]), found=found,
                params=all(inner.get_parameter(n) is p for n, p in inner.named_parameters()))


def test_stage3_names_resolve_with_get_buffer(world2):
    """Members a unit's own module holds (blocks.0.mask) resolve by the names given."""
    for report in world2.run(_stage3_lookups):
        assert report["buffers"][1] == report["buffers"][0], report
        assert report["found"] == [True] * 3 and report["params"], report


@pytest.mark.parametrize("stage, offload", [(1, False), (2, True), (3, False)])
def test_l2_mode_survives_every_stage(world2, stage, offload):
    """adam_w_mode=False (L2 decay) is kept where OSS rebuilds the optimizer and at stage 3."""
    reports = world2.run(_train_like_chat, stage, offload=offload, checkpointing=None,
                         adam_w_mode=False)
    for report in reports:
        assert report["loss_diff"] < TOL and report["param_diff"] < TOL, report


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_checkpointing_enabled_after_initialize(world2, stage):
    """main.py's order: model.gradient_checkpointing_enable() on the engine, HF's defaults."""
    for report in world2.run(_train_like_chat, stage, checkpointing="after"):
        assert report["loss_diff"] < TOL and report["param_diff"] < TOL, report


@pytest.mark.parametrize("stage, dtype", [(1, "bf16"), (3, "fp16")])
def test_chat_training_low_precision(world2, stage, dtype):
    reports = world2.run(_train_like_chat, stage, dtype=dtype, checkpointing=None)
    assert reports[0]["loss_diff"] == reports[1]["loss_diff"]
    for report in reports:  # autocast over fp32 master weights: close to the fp32 oracle
        assert report["loss_diff"] < 5e-2, report
        assert report["param_diff"] < 5e-2, report


@pytest.mark.parametrize("stage", [0, 2, 3])
def test_reward_model_matches_one_process(world2, stage):
    results = world2.run(_train_reward_model, stage)
    assert results[0][1] == results[1][1]  # the accuracy every rank reports
    for (loss_diff, param_diff), _ in results:
        assert loss_diff < TOL and param_diff < TOL, (loss_diff, param_diff)


def test_gathered_parameters_sets_ds_status(world2):
    for marked, before, inside, after, full_shape in world2.run(_gathered_status):
        assert marked
        status, shard_shape, ds_shape, ds_numel = before
        assert status == ZeroParamStatus.NOT_AVAILABLE and ds_shape == full_shape
        assert shard_shape[0] == full_shape[0] // 2 and ds_numel == math.prod(full_shape)
        assert inside == (ZeroParamStatus.AVAILABLE, full_shape)
        assert after == ZeroParamStatus.NOT_AVAILABLE


def test_initialize_marks_stage3_parameters(world2):
    for result in world2.run(_engine_marks_stage3_parameters):
        assert all(result), result


def _save_hf_format_stage3(save_dir):
    model = tiny_opt(lora=False)
    shapes = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    engine, *_ = deepspeed.initialize(model=model, optimizer=FusedAdam(model.parameters()),
                                      config=chat_config(False, "fp32", 3, micro=MICRO))
    with deepspeed.zero.GatheredParameters(list(engine.module.parameters())[:1]):  # all ranks
        first = next(iter(engine.module.state_dict().items()))
    if torch.distributed.get_rank() != 0:
        return None
    save_hf_format(engine, save_dir)
    saved = torch.load(os.path.join(save_dir, "pytorch_model.bin"), weights_only=True)
    return dict(keys=sorted(saved) == sorted(shapes),
                empty=sorted(k for k, v in saved.items() if v.numel() == 0),
                params=sorted(n for n, _ in engine.module.named_parameters(
                    remove_duplicate=False)),
                config=os.path.exists(os.path.join(save_dir, "config.json")),
                gathered=tuple(first[1].shape) == shapes[first[0]])


def test_stage3_save_hf_format_on_rank_0_writes_placeholders(world2, tmp_path):
    """At stage 3 the unwrapped model's state_dict() on rank 0 alone (DeepSpeed-Chat's
    save_hf_format at every stage) gives DeepSpeed's empty placeholders for the sharded
    parameters, the model's keys and its config, with no collective, so no rank waits; inside
    GatheredParameters a parameter has its value. save_zero_three_model then writes the weights
    (test_chat_training_matches_one_process)."""
    rank0, rank1 = world2.run(_save_hf_format_stage3, str(tmp_path))
    assert rank1 is None
    assert rank0["keys"] and rank0["config"] and rank0["gathered"], rank0
    assert rank0["empty"] == [n for n in rank0["params"]], rank0


def _epoch_end():
    model = tiny_opt(lora=False)
    engine, *_ = deepspeed.initialize(model=model, optimizer=FusedAdam(model.parameters()),
                                      config=chat_config(False, "fp32", 0, micro=MICRO))
    engine.tput_timer.update_epoch_count()  # main.py, after each epoch
    x = torch.randint(0, 128, (MICRO, 8))
    for _ in range(2):
        engine.backward(engine(input_ids=x, labels=x).loss)
        engine.step()
    timer = engine.tput_timer
    return (timer.epoch_count, timer.global_step_count, timer.total_samples,
            timer.avg_samples_per_sec() > 0)


def test_engine_has_tput_timer(world2):
    for epochs, steps, samples, measured in world2.run(_epoch_end):
        assert (epochs, steps, samples, measured) == (1, 2, 2 * MICRO * 2, True)
