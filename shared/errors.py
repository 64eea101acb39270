"""Why a delta was refused. The reason codes are stable: they label metrics and HTTP bodies."""

from __future__ import annotations

from typing import Literal

Reason = Literal[
    "format",  # not a deltasync file, bad header, unknown version of the format
    "corrupt",  # a blob's bytes do not match their recorded digest, or fail to decode
    "wrong_base",  # the declared base commitment is not the one held
    "out_of_order",  # the declared base version is not the one held
    "digest_mismatch",  # the result of applying does not match the declared digest
    "missing",  # an object the chain names is not in the store
    "shape_mismatch",  # the delta names tensors, shapes or dtypes the target does not have
    "locked",  # the store has another writer (or this writer lost its lock)
    "conflict",  # the store already holds this version with other contents: another writer or an unfinished publish
]


class DeltaError(Exception):
    """A delta or chain object that cannot be applied; nothing was changed."""

    def __init__(self, reason: Reason, message: str):
        super().__init__(f"{reason}: {message}")
        self.reason: Reason = reason
        self.message = message


class StoreError(ValueError):
    """A store that cannot be opened or reached. The message is one line that says what is wrong
    and what to do (install a package, set credentials, check the path or the network)."""


# fsspec protocols whose filesystem lives in a separate package
_PACKAGES = {"gs": "gcsfs", "gcs": "gcsfs", "s3": "s3fs", "s3a": "s3fs", "az": "adlfs", "abfs": "adlfs",
             "abfss": "adlfs", "hf": "huggingface_hub", "sftp": "paramiko", "ssh": "paramiko"}
_NETWORK = {"ConnectError", "ConnectTimeout", "ReadTimeout", "EndpointConnectionError", "ConnectionError",
            "ConnectTimeoutError", "ConnectionRefusedError", "OfflineModeIsEnabled", "ClientConnectorError",
            "NameResolutionError", "gaierror"}
_CREDENTIALS = {"NoCredentialsError", "PartialCredentialsError", "InvalidAccessKeyId", "SignatureDoesNotMatch",
                "ExpiredToken", "TokenRetrievalError", "UnauthorizedSSOTokenError"}


def _names(e: BaseException) -> set[str]:
    return {c.__name__ for c in type(e).__mro__}


def first_line(e: BaseException) -> str:
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def credentials_hint(scheme: str) -> str:
    if scheme == "s3":
        return ("set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY (or AWS_PROFILE, ~/.aws/credentials; "
                "AWS_ENDPOINT_URL for S3-compatible services)")
    if scheme == "hf":
        return "set HF_TOKEN or run `hf auth login` (a token with access to the bucket)"
    return "check the credentials for this store"


def store_error(uri: str, e: BaseException) -> StoreError | None:
    """A one-line :class:`StoreError` for the usual ways of failing to reach a store (a missing
    fsspec backend, no credentials, no network), or None when ``e`` is none of them."""
    scheme = uri.split("://", 1)[0].lower() if "://" in uri else "file"
    names = _names(e)
    if isinstance(e, StoreError):
        return e
    if isinstance(e, ImportError):
        package = _PACKAGES.get(scheme) or getattr(e, "name", None) or "the package it names"
        return StoreError(f"{uri}: {scheme}:// stores need {package}, which is not installed: "
                          f"pip install {package}")
    if names & _CREDENTIALS:
        return StoreError(f"{uri}: no usable credentials ({first_line(e)}): {credentials_hint(scheme)}")
    response = getattr(e, "response", None)
    status = getattr(response, "status_code", None)  # httpx / requests (the Hub)
    code = response.get("Error", {}).get("Code", "") if isinstance(response, dict) else ""  # botocore
    if status in (401, 403) or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch") \
            or (isinstance(e, PermissionError) and scheme != "file"):
        return StoreError(f"{uri}: access denied ({first_line(e)}): {credentials_hint(scheme)}")
    if names & _NETWORK or (isinstance(e, OSError) and not isinstance(e, FileNotFoundError | PermissionError)
                            and scheme in ("hf", "s3", "gs", "gcs", "http", "https")):
        where, check = {"hf": ("the Hugging Face Hub", "the network, HF_ENDPOINT, and that HF_HUB_OFFLINE "
                                                      "is unset"),
                        "s3": ("S3", "the network and AWS_ENDPOINT_URL")}.get(scheme, ("the store", "the network"))
        return StoreError(f"{uri}: cannot reach {where} ({first_line(e)}): check {check}")
    return None
