"""The main job on embedded defaults: a real rollout replica follows a training loop exactly.

A tiny Qwen3 is built locally; a vLLM rollout server (CPU) serves it; the trainer samples
completions from that server, takes AdamW steps on a policy-gradient loss over them, and
publishes every step through ``DeltaPublisher`` into a local-folder bucket, which POSTs
``/update``. After each step the replica's live ``/weights/digest`` must equal the trainer's state
digest. One row per step: payload vs dense, apply pause, end-to-end latency.

    python -m trainer_space.demo [--steps 20] [--lr 2e-6] [--out runs/demo]
"""

from __future__ import annotations

import argparse
import json
import secrets
import shutil
import statistics
import sys
import time
from pathlib import Path

import httpx
import torch
from rich.console import Console
from rich.table import Table

from shared.publisher import DeltaPublisher
from shared.tiny_model import CORPUS, build_tiny_model

from .replica_process import Replica

console = Console(width=None if sys.stdout.isatty() else 150)


def sample(client: httpx.Client, url: str, prompts: list[str], n: int, max_tokens: int) -> tuple[list, int]:
    model = client.get(f"{url}/v1/models").json()["data"][0]["id"]
    r = client.post(f"{url}/v1/completions", json={
        "model": model, "prompt": prompts, "n": n, "max_tokens": max_tokens, "temperature": 1.0,
        "return_token_ids": True})
    r.raise_for_status()
    body = r.json()
    return body["choices"], body.get("policy_version")


def reward(text: str) -> float:
    """A toy task: prefer completions made of lowercase letters and spaces."""
    return sum(c.islower() or c == " " for c in text) / max(len(text), 1)


