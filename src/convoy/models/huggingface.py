"""Hugging Face ``transformers`` models (``model.name: hf``), with what the strategies need.

``model.kwargs.path`` is a local folder as ``save_pretrained`` writes it (``config.json``,
optional ``*.safetensors`` weights, optional tokenizer files); ``model.kwargs.config`` is a
config dict with ``model_type`` (weights initialised by ``transformers``, seeded by the run).
Nothing is downloaded: ``local_files_only`` everywhere, and a missing folder or an unknown
``model_type`` is one ``ConfigError``.

The head follows the data (``model.kwargs.head``, default ``auto``): a vocabulary means a
causal LM (``AutoModelForCausalLM``); classes mean sequence classification, or image
classification where the data are images (``in_channels``); ``num_outputs`` means regression
(the sequence or image classification head with ``problem_type: regression``).

``HuggingFaceModel`` holds the ``transformers`` model as ``model`` (so checkpoint keys are
``model.<the Hub's keys>``) and returns plain logits, as Convoy's tasks take them. Its
``blocks`` are the model's repeated layers, found from ``_no_split_modules`` (the classes
``transformers`` itself never splits across devices) or ``model.kwargs.block_class``: FSDP
units, activation checkpointing and ``run.compile`` work per block as for ``gpt``. Its
tensor-parallel plan is the config's ``base_model_tp_plan`` (``colwise`` / ``rowwise`` per
module pattern), where ``transformers`` has one.

``transformers`` is the ``hf`` extra, imported only when a model is built (about 4 s).
"""

from __future__ import annotations

import difflib
import json
from pathlib import Path
from typing import Any

import torch
from torch import nn

from convoy.errors import ConfigError, ConvoyError, one_of
from convoy.imports import missing_extra
from convoy.models.hf_weights import FolderWeights, weight_files
from convoy.models.init import building_on_meta
from convoy.models.packing import token_inputs

HEADS = ("auto", "causal_lm", "sequence_classification", "image_classification", "regression")
"""``model.kwargs.head``: which ``transformers`` head the model gets."""

TP_STYLES = ("colwise", "rowwise")
"""The ``base_model_tp_plan`` styles Convoy applies (torch's Colwise/RowwiseParallel); a plan
with another style (``colwise_rep``, ``local_*``, expert-parallel ones) is refused."""


def transformers_module() -> Any:
    """``transformers``, or a ``ConvoyError`` with the install line (the ``hf`` extra)."""
    try:
        import transformers
    except ImportError:
        raise ConvoyError(missing_extra("model.name 'hf'", "transformers", "hf")) from None
    transformers.logging.set_verbosity_error()  # its advice on unused weights is not ours
    return transformers


def hf(
    path: str | None = None,
    config: dict[str, Any] | None = None,
    head: str = "auto",
    block_class: str | None = None,
    vocab_size: int | None = None,
    num_classes: int | None = None,
    num_outputs: int | None = None,
    in_channels: int | None = None,
    image_size: int | None = None,
    pad_token_id: int | None = None,
) -> HuggingFaceModel:
    """A ``transformers`` model from a local folder (``path``) or a config dict (``config``)
    with the head the data needs; data-shaped arguments come from the dataset. Weights in the
    folder are loaded (float32); a config builds untrained weights."""
    if (path is None) == (config is None):
        raise ConfigError(
            "model.kwargs", {"path": path, "config": config}, "give one of path or config"
        )
    if head not in HEADS:
        raise ConfigError("model.kwargs.head", head, one_of(HEADS))
    hf_config = load_config(path, config)
    head = resolve_head(head, num_classes, num_outputs, in_channels)
    # A folder's model, or a config that names its vocabulary, keeps it; the data's must fit.
    keeps_vocab = path is not None or "vocab_size" in (config or {})
    fit_config(hf_config, head, keeps_vocab, vocab_size, num_classes, num_outputs, in_channels)
    if head == "image_classification" and path is None and image_size is not None:
        hf_config.image_size = image_size
    if head != "causal_lm" and pad_token_id is not None:
        hf_config.pad_token_id = pad_token_id  # what the data pads token rows with
    files = weight_files(Path(path)) if path is not None else []
    # Built on meta by the engine, the folder's weights are read later, by slice, into each
    # rank's shards (convoy.models.hf_weights), not whole here.
    read_now = bool(files) and not building_on_meta()
    model = HuggingFaceModel(
        build_hf_model(hf_config, head, path if read_now else None), head, block_class
    )
    if files:
        assert path is not None
        folder = FolderWeights(Path(path), files)
        check_folder_matches(folder, model)
        if not read_now:
            model.__dict__["weights_folder"] = folder
    return model


