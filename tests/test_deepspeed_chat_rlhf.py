"""DeepSpeed-Chat step 3 (RLHF with PPO) under ``import shardkit as deepspeed``.

``dschat/rlhf/rlhf_engine.py``'s ``DeepSpeedRLHFEngine`` builds its engines as written there,
all in one process: the actor from the train config (``hybrid_engine`` on or off, LoRA on or
off, its optimizer and cosine schedule), the reference model and the EMA actor from the eval
config (optimizer-less engines, ``offload_reference_model``; stage 0 unless the actor is at
stage 3), the critic from the train config and the reward model from the eval config (both
``RewardModel`` over an OPT decoder, as ``dschat/utils/model/reward_model.py``; the reward
engine optimizer-less). ``dschat/rlhf/ppo_trainer.py``'s ``DeepSpeedPPOTrainer`` then runs
as written: ``generate_experience`` (``actor.module.generate(..., synced_gpus=stage == 3)``
with greedy decoding, the two ranks' answers ending at different lengths; actor, reference,
``reward.forward_value`` and ``critic.forward_value`` under ``no_grad``), ``train_rlhf`` (the
clipped policy loss and the clipped value loss, ``backward`` and ``step`` on the actor then
the critic) and step 3's ``main.py`` around it: the actor engine's
``gradient_checkpointing_enable()`` / ``_disable()`` around training, ``moving_average`` into
the EMA engine, and at the end ``convert_lora_to_linear_layer`` and the saves
(``save_hf_format`` on rank 0, ``save_zero_three_model`` at stage 3), which must load back with
``from_pretrained`` / ``load_state_dict``.

In fp32 every rank's losses, full actor, critic and EMA parameters equal one-process training
over both ranks' experience (the same greedy generation, plain torch models, torch AdamW)
after every PPO step. One world of 2 gloo ranks.

Found here and fixed: a critic at stage 3 (``engine.forward_value`` ran outside the root FSDP
unit, whose gradients were dropped silently) and ``get_overflow()`` (``engine.optimizer.overflow``
was missing, so DeepSpeed-Chat's default fp16 stopped after step 1).
"""

import math
import os

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F
import transformers

import shardkit as deepspeed
from shardkit.ops.adam import DeepSpeedCPUAdam, FusedAdam
from shardkit.testing import world_fixture
from tests.test_deepspeed_chat import (
    DECAY, LORA_LR, LR, TOL, _full_parameters, _max_diff, all_reduce_mean, chat_config,
    eval_ds_config, grouped_parameters, moving_average, save_hf_format, save_zero_three_model,
    tiny_opt, to_fetch)

PAD, EOS = 1, 5          # OPT's pad token; the end token the tiny actor emits early
PROMPT, ANSWER = 4, 4    # max_prompt_seq_len, max_answer_seq_len
MICRO = 2                # per_device_generation_batch_size = per_device_training_batch_size
PPO_STEPS = 2
VOCAB_IDS = 128
CRITIC_LR = 1e-3

world2 = world_fixture(2)


# ----------------------------------------------------------------------------- the models

class LinearLayer_LoRA(nn.Module):
    """``dschat/utils/module/lora.py``'s adapter: the frozen base weight, ``lora_right_weight``
    (kaiming) and ``lora_left_weight`` (zeros), ``lora_scaling / lora_dim``, and
    ``fuse_lora_weight`` for the save. Its ``train()`` / ``eval()`` only touch the dropout, as
    there."""

    def __init__(self, weight, lora_dim, bias=None):
        super().__init__()
        self.weight, self.bias = weight, bias
        rows, columns = getattr(weight, "ds_shape", weight.shape)
        self.lora_right_weight = nn.Parameter(torch.zeros(columns, lora_dim))
        self.lora_left_weight = nn.Parameter(torch.zeros(lora_dim, rows))
        self.lora_scaling = 1.0 / lora_dim
        self.lora_dropout = nn.Identity()
        nn.init.kaiming_uniform_(self.lora_right_weight, a=math.sqrt(5))
        self.weight.requires_grad = False
        self.fuse_lora = False

    def eval(self):
        self.lora_dropout.eval()

    def train(self, mode=True):
        self.lora_dropout.train(mode)

    def fuse_lora_weight(self):
        if not self.fuse_lora:
            self.weight.data += self.lora_scaling * (self.lora_left_weight.t()
                                                     @ self.lora_right_weight.t())
        self.fuse_lora = True

    def forward(self, x):
        if self.fuse_lora:
            return F.linear(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias) + \
            (self.lora_dropout(x) @ self.lora_right_weight @ self.lora_left_weight) * \
            self.lora_scaling


