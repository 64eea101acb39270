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
        os.replace(self._local_tmp(path, data), path)  # atomic: a reader sees the old object or the whole new one

    def _local_tmp(self, path: str, data: bytes | str | Path) -> str:
        """A complete, synced copy of ``data`` beside ``path``, under a temporary name."""
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.tmp-{uuid.uuid4().hex}"
        if isinstance(data, bytes):
            with open(tmp, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        else:
            self.fs.copy(str(data), tmp)
        return tmp

    def create(self, key: str, data: bytes) -> bool:
        """Write ``key`` only if it does not exist yet; False when it does.

        Exclusive on a local folder (a hard link of a complete temporary file) and on S3
        (``If-None-Match: *``). Hub buckets offer no conditional write, so there this is check,
        write, read back: two writers racing within one round trip can both succeed.
        """
        path = self.path(key)
        if self.local:
            tmp = self._local_tmp(path, data)
            try:
                os.link(tmp, path)
                return True
            except FileExistsError:
                return False
            except OSError:  # a filesystem without hard links: exclusive, not atomic for readers
                try:
                    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
                except FileExistsError:
                    return False
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                return True
            finally:
                os.unlink(tmp)
        if self.uri.startswith("s3://"):
            try:
                self.fs.pipe_file(path, data, mode="create")
                return True
            except FileExistsError:
                return False
        if self.exists(key):
            return False
        self.put(key, data)
        return self.get(key) == data

    def exists(self, key: str) -> bool:
        self._fresh(key)
        return self.fs.exists(self.path(key))

    def list(self, prefix: str, *, include_tmp: bool = False) -> list[str]:
        """Keys directly below ``prefix`` (a folder; ``""`` is the root), sorted; temporary uploads only if asked."""
        self._fresh(prefix)
        try:
            names = self.fs.ls(self.path(prefix), detail=False)
        except FileNotFoundError:
            return []
        keys = [n.rstrip("/").rsplit("/", 1)[-1] for n in names]
        return sorted(f"{prefix}/{k}" if prefix else k for k in keys if include_tmp or ".tmp-" not in k)

    def delete(self, key: str) -> None:
        try:
            self.fs.rm_file(self.path(key))
        except FileNotFoundError:
            pass


def open_store(uri: str | Path, *, create: bool = True, **storage_options: Any) -> Store:
    """``/some/dir`` or ``file://``, ``hf://buckets/ns/name[/prefix]``, ``s3://bucket/prefix``.

    For ``hf://`` the token comes from ``storage_options['token']`` or the usual HF_TOKEN; for
    ``s3://`` options such as ``endpoint_url`` go to s3fs (``client_kwargs``).

    ``create=False`` (readers) creates nothing: a local folder that does not exist, or a remote
    prefix that holds nothing, is a :class:`StoreError` ("no store at ..."), and a remote store is
    reached once here, so missing credentials or no network fail now, in one line. A missing
    fsspec backend or an unknown scheme is a :class:`StoreError` either way.
    """
    from .errors import StoreError, store_error

    def _local(uri: str, root: str, create: bool) -> Store:
        path = Path(root)
        if create:
            path.mkdir(parents=True, exist_ok=True)
        elif not path.is_dir():
            what = "a file, not a store folder" if path.exists() else "no such folder"
            raise StoreError(f"no store at {uri}: {what} (check the path; `deltasync push` starts a chain)")
        return Store(LocalFileSystem(), str(path.resolve()), uri)

    uri = str(uri)
    if "://" not in uri:
        return _local(uri, str(Path(uri)), create)
    if uri.startswith("hf://") and not uri.startswith("hf://buckets/"):
        raise StoreError(f"{uri}: hf:// stores must be Storage Buckets: hf://buckets/<namespace>/<name>[/prefix]")
    try:
        fs, root = fsspec.url_to_fs(uri, **storage_options)
    except ValueError as e:
        if "Protocol not known" not in str(e):
            raise
        scheme = uri.split("://", 1)[0]
        raise StoreError(f"{uri}: unknown store scheme {scheme}://; a store is a folder, "
                         "hf://buckets/<namespace>/<name>[/prefix] or s3://<bucket>[/prefix]") from None
    except ImportError as e:
        raise store_error(uri, e) from None
    if isinstance(fs, LocalFileSystem):
        return _local(uri, root, create)
    if not create:
        try:
            fs.info(root)  # not exists(), which reads "offline" or "no credentials" as "not there"
        except FileNotFoundError:
            raise StoreError(f"no store at {uri}: nothing is stored there (check the URI; "
                             "`deltasync push` starts a chain)") from None
        except Exception as e:  # credentials, network
            if (err := store_error(uri, e)) is not None:
                raise err from None
            raise
    return Store(fs, root, uri)
