"""The rollout server is closed by default: a real server (vLLM on CPU) on loopback, over HTTP.

One server for the whole module, started the most exposed way a test can: ``--api-key``, an
update token, a small ``--max-body-bytes`` and ``VLLM_SERVER_DEV_MODE=1``. The refusal to start
on a public address without a token comes before vLLM loads anything, so it is checked with
plain ``python -m rollout_space`` runs that need no engine.
"""

from __future__ import annotations

import json
import os
import secrets
import subprocess
import sys
import threading
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
from chain_helpers import FakeTrainer
from conftest import ENGINE_ARGS, STARTUP_TIMEOUT_S, Server

from shared.process import REPO, free_port

SECRET = f"dsync-{secrets.token_hex(12)}"  # the update token: distinctive, so a log grep means something
WRONG = f"wrong-{secrets.token_hex(12)}"
API_KEY = f"key-{secrets.token_hex(12)}"
MAX_BODY = 64 * 1024
AUTH = {"Authorization": f"Bearer {SECRET}"}
KEY = {"Authorization": f"Bearer {API_KEY}"}
REFUSAL = "python -m rollout_space: refusing to serve on 0.0.0.0 without an update token"
DEV_ROUTES = ["/collective_rpc", "/update_weights", "/weight_checker", "/init_weight_transfer_engine", "/sleep",
              "/wake_up", "/is_sleeping", "/reset_prefix_cache", "/reset_mm_cache", "/scale_elastic_ep",
              "/is_scaling_elastic_ep", "/start_weight_update", "/finish_weight_update"]


# ----------------------------------------------------------------------------- no engine


def _without_token() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in ("DELTASYNC_TOKEN", "VLLM_API_KEY")}


