"""matplotlib for the benchmarks' figures, imported only when a plot is asked for."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from convoy.errors import ConfigError, ConvoyError
from convoy.imports import missing_extra
from convoy.storage import check_writable_dir


def pyplot() -> Any:
    """``matplotlib.pyplot`` on the file-only Agg backend, or a one-line error saying how to
    install it."""
    try:
        import matplotlib  # the plot extra
    except ImportError:
        raise ConvoyError(missing_extra("--plot", "matplotlib", "plot")) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt  # the plot extra

    return plt


FORMATS = (".png", ".svg", ".pdf")


def check_plot_path(path: str) -> None:
    """Refuse, before anything runs, a ``--plot`` path that cannot take a figure: a folder,
    no image suffix, or a folder that cannot be created (a missing one is made when saving)."""
    target = Path(path).expanduser()
    if target.is_dir():
        raise ConfigError("--plot", path, "a file path ending in .png (this is a folder)")
    if target.suffix.lower() not in FORMATS:
        raise ConfigError("--plot", path, f"a file path ending in {', '.join(FORMATS)}")
    check_writable_dir(str(target.parent), "--plot", path)


def log2_x(axis: Any, ticks: list[int], labels: list[str] | None = None) -> None:
    """A log2 x axis with a tick (and label) at each measured point."""
    axis.set_xscale("log", base=2)
    axis.set_xticks(ticks)
    axis.set_xticklabels(labels or [str(t) for t in ticks])
    axis.minorticks_off()
    axis.grid(True, which="major", alpha=0.3)


def save(figure: Any, path: str) -> str:
    """Write ``figure`` to ``path`` (PNG by its suffix) and close it."""
    figure.tight_layout()
    Path(path).expanduser().parent.mkdir(parents=True, exist_ok=True)
    figure.savefig(Path(path).expanduser(), dpi=120)
    import matplotlib.pyplot as plt  # the plot extra

    plt.close(figure)
    return path
