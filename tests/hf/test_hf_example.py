"""examples/hf_causal_lm.py fine-tunes a Llama built from its config under torchrun (2 CPU
ranks, FSDP + bf16 + activation checkpointing): the loss falls and the saved directory loads."""

import os
import re
import subprocess
import sys

import torch

from shardkit.testing import free_port
from tests.hf.hf_common import transformers

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_hf_causal_lm_example_trains_and_saves_pretrained(tmp_path):
    env = {k: v for k, v in os.environ.items()
           if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    out = tmp_path / "saved"
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2",
         "--master_port", str(free_port()), os.path.join(ROOT, "examples", "hf_causal_lm.py"),
         "--steps", "6", "--seq-len", "16", "--save-dir", str(out)],
        env=env, capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    losses = [float(x) for x in re.findall(r"step \d+, loss ([0-9.]+)", proc.stdout)]
    assert len(losses) == 6 and losses[-1] < losses[0], losses
    model = transformers.LlamaForCausalLM.from_pretrained(out)
    assert (out / "model.safetensors").exists()
    assert all(torch.isfinite(p).all() for p in model.parameters())
