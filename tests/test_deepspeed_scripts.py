"""DeepSpeedExamples' training scripts, re-expressed in small: the call patterns of
training/cifar (cifar10_deepspeed.py), training/gan (gan_deepspeed_train.py),
training/HelloDeepSpeed (train_bert_ds.py) and training/bf16_master_weight (train.py) run
through ``import shardkit as deepspeed`` and must train as one process on the global batch.

All bodies run in one world of 2 gloo ranks.
"""

import argparse
import json
import os
import pathlib

import pytest
import torch
import torch.nn as nn
import torch.nn.functional as F

import shardkit as deepspeed
from shardkit import distributed
from shardkit.config import ConfigError
from shardkit.deepspeed_compat import comm, get_accelerator
from shardkit.testing import world_fixture

TOL = 2e-6

world2 = world_fixture(2)


def _net(seed=0):
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(6, 12), nn.Tanh(), nn.Linear(12, 12), nn.Tanh(),
                         nn.Linear(12, 4))


def _params_diff(engine, oracle) -> float:
    full = engine.module_state_dict()
    return max(float((full[k].float() - v).abs().max()) for k, v in oracle.state_dict().items())


def _gathered(tensor):
    """Every rank's ``tensor`` concatenated in rank order (the global batch)."""
    parts = [torch.empty_like(tensor) for _ in range(distributed.get_world_size())]
    distributed.all_gather(parts, tensor.contiguous())
    return torch.cat(parts)


# --------------------------------------------------------------- cifar10_deepspeed.py pattern


def _cifar_pattern(stage):
    """add_config_arguments + initialize(args=, model_parameters=filter(...), training_data=,
    config=dict) with Adam, WarmupLR and gradient clipping; the loop reads the engine's
    loader and its accessors. Returns (max difference to the oracle, facts)."""
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    parser.add_argument("--local_rank", type=int, default=-1)
    args = parser.parse_args([])
    g = torch.Generator().manual_seed(1)
    dataset = torch.utils.data.TensorDataset(torch.randn(48, 6, generator=g),
                                             torch.randint(0, 4, (48,), generator=g))
    config = {"train_batch_size": 8, "steps_per_print": 2000,
              "optimizer": {"type": "Adam", "params": {"lr": 1e-2, "betas": [0.8, 0.999],
                                                       "eps": 1e-6, "weight_decay": 3e-7}},
              "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0,
                                                           "warmup_max_lr": 1e-2,
                                                           "warmup_num_steps": 4}},
              "gradient_clipping": 1.0, "prescale_gradients": False,
              "bf16": {"enabled": False},
              "fp16": {"enabled": False, "fp16_master_weights_and_grads": False,
                       "loss_scale": 0, "loss_scale_window": 500, "hysteresis": 2,
                       "min_loss_scale": 1, "initial_scale_power": 15},
              "wall_clock_breakdown": False,
              "zero_optimization": {"stage": stage, "allgather_partitions": True,
                                    "reduce_scatter": True, "allgather_bucket_size": 50000000,
                                    "reduce_bucket_size": 50000000, "overlap_comm": True,
                                    "contiguous_gradients": True, "cpu_offload": False}}
    net, oracle = _net(), _net()
    parameters = filter(lambda p: p.requires_grad, net.parameters())
    engine, _, loader, _ = deepspeed.initialize(args=args, model=net,
                                                model_parameters=parameters,
                                                training_data=dataset, config=config)
    # DeepSpeed's "Adam" is AdamW (adam_w_mode defaults to true)
    ref_opt = torch.optim.AdamW(oracle.parameters(), lr=1e-2, betas=(0.8, 0.999),
                                eps=1e-6, weight_decay=3e-7)
    from shardkit.optim.lr_scheduler import WarmupLR
    ref_sched = WarmupLR(ref_opt, warmup_min_lr=0, warmup_max_lr=1e-2, warmup_num_steps=4)
    device = get_accelerator().device_name(engine.local_rank)
    sizes, worst = [], 0.0
    for inputs, labels in loader:
        inputs, labels = inputs.to(device), labels.to(device)
        sizes.append(len(inputs))
        loss = F.cross_entropy(engine(inputs), labels)
        engine.backward(loss)
        engine.step()
        ref_opt.zero_grad()
        F.cross_entropy(oracle(_gathered(inputs)), _gathered(labels)).backward()
        torch.nn.utils.clip_grad_norm_(oracle.parameters(), 1.0)
        ref_opt.step()
        ref_sched.step()
        worst = max(worst, _params_diff(engine, oracle))
    facts = (sizes, engine.fp16_enabled(), engine.bfloat16_enabled(), engine.local_rank,
             engine.global_steps, device)
    return worst, facts


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
def test_cifar_script_pattern_trains_as_one_process(world2, stage):
    for worst, facts in world2.run(_cifar_pattern, stage):
        assert worst < TOL
        assert facts == ([4] * 6, False, False, facts[3], 6, "cpu")


