"""Reliability under concurrency (issue 9): an all-or-nothing apply whose batches run on threads,
and a publisher whose slow replica delays neither uploads nor the other replicas."""

from __future__ import annotations

import json
import threading
from concurrent.futures import ThreadPoolExecutor
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from shared import changes
from shared.apply import Patch, flat_bits, write_all
from shared.chain import Chain
from shared.publisher import DeltaPublisher
from shared.stores import open_store

WAIT = 30  # seconds an event may take before the test fails (never a sleep)


# ---------------------------------------------------------------------------------- apply
@pytest.fixture
def four_threads(monkeypatch):
    pool = ThreadPoolExecutor(max_workers=4, thread_name_prefix="test-tensors")
    monkeypatch.setitem(changes._POOLS, "tensors", pool)
    yield pool
    pool.shutdown(wait=True)


def _patch(cls, target: torch.Tensor, start: int, n: int, **kw) -> Patch:
    flat = flat_bits(target)
    pos = torch.arange(start, start + n)
    old = flat.index_select(0, pos)
    p = cls(f"t{start}", flat, pos, old ^ 0x5A5A, old)
    for k, v in kw.items():
        setattr(p, k, v)
    return p


class Boom(RuntimeError):
    pass


def test_no_batch_writes_after_a_failure_and_rollback_waits_for_in_flight_ones(four_threads):
    """F fails while A is in the middle of its write; Z already wrote. Rollback starts (Z's
    revert) only after A finished, and A's write is reverted too: the target is bit-identical."""
    target = torch.randn(1000).bfloat16()
    before = target.clone()
    a_started, z_applied, rollback, a_done = (threading.Event() for _ in range(4))

    class Slow(Patch):  # A: its write lands only once rollback began, or after a timeout
        def apply(self):
            a_started.set()
            rollback.wait(timeout=3)
            super().apply()
            a_done.set()

    class Early(Patch):  # Z: written before the failure; its revert marks the start of rollback
        def apply(self):
            super().apply()
            z_applied.set()

        def revert(self):
            rollback.set()
            super().revert()

    class Failing(Patch):
        def apply(self):
            assert a_started.wait(WAIT) and z_applied.wait(WAIT)
            raise Boom("write failed")

    # weights 40/30/20 put F, A and Z in three different batches (threads)
    f = _patch(Failing, target, 0, 40)
    a = _patch(Slow, target, 100, 30)
    z = _patch(Early, target, 200, 20)
    with pytest.raises(Boom):
        write_all([z, a, f])  # rollback visits f, a, then z
    assert a_done.wait(WAIT)
    four_threads.shutdown(wait=True)  # nothing may still be writing
    assert torch.equal(target.view(torch.int16), before.view(torch.int16))
    assert not any(p.applied for p in (f, a, z))


@pytest.mark.parametrize("round", range(20))
def test_a_failing_batch_leaves_the_target_bit_identical(four_threads, round):
    torch.manual_seed(round)
    target = torch.randn(64 * 64).bfloat16()
    before = target.clone()
    patches = [_patch(Patch, target, i * 64, 1 + (i * 7) % 63) for i in range(64)]
    bad = round % len(patches)

    class Failing(Patch):
        def apply(self):
            super().apply()  # half-written, then fails
            raise Boom("write failed")

    patches[bad] = _patch(Failing, target, bad * 64, patches[bad].positions.numel())
    with pytest.raises(Boom):
        write_all(patches)
    four_threads.shutdown(wait=True)
    assert torch.equal(target.view(torch.int16), before.view(torch.int16))


# ------------------------------------------------------------------------------ publisher
class _Replica(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, release: threading.Event | None = None):
        self.release = release  # None: answer at once; else hold every /update until it is set
        self.got: dict[int, threading.Event] = {}
        self.lock = threading.Lock()
        super().__init__(("127.0.0.1", 0), _Handler)
        threading.Thread(target=self.serve_forever, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def seen(self, version: int) -> threading.Event:
        with self.lock:
            return self.got.setdefault(version, threading.Event())


class _Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def do_POST(self):
        server: _Replica = self.server  # type: ignore[assignment]
        version = json.loads(self.rfile.read(int(self.headers["Content-Length"])))["version"]
        server.seen(version).set()
        if server.release is not None:
            server.release.wait()
        body = json.dumps({"version": version}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)


def test_a_hung_replica_delays_neither_uploads_nor_the_other_replica(tmp_path):
    release = threading.Event()
    fast, slow = _Replica(), _Replica(release)
    live = {"w": torch.zeros(256, dtype=torch.bfloat16)}
    pub = DeltaPublisher(live, str(tmp_path), replicas=[fast.url, slow.url], dtype=None, queue_size=2,
                         retries=0, notify_timeout_s=WAIT * 2)
    reports = []
    published = threading.Event()

    def train():  # queue_size=2: before the fix the 4th publish() blocks behind the hung replica
        for v in range(1, 6):
            live["w"][v] = float(v)
            reports.append(pub.publish())
        published.set()

    trainer = threading.Thread(target=train, daemon=True)
    try:
        trainer.start()
        assert published.wait(WAIT), "training blocked behind a hung replica"
        assert fast.seen(5).wait(WAIT), "the answering replica never heard of v5"
        assert slow.seen(1).wait(WAIT)
        assert Chain(open_store(tmp_path)).latest().version == 5
        with pytest.raises(TimeoutError):  # v1 waits for every replica's answer
            reports[0].wait(timeout=0.05)
        assert not reports[-1].done
    finally:
        release.set()
    for r in reports:
        r.wait(timeout=WAIT)
        assert r.replicas == {fast.url: {"version": r.version}, slow.url: {"version": r.version}}
    pub.flush(timeout=WAIT)
    assert pub.pending == 0
    pub.close()
    assert [r.version for r in pub.reports] == [0, 1, 2, 3, 4, 5]
    fast.shutdown()
    slow.shutdown()


def test_close_waits_for_every_answer(tmp_path):
    release = threading.Event()
    slow = _Replica(release)
    live = {"w": torch.zeros(16, dtype=torch.bfloat16)}
    pub = DeltaPublisher(live, str(tmp_path), replicas=[slow.url], dtype=None, retries=0,
                         notify_timeout_s=WAIT * 2)
    live["w"][0] = 1.0
    report = pub.publish()
    assert slow.seen(1).wait(WAIT)
    closer = threading.Thread(target=pub.close)
    closer.start()
    assert not report.done
    release.set()
    closer.join(WAIT)
    assert not closer.is_alive() and report.done
    assert report.replicas == {slow.url: {"version": 1}}
    slow.shutdown()
