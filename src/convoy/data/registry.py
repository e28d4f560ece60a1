"""Dataset registry: ``data.name`` -> a loader returning ``Splits``.

A name is a registered dataset (``DATASETS``, what ``convoy list`` shows) or the user's own
factory ``package.module:function`` (``convoy.data.user``). ``check_dataset`` runs in the
driver before any worker starts, so a missing path or an import that fails is reported once,
clearly, instead of once per rank from inside a worker.
"""

from __future__ import annotations

from collections.abc import Callable

from convoy.config import DataConfig
from convoy.data.base import Splits
from convoy.data.chat import read_chat_template
from convoy.data.cifar10 import check_cifar10_path, load_cifar10
from convoy.data.hf_datasets import check_hf_dataset_path, load_hf_dataset
from convoy.data.imagefolder import check_imagefolder_path, load_imagefolder
from convoy.data.parquet import check_parquet_path, load_parquet
from convoy.data.sensors import load_basicmotions
from convoy.data.series import check_series_path, load_series
from convoy.data.sft import check_sft_path, check_sft_splits, load_sft
from convoy.data.sources import check_numpy_path, load_digits, load_numpy, load_synthetic
from convoy.data.tabular import load_diabetes
from convoy.data.text_shards import check_corpus_path, load_corpus
from convoy.data.tokenizer import check_model_tokenizer
from convoy.data.user import check_data_factory, is_user_data, load_user_data
from convoy.errors import ConfigError, one_of

DATASETS: dict[str, Callable[[DataConfig], Splits]] = {
    "digits": load_digits,
    "synthetic": load_synthetic,
    "cifar10": load_cifar10,
    "imagefolder": load_imagefolder,
    "parquet": load_parquet,
    "numpy": load_numpy,
    "text": load_corpus,
    "diabetes": load_diabetes,
    "basicmotions": load_basicmotions,
    "series": load_series,
    "hf_dataset": load_hf_dataset,
    "sft": load_sft,
}
PATH_CHECKS: dict[str, Callable[[str | None], object]] = {
    "cifar10": check_cifar10_path,
    "imagefolder": check_imagefolder_path,
    "parquet": check_parquet_path,
    "numpy": check_numpy_path,
    "text": check_corpus_path,
    "series": check_series_path,
    "hf_dataset": check_hf_dataset_path,
    "sft": check_sft_path,
}
TOKENIZING = ("text", "hf_dataset", "sft")
"""The sources that read ``data.tokenizer``."""


def check_dataset(cfg: DataConfig) -> None:
    """Fail early on an unknown dataset name, a missing path, a model tokenizer's folder
    without one, a chat template file that is not there, or a user factory that does not
    import or does not take ``data.kwargs`` (the factory itself is not called here)."""
    if is_user_data(cfg.name):
        check_data_factory(cfg)
        return
    if cfg.name not in DATASETS:
        raise ConfigError(
            "data.name", cfg.name, f"{one_of(DATASETS)}, or a factory 'package.module:function'"
        )
    if cfg.kwargs:
        raise ConfigError(
            "data.kwargs",
            cfg.kwargs,
            f"only user data factories ('package.module:function') take kwargs, not {cfg.name!r}",
        )
    check = PATH_CHECKS.get(cfg.name)
    if check is not None:
        check(cfg.path)
    if cfg.name in TOKENIZING and cfg.tokenizer == "model":
        check_model_tokenizer(cfg.tokenizer_path)
    read_chat_template(cfg.chat_template)  # a named file exists (sft's; others refuse it)


def load_splits(cfg: DataConfig) -> Splits:
    """Build the three splits of the configured dataset."""
    if is_user_data(cfg.name):
        return load_user_data(cfg)
    return DATASETS[cfg.name](cfg)


def check_loaded(cfg: DataConfig, splits: Splits) -> None:
    """The driver's checks of splits once loaded that a source asks for (``sft``: every split
    has a row to train on; what it counted said in one line)."""
    if cfg.name == "sft":
        check_sft_splits(cfg, splits)
