"""model_state_bytes counts what a rank holds, once per storage."""

import torch
import torch.nn as nn

from shardkit.models import GPT, GPTConfig, MLP
from shardkit.utils.memory import model_state_bytes, tensor_storage_bytes


def _numel(module):
    return sum(p.numel() for p in module.parameters())


def test_params_grads_and_adam_state():
    model = MLP(width=16, depth=3)
    n = _numel(model)
    assert model_state_bytes(model).as_dict() == {"params": 4 * n, "grads": 0, "optimizer": 0,
                                                  "transport": 0, "total": 4 * n}
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model(torch.randn(4, 16)).sum().backward()
    opt.step()
    got = model_state_bytes(model, opt)
    steps = sum(1 for _ in model.parameters())  # AdamW keeps one scalar step tensor per param
    assert got.params == 4 * n and got.grads == 4 * n
    assert got.optimizer == 8 * n + 4 * steps
    assert got.total == got.params + got.grads + got.optimizer
    assert got["grads"] == got.grads


def test_tied_weights_counted_once():
    cfg = GPTConfig(vocab_size=64, n_layer=1, d_model=16, n_head=2, seq_len=8, tie_weights=True)
    tied = GPT(cfg)
    untied = GPT(GPTConfig(**{**cfg.__dict__, "tie_weights": False}))
    head = untied.head.weight.numel()
    assert model_state_bytes(tied).params == model_state_bytes(untied).params - 4 * head


def test_views_of_one_flat_buffer_counted_once():
    flat = torch.zeros(100)
    views = [flat[:30], flat[30:], flat.view(10, 10)]
    assert tensor_storage_bytes(views) == 400

    class Flat(nn.Module):
        def __init__(self):
            super().__init__()
            self.buf = torch.zeros(50)
            self.a = nn.Parameter(self.buf[:20])
            self.b = nn.Parameter(self.buf[20:])

        def model_state_tensors(self):
            yield "params", self.buf

    assert model_state_bytes(Flat()).params == 200


def test_freed_storage_counts_zero_and_optimizer_only_params_count():
    p = nn.Parameter(torch.zeros(10))
    p.data.untyped_storage().resize_(0)
    assert model_state_bytes(optimizer=torch.optim.SGD([p], lr=0.1)).params == 0
    q = nn.Parameter(torch.zeros(10))
    q.grad = torch.ones(10)
    got = model_state_bytes(optimizer=torch.optim.SGD([q], lr=0.1))
    assert (got.params, got.grads, got.optimizer) == (40, 40, 0)