def convert_linear_layer_to_lora(model, part_module_name, lora_dim):
    names = [n for n, m in model.named_modules()
             if isinstance(m, nn.Linear) and part_module_name in n]
    for name in names:
        parent, _, leaf = name.rpartition(".")
        holder = model.get_submodule(parent)
        base = getattr(holder, leaf)
        setattr(holder, leaf, LinearLayer_LoRA(base.weight, lora_dim, base.bias))
    return model


def only_optimize_lora_parameters(model):
    for name, param in model.named_parameters():
        param.requires_grad = "lora_right_weight" in name or "lora_left_weight" in name
    return model


def convert_lora_to_linear_layer(model):
    """The save's fusion: each adapter's tensors gathered with ``modifier_rank=0`` at stage
    3, fused into the base weight."""
    for module in [m for m in model.modules() if isinstance(m, LinearLayer_LoRA)]:
        zero3 = hasattr(module.weight, "ds_id")
        with deepspeed.zero.GatheredParameters(
                to_fetch([module.weight, module.bias, module.lora_left_weight,
                          module.lora_right_weight]), modifier_rank=0, enabled=zero3):
            module.fuse_lora_weight()
    return model


class RewardModel(nn.Module):
    """``dschat/utils/model/reward_model.py``'s ``RewardModel``: the decoder
    (``rwtransformer``), a one-output ``v_head``, and ``forward_value``, which step 3 calls
    on the critic (values of every position) and on the reward model (the score of each
    answer's last token before padding)."""

    def __init__(self, base_model, pad_id=PAD):
        super().__init__()
        self.config = base_model.config
        self.v_head = nn.Linear(self.config.word_embed_proj_dim, 1, bias=False)
        self.rwtransformer = base_model
        self.PAD_ID = pad_id

    def gradient_checkpointing_enable(self):
        self.rwtransformer.gradient_checkpointing_enable()

    def gradient_checkpointing_disable(self):
        self.rwtransformer.gradient_checkpointing_disable()

    def forward_value(self, input_ids=None, attention_mask=None, return_value_only=False,
                      prompt_length=0, use_cache=False):
        hidden = self.rwtransformer(input_ids, attention_mask=attention_mask,
                                    use_cache=use_cache)[0]
        values = self.v_head(hidden).squeeze(-1)
        if return_value_only:
            return values
        assert prompt_length > 1
        ends = []
        for i in range(values.size(0)):
            pads = (input_ids[i, prompt_length:] == self.PAD_ID).nonzero()
            end = pads[0].item() + prompt_length if len(pads) > 0 else input_ids.shape[1]
            ends.append(values[i, end - 1])
        return {"values": values, "chosen_end_scores": torch.stack(ends)}


def make_actor(lora):
    """The step-1 model (seed 0) with LoRA on the decoder's linear layers and only the
    adapters trained (``--actor_lora_dim 4 --only_optimize_lora``), or without LoRA."""
    model = tiny_opt(lora=False, seed=0)
    model.generation_config.eos_token_id = EOS
    if lora:
        torch.manual_seed(5)
        convert_linear_layer_to_lora(model, "decoder.layers.", 4)
        only_optimize_lora_parameters(model)
        model.enable_input_require_grads()  # make_model_gradient_checkpointing_compatible
    return model


