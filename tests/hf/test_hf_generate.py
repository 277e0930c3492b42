"""Generation with FSDP-wrapped Hugging Face models, as evaluation scripts do it: right after
loading a trained state dict (no forward has run yet), inside ``summon_full_params()`` and
without it; a decoder-only and an encoder-decoder model (whose ``generate()`` calls the
encoder, an inner unit, before the root)."""

import torch

from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
from shardkit.nn.wrap import auto_wrap, transformer_auto_wrap_policy
from shardkit.testing import world_fixture
from tests.hf.hf_common import VOCAB, build, transformers

world2 = world_fixture(2)


def _t5(seed: int = 0):
    torch.manual_seed(seed)
    cfg = transformers.T5Config(d_model=16, d_ff=32, num_layers=2, num_decoder_layers=2,
                                num_heads=2, d_kv=8, vocab_size=VOCAB, decoder_start_token_id=0,
                                pad_token_id=0, eos_token_id=1, dropout_rate=0.0)
    return transformers.T5ForConditionalGeneration(cfg).eval()


def _wrapped(plain, block_class):
    """A fresh copy of ``plain``'s architecture under FSDP, loaded from its state dict."""
    model = FSDP(auto_wrap(type(plain)(plain.config),
                           auto_wrap_policy=transformer_auto_wrap_policy({block_class})))
    model.load_state_dict(plain.state_dict())
    return model.eval()


def _generations():
    prompt = torch.tensor([[5, 6, 7, 8]])
    cases = {"gpt2": (build("gpt2", tied=True).eval(),
                      transformers.models.gpt2.modeling_gpt2.GPT2Block),
             "t5": (_t5(), transformers.models.t5.modeling_t5.T5Block)}
    out = {}
    for name, (plain, block) in cases.items():
        want = plain.generate(prompt, max_new_tokens=4, do_sample=False)
        model = _wrapped(plain, block)
        with model.summon_full_params():
            out[f"{name} summoned"] = torch.equal(
                model.generate(prompt, max_new_tokens=4, do_sample=False), want)
        out[f"{name} sharded"] = torch.equal(
            _wrapped(plain, block).generate(prompt, max_new_tokens=4, do_sample=False), want)
        out[f"{name} again"] = torch.equal(
            model.generate(prompt, max_new_tokens=4, do_sample=False), want)
    return out


def test_generate_matches_the_plain_model(world2):
    for r in world2.run(_generations):
        assert all(r.values()), sorted(k for k, v in r.items() if not v)
