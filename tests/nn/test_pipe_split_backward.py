"""Backward split into B (input gradient) and W (parameter gradients) for any module."""

import pytest
import torch
import torch.nn as nn

from shardkit.models import GPT, MLP, Block, GPTConfig
from shardkit.nn.pipe.split_backward import GradientSink, backward_input


class _TiedTwice(nn.Module):
    """One Linear used at two depths plus a second branch: a group with two frontier nodes."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.a(torch.tanh(self.a(x) + self.b(x)))


class _Sandwich(nn.Module):
    """One Linear on both sides of another: W for ``a`` walks through ``b``'s frontier node."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(8, 8), nn.Linear(8, 8)

    def forward(self, x):
        return self.a(torch.tanh(self.b(torch.tanh(self.a(x)))))


def _frozen_mlp():
    model = MLP(16, 3, out=4)
    model[0].weight.requires_grad_(False)
    return model


CASES = {
    "block": (lambda: Block(GPTConfig()), lambda: torch.randn(2, 8, 64), True),
    "mlp": (lambda: MLP(16, 3, out=4), lambda: torch.randn(5, 16), True),
    "mlp, input without grad": (lambda: MLP(16, 3, out=4), lambda: torch.randn(5, 16), False),
    "tied weight": (_TiedTwice, lambda: torch.randn(3, 8), True),
    "tied around another layer": (_Sandwich, lambda: torch.randn(3, 8), True),
    "frozen weight": (_frozen_mlp, lambda: torch.randn(5, 16), True),
}


@pytest.mark.parametrize("name", list(CASES))
def test_b_then_w_equals_one_backward(name):
    make, data, input_grad = CASES[name]
    torch.manual_seed(0)
    module, x = make(), data()
    x_ref = x.clone().requires_grad_(input_grad)
    out = module(x_ref)
    g = torch.randn_like(out)
    out.backward(g)
    ref = {p: p.grad.clone() for p in module.parameters() if p.requires_grad}
    module.zero_grad(set_to_none=True)
    x_split = x.clone().requires_grad_(input_grad)
    dx, weight_pass = backward_input([module(x_split)], [g], [x_split], list(module.parameters()))
    assert all(p.grad is None for p in module.parameters())  # B touches no parameter
    if input_grad:
        torch.testing.assert_close(dx[0], x_ref.grad, rtol=0, atol=0)
    else:
        assert dx == [None]
    grads = weight_pass.run()
    assert set(grads) == set(ref)  # frozen parameters get nothing, tied ones one entry
    for p in ref:
        torch.testing.assert_close(grads[p], ref[p], rtol=1e-6, atol=1e-7)
    with pytest.raises(RuntimeError, match="already ran"):
        weight_pass.run()
    # straight into .grad, as the schedules do when no parameter has a gradient hook
    module.zero_grad(set_to_none=True)
    _, weight_pass = backward_input([module(x_split)], [g], [x_split], list(module.parameters()))
    assert weight_pass.run(into_grad=True) == {}
    for p in ref:
        torch.testing.assert_close(p.grad, ref[p], rtol=1e-6, atol=1e-7)


def test_gpt_with_tied_embedding_and_a_loss_root():
    torch.manual_seed(0)
    model = GPT(GPTConfig(tie_weights=True))
    idx = torch.randint(0, 256, (2, 8))
    model(idx).square().mean().backward()
    ref = {p: p.grad.clone() for p in model.parameters()}
    model.zero_grad(set_to_none=True)
    dx, weight_pass = backward_input([model(idx).square().mean()], None, [idx],
                                     list(model.parameters()))
    grads = weight_pass.run()
    assert dx == [None] and set(grads) == set(ref)
    for p in ref:
        torch.testing.assert_close(grads[p], ref[p], rtol=1e-5, atol=1e-7)


def test_gradient_hooks_fire_once_per_step_with_the_step_total():
    torch.manual_seed(0)
    module = MLP(8, 2)
    seen = []
    module[0].weight.register_post_accumulate_grad_hook(lambda p: seen.append(p.grad.clone()))
    xs = [torch.randn(3, 8) for _ in range(3)]
    total = sum(torch.autograd.grad(module(x).sum(), module[0].weight)[0] for x in xs)
    sink = GradientSink(module.parameters())
    assert sink.deferred
    for x in xs:
        x = x.requires_grad_(True)
        _, weight_pass = backward_input([module(x).sum()], None, [x], list(module.parameters()))
        sink.run(weight_pass)
    assert seen == [] and module[0].weight.grad is None
    sink.deliver()
    assert len(seen) == 1
    torch.testing.assert_close(seen[0], total)


@pytest.mark.parametrize("merge", [1, 2, 3])
def test_merged_products_and_embeddings_equal_per_microbatch_backward(merge):
    """A GPT stage (embedding, blocks, head) from a first stage without input gradient: the sink
    merges Linear and embedding weight gradients over micro-batches, same totals."""
    torch.manual_seed(0)
    model = GPT(GPTConfig())
    batches = [torch.randint(0, 256, (2, 8)) for _ in range(3)]
    for idx in batches:
        model(idx).square().mean().backward()
    ref = {p: p.grad.clone() for p in model.parameters()}
    model.zero_grad(set_to_none=True)
    sink = GradientSink(model.parameters(), merge)
    for idx in batches:
        _, weight_pass = backward_input([model(idx).square().mean()], None, [idx],
                                        list(model.parameters()))
        assert len(weight_pass._products) > 0  # the Linears and the embeddings merge
        sink.run(weight_pass)
    sink.deliver()
    for p in ref:
        torch.testing.assert_close(p.grad, ref[p], rtol=1e-5, atol=1e-6)


def test_sink_adds_a_product_once_its_waiting_rows_are_enough():
    """Small micro-batches wait to be merged (up to ``merge``); once a weight's waiting rows reach
    ``enough_rows`` its product is added at that W, where the schedule placed it."""
    torch.manual_seed(0)
    layer = nn.Linear(8, 8)
    xs = [torch.randn(rows, 8) for rows in (3, 3, 6, 2)]
    ref = sum(torch.autograd.grad(layer(x).sum(), layer.weight)[0] for x in xs)
    sink = GradientSink(layer.parameters(), merge=10, enough_rows=6)
    waiting = []
    for x in xs:
        x = x.requires_grad_(True)
        _, weight_pass = backward_input([layer(x).sum()], None, [x], list(layer.parameters()))
        sink.run(weight_pass)
        waiting.append(len(sink._products))
    assert waiting == [1, 0, 0, 1]  # 3 rows wait, 3 + 3 are enough, 6 alone are, 2 wait
    sink.deliver()
    torch.testing.assert_close(layer.weight.grad, ref)
    for bad in (0, True, 2.5):
        with pytest.raises(ValueError, match="GradientSink\\(enough_rows="):
            GradientSink(layer.parameters(), enough_rows=bad)