def make_critic():
    """The step-2 reward model (seed 1); the critic and the reward model start from it."""
    base = tiny_opt(lora=False, seed=1).model
    torch.manual_seed(2)
    return RewardModel(base)


def eval_config(offload, stage, world, dtype="fp32"):
    """``get_eval_ds_config(offload, dtype, stage)`` (fp32: no precision section) with the
    batch sizes ``rlhf_engine.py`` sets."""
    return eval_ds_config(offload, dtype, stage, micro=MICRO, world=world)


def train_config(offload, stage, world, hybrid=False, dtype="fp32", scale_power=None):
    """``get_train_ds_config``; ``scale_power``: the fp16 loss scale's initial power of 2
    (DeepSpeed's default 16)."""
    config = chat_config(offload, dtype, stage, hybrid=hybrid, micro=MICRO, world=world)
    if scale_power is not None:
        config["fp16"]["initial_scale_power"] = scale_power
    config["hybrid_engine"]["max_out_tokens"] = PROMPT + ANSWER
    return config


def _optimizer_and_schedule(model, offload, lr):
    groups = grouped_parameters(model, DECAY, LORA_LR)
    cls = DeepSpeedCPUAdam if offload else FusedAdam
    optimizer = cls(groups, lr=lr, betas=(0.9, 0.95))
    return optimizer, _cosine(optimizer)


def _cosine(optimizer):
    return transformers.get_scheduler(name="cosine", optimizer=optimizer, num_warmup_steps=0,
                                      num_training_steps=PPO_STEPS + 1)


# ----------------------------------------------------------------------------- the trainer

KL_CTL, CLIP_REWARD, CLIPRANGE, CLIPRANGE_VALUE, GAMMA, LAM = 0.1, 5.0, 0.2, 0.2, 1.0, 0.95


def gather_log_probs(logits, labels):
    return F.log_softmax(logits, dim=-1).gather(dim=-1, index=labels.unsqueeze(-1)).squeeze(-1)


