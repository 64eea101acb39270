"""``python -m trainer_space``: the trainer Space (monitoring UI + training job).

    python -m trainer_space [--host H] [--port 7860]
        The Space's entry: the Gradio page. Run defaults come from the environment a Space sets:
        DELTASYNC_MODEL, DELTASYNC_STORE, DELTASYNC_REPLICAS (comma-separated), DELTASYNC_ENV_URL,
        DELTASYNC_TOKEN (the replicas' update token), DELTASYNC_API_KEY (their --api-key for /v1/*),
        DELTASYNC_OUTPUT_DIR, DELTASYNC_DIGESTS, DELTASYNC_COPY_FROM and
        DELTASYNC_TRAINER_TOKEN (asked for by Start and Stop; when unset, DELTASYNC_TOKEN is).

    python -m trainer_space --local --max-steps N --run-dir DIR [--ui]
        The embedded defaults: builds a small Wordle policy in DIR/model, starts the env Space
        and one rollout Space (vLLM on CPU) as child processes with DIR/bucket as the store,
        trains N optimizer steps, prints one row per version and writes DIR/report.json and
        DIR/report.png. With --ui the page is served while it trains.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import sys
import threading
from pathlib import Path

from rich.console import Console
from rich.table import Table

from shared.access import open_without_token
from shared.spaces import space_setting
from shared.warmup import warm_in_background

from .monitor import Monitor
from .train import RunSettings, run


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(prog="python -m trainer_space", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--host", default=os.environ.get("HOST", "0.0.0.0"))
    ap.add_argument("--port", type=int, default=int(os.environ.get("PORT", "7860")))
    ap.add_argument("--local", action="store_true", help="run the embedded defaults (see above)")
    ap.add_argument("--ui", action="store_true", help="with --local: serve the page while training")
    ap.add_argument("--max-steps", type=int, default=10)
    ap.add_argument("--run-dir", type=Path, default=Path("runs/trainer"))
    ap.add_argument("--learning-rate", type=float, default=3e-6)
    ap.add_argument("--insecure-no-token", action="store_true",
                    help="serve the page on a public address without a token for Start and Stop")
    return ap.parse_args(argv)


def serve(settings: RunSettings, host: str, port: int, *, token: str | None, monitor: Monitor | None = None,
          block: bool = True):
    """The page at ``/`` and ``GET /health`` (for a Space's HEALTHCHECK and for tests) on one port."""
    import gradio as gr
    import uvicorn
    from fastapi import FastAPI

    from .ui import Session, build

    session = Session(settings, token=token, monitor=monitor)
    if monitor is not None:
        session.status = "running (started from the command line)"
    app = FastAPI(title="DeltaSync trainer")

    @app.get("/health")
    def health() -> dict:
        return {"status": "ok", "run": session.status}

    app = gr.mount_gradio_app(app, build(session).queue(), path="/")
    server = uvicorn.Server(uvicorn.Config(app, host=host, port=port, log_level="warning"))
    if block:
        server.run()
    else:
        threading.Thread(target=server.run, name="trainer-ui", daemon=True).start()
    return session


def space_defaults() -> RunSettings:
    """Run defaults from the Space's variables; inside a Space, unset ones come from its own id."""
    env = os.environ

    def setting(key: str) -> str:
        return space_setting("trainer", key) or ""

    return RunSettings(model=env.get("DELTASYNC_MODEL", "Qwen/Qwen3-0.6B"),
                       store=setting("DELTASYNC_STORE"),
                       replicas=[u for u in setting("DELTASYNC_REPLICAS").split(",") if u],
                       env_url=setting("DELTASYNC_ENV_URL"),
                       token=env.get("DELTASYNC_TOKEN"), api_key=env.get("DELTASYNC_API_KEY"),
                       output_dir=env.get("DELTASYNC_OUTPUT_DIR", "runs/trainer"),
                       digests=env.get("DELTASYNC_DIGESTS", "every"),
                       **({"copy_from": env["DELTASYNC_COPY_FROM"]} if env.get("DELTASYNC_COPY_FROM") else {}))


def print_rows(console: Console, rows: list[dict]) -> None:
    table = Table(title="one row per version: every replica must serve exactly the trainer's weights")
    for col in ("version", "reward", "changed", "payload B", "dense B", "encode ms", "pause ms", "games", "exact"):
        table.add_column(col, justify="right")
    def fmt(value, spec: str, scale: float = 1.0) -> str:
        return "-" if value is None else format(value * scale, spec)

    for r in rows:
        table.add_row(str(r["version"]), fmt(r["reward"], ".3f"), f"{r['changed_fraction']:.2%}",
                      f"{r['payload_bytes']:,}", f"{r['dense_bytes']:,}", fmt(r["encode_s"], ".1f", 1e3),
                      fmt(r["pause_s"], ".1f", 1e3), fmt(r["games"], ".0f"),
                      {True: "[green]exact[/]", False: "[red]MISMATCH[/]", None: "-"}[r["exact"]])
    console.print(table)


def report(run_dir: Path, monitor: Monitor, replicas: list[str], timings: list[dict]) -> bool:
    rows = [r for r in monitor.rows() if r["version"] > 0]
    versions = [{"version": r["version"], "trainer_state_digest": r["state_digest"],
                 "trainer_state_fingerprint": r["state_fingerprint"],
                 "replica_state_digests": r["live"], "exact": r["exact"], "payload_bytes": r["payload_bytes"],
                 "dense_bytes": r["dense_bytes"], "int32_bf16_bytes": r["int32_bf16_bytes"],
                 "changed_fraction": r["changed_fraction"], "reward": r["reward"], "loss": r["loss"],
                 "env_games_played": r["games"], "encode_s": r["encode_s"], "upload_s": r["upload_s"],
                 "stage_s": r["stage_s"], "pause_s": r["pause_s"]} for r in rows]
    exact = bool(rows) and all(r["exact"] is True and set(r["live"]) == set(replicas) for r in rows)
    summary = {"exact": exact, "replicas": replicas, "versions": versions, "env": monitor.env_stats,
               "sync_wait_s": [t["wait_s"] for t in timings],
               "median_payload_bytes": statistics.median(r["payload_bytes"] for r in rows) if rows else None}
    (run_dir / "report.json").write_text(json.dumps(summary, indent=1))
    plot(rows, monitor.step_logs(), run_dir / "report.png")
    return exact


def plot(rows: list[dict], steps: list[dict], path: Path) -> None:
    """Bytes per version beside dense and int32+bf16, and reward per step: what a person looks at first."""
    import matplotlib

    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    x = [r["version"] for r in rows]
    for key, label in (("dense_bytes", "dense bf16"), ("int32_bf16_bytes", "int32 + bf16"),
                       ("payload_bytes", "deltasync")):
        ax1.plot(x, [r[key] or float("nan") for r in rows], marker=".", label=label)  # 0 has no log
    ax1.set_yscale("log")
    ax1.set(xlabel="version", ylabel="bytes", title="what each version costs to ship")
    ax1.legend()
    ax2.plot([s["step"] for s in steps], [s.get("reward", float("nan")) for s in steps], marker=".")
    ax2.set(xlabel="optimizer step", ylabel="mean reward", title="Wordle reward (env Space)")
    for ax in (ax1, ax2):
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def run_local(a: argparse.Namespace) -> int:
    from .local import LocalServices, build_policy

    console = Console(width=None if sys.stdout.isatty() else 160)
    run_dir = a.run_dir
    run_dir.mkdir(parents=True, exist_ok=True)
    with console.status("building the local Wordle policy…"):
        model = build_policy(run_dir / "model")
    shutil.rmtree(run_dir / "bucket", ignore_errors=True)
    with console.status("starting the env Space and a vLLM rollout Space (CPU)…"), \
            LocalServices(run_dir, model) as services:
        console.print(f"env {services.env.url}, rollout {services.rollout.url}, bucket {services.store}")
        settings = RunSettings(model=str(model), store=str(services.store), replicas=[services.rollout.url],
                               env_url=services.env.url, token=services.token, api_key=services.api_key,
                               output_dir=str(run_dir),
                               max_steps=a.max_steps, learning_rate=a.learning_rate)
        monitor = Monitor(settings.store, settings.replicas, settings.env_url)
        if a.ui:
            serve(settings, a.host, a.port, token=services.token, monitor=monitor, block=False)
            console.print(f"[bold]monitoring UI:[/] http://{a.host if a.host not in ('0.0.0.0', '') else '127.0.0.1'}:{a.port}")
        transfer = run(settings, monitor, threading.Event())
        monitor.refresh()
    print_rows(console, [r for r in monitor.rows() if r["version"] > 0])
    exact = report(run_dir, monitor, settings.replicas, transfer.timings)
    console.print(("[bold green]every version served bit-exactly[/]" if exact else
                   "[bold red]a version was not served exactly[/]") +
                  f": report in {run_dir / 'report.json'}, plot in {run_dir / 'report.png'}")
    return 0 if exact else 1


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    os.environ.setdefault("GRADIO_ANALYTICS_ENABLED", "False")
    a = parse_args(argv)
    # One secret is enough for a Space: the replicas' update token also guards Start and Stop.
    token = os.environ.get("DELTASYNC_TRAINER_TOKEN") or os.environ.get("DELTASYNC_TOKEN")
    if not a.local and open_without_token(a.host, token, a.insecure_no_token):
        print(f"python -m trainer_space: refusing to serve on {a.host} without DELTASYNC_TOKEN or "
              "DELTASYNC_TRAINER_TOKEN (anyone could start or stop runs); set one, or pass --insecure-no-token",
              file=sys.stderr)
        return 2
    warm_in_background()  # so that the first publish() finds the numba kernels compiled
    if a.local:
        return run_local(a)
    serve(space_defaults(), a.host, a.port, token=token)
    return 0


if __name__ == "__main__":
    sys.exit(main())
