"""Fine-tune a Hugging Face causal LM with shardkit FSDP, bf16 mixed precision and activation
checkpointing, on CPU (gloo) or GPUs (nccl).

    torchrun --nproc_per_node 2 examples/hf_causal_lm.py --model llama --steps 20

The model is built from a small config (``--model gpt2`` or ``llama``; nothing is downloaded);
point ``--config`` at a ``config.json`` directory to use your own. Its transformer blocks come
from the model's ``_no_split_modules``: each one becomes an FSDP unit and a checkpointed region.
Parameters are all-gathered and computed in bf16 while the sharded fp32 master weights step;
gradients are reduce-scattered in fp32. The data is a synthetic next-token task (sequences that
count up modulo the vocabulary), so the loss visibly falls. ``--save-dir`` writes the trained
model with ``save_pretrained`` (rank 0, from FSDP's full state dict).
"""

import argparse
import os
import sys

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
import transformers  # noqa: E402

import shardkit  # noqa: E402
from shardkit import distributed, recipes  # noqa: E402
from shardkit.nn.checkpoint import apply_activation_checkpointing  # noqa: E402
from shardkit.nn.data_parallel.mixed_precision import MixedPrecisionPolicy  # noqa: E402
from shardkit.nn.wrap import no_split_modules_policy  # noqa: E402


def small_config(kind: str, vocab: int, seq_len: int):
    if kind == "gpt2":
        return transformers.GPT2Config(vocab_size=vocab, n_positions=seq_len, n_embd=64,
                                       n_layer=2, n_head=4, bos_token_id=0, eos_token_id=0)
    return transformers.LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128,
                                    num_hidden_layers=2, num_attention_heads=4,
                                    num_key_value_heads=2, max_position_embeddings=seq_len,
                                    bos_token_id=0, eos_token_id=0, pad_token_id=None)


def batch(step: int, rank: int, size: int, seq_len: int, vocab: int) -> torch.Tensor:
    """This rank's sequences of step ``step``: each counts up from a random start by 1..3."""
    g = torch.Generator().manual_seed(10_000 * step + rank)
    start = torch.randint(0, vocab, (size, 1), generator=g)
    stride = torch.randint(1, 4, (size, 1), generator=g)
    return (start + stride * torch.arange(seq_len)) % vocab


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=["gpt2", "llama"], default="llama",
                        help="small config to build the model from (default llama)")
    parser.add_argument("--config", default=None, help="a config.json directory instead of --model")
    parser.add_argument("--steps", type=int, default=20, help="optimizer steps (default 20)")
    parser.add_argument("--batch-size", type=int, default=8, help="sequences per rank (default 8)")
    parser.add_argument("--seq-len", type=int, default=32, help="tokens per sequence (default 32)")
    parser.add_argument("--lr", type=float, default=3e-3, help="learning rate (default 3e-3)")
    parser.add_argument("--save-dir", default=None,
                        help="write the trained model here with save_pretrained (rank 0)")
    args = parser.parse_args()

    shardkit.init_distributed()  # torchrun's group; under plain `python`, one rank in memory
    rank = distributed.get_rank()
    torch.manual_seed(0)  # same initial weights on every rank
    config = transformers.AutoConfig.from_pretrained(args.config, local_files_only=True) \
        if args.config else small_config(args.model, 128, args.seq_len)
    config.use_cache = False
    model = transformers.AutoModelForCausalLM.from_config(config)

    policy = no_split_modules_policy(model)  # e.g. {LlamaDecoderLayer}
    bf16 = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    # stage 3: an FSDP unit per block and at the root, AdamW over FSDP's shards
    composition = recipes.compose(model, 3, recipes.adamw(args.lr), wrap_policy=policy,
                                  mixed_precision=bf16)
    model, optimizer = composition.wrapped, composition.optimizer
    apply_activation_checkpointing(model, policy)  # after wrapping: each block's FSDP unit

    for step in range(args.steps):
        ids = batch(step, rank, args.batch_size, args.seq_len, config.vocab_size)
        loss = model(input_ids=ids, labels=ids).loss
        loss.backward()
        model.clip_grad_norm_(1.0)
        optimizer.step()
        optimizer.zero_grad()
        if rank == 0:
            print(f"step {step}, loss {loss.item():.4f}", flush=True)

    state = model.state_dict()  # collective: full fp32 weights on every rank
    if args.save_dir and rank == 0:
        fresh = transformers.AutoModelForCausalLM.from_config(config)
        fresh.load_state_dict(state, strict=True)
        fresh.save_pretrained(args.save_dir)
        print(f"saved {type(fresh).__name__} to {args.save_dir}", flush=True)
    distributed.barrier()
    return 0


if __name__ == "__main__":
    sys.exit(main())
