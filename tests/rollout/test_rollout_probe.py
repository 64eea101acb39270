"""The write-through probe against real rollout servers (vLLM on CPU, tiny Qwen3).

The read-back audit proves the parameters hold the written bits, not that generation computes
from them. These tests produce, for real, a layer that computes from a private copy of its weight
(what oneDNN's packed CPU weights do; ``probe_worker.PrivateCopyExtension``) and check that the
audit lets an update through while the probe names that one parameter and the replica refuses to
serve; and that on the normal path the probe passes and leaves the weights bit-exact.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import pytest
from chain_helpers import FakeTrainer
from conftest import STARTUP_TIMEOUT_S, TOKEN, Server, launch, wait_ready
from probe_worker import MODULE_ENV

pytestmark = pytest.mark.slow
AUTH = {"Authorization": f"Bearer {TOKEN}"}
PRIVATE = "model.layers.0.mlp.down_proj"


def expected_params(layers: int = 2) -> dict[str, list[str]]:
    """Engine parameter -> checkpoint tensors, for the tiny tied Qwen3 (vLLM fuses q/k/v and gate/up)."""
    out = {"model.embed_tokens.weight": ["model.embed_tokens.weight"]}
    for i in range(layers):
        p = f"model.layers.{i}"
        out |= {f"{p}.self_attn.qkv_proj.weight": [f"{p}.self_attn.{x}_proj.weight" for x in "qkv"],
                f"{p}.self_attn.o_proj.weight": [f"{p}.self_attn.o_proj.weight"],
                f"{p}.self_attn.q_norm.weight": [f"{p}.self_attn.q_norm.weight"],
                f"{p}.self_attn.k_norm.weight": [f"{p}.self_attn.k_norm.weight"],
                f"{p}.mlp.gate_up_proj.weight": [f"{p}.mlp.gate_proj.weight", f"{p}.mlp.up_proj.weight"],
                f"{p}.mlp.down_proj.weight": [f"{p}.mlp.down_proj.weight"],
                f"{p}.input_layernorm.weight": [f"{p}.input_layernorm.weight"],
                f"{p}.post_attention_layernorm.weight": [f"{p}.post_attention_layernorm.weight"]}
    return out | {"model.norm.weight": ["model.norm.weight"]}


@pytest.fixture
def trainer(tiny_model_dir: Path, tmp_path: Path):
    t = FakeTrainer(tiny_model_dir, str(tmp_path / "bucket"), lr=2e-5)
    t.publisher.flush()  # v0: the base model itself
    yield t
    t.close()


def private_copy_server(model: Path, store: str, workdir: Path, *extra: str) -> Server:
    """A server whose ``PRIVATE`` layer computes from a copy of its weight made at start-up."""
    return launch(model, Path(store), workdir, *extra, worker="probe_worker.PrivateCopyExtension",
                  env={MODULE_ENV: PRIVATE})


def wait_listening(s: Server) -> dict:
    """``GET /version`` once the server answers (it listens only after start-up, probe included)."""
    deadline = time.monotonic() + STARTUP_TIMEOUT_S
    while time.monotonic() < deadline:
        assert s.proc.poll() is None, s.log()[-4000:]
        try:
            return s.get("/version").json()
        except httpx.TransportError:
            time.sleep(0.2)
    raise TimeoutError(s.log()[-4000:])


def probe_metric(s: Server, outcome: str) -> float:
    for line in s.get("/metrics").text.splitlines():
        if line.startswith(f'deltasync_write_probes_total{{outcome="{outcome}"}}'):
            return float(line.split()[-1])
    return 0.0


def probe_while_generating(s: Server, clients: int = 3) -> tuple[httpx.Response, dict]:
    """``POST /probe`` while ``clients`` threads send greedy completions back to back; returns its
    answer and what the clients got: token ids of each 200, every status, the statuses of requests
    sent after the probe answered, and how many were sent before it answered and answered after it
    was sent (in flight, or held, while it ran)."""
    stop, lock = threading.Event(), threading.Condition()
    served: dict = {"tokens": [], "statuses": set(), "after": set(), "after_n": 0, "overlapping": 0, "done": 0}
    probe = {"sent": False, "answered": False}

    def client() -> None:
        with httpx.Client(timeout=120) as c:
            while not stop.is_set():
                sent_before_answer, sent_after_answer = not probe["answered"], probe["answered"]
                r = c.post(s.url + "/v1/completions", json={"model": s.model, "prompt": "The quick brown",
                                                            "max_tokens": 8, "temperature": 0,
                                                            "return_token_ids": True})
                with lock:
                    served["statuses"].add(r.status_code)
                    if r.status_code == 200:
                        served["tokens"].append(r.json()["choices"][0]["token_ids"])
                    served["overlapping"] += sent_before_answer and probe["sent"]
                    if sent_after_answer:
                        served["after"].add(r.status_code)
                        served["after_n"] += 1
                    served["done"] += 1
                    lock.notify_all()

    threads = [threading.Thread(target=client) for _ in range(clients)]
    for t in threads:
        t.start()
    try:
        with lock:  # generation is under way before the probe is asked for
            assert lock.wait_for(lambda: served["done"] >= clients, timeout=120)
        probe["sent"] = True
        r = s.post("/probe", headers=AUTH)
        probe["answered"] = True
        with lock:  # and goes on after it
            assert lock.wait_for(lambda: served["after_n"] >= clients, timeout=120)
    finally:
        stop.set()
        for t in threads:
            t.join()
    return r, served


def live_digest(s: Server) -> str:
    r = s.get("/weights/digest", params={"fresh": "true"}, headers=AUTH)
    assert r.status_code == 200, r.text
    return r.json()["state_digest"]


def test_probe_passes_on_the_normal_path(tiny_model_dir: Path, tmp_path: Path, trainer: FakeTrainer):
    s = wait_ready(launch(tiny_model_dir, str(tmp_path / "bucket"), tmp_path, "--write-probe", "dense"))
    try:
        v = s.get("/version").json()
        assert v["status"] == "ready" and v["version"] == 0 and v["damage"] == ""
        summary = v["write_probe"]
        assert summary["outcome"] == "passed" and summary["why"] == "start" and summary["failed"] == []
        assert summary["covered"] == summary["checked"] == len(expected_params())
        full = s.get("/probe").json()
        assert {p["param"]: p["tensors"] for p in full["params"]} == expected_params()
        assert all(p["reaches"] for p in full["params"])
        assert full["deterministic"] and full["restored"] and full["unbound"] == []
        assert full["forwards"] == len(expected_params()) + 3  # twice the first run, one per parameter, the last

        before = s.complete()["choices"][0]["logprobs"]["token_logprobs"]
        assert s.post("/probe").status_code == 401  # runs only with the bearer token
        r, served = probe_while_generating(s)
        assert r.status_code == 200, r.text
        assert r.json()["outcome"] == "passed" and r.json()["why"] == "request"
        assert probe_metric(s, "passed") == 2.0 and probe_metric(s, "failed") == 0.0
        # Generation was held, never served from perturbed weights: requests in flight when the
        # probe was asked for, and those sent while it ran, all give the unperturbed greedy tokens
        # (-2w - m in any one parameter changes them; logprobs of batched requests may differ in
        # the last bits on CPU, token ids do not).
        tokens = s.complete()["choices"][0]["token_ids"]
        assert served["overlapping"] >= 1 and served["statuses"] == served["after"] == {200}
        assert served["tokens"] == [tokens] * len(served["tokens"])
        # perturbing and restoring every parameter left the weights and the output exact
        assert live_digest(s) == trainer.publisher.state_digest
        assert s.complete()["choices"][0]["logprobs"]["token_logprobs"] == before

        report = trainer.step()
        trainer.publisher.flush()
        r = s.update(report.version)
        assert r.status_code == 200, r.text
        assert r.json()["state_digest"] == report.state_digest and r.json()["write_probe"] is None  # a delta
        assert live_digest(s) == report.state_digest
        assert s.complete()["policy_version"] == report.version

        # Steps that change nearly every weight: catching up through the newest anchor is cheaper than
        # the deltas, so the replica loads it densely while serving, and then (--write-probe dense) probes.
        trainer.lr = 2e-3
        reports = [trainer.step() for _ in range(2)]
        trainer.publisher.flush()
        r = s.update(reports[-1].version)
        assert r.status_code == 200, r.text
        assert [st["kind"] for st in r.json()["steps"]] == ["anchor"]
        probe = r.json()["write_probe"]
        assert probe["outcome"] == "passed" and probe["why"] == "dense" and probe["version"] == reports[-1].version
        assert probe["checked"] == len(expected_params()) and probe["failed"] == []
        assert live_digest(s) == reports[-1].state_digest
        assert s.get("/version").json()["write_probe"]["why"] == "dense"
    finally:
        s.stop()


def test_private_copy_is_caught_at_start_and_refused(tiny_model_dir: Path, tmp_path: Path, trainer: FakeTrainer):
    s = private_copy_server(tiny_model_dir, str(tmp_path / "bucket"), tmp_path)
    try:
        v = wait_listening(s)
        assert v["status"] == "damaged" and v["version"] is None
        assert v["write_probe"]["outcome"] == "failed" and v["write_probe"]["why"] == "start"
        assert v["write_probe"]["failed"] == [f"{PRIVATE}.weight"]
        assert f"{PRIVATE}.weight" in v["damage"]
        full = s.get("/probe").json()
        assert [p["param"] for p in full["params"] if not p["reaches"]] == [f"{PRIVATE}.weight"]
        assert len(full["params"]) == len(expected_params())
        assert full["restored"] and full["deterministic"]
        assert s.get("/health").status_code == 503
        r = s.post("/v1/completions", json={"model": s.model, "prompt": "The quick", "max_tokens": 2})
        assert r.status_code == 503 and PRIVATE in r.json()["error"]["message"]
        report = trainer.step()
        trainer.publisher.flush()
        r = s.update(report.version)  # no update can make writes reach a private copy
        assert r.status_code == 503, r.text
        assert r.json()["refused"]["reason"] == "write_through" and r.json()["version"] is None
        assert probe_metric(s, "failed") == 1.0
    finally:
        s.stop()


def test_audit_passes_a_write_the_output_never_sees_but_the_probe_fails_it(
        tiny_model_dir: Path, tmp_path: Path, trainer: FakeTrainer):
    s = wait_ready(private_copy_server(tiny_model_dir, str(tmp_path / "bucket"), tmp_path,
                                       "--write-probe", "off"))
    try:
        v = s.get("/version").json()
        assert v["status"] == "ready" and v["write_probe"] is None
        report = trainer.step()
        trainer.publisher.flush()
        r = s.update(report.version)
        # the read-back audit passes: the parameters hold every written bit ...
        assert r.status_code == 200, r.text
        assert r.json()["version"] == report.version and r.json()["state_digest"] == report.state_digest
        assert live_digest(s) == report.state_digest
        # ... while one layer still computes with the weights of v0. Requests in flight when the probe
        # is asked for finish (200, unperturbed greedy tokens); those that arrive while it runs, and
        # after, are refused.
        tokens = s.complete()["choices"][0]["token_ids"]
        r, served = probe_while_generating(s)
        assert r.status_code == 503, r.text
        assert served["statuses"] == {200, 503} and served["after"] == {503} and served["overlapping"] >= 1
        assert served["tokens"] == [tokens] * len(served["tokens"])
        assert r.json()["outcome"] == "failed" and r.json()["failed"] == [f"{PRIVATE}.weight"]
        assert r.json()["version"] == report.version
        v = s.get("/version").json()
        assert v["status"] == "damaged" and v["write_probe"]["why"] == "request"
        assert s.get("/health").status_code == 503
        assert s.update(report.version).status_code == 503
    finally:
        s.stop()
