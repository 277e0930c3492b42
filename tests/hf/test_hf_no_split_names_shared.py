"""Blocks declared by name in Hugging Face's ``_no_split_modules`` when two classes share the
name (a vision tower's ``Block`` beside a text model's ``Block``, as remote-code multimodal
models have): every instance of every class of that name becomes an FSDP unit, as HF's
``device_map`` keeps every module of that name whole."""

import torch.nn as nn

from shardkit.nn.data_parallel import FullyShardedDataParallel
from shardkit.nn.wrap import no_split_module_classes
from shardkit.nn.wrap.auto_wrap import planned_units
from shardkit.recipes import default_wrap_policy


def _vision_block_class():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(8, 8)

        def forward(self, x):
            return x + self.proj(x)
    return Block


def _text_block_class():
    class Block(nn.Module):
        def __init__(self):
            super().__init__()
            self.up, self.down = nn.Linear(8, 16), nn.Linear(16, 8)

        def forward(self, x):
            return x + self.down(self.up(x))
    return Block


VisionBlock, TextBlock = _vision_block_class(), _text_block_class()


class _TwoTowers(nn.Module):
    _no_split_modules = ["Block"]

    def __init__(self):
        super().__init__()
        self.vision = nn.ModuleList([VisionBlock(), VisionBlock()])
        self.text = nn.ModuleList([TextBlock(), TextBlock(), TextBlock()])
        self.head = nn.Linear(8, 4)

    def forward(self, x):
        for block in [*self.vision, *self.text]:
            x = block(x)
        return self.head(x)


def test_every_class_of_a_declared_name_is_a_block():
    assert VisionBlock.__name__ == TextBlock.__name__ and VisionBlock is not TextBlock
    model = _TwoTowers()
    assert set(no_split_module_classes(model)) == {VisionBlock, TextBlock}
    # the same classes in the same order on every rank (the units' order is the wrap order)
    assert no_split_module_classes(model) == no_split_module_classes(_TwoTowers())


def test_default_stage3_wrapping_makes_a_unit_of_every_block_of_both_towers():
    model = _TwoTowers()
    units = planned_units(model, default_wrap_policy(model), FullyShardedDataParallel)
    blocks = [*model.vision, *model.text]
    assert [module for module, _ in units] == [*blocks, model]
    # the root keeps only the head: the towers' weights are sharded unit by unit
    root_params = {id(p) for p in units[-1][1]}
    assert root_params == {id(p) for p in model.head.parameters()}