# --------------------------------------------------------------- gan_deepspeed_train.py pattern


def _gan_pattern(stage, raw_forward):
    """The GAN loop: a client torch optimizer, the script calls the *model* (not the engine)
    and runs engine.backward twice before one engine.step (real and fake halves)."""
    rank = distributed.get_rank()
    net, oracle = _net(), _net()
    opt = torch.optim.Adam(net.parameters(), lr=1e-2, betas=(0.5, 0.999))
    ref_opt = torch.optim.Adam(oracle.parameters(), lr=1e-2, betas=(0.5, 0.999))
    config = {"train_batch_size": 8, "steps_per_print": 10, "zero_optimization": {"stage": stage}}
    engine, opt, _, _ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                             optimizer=opt, config=config)
    forward = net if raw_forward else engine
    worst = 0.0
    for step in range(4):
        g = torch.Generator().manual_seed(10 + step)
        real, fake = torch.randn(8, 6, generator=g), torch.randn(8, 6, generator=g)
        mine = slice(rank * 4, rank * 4 + 4)
        net.zero_grad()
        engine.backward(F.softplus(-forward(real[mine])).mean())
        engine.backward(F.softplus(forward(fake[mine])).mean())
        engine.step()
        ref_opt.zero_grad()
        (F.softplus(-oracle(real)).mean() + F.softplus(oracle(fake)).mean()).backward()
        ref_opt.step()
        worst = max(worst, _params_diff(engine, oracle))
    return worst


@pytest.mark.parametrize("stage", [0, 1, 2, 3])
@pytest.mark.parametrize("raw_forward", [False, True], ids=["engine_forward", "model_forward"])
def test_gan_script_pattern_trains_as_one_process(world2, stage, raw_forward):
    # stages 0-1 calling the model bypassed DDP (gradients never averaged); stage 1 with two
    # backwards a step halved the first one's gradients (reduce-to-owners zeroes the others)
    assert max(world2.run(_gan_pattern, stage, raw_forward)) < TOL


def _gan_shipped_config(tmp):
    net = _net()
    path = os.path.join(tmp, "gan_deepspeed_config.json")
    if distributed.get_rank() == 0:
        with open(path, "w") as f:
            json.dump({"train_batch_size": 8, "steps_per_print": 10,
                       "optimizer": {"type": "Adam", "params": {"lr": 2e-4,
                                                                "betas": [0.5, 0.999]}}}, f)
    distributed.barrier()
    parser = deepspeed.add_config_arguments(argparse.ArgumentParser())
    args = parser.parse_args(["--deepspeed_config", path])
    try:
        deepspeed.initialize(args=args, model=net, model_parameters=net.parameters(),
                             optimizer=torch.optim.Adam(net.parameters(), lr=2e-4))
    except ConfigError as error:
        return str(error)
    return None


def test_gan_shipped_config_refusal_says_what_deepspeed_does(world2, tmp_path):
    for message in world2.run(_gan_shipped_config, str(tmp_path)):
        assert "optimizer=<Adam>" in message and "type Adam" in message
        assert "delete the config's 'optimizer' section" in message


# ------------------------------------------------------- bf16_master_weight/train.py pattern


def _torch_backward(dtype, torch_style, config_file):
    """initialize(config=<path>) with a disabled torch_autocast section; the loop calls
    loss.backward() (PyTorch style) instead of engine.backward, then engine.step, and
    engine.destroy() at the end."""
    rank = distributed.get_rank()
    if rank == 0:
        with open(config_file, "w") as f:
            json.dump({"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 1,
                       "steps_per_print": 100,
                       "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
                       dtype: {"enabled": True},
                       "zero_optimization": {"stage": 0, "reduce_bucket_size": 5e7},
                       "torch_autocast": {"enabled": False}}, f)
    distributed.barrier()
    net = _net()
    engine, *_ = deepspeed.initialize(model=net, model_parameters=net.parameters(),
                                      config=config_file)
    engine.train()
    for step in range(3):
        g = torch.Generator().manual_seed(step)
        x, y = torch.randn(8, 6, generator=g), torch.randn(8, 4, generator=g)
        loss = F.mse_loss(engine(x[rank * 4:rank * 4 + 4]).float(), y[rank * 4:rank * 4 + 4])
        loss.backward() if torch_style else engine.backward(loss)
        engine.step()
    engine.destroy()
    return {k: v.float() for k, v in engine.module_state_dict().items()}


