"""Where a run's files live: a local (or NFS) directory, or an ``s3://bucket/prefix``.

Everything a run keeps (config, metrics, summary, checkpoints) goes through ``RunStorage``, so
the same layout works on both. Local paths use the file system directly. ``s3://`` goes through
pyarrow's S3 file system, the one Ray Train's own storage uses, configured the standard AWS way:
credentials and region from the environment or ``~/.aws``, and ``AWS_ENDPOINT_URL`` for an
S3-compatible server (MinIO, Ceph, moto). pyarrow is imported only for ``s3://`` runs.
"""

from __future__ import annotations

import functools
import os
import shutil
from abc import ABC, abstractmethod
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from convoy.errors import ConfigError, ConvoyError

REMOTE_SCHEMES = ("s3://",)
T = TypeVar("T")


def is_remote(location: str | Path) -> bool:
    return str(location).startswith(REMOTE_SCHEMES)


class StorageError(ConvoyError, OSError):
    """The run's storage cannot be reached or written (an ``OSError`` like a disk's)."""

    def __init__(self, what: str, detail: str, hint: str) -> None:
        self.what, self.detail, self.hint = what, detail, hint
        super().__init__(f"run.storage_dir: cannot {what} ({detail}); {hint}")


class RunStorage(ABC):
    """One run directory. Paths given to methods are relative to it, with ``/`` separators."""

    uri: str

    @staticmethod
    def at(location: str | Path) -> RunStorage:
        if is_remote(location):
            return S3Storage(str(location))
        return LocalStorage(Path(location))

    def __str__(self) -> str:
        return self.uri

    @abstractmethod
    def local_path(self, rel: str) -> Path | None:
        """The path on this machine's file system, or None when the storage is remote."""

    @abstractmethod
    def exists(self, rel: str) -> bool: ...

    @abstractmethod
    def read_text(self, rel: str) -> str:
        """The file's text; ``FileNotFoundError`` when it does not exist."""

    @abstractmethod
    def write_text(self, rel: str, text: str) -> None:
        """Write a whole file atomically: readers see the old file or the new, never half."""

    @abstractmethod
    def append_text(self, rel: str, text: str) -> None: ...

    @abstractmethod
    def list_dirs(self, rel: str) -> list[str]:
        """Names of the directories directly under ``rel`` (empty if it does not exist)."""

    @abstractmethod
    def delete(self, rel: str) -> None:
        """Delete a directory tree or file; nothing happens if it does not exist."""

    @abstractmethod
    def upload(self, source: Path, rel: str) -> None:
        """Copy the files of a local directory into ``rel`` (merging with what is there)."""

    @abstractmethod
    def download(self, rel: str, target: Path) -> None:
        """Copy the directory ``rel`` to a local directory."""


class LocalStorage(RunStorage):
    def __init__(self, root: Path) -> None:
        self.root = root.expanduser().resolve()
        self.uri = str(self.root)

    def local_path(self, rel: str) -> Path:
        return self.root / rel if rel else self.root

    def exists(self, rel: str) -> bool:
        return self.local_path(rel).exists()

    def read_text(self, rel: str) -> str:
        return self.local_path(rel).read_text()

    def write_text(self, rel: str, text: str) -> None:
        path = self.local_path(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, text)

    def append_text(self, rel: str, text: str) -> None:
        path = self.local_path(rel)
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a") as handle:
            handle.write(text)

    def list_dirs(self, rel: str) -> list[str]:
        path = self.local_path(rel)
        if not path.is_dir():
            return []
        return sorted(p.name for p in path.iterdir() if p.is_dir())

    def delete(self, rel: str) -> None:
        path = self.local_path(rel)
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()

    def upload(self, source: Path, rel: str) -> None:
        shutil.copytree(source, self.local_path(rel), dirs_exist_ok=True)

    def download(self, rel: str, target: Path) -> None:
        shutil.copytree(self.local_path(rel), target, dirs_exist_ok=True)


_VERBS = {
    "exists": "reach",
    "read_text": "read",
    "write_text": "write",
    "list_dirs": "list",
    "delete": "delete",
    "upload": "upload to",
    "download": "download",
}


def _s3_errors(method: Callable[..., T]) -> Callable[..., T]:
    """Turn pyarrow's S3 errors (after its own retries) into one clear ``StorageError``."""

    @functools.wraps(method)
    def wrapper(self: S3Storage, rel: Any, *args: Any) -> T:
        try:
            return method(self, rel, *args)
        except FileNotFoundError:
            raise
        except OSError as exc:
            target = f"{self.uri}/{args[0] if isinstance(rel, Path) else rel}"
            endpoint = os.environ.get("AWS_ENDPOINT_URL", "AWS's default endpoint")
            detail = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
            raise StorageError(
                f"{_VERBS[method.__name__]} {target}",
                detail,
                f"check that the S3 endpoint ({endpoint}) is reachable and the credentials "
                "can write there",
            ) from None

    return wrapper