def check_folder_matches(folder: FolderWeights, model: nn.Module) -> None:
    """The folder's tensors fit the config's model: shapes equal, and not every parameter
    missing (a folder of another architecture)."""
    missing = folder.check(model)
    total = sum(1 for _ in model.parameters())
    if missing and len(missing) >= total:
        stored = next(iter(folder.tensors), "nothing")
        raise ConfigError(
            "model.kwargs.path",
            str(folder.folder),
            f"none of its tensors is a parameter of the config's model (it has {stored!r}; "
            f"the model has {missing[0]!r})",
        )


def load_config(path: str | None, config: dict[str, Any] | None) -> Any:
    """The ``transformers`` config of a folder or a dict, offline."""
    transformers = transformers_module()
    if path is not None:
        folder = Path(path)
        if not folder.is_dir():
            raise ConfigError("model.kwargs.path", path, "no such folder")
        if not (folder / "config.json").is_file():
            raise ConfigError(
                "model.kwargs.path",
                path,
                "has no config.json: a folder as save_pretrained writes it (config.json, "
                "model.safetensors, tokenizer files)",
            )
        model_type = _read_model_type(folder / "config.json")
        check_model_type("model.kwargs.path", model_type, transformers)
        return transformers.AutoConfig.from_pretrained(str(folder), local_files_only=True)
    assert config is not None
    settings = dict(config)
    model_type = settings.pop("model_type", None)
    if model_type is None:
        raise ConfigError(
            "model.kwargs.config", config, "needs model_type (e.g. llama, gpt2, bert, vit)"
        )
    check_model_type("model.kwargs.config.model_type", model_type, transformers)
    try:
        return transformers.AutoConfig.for_model(model_type, **settings)
    except (TypeError, ValueError) as exc:
        raise ConfigError(
            "model.kwargs.config", config, f"transformers refused it: {exc}"
        ) from None


def _read_model_type(config_file: Path) -> Any:
    try:
        return json.loads(config_file.read_text()).get("model_type")
    except (ValueError, AttributeError) as exc:
        raise ConfigError("model.kwargs.path", str(config_file), f"unreadable: {exc}") from None


def check_model_type(field: str, model_type: Any, transformers: Any) -> None:
    """``model_type`` is one this ``transformers`` knows (no code is fetched for others)."""
    known = list(transformers.CONFIG_MAPPING.keys())
    if model_type in known:
        return
    close = difflib.get_close_matches(str(model_type), known, n=3)
    hint = f"did you mean {', '.join(close)}? " if close else ""
    raise ConfigError(
        field,
        model_type,
        f"not a model_type of transformers {transformers.__version__} ({len(known)} known, "
        f"e.g. llama, gpt2, bert, vit); {hint}models whose code lives on the Hub are not run",
    )


def resolve_head(
    head: str, num_classes: int | None, num_outputs: int | None, in_channels: int | None
) -> str:
    """``auto`` -> the head the data's shape calls for."""
    if head != "auto":
        return head
    if num_classes is not None:
        return "image_classification" if in_channels is not None else "sequence_classification"
    if num_outputs is not None:
        return "regression"
    return "causal_lm"


