"""What a rank's pipeline stages get wrong about where they run and how they take their
input, in words for the executor's errors: stages of one rank on different devices, and a stage
module that expects the tensors of a tuple input as separate arguments. Local; no communication.
"""

from __future__ import annotations


def _device_problems(stages: list) -> list[str]:
    """A rank whose stages are on different devices: its pipeline messages (activations,
    gradients, headers) are sent and received on one device, its stages'. Local."""
    if len({stage.device for stage in stages}) < 2:
        return []
    where = ", ".join(f"stage {stage.stage_index} on {str(stage.device)!r}" for stage in stages)
    return [f"the stages of one rank must be on one device (its pipeline messages are sent and "
            f"received there), got {where}; move their modules to one device (module.to(...)) "
            f"and pass it as each PipelineStage's device"]


def _packed_input_hint(activation, error: Exception) -> str:
    """What to do when a stage module given several tensors raised a TypeError (most likely
    a ``forward(self, a, b)``): shardkit passes them as one tuple, where torch unpacks them."""
    if not isinstance(activation, tuple) or not isinstance(error, TypeError):
        return ""
    return (f" (the stage's input is a tuple of {len(activation)} tensors, passed as one "
            f"argument as in nn.Sequential, where torch.distributed.pipelining unpacks it: "
            f"take one argument and unpack it in forward)")
