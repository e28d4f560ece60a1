"""What is trained and on what: the ``task``, ``model``, ``data`` and ``optim`` sections."""

from __future__ import annotations

from typing import Annotated, Any, Literal, get_args

from pydantic import Field, field_validator, model_validator

from convoy.config.base import Section
from convoy.errors import ConfigError


class TaskConfig(Section):
    name: str = "classification"
    """What a batch is, the loss and the metrics: classification, language_modeling,
    regression, or the user's own ``package.module:Class`` (a ``convoy.tasks.Task``)."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the task's constructor."""


class LoraConfig(Section):
    """LoRA adapters through PEFT (the ``lora`` extra): every other parameter frozen."""

    r: Annotated[int, Field(gt=0)] = 8
    """The adapters' rank."""
    alpha: Annotated[float, Field(gt=0)] = 16.0
    """Their scale is alpha / r."""
    dropout: Annotated[float, Field(ge=0, lt=1)] = 0.0
    """Dropout on the adapters' input."""
    target_modules: list[str] = Field(min_length=1)
    """Names of the linear layers that get adapters (the last component, as PEFT matches
    them: ``q_proj``, ``v_proj`` on Llama; ``q``, ``v`` on ``gpt``)."""


class ModelConfig(Section):
    name: str = "vit_tiny"
    """A registered model name (see ``convoy.models``) or a user factory ``package.module:fn``."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for the factory; data-shaped ones the factory accepts
    (``num_classes``, ``in_channels``, ``image_size``, ``vocab_size``, ``num_features``...)
    default to the dataset's."""
    lora: LoraConfig | None = None
    """LoRA adapters (``convoy.models.lora``): only they train; checkpoints hold them and their
    optimizer state, not the frozen base."""


class RayDataConfig(Section):
    """How the ``ray_data`` loader runs its preprocessing (``map_batches``) on CPU."""

    compute: Literal["tasks", "actors"] = "tasks"
    """tasks: stateless Ray tasks; actors: a pool of long-lived actors."""
    concurrency: Annotated[int, Field(gt=0)] | None = None
    """Most tasks at once, or the actor pool's size, per pipeline (every train worker runs
    its own for training; default: Ray decides; 1 actor)."""
    batch_size: Annotated[int, Field(gt=0)] = 256
    """Rows per preprocessing batch."""
    reserved_cpus: Annotated[float, Field(gt=0)] = 1.0
    """CPUs kept free of train workers for the pipeline; train workers get fractions if needed."""
    prefetch_batches: Annotated[int, Field(ge=0)] = 2
    """Units (row groups or chunks) each worker's pipeline hands over ahead of the step, and
    batches of an eval split (iter_torch_batches)."""
    shuffle_buffer_rows: Annotated[int, Field(ge=0)] = 1024
    """Rows of an in-memory source (or of parquet image slices) whose order each worker
    shuffles together every epoch (a window of chunks, after the chunks' own seeded order);
    streamed sources use ``data.shuffle_row_groups``."""
    resources: dict[str, float] = Field(default_factory=dict)
    """Custom Ray resources every preprocessing task or actor asks for, e.g.
    ``{preprocess: 1}``: the map stages then run only on nodes started with that resource
    (``ray start --resources '{"preprocess": 8}'``), so CPU-only nodes preprocess and the
    training nodes only train."""
    cache_eval_mib: Annotated[float, Field(ge=0)] = 1024
    """Eval splits whose preprocessed tensors fit in this many MiB are preprocessed once and
    kept in the object store; larger ones are streamed at every evaluation."""

    @field_validator("resources")
    @classmethod
    def _custom_resources(cls, value: dict[str, float]) -> dict[str, float]:
        for name, amount in value.items():
            if name in ("CPU", "GPU", "memory") or amount <= 0:
                raise ValueError(
                    f"{name}={amount}: allowed: custom resource names (not CPU, GPU or memory: "
                    "CPUs come from reserved_cpus) with amounts above 0"
                )
        return value


SFT_FIELDS = ("chat_template", "train_on", "packing", "long_rows")
"""The fields only ``data.name: sft`` reads."""


