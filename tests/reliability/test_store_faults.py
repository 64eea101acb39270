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
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from library.helpers import perturb, same_bits

from reliability.publisher_proc import POLICY, states
from shared.chain import Chain, reconstruct
from shared.digest import state_digest
from shared.errors import DeltaError
from shared.lock import read_holder
from shared.process import REPO
from shared.publisher import DeltaPublisher
from shared.stores import open_store

PUBLISHER_PROC = Path(__file__).with_name("publisher_proc.py")
CLI = [sys.executable, "-m", "shared.cli"]


@contextlib.contextmanager
def injected(tally, case: str) -> Iterator[None]:
    """Count one fault; it survived when the block ran to its end (every check passed)."""
    survived = False
    try:
        yield
        survived = True
    finally:
        tally.fault(case, survived=survived)


def deltasync(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], cwd=REPO, check=False, capture_output=True, text=True, timeout=300)


def fsck_json(store: Path, *flags: str) -> dict:
    r = deltasync("fsck", str(store), "--json", *flags)
    assert r.returncode in (0, 1) and "Traceback" not in r.stderr, r.stderr
    return json.loads(r.stdout)


def files_in(folder: Path) -> set[str]:
    return {str(p.relative_to(folder)) for p in folder.rglob("*") if p.is_file()}


# ------------------------------------------------------------------------ the publisher killed mid-upload

# (what the write in flight is, key it holds, earlier writes of that key let through, latest after the kill)
KILL_POINTS = [
    ("a delta's upload", "deltas/v00000005", 0, 4),
    ("an anchor's upload after its version's delta landed", "anchors/v00000006", 0, 5),
    ("the manifest's create after the objects landed", "manifests/v00000005", 0, 4),
    ("moving latest after the manifest landed", "latest.json", 5, 4),
]


def kill_mid_upload(store: Path, hold: str, skip: int, versions: int = 7) -> tuple[int, str]:
    """Run the publisher until it blocks inside the held write, SIGKILL it there; returns its pid
    and the temporary file the write left."""
    proc = subprocess.Popen([sys.executable, str(PUBLISHER_PROC), str(store), str(versions), "--hold", hold,
                             "--skip", str(skip)], cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            if line.startswith("holding "):
                _, key, tmp = line.split()
                break
        else:
            pytest.fail(f"the publisher ended before holding {hold}: {proc.wait()} {proc.stderr.read()[-3000:]}")
        assert key.startswith(hold), key
        proc.send_signal(signal.SIGKILL)
        assert proc.wait(timeout=30) == -signal.SIGKILL
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stdout.close()  # type: ignore[union-attr]
        proc.stderr.close()  # type: ignore[union-attr]
    return proc.pid, str(Path(tmp).relative_to(store))


@pytest.mark.parametrize("what,hold,skip,landed", KILL_POINTS, ids=[k[1].split("/")[0] for k in KILL_POINTS])
def test_publisher_killed_mid_upload(tmp_path, tally, caplog, what, hold, skip, landed):
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
        assert tmp in found["orphans"], found
        assert found["writer"]["pid"] == pid and "DeltaPublisher" in found["writer"]["command"]
        if hold == "latest.json":
            assert any("v5 has a manifest but latest is v4" in p["what"] for p in found["problems"]), found

        # the trainer restarts from its last landed version and steps somewhere the dead one did not
        live = {k: t.clone() for k, t in wanted[landed].items()}
        nxt = perturb(live, 0.01, seed=100 + landed)
        with caplog.at_level(logging.WARNING, logger="deltasync.lock"):
            pub = DeltaPublisher(live, str(store), dtype=None, policy=POLICY, keep_anchors=1000)
        with pub:
            assert f"pid {pid}" in caplog.text and "taking over the stale writer lock" in caplog.text
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
