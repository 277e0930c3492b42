"""Hugging Face families with constructs the earlier families lack, under every shardkit
wrapper, against one-process training on both ranks of a world of 2 after every AdamW step
(fp32, each rank its slice of the same global batch, the oracle averaging the per-rank losses;
the harness is tests/test_torch_blocks.py's):

* CLIP: two towers (text and vision), a 0-dim ``logit_scale`` parameter, the contrastive loss
  over each rank's rows, text pooled at the eos token;
* Whisper: a conv1d front end on log-mel features, frozen sinusoidal encoder positions beside
  learned decoder positions, an encoder-decoder with ``proj_out`` tied to the decoder's token
  embedding; after training, greedy ``generate()`` through the wrapper gives the plain trained
  model's tokens and scores;
* Wav2Vec2 (CTC): a grouped conv positional embedding under ``parametrizations.weight_norm``
  (``original0`` of shape ``(1, 1, k)``), a conv feature encoder with group norm, CTC loss;
  the weight-normed positional embedding is a unit of its own under auto-wrap;
* Wav2Vec2 again in the large checkpoints' layout (layer-normed conv features,
  ``do_stable_layer_norm``) on padded audio with an attention mask;
* fine-tuning recipes: CLIP with its vision tower locked, Whisper with ``freeze_encoder()``,
  Wav2Vec2 with ``freeze_feature_encoder()``, and Whisper, Wav2Vec2 and CLIP under HF's
  ``gradient_checkpointing_enable()`` (non-reentrant);
* Mamba: a depthwise ``Conv1d`` (``groups`` = channels), ``A_log``/``D`` parameters and its own
  selective scan (the slow PyTorch path), embedding tied to the LM head; ``generate()`` (its
  conv and SSM state cache) after training.

Wrappers: OSS + torch DDP, ShardedDataParallel + OSS, FullyShardedDataParallel as one unit,
auto-wrapped on the family's block classes, and with every module that holds a parameter a unit
of its own (``default_auto_wrap_policy(min_num_params=1)``: the weight-norm parametrization,
CLIP's root with its 0-dim ``logit_scale``), ``shardkit.initialize`` at ZeRO stages 0-3. Losses
and every parameter are compared after each of 3 steps (2e-5); the full state dict has the
plain model's keys and loads strictly into a fresh HF model; CLIP and Wav2Vec2 in eval through
the wrapper give the plain trained model's outputs.
"""

import pytest
import torch

from shardkit.nn.wrap import no_split_module_classes
from shardkit.testing import world_fixture
from tests.hf.hf_common import eager_model, transformers as T
from tests.utils.wrapper_matrix import all_cases, check_case

VOCAB, SEQ, HIDDEN, ROWS = 61, 8, 16, 4
EOS, PAD = 2, 1
TOL = 2e-5
world2 = world_fixture(2)


# ----------------------------------------------------------------------------- models

def clip(seed=0):
    cfg = T.CLIPConfig(
        text_config=dict(vocab_size=VOCAB, hidden_size=HIDDEN, intermediate_size=32,
                         num_hidden_layers=2, num_attention_heads=2,
                         max_position_embeddings=SEQ, bos_token_id=0, eos_token_id=EOS,
                         pad_token_id=PAD),
        vision_config=dict(hidden_size=HIDDEN, intermediate_size=32, num_hidden_layers=2,
                           num_attention_heads=2, image_size=8, patch_size=4, num_channels=3),
        projection_dim=8)
    return eager_model(T.CLIPModel, cfg, seed)


def whisper(seed=0):
    cfg = T.WhisperConfig(
        vocab_size=VOCAB, num_mel_bins=8, encoder_layers=2, decoder_layers=2,
        encoder_attention_heads=2, decoder_attention_heads=2, encoder_ffn_dim=32,
        decoder_ffn_dim=32, d_model=HIDDEN, max_source_positions=8, max_target_positions=16,
        dropout=0.0, attention_dropout=0.0, activation_dropout=0.0, pad_token_id=PAD,
        bos_token_id=0, eos_token_id=EOS, decoder_start_token_id=0, suppress_tokens=None,
        begin_suppress_tokens=None)
    return eager_model(T.WhisperForConditionalGeneration, cfg, seed)


