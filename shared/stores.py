"""Object stores for version chains: one class over fsspec serves a local folder (the default),
a Hugging Face Storage Bucket (``hf://buckets/<ns>/<name>/<prefix>``) and S3 (``s3://``).

The chain needs only whole-object put/get/list/delete, and readers must never see a half-written
object: local writes go to a temporary name and are renamed into place; S3 and bucket uploads are
atomic per object. Listings of remote stores are cached by fsspec, so reads invalidate first.
"""

from __future__ import annotations

import os
import uuid
from pathlib import Path
from typing import Any

import fsspec
from fsspec.implementations.local import LocalFileSystem

from .errors import DeltaError


class Store:
    """Keys are ``/``-separated paths below the store's root."""

    def __init__(self, fs: fsspec.AbstractFileSystem, root: str, uri: str):
        self.fs, self.root, self.uri = fs, root.rstrip("/"), uri
        self.local = isinstance(fs, LocalFileSystem)

    def __repr__(self) -> str:
        return f"Store({self.uri!r})"

    def path(self, key: str) -> str:
        return f"{self.root}/{key}" if key else self.root

    def _fresh(self, key: str) -> None:
        if not self.local:
            self.fs.invalidate_cache(self.path(key))

    def get(self, key: str) -> bytes:
        self._fresh(key)
        try:
            return self.fs.cat_file(self.path(key))
        except FileNotFoundError:
            raise DeltaError("missing", f"{self.uri}: no object {key!r}") from None

    def download(self, key: str, dest: str | Path) -> Path:
        self._fresh(key)
        try:
            self.fs.get_file(self.path(key), str(dest))
        except FileNotFoundError:
            raise DeltaError("missing", f"{self.uri}: no object {key!r}") from None
        return Path(dest)

    def put(self, key: str, data: bytes | str | Path) -> None:
        path = self.path(key)
        if not self.local:
            if isinstance(data, bytes):
                self.fs.pipe_file(path, data)
            else:
                self.fs.put_file(str(data), path)
            return
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        if isinstance(data, bytes):
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        else:
            self.fs.copy(str(data), tmp)
        os.replace(tmp, path)  # atomic: a reader sees the old object or the whole new one

    def exists(self, key: str) -> bool:
        self._fresh(key)
        return self.fs.exists(self.path(key))

    def list(self, prefix: str) -> list[str]:
        """Keys directly below ``prefix`` (a folder), sorted; temporary uploads excluded."""
        self._fresh(prefix)
        try:
            names = self.fs.ls(self.path(prefix), detail=False)
        except FileNotFoundError:
            return []
        keys = [n.rstrip("/").rsplit("/", 1)[-1] for n in names]
        return sorted(f"{prefix}/{k}" for k in keys if ".tmp-" not in k)

    def delete(self, key: str) -> None:
        try:
            self.fs.rm_file(self.path(key))
        except FileNotFoundError:
            pass


def open_store(uri: str | Path, **storage_options: Any) -> Store:
    """``/some/dir`` or ``file://``, ``hf://buckets/ns/name[/prefix]``, ``s3://bucket/prefix``.

    For ``hf://`` the token comes from ``storage_options['token']`` or the usual HF_TOKEN; for
    ``s3://`` options such as ``endpoint_url`` go to s3fs (``client_kwargs``).
    """
    uri = str(uri)
    if "://" not in uri:
        Path(uri).mkdir(parents=True, exist_ok=True)
        return Store(LocalFileSystem(), str(Path(uri).resolve()), uri)
    if uri.startswith("hf://") and not uri.startswith("hf://buckets/"):
        raise ValueError("hf:// stores must be Storage Buckets: hf://buckets/<namespace>/<name>[/prefix]")
    fs, root = fsspec.url_to_fs(uri, **storage_options)
    if isinstance(fs, LocalFileSystem):
        Path(root).mkdir(parents=True, exist_ok=True)
    return Store(fs, root, uri)