class DataConfig(Section):
    name: str = "digits"
    """A registered dataset (``convoy list``) or a user factory ``package.module:fn`` that
    returns the splits (see the README's "Your own model, data and task")."""
    kwargs: dict[str, Any] = Field(default_factory=dict)
    """Keyword arguments for a user data factory."""
    path: str | None = None
    """Directory, file or archive for datasets read from disk (cifar10, imagefolder, parquet,
    numpy; text: a .txt file, a folder of them, or parquet with a text column; series: a
    folder or s3://bucket/prefix of parquet shards, streamed; hf_dataset: a folder written by
    ``datasets``' save_to_disk, a .parquet file, or a folder of parquet files; sft: a .jsonl
    file, a folder of them named by split, or what hf_dataset reads)."""
    seq_len: Annotated[int, Field(gt=0)] = 128
    """Tokens per training sequence (text): the corpus is packed into sequences this long;
    sft: the rows its samples are packed (or padded) into."""
    tokenizer: Literal["bpe", "bytes", "model"] = "bpe"
    """text, and hf_dataset's text: 'bpe' trains a byte-level BPE on the training split
    (tokenizers library); 'bytes' uses the 256 UTF-8 byte values (no training, no vocabulary
    file); 'model' uses the tokenizer saved in a pretrained model's folder
    (``tokenizer_path``; the hf extra), its whole vocabulary, added tokens included. sft
    always uses 'model' (its default there)."""
    tokenizer_path: str | None = None
    """tokenizer 'model': the folder that holds it (``tokenizer.json``, or the files
    transformers converts: ``tokenizer.model``, ``vocab.json`` + ``merges.txt``,
    ``vocab.txt``). Filled from ``model.kwargs.path`` where ``model.name`` is hf."""
    vocab_size: Annotated[int, Field(ge=257)] = 2048
    """text with tokenizer 'bpe': the vocabulary size to train."""
    text_column: str = "text"
    """text from parquet, hf_dataset: the column that holds the documents (for targets
    'class' and 'value' without ``feature_columns``: the text each row's tokens come from,
    cut or padded to ``seq_len``)."""
    target: Literal["next_token", "class", "value"] | None = None
    """hf_dataset: what a row's target is: 'next_token' (language modeling on
    ``text_column``), 'class' (``label_column`` as classes: integers, strings or a ClassLabel)
    or 'value' (``label_column`` as numbers, standardized). Filled from task.name for the
    built-in tasks; a task of your own names it."""
    chat_template: str | None = None
    """sft: the chat template that renders message rows, a Jinja string or a file holding
    one; default: the tokenizer's own (``chat_template`` in its folder's
    ``tokenizer_config.json``, or ``chat_template.jinja``)."""
    train_on: Literal["assistant", "last_assistant", "all"] = "assistant"
    """sft: the tokens trained (the others' targets are -100): 'assistant', every assistant
    turn's content and end-of-turn token (a prompt/completion row's completion); 'last_assistant',
    only the last assistant turn; 'all', every token. A plain text row trains every token."""
    packing: bool = True
    """sft: samples are packed into rows of ``seq_len`` tokens, ``position_ids`` restarting
    at 0 at each sample's first token (where the model finds its boundaries); false: one
    sample a row, padded to ``seq_len``."""
    long_rows: Literal["cut", "skip"] = "cut"
    """sft: a sample longer than ``seq_len`` tokens is cut to its first ``seq_len`` ('cut')
    or left out ('skip'); either is counted and reported."""
    feature_columns: list[str] | None = None
    """hf_dataset with target 'class' or 'value': the numeric columns (numbers, or lists of
    numbers of one length) that form each row's features, in order, standardized with the
    training split's statistics; unset: the row's text (``text_column``) as token ids."""
    series_columns: list[str] | None = None
    """series: the list columns that are the channels, in order (default: series.json's
    channels, else every list column)."""
    label_column: str = "label"
    """series: the integer label column; hf_dataset: the classes or values (``target``)."""
    series_len: Annotated[int, Field(gt=0)] | None = None
    """series: the padding rule; every series is padded with zeros or cut to this many steps
    (unset: all series must have one length)."""
    shuffle_row_groups: Annotated[int, Field(gt=0)] = 4
    """Streamed sources (series, a sharded text corpus), either loader: rows are shuffled
    within windows of this many row groups, which is also what a worker holds in memory at
    once."""
    stream_readers: Annotated[int, Field(gt=0)] = 2
    """Streamed sources with the torch loader: threads that read a rank's next windows at
    once, each a whole window (a rank holds this many windows more in memory). More keep a
    GPU fed at large batches (one H200, conv1d at batch 1,024: 1 -> 2 readers took the data
    wait from 13% to 6.5%) and hide object storage's latency."""
    loader: Literal["torch", "ray_data"] = "torch"
    """torch: a DataLoader in every worker; ray_data: a Ray Data pipeline streamed into the
    Ray Train workers (needs scaling.launcher: ray)."""
    on_bad_record: Literal["error", "skip"] = "error"
    """An unreadable image: error names it and stops; skip leaves it out and reports it."""
    ray_data: RayDataConfig = Field(default_factory=RayDataConfig)
    batch_size: Annotated[int, Field(gt=0)] = 64
    """Global training batch: split over workers and accumulation steps."""
    eval_batch_size: Annotated[int, Field(gt=0)] = 256
    """Per-worker batch for evaluation."""
    num_workers: Annotated[int, Field(ge=0)] = 0
    """DataLoader worker processes per training worker."""
    val_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.1
    """Share of the training set held out for validation when the dataset has no val split."""
    test_fraction: Annotated[float, Field(gt=0, lt=1)] = 0.2
    """Share held out for test when the dataset has no test split (digits)."""
    image_size: Annotated[int, Field(gt=0)] | None = None
    """Resize images to this size (imagefolder); synthetic images use it as their size."""
    train_size: Annotated[int, Field(gt=0)] | None = None
    """Number of training samples (synthetic), or a cap on them (other datasets)."""
    augment_crop_padding: Annotated[int, Field(ge=0)] = 0
    """Training-only augmentation: pad by this many pixels and crop back at a random offset."""
    augment_flip: bool = False
    """Training-only augmentation: flip images horizontally with probability 1/2."""

    @model_validator(mode="after")
    def _sft_fields(self) -> DataConfig:
        """sft tokenizes with a model's tokenizer (``tokenizer: model`` unless the recipe
        names another, which is refused); its own fields are refused for other sources
        (compared with their defaults: a saved job writes every field)."""
        if self.name == "sft" and self.tokenizer != "model":
            if "tokenizer" in self.model_fields_set:
                raise ConfigError(
                    "data.tokenizer",
                    self.tokenizer,
                    "sft renders rows with a model's chat template and tokenizer: use "
                    "data.tokenizer: model (its default)",
                )
            object.__setattr__(self, "tokenizer", "model")  # frozen, still being built
        if self.name == "sft":
            return self
        for key in SFT_FIELDS:
            value = getattr(self, key)
            if value != type(self).model_fields[key].default:
                raise ConfigError(
                    f"data.{key}", value, f"read only by data.name: sft (got {self.name!r})"
                )
        return self

    @model_validator(mode="after")
    def _tokenizer_path_needs_model(self) -> DataConfig:
        """A tokenizer folder is read only by ``tokenizer: model``: refused, not ignored."""
        if self.tokenizer_path is not None and self.tokenizer != "model":
            raise ConfigError(
                "data.tokenizer_path",
                self.tokenizer_path,
                f"read only with data.tokenizer: model (got {self.tokenizer!r}); remove it, or "
                "set data.tokenizer: model",
            )
        return self


