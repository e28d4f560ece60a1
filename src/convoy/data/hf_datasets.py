"""The ``hf_dataset`` source: a dataset saved with Hugging Face ``datasets`` (the ``hf`` extra).

Reading. ``data.path`` is a folder that ``Dataset.save_to_disk`` or ``DatasetDict.save_to_disk``
wrote (read with ``datasets.load_from_disk``), a ``.parquet`` file (``Dataset.to_parquet``), or
a folder of parquet files whose file or folder names say the split as on the Hub
(``data/train-00000-of-00001.parquet``, ``validation/...``: ``datasets``' own rule; files that
name none are train). Every split is read whole into memory as an Arrow table, with the
``datasets`` features stored beside it (a ``ClassLabel``'s names).

Splits. ``train`` is train, ``validation`` (``valid``, ``val``, ``dev``) is val, ``test`` is
test; other splits (``unsupervised``) are left out. A missing val or test split is held out of
train by rows (``data.val_fraction``, ``data.test_fraction``, seeded with ``DATA_SEED``), at
least one row each, rows kept in their order.

Targets (``data.target``, filled from ``task.name`` for the built-in tasks):

- ``next_token``: each row of ``data.text_column`` is a document, tokenized and packed as the
  ``text`` source packs its own (``packed_splits``: bits per byte, gzip's reference, the saved
  tokenizer); null and whitespace-only rows are skipped.
- ``class``: ``data.label_column`` holds classes: a ``ClassLabel`` (its names), integers, bools,
  or strings (sorted, over every split). The shape gives ``num_classes``, and with features
  ``num_outputs`` of the same value, so ``tabular_mlp`` gives one logit per class.
- ``value``: ``data.label_column`` holds numbers (or lists of numbers of one length: several
  outputs), standardized with the training split's mean and std; ``meta`` records
  ``target_mean`` and ``target_std`` as ``diabetes`` does. Cast an integer column to float
  in ``datasets`` or set ``data.target: value`` to regress on it.

The inputs of ``class`` and ``value`` rows are ``data.feature_columns`` (numbers, or lists of
numbers of one length; standardized with train's statistics; shape ``num_features``), else the
text of ``data.text_column`` tokenized with ``data.tokenizer`` (``bpe`` is trained on train's
texts) and cut or padded to ``data.seq_len`` tokens with the tokenizer's pad id (shape
``vocab_size`` and ``seq_len``, what an ``hf`` model's sequence-classification head takes;
``meta["pad_id"]`` says the pad id, which that model's ``pad_token_id`` should be).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import TensorDataset

from convoy.config import DataConfig
from convoy.data.base import Splits, given_path, hold_out
from convoy.data.sources import DATA_SEED
from convoy.data.tabular import mean_std
from convoy.data.text import check_text_column, corpus_fingerprint, packed_splits
from convoy.data.text_shards import documents
from convoy.data.tokenizer import build_tokenizer, tokenizer_json
from convoy.errors import ConfigError, ConvoyError
from convoy.imports import missing_extra

EXPECTED = (
    "hf_dataset reads a folder written by save_to_disk (a Dataset or DatasetDict), a .parquet "
    "file, or a folder of parquet files named by split (train, validation, test)"
)
SAVED_FILES = (("dataset_info.json", "state.json"), ("dataset_dict.json",))
"""What ``save_to_disk`` leaves in a folder: a Dataset's two files, or a DatasetDict's one."""
SPLIT_NAMES = {
    "train": "train",
    "validation": "val",
    "valid": "val",
    "val": "val",
    "dev": "val",
    "test": "test",
}
"""``datasets``' split names -> Convoy's."""


def datasets_module() -> Any:
    """``datasets``, or a ``ConvoyError`` with the install line (the ``hf`` extra)."""
    try:
        import datasets  # the hf extra
    except ImportError:
        raise ConvoyError(missing_extra("data.name 'hf_dataset'", "datasets", "hf")) from None
    datasets.disable_progress_bars()  # a bar per split read would fill the run's log
    return datasets


# --- reading ----------------------------------------------------------------------------------


def check_hf_dataset_path(path: str | None) -> Path:
    """``data.path`` of ``hf_dataset`` (looked at, not read), or a ``ConfigError``."""
    root = given_path(path, EXPECTED)
    if root.is_file():
        if root.suffix != ".parquet":
            raise ConfigError("data.path", path, f"not a .parquet file; {EXPECTED}")
        return root
    if not root.is_dir():
        raise ConfigError("data.path", path, f"no such file or folder; {EXPECTED}")
    if not (is_saved(root) or any(root.rglob("*.parquet"))):
        looked = " or ".join(" + ".join(files) for files in SAVED_FILES)
        raise ConfigError(
            "data.path", path, f"neither {looked} nor .parquet files in it; {EXPECTED}"
        )
    return root


def is_saved(root: Path) -> bool:
    """Whether ``save_to_disk`` wrote ``root``: a Dataset's two files, or a DatasetDict's one."""
    return any(all((root / name).is_file() for name in files) for files in SAVED_FILES)


def read_tables(cfg: DataConfig) -> dict[str, Any]:
    """The dataset's splits as Arrow tables, under Convoy's names (train, val, test)."""
    root = check_hf_dataset_path(cfg.path)
    datasets = datasets_module()
    if root.is_file():
        return {"train": _read_parquet([root])}
    if is_saved(root):
        loaded = datasets.load_from_disk(str(root))
        parts = dict(loaded) if isinstance(loaded, datasets.DatasetDict) else {"train": loaded}
        # The arrow format hands over the memory-mapped table, its features in its metadata.
        return _named({split: part.with_format("arrow")[:] for split, part in parts.items()}, cfg)
    patterns = datasets.data_files.get_data_patterns(str(root))
    resolved = datasets.data_files.DataFilesDict.from_patterns(patterns, base_path=str(root))
    files = {
        str(split): [Path(f) for f in found if str(f).endswith(".parquet")]
        for split, found in resolved.items()
    }
    return _named({split: _read_parquet(f) for split, f in files.items() if f}, cfg)


def _read_parquet(files: list[Path]) -> Any:
    import pyarrow as pa  # 0.3 s to import: only where parquet is read
    import pyarrow.parquet as pq

    return pa.concat_tables([pq.read_table(f) for f in sorted(files)])


def _named(tables: dict[str, Any], cfg: DataConfig) -> dict[str, Any]:
    """The splits Convoy uses, under its names; a ``ConfigError`` where there is no train."""
    named = {SPLIT_NAMES[s]: t for s, t in tables.items() if s in SPLIT_NAMES}
    if "train" not in named:
        raise ConfigError(
            "data.path",
            cfg.path,
            f"has no train split (its splits: {', '.join(tables) or 'none'}); {EXPECTED}",
        )
    return named


def hold_out_missing(tables: dict[str, Any], cfg: DataConfig) -> dict[str, Any]:
    """Train, val and test: a split the dataset lacks is held out of train by rows."""
    missing = [name for name in ("test", "val") if name not in tables]
    if not missing:
        return dict(tables)
    train = tables["train"]
    fractions = {"test": cfg.test_fraction, "val": cfg.val_fraction}
    try:
        *held, rest = hold_out(train.num_rows, tuple(fractions[m] for m in missing), DATA_SEED)
    except ValueError as exc:
        raise ConfigError("data.path", cfg.path, f"its train split: {exc}") from None
    out = dict(tables)
    for name, rows in zip(missing, held, strict=True):
        out[name] = train.take(sorted(rows.tolist()))
    out["train"] = train.take(sorted(rest.tolist()))
    return out


# --- the source -------------------------------------------------------------------------------


def load_hf_dataset(cfg: DataConfig) -> Splits:
    """The splits for ``data.target``; see the module docstring."""
    if cfg.target is None:
        raise ConfigError(
            "data.target",
            None,
            "hf_dataset needs to know what a row's target is: next_token, class or value (the "
            "built-in tasks fill it in; a task of your own names it)",
        )
    tables = read_tables(cfg)
    if cfg.target == "next_token":
        for table in tables.values():
            check_text_column(table.schema, cfg.text_column, str(cfg.path))
        tables = hold_out_missing(tables, cfg)
        docs = {name: documents(table, cfg.text_column) for name, table in tables.items()}
        return packed_splits(cfg, docs["train"], docs["val"], docs["test"])
    return labelled_splits(cfg, tables)


def labelled_splits(cfg: DataConfig, tables: dict[str, Any]) -> Splits:
    """Rows with a class or a value: (features or token ids, target) per split."""
    where = str(cfg.path)
    for table in tables.values():
        _check_column(table.schema, cfg.label_column, "data.label_column", where)
    tables = hold_out_missing(tables, cfg)
    if cfg.train_size is not None:  # a cap on training rows
        tables["train"] = tables["train"].slice(0, cfg.train_size)
    inputs, shape, meta = _inputs(cfg, tables, where)
    if cfg.target == "class":
        targets, classes = class_targets(cfg, tables, where)
        shape["num_classes"] = len(classes)
        if "num_features" in shape:
            shape["num_outputs"] = len(classes)
        meta["classes"] = classes
    else:
        targets = value_targets(cfg, tables, where)
        target_mean, target_std = mean_std(targets["train"])
        targets = {name: (t - target_mean) / target_std for name, t in targets.items()}
        shape["num_outputs"] = 1 if targets["train"].dim() == 1 else targets["train"].shape[1]
        meta |= {"target_mean": target_mean.tolist(), "target_std": target_std.tolist()}
    datasets = {name: TensorDataset(inputs[name], targets[name]) for name in tables}
    return Splits(datasets["train"], datasets["val"], datasets["test"], shape, meta=meta)


def _check_column(schema: Any, column: str, field: str, where: str) -> None:
    if column not in schema.names:
        raise ConfigError(
            field, column, f"{where} has no such column; it has {', '.join(schema.names)}"
        )


def _inputs(
    cfg: DataConfig, tables: dict[str, Any], where: str
) -> tuple[dict[str, torch.Tensor], dict[str, int], dict[str, Any]]:
    """Each split's inputs, the shape they give the model, and their meta."""
    if cfg.feature_columns:
        features = feature_matrices(cfg.feature_columns, tables, where)
        feature_mean, feature_std = mean_std(features["train"])
        standardized = {n: (x - feature_mean) / feature_std for n, x in features.items()}
        shape = {"num_features": int(features["train"].shape[1])}
        return standardized, shape, {"feature_names": list(cfg.feature_columns)}
    for table in tables.values():
        check_text_column(table.schema, cfg.text_column, where + " (or set data.feature_columns)")
    texts = {name: _texts(table, cfg.text_column) for name, table in tables.items()}
    tokenizer = build_tokenizer(cfg, [t for t in texts["train"] if t.strip()])
    rows = {
        name: token_rows(tokenizer.encode_each(t), cfg.seq_len, tokenizer.pad_id)
        for name, t in texts.items()
    }
    saved = tokenizer_json(tokenizer)
    meta = {
        "fingerprint": corpus_fingerprint(
            cfg, (texts["train"], texts["val"], texts["test"]), saved
        ),
        "tokenizer_json": saved,
        "pad_id": tokenizer.pad_id,
    }
    # pad_token_id: a classification model reads the last real token and masks the padding by it.
    shape = {"vocab_size": len(tokenizer.token_bytes), "seq_len": cfg.seq_len}
    return rows, shape | {"pad_token_id": tokenizer.pad_id}, meta


