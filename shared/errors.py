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
