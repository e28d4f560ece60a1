"""Export a run's checkpoint for use outside Convoy, and read an export back.

Every format starts the same way (``consolidate``): the committed checkpoint and the job
that wrote it; without a name asked for, the run's best where it ranks its checkpoints, else
its latest (``choice``). The weights then stream from the sharded DCP checkpoint into
safetensors files one file at a time (``shards``), so a run sharded by any strategy over any
world size exports alike, and the memory an export takes is one output file's, not the
model's: a model bigger than the memory of the machine that exports it exports in smaller
files. Each format writes them its way:

- ``safetensors`` (``to_safetensors``), any model: ``model.safetensors`` under Convoy's
  keys, loadable with plain PyTorch and safetensors, no process group, no pickle;
- ``hf`` (``to_hf``), ``model.name: hf`` runs: a ``save_pretrained`` folder that the task's
  ``transformers`` auto class and ``AutoTokenizer`` load; for a LoRA run the merged model
  (``merge``, ``adapters``: the whole model in one process);
- ``peft`` (``to_peft``), LoRA runs: ``adapter_config.json`` and
  ``adapter_model.safetensors``, which ``PeftModel.from_pretrained`` loads over the base.

Weights over ``max_shard_size`` (default 5GB, as ``transformers``) are split into
``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``.

Both keep ``model.json`` (the job, the data's shape, the recorded metrics) beside the weights,
and ``evaluate`` measures either, or a run's checkpoint, on the job's test split (``convoy
evaluate``).
"""

from convoy.export.choice import CheckpointChoice, choose_checkpoint
from convoy.export.consolidate import MODEL_FILE, find_checkpoint, read_description
from convoy.export.evaluate import evaluate_checkpoint, evaluate_exported, load_exported
from convoy.export.shards import (
    DEFAULT_MAX_SHARD_SIZE,
    INDEX_FILE,
    WEIGHTS_FILE,
    parse_size,
    read_weights,
    weight_files,
)
from convoy.export.to_hf import HF_FORMAT, TOKENIZER_NOTES, export_hf
from convoy.export.to_peft import PEFT_FORMAT, export_peft
from convoy.export.to_safetensors import SAFETENSORS_FORMAT, export_checkpoint

__all__ = [
    "DEFAULT_MAX_SHARD_SIZE",
    "HF_FORMAT",
    "INDEX_FILE",
    "MODEL_FILE",
    "PEFT_FORMAT",
    "SAFETENSORS_FORMAT",
    "TOKENIZER_NOTES",
    "WEIGHTS_FILE",
    "CheckpointChoice",
    "choose_checkpoint",
    "evaluate_checkpoint",
    "evaluate_exported",
    "export_checkpoint",
    "export_hf",
    "export_peft",
    "find_checkpoint",
    "load_exported",
    "parse_size",
    "read_description",
    "read_weights",
    "weight_files",
]