@pytest.mark.parametrize("dtype", ["fp16", "bf16"])
def test_pytorch_style_backward_matches_engine_backward(world2, tmp_path, dtype):
    # fp16: loss.backward() applies no loss scale, so the step must not divide by it
    a = world2.run(_torch_backward, dtype, True, str(tmp_path / "a.json"))
    b = world2.run(_torch_backward, dtype, False, str(tmp_path / "b.json"))
    for ra, rb in zip(a, b):
        assert max(float((ra[k] - rb[k]).abs().max()) for k in ra) < 1e-3


def _autocast_on():
    try:
        deepspeed.initialize(model=_net(), config={
            "train_batch_size": 8, "optimizer": {"type": "SGD", "params": {"lr": 0.1}},
            "torch_autocast": {"enabled": True, "dtype": "torch.bfloat16"}})
    except ConfigError as error:
        return str(error)
    return None


def test_torch_autocast_enabled_is_refused_naming_bf16(world2):
    for message in world2.run(_autocast_on):
        assert "torch_autocast.enabled" in message and '"bf16": {"enabled": true}' in message


# ------------------------------------------------------------ train_bert_ds.py (HelloDeepSpeed)


class _MLM(nn.Module):
    """A model whose forward takes the batch as keywords and returns the loss."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(20, 8)
        self.head = nn.Linear(8, 20)

    def forward(self, src_tokens, attention_mask, tgt_tokens):
        hidden = self.embed(src_tokens) * attention_mask.unsqueeze(-1)
        return F.cross_entropy(self.head(hidden).reshape(-1, 20), tgt_tokens.reshape(-1))


def _bert_pattern(exp_dir, dtype):
    rank = distributed.get_rank()
    ds_config = {"train_micro_batch_size_per_gpu": 4,
                 "optimizer": {"type": "Adam", "params": {"lr": 1e-2}},
                 dtype: {"enabled": True},
                 "zero_optimization": {"stage": 1, "offload_optimizer": {"device": "cpu"}}}

    def batches(start):
        for step in range(start, 7):
            g = torch.Generator().manual_seed(100 * step + rank)
            src = torch.randint(0, 20, (4, 5), generator=g)
            yield step, {"src_tokens": src, "attention_mask": torch.ones(4, 5),
                         "tgt_tokens": torch.randint(0, 20, (4, 5), generator=g)}

    model = _MLM()
    model, _, _, _ = deepspeed.initialize(model=model, model_parameters=model.parameters(),
                                          config=ds_config)
    model.train()
    for step, batch in batches(1):
        model.backward(model(**batch))
        model.step()
        if step == 3:
            model.save_checkpoint(save_dir=exp_dir, client_state={"checkpoint_step": step})
    straight = {k: v.float().clone() for k, v in model.module_state_dict().items()}
    resumed = _MLM()
    resumed, _, _, _ = deepspeed.initialize(model=resumed, config=ds_config,
                                            model_parameters=resumed.parameters())
    _, client_state = resumed.load_checkpoint(load_dir=pathlib.Path(exp_dir))
    for step, batch in batches(client_state["checkpoint_step"] + 1):
        resumed.backward(resumed(**batch))
        resumed.step()
    again = resumed.module_state_dict()
    return client_state, max(float((again[k].float() - v).abs().max())
                             for k, v in straight.items())


@pytest.mark.parametrize("dtype", ["bf16", "fp16"])
def test_hello_deepspeed_pattern_resumes_from_its_checkpoint(world2, tmp_path, dtype):
    for client_state, diff in world2.run(_bert_pattern, str(tmp_path / dtype), dtype):
        assert client_state["checkpoint_step"] == 3
        assert diff == 0.0


# ------------------------------------------------------------------ accelerator and comm


def _accelerator_and_comm():
    accelerator = get_accelerator()
    accelerator.set_device(int(os.environ.get("LOCAL_RANK", "0")))
    t = torch.tensor([float(comm.get_rank() + 1)])
    comm.all_reduce(t)
    comm.barrier()
    return (accelerator.device_name(comm.get_rank()), accelerator.is_available(),
            accelerator.communication_backend_name(), comm.get_world_size(), float(t))


def test_accelerator_and_comm_as_scripts_use_them(world2):
    assert world2.run(_accelerator_and_comm) == [("cpu", True, "gloo", 2, 3.0)] * 2


def test_deepspeeds_names_at_the_top_level():
    # `import shardkit as deepspeed`: deepspeed.comm, deepspeed.get_accelerator(); and the
    # path a script's `from deepspeed.accelerator import get_accelerator` becomes
    import shardkit
    from shardkit.accelerator import get_accelerator as from_module
    assert shardkit.comm is comm and shardkit.get_accelerator is from_module
    assert from_module() is get_accelerator() and from_module().device_name() in ("cpu", "cuda")