def _texts(table: Any, column: str) -> list[str]:
    """A text column's rows, a null as empty text (every row keeps its label)."""
    return [text or "" for text in table.column(column).to_pylist()]


def token_rows(ids: list[np.ndarray], length: int, pad_id: int) -> torch.Tensor:
    """Token ids per row, cut or right-padded with ``pad_id`` to ``length``: (rows, length)."""
    rows = torch.full((len(ids), length), pad_id, dtype=torch.long)
    for i, row in enumerate(ids):
        kept = row[:length]
        rows[i, : len(kept)] = torch.from_numpy(kept.astype(np.int64))
    return rows


def feature_matrices(
    columns: list[str], tables: dict[str, Any], where: str
) -> dict[str, torch.Tensor]:
    """Each split's feature columns side by side as float32 (rows, features)."""
    for table in tables.values():
        for column in columns:
            _check_column(table.schema, column, "data.feature_columns", where)
    return {
        name: torch.cat(
            [numeric_matrix(table, column, "data.feature_columns", where) for column in columns],
            dim=1,
        )
        for name, table in tables.items()
    }


def numeric_matrix(table: Any, column: str, field: str, where: str) -> torch.Tensor:
    """A column of numbers (rows, 1) or of lists of numbers of one length (rows, k), float32;
    a ``ConfigError`` on ``field`` for anything else, or a null."""
    import pyarrow as pa  # 0.3 s to import: only where parquet or arrow is read

    values = table.column(column).combine_chunks()
    kind = values.type
    listed = is_list(kind)
    item = kind.value_type if listed else kind
    if not (pa.types.is_integer(item) or pa.types.is_floating(item) or pa.types.is_boolean(item)):
        raise ConfigError(
            field,
            column,
            f"{where}: the column is {kind}; it must hold numbers or lists of numbers",
        )
    if values.null_count or (listed and values.flatten().null_count):
        raise ConfigError(
            field, column, f"{where}: the column has empty (null) values; fill or drop them"
        )
    if not listed:
        column_values = values.to_numpy(zero_copy_only=False).astype(np.float32)
        return torch.from_numpy(column_values).view(-1, 1)
    lengths = set(values.value_lengths().to_pylist()) if len(values) else {0}
    if len(lengths) != 1:
        raise ConfigError(
            field,
            column,
            f"{where}: its lists have {len(lengths)} different lengths; they must have one",
        )
    flat = values.flatten().to_numpy(zero_copy_only=False).astype(np.float32)
    return torch.from_numpy(flat).view(len(values), lengths.pop())


