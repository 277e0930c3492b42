"""FSDP over data-parallel sub-groups: NO_SHARD's group of one rank, and explicit hybrid pairs.

Several data-parallel groups side by side (one per pipeline stage) build their FSDP units
independently. NO_SHARD created its one-rank group as every rank's group on every rank, which
only the builders did: their count of world groups ran ahead, and the next group the whole
world created got different names on the ranks (every rank hung). An explicit hybrid pair was
checked by one object all-gather over the whole world the first time this rank saw it: ranks
whose pair was already checked skipped it while the others waited in it (a second model over
other groups on some ranks hung every rank), and a stage could not build a new grid while the
other stages built nothing. Checked at world 8 (2 nodes x 4), with a timeout instead of a hang.
"""

import torch
import torch.nn.functional as F

from shardkit import distributed as skdist
from shardkit.models import MLP
from shardkit.nn.data_parallel import FullyShardedDataParallel as FSDP
from shardkit.nn.data_parallel import ShardingStrategy
from shardkit.testing import world_fixture

nodes2x4 = world_fixture(8, name="nodes2x4", ranks_per_node=4, timeout=30)

WIDTH, BATCH, STEPS = 16, 8, 2
_GROUPS = {}


def sub_group(blocks):
    """This rank's group among ``blocks`` (every rank creates every block, once)."""
    key = tuple(map(tuple, blocks))
    if key not in _GROUPS:
        for ranks in blocks:
            group = skdist.new_group(ranks)
            if skdist.get_rank() in ranks:
                _GROUPS[key] = group
    return _GROUPS[key]


def worst_gap_to_one_process(model, ranks, seed):
    """Train ``model`` (FSDP over the data-parallel ranks ``ranks``, this rank's slice of each
    batch) and a local copy on the whole batch; the largest parameter difference after."""
    reference = MLP(WIDTH, 1, seed=seed)
    per, place = BATCH // len(ranks), ranks.index(skdist.get_rank())
    optims = [torch.optim.SGD(m.parameters(), lr=0.1) for m in (model, reference)]
    for step in range(STEPS):
        gen = torch.Generator().manual_seed(step)
        x, y = torch.randn(BATCH, WIDTH, generator=gen), torch.randn(BATCH, WIDTH, generator=gen)
        F.mse_loss(model(x[place * per:(place + 1) * per]),
                   y[place * per:(place + 1) * per]).backward()
        F.mse_loss(reference(x), y).backward()
        for optim in optims:
            optim.step()
            optim.zero_grad()
    full = model.state_dict()
    return max((full[k] - v).abs().max().item() for k, v in reference.state_dict().items())


SPANNING = [[0, 1, 4, 5], [2, 3, 6, 7]]


def _no_shard_on_one_sub_group_then_a_world_group():
    """Only the first data-parallel group trains with NO_SHARD; then the whole world creates
    a group and all-reduces over it."""
    gap, group = None, sub_group(SPANNING)
    if skdist.get_rank() in SPANNING[0]:
        model = FSDP(MLP(WIDTH, 1, seed=3), process_group=group,
                     sharding_strategy=ShardingStrategy.NO_SHARD)
        gap = worst_gap_to_one_process(model, SPANNING[0], seed=3)
    world = skdist.new_group(list(range(skdist.get_world_size())))
    total = torch.ones(1)
    skdist.all_reduce(total, group=world)
    return gap, total.item()


def test_no_shard_on_one_sub_group_leaves_world_groups_usable(nodes2x4):
    results = nodes2x4.run(_no_shard_on_one_sub_group_then_a_world_group)
    for rank, (gap, total) in enumerate(results):
        assert total == 8.0, rank  # was: every rank hung creating the world group
        if rank in SPANNING[0]:
            assert gap <= 1e-6, (rank, gap)


# two pipeline stages of 4 ranks, each a 2 x 2 grid: shard groups (rows) and replica groups
ROWS = [[0, 1], [2, 3], [4, 5], [6, 7]]
COLUMNS = [[0, 2], [1, 3], [4, 6], [5, 7]]


def _hybrid(pair, seed):
    return FSDP(MLP(WIDTH, 1, seed=seed), sharding_strategy=ShardingStrategy.HYBRID_SHARD,
                process_group=pair)


def _stages_building_hybrid_units_apart():
    """Both stages build a unit over their grid; then the second stage builds one over its
    transposed grid (shard over the columns) while the first builds two more over its grid;
    then in the first stage ranks 2 and 3 alone switch to the transposed pair."""
    me = skdist.get_rank()
    stage = me // 4
    grid, transposed = (sub_group(ROWS), sub_group(COLUMNS)), (sub_group(COLUMNS), sub_group(ROWS))
    _hybrid(grid, seed=1)
    if stage == 0:
        gaps = [worst_gap_to_one_process(_hybrid(grid, seed=s), list(range(4)), seed=s)
                for s in (2, 3)]
    else:
        gaps = [worst_gap_to_one_process(_hybrid(transposed, seed=4), list(range(4, 8)),
                                         seed=4)]
    if stage == 1:
        return gaps, None
    try:
        _hybrid(transposed if me in (2, 3) else grid, seed=5)
        return gaps, None
    except ValueError as error:
        return gaps, str(error)


def test_hybrid_pairs_are_checked_by_their_own_grid(nodes2x4):
    for rank, (gaps, error) in enumerate(nodes2x4.run(_stages_building_hybrid_units_apart)):
        assert gaps and max(gaps) <= 1e-6, (rank, gaps)  # was: every rank hung
        if rank < 4:  # was: ranks 0 and 1 ran on, 2 and 3 waited in a check over the world
            assert error is not None and "do not form one grid" in error, (rank, error)
        else:
            assert error is None, (rank, error)
