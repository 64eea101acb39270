"""One writer per store, a publisher that cannot lose versions, and fsck that checks and repairs."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time

import pytest

from shared.chain import LATEST, Chain, Latest, delta_key, reconstruct
from shared.errors import DeltaError
from shared.fsck import check, repair
from shared.lock import LOCK_KEY, Holder, WriterLock, read_holder
from shared.publisher import DeltaPublisher, PublishError
from shared.stores import open_store

from .cli_process import run_cli
from .helpers import same_bits
from .test_chain import ROOT, FlakyStore, drifting, publish_chain


def dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def plant_lock(store, *, pid: int, host: str | None = None, renewed: float | None = None) -> None:
    now = time.time()
    store.put(LOCK_KEY, Holder(id="planted", host=host or socket.gethostname(), pid=pid, command="another trainer",
                               since=now, renewed=renewed or now, ttl_s=120).model_dump_json().encode())


# ---------------------------------------------------------------------------------------- the lock


def test_second_publisher_is_refused_and_the_store_stays_readable(tmp_path):
    gen = drifting(3)
    live = next(gen)
    with DeltaPublisher(live, str(tmp_path), dtype=None) as first:
        next(gen)
        first.publish().wait()
        with pytest.raises(DeltaError) as e:
            DeltaPublisher(live, str(tmp_path), dtype=None)
        assert e.value.reason == "locked"
        assert "already has a writer: DeltaPublisher" in str(e.value) and "--break-lock" in str(e.value)
        next(gen)
        first.publish()
    assert read_holder(open_store(tmp_path)) is None  # released at close
    state, header = reconstruct(Chain(open_store(tmp_path)))
    assert header.version == 2 and same_bits(state, live)
    with DeltaPublisher(live, str(tmp_path), dtype=None) as again:  # free again: continues the chain
        assert again.version == 2


def test_a_dead_writers_lock_is_taken_over(tmp_path):
    store = open_store(tmp_path)
    plant_lock(store, pid=dead_pid())  # same host, process gone
    with WriterLock(store, "me") as lock:
        assert read_holder(store).id == lock.me.id
    plant_lock(store, pid=os.getpid(), host="elsewhere", renewed=time.time() - 600)  # not renewed: stale
    with WriterLock(store, "me"):
        pass
    plant_lock(store, pid=os.getpid(), host="elsewhere")  # alive elsewhere, renewed: refused
    with pytest.raises(DeltaError, match="another trainer"):
        WriterLock(store, "me").acquire()


def test_a_writer_that_lost_its_lock_stops(tmp_path):
    gen = drifting(2)
    live = next(gen)
    pub = DeltaPublisher(live, str(tmp_path), dtype=None)
    plant_lock(pub.store, pid=os.getpid(), host="elsewhere")  # e.g. `fsck --break-lock` and a new writer
    pub._lock.renew()  # what its renewal thread does every ttl/4
    next(gen)
    with pytest.raises(DeltaError, match="writer lock was taken by another trainer"):
        pub.publish()
    pub.close()
    assert read_holder(pub.store).id == "planted"  # close() leaves the other writer's lock alone


def test_concurrent_publish_of_one_version_is_a_conflict(tmp_path):
    """Without the lock (two Chains on one store), the second manifest for a version is refused."""
    publish_chain(str(tmp_path), 2)
    store = open_store(tmp_path)
    chain = Chain(store)
    m = chain.manifest(2)
    store.put(LATEST, Latest(version=1, commitment=chain.manifest(1).commitment).model_dump_json().encode())
    from shared.codec import read_header
    header = read_header(store.download(m.object("delta").key, tmp_path / "d.safetensors"))
    header.commitment = "0" * 64  # another writer's v2
    with pytest.raises(DeltaError) as e:
        chain.publish(header, {}, m.objects)
    assert e.value.reason == "conflict" and "fsck" in str(e.value)
    assert chain.manifest(2, refresh=True).commitment == m.commitment  # untouched


def test_completing_an_unfinished_publish_keeps_the_objects_its_manifest_names(tmp_path):
    """A publish that wrote its manifest but not ``latest``, completed by a new encoding of the same
    version (same commitment, other bytes: safetensors writes its metadata in no fixed order):
    the objects the manifest names stay as they were, ``latest`` moves, and the version rebuilds."""
    states, _ = publish_chain(str(tmp_path), 2)
    store = open_store(tmp_path)
    chain = Chain(store)
    m = chain.manifest(2)
    store.put(LATEST, Latest(version=1, commitment=chain.manifest(1).commitment).model_dump_json().encode())
    key = m.object("delta").key
    first = store.get(key)
    from shared.codec import read_header
    header = read_header(store.download(key, tmp_path / "d.safetensors"))
    assert chain.publish(header, {key: b"another encoding of v2"}, m.objects).commitment == m.commitment
    assert store.get(key) == first
    state, rebuilt = reconstruct(Chain(open_store(tmp_path)))
    assert rebuilt.version == 2 and same_bits(state, states[2])


# ---------------------------------------------------------------------------------------- publisher


def test_close_is_idempotent_and_publish_after_close_raises(tmp_path):
    gen = drifting(2)
    live = next(gen)
    with DeltaPublisher(live, str(tmp_path), dtype=None) as pub:
        next(gen)
        report = pub.publish()
        pub.close()  # inside `with`: __exit__ closes again
    pub.close()
    assert report.done and report.wait(0).kind == "delta"
    next(gen)
    with pytest.raises(RuntimeError, match="after close"):
        pub.publish()
    assert Chain(open_store(tmp_path)).latest().version == 1


def test_a_script_that_never_closes_still_uploads_everything(tmp_path):
    script = (
        "import logging, sys, torch; logging.basicConfig(level=logging.INFO)\n"
        "from shared.publisher import DeltaPublisher\n"
        "state = {'w': torch.zeros(256, 256, dtype=torch.bfloat16)}\n"
        f"pub = DeltaPublisher(state, {str(tmp_path)!r}, queue_size=8)\n"
        "for i in range(5):\n"
        "    state['w'][i, :4] = 1.0 + i\n"
        "    pub.publish()\n"
        "print('done', flush=True)\n")  # no close()
    r = subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    chain = Chain(open_store(tmp_path))
    assert chain.latest().version == 5 and reconstruct(chain)[1].version == 5
    assert read_holder(open_store(tmp_path)) is None


def test_a_failed_version_raises_from_wait_and_healing_names_no_missing_base(tmp_path):
    gen = drifting(4)
    live = next(gen)
    store = FlakyStore(open_store(tmp_path), {"v00000002"}, times=100)
    pub = DeltaPublisher(live, store, retries=1, backoff_s=0, dtype=None)
    next(gen)
    pub.publish().wait()
    next(gen)
    failed = pub.publish()
    with pytest.raises(PublishError, match="v2 was not published: simulated outage"):
        failed.wait(60)
    store.times = 0
    next(gen)
    healed = pub.publish().wait(60)
    pub.close()
    assert healed.kind == "anchor" and healed.version == 3
    m = Chain(open_store(tmp_path)).manifest(3)
    assert [o.kind for o in m.objects] == ["anchor"]  # no "delta from v2", which never landed
    assert check(open_store(tmp_path)).ok


def test_retention_reports_what_it_deleted(tmp_path):
    from shared.chain import AnchorPolicy

    gen = drifting(7)
    live = next(gen)
    with DeltaPublisher(live, str(tmp_path), dtype=None, policy=AnchorPolicy(max_deltas=2)) as pub:
        reports = [pub.publish() for _ in gen]
    dropped = [v for r in reports for v in r.dropped]
    chain = Chain(open_store(tmp_path))
    assert dropped and not set(dropped) & set(chain.versions())
    assert set(dropped) | set(chain.versions()) == set(range(8))


# ---------------------------------------------------------------------------------------- fsck


def test_fsck_of_a_healthy_store(tmp_path):
    publish_chain(str(tmp_path), 6)
    report = check(open_store(tmp_path))
    assert report.ok and report.latest == 6 and report.restorable == list(range(7)) and report.writer is None


def test_fsck_repairs_an_unfinished_publish_and_a_damaged_tail(tmp_path):
    states, _ = publish_chain(str(tmp_path), 6)  # anchors at 0 and 4 (max_deltas=4)
    store = open_store(tmp_path)
    # a writer died after v6's manifest, before latest moved; v5's delta was damaged; junk left behind
    store.put(LATEST, Latest(version=5, commitment=Chain(store).manifest(5).commitment).model_dump_json().encode())
    raw = store.get(delta_key(4, 5))
    store.put(delta_key(4, 5), raw[:-1] + bytes([raw[-1] ^ 1]))
    store.put("deltas/v00000009.safetensors", b"junk")
    (tmp_path / "deltas" / "v00000007.safetensors.tmp-abc").write_bytes(b"partial")
    found = check(store)
    whats = " | ".join(f.what for f in found.problems)
    assert not found.ok and found.restorable == [0, 1, 2, 3, 4]
    assert "latest (v5) cannot be rebuilt" in whats and "v6 has a manifest but latest is v5" in whats
    assert set(found.orphans) == {"deltas/v00000009.safetensors", "deltas/v00000007.safetensors.tmp-abc"}

    fixed = repair(store)
    assert fixed.ok and fixed.latest == 4 and fixed.versions == [0, 1, 2, 3, 4], fixed.problems
    assert "latest -> v4" in fixed.repaired and "deleted manifest v6" in fixed.repaired
    state, header = reconstruct(Chain(open_store(tmp_path)))
    assert header.version == 4 and same_bits(state, states[4])
    # the chain goes on from there
    gen = drifting(6)
    live = next(gen)
    for _ in range(4):
        next(gen)
    with DeltaPublisher(live, str(tmp_path), dtype=None) as pub:
        assert pub.version == 4
        next(gen)
        pub.publish().wait(60)
    assert check(open_store(tmp_path)).ok


def test_fsck_repair_waits_for_no_live_writer(tmp_path):
    gen = drifting(1)
    live = next(gen)
    with DeltaPublisher(live, str(tmp_path), dtype=None):
        with pytest.raises(DeltaError, match="already has a writer"):
            repair(open_store(tmp_path))
        assert check(open_store(tmp_path)).writer.command == "DeltaPublisher"


# ---------------------------------------------------------------------------------------- the CLI



def deltasync(*args: str, cwd) -> subprocess.CompletedProcess:
    return run_cli(args, cwd=cwd, env={**os.environ, "PYTHONPATH": str(ROOT)})


def checkpoints(folder, n: int) -> list[str]:
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    state = {"a.weight": torch.randn(64, 64).bfloat16()}
    names = []
    for i in range(n):
        if i:
            state["a.weight"][i, :3] += 1
        names.append(f"c{i}.safetensors")
        save_file(state, str(folder / names[-1]))
    return names


def listing(folder) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_cli_push_and_squash_refuse_while_another_writer_holds_the_store(tmp_path):
    files = checkpoints(tmp_path, 4)
    for f in files[:3]:
        assert deltasync("push", "st", f, cwd=tmp_path).returncode == 0
    store = open_store(tmp_path / "st")
    with WriterLock(store, "a trainer elsewhere"):
        before = listing(tmp_path / "st")
        for args in (("push", "st", files[3]), ("squash", "st", "--from", "0", "--to", "2")):
            r = deltasync(*args, cwd=tmp_path)
            assert r.returncode == 1 and "Traceback" not in r.stderr, r.stderr
            assert "already has a writer: a trainer elsewhere" in r.stderr and len(r.stderr.strip().splitlines()) == 1
        assert listing(tmp_path / "st") == before
    r = deltasync("push", "st", files[3], cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.startswith("v3 (delta)"), r.stderr


def test_cli_push_names_what_retention_deleted(tmp_path):
    files = checkpoints(tmp_path, 6)
    outs = [deltasync("push", "st", f, "--keep-anchors", "1", cwd=tmp_path) for f in files]
    assert all(r.returncode == 0 for r in outs)
    text = "".join(r.stdout for r in outs)
    assert "retention (--keep-anchors 1) deleted v0..v3" in text  # the anchor at v4 (max 4 deltas) frees v0..v3
    assert Chain(open_store(tmp_path / "st")).versions() == [4, 5]


def test_cli_fsck_finds_repairs_and_breaks_locks(tmp_path):
    files = checkpoints(tmp_path, 4)
    for f in files:
        assert deltasync("push", "st", f, cwd=tmp_path).returncode == 0
    r = deltasync("fsck", "st", cwd=tmp_path)
    assert r.returncode == 0 and r.stdout.strip() == "st: latest v3, 4 of 4 versions restorable: ok", r.stdout
    store = open_store(tmp_path / "st")
    raw = store.get(delta_key(2, 3))
    store.put(delta_key(2, 3), raw[:-1] + bytes([raw[-1] ^ 1]))  # bit rot in the newest delta
    plant_lock(store, pid=dead_pid())
    r = deltasync("fsck", "st", cwd=tmp_path)
    assert r.returncode == 1 and "problem: deltas/v00000003.safetensors" in r.stdout and "NOT OK" in r.stdout
    assert "(stale)" in r.stdout
    r = deltasync("fsck", "st", "--repair", "--json", cwd=tmp_path)
    assert r.returncode == 0, r.stdout + r.stderr
    import json

    report = json.loads(r.stdout)
    assert report["ok"] and report["latest"] == 2 and "latest -> v2" in report["repaired"]
    assert report["writer"] is None  # the stale lock was taken over, then released
    assert deltasync("pull", "st", "-o", "v2.safetensors", cwd=tmp_path).returncode == 0
    plant_lock(store, pid=os.getpid(), host="elsewhere")
    r = deltasync("fsck", "st", "--break-lock", cwd=tmp_path)
    assert r.returncode == 0 and "removed the writer lock of another trainer" in r.stdout
    assert read_holder(store) is None