class PPOTrainer:
    """``DeepSpeedPPOTrainer``'s experience and losses, over engines (or, for the one-process
    reference, :class:`Plain` models, which offer the same calls)."""

    def __init__(self, actor, ref, critic, reward, z3_enabled):
        self.actor_model, self.ref_model = actor, ref
        self.critic_model, self.reward_model = critic, reward
        self.z3_enabled = z3_enabled
        self.last_generated_experience = None

    def _generate_sequence(self, prompts, mask):
        with torch.no_grad():
            seq = self.actor_model.module.generate(
                prompts, attention_mask=mask, max_length=ANSWER + prompts.shape[1],
                pad_token_id=PAD, synced_gpus=self.z3_enabled)
        self.prompt_length = prompts.shape[1]
        valid = (seq[:, self.prompt_length:] != PAD).sum(dim=-1)
        kept = [seq[i:i + 1] for i in range(seq.shape[0]) if valid[i] > 1]
        return torch.cat(kept, dim=0) if kept else None

    def generate_experience(self, prompts, mask):
        self.eval()
        seq = self._generate_sequence(prompts, mask)
        if seq is None:
            prompts = self.last_generated_experience["prompts"]
            seq = self.last_generated_experience["seq"]
        else:
            self.last_generated_experience = {"prompts": prompts, "seq": seq}
        self.train()
        attention_mask = seq.not_equal(PAD).long()
        with torch.no_grad():
            output = self.actor_model(seq, attention_mask=attention_mask)
            output_ref = self.ref_model(seq, attention_mask=attention_mask)
            reward_score = self.reward_model.forward_value(
                seq, attention_mask, prompt_length=self.prompt_length)["chosen_end_scores"]
            values = self.critic_model.forward_value(
                seq, attention_mask, return_value_only=True).detach()[:, :-1]
        return {"prompts": prompts,
                "logprobs": gather_log_probs(output.logits[:, :-1, :], seq[:, 1:]),
                "ref_logprobs": gather_log_probs(output_ref.logits[:, :-1, :], seq[:, 1:]),
                "value": values, "rewards": reward_score.detach(), "input_ids": seq,
                "attention_mask": attention_mask}

    @staticmethod
    def compute_rewards(prompts, log_probs, ref_log_probs, reward_score, action_mask):
        rewards = -KL_CTL * (log_probs - ref_log_probs)
        start = prompts.shape[1] - 1
        ends = start + action_mask[:, start:].sum(1) + 1
        clipped = torch.clamp(reward_score, -CLIP_REWARD, CLIP_REWARD)
        for j in range(log_probs.shape[0]):
            rewards[j, start:ends[j]][-1] += clipped[j]
        return rewards

    @staticmethod
    def get_advantages_and_returns(values, rewards, start):
        lastgaelam, reversed_advantages = 0, []
        length = rewards.size(-1)
        for t in reversed(range(start, length)):
            nextvalues = values[:, t + 1] if t < length - 1 else 0.0
            delta = rewards[:, t] + GAMMA * nextvalues - values[:, t]
            lastgaelam = delta + GAMMA * LAM * lastgaelam
            reversed_advantages.append(lastgaelam)
        advantages = torch.stack(reversed_advantages[::-1], dim=1)
        return advantages.detach(), advantages + values[:, start:]

    @staticmethod
    def actor_loss_fn(logprobs, old_logprobs, advantages, mask):
        ratio = torch.exp((logprobs - old_logprobs) * mask)
        loss1 = -advantages * ratio
        loss2 = -advantages * torch.clamp(ratio, 1.0 - CLIPRANGE, 1.0 + CLIPRANGE)
        return torch.sum(torch.max(loss1, loss2) * mask) / mask.sum()

    @staticmethod
    def critic_loss_fn(values, old_values, returns, mask):
        clipped = torch.clamp(values, old_values - CLIPRANGE_VALUE, old_values + CLIPRANGE_VALUE)
        loss = torch.max((values - returns) ** 2, (clipped - returns) ** 2)
        return 0.5 * torch.sum(loss * mask) / mask.sum()

    def _targets(self, inputs):
        """The no-grad part of ``train_rlhf``: rewards, advantages, returns."""
        prompts, seq = inputs["prompts"], inputs["input_ids"]
        start = prompts.size(-1) - 1
        action_mask = inputs["attention_mask"][:, 1:]
        old_values = inputs["value"]
        with torch.no_grad():
            old_rewards = self.compute_rewards(prompts, inputs["logprobs"],
                                               inputs["ref_logprobs"], inputs["rewards"],
                                               action_mask)
            ends = start + action_mask[:, start:].sum(1) + 1
            for i in range(old_rewards.shape[0]):
                old_rewards[i, ends[i]:] = 0
                old_values[i, ends[i]:] = 0
            advantages, returns = self.get_advantages_and_returns(old_values, old_rewards, start)
        batch = {"input_ids": seq, "attention_mask": inputs["attention_mask"]}
        return start, action_mask, old_values, advantages, returns, batch

    def actor_loss(self, inputs, targets):
        start, action_mask, _, advantages, _, batch = targets
        logits = self.actor_model(**batch, use_cache=False).logits
        log_prob = gather_log_probs(logits[:, :-1, :], batch["input_ids"][:, 1:])
        return self.actor_loss_fn(log_prob[:, start:], inputs["logprobs"][:, start:],
                                  advantages, action_mask[:, start:])

    def critic_loss(self, targets):
        start, action_mask, old_values, _, returns, batch = targets
        value = self.critic_model.forward_value(**batch, return_value_only=True,
                                                use_cache=False)[:, :-1]
        return self.critic_loss_fn(value[:, start:], old_values[:, start:], returns,
                                   action_mask[:, start:])

    def train_rlhf(self, inputs):
        targets = self._targets(inputs)
        actor_loss = self.actor_loss(inputs, targets)
        self.actor_model.backward(actor_loss)
        self.actor_model.step()
        critic_loss = self.critic_loss(targets)
        self.critic_model.backward(critic_loss)
        self.critic_model.step()
        return actor_loss, critic_loss

    def get_overflow(self, dtype):
        """After every step main.py asks (BF16_Optimizer keeps no flag: bf16 never asks)."""
        if dtype == "bf16":
            return False, False
        return self.actor_model.optimizer.overflow, self.critic_model.optimizer.overflow

    def train(self):
        self.actor_model.train()
        self.critic_model.train()

    def eval(self):
        for model in (self.actor_model, self.critic_model, self.reward_model, self.ref_model):
            model.eval()


