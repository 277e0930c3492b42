"""Tiny Hugging Face models built from configs (never downloaded) for the HF tests."""

from __future__ import annotations

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402
# a hard import: transformers is in the `test` extra, and these checks must never skip silently
import transformers  # noqa: E402

# an odd vocabulary: the embedding (tied or not) splits unevenly across ranks
VOCAB, SEQ = 61, 8


def eager_model(cls, cfg, seed: int):
    """``cls(cfg)`` built under ``seed``, with eager attention and no key/value cache (what
    the parity checks compare against one process)."""
    torch.manual_seed(seed)
    cfg._attn_implementation = "eager"
    model = cls(cfg)
    if hasattr(model.config, "use_cache"):
        model.config.use_cache = False
    return model


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


def bert_pretraining(seed: int = 0):
    """A 2-layer BERT with both pre-training heads (masked LM tied to the word embeddings, and
    the pooler + next-sentence head), no dropout, eager attention."""
    torch.manual_seed(seed)
    cfg = transformers.BertConfig(vocab_size=VOCAB, hidden_size=16, num_hidden_layers=2,
                                  num_attention_heads=2, intermediate_size=32,
                                  max_position_embeddings=SEQ, type_vocab_size=2,
                                  hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0,
                                  pad_token_id=0)
    cfg._attn_implementation = "eager"
    return transformers.BertForPreTraining(cfg)


def mixtral(seed: int = 0):
    """A 2-layer Mixtral, top-2 of 4 experts (stored as 3-D tensors), router aux loss on."""
    torch.manual_seed(seed)
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=16,
                                     num_hidden_layers=2, num_attention_heads=2,
                                     num_key_value_heads=1, num_local_experts=4,
                                     num_experts_per_tok=2, max_position_embeddings=SEQ,
                                     output_router_logits=True, router_aux_loss_coef=0.1,
                                     router_jitter_noise=0.0, bos_token_id=0, eos_token_id=0,
                                     pad_token_id=None)
    cfg._attn_implementation = "eager"
    model = transformers.MixtralForCausalLM(cfg)
    model.config.use_cache = False
    return model


def qwen2_moe(seed: int = 0):
    """A 2-layer Qwen2-MoE: layer 0 dense (``mlp_only_layers``), layer 1 top-2 of 4 experts
    (3-D tensors) beside a shared expert with its sigmoid gate; router aux loss on."""
    torch.manual_seed(seed)
    cfg = transformers.Qwen2MoeConfig(vocab_size=VOCAB, hidden_size=16, intermediate_size=32,
                                      moe_intermediate_size=8,
                                      shared_expert_intermediate_size=16,
                                      num_hidden_layers=2, num_attention_heads=2,
                                      num_key_value_heads=1, num_experts=4,
                                      num_experts_per_tok=2, mlp_only_layers=[0],
                                      max_position_embeddings=SEQ, output_router_logits=True,
                                      router_aux_loss_coef=0.1, bos_token_id=0,
                                      eos_token_id=0, pad_token_id=None)
    cfg._attn_implementation = "eager"
    model = transformers.Qwen2MoeForCausalLM(cfg)
    model.config.use_cache = False
    return model


def switch_transformers(seed: int = 0):
    """A 2+2-layer Switch Transformer, every other layer a top-1 mixture of 8 experts, each
    expert its own module (an expert without tokens on a rank has no gradient there)."""
    torch.manual_seed(seed)
    cfg = transformers.SwitchTransformersConfig(
        vocab_size=VOCAB, d_model=16, d_kv=8, d_ff=32, expert_capacity=64, num_layers=2,
        num_decoder_layers=2, num_sparse_encoder_layers=1, num_sparse_decoder_layers=1,
        num_heads=2, num_experts=8, router_jitter_noise=0.0, dropout_rate=0.0,
        decoder_start_token_id=0, pad_token_id=0, eos_token_id=1)
    cfg._attn_implementation = "eager"
    model = transformers.SwitchTransformersForConditionalGeneration(cfg)
    model.config.use_cache = False
    return model


def vit(seed: int = 0):
    """A 2-layer ViT classifier on 8x8 RGB images (4x4 conv patches, a cls token)."""
    torch.manual_seed(seed)
    cfg = transformers.ViTConfig(image_size=8, patch_size=4, num_channels=3, hidden_size=16,
                                 num_hidden_layers=2, num_attention_heads=2,
                                 intermediate_size=32, num_labels=5, hidden_dropout_prob=0.0,
                                 attention_probs_dropout_prob=0.0)
    cfg._attn_implementation = "eager"
    return transformers.ViTForImageClassification(cfg)
