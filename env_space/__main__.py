"""Serve the Wordle environment over the OpenEnv protocol: a /ws WebSocket session per game,
the HTTP /reset and /step routes, /health, and a Gradio page at /web.

Example: python -m env_space --port 7860 --max-sessions 64
"""

from __future__ import annotations

import argparse
import os

from pydantic import ValidationError

from env_space.server import ServerSettings


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    defaults = ServerSettings()
    p = argparse.ArgumentParser(prog="python -m env_space", description=__doc__,
                                formatter_class=_Formatter)
    p.add_argument("--host", default=os.environ.get("HOST", "0.0.0.0"),
                   help="address to listen on (env HOST; 0.0.0.0 is every interface)")
    p.add_argument("--port", type=int, default=int(os.environ.get("PORT", "7860")),
                   help="port to listen on (env PORT; Spaces route 7860)")
    p.add_argument("--max-sessions", type=int, default=defaults.max_sessions,
                   help="cap on live sessions, WebSocket and HTTP together")
    p.add_argument("--session-timeout", type=float, default=defaults.session_timeout_s,
                   help="seconds of inactivity after which a session is reaped")
    p.add_argument("--max-body-bytes", type=int, default=defaults.max_body_bytes,
                   help="largest HTTP request body / WebSocket message accepted")
    p.add_argument("--max-invalid-moves", type=int, default=defaults.max_invalid_moves,
                   help="invalid moves after which a game ends")
    p.add_argument("--no-web", action="store_true",
                   help="do not mount the Gradio page at /web (default: mounted)")
    p.add_argument("--log-level", default="info", choices=["critical", "error", "warning", "info", "debug"],
                   help="uvicorn log level; debug also logs every request")
    return p.parse_args(argv)


class _Formatter(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option's help ends with its default (flags say theirs in words)."""

    def _get_help_string(self, action):
        if isinstance(action, argparse._StoreTrueAction | argparse._HelpAction):
            return action.help
        return super()._get_help_string(action)


def main(argv: list[str] | None = None) -> None:
    args = parse_args(argv)
    try:
        settings = ServerSettings(
            max_sessions=args.max_sessions,
            session_timeout_s=args.session_timeout,
            max_body_bytes=args.max_body_bytes,
            max_invalid_moves=args.max_invalid_moves,
            enable_web=not args.no_web,
        )
    except ValidationError as exc:
        raise SystemExit(f"python -m env_space: invalid option: {exc}") from None
    # Gradio must not phone home from a Space or a sandbox.
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")

    import uvicorn

    from env_space.server import create_app

    uvicorn.run(
        create_app(settings),
        host=args.host,
        port=args.port,
        log_level=args.log_level,
        access_log=args.log_level == "debug",
        ws_max_size=settings.max_body_bytes,
        timeout_graceful_shutdown=5,
    )


if __name__ == "__main__":
    main()
