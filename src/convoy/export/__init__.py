"""Export a run's checkpoint for use outside Convoy, and read an export back.

Every format starts the same way (``consolidate``): the checkpoint's model is built on one
CPU device and only the model entries of the sharded DCP checkpoint are read into it, so a
run sharded by any strategy over any world size exports alike. Then a format writes it:

- ``safetensors`` (``to_safetensors``), any model: one ``model.safetensors`` under Convoy's
  keys, loadable with plain PyTorch and safetensors, no process group, no pickle;
- ``hf`` (``to_hf``), ``model.name: hf`` runs: a ``save_pretrained`` folder that the task's
  ``transformers`` auto class and ``AutoTokenizer`` load.

Both keep ``model.json`` (the job, the data's shape, the recorded metrics) beside the weights,
and ``evaluate`` measures either on the job's test split (``convoy evaluate``).
"""

from convoy.export.consolidate import MODEL_FILE, WEIGHTS_FILE, find_checkpoint, read_description
from convoy.export.evaluate import evaluate_exported, load_exported
from convoy.export.to_hf import HF_FORMAT, TOKENIZER_NOTES, export_hf
from convoy.export.to_safetensors import SAFETENSORS_FORMAT, export_checkpoint

__all__ = [
    "HF_FORMAT",
    "MODEL_FILE",
    "SAFETENSORS_FORMAT",
    "TOKENIZER_NOTES",
    "WEIGHTS_FILE",
    "evaluate_exported",
    "export_checkpoint",
    "export_hf",
    "find_checkpoint",
    "load_exported",
    "read_description",
]