class Plain:
    """A plain model offering an engine's calls (``.module``, call, its methods)."""

    def __init__(self, module):
        self.module = module

    def __call__(self, *args, **kwargs):
        return self.module(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self.module, name)


# ----------------------------------------------------------------------------- data

STEP_PROMPTS = {  # rank 0's answers end (EOS) after 2 tokens; rank 1's run to ANSWER tokens
    (0, 0): [[77, 94, 22, 97], [122, 44, 9, 118]], (0, 1): [[47, 117, 61, 13], [91, 7, 55, 6]],
    (1, 0): [[98, 87, 118, 112], [81, 10, 62, 30]], (1, 1): [[125, 61, 104, 119], [PAD, 27, 6, 4]],
}


def prompt_batch(step, rank):
    """A left-padded prompt batch, as DeepSpeed-Chat's prompt dataset gives it."""
    prompts = torch.tensor(STEP_PROMPTS[step, rank])
    return prompts, prompts.ne(PAD).long()


# ----------------------------------------------------------------------------- rank side

def _rlhf_engine(case, world):
    """``DeepSpeedRLHFEngine.__init__``'s order: actor, ref, EMA, critic, reward."""
    stage, critic_stage, dtype = case["actor_stage"], case["critic_stage"], case["dtype"]
    actor_model = make_actor(case["lora"])
    optim, schedule = _optimizer_and_schedule(actor_model, case["offload"], LR)
    actor, *_ = deepspeed.initialize(
        model=actor_model, optimizer=optim, lr_scheduler=schedule,
        config=train_config(case["offload"], stage, world, hybrid=case["hybrid"], dtype=dtype,
                            scale_power=case["scale_power"]))
    ref, *_ = deepspeed.initialize(
        model=make_actor(False),
        config=eval_config(case["offload_ref"], stage if stage == 3 else 0, world, dtype))
    ema_model = make_actor(False)
    if case["lora"]:
        torch.manual_seed(6)
        convert_linear_layer_to_lora(ema_model, "decoder.layers.", 4)
    ema, *_ = deepspeed.initialize(
        model=ema_model, config=eval_config(case["offload_ref"], stage if stage == 3 else 0,
                                            world, dtype))
    critic_model = make_critic()
    optim, schedule = _optimizer_and_schedule(critic_model, case["offload"], CRITIC_LR)
    critic, *_ = deepspeed.initialize(model=critic_model, optimizer=optim,
                                      lr_scheduler=schedule,
                                      config=train_config(case["offload"], critic_stage, world,
                                                          dtype=dtype,
                                                          scale_power=case["scale_power"]))
    reward, *_ = deepspeed.initialize(
        model=make_critic(), config=eval_config(False, critic_stage if critic_stage == 3 else 0,
                                                world, dtype))
    if case["critic_ckpt"]:
        critic.gradient_checkpointing_enable()
    return actor, ref, ema, critic, reward