TORCH_DEFAULTS: dict[str, dict[str, Any]] = {
    "adamw": {"betas": (0.9, 0.999), "weight_decay": 0.01},  # torch.optim.AdamW
    "sgd": {"momentum": 0.0, "weight_decay": 0.0},  # torch.optim.SGD
}
"""Each optimizer's own fields and torch's defaults for them: what a recipe that leaves one
out gets, so a loop ported from plain PyTorch trains the same. A field that is not in its
optimizer's entry (``momentum`` for adamw, ``betas`` for sgd) stays null."""


class OptimConfig(Section):
    """The optimizer and its learning-rate schedule.

    ``weight_decay``, ``momentum`` and ``betas`` default to torch's for ``name``
    (``TORCH_DEFAULTS``), resolved at load time so ``convoy config show`` prints what will
    be used; one the optimizer does not have is refused rather than ignored. The schedule is
    Convoy's, as torch's optimizers have none to follow: cosine by default (the shipped
    recipes are tuned with it), after ``warmup_steps`` of linear warm-up (none unless asked
    for). ``convoy train`` prints both before it starts.
    """

    name: Literal["adamw", "sgd"] = "adamw"
    lr: Annotated[float, Field(gt=0)] = 1e-3
    """Peak learning rate (after warmup), before optional linear scaling."""
    weight_decay: Annotated[float, Field(ge=0)] | None = None
    """Weight decay of parameters of 2-D and up (decoupled for adamw, L2 for sgd); default:
    torch's, 0.01 for adamw and 0 for sgd."""
    momentum: Annotated[float, Field(ge=0, lt=1)] | None = None
    """sgd only; default: torch's 0 (``SGD(lr, momentum=0.9)`` is ``momentum: 0.9``)."""
    betas: tuple[float, float] | None = None
    """adamw only; default: torch's (0.9, 0.999)."""
    warmup_steps: Annotated[int, Field(ge=0)] = 0
    """Steps of linear warm-up from lr / warmup_steps to the peak."""
    schedule: Literal["cosine", "constant"] = "cosine"
    """After warm-up: cosine decay to ``min_lr_ratio`` x lr over the run, or a constant lr
    (what a plain torch loop without a scheduler does)."""
    min_lr_ratio: Annotated[float, Field(ge=0, le=1)] = 0.0
    """Cosine floor as a fraction of the peak learning rate."""
    scale_lr_base_batch: Annotated[int, Field(gt=0)] | None = None
    """If set, lr is scaled linearly by global_batch / this value (Goyal et al.)."""
    grad_clip_norm: Annotated[float, Field(gt=0)] | None = None
    """Clip the global gradient norm (over every shard) to this value."""
    grad_accum_steps: Annotated[int, Field(gt=0)] = 1
    fused: bool | None = None
    """torch's fused optimizer kernel (one launch for every parameter, not one per tensor);
    default: on for CUDA, off elsewhere (on the CPU the per-tensor loop is torch's default,
    and the fused kernel rounds differently)."""

    @field_validator("betas")
    @classmethod
    def _betas_in_range(cls, value: tuple[float, float] | None) -> tuple[float, float] | None:
        if value is not None and not all(0 <= beta < 1 for beta in value):
            raise ValueError("allowed: two numbers in [0, 1), e.g. [0.9, 0.999]")
        return value

    @model_validator(mode="after")
    def _torch_defaults(self) -> OptimConfig:
        """Fill the optimizer's unset fields with torch's defaults; refuse the other's."""
        own = TORCH_DEFAULTS[self.name]
        for key in ("weight_decay", "momentum", "betas"):
            value = getattr(self, key)
            if key not in own and value is not None:
                has = next(name for name, fields in TORCH_DEFAULTS.items() if key in fields)
                raise ConfigError(
                    f"optim.{key}",
                    value,
                    f"set but optim.name is {self.name!r}, which has no {key}; remove it, or "
                    f"use optim.name: {has}",
                )
            if key in own and value is None:
                # The model is frozen; this runs once, while it is being built.
                object.__setattr__(self, key, own[key])
        return self

    @property
    def hyperparameters(self) -> dict[str, Any]:
        """The optimizer's own fields, resolved (``momentum`` or ``betas``, and
        ``weight_decay``), as torch's constructor names them."""
        return {key: getattr(self, key) for key in TORCH_DEFAULTS[self.name]}


LOADER_NAMES: tuple[str, ...] = get_args(DataConfig.model_fields["loader"].annotation)
"""Every ``data.loader``; which launcher takes which is the launcher's fact
(``convoy.config.launchers``)."""
