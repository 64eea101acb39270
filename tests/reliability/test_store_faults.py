"""Faults on the store's side (issue 9): a publisher killed mid-upload, the store unreachable for a
while, objects damaged after publish, retention racing a late joiner. Each ends on a valid,
exact version with nothing lost, or on a clear refusal with the last good version still served.

The store is real: a local folder, or S3 on moto's server behind a loopback relay the test takes
down and holds requests at (:mod:`reliability.store_servers`); the trainer is a real
``DeltaPublisher`` (in a subprocess where it is killed) and the replicas are real
``python -m rollout_space`` servers.
"""

from __future__ import annotations

import contextlib
import json
import logging
import queue
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from library.cli_process import run_cli
from library.helpers import perturb, same_bits
from rollout.chain_helpers import FakeTrainer

from reliability.publisher_proc import POLICY, states
from reliability.servers import Server, launch, wait_ready
from reliability.store_servers import S3_ENV, MotoServer, TcpProxy
from shared.chain import AnchorPolicy, Chain, reconstruct
from shared.digest import state_digest
from shared.errors import DeltaError
from shared.lock import read_holder
from shared.process import REPO
from shared.publisher import DeltaPublisher, PublishError
from shared.stores import open_store

PUBLISHER_PROC = Path(__file__).with_name("publisher_proc.py")


@contextlib.contextmanager
def injected(tally, case: str) -> Iterator[None]:
    """Count one fault; it survived when the block ran to its end (every check passed)."""
    survived = False
    try:
        yield
        survived = True
    finally:
        tally.fault(case, survived=survived)


def fsck_json(store: Path, *flags: str) -> dict:
    r = run_cli(["fsck", store, "--json", *flags])
    assert r.returncode in (0, 1) and "Traceback" not in r.stderr, r.stderr
    report = json.loads(r.stdout)
    assert report["ok"] == (r.returncode == 0), report  # the exit status says it too
    return report