def _reference(case):
    """The same five models, plain, with torch AdamW and the same schedules."""
    actor = make_actor(case["lora"])
    ref = make_actor(False)
    ema = make_actor(False)
    if case["lora"]:
        torch.manual_seed(6)
        convert_linear_layer_to_lora(ema, "decoder.layers.", 4)
    critic, reward = make_critic(), make_critic()
    optims = []
    for model, lr in ((actor, LR), (critic, CRITIC_LR)):
        groups = grouped_parameters(model, DECAY, LORA_LR)
        optim = torch.optim.AdamW(groups, lr=lr, betas=(0.9, 0.95), weight_decay=0.0)
        optims.append((model, optim, _cosine(optim)))
    if case["critic_ckpt"]:
        critic.gradient_checkpointing_enable()
    for model in (ref, reward):
        model.eval()
    return actor, ref, ema, critic, reward, optims


def _reference_step(trainer, experiences, optims, world):
    """``train_rlhf`` over the global batch: each rank's loss as that rank computes it, the
    gradients of their mean, clipping 1.0, AdamW, the schedule."""
    targets = [trainer._targets(exp) for exp in experiences]
    actor_loss = sum(trainer.actor_loss(e, t) for e, t in zip(experiences, targets)) / world
    critic_loss = sum(trainer.critic_loss(t) for t in targets) / world
    for loss, (model, optim, schedule) in zip((actor_loss, critic_loss), optims):
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        schedule.step()
        optim.zero_grad()
    return actor_loss.item(), critic_loss.item()


def _run_step3(case, save_dir=None):
    rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
    stage = case["actor_stage"]
    actor, ref, ema, critic, reward = _rlhf_engine(case, world)
    trainer = PPOTrainer(actor, ref, critic, reward, z3_enabled=stage == 3)
    r_actor, r_ref, r_ema, r_critic, r_reward, optims = _reference(case)
    oracle = PPOTrainer(Plain(r_actor), Plain(r_ref), Plain(r_critic), Plain(r_reward), False)
    report = {"lengths": [], "modes": [], "overflow": [], "loss_diff": 0.0, "actor_diff": 0.0,
              "critic_diff": 0.0, "ema_diff": 0.0, "experience_diff": 0.0}
    for step in range(PPO_STEPS):
        out = trainer.generate_experience(*prompt_batch(step, rank))
        report["modes"].append((actor.module.training, critic.module.training,
                                ref.module.training, reward.module.training))
        report["lengths"].append(out["input_ids"].shape[1])
        experiences = [oracle.generate_experience(*prompt_batch(step, r)) for r in range(world)]
        mine = experiences[rank]
        assert torch.equal(out["input_ids"], mine["input_ids"]), (out["input_ids"], mine)
        report["experience_diff"] = max(report["experience_diff"], *(
            (out[k] - mine[k]).abs().max().item()
            for k in ("logprobs", "ref_logprobs", "value", "rewards")))
        if case["actor_ckpt"]:
            actor.gradient_checkpointing_enable()
            r_actor.gradient_checkpointing_enable()
        actor_loss, critic_loss = trainer.train_rlhf(out)
        moving_average(actor, ema, zero_stage=stage)
        ref_losses = _reference_step(oracle, experiences, optims, world)
        moving_average(r_actor, r_ema, zero_stage=0)
        if case["actor_ckpt"]:
            actor.gradient_checkpointing_disable()
            r_actor.gradient_checkpointing_disable()
        if case["dtype"] != "fp32":  # DeepSpeed-Chat's dtypes (its configs know no fp32)
            report["overflow"].append(trainer.get_overflow(case["dtype"]))
        losses = [all_reduce_mean(loss.detach().clone()).item()
                  for loss in (actor_loss, critic_loss)]
        report["loss_diff"] = max(report["loss_diff"],
                                  *(abs(a - b) for a, b in zip(losses, ref_losses)))
        for key, engine, model in (("actor_diff", actor, r_actor),
                                   ("critic_diff", critic, r_critic),
                                   ("ema_diff", ema, r_ema)):
            report[key] = max(report[key], _max_diff(_full_parameters(engine.module),
                                                     dict(model.named_parameters())))
    if save_dir is not None:
        report.update(_save_like_main(case, actor, critic, ema, (r_actor, r_critic, r_ema),
                                      rank, save_dir))
    return report