def policy_gradient_loss(model, tokenizer, prompts: list[str], choices: list[dict], n: int) -> tuple[torch.Tensor, float]:
    rewards = torch.tensor([reward(c["text"]) for c in choices])
    adv = rewards - rewards.mean()
    losses = []
    for i, c in enumerate(choices):
        prompt_ids = tokenizer(prompts[i // n])["input_ids"]
        comp_ids = c.get("token_ids") or tokenizer(c["text"])["input_ids"]
        if not comp_ids:
            continue
        ids = torch.tensor([prompt_ids + comp_ids])
        logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1]
        logp = torch.log_softmax(logits.float(), -1).gather(1, torch.tensor(comp_ids)[:, None]).sum()
        losses.append(-adv[i] * logp)
    return torch.stack(losses).mean(), float(rewards.mean())


def plot(rows: list[dict], path: Path) -> None:
    """Bytes per step (log scale) and the replica's pause: what a person checks first."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 3.8))
    for key, label in (("dense_bytes", "dense bf16"), ("int32_bf16_bytes", "int32 + bf16"),
                       ("payload_bytes", "deltasync")):
        ax1.plot(steps, [r[key] for r in rows], marker=".", label=label)
    ax1.set_yscale("log")
    ax1.set_xlabel("step")
    ax1.set_ylabel("bytes per version")
    ax1.legend()
    ax1.set_title("what each version costs to ship")
    ax2.plot(steps, [r["pause_s"] * 1e3 for r in rows], marker=".", label="replica pause")
    ax2.plot(steps, [r["encode_s"] * 1e3 for r in rows], marker=".", label="trainer encode")
    ax2.set_yscale("log")  # the first encode also loads the compiled kernels
    ax2.set_xlabel("step")
    ax2.set_ylabel("ms")
    for ax in (ax1, ax2):
        ax.xaxis.set_major_locator(matplotlib.ticker.MaxNLocator(integer=True))
    ax2.legend()
    ax2.set_title("time (every version served bit-exactly)" if all(r["exact"] for r in rows)
                  else "time (a version did not match!)")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=2e-6)
    ap.add_argument("--out", type=Path, default=Path("runs/demo"))
    ap.add_argument("--samples", type=int, default=4, help="completions per prompt")
    ap.add_argument("--hidden", type=int, default=256, help="width of the locally built Qwen3")
    ap.add_argument("--layers", type=int, default=4)
    a = ap.parse_args(argv)

    from transformers import AutoModelForCausalLM, AutoTokenizer

    model_dir = a.out / f"model-h{a.hidden}-l{a.layers}"
    if not (model_dir / "model.safetensors").exists():
        build_tiny_model(model_dir, hidden=a.hidden, layers=a.layers, heads=a.hidden // 64,
                         kv_heads=max(1, a.hidden // 128), head_dim=64, intermediate=3 * a.hidden)
    bucket = a.out / "bucket"
    shutil.rmtree(bucket, ignore_errors=True)
    token = secrets.token_hex(16)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)  # fp32 master weights
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
    prompts = [s[:24] for s in CORPUS[:4]]

    console.print(f"[bold]DeltaSync demo[/]: model {model_dir}, bucket {bucket}, {a.steps} steps, lr {a.lr}")
    with Replica(model_dir, bucket, token=token, log_path=a.out / "rollout.log") as replica:
        # Version 0 is the base model itself: every replica already has it, nothing is uploaded.
        pub = DeltaPublisher(model, str(bucket), replicas=[replica.url], token=token,
                             external_base=str(model_dir))
        with console.status("starting the vLLM rollout server (CPU)…"):
            replica.wait_ready()
        table = Table(title="per step: the replica must serve exactly the trainer's weights")
        for col in ("step", "reward", "changed", "payload", "dense", "int32+bf16", "encode ms",
                    "pause ms", "e2e ms", "served by", "digest"):
            table.add_column(col, justify="right")
        rows, ok_all = [], True
        with httpx.Client(timeout=300) as client:
            for step in range(1, a.steps + 1):
                choices, served = sample(client, replica.url, prompts, a.samples, 12)
                loss, mean_reward = policy_gradient_loss(model, tokenizer, prompts, choices, a.samples)
                loss.backward()
                opt.step()
                opt.zero_grad()
                t0 = time.perf_counter()
                report = pub.publish()
                pub.flush()  # upload, then POST /update, which answers once the version is served
                e2e = time.perf_counter() - t0
                live = client.get(f"{replica.url}/weights/digest").json()
                ok = live["state_digest"] == pub.state_digest and live["version"] == step
                ok_all &= ok
                answer = report.replicas.get(replica.url, {})
                pause = sum(s.get("pause_s", 0.0) for s in answer.get("steps", []))
                row = {"step": step, "loss": float(loss.detach()), "reward": mean_reward,
                       "sampled_from": served, **report.as_dict(), "pause_s": pause, "e2e_s": e2e,
                       "replica_digest": live["state_digest"], "exact": ok}
                rows.append(row)
                table.add_row(str(step), f"{mean_reward:.3f}", f"{report.changed_fraction:.2%}",
                              f"{report.payload_bytes:,}", f"{report.dense_bytes:,}",
                              f"{report.int32_bf16_bytes:,}", f"{report.encode_s * 1e3:.1f}",
                              f"{pause * 1e3:.1f}", f"{e2e * 1e3:.0f}", f"v{served}",
                              "[green]exact[/]" if ok else "[red]MISMATCH[/]")
                console.print(f"step {step:3d}: reward {mean_reward:.3f}  changed {report.changed_fraction:.2%}  "
                              f"payload {report.payload_bytes:,} B  pause {pause * 1e3:.1f} ms  "
                              f"{'exact' if ok else 'MISMATCH'}")
        pub.close()
    console.print(table)
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    console.print(f"medians: payload {med('payload_bytes'):,.0f} B of {rows[0]['dense_bytes']:,} dense "
                  f"({med('dense_bytes') / med('payload_bytes'):.1f}x smaller), pause {med('pause_s') * 1e3:.1f} ms, "
                  f"end to end {med('e2e_s') * 1e3:.0f} ms")
    (a.out / "report.json").write_text(json.dumps({"steps": rows, "exact": ok_all}, indent=1))
    plot(rows, a.out / "report.png")
    console.print(("[bold green]every version served bit-exactly[/]" if ok_all else
                   "[bold red]a version did not match[/]") + f" — report in {a.out / 'report.json'}, "
                  f"plot in {a.out / 'report.png'}")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())
