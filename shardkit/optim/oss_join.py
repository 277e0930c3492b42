"""OSS under ``torch.distributed.algorithms.join.Join``: uneven numbers of steps per rank.

A rank that ran out of batches leaves the ``Join`` block and, while the others go on, shadows
each of their steps: :class:`OSSJoinHook` runs ``OSS.step()`` there, whose control agreement and
parameter all-gathers pair with theirs, as torch's ``ZeroRedundancyOptimizer`` does. Policy
(which joinables, their order, ``throw_on_early_termination``) stays with the caller."""

from torch.distributed.algorithms.join import JoinHook


class OSSJoinHook(JoinHook):
    """The join hook of an :class:`~shardkit.optim.OSS`: each shadowed iteration steps the
    joined rank's share with the gradients it holds (as ``ZeroRedundancyOptimizer``'s: none
    after ``zero_grad()``, so its share then keeps its values) and joins the parameter
    sync, so every rank ends with the same parameters. Memory: none beyond a step's.
    Communication: one step's (the agreement and ``Ψ(N-1)/N`` elements of all-gathers) per
    shadowed iteration; after the last one, waits for the syncs still in flight."""

    def __init__(self, optimizer):
        super().__init__()
        self.optimizer = optimizer

    def main_hook(self) -> None:
        self.optimizer.step()

    def post_hook(self, is_last_joiner: bool) -> None:
        self.optimizer.wait_for_sync()
