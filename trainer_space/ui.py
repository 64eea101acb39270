"""The trainer Space's page: start and stop a run, or attach to one; watch it live.

Gradio's own components only (``gr.LinePlot`` fed by a ``gr.Timer``). Everything shown comes
from :class:`trainer_space.monitor.Monitor`, so a run started here and a run of any other trainer
(attached by its store and replica URLs) look the same.
"""

from __future__ import annotations

import logging
import threading
import traceback
from dataclasses import dataclass, field

import gradio as gr
import pandas as pd

from shared.access import token_ok

from .monitor import Monitor
from .train import RunSettings, run

log = logging.getLogger("trainer_space.ui")


@dataclass
class Session:
    """The one run a trainer process holds (a Space runs one trainer)."""

    defaults: RunSettings
    token: str | None = None  # required for Start/Stop when set
    monitor: Monitor | None = None
    thread: threading.Thread | None = None
    stop_event: threading.Event = field(default_factory=threading.Event)
    status: str = "idle"

    def running(self) -> bool:
        return self.thread is not None and self.thread.is_alive()

    def authorized(self, given: str) -> bool:
        return not self.token or token_ok(given, self.token)

    def start(self, settings: RunSettings) -> str:
        if self.running():
            return "A run is already going; stop it first."
        self.monitor = Monitor(settings.store, settings.replicas, settings.env_url)
        self.stop_event = threading.Event()
        self.status = f"running: {settings.max_steps} steps of {settings.model}"

        def target() -> None:
            try:
                run(settings, self.monitor, self.stop_event)
                self.status = "stopped" if self.stop_event.is_set() else "finished"
            except Exception as e:  # noqa: BLE001 - shown on the page, and logged
                log.exception("the run failed")
                self.status = f"failed: {type(e).__name__}: {e}"
                traceback.print_exc()

        self.thread = threading.Thread(target=target, name="trainer-run", daemon=True)
        self.thread.start()
        return self.status

    def attach(self, store: str, replicas: list[str], env_url: str | None) -> str:
        if self.running():
            return "A run is going here; its monitor stays."
        self.monitor = Monitor(store or None, replicas, env_url or None)
        self.status = f"attached to {store or 'no store'} and {len(replicas)} replica(s)"
        return self.status


def _urls(text: str) -> list[str]:
    return [u.strip() for u in (text or "").replace("\n", ",").split(",") if u.strip()]


def frames(monitor: Monitor | None) -> dict[str, pd.DataFrame | None]:
    """The plots' data, long format (x, y, series); None where there is nothing to draw yet.

    A plot must not be sent an empty frame: Gradio then types the ``series`` column as a
    number and keeps drawing every later frame without its lines.
    """
    keys = ("train", "bytes", "changed", "times", "behind", "env")
    if monitor is None:
        return dict.fromkeys(keys)
    monitor.refresh()
    rows = monitor.rows()

    def frame(data: list[dict]) -> pd.DataFrame | None:
        return pd.DataFrame(data) if data else None

    def long(items, x, series: dict[str, str], scale: float = 1.0) -> pd.DataFrame | None:
        return frame([{"x": r[x], "y": r[k] * scale, "series": name} for r in items
                      for k, name in series.items() if r.get(k) is not None])

    deltas = [r for r in rows if r["version"] > 0]
    latest = max((r["version"] for r in rows), default=0)
    return {
        "train": long(monitor.step_logs(), "step", {"reward": "reward", "loss": "loss"}),
        "bytes": long(deltas, "version", {"payload_bytes": "deltasync", "dense_bytes": "dense bf16",
                                          "int32_bf16_bytes": "int32 + bf16"}),
        "changed": long(deltas, "version", {"changed_fraction": "changed %"}, 100.0),
        "times": long(deltas, "version", {"encode_s": "encode", "encoder_s": "encoder thread",
                                          "upload_s": "upload", "stage_s": "stage", "pause_s": "pause"}, 1e3),
        "behind": frame([{"x": v.url, "y": latest - (v.version or 0), "series": v.status}
                         for v in monitor.replica_views()]),
        "env": frame([{"x": k.replace("_", " "), "y": v, "series": "env"} for k, v in monitor.env_stats.items()]),
    }


def version_table(monitor: Monitor | None) -> pd.DataFrame:
    cols = ["version", "kind", "changed %", "payload B", "dense B", "state digest", "served exactly by", "exact"]
    if monitor is None:
        return pd.DataFrame(columns=cols)
    out = []
    for r in reversed(monitor.rows()):
        out.append([r["version"], r["kind"], round(100 * r["changed_fraction"], 3), r["payload_bytes"],
                    r["dense_bytes"], r["state_digest"][:16] or f"fingerprint {r['state_fingerprint'][:16]}",
                    ", ".join(u for u, d in r["live"].items() if d == r["identity"]),
                    {True: "exact", False: "MISMATCH", None: "not checked"}[r["exact"]]])
    return pd.DataFrame(out, columns=cols)


