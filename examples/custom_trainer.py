"""Any PyTorch training loop can feed DeltaSync replicas: publish after every optimizer step.

    python examples/custom_trainer.py --model MODEL_DIR --store STORE --replica URL --token T \
        [--api-key K] [--steps 5]

The replica must have been started on MODEL_DIR (version 0, nothing uploaded). Each step samples
completions from the replica, takes an AdamW step on a toy policy-gradient loss (reward: how much
of a completion is lowercase letters and spaces), publishes the change as one exact bf16 delta and
checks that the replica's live weights are now the trainer's, bit for bit.
"""

import argparse

from shared.openmp import bound_openmp_spin

bound_openmp_spin()  # before torch loads: its OpenMP workers would spin through every publish()

import httpx  # noqa: E402
import torch  # noqa: E402
from transformers import AutoModelForCausalLM, AutoTokenizer  # noqa: E402

from shared.publisher import DeltaPublisher  # noqa: E402
from shared.warmup import warm_in_background  # noqa: E402

warm_in_background()  # numba's kernels compiled while the model loads, not in the first publish()

ap = argparse.ArgumentParser()
for flag in ("--model", "--store", "--replica", "--token"):
    ap.add_argument(flag, required=True)
ap.add_argument("--api-key", default=None, help="the replica's --api-key, if it has one")
ap.add_argument("--steps", type=int, default=5)
ap.add_argument("--lr", type=float, default=1e-5)
a = ap.parse_args()

tokenizer = AutoTokenizer.from_pretrained(a.model)
model = AutoModelForCausalLM.from_pretrained(a.model, dtype=torch.float32)  # fp32 master weights
opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.0)
prompt = "The quick brown"
prompt_ids = tokenizer(prompt)["input_ids"]
http = httpx.Client(base_url=a.replica, timeout=120,
                    headers={"Authorization": f"Bearer {a.api_key}"} if a.api_key else {})

with DeltaPublisher(model, a.store, replicas=[a.replica], token=a.token, external_base=a.model) as pub:
    for step in range(1, a.steps + 1):
        choices = http.post("/v1/completions", json={
            "model": a.model, "prompt": prompt, "n": 4, "max_tokens": 12, "temperature": 1.0,
            "return_token_ids": True}).raise_for_status().json()["choices"]
        rewards = torch.tensor([sum(c.islower() or c == " " for c in ch["text"]) / max(len(ch["text"]), 1)
                                for ch in choices])
        loss = 0.0
        for ch, adv in zip(choices, rewards - rewards.mean()):
            ids = torch.tensor([prompt_ids + ch["token_ids"]])
            logits = model(input_ids=ids).logits[0, len(prompt_ids) - 1:-1]
            loss = loss - adv * torch.log_softmax(logits, -1).gather(1, ids[0, len(prompt_ids):, None]).sum()
        loss.backward()
        opt.step()
        opt.zero_grad()
        report = pub.publish()  # encode now; upload and POST /update in the background
        pub.flush()  # wait until the replica serves it
        live = http.get("/weights/digest").json()
        exact = live["version"] == report.version and live["state_digest"] == pub.state_digest
        print(f"v{report.version}: reward {rewards.mean():.3f}, {report.changed_fraction:.2%} changed, "
              f"{report.payload_bytes:,} of {report.dense_bytes:,} bytes, {'exact' if exact else 'MISMATCH'}")
        if not exact:
            raise SystemExit(f"replica serves {live}, trainer has {pub.state_digest}")