def is_list(kind: Any) -> bool:
    """Whether an Arrow type is a list (of any of its three kinds)."""
    import pyarrow as pa  # 0.3 s to import: only where parquet or arrow is read

    return bool(
        pa.types.is_list(kind) or pa.types.is_large_list(kind) or pa.types.is_fixed_size_list(kind)
    )


def class_targets(
    cfg: DataConfig, tables: dict[str, Any], where: str
) -> tuple[dict[str, torch.Tensor], list[str]]:
    """Each split's class ids (int64) and the class names (a ClassLabel's, the strings
    sorted, else ``"0"``..``"n-1"``)."""
    import pyarrow as pa  # 0.3 s to import: only where parquet or arrow is read

    column, field = cfg.label_column, "data.label_column"
    kind = tables["train"].schema.field(column).type
    names = _class_label_names(tables["train"].schema, column)
    for name, table in tables.items():
        if table.column(column).null_count:
            raise ConfigError(
                field, column, f"{where}: the {name} split has rows without a label (null)"
            )
    if pa.types.is_string(kind) or pa.types.is_large_string(kind):
        names = sorted({v for t in tables.values() for v in t.column(column).to_pylist()})
        index = {n: i for i, n in enumerate(names)}
        return {
            s: torch.tensor([index[v] for v in t.column(column).to_pylist()])
            for s, t in tables.items()
        }, names
    if not (pa.types.is_integer(kind) or pa.types.is_boolean(kind)):
        raise ConfigError(
            field,
            column,
            f"{where}: the column is {kind}; classes are integers, strings or a ClassLabel (for "
            "numbers to predict use task regression, data.target: value)",
        )
    labels = {
        s: torch.from_numpy(
            t.column(column).combine_chunks().to_numpy(zero_copy_only=False).astype(np.int64)
        )
        for s, t in tables.items()
    }
    if names is None:
        largest = max(int(y.max()) for y in labels.values() if len(y))
        names = [str(i) for i in range(largest + 1)]
    return labels, names


def _class_label_names(schema: Any, column: str) -> list[str] | None:
    """A ``ClassLabel``'s names, from the ``datasets`` features in the table's metadata."""
    features = datasets_module().Features.from_arrow_schema(schema)
    names = getattr(features.get(column), "names", None)
    return list(names) if names else None


def value_targets(cfg: DataConfig, tables: dict[str, Any], where: str) -> dict[str, torch.Tensor]:
    """Each split's float targets: (rows,) for a column of numbers, (rows, k) for lists."""
    matrices = {
        name: numeric_matrix(t, cfg.label_column, "data.label_column", where)
        for name, t in tables.items()
    }
    scalar = not is_list(tables["train"].schema.field(cfg.label_column).type)
    return {name: m.view(-1) if scalar else m for name, m in matrices.items()}