def wav2vec2(seed=0, **extra):
    cfg = T.Wav2Vec2Config(
        vocab_size=12, hidden_size=HIDDEN, num_hidden_layers=2, num_attention_heads=2,
        intermediate_size=32, conv_dim=(8, 8), conv_stride=(4, 2), conv_kernel=(8, 4),
        num_conv_pos_embeddings=4, num_conv_pos_embedding_groups=2, hidden_dropout=0.0,
        attention_dropout=0.0, activation_dropout=0.0, feat_proj_dropout=0.0,
        final_dropout=0.0, layerdrop=0.0, mask_time_prob=0.0, mask_feature_prob=0.0,
        ctc_loss_reduction="mean", pad_token_id=0, **extra)
    return eager_model(T.Wav2Vec2ForCTC, cfg, seed)


def mamba(seed=0):
    cfg = T.MambaConfig(vocab_size=VOCAB, hidden_size=HIDDEN, state_size=4,
                        num_hidden_layers=2, expand=2, conv_kernel=4, time_step_rank=4,
                        bos_token_id=0, eos_token_id=EOS, pad_token_id=PAD)
    return eager_model(T.MambaForCausalLM, cfg, seed)


def wav2vec2_stable(seed=0):
    """The large checkpoints' layout: layer-normed conv features, pre-LN layers
    (``do_stable_layer_norm``), padded audio with an attention mask."""
    model = wav2vec2(seed, do_stable_layer_norm=True, feat_extract_norm="layer",
                     conv_bias=True)
    return model


def _variant(build, change):
    def model(seed=0):
        out = build(seed)
        change(out)
        return out
    return model


def _gc(model):
    model.gradient_checkpointing_enable({"use_reentrant": False})


def _freeze_vision(model):
    model.vision_model.requires_grad_(False)  # LiT: a locked image tower


MODELS = {"clip": clip, "whisper": whisper, "wav2vec2": wav2vec2, "mamba": mamba,
          "wav2vec2_stable": wav2vec2_stable,
          # fine-tuning recipes: frozen parts beside trainable ones, checkpointed layers
          "clip_locked_vision": _variant(clip, _freeze_vision),
          "whisper_frozen_encoder": _variant(whisper, lambda m: m.freeze_encoder()),
          "wav2vec2_frozen_features": _variant(wav2vec2, lambda m: m.freeze_feature_encoder()),
          "whisper_gc": _variant(whisper, _gc), "wav2vec2_gc": _variant(wav2vec2, _gc),
          "clip_gc": _variant(clip, _gc)}


def _family(name):
    return name.split("_")[0]


def _blocks(name):
    if name.startswith("wav2vec2"):  # declares no _no_split_modules
        w2v = T.models.wav2vec2.modeling_wav2vec2
        return (w2v.Wav2Vec2EncoderLayer, w2v.Wav2Vec2EncoderLayerStableLayerNorm,
                w2v.Wav2Vec2PositionalConvEmbedding)
    return no_split_module_classes(MODELS[name]())


# ----------------------------------------------------------------------------- data

def _generator(name, step):
    return torch.Generator().manual_seed(list(MODELS).index(name) * 1000 + step)


def _clip_batch(step, n=ROWS):
    g = _generator("clip", step)
    ids = torch.randint(3, VOCAB, (n, SEQ), generator=g)
    mask = torch.ones(n, SEQ, dtype=torch.long)
    for row in range(n):
        length = SEQ - (row + step) % 3
        ids[row, length - 1] = EOS
        ids[row, length:], mask[row, length:] = PAD, 0
    return {"input_ids": ids, "attention_mask": mask,
            "pixel_values": torch.randn(n, 3, 8, 8, generator=g), "return_loss": True}


def _whisper_batch(step, n=ROWS):
    g = _generator("whisper", step)
    labels = torch.randint(3, VOCAB, (n, 6), generator=g)
    labels[0, 4 + step % 2:] = -100
    return {"input_features": torch.randn(n, 8, 16, generator=g), "labels": labels}


def _wav2vec2_batch(step, n=ROWS):
    g = _generator("wav2vec2", step)
    labels = torch.randint(1, 12, (n, 5), generator=g)
    labels[1, 3:] = -100
    return {"input_values": torch.randn(n, 160, generator=g), "labels": labels}


