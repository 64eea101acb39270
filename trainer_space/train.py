"""The training job: trl's AsyncGRPOTrainer plays Wordle on the env Space, samples from the
rollout Spaces, and ships every weight sync as an exact delta through the store.

``run(settings, monitor)`` is what both entry points call: the embedded-default command line
(``python -m trainer_space --local``) and the Start button of the monitoring UI.
"""

from __future__ import annotations

import functools
import logging
import threading
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, Field

from shared.publisher import BUSY_FRACTION

from . import cpu_shims
from .monitor import Monitor
from .relay import AuthRelay
from .transfer import DeltaSyncTransfer
from .wordle import PROMPT, WordleGame

log = logging.getLogger("trainer_space.train")


class RunSettings(BaseModel):
    """A run's main settings: what the UI's form and the command line set."""

    model: str = Field(description="checkpoint folder or Hub id; the replicas must serve the same one")
    store: str = Field(description="where versions land: a folder, hf://buckets/ns/name/prefix, s3://...")
    replicas: list[str] = Field(description="rollout Space URLs; the first one also serves generation")
    env_url: str = Field(description="Wordle env Space URL")
    token: str | None = Field(default=None, description="the replicas' update token")
    api_key: str | None = Field(default=None, description="the rollout Space's --api-key, which guards /v1/*; "
                                "trl reaches it through a loopback relay that adds it")
    output_dir: str = "runs/trainer"
    max_steps: int = Field(default=10, ge=1)
    learning_rate: float = Field(default=3e-6, gt=0)
    num_generations: int = Field(default=4, ge=2)
    prompts_per_step: int = Field(default=2, ge=1)
    max_completion_length: int = Field(default=48, ge=8)
    max_tool_calls: int = Field(default=3, ge=1)
    max_staleness: int = Field(default=2, ge=0)
    temperature: float = Field(default=1.0, gt=0)
    compact: bool = False
    # blake3 digests "every" version, or only at "anchors" (then replicas are checked by fingerprint between)
    digests: Literal["every", "anchors"] = "every"
    # host weights: the share of a tensor changed from which publish() copies it rather than scans it
    # (0: every tensor, a second bf16 snapshot in host memory; see DeltaPublisher)
    copy_from: float = Field(default=BUSY_FRACTION, ge=0, le=1)
    verify: bool = Field(default=True, description="check every replica's live digest after each sync")


def _callback(monitor: Monitor, stop: threading.Event):
    """trl callback: per-step logs to the monitor, and the UI's Stop button to trl."""
    from transformers import TrainerCallback

    class Reporter(TrainerCallback):
        def on_log(self, args, state, control, logs=None, **kwargs):
            if logs and "loss" in logs:
                monitor.on_step(state.global_step, logs)

        def on_step_end(self, args, state, control, **kwargs):
            if stop.is_set():
                control.should_training_stop = True

    return Reporter()


def make_transfer(settings: RunSettings, monitor: Monitor) -> DeltaSyncTransfer:
    def after_sync(version: int) -> None:
        if settings.verify:
            bad = {url for url, exact in monitor.verify(version).items() if not exact}
            if bad:
                raise RuntimeError(f"v{version}: live weights of {sorted(bad)} differ from the trainer's")
        else:
            monitor.refresh()

    return DeltaSyncTransfer(settings.store, settings.replicas, base=settings.model, token=settings.token,
                             compact=settings.compact, digests=settings.digests, copy_from=settings.copy_from,
                             on_report=monitor.on_report,
                             after_sync=after_sync)


def run(settings: RunSettings, monitor: Monitor, stop: threading.Event | None = None) -> DeltaSyncTransfer:
    """Train ``max_steps`` optimizer steps (or until ``stop`` is set); returns the transfer used."""
    if not settings.api_key:
        return _train(settings, settings.replicas[0], monitor, stop)
    with AuthRelay(settings.replicas[0], settings.api_key) as relay:
        return _train(settings, relay.url, monitor, stop)


def _train(settings: RunSettings, generation_url: str, monitor: Monitor,
           stop: threading.Event | None) -> DeltaSyncTransfer:
    from datasets import Dataset
    from trl.experimental.async_grpo import AsyncGRPOConfig, AsyncGRPOTrainer

    shims = cpu_shims.apply()
    if shims:
        log.info("no CUDA: trl runs with the CPU shims %s", shims)
    cpu = bool(shims)
    samples_per_step = settings.prompts_per_step * settings.num_generations
    args = AsyncGRPOConfig(
        output_dir=str(Path(settings.output_dir) / "trl"), vllm_server_base_url=generation_url,
        max_steps=settings.max_steps, learning_rate=settings.learning_rate,
        num_generations=settings.num_generations, per_device_train_batch_size=samples_per_step,
        gradient_accumulation_steps=1, max_completion_length=settings.max_completion_length,
        max_tool_calling_iterations=settings.max_tool_calls, temperature=settings.temperature,
        max_staleness=settings.max_staleness, queue_maxsize=samples_per_step * max(settings.max_staleness, 1),
        dtype="float32" if cpu else "bfloat16", use_cpu=cpu, bf16=False,
        chat_template_kwargs={"enable_thinking": False}, logging_steps=1, report_to="none",
        save_strategy="no", log_completions=False)
    dataset = Dataset.from_dict({"prompt": [[{"role": "user", "content": PROMPT}]] * 64})
    transfer = make_transfer(settings, monitor)
    trainer = AsyncGRPOTrainer(model=settings.model, args=args, train_dataset=dataset,
                               environment_factory=functools.partial(WordleGame, settings.env_url),
                               weight_transfer=transfer,
                               callbacks=[_callback(monitor, stop or threading.Event())])
    trainer.train()  # trl calls transfer.destroy() (the publisher's close) in a finally
    return transfer
