"""Tiny Hugging Face models built from configs (never downloaded) for the HF tests."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
# a hard import: transformers is in the `test` extra, and these checks must never skip silently
import transformers  # noqa: E402

# an odd vocabulary: the embedding (tied or not) splits unevenly across ranks
VOCAB, SEQ = 61, 8


def gpt2_config(tied: bool = True):
    return transformers.GPT2Config(vocab_size=VOCAB, n_positions=SEQ, n_embd=16, n_layer=2,
                                   n_head=2, resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0,
                                   tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0)


def llama_config(tied: bool = False):
    return transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                    num_hidden_layers=2, num_attention_heads=2,
                                    num_key_value_heads=1, max_position_embeddings=SEQ,
                                    tie_word_embeddings=tied, bos_token_id=0, eos_token_id=0,
                                    pad_token_id=None)


def build(kind: str, tied: bool, seed: int = 0):
    """A fresh model of ``kind`` ("gpt2" or "llama"), fp32, eager attention, same weights for
    the same seed on every rank."""
    torch.manual_seed(seed)
    if kind == "gpt2":
        cfg, cls = gpt2_config(tied), transformers.GPT2LMHeadModel
    else:
        cfg, cls = llama_config(tied), transformers.LlamaForCausalLM
    cfg._attn_implementation = "eager"
    model = cls(cfg)
    model.config.use_cache = False
    return model


def tiny_t5(seed: int = 0):
    """A 2+2-layer T5 (shared embeddings, no dropout) with seeded random weights."""
    torch.manual_seed(seed)
    cfg = transformers.T5Config(d_model=16, d_ff=32, num_layers=2, num_decoder_layers=2,
                                num_heads=2, d_kv=8, vocab_size=VOCAB, decoder_start_token_id=0,
                                pad_token_id=0, eos_token_id=1, dropout_rate=0.0)
    return transformers.T5ForConditionalGeneration(cfg)


def batch(step: int, n: int = 4):
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, VOCAB, (n, SEQ), generator=g)