def _save_like_main(case, actor, critic, ema, reference, rank, save_dir):
    """step 3 main.py's end: LoRA fused into the weights, then save_hf_format on rank 0 (at
    stage 3 it writes DeepSpeed's empty placeholders and the config) and save_zero_three_model
    at stage 3, which overwrites the weights file."""
    stage, critic_stage = case["actor_stage"], case["critic_stage"]
    convert_lora_to_linear_layer(actor)
    convert_lora_to_linear_layer(ema)
    for model in reference:
        convert_lora_to_linear_layer(model)
    dirs = {name: os.path.join(save_dir, name) for name in ("actor", "critic", "actor_ema")}
    if rank == 0:
        for name, engine in (("actor", actor), ("critic", critic), ("actor_ema", ema)):
            save_hf_format(engine, dirs[name])
    if stage == 3:
        save_zero_three_model(actor, rank, dirs["actor"], zero_stage=stage)
        save_zero_three_model(ema, rank, dirs["actor_ema"], zero_stage=stage)
    if critic_stage == 3:
        save_zero_three_model(critic, rank, dirs["critic"], zero_stage=critic_stage)
    torch.distributed.barrier()
    result = {}
    r_actor, r_critic, r_ema = reference
    for name, model in (("actor", r_actor), ("actor_ema", r_ema)):
        loaded, info = transformers.OPTForCausalLM.from_pretrained(dirs[name],
                                                                   output_loading_info=True)
        result[name + "_load"] = (sorted(info["missing_keys"]), sorted(info["unexpected_keys"]))
        expected = {k: v for k, v in model.state_dict().items() if "lora" not in k}
        result[name + "_saved_diff"] = _max_diff(loaded.state_dict(), expected)
    loaded = make_critic()
    state = torch.load(os.path.join(dirs["critic"], "pytorch_model.bin"), weights_only=True)
    missing, unexpected = loaded.load_state_dict(state, strict=False)
    result["critic_load"] = (missing, unexpected)
    result["critic_saved_diff"] = _max_diff(loaded.state_dict(), r_critic.state_dict())
    torch.distributed.barrier()
    return result


class _ValueNet(nn.Module):
    """A root whose own parameters (``head``) serve a ``forward_value`` method, as the
    critic's ``v_head`` does."""

    def __init__(self):
        super().__init__()
        self.body = nn.Linear(4, 4)
        self.head = nn.Linear(4, 1)

    def forward(self, x):
        return self.head(self.body(x))

    def forward_value(self, x):
        return self.head(self.body(x)).squeeze(-1)


def _direct_call_after_no_grad_forward():
    """FSDP root, a ``no_grad`` call of ``forward_value`` (the unit stays gathered), then the
    same call with gradients and a backward: the error, or the shards' gradients."""
    from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
    torch.manual_seed(0)
    fsdp = FSDP(_ValueNet())
    x = torch.ones(2, 4)
    with torch.no_grad():
        fsdp.forward_value(x)
    try:
        fsdp.forward_value(x).sum().backward()
    except RuntimeError as error:
        return str(error), None
    return None, [p.grad is not None for p in fsdp.parameters()]


# ----------------------------------------------------------------------------- tests

def _case(actor_stage, critic_stage, hybrid, lora, offload, offload_ref, actor_ckpt,
          critic_ckpt, dtype="fp32", scale_power=None):
    return dict(actor_stage=actor_stage, critic_stage=critic_stage, hybrid=hybrid, lora=lora,
                offload=offload, offload_ref=offload_ref, actor_ckpt=actor_ckpt,
                critic_ckpt=critic_ckpt, dtype=dtype, scale_power=scale_power)