def fit_config(
    config: Any,
    head: str,
    keeps_vocab: bool,
    vocab_size: int | None,
    num_classes: int | None,
    num_outputs: int | None,
    in_channels: int | None,
) -> None:
    """Set what the data decides on ``config`` (in place). A model that ``keeps_vocab`` (a
    folder's, or a config that names it) keeps its vocabulary, and the data's must fit in it."""
    if vocab_size is not None and hasattr(config, "vocab_size"):
        if not keeps_vocab:
            config.vocab_size = vocab_size
            # Special ids of the config's default vocabulary (GPT-2's 50256) that the data's
            # does not have: unset, as a tokenizer without them would leave them.
            for name in ("bos_token_id", "eos_token_id", "pad_token_id"):
                value = getattr(config, name, None)
                if isinstance(value, int) and value >= vocab_size:
                    setattr(config, name, None)
        elif vocab_size > config.vocab_size:
            field = "model.kwargs.path" if config.name_or_path else "model.kwargs.config.vocab_size"
            raise ConfigError(
                field,
                config.name_or_path or config.vocab_size,
                f"the model's vocabulary has {config.vocab_size} tokens and the data's "
                f"tokenizer {vocab_size}: tokenize with one whose ids fit (the model's own "
                "folder, data.tokenizer: model, unless tokens were added to it)",
            )
    if head in ("sequence_classification", "image_classification") and num_classes:
        config.num_labels = num_classes
    if head == "regression":
        config.num_labels = num_outputs or 1
        config.problem_type = "regression"
    image_channels = head == "image_classification" and hasattr(config, "num_channels")
    if image_channels and in_channels is not None and not config.name_or_path:
        config.num_channels = in_channels


def head_class(head: str, config: Any) -> Any:
    """The ``transformers`` auto class for ``head`` (regression uses the classification head
    of the data's kind)."""
    transformers = transformers_module()
    if head == "regression":
        images = type(config) in transformers.MODEL_FOR_IMAGE_CLASSIFICATION_MAPPING
        head = "image_classification" if images else "sequence_classification"
    return {
        "causal_lm": transformers.AutoModelForCausalLM,
        "sequence_classification": transformers.AutoModelForSequenceClassification,
        "image_classification": transformers.AutoModelForImageClassification,
    }[head]


def build_hf_model(config: Any, head: str, path: str | None) -> nn.Module:
    """The model, float32, with the folder's weights where it has them. On the meta device
    (the driver's checks) nothing is read."""
    auto = head_class(head, config)
    on_meta = torch.empty(0).device.type == "meta"
    try:
        if path is not None and not on_meta:
            return auto.from_pretrained(
                path, config=config, local_files_only=True, dtype=torch.float32
            )
        return auto.from_config(config, dtype=torch.float32)
    except ValueError as exc:  # no such head for this model_type
        field = "model.kwargs.head"
        raise ConfigError(field, head, f"{config.model_type}: {str(exc).splitlines()[0]}") from None