def replica_table(monitor: Monitor | None) -> str:
    if monitor is None or not monitor.replicas:
        return "No replicas yet: start a run or attach."
    lines = ["| replica | status | version | metrics |", "|---|---|---|---|"]
    for v in monitor.replica_views():
        lines.append(f"| {v.url} | {v.status} | {v.version if v.version is not None else '-'} | "
                     f"[/metrics]({v.url}/metrics) |")
    return "\n".join(lines)


def build(session: Session) -> gr.Blocks:
    d = session.defaults
    with gr.Blocks(title="DeltaSync trainer") as page:
        gr.Markdown("# DeltaSync trainer\nTRL's AsyncGRPOTrainer plays Wordle; every weight sync ships as an "
                    "exact bf16 delta through the bucket, and each replica's live weights are checked.")
        with gr.Row():
            with gr.Column(scale=2):
                with gr.Tab("Run"):
                    model = gr.Textbox(d.model, label="model (the replicas serve the same)")
                    store = gr.Textbox(d.store, label="store")
                    replicas = gr.Textbox(", ".join(d.replicas), label="replica URLs")
                    env_url = gr.Textbox(d.env_url, label="env URL")
                    with gr.Row():
                        steps = gr.Number(d.max_steps, label="optimizer steps", precision=0, minimum=1)
                        lr = gr.Number(d.learning_rate, label="learning rate")
                        gens = gr.Number(d.num_generations, label="generations per prompt", precision=0, minimum=2)
                    token = gr.Textbox("", label="trainer token (needed when the Space sets one)", type="password")
                    with gr.Row():
                        start = gr.Button("Start", variant="primary", elem_id="start")
                        stop = gr.Button("Stop", variant="stop", elem_id="stop")
                with gr.Tab("Attach"):
                    a_store = gr.Textbox(d.store, label="store of a run started elsewhere")
                    a_replicas = gr.Textbox(", ".join(d.replicas), label="replica URLs")
                    a_env = gr.Textbox(d.env_url, label="env URL (optional)")
                    attach = gr.Button("Attach", elem_id="attach")
            with gr.Column(scale=3):
                status = gr.Markdown(f"**status:** {session.status}", elem_id="status")
                # The answer to this visitor's last click; the timer only rewrites the shared status.
                notice = gr.Markdown("", elem_id="notice")
                replica_md = gr.Markdown(replica_table(session.monitor), elem_id="replicas")
        with gr.Row():
            train_plot = gr.LinePlot(x="x", y="y", color="series", title="reward and loss per step",
                                     x_title="step", elem_id="plot-train")
            bytes_plot = gr.LinePlot(x="x", y="y", color="series", title="bytes per version",
                                     x_title="version", y_title="bytes", elem_id="plot-bytes")
            changed_plot = gr.LinePlot(x="x", y="y", color="series", title="weights changed",
                                       x_title="version", y_title="%", elem_id="plot-changed")
        with gr.Row():
            times_plot = gr.LinePlot(x="x", y="y", color="series",
                                     title="encode (loop held) / encoder thread / upload / stage / pause",
                                     x_title="version", y_title="ms", elem_id="plot-times")
            behind_plot = gr.BarPlot(x="x", y="y", color="series", title="versions behind, per replica",
                                     x_title="replica", elem_id="plot-behind")
            env_plot = gr.BarPlot(x="x", y="y", color="series", title="Wordle games (env)", elem_id="plot-env")
        table = gr.Dataframe(version_table(session.monitor), label="versions", elem_id="versions",
                             interactive=False)

        def on_start(model, store, replicas, env_url, steps, lr, gens, token):
            if not session.authorized(token):
                return "refused: wrong or missing trainer token"
            try:
                settings = d.model_copy(update=dict(model=model, store=store, replicas=_urls(replicas),
                                                    env_url=env_url, max_steps=int(steps), learning_rate=float(lr),
                                                    num_generations=int(gens)))
                settings = RunSettings.model_validate(settings.model_dump())
            except Exception as e:  # noqa: BLE001 - a form error, shown
                return f"refused: {e}"
            return session.start(settings)

        def on_stop(token):
            if not session.authorized(token):
                return "refused: wrong or missing trainer token"
            session.stop_event.set()
            return "stopping after the current step"

        def on_attach(store, replicas, env_url):
            return session.attach(store, _urls(replicas), env_url)

        def tick():
            plots = [gr.skip() if df is None else df for df in frames(session.monitor).values()]
            return (f"**status:** {session.status}", replica_table(session.monitor), *plots,
                    version_table(session.monitor))

        start.click(on_start, [model, store, replicas, env_url, steps, lr, gens, token], notice)
        stop.click(on_stop, [token], notice)
        attach.click(on_attach, [a_store, a_replicas, a_env], notice)
        gr.Timer(1.0).tick(tick, None, [status, replica_md, train_plot, bytes_plot, changed_plot, times_plot,
                                        behind_plot, env_plot, table])
    return page