@pytest.mark.parametrize("case", [
    # actor ZeRO-3 + hybrid engine + LoRA (only the adapters trained) + checkpointing, the
    # reference and EMA offloaded stage-3 engines; critic and reward at stage 0
    _case(3, 0, True, True, False, True, True, True),
    # actor and critic ZeRO-2 with the CPU optimizer (--offload), reference / EMA / reward
    # at stage 0
    _case(2, 2, False, False, True, False, False, True),
    # actor ZeRO-3 without LoRA or hybrid engine, critic ZeRO-1
    _case(3, 1, False, False, False, False, False, False),
    # critic ZeRO-3: its reward engine at stage 3 too
    _case(2, 3, True, True, False, True, False, False),
], ids=["actor3-hybrid-lora-offload_ref", "actor2-critic2-offload", "actor3-critic1",
        "critic3"])
def test_step3_matches_one_process(world2, tmp_path, case):
    reports = world2.run(_run_step3, case, save_dir=str(tmp_path))
    assert reports[0]["lengths"][0] < reports[1]["lengths"][0], reports  # synced_gpus needed
    for report in reports:
        # generate_experience: eval() for generation, then train() on actor and critic only
        assert report["modes"] == [(True, True, False, False)] * PPO_STEPS, report
        assert report["experience_diff"] < TOL, report
        assert report["loss_diff"] < TOL, report
        assert report["actor_diff"] < TOL, report
        assert report["critic_diff"] < TOL, report
        assert report["ema_diff"] < TOL, report
        for name in ("actor", "actor_ema", "critic"):  # every key an HF / model name
            assert report[name + "_load"] == ([], []), report
        for name in ("actor", "actor_ema", "critic"):
            assert report[name + "_saved_diff"] < TOL, report


def test_stage3_direct_call_with_grad_after_a_kept_gather_is_not_silent(world2):
    for error, has_grad in world2.run(_direct_call_after_no_grad_forward):
        assert error is not None or all(has_grad), (error, has_grad)


def _overflow_flags(stage):
    """DeepSpeed's ``engine.optimizer.overflow`` (fp16) before a step, after a step whose
    loss is inf (skipped), and after a good one."""
    model = make_actor(False)
    optim, schedule = _optimizer_and_schedule(model, False, LR)
    engine, *_ = deepspeed.initialize(model=model, optimizer=optim, lr_scheduler=schedule,
                                      config=train_config(False, stage, 2, dtype="fp16"))
    flags = [getattr(engine.optimizer, "overflow", "missing")]
    x = torch.randint(3, VOCAB_IDS, (MICRO, 6))
    for scale in (float("inf"), 1.0):
        engine.backward(engine(x, labels=x).loss * scale)
        engine.step()
        flags.append(getattr(engine.optimizer, "overflow", "missing"))
    return flags


def test_step3_fp16_reads_the_overflow_flags(world2, tmp_path):
    """DeepSpeed-Chat's default dtype, close to the fp32 oracle: the actor at ZeRO-3 (fp32
    shards, fp16 autocast), the critic (ZeRO-2) and reward (ZeRO-0) engines with fp16 weights
    (fp32 masters for the critic), whose ``forward_value`` runs in fp16 as under DeepSpeed;
    get_overflow() answers (False, False) after each PPO step. Their fp16 values make both
    losses fp16, whose gradient at DeepSpeed's initial scale 2**16 is inf in fp16 (DeepSpeed
    skips those first steps too; the critic's fp16 backward still overflows at 2**15): the
    scale starts at 2**12 so that both PPO steps train."""
    case = _case(3, 2, True, False, False, True, False, False, dtype="fp16", scale_power=12)
    for report in world2.run(_run_step3, case):
        assert report["overflow"] == [(False, False)] * PPO_STEPS, report
        assert report["loss_diff"] < 5e-2 and report["actor_diff"] < 5e-2, report
        assert report["critic_diff"] < 5e-2 and report["ema_diff"] < 5e-2, report


@pytest.mark.parametrize("stage", [2, 3])
def test_optimizer_overflow_flag_follows_the_skipped_step(world2, stage):
    for flags in world2.run(_overflow_flags, stage):
        assert flags == [False, True, False], flags