class HuggingFaceModel(nn.Module):
    """A ``transformers`` model that takes a batch's inputs and returns its logits."""

    def __init__(self, model: nn.Module, head: str, block_class: str | None = None) -> None:
        super().__init__()
        self.model = model
        self.head_kind = head
        self.block_class = block_class
        # Not registered as a submodule (their parameters are the model's; the keys stay the
        # Hub's): a plain attribute that ``blocks`` returns.
        self.__dict__["_blocks"] = find_blocks(model, block_class)
        self.images = getattr(model, "main_input_name", "input_ids") == "pixel_values"

    @property
    def blocks(self) -> nn.ModuleList:
        """The model's repeated layers: its FSDP units, checkpointed and compiled blocks."""
        blocks: nn.ModuleList = self.__dict__["_blocks"]
        return blocks

    @property
    def config(self) -> Any:
        """The ``transformers`` config."""
        return self.model.config

    @property
    def context_length(self) -> int | None:
        """The longest sequence the model's positions cover (None for images)."""
        length = getattr(self.config, "max_position_embeddings", None)
        return None if self.images else length

    @torch.no_grad()
    def init_module(self, module: nn.Module) -> None:
        """``transformers``' own init of one module (its ``_init_weights``: normal weights
        with the config's ``initializer_range``, zero biases, unit norms, rotary tables);
        Convoy calls it module by module on a model built from a config, so its initial
        weights do not depend on the layout (``convoy.models.init``). A model read from a
        folder is built for real, its weights loaded."""
        init_weights: Any = getattr(self.model, "_init_weights")  # noqa: B009 (a method)
        init_weights(module)

    def forward(self, inputs: Any) -> torch.Tensor:
        """Logits: ``(B, T, vocab)`` for a causal LM, ``(B, labels)`` for the others."""
        if self.images:
            return self.model(pixel_values=inputs).logits
        if self.head_kind == "causal_lm":  # packed sequences: no padding to mask
            # Packed samples' positions restart per sample: with no attention mask and no
            # cache, transformers masks attention within each (convoy.models.packing).
            tokens, positions = token_inputs(inputs)
            return self.model(input_ids=tokens, position_ids=positions, use_cache=False).logits
        pad = self.config.pad_token_id
        mask = None if pad is None else inputs.ne(pad).long()  # padded rows of token ids
        return self.model(input_ids=inputs, attention_mask=mask).logits

    def tensor_parallel_plan(self, tp_size: int) -> dict[str, Any]:
        """The config's ``base_model_tp_plan`` under this module's paths, as torch's styles;
        a ``ValueError`` where there is none or the heads do not split."""
        from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

        plan = getattr(self.config, "base_model_tp_plan", None) or {}
        if not plan:
            raise ValueError(
                f"transformers has no tensor-parallel plan for model_type "
                f"{self.config.model_type!r} (its config's base_model_tp_plan is empty); "
                "set strategy.tp_size=1"
            )
        unknown = sorted({style for style in plan.values() if style not in TP_STYLES})
        if unknown:
            raise ValueError(
                f"its base_model_tp_plan uses {', '.join(unknown)}; Convoy applies "
                f"{' and '.join(TP_STYLES)} only"
            )
        for field in ("num_attention_heads", "num_key_value_heads"):
            heads = getattr(self.config, field, None)
            if isinstance(heads, int) and heads % tp_size:
                raise ValueError(f"its {field} ({heads}) does not split over {tp_size}")
        prefix = f"model.{self.model.base_model_prefix}."
        styles = {"colwise": ColwiseParallel, "rowwise": RowwiseParallel}
        return {prefix + pattern: styles[style]() for pattern, style in plan.items()}


def find_blocks(model: nn.Module, block_class: str | None) -> nn.ModuleList:
    """The model's repeated layers: modules of ``block_class`` (else of a class in
    ``_no_split_modules``) that sit in an ``nn.ModuleList``, in order. Empty where none are
    found; a ``ConfigError`` where the ``block_class`` asked for is not in the model."""
    names = {block_class} if block_class else set(getattr(model, "_no_split_modules", None) or ())
    found = [
        child
        for module in model.modules()
        if isinstance(module, nn.ModuleList)
        for child in module
        if type(child).__name__ in names
    ]
    if block_class and not found:
        raise ConfigError(
            "model.kwargs.block_class",
            block_class,
            f"no layer of {type(model).__name__} in an nn.ModuleList has this class; "
            f"its repeated layers are {', '.join(repeated_classes(model)) or 'none'}",
        )
    return nn.ModuleList(found)


def repeated_classes(model: nn.Module) -> list[str]:
    """Class names of the layers the model keeps in ``nn.ModuleList``s."""
    return sorted(
        {
            type(child).__name__
            for module in model.modules()
            if isinstance(module, nn.ModuleList)
            for child in module
        }
    )
