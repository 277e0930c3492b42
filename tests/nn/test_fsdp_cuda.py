"""FSDP on CUDA (skipped without a GPU): NCCL world of 1, the Triton packing path, parity with
single-process training, CPU offload (pinned fp32 shards, CUDA compute) and bf16 compute."""


import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.fixture(scope="module")
def nccl_world_of_one():
    from shardkit import distributed as skdist

    skdist.init_single_process(backend="nccl")  # no environment variables to leak
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    skdist.destroy()


def _train(model, steps, device, **fsdp_kwargs):
    from shardkit.models import synthetic_batch
    from tests.nn.fsdp_common import TINY, make_optimizer

    optim = make_optimizer(model)
    losses = []
    for step in range(steps):
        idx, target = (t.to(device) for t in synthetic_batch(TINY, 8, step))
        loss = model.loss(idx, target)
        loss.backward()
        if hasattr(model, "clip_grad_norm_"):
            model.clip_grad_norm_(1.0)
        else:
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        optim.step()
        optim.zero_grad()
        losses.append(loss.item())
    return losses, optim


def test_cuda_parity_offload_and_bf16(nccl_world_of_one):
    from tests.nn.fsdp_common import build_gpt, max_diff, wrap_gpt

    cuda = torch.device("cuda")
    reference = build_gpt().to(cuda)
    ref_losses, _ = _train(reference, 5, cuda)
    ref_sd = reference.state_dict()

    model = wrap_gpt(build_gpt().to(cuda))
    losses, optim = _train(model, 5, cuda)
    assert max_diff(model.state_dict(), ref_sd) <= 1e-5
    full_osd = model.gather_full_optim_state_dict(optim)
    assert full_osd["state"]

    offload = wrap_gpt(build_gpt(), move_params_to_cpu=True)
    assert all(p.device.type == "cpu" and p.is_pinned() for p in offload.parameters())
    off_losses, _ = _train(offload, 5, cuda)
    assert max_diff({k: v.cuda() for k, v in offload.state_dict().items()}, ref_sd) <= 1e-5
    assert max(abs(a - b) for a, b in zip(off_losses, ref_losses)) <= 1e-5

    bf16 = wrap_gpt(build_gpt().to(cuda), compute_dtype=torch.bfloat16)
    bf16_losses, _ = _train(bf16, 5, cuda)
    assert max(abs(a - b) / b for a, b in zip(bf16_losses, ref_losses)) <= 0.02