def _wav2vec2_padded_batch(step, n=ROWS):
    out = _wav2vec2_batch(step, n)
    mask = torch.ones(n, 160, dtype=torch.long)
    mask[(step + 1) % n, 120:] = 0
    out["input_values"] = out["input_values"] * mask
    out["attention_mask"] = mask
    return out


def _mamba_batch(step, n=ROWS):
    ids = torch.randint(3, VOCAB, (n, SEQ), generator=_generator("mamba", step))
    return {"input_ids": ids, "labels": ids}


BATCHES = {name: {"clip": _clip_batch, "whisper": _whisper_batch, "wav2vec2": _wav2vec2_batch,
                  "mamba": _mamba_batch}[_family(name)] for name in MODELS}
BATCHES["wav2vec2_stable"] = _wav2vec2_padded_batch


def _loss_of(output):
    return output.loss


# ----------------------------------------------------------------------------- after training

def _model_of(net):
    """What a user calls ``generate`` on: the engine and the FSDP/ShardedDDP wrappers hand
    attributes through to the model; torch DDP needs ``.module``."""
    return net.module if isinstance(net, torch.nn.parallel.DistributedDataParallel) else net


def _generated(name):
    def after(net, plain):
        """Greedy generation through the trained wrapper against the plain trained model:
        (tokens equal, largest score difference)."""
        net.eval()
        plain.eval()
        if name == "whisper":
            inputs = {"input_features": _whisper_batch(10)["input_features"][:1]}
        else:
            inputs = {"input_ids": _mamba_batch(10)["input_ids"][:1, :4]}
        kwargs = dict(max_new_tokens=4, do_sample=False, output_scores=True,
                      return_dict_in_generate=True, use_cache=True)
        got = _model_of(net).generate(**inputs, **kwargs)
        want = plain.generate(**inputs, **kwargs)
        scores = max(float((a - b).abs().max()) for a, b in zip(got.scores, want.scores))
        return torch.equal(got.sequences, want.sequences), scores
    return after


def _evaluated(name, key):
    def after(net, plain):
        """An eval forward through the trained wrapper against the plain trained model: the
        largest difference of ``key``."""
        net.eval()
        plain.eval()
        inputs = {k: v for k, v in BATCHES[name](10).items() if k not in ("labels",
                                                                          "return_loss")}
        with torch.no_grad():
            got, want = net(**inputs)[key], plain(**inputs)[key]
        return True, float((got - want).abs().max())
    return after


AFTER = {name: {"clip": _evaluated(name, "logits_per_image"), "whisper": _generated("whisper"),
                "wav2vec2": _evaluated(name, "logits"),
                "mamba": _generated("mamba")}[_family(name)] for name in MODELS}
WRAPPERS = ["oss_ddp", "sharded_ddp", "fsdp", "fsdp_blocks", "fsdp_size", "stage0", "stage1",
            "stage2", "stage3"]


def _all():
    blocks = {name: _blocks(name) for name in MODELS}
    return all_cases(MODELS, BATCHES, _loss_of, blocks, WRAPPERS, AFTER)


@pytest.fixture(scope="module")
def results(world2):
    return world2.run(_all)


# real shardkit bugs found by this module: (model, wrapper) -> reason (xfail strict). Empty
# since parents' reads of a unit's weight gather it (CLIP's position_embedding.weight.shape,
# Mamba's conv1d.weight handed to causal_conv1d_fn under a size policy used to read the shard)
KNOWN: dict = {}


def _marked(case):
    reason = KNOWN.get(case)
    marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
    return pytest.param(case, id="-".join(case), marks=marks)


CASES = [(m, w) for m in MODELS for w in WRAPPERS]


@pytest.mark.parametrize("case", [_marked(c) for c in CASES])
def test_family_trains_like_one_process_on_every_rank(results, case):
    check_case(results, case, TOL)


@pytest.mark.parametrize("case", [_marked(c) for c in CASES])
def test_trained_wrapper_evaluates_and_generates_like_the_plain_model(results, case):
    for rank, per_rank in enumerate(results):
        result = per_rank[case]
        assert not isinstance(result, str), (rank, result)
        same_tokens, difference = result[3]
        assert same_tokens, (rank, case)
        assert difference <= TOL, (rank, difference)
