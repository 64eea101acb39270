"""Who may call a server: the loopback rule and bearer-token checks every Space uses.

A server reachable from other machines must not be open by default: bound to anything but a
loopback address, a Space refuses to start without its token unless the operator says
``--insecure-no-token``. Tokens are compared in constant time and never logged.
"""

from __future__ import annotations

import hashlib
import hmac

LOOPBACK_HOSTS = frozenset({"127.0.0.1", "localhost", "::1"})


def is_loopback(host: str | None) -> bool:
    """True for an address only this machine can reach. ``None`` or ``""`` (as uvicorn and
    vLLM's ``--host`` default mean it) is every interface, so not loopback."""
    return bool(host) and host.strip("[]").lower() in LOOPBACK_HOSTS  # type: ignore[union-attr]


def open_without_token(host: str | None, token: str | None, insecure: bool) -> bool:
    """True when a server on ``host`` would let anyone reach what the token should guard:
    a public address, no token, and no explicit ``--insecure-no-token``."""
    return not token and not insecure and not is_loopback(host)


def token_ok(given: str | None, token: str) -> bool:
    """``given == token`` in constant time (also in the lengths: both sides are hashed first)."""
    a = hashlib.sha256((given or "").encode()).digest()
    b = hashlib.sha256(token.encode()).digest()
    return hmac.compare_digest(a, b)


def bearer_ok(header_value: str | None, token: str | None) -> bool:
    """Whether an ``Authorization`` header carries ``Bearer <token>``; with no token configured
    every caller passes (a loopback server, or one started with ``--insecure-no-token``)."""
    if not token:
        return True
    scheme, _, given = (header_value or "").partition(" ")
    return token_ok(given.strip() if scheme.lower() == "bearer" else "", token)