class S3Storage(RunStorage):
    """``s3://bucket/prefix`` through pyarrow's S3 file system."""

    def __init__(self, uri: str) -> None:
        import pyarrow.fs as pafs  # 0.3 s to import: only s3:// storage needs it

        self.uri = uri.rstrip("/")
        self._pafs = pafs
        try:
            fs, path = pafs.FileSystem.from_uri(self.uri)
        except (OSError, ValueError) as exc:
            raise StorageError(f"open {self.uri}", str(exc), "check the URI") from None
        self.fs: Any = fs
        self.root: str = path

    def _path(self, rel: str) -> str:
        return f"{self.root}/{rel}" if rel else self.root

    def local_path(self, rel: str) -> None:
        return None

    @_s3_errors
    def exists(self, rel: str) -> bool:
        info = self.fs.get_file_info(self._path(rel))
        return bool(info.type != self._pafs.FileType.NotFound)

    @_s3_errors
    def read_text(self, rel: str) -> str:
        path = self._path(rel)
        if not self.exists(rel):
            raise FileNotFoundError(f"{self.uri}/{rel}")
        with self.fs.open_input_stream(path) as stream:
            return bytes(stream.read()).decode()

    @_s3_errors
    def write_text(self, rel: str, text: str) -> None:
        # One PUT: S3 makes an object visible whole or not at all.
        with self.fs.open_output_stream(self._path(rel)) as stream:
            stream.write(text.encode())

    def append_text(self, rel: str, text: str) -> None:
        # S3 objects cannot be appended to; rewrite (run logs are small).
        existing = self.read_text(rel) if self.exists(rel) else ""
        self.write_text(rel, existing + text)

    @_s3_errors
    def list_dirs(self, rel: str) -> list[str]:
        selector = self._pafs.FileSelector(self._path(rel), allow_not_found=True)
        infos = self.fs.get_file_info(selector)
        return sorted(i.base_name for i in infos if i.type == self._pafs.FileType.Directory)

    @_s3_errors
    def delete(self, rel: str) -> None:
        path = self._path(rel)
        info = self.fs.get_file_info(path)
        if info.type == self._pafs.FileType.Directory:
            self.fs.delete_dir(path)
        elif info.type == self._pafs.FileType.File:
            self.fs.delete_file(path)

    @_s3_errors
    def upload(self, source: Path, rel: str) -> None:
        self._pafs.copy_files(
            str(source),
            self._path(rel),
            source_filesystem=self._pafs.LocalFileSystem(),
            destination_filesystem=self.fs,
        )

    @_s3_errors
    def download(self, rel: str, target: Path) -> None:
        target.mkdir(parents=True, exist_ok=True)
        self._pafs.copy_files(
            self._path(rel),
            str(target),
            source_filesystem=self.fs,
            destination_filesystem=self._pafs.LocalFileSystem(),
        )


def atomic_write(path: Path, text: str) -> None:
    """Write to a temporary sibling and rename, so readers never see half a file."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(text)
    tmp.replace(path)


def check_writable_dir(path: str, flag: str, shown: str | None = None) -> None:
    """Refuse a local folder that is a file or cannot be created (its nearest existing
    ancestor is not a writable folder), creating nothing; ``s3://`` is not checked here.
    The error names ``flag`` and ``shown`` (default ``path``)."""
    shown = path if shown is None else shown
    if path.startswith("s3://"):
        return
    target = Path(path).expanduser()
    if target.exists() and not target.is_dir():
        raise ConfigError(flag, shown, f"a folder ({path} is a file)")
    missing = []
    existing = target
    while not existing.exists():
        missing.append(existing)
        existing = existing.parent
    problem = None
    if not existing.is_dir() or not os.access(existing, os.W_OK | os.X_OK):
        problem = f"{existing} is not a writable folder"
    else:
        try:  # make the missing folders, then take them away again: nothing is left behind
            for folder in reversed(missing):
                folder.mkdir()
        except OSError as exc:
            problem = f"cannot create {folder}: {exc.strerror or exc}"
        finally:
            for folder in missing:
                if folder.is_dir():
                    folder.rmdir()
    if problem:
        raise ConfigError(flag, shown, f"a folder that can be created or written ({problem})")
