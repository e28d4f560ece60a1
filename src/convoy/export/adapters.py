"""A LoRA run's model whole, as it trained, and merged: what ``--format hf --merge`` writes.

A run with ``model.lora`` checkpoints its adapters only; its frozen base is the model's folder
(``model.kwargs.path``) or its seeded init (``run.seed``), rebuilt at every start.
``adapted_model`` does the same on one CPU device (``build_initial`` with the adapters), then
reads the checkpoint's adapters into it (DCP, any strategy and world size, no process group).
``merged_model`` folds them into the base layers with PEFT's own merge (``W + B A * alpha /
r``) and puts the base layers back in the wrappers' places: the model's own class and names,
as without LoRA. Unlike every other export this holds the whole model in one process.
"""

from __future__ import annotations

import torch.distributed.checkpoint as dcp
from torch import nn

from convoy.checkpoint import ignore_dcp_group_warning, local_copy
from convoy.errors import ConvoyError
from convoy.export.consolidate import SavedCheckpoint
from convoy.export.shards import checkpoint_tensors
from convoy.models.lora import peft_module
from convoy.models.registry import build_initial


def adapted_model(saved: SavedCheckpoint) -> nn.Module:
    """The LoRA run's model on one CPU device, in eval mode, as it trained: its base from the
    folder or the seed (``run.seed``), its adapters read from the checkpoint."""
    job = saved.job
    model = build_initial(
        job.model.name, job.model.kwargs, saved.meta["data_shape"], job.run.seed, job.model.lora
    )
    ignore_dcp_group_warning()
    with local_copy(saved.run, saved.name) as path:
        held = checkpoint_tensors(path)
        state = {k: v for k, v in model.state_dict().items() if k in held}
        dcp.load({"model": state}, checkpoint_id=path, no_dist=True)
    missing = sorted(k for k in held if k not in state)
    if missing:
        raise ConvoyError(
            f"checkpoint {saved.name} has {missing[0]!r}, which the job's model lacks: it was "
            "written by another model"
        )
    model.load_state_dict(state, strict=False)
    return model.eval()


def merged_model(saved: SavedCheckpoint) -> nn.Module:
    """``adapted_model`` with its adapters merged into the base layers (``W + B A * alpha /
    r``) and PEFT's wrappers gone: the model's own class and names, as without LoRA."""
    tuner = peft_module().tuners.tuners_utils.BaseTunerLayer
    model = adapted_model(saved)
    wrapped = [(n, m) for n, m in model.named_modules() if isinstance(m, tuner)]
    for name, layer in wrapped:
        layer.merge()
        parent, _, child = name.rpartition(".")
        model.get_submodule(parent).register_module(child, layer.get_base_layer())
    for param in model.parameters():
        param.requires_grad_(True)  # as the base model (trained or not) has them
    return model