def files_in(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


# ------------------------------------------------------------------------ the publisher killed mid-upload

# (the write in flight, the key it holds, earlier writes of that key let through, latest after the kill,
#  objects that landed with no manifest naming them)
LONG = pytest.mark.long
KILL_POINTS = [
    pytest.param("a delta's upload", "deltas/v00000005", 0, 4, [], id="deltas"),
    pytest.param("an anchor's upload after its version's delta landed", "anchors/v00000006", 0, 5,
                 ["deltas/v00000006.safetensors"], id="anchors", marks=LONG),
    pytest.param("the manifest's create after the objects landed", "manifests/v00000005", 0, 4,
                 ["deltas/v00000005.safetensors"], id="manifests", marks=LONG),
    pytest.param("moving latest after the manifest landed", "latest.json", 5, 4, [], id="latest"),
]


HOLD_DEADLINE_S = 240  # seen here: up to ~2 min with a cold numba cache and both cores busy


def child_events(proc: subprocess.Popen) -> queue.Queue:
    """The child's stdout lines, then None once it has exited. Its exit is watched apart from
    the pipe: EOF never comes while anything else holds the pipe's write end."""
    events: queue.Queue = queue.Queue()

    def read() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            events.put(line)

    def reap() -> None:
        proc.wait()
        events.put(None)

    for target in (read, reap):
        threading.Thread(target=target, daemon=True).start()
    return events


def kill_mid_upload(store: Path, hold: str, skip: int, versions: int = 7) -> tuple[int, str]:
    """Run the publisher until it blocks inside the held write, SIGKILL it there; returns its pid
    and the temporary file the write left."""
    errors = store.with_name("publisher.log")
    with open(errors, "w") as err:  # a file, never a pipe nobody reads
        proc = subprocess.Popen([sys.executable, "-X", "faulthandler", str(PUBLISHER_PROC), str(store), str(versions),
                                 "--hold", hold, "--skip", str(skip)], cwd=REPO, stdout=subprocess.PIPE, stderr=err,
                                 text=True)
    events = child_events(proc)
    deadline = time.monotonic() + HOLD_DEADLINE_S
    try:
        while True:
            try:
                line = events.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                # a publisher that never reaches the held write is a bug to see, not a test to time
                # out: SIGABRT makes faulthandler write every thread's stack to the log
                proc.send_signal(signal.SIGABRT)
                proc.wait(timeout=30)
                pytest.fail(f"the publisher did not reach {hold} in {HOLD_DEADLINE_S} s; its stacks:\n"
                            f"{errors.read_text()[-8000:]}")
            if line is None:
                pytest.fail(f"the publisher ended before holding {hold}: exit {proc.returncode}\n"
                            f"{errors.read_text()[-6000:]}")
            if line.startswith("holding "):
                _, key, tmp = line.split()
                break
        assert key.startswith(hold), key
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return proc.pid, str(Path(tmp).relative_to(store))


@pytest.mark.parametrize("what,hold,skip,landed,orphans", KILL_POINTS)
def test_publisher_killed_mid_upload(tmp_path, tally, caplog, what, hold, skip, landed, orphans):
    """The chain stays readable at the last version that landed; fsck names what the dead writer
    left; the next publisher takes over its lock and its first publish lands exactly; --repair
    leaves nothing behind."""
    store = tmp_path / "store"
    wanted = states(7)
    with injected(tally, f"publisher SIGKILL during {what}"):
        pid, tmp = kill_mid_upload(store, hold, skip)
        assert (store / tmp).is_file()  # the write in flight never moved into place

        chain = Chain(open_store(store, create=False))
        assert chain.latest().version == landed
        for v in range(landed + 1):  # every version that landed rebuilds exactly, through its own plan
            assert chain.plan(None, v)
            state, header = reconstruct(chain, v)
            assert header.version == v and same_bits(state, wanted[v]), v

        found = fsck_json(store)
        assert not found["ok"] and found["latest"] == landed
        assert sorted(found["orphans"]) == sorted([tmp, *orphans]), found
        assert found["writer"]["pid"] == pid and "DeltaPublisher" in found["writer"]["command"]
        if hold == "latest.json":
            assert any("v5 has a manifest but latest is v4" in p["what"] for p in found["problems"]), found

        # the trainer restarts from its last landed version and steps somewhere the dead one did not
        live = {k: t.clone() for k, t in wanted[landed].items()}
        nxt = perturb(live, 0.01, seed=100 + landed)
        with caplog.at_level(logging.WARNING):
            pub = DeltaPublisher(live, str(store), dtype=None, policy=POLICY, keep_anchors=1000)
        with pub:
            assert f"pid {pid}" in caplog.text and "taking over the stale writer lock" in caplog.text
            if hold == "latest.json":  # the dead writer's v5, published past latest: not ours to keep
                assert "discarded v5, published past latest (v4)" in caplog.text
            assert pub.version == landed
            for k, t in live.items():
                t.copy_(nxt[k])
            report = pub.publish().wait(120)
        assert report.version == landed + 1 and report.state_digest == state_digest(nxt)
        assert read_holder(open_store(store)) is None
        state, header = reconstruct(Chain(open_store(store)))
        assert header.version == landed + 1 and same_bits(state, nxt)

        fixed = fsck_json(store, "--repair")
        assert fixed["ok"] and fixed["latest"] == landed + 1, fixed
        assert f"deleted {tmp}" in fixed["repaired"], fixed
        assert not any(".tmp-" in f for f in files_in(store)), files_in(store)
        state, header = reconstruct(Chain(open_store(store)))
        assert header.version == landed + 1 and same_bits(state, nxt)


# ------------------------------------------------------------------------ objects damaged after publish


def damage(path: Path, how: str) -> None:
    """Bit rot, a cut-off upload, or an object deleted by hand, on the store's own files."""
    if how == "deleted":
        path.unlink()
        return
    data = bytearray(path.read_bytes())
    if how == "bit flip":
        data[len(data) // 2] ^= 0x10
    else:  # truncated
        del data[len(data) // 2:]
    path.write_bytes(bytes(data))


DAMAGE = ["bit flip", "truncated", "deleted"]
REASON = {"bit flip": "corrupt", "truncated": "corrupt", "deleted": "missing"}


def publish_states(store: str | Path, wanted: list[dict]) -> None:
    """Versions 0..len-1 of ``wanted`` (anchors at v0, v3, v6), every version kept."""
    live = {k: t.clone() for k, t in wanted[0].items()}
    with DeltaPublisher(live, str(store), dtype=None, policy=POLICY, keep_anchors=1000) as pub:
        for state in wanted[1:]:
            for k, t in live.items():
                t.copy_(state[k])
            pub.publish()


@pytest.mark.parametrize("how", DAMAGE)
def test_reader_refuses_a_damaged_object_and_routes_around_it(tmp_path, tally, how):
    """A damaged delta on a reader's path: refused, naming it; the next plan goes through an anchor.
    A damaged anchor: ``reconstruct`` rebuilds through an older anchor. No route left: refused."""
    store, wanted = tmp_path / "store", states(7)
    publish_states(store, wanted)
    chain = Chain(open_store(store, create=False))
    key = chain.manifest(5).object("delta").key
    with injected(tally, f"delta {how} after publish (a replica's plan routes through an anchor)"):
        plan = chain.plan(4, 6, chain.manifest(4).commitment)
        assert [(o.kind, o.version) for o in plan] == [("delta", 5), ("delta", 6)]
        damage(store / key, how)
        with pytest.raises(DeltaError) as e:
            chain.fetch(plan[0])
        assert e.value.reason == REASON[how] and key in str(e.value)
        tally.input(f"delta {how} after publish", refused=True)
        plan = chain.plan(4, 6, chain.manifest(4).commitment)
        assert [(o.kind, o.version) for o in plan] == [("anchor", 6)]
        state, header = reconstruct(chain, 6)
        assert header.version == 6 and same_bits(state, wanted[6])

    anchor = chain.manifest(3).object("anchor").key
    with injected(tally, f"anchor {how} after publish (reconstruct goes through an older anchor)"):
        damage(store / anchor, how)
        fresh = Chain(open_store(store, create=False))  # a reader that knows nothing yet
        state, header = reconstruct(fresh, 4)
        assert header.version == 4 and same_bits(state, wanted[4])
        assert [o.version for o in fresh.plan(None, 4)] == [0, 1, 2, 3, 4]

    last = chain.manifest(7).object("delta").key
    with injected(tally, f"delta {how} after publish, no other route (refused, older versions intact)"):
        damage(store / last, how)
        for reader in (chain, Chain(open_store(store, create=False))):
            with pytest.raises(DeltaError) as e:
                reconstruct(reader, 7)
            assert e.value.reason == REASON[how] and last in str(e.value)
        tally.input(f"delta {how} after publish, no other route", refused=True)
        state, header = reconstruct(Chain(open_store(store, create=False)), 6)
        assert header.version == 6 and same_bits(state, wanted[6])


# ------------------------------------------------------------------------ helpers for S3 and replicas

BUCKET = "deltasync-faults"
EVENT_TIMEOUT_S = 180.0


class LogWatch(logging.Handler):
    """Set once a record of ``logger`` contains ``text``: the test waits on the log line itself."""

    def __init__(self, logger: str, text: str):
        super().__init__(logging.DEBUG)
        self.text, self.seen = text, threading.Event()
        self.logger = logging.getLogger(logger)
        self.logger.addHandler(self)

    def emit(self, record: logging.LogRecord) -> None:
        if self.text in record.getMessage():
            self.seen.set()

    def wait(self, timeout: float = EVENT_TIMEOUT_S) -> bool:
        try:
            return self.seen.wait(timeout)
        finally:
            self.logger.removeHandler(self)


def wait_for(what: str, ready, server: Server | None = None, timeout: float = EVENT_TIMEOUT_S):
    """Poll ``ready()`` (an HTTP state, a log file) until it returns something truthy."""
    deadline = time.monotonic() + timeout
    while not (got := ready()):
        if server is not None:
            assert server.proc.poll() is None, f"the replica exited:\n{server.log()[-4000:]}"
        assert time.monotonic() < deadline, f"{what}: not after {timeout:.0f}s" + (
            f"\n{server.log()[-4000:]}" if server is not None else "")
        time.sleep(0.1)
    return got


def serves(server: Server, version: int) -> bool:
    return server.version()["version"] == version


def refused_count(server: Server, reason: str) -> float:
    for line in server.get("/metrics").text.splitlines():
        if line.startswith(f'deltasync_updates_refused_total{{reason="{reason}"}}'):
            return float(line.split()[-1])
    return 0.0


@pytest.fixture(scope="module")
def moto(tmp_path_factory) -> Iterator[MotoServer]:
    m = MotoServer(tmp_path_factory.mktemp("moto") / "moto.log")
    yield m
    m.stop()


@pytest.fixture(scope="module")
def map_cache(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("maps")


@pytest.fixture
def s3(moto: MotoServer, monkeypatch, request) -> Iterator[tuple[str, TcpProxy, dict[str, str]]]:
    """A fresh chain location in moto's bucket, reached by this process and its replicas through
    a relay the test controls; returns (uri, relay, the environment that reaches it)."""
    from s3fs import S3FileSystem

    proxy = TcpProxy(moto.port)
    env = S3_ENV | {"AWS_ENDPOINT_URL": proxy.url}
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    S3FileSystem.clear_instance_cache()  # instances are cached per arguments, not per endpoint
    moto.store(f"s3://{BUCKET}")
    yield f"s3://{BUCKET}/{request.node.name.replace('[', '-').rstrip(']')}", proxy, env
    proxy.close()
    S3FileSystem.clear_instance_cache()


def s3_get(uri: str, key: str) -> bytes:
    """The request line of a GET of ``key`` below ``uri`` (path-style, as s3fs sends it to an endpoint)."""
    return f"GET /{uri.removeprefix('s3://')}/{key}".encode()


def trainer_on(model_dir: Path, store: str, *, max_deltas: int, keep_anchors: int = 1000) -> FakeTrainer:
    """A trainer whose v0 is the base model (nothing uploaded) and that anchors every ``max_deltas``."""
    t = FakeTrainer(model_dir, store, lr=2e-5)
    t.publisher.policy, t.publisher.keep_anchors = AnchorPolicy(max_deltas=max_deltas), keep_anchors
    t.publisher.flush()
    return t


# ------------------------------------------------------------------------ the store unreachable for a while


def test_publisher_retries_through_a_store_outage(s3, tally):
    """The store goes away during an upload and comes back: the upload is retried and lands; no
    version is reported published that is not in the store, exact."""
    uri, proxy, _ = s3
    wanted = states(3)
    live = {k: t.clone() for k, t in wanted[0].items()}
    with DeltaPublisher(live, uri, dtype=None, policy=POLICY, keep_anchors=1000) as pub:
        for k, t in live.items():
            t.copy_(wanted[1][k])
        pub.publish().wait(EVENT_TIMEOUT_S)
        with injected(tally, "S3 store unreachable during an upload (the publisher retries)"):
            retrying = LogWatch("deltasync.publisher", "upload of v2 failed")
            proxy.down()
            for k, t in live.items():
                t.copy_(wanted[2][k])
            report = pub.publish()
            assert retrying.wait(), "the upload never failed while the store was down"
            assert not report.done
            proxy.up()
            assert report.wait(EVENT_TIMEOUT_S).kind == "delta"
    assert [r.kind for r in pub.reports] == ["anchor", "delta", "delta"] and not pub.errors
    chain = Chain(open_store(uri, create=False))
    assert chain.versions() == [0, 1, 2] and chain.latest().version == 2
    for v in range(3):
        state, header = reconstruct(chain, v)
        assert header.version == v and same_bits(state, wanted[v])


@pytest.mark.long
def test_an_outage_longer_than_the_retries_fails_the_version_openly_and_the_next_anchors(s3, tally):
    uri, proxy, _ = s3
    wanted = states(3)
    live = {k: t.clone() for k, t in wanted[0].items()}
    with injected(tally, "S3 store unreachable past every retry (version fails openly, the next anchors)"):
        with DeltaPublisher(live, uri, dtype=None, policy=POLICY, keep_anchors=1000, retries=1,
                            backoff_s=0.1) as pub:
            pub.flush()  # v0 landed
            proxy.down()
            for k, t in live.items():
                t.copy_(wanted[1][k])
            with pytest.raises(PublishError, match="v1 was not published"):
                pub.publish().wait(EVENT_TIMEOUT_S)
            proxy.up()
            for k, t in live.items():
                t.copy_(wanted[2][k])
            healed = pub.publish().wait(EVENT_TIMEOUT_S)
        assert healed.kind == "anchor" and healed.version == 2
        chain = Chain(open_store(uri, create=False))
        assert chain.versions() == [0, 2]  # v1 was never reported published, and is not there
        state, header = reconstruct(chain, 2)
        assert header.version == 2 and same_bits(state, wanted[2])


@pytest.mark.slow
def test_replica_catches_up_by_polling_after_a_store_outage(s3, tally, tiny_model_dir, tmp_path, map_cache):
    """Trainer and replica both lose the store while a version uploads; once it is back the upload
    lands and the replica, told nothing, reaches it by polling, exact."""
    uri, proxy, env = s3
    trainer = trainer_on(tiny_model_dir, uri, max_deltas=100)
    server = wait_ready(launch(tiny_model_dir, uri, tmp_path / "replica", "--poll-s", "0.5", map_cache=map_cache,
                               env=env))
    try:
        assert serves(server, 0)
        first = trainer.step().wait(EVENT_TIMEOUT_S)
        wait_for("the replica polls its way to v1", lambda: serves(server, 1), server)
        with injected(tally, "S3 store unreachable for trainer and replica (retry, then catch-up by polling)"):
            retrying = LogWatch("deltasync.publisher", "upload of v2 failed")
            polls = server.log().count("polling the store failed")
            proxy.down()
            report = trainer.step()
            assert retrying.wait(), "the upload never failed while the store was down"
            wait_for("the replica's poll fails", lambda: server.log().count("polling the store failed") > polls, server)
            proxy.up()
            report.wait(EVENT_TIMEOUT_S)
            wait_for("the replica polls its way to v2", lambda: serves(server, 2), server)
            live = server.live_digest()
            assert live["version"] == 2 and live["state_digest"] == report.state_digest
            assert report.state_digest == trainer.publisher.state_digest != first.state_digest
            state, header = reconstruct(Chain(open_store(uri, create=False)))
            assert header.version == 2 and state_digest(state) == report.state_digest
    finally:
        server.stop()
        trainer.close()


@pytest.mark.long
@pytest.mark.slow
def test_replica_retries_a_download_an_outage_cut(s3, tally, tiny_model_dir, tmp_path, map_cache):
    """The store goes away in the middle of the replica's download: once it is back, polling
    must catch up to that same version (no newer version is published to nudge it)."""
    uri, proxy, env = s3
    trainer = trainer_on(tiny_model_dir, uri, max_deltas=100)
    server = wait_ready(launch(tiny_model_dir, uri, tmp_path / "replica", "--poll-s", "0.5", map_cache=map_cache,
                               env=env))
    try:
        assert serves(server, 0)
        base = trainer.publisher.state_digest
        with injected(tally, "S3 store unreachable during a replica's download (catch-up by polling)"):
            hold = proxy.hold(s3_get(uri, "deltas/v00000001"))
            report = trainer.step().wait(EVENT_TIMEOUT_S)
            assert hold.hit.wait(EVENT_TIMEOUT_S), "the replica never asked for v1's delta"
            proxy.down()  # cuts the download, and refuses its retries
            hold.release.set()
            wait_for("the replica gives up on v1", lambda: "refused update to v1" in server.log(), server)
            assert serves(server, 0) and server.live_digest()["state_digest"] == base
            proxy.up()
            wait_for("the replica polls its way to v1", lambda: serves(server, 1), server, timeout=60)
            assert server.live_digest()["state_digest"] == report.state_digest
    finally:
        server.stop()
        trainer.close()


# ------------------------------------------------------------------------ a replica meets damaged objects


@pytest.mark.slow
def test_replica_refuses_damaged_objects_and_routes_around_them(tiny_model_dir, tmp_path, tally, map_cache):
    """Per damage: the replica's /update refuses the damaged delta (the reason and the object in
    the answer, counted in /metrics) and keeps serving its version; the next /update routes
    through the anchor and lands exact. With no route left it keeps serving and says why."""
    store = tmp_path / "store"
    trainer = trainer_on(tiny_model_dir, str(store), max_deltas=2)  # v0 the base model; anchors at v2, v4, ...
    server = wait_ready(launch(tiny_model_dir, store, tmp_path / "replica", map_cache=map_cache))
    chain = Chain(open_store(store))
    try:
        held = 0
        for how in DAMAGE:
            first, second = trainer.step().wait(EVENT_TIMEOUT_S), trainer.step().wait(EVENT_TIMEOUT_S)
            assert second.kind == "delta+anchor", second
            key = chain.manifest(first.version).object("delta").key
            with injected(tally, f"replica: delta {how} after publish (refused, then routed through an anchor)"):
                damage(store / key, how)
                before = refused_count(server, REASON[how])
                r = server.update()
                assert r.status_code == (404 if how == "deleted" else 422), r.text
                body = r.json()
                assert body["refused"]["reason"] == REASON[how] and key in body["refused"]["message"], body
                assert body["version"] == held and serves(server, held)
                assert refused_count(server, REASON[how]) == before + 1
                tally.input(f"replica: delta {how} after publish", refused=True)
                r = server.update()
                assert r.status_code == 200, r.text
                assert [(s["kind"], s["version"]) for s in r.json()["steps"]] == [("anchor", second.version)]
                live = server.live_digest()
                assert live["version"] == second.version and live["state_digest"] == second.state_digest
                held = second.version

        last = trainer.step().wait(EVENT_TIMEOUT_S)  # a delta only: nothing else reaches it
        key = chain.manifest(last.version).object("delta").key
        with injected(tally, "replica: delta bit flip with no other route (keeps serving, says why)"):
            damage(store / key, "bit flip")
            before = refused_count(server, "corrupt")
            for _ in range(2):  # asking again does not help, and changes nothing
                r = server.update()
                assert r.status_code == 422 and r.json()["refused"]["reason"] == "corrupt", r.text
                assert key in r.json()["refused"]["message"] and r.json()["version"] == held
                tally.input("replica: delta bit flip, no other route", refused=True)
            assert refused_count(server, "corrupt") == before + 2
            out = server.complete()
            assert out["policy_version"] == held
            live = server.live_digest()
            assert live["version"] == held and live["state_digest"] == chain.manifest(held).state_digest
            healed = trainer.step().wait(EVENT_TIMEOUT_S)  # the trainer goes on; this one anchors
            assert healed.kind == "delta+anchor"
            r = server.update()
            assert r.status_code == 200 and r.json()["version"] == healed.version, r.text
            assert server.live_digest()["state_digest"] == healed.state_digest
    finally:
        server.stop()
        trainer.close()


# ------------------------------------------------------------------------ retention racing a late joiner


@pytest.mark.slow
def test_retention_deletes_what_a_late_joiner_planned(s3, tally, tiny_model_dir, tmp_path, map_cache):
    """A replica starting late plans v0 -> v1 -> v2; while it downloads, an anchor lands and
    retention deletes v0..v2. It applies none of the run it could not finish (it serves v0, exact),
    says why, and the next /update plans again from the anchor and lands exact."""
    uri, proxy, env = s3
    trainer = trainer_on(tiny_model_dir, uri, max_deltas=3, keep_anchors=1)
    base = trainer.publisher.state_digest
    for _ in range(2):
        trainer.step().wait(EVENT_TIMEOUT_S)
    hold = proxy.hold(s3_get(uri, "deltas/v00000002"))  # the second object of its planned run
    server = launch(tiny_model_dir, uri, tmp_path / "replica", map_cache=map_cache, env=env)
    try:
        with injected(tally, "retention deletes the objects a late joiner planned, mid-download"):
            wait_for("the late joiner downloads v2's delta", lambda: hold.hit.is_set(), server)
            anchored = trainer.step().wait(EVENT_TIMEOUT_S)
            assert anchored.kind == "delta+anchor" and anchored.dropped == [0, 1, 2], anchored
            hold.release.set()
            wait_ready(server)
            said = [line for line in server.log().splitlines() if "refused update to v2: missing" in line]
            assert said and "deltas/v00000002.safetensors" in said[0], server.log()[-3000:]
            assert refused_count(server, "missing") == 1
            assert serves(server, 0)  # v1's delta was downloaded, but a run is applied whole or not at all
            assert server.live_digest()["state_digest"] == base
            r = server.update()
            assert r.status_code == 200, r.text
            assert [(s["kind"], s["version"]) for s in r.json()["steps"]] == [("anchor", 3)]
            live = server.live_digest()
            assert live["version"] == 3 and live["state_digest"] == anchored.state_digest
    finally:
        server.stop()
        trainer.close()