def test_refuses_a_public_address_without_a_token(tmp_path: Path):
    """Default host (every interface) and an explicit 0.0.0.0: exit 2 with one clear line. The
    model does not exist, so reaching vLLM's loader would fail differently."""
    runs = {name: subprocess.Popen(
        [sys.executable, "-m", "rollout_space", "--model", str(tmp_path / "no-such-model"),
         "--store", str(tmp_path / "bucket"), "--port", str(free_port()), *host],
        cwd=REPO, env=_without_token(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for name, host in (("default", []), ("explicit", ["--host", "0.0.0.0"]))}
    for name, proc in runs.items():
        out, err = proc.communicate(timeout=180)
        assert proc.returncode == 2, (name, err[-3000:])
        lines = [ln for ln in err.splitlines() if ln.strip()]
        assert [ln for ln in lines if "refusing" in ln] == [lines[-1]], (name, err[-3000:])
        assert lines[-1].startswith(REFUSAL) and "--insecure-no-token" in lines[-1] \
            and "DELTASYNC_TOKEN" in lines[-1], lines[-1]
        assert "Traceback" not in err and "no-such-model" not in err + out, err[-3000:]
        assert not (tmp_path / "bucket").exists()


def test_the_override_and_loopback_and_a_token_get_past_the_check(monkeypatch, tmp_path: Path):
    """``main`` reaches ``create_app`` (replaced here, so no engine starts) in every allowed case."""
    import rollout_space.__main__ as entry
    import rollout_space.server

    class Reached(Exception):
        pass

    def create_app(args):
        raise Reached(args)

    monkeypatch.setattr(rollout_space.server, "create_app", create_app)
    monkeypatch.delenv("DELTASYNC_TOKEN", raising=False)
    monkeypatch.delenv("DELTASYNC_MAX_BODY_BYTES", raising=False)
    base = ["--model", str(tmp_path / "m"), "--store", str(tmp_path / "b")]
    for extra in (["--host", "0.0.0.0", "--insecure-no-token"], ["--host", "127.0.0.1"], ["--host", "::1"],
                  ["--host", "localhost"], ["--host", "0.0.0.0", "--token", "t"], ["--insecure-no-token"]):
        with pytest.raises(Reached) as reached:
            entry.main(base + extra)
        args = reached.value.args[0]
        assert args.max_body_bytes == 16 << 20 and args.host == (extra[1] if extra[0] == "--host" else None)
    with pytest.raises(SystemExit) as refused:
        entry.main(base + ["--host", "10.1.2.3"])
    assert refused.value.code == 2
    monkeypatch.setenv("DELTASYNC_MAX_BODY_BYTES", "1234")
    monkeypatch.setenv("DELTASYNC_TOKEN", "from-env")
    with pytest.raises(Reached) as reached:
        entry.main(base + ["--host", "0.0.0.0"])
    assert reached.value.args[0].max_body_bytes == 1234 and reached.value.args[0].token == "from-env"


def test_shared_access_and_asgi_import_no_web_framework():
    code = ("import sys, shared.access, shared.asgi; "
            "print(sorted({m.split('.')[0] for m in sys.modules} & {'fastapi', 'starlette', 'uvicorn'}))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "[]", out.stderr


def test_bearer_rule():
    from shared.access import bearer_ok, is_loopback

    assert all(is_loopback(h) for h in ("127.0.0.1", "localhost", "LOCALHOST", "::1", "[::1]"))
    assert not any(is_loopback(h) for h in (None, "", "0.0.0.0", "::", "10.0.0.1", "127.0.0.1.example.com"))
    assert bearer_ok(f"Bearer {SECRET}", SECRET) and bearer_ok(f"bearer {SECRET}", SECRET)
    for given in (None, "", SECRET, f"Basic {SECRET}", f"Bearer {SECRET[:-1]}", f"Bearer {SECRET}x", "Bearer "):
        assert not bearer_ok(given, SECRET), given
    assert bearer_ok(None, None) and bearer_ok("anything", "")


def test_a_digest_pass_that_a_write_interrupts_starts_again():
    """The worker's digest job (no engine: stand-in weights). A write landing between two tensors
    must not give a digest that mixes two versions; the pass starts again, and the last allowed
    pass holds the weights lock throughout."""
    from rollout_space.live_weights import Held
    from rollout_space.worker import DIGEST_PASSES, DeltaWorkerExtension, _State

    specs = {"a": ("BF16", [2]), "b": ("BF16", [2]), "c": ("F32", [])}  # "c" is not mapped
    versions = [Held(v, f"c{v}", {n: f"{n}{v}" for n in specs}, specs, declared={n: f"f{n}{v}" for n in specs})
                for v in range(DIGEST_PASSES)]
    for interruptions in range(DIGEST_PASSES):
        writes_left = interruptions

        class Weights:
            live = SimpleNamespace(map=SimpleNamespace(tensors={"a", "b"}))
            held = versions[0]

            def hash_against(self, name: str, held_digest: str) -> tuple[str, None]:
                nonlocal writes_left
                value = self.held.digests[name]
                if name == "a" and writes_left:  # a write lands right after this read
                    writes_left -= 1
                    st.writes += 1
                    self.held = versions[self.held.version + 1]
                return value, None

        st = _State(Weights(), None)
        ext = DeltaWorkerExtension()
        ext._deltasync_state = st
        out = json.loads(ext._job_digest("digest-1", ""))
        want = versions[interruptions]
        assert out["ok"] and out["passes"] == interruptions + 1, out
        assert (out["version"], out["commitment"]) == (want.version, want.commitment)
        assert out["state_digest"] == want.state_digest and not out["mismatched"]
        assert out["state_fingerprint"] == want.state_fingerprint
        assert not st.lock.locked()


# ----------------------------------------------------------------------------- one real server


@pytest.fixture(scope="module")
def trainer(tiny_model_dir: Path, rollout_dir: Path):
    t = FakeTrainer(tiny_model_dir, str(rollout_dir / "security-bucket"), lr=2e-5, token=SECRET)
    t.publisher.flush()  # v0: the base model itself
    yield t
    t.close()


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path, trainer: FakeTrainer, rollout_dir: Path):
    work = rollout_dir / "security"
    work.mkdir(exist_ok=True)
    port = free_port()
    env = {"VLLM_CACHE_ROOT": str(work / "vllm-cache"), "TOKENIZERS_PARALLELISM": "false",
           "DELTASYNC_MAP_CACHE": str(rollout_dir.parent / "maps"), "VLLM_SERVER_DEV_MODE": "1"}
    s = Server(tiny_model_dir, rollout_dir / "security-bucket", log_path=work / f"rollout-{port}.log",
               token=SECRET, env=env, port=port,
               extra=["--work-dir", str(work / "objects"), *ENGINE_ARGS, "--api-key", API_KEY,
                      "--max-body-bytes", str(MAX_BODY)])
    s.wait_ready(STARTUP_TIMEOUT_S)
    trainer.publisher.replicas.append(s.url)  # the publisher posts /update with the token
    yield s
    s.stop()


def _digests_computed(server: Server) -> float:
    for line in server.get("/metrics").text.splitlines():
        if line.startswith("deltasync_live_digests_total "):
            return float(line.split()[1])
    raise AssertionError("no deltasync_live_digests_total in /metrics")


def _digest(server: Server, **kw) -> dict:
    r = server.get("/weights/digest", **kw)
    assert r.status_code == 200, r.text
    return r.json()


@pytest.mark.slow
def test_control_routes_need_the_token(server: Server):
    for path in ("/update", "/pause", "/resume"):
        for headers in ({}, {"Authorization": f"Bearer {WRONG}"}, {"Authorization": SECRET},
                        {"Authorization": f"Basic {SECRET}"}, {"Authorization": f"Bearer {SECRET[:-1]}"},
                        {"Authorization": f"Bearer {SECRET}0"}, {"Authorization": f"Bearer {API_KEY}"}):
            r = server.post(path, json={}, headers=headers)
            assert r.status_code == 401, (path, headers, r.text)
            assert r.json() == {"detail": "missing or wrong bearer token"}
            assert r.headers["www-authenticate"] == "Bearer"
    assert server.get("/is_paused").json() == {"is_paused": False}  # nothing paused it
    assert server.post("/pause", headers=AUTH).json() == {"status": "paused"}
    assert server.get("/is_paused").json() == {"is_paused": True}
    assert server.post("/resume", headers=AUTH).json() == {"status": "resumed"}
    assert server.get("/is_paused").json() == {"is_paused": False}
    r = server.post("/update", json={}, headers=AUTH)
    assert r.status_code == 200 and r.json()["version"] == 0, r.text


@pytest.mark.slow
def test_api_key_guards_v1_only(server: Server):
    assert server.get("/v1/models").status_code == 401
    assert server.get("/v1/models", headers={"Authorization": f"Bearer {SECRET}"}).status_code == 401
    body = {"model": server.model, "prompt": "The quick brown", "max_tokens": 4, "temperature": 0}
    assert server.post("/v1/completions", json=body).status_code == 401
    models = server.get("/v1/models", headers=KEY)
    assert models.status_code == 200 and models.json()["data"][0]["id"] == server.model
    r = server.post("/v1/completions", json=body, headers=KEY)
    assert r.status_code == 200 and r.json()["policy_version"] == 0, r.text
    for path in ("/health", "/version", "/is_paused", "/metrics"):  # the control plane has its own rules
        assert server.get(path).status_code == 200, path


@pytest.mark.slow
def test_oversize_bodies_are_413(server: Server):
    body = {"model": server.model, "prompt": "x " * MAX_BODY, "max_tokens": 1}
    raw = json.dumps(body).encode()
    assert len(raw) > MAX_BODY
    for headers in (KEY, {}):  # refused before the key is even looked at
        r = server.post("/v1/completions", content=raw, headers={**headers, "content-type": "application/json"})
        assert r.status_code == 413, r.text
        assert r.json() == {"detail": f"request body exceeds the {MAX_BODY}-byte limit"}

    def chunks():
        for i in range(0, len(raw), 8192):
            yield raw[i:i + 8192]

    r = server.post("/v1/completions", content=chunks(), headers={**KEY, "content-type": "application/json"})
    assert r.status_code == 413 and "limit" in r.json()["detail"], r.text
    r = server.post("/update", content=b" " * (MAX_BODY + 1), headers=AUTH)
    assert r.status_code == 413, r.text
    # just under the limit, chunked: replayed to vLLM whole
    small = json.dumps({"model": server.model, "prompt": "The quick brown", "max_tokens": 2,
                        "temperature": 0, "user": "u" * (MAX_BODY - 300)}).encode()
    assert MAX_BODY - 200 < len(small) <= MAX_BODY
    r = server.post("/v1/completions", content=iter([small[:1000], small[1000:]]),
                    headers={**KEY, "content-type": "application/json"})
    assert r.status_code == 200 and r.json()["policy_version"] == 0, r.text


@pytest.mark.slow
def test_no_vllm_dev_mode_routes(server: Server):
    headers = {**KEY}  # the api key, so an auth check cannot be what refuses a /v1-less route
    for path in DEV_ROUTES:
        for method in ("GET", "POST"):
            r = httpx.request(method, server.url + path, headers=headers, json={}, timeout=30)
            assert r.status_code in (404, 405), (method, path, r.status_code, r.text)
    r = httpx.post(server.url + "/sleep?level=1", headers=AUTH, timeout=30)
    assert r.status_code in (404, 405)
    assert server.get("/health").status_code == 200  # still awake
    paths = set(server.get("/openapi.json").json()["paths"])
    assert not paths & set(DEV_ROUTES), paths & set(DEV_ROUTES)
    assert {"/update", "/pause", "/resume", "/weights/digest", "/v1/completions"} <= paths


@pytest.mark.slow
def test_digest_is_computed_once_per_version_and_shared(server: Server, trainer: FakeTrainer):
    first = _digest(server)
    assert first["version"] == 0 and first["state_digest"] == trainer.publisher.state_digest
    before = _digests_computed(server)
    for _ in range(5):
        again = _digest(server)
        assert again["cached"] is True and again["state_digest"] == first["state_digest"]
        assert again["version"] == 0 and again["matches_held"]
    assert _digests_computed(server) == before

    report = trainer.step()
    trainer.publisher.flush()  # the replica serves v1 when this returns
    assert server.get("/version").json()["version"] == report.version == 1
    start = threading.Barrier(8)

    def ask(_: int) -> dict:
        start.wait()
        return _digest(server)

    with ThreadPoolExecutor(8) as pool:
        answers = list(pool.map(ask, range(8)))
    assert all(a["version"] == 1 and a["state_digest"] == report.state_digest and a["matches_held"]
               for a in answers), answers
    assert any(a["cached"] is False for a in answers)  # the first after the update is computed
    assert _digests_computed(server) == before + 1  # once, however many asked at once
    assert _digest(server)["cached"] is True and _digests_computed(server) == before + 1


@pytest.mark.slow
def test_fresh_digest_needs_the_token_and_recomputes(server: Server, trainer: FakeTrainer):
    _digest(server)  # the served version's digest is cached (whatever ran before)
    before = _digests_computed(server)
    for headers in ({}, {"Authorization": f"Bearer {WRONG}"}, KEY):
        r = server.get("/weights/digest?fresh=true", headers=headers)
        assert r.status_code == 401 and r.json() == {"detail": "missing or wrong bearer token"}, r.text
    assert _digests_computed(server) == before  # refused before any work
    assert server.get("/weights/digest?fresh=false").json()["cached"] is True
    fresh = _digest(server, params={"fresh": "true"}, headers=AUTH)
    assert fresh["cached"] is False and fresh["state_digest"] == trainer.publisher.state_digest
    assert _digests_computed(server) == before + 1
    assert _digest(server)["cached"] is True and _digests_computed(server) == before + 1


@pytest.mark.slow
def test_digests_during_updates_always_name_the_weights_they_read(server: Server, trainer: FakeTrainer):
    """Anonymous and fresh digests asked for without pause while two updates land (the worker
    reads tensor by tensor and starts again when a write comes between two): every answer's
    digest is the trainer's for the version it names."""
    expected = {v: trainer.publisher.chain.manifest(v).state_digest for v in range(trainer.publisher.version + 1)}
    first, last = trainer.publisher.version, trainer.publisher.version + 2
    stop, answers, errors, saw_last = threading.Event(), [], [], threading.Event()
    running = [threading.Event() for _ in range(4)]

    def hammer(i: int) -> None:
        with httpx.Client(base_url=server.url, timeout=60) as c:
            while not stop.is_set():
                r = c.get("/weights/digest", params={"fresh": "true"} if i == 0 else None,
                          headers=AUTH if i == 0 else None)
                (answers if r.status_code == 200 else errors).append(r.json())
                running[i].set()
                if r.status_code == 200 and r.json()["version"] == last:
                    saw_last.set()

    threads = [threading.Thread(target=hammer, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    try:
        assert all(e.wait(60) for e in running)
        for _ in range(2):
            report = trainer.step()
            trainer.publisher.flush()
            expected[report.version] = report.state_digest
            assert server.get("/version").json()["version"] == report.version
        assert report.version == last and saw_last.wait(60)
    finally:
        stop.set()
        for t in threads:
            t.join()
    assert not errors, errors[:3]
    assert {first, last} <= {a["version"] for a in answers}
    wrong = [a for a in answers if a["state_digest"] != expected[a["version"]] or not a["matches_held"]]
    assert answers and not wrong, wrong[:3]
    final = _digest(server)
    assert final["version"] == last and final["state_digest"] == trainer.publisher.state_digest
    assert server.post("/v1/completions", json={"model": server.model, "prompt": "0 1 2", "max_tokens": 3},
                       headers=KEY).json()["policy_version"] == trainer.publisher.version


@pytest.mark.slow
def test_tokens_never_reach_the_log(server: Server):
    """After authorized and refused calls with the token, the key and a wrong token."""
    server.post("/pause", headers={"Authorization": f"Bearer {WRONG}"})
    server.post("/resume", headers=AUTH)
    server.get("/v1/models", headers={"Authorization": f"Bearer {WRONG}"})
    assert server.get("/health").status_code == 200
    log = server.log()
    assert "refused POST /pause from 127.0.0.1: missing or wrong bearer token" in log
    for secret in (SECRET, API_KEY, WRONG):
        assert secret not in log, secret
