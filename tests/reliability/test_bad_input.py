"""Bad input at every boundary (issue 9): a clear error, nothing changed, and a count.

Three boundaries, each swept from a table: the rollout server's HTTP surface (bodies, headers,
query values, generation requests), objects in the store (what a replica's ``/update`` and the
library's ``Chain``/``reconstruct`` read), and the files the ``deltasync`` CLI is given. Single
cases already covered elsewhere (tests/library/test_damage.py, test_cli_errors.py,
tests/rollout/test_rollout_security.py, test_rollout_server.py) are the seeds; here every boundary
gets the whole table, and every input is counted with ``tally.input``.

A sweep runs every case of its table before it fails, so the counts say how many got through.
"""

from __future__ import annotations

import json
import shutil
import socket
import struct
from collections.abc import Callable, Iterable
from contextlib import chdir, redirect_stderr, redirect_stdout
from dataclasses import dataclass, field
from io import StringIO
from pathlib import Path

import httpx
import pytest
import safetensors.torch
import torch
from library.helpers import perturb, same_bits
from library.test_cli_errors import snapshot, template  # noqa: F401 - template is a fixture
from rollout.chain_helpers import FakeTrainer

from shared.apply import apply_delta
from shared.chain import (
    LATEST,
    Chain,
    Latest,
    Manifest,
    anchor_key,
    delta_key,
    manifest_key,
    reconstruct,
    ref_for,
)
from shared.codec import DeltaFile, Header, anchor_header, encode_delta, save_anchor
from shared.digest import commitment, state_digest
from shared.fingerprint import state_fingerprint_of
from shared.errors import DeltaError
from shared.publisher import DeltaPublisher
from shared.stores import open_store

from .servers import AUTH, STARTUP_TIMEOUT_S, TOKEN, Server, launch

MAX_BODY = 64 * 1024


@dataclass
class Case:
    """One bad input. ``expect``: acceptable HTTP statuses or exit codes; ``reason``: the refusal
    reason a replica (and ``/metrics``) or the library must give, when the input reaches it."""

    id: str
    data: object = None
    expect: tuple[int, ...] = ()
    reason: str | None = None
    extra: dict = field(default_factory=dict)


def sweep(tally, boundary: str, cases: Iterable[Case], check: Callable[[Case], None]) -> None:
    """Run ``check`` on every case, count each, then fail listing every case that got through."""
    failures = []
    for case in cases:
        try:
            check(case)
            refused = True
        except AssertionError as e:
            refused = False
            failures.append(f"{case.id}: {str(e).splitlines()[0] if str(e) else 'assertion failed'}")
        tally.input(boundary, refused=refused)
    assert not failures, f"{len(failures)} bad inputs got through:\n" + "\n".join(failures)


def one(tally, boundary: str, case: Case, check: Callable[[Case], None]) -> None:
    """A single case, counted under its own row (the known gaps)."""
    ok = False
    try:
        check(case)
        ok = True
    finally:
        tally.input(f"{boundary}: {case.id}", refused=ok)


# =============================================================================== the rollout server


@pytest.fixture(scope="module")
def rig(tiny_model_dir: Path, tmp_path_factory):
    """One replica for the module, at v2 of a trainer's chain (the trainer tells it nothing)."""
    work = tmp_path_factory.mktemp("bad-input")
    store = work / "store"
    trainer = FakeTrainer(tiny_model_dir, str(store), lr=2e-5)
    for _ in range(2):
        trainer.step()
    trainer.publisher.flush()
    server = launch(tiny_model_dir, store, work, "--max-body-bytes", str(MAX_BODY))
    try:
        server.wait_ready(STARTUP_TIMEOUT_S)
        assert server.get("/version").json()["version"] == 2
        yield Rig(server, trainer, store)
    finally:
        server.stop()
        trainer.close()


@dataclass
class Rig:
    server: Server
    trainer: FakeTrainer
    store: Path

    def served(self) -> tuple:
        """What the replica serves: version, commitment, state digest and the live weights' digest."""
        v = self.server.get("/version").json()
        live = self.server.live_digest()
        return v["version"], v["commitment"], v["state_digest"], v["status"], live["state_digest"]

    def refused_count(self, reason: str) -> float:
        needle = f'deltasync_updates_refused_total{{reason="{reason}"}} '
        for line in self.server.get("/metrics").text.splitlines():
            if line.startswith(needle):
                return float(line.split()[-1])
        return 0.0

    def unchanged_after(self, before: tuple) -> None:
        after = self.served()
        assert after == before, f"served {after[:2]} ... after, {before[:2]} ... before"
        assert after[2] == after[4], "held and live digests differ"
        assert self.server.get("/is_paused").json() == {"is_paused": False}, "left paused"
        out = self.server.complete(max_tokens=2)
        assert out["policy_version"] == before[0], out

    def recover(self, version: int) -> None:
        """After a case that got through: bring the replica back to ``version`` (re-sync, resume)."""
        self.server.post("/resume", headers=AUTH)
        if self.server.get("/version").json()["version"] != version:
            r = self.server.update(version)
            assert r.status_code == 200 and r.json()["version"] == version, r.text


def _reason_in_body(r: httpx.Response) -> str:
    """The refusal's text, wherever the endpoint puts it: FastAPI's ``detail``, vLLM's
    ``error.message``, or an update's ``refused``."""
    body = r.json()
    if isinstance(body, dict) and isinstance(body.get("refused"), dict):
        return body["refused"]["reason"] + ": " + body["refused"]["message"]
    if isinstance(body, dict) and "detail" in body:
        return json.dumps(body["detail"])
    if isinstance(body, dict) and isinstance(body.get("error"), dict):
        return str(body["error"].get("message", ""))
    return ""


def http_check(rig: Rig) -> Callable[[Case], None]:
    """``case.data``: (method, path, httpx kwargs). Refused with one of ``case.expect``, a reason in
    the body (and in /metrics when the engine refused), and the replica serving as before."""

    def check(case: Case) -> None:
        method, path, kw = case.data
        before = rig.served()
        counted = rig.refused_count(case.reason) if case.reason else 0
        try:
            r = httpx.request(method, rig.server.url + path, timeout=60, **kw)
            assert r.status_code in case.expect, f"HTTP {r.status_code}: {r.text[:200]}"
            assert r.headers.get("content-type", "").startswith("application/json"), r.headers
            why = _reason_in_body(r)
            assert why.strip(" \"'[]{}"), f"no reason in the body: {r.text[:200]}"
            if case.reason:
                assert r.json()["refused"]["reason"] == case.reason and r.json()["accepted"] is False, r.text
                assert rig.refused_count(case.reason) == counted + 1, f"{case.reason} not counted in /metrics"
            rig.unchanged_after(before)
        finally:
            rig.recover(before[0])

    return check


def raw_check(rig: Rig) -> Callable[[Case], None]:
    """``case.data``: the bytes of a whole HTTP request, sent as they are (headers httpx would not
    send). Answered with a 4xx status and the replica unchanged."""

    def check(case: Case) -> None:
        before = rig.served()
        with socket.create_connection(("127.0.0.1", rig.server.port), timeout=60) as s:
            s.sendall(case.data)
            s.shutdown(socket.SHUT_WR)
            reply = b""
            while chunk := s.recv(65536):
                reply += chunk
        status = int(reply.split(b" ", 2)[1]) if reply.startswith(b"HTTP/1.1 ") else None
        assert status in case.expect, f"answered {reply[:200]!r}"
        assert reply.split(b"\r\n\r\n", 1)[1].strip(), "no reason in the body"
        rig.unchanged_after(before)

    return check


def _update(body: bytes | str, *, headers: dict | None = None, query: str = "") -> tuple:
    return "POST", f"/update{query}", {"content": body, "headers": {"content-type": "application/json",
                                                                     **AUTH, **(headers or {})}}


def _json(obj) -> bytes:
    return json.dumps(obj).encode()


UPDATE_BODIES = [
    Case("not JSON", _update(b"{not json"), (422,)),
    Case("a JSON array", _update(b"[2]"), (422,)),
    Case("a JSON string", _update(b'"latest"'), (422,)),
    Case("JSON null", _update(b"null"), (422,)),
    Case("version as text", _update(_json({"version": "two"})), (422,)),
    Case("version as a float", _update(_json({"version": 1.5})), (422,)),
    Case("version as a list", _update(_json({"version": [2]})), (422,)),
    Case("version as an object", _update(_json({"version": {"$gt": 1}})), (422,)),
    Case("version NaN", _update(b'{"version": NaN}'), (422,)),
    Case("mode unknown", _update(_json({"mode": "explode"})), (422,)),
    Case("mode null", _update(_json({"mode": None})), (422,)),
    Case("invalid UTF-8", _update(b'{"version": "\xff\xfe"}'), (422,)),
    Case("deeply nested", _update(b"[" * 20000 + b"]" * 20000), (422,)),
    Case("negative version", _update(_json({"version": -1})), (422,)),
    Case("a misspelled field", _update(_json({"verison": 1})), (422,)),
    Case("an unknown field", _update(_json({"version": 2, "force": True})), (422,)),
    Case("an older version", _update(_json({"version": 1})), (409,), "out_of_order"),
    Case("a future version", _update(_json({"version": 7})), (404,), "missing"),
    Case("version 2**63", _update(_json({"version": 2**63})), (404,), "missing"),
    Case("version 10**30", _update(_json({"version": 10**30})), (404, 422)),
    Case("oversize body", _update(b" " * (MAX_BODY + 1)), (413,)),
    Case("oversize body, chunked", ("POST", "/update", {"content": iter([b" " * 40000] * 2), "headers": AUTH}),
         (413,)),
]

CONTROL = [("POST", "/update", {"json": {}}), ("POST", "/pause", {}), ("POST", "/resume", {}),
           ("GET", "/weights/digest?fresh=true", {})]
AUTH_HEADERS = [
    ("no Authorization", None),
    ("wrong token", "Bearer not-the-token"),
    ("token without a scheme", TOKEN),
    ("Basic scheme", f"Basic {TOKEN}"),
    ("the scheme alone", "Bearer"),
    ("token minus its last character", f"Bearer {TOKEN[:-1]}"),
    ("the token twice", f"Bearer {TOKEN},{TOKEN}"),
    ("a tab for the space", f"Bearer\t{TOKEN}"),
    ("non-ASCII bytes", b"Bearer \xff\xfe\xfd"),
    ("an 8 KB token", "Bearer " + "x" * 8192),
]
AUTH_CASES = [Case(f"{method} {path}: {name}",
                   (method, path, kw | {"headers": {} if value is None else {"Authorization": value}}), (401,))
              for method, path, kw in CONTROL for name, value in AUTH_HEADERS]

QUERY_CASES = [
    Case("/pause?mode=explode", ("POST", "/pause?mode=explode", {"headers": AUTH}), (422,)),
    Case("/pause?mode= (empty)", ("POST", "/pause?mode=", {"headers": AUTH}), (422,)),
    Case("/pause?clear_cache=maybe", ("POST", "/pause?clear_cache=maybe", {"headers": AUTH}), (422,)),
    Case("/pause?mode=WAIT (case)", ("POST", "/pause?mode=WAIT", {"headers": AUTH}), (422,)),
    Case("/update?wait=perhaps", _update(b"{}", query="?wait=perhaps"), (422,)),
    Case("/update?mode=bogus", _update(b"{}", query="?mode=bogus"), (422,)),
    Case("/weights/digest?fresh=perhaps", ("GET", "/weights/digest?fresh=perhaps", {}), (422,)),
]

BAD_COMPLETIONS = [
    ("not JSON", b"{not json"),
    ("a JSON array", b"[1, 2]"),
    ("an unknown model", {"model": "no-such-model", "prompt": "hi"}),
    ("prompt as a number", {"prompt": 5}),
    ("prompt as an object", {"prompt": {"text": "hi"}}),
    ("negative token id", {"prompt": [-5]}),
    ("temperature as text", {"prompt": "hi", "temperature": "hot"}),
    ("stop as a number", {"prompt": "hi", "stop": 5}),
    ("seed as text", {"prompt": "hi", "seed": "x"}),
    ("invalid UTF-8", b'{"prompt": "\xff\xfe"}'),
    ("no prompt", {}),
    ("token id outside the vocabulary", {"prompt": [10**6]}),
    ("max_tokens -1", {"prompt": "hi", "max_tokens": -1}),
    ("max_tokens 10**9", {"prompt": "hi", "max_tokens": 10**9}),
    ("temperature -1", {"prompt": "hi", "temperature": -1}),
    ("n = 0", {"prompt": "hi", "n": 0}),
    ("logprobs 1000", {"prompt": "hi", "logprobs": 1000}),
    ("top_p 7", {"prompt": "hi", "top_p": 7}),
]
BAD_CHATS = [
    ("messages as a string", {"messages": "hi"}),
    ("a message as a number", {"messages": [5]}),
    ("messages empty", {"messages": []}),
]


def _generation(path: str, body, model: str) -> tuple:
    if isinstance(body, dict) and "model" not in body:
        body = {"model": model, **body}
    content = body if isinstance(body, bytes) else _json(body)
    return "POST", path, {"content": content, "headers": {"content-type": "application/json"}}


def _raw(head: str, body: bytes = b"") -> bytes:
    return head.replace("\n", "\r\n").encode() + b"\r\n" + body


RAW_CASES = [
    Case("Content-Length not a number", _raw("POST /update HTTP/1.1\nHost: x\nAuthorization: Bearer "
                                            f"{TOKEN}\nContent-Length: abc\n", b"{}"), (400,)),
    Case("Content-Length negative", _raw("POST /update HTTP/1.1\nHost: x\nAuthorization: Bearer "
                                         f"{TOKEN}\nContent-Length: -1\n", b"{}"), (400,)),
    Case("Content-Length far over the limit", _raw("POST /update HTTP/1.1\nHost: x\nAuthorization: Bearer "
                                                   f"{TOKEN}\nContent-Length: 99999999999\n", b"{}"), (413,)),
    Case("two Content-Lengths", _raw("POST /update HTTP/1.1\nHost: x\nAuthorization: Bearer "
                                     f"{TOKEN}\nContent-Length: 2\nContent-Length: 5\n", b"{}"), (400,)),
    Case("a header line without a colon", _raw(f"POST /update HTTP/1.1\nHost: x\nAuthorization: Bearer {TOKEN}\n"
                                               "garbage\nContent-Length: 2\n", b"{}"), (400,)),
    Case("a NUL byte in Authorization", _raw(f"POST /update HTTP/1.1\nHost: x\nAuthorization: Bearer {TOKEN}\0\n"
                                             "Content-Length: 2\n", b"{}"), (400,)),
]

CONTENT_TYPE_CASES = [
    Case("/update: a form-encoded body", _update(b"version=2", headers={
        "content-type": "application/x-www-form-urlencoded"}), (415,)),
    Case("/update: a multipart body", _update(b"--b\r\nContent-Disposition: form-data; name=version\r\n\r\n2\r\n--b--",
                                              headers={"content-type": "multipart/form-data; boundary=b"}), (415,)),
    Case("/update: text/plain", _update(_json({"version": 2}), headers={"content-type": "text/plain"}), (415,)),
    Case("/v1/completions: text/plain", ("POST", "/v1/completions", {"content": b'{"prompt": "hi"}', "headers": {
        "content-type": "text/plain"}}), (415,)),
]


@pytest.mark.slow
def test_update_bodies(rig: Rig, tally):
    sweep(tally, "rollout POST /update: bad bodies", UPDATE_BODIES, http_check(rig))


@pytest.mark.slow
def test_authorization_headers(rig: Rig, tally):
    def check(case: Case) -> None:
        http_check(rig)(case)
        r = httpx.request(case.data[0], rig.server.url + case.data[1], timeout=60, **case.data[2])
        assert r.json() == {"detail": "missing or wrong bearer token"}, r.text
        assert r.headers["www-authenticate"] == "Bearer"

    sweep(tally, "rollout control routes: bad Authorization", AUTH_CASES, check)


@pytest.mark.slow
def test_query_values(rig: Rig, tally):
    sweep(tally, "rollout /pause /update /weights/digest: bad query values", QUERY_CASES, http_check(rig))


@pytest.mark.slow
def test_garbled_requests(rig: Rig, tally):
    sweep(tally, "rollout: garbled HTTP headers", RAW_CASES, raw_check(rig))
    sweep(tally, "rollout /update: wrong content types", CONTENT_TYPE_CASES, http_check(rig))


@pytest.mark.slow
def test_generation_requests(rig: Rig, tally):
    model = rig.server.model
    cases = [Case(f"/v1/completions: {name}", _generation("/v1/completions", body, model), (400, 404, 422))
             for name, body in BAD_COMPLETIONS]
    cases += [Case(f"/v1/chat/completions: {name}", _generation("/v1/chat/completions", body, model),
                   (400, 404, 422)) for name, body in BAD_CHATS]
    sweep(tally, "rollout /v1 generation: garbage requests", cases, http_check(rig))


# =============================================================================== store objects


@dataclass
class Held:
    """A chain's newest good version, which a reader or replica holds; damage goes at the next."""

    store_dir: Path
    state: dict[str, torch.Tensor]
    header: Header

    @property
    def next(self) -> int:
        return self.header.version + 1

    def put(self, key: str, data: bytes) -> None:
        open_store(str(self.store_dir)).put(key, data)

    def publish(self, objects: dict[str, bytes], refs: list, *, commitment_: str, state_fingerprint_: str,
                state_digest_: str) -> None:
        """Objects, manifest, latest: the publish order, with whatever objects the case made."""
        for key, data in objects.items():
            self.put(key, data)
        m = Manifest(version=self.next, commitment=commitment_, base_commitment=self.header.commitment,
                     state_fingerprint=state_fingerprint_, state_digest=state_digest_, created=0.0, objects=refs)
        self.put(manifest_key(self.next), m.model_dump_json().encode())
        self.put(LATEST, Latest(version=self.next, commitment=commitment_).model_dump_json().encode())

    def new_state(self, seed: int = 11) -> dict[str, torch.Tensor]:
        return perturb(self.state, 0.02, seed)

    def delta(self, new: dict[str, torch.Tensor] | None = None, base_commitment: str | None = None) -> bytes:
        return encode_delta(self.state, new or self.new_state(), version=self.next,
                            base_version=self.header.version,
                            base_commitment=self.header.commitment if base_commitment is None else base_commitment)

    def delta_object(self, data: bytes, *, key: str | None = None, header: Header | None = None) -> None:
        """``data`` as the next version's delta; the manifest names it (size, blake3) as the
        chain would, and takes its commitment from ``header`` (default: a good delta's)."""
        header = header or DeltaFile.from_bytes(self.delta()).header
        k = delta_key(self.header.version, self.next)
        ref = ref_for("delta", header, k, data).model_copy(update={"key": key}) if key else \
            ref_for("delta", header, k, data)
        self.publish({k: data}, [ref], commitment_=header.commitment, state_fingerprint_=header.state_fingerprint,
                     state_digest_=header.state_digest)

    def anchor_object(self, content: dict[str, torch.Tensor], claimed: dict[str, torch.Tensor],
                      damage: Callable[[bytes], bytes] = lambda b: b) -> None:
        """An anchor file of ``content`` as the next version, whose manifest claims ``claimed``."""
        sd, sf = state_digest(claimed), state_fingerprint_of(claimed)
        c = commitment(self.header.commitment, sf)
        h = anchor_header(content, version=self.next, base_version=self.header.version,
                          base_commitment=self.header.commitment)
        tmp = self.store_dir.parent / "anchor.tmp"
        save_anchor(content, tmp, h)
        data = damage(tmp.read_bytes())
        tmp.unlink()
        ref = ref_for("anchor", h, anchor_key(self.next), data)
        self.publish({anchor_key(self.next): data}, [ref], commitment_=c, state_fingerprint_=sf, state_digest_=sd)


def _flip_in_data(data: bytes) -> bytes:
    """Flip one bit in a safetensors file's tensor bytes, past its header."""
    (n,) = struct.unpack("<Q", data[:8])
    out = bytearray(data)
    out[8 + n + 17] ^= 0x10
    return bytes(out)


def _garbage_header(h: Held) -> None:
    h.delta_object(struct.pack("<Q", 32) + b"\x01" * 32 + b"\x00" * 64)


def _manifest_raw(raw: bytes) -> Callable[[Held], None]:
    def make(h: Held) -> None:
        h.put(manifest_key(h.next), raw)
        h.put(LATEST, Latest(version=h.next, commitment="c").model_dump_json().encode())
    return make


def _key_outside(key: str) -> Callable[[Held], None]:
    return lambda h: h.delta_object(h.delta(), key=key)


def _latest_raw(raw: bytes) -> Callable[[Held], None]:
    return lambda h: h.put(LATEST, raw)


def _swapped_delta(h: Held) -> None:
    """The manifest names one delta (size, blake3); the store holds another of the same size."""
    good, other = h.delta(h.new_state(11)), h.delta(h.new_state(12))
    header = DeltaFile.from_bytes(good).header
    k = delta_key(h.header.version, h.next)
    ref = ref_for("delta", header, k, good)
    h.publish({k: other}, [ref], commitment_=header.commitment, state_fingerprint_=header.state_fingerprint,
              state_digest_=header.state_digest)


def _wrong_base(h: Held) -> None:
    data = h.delta(base_commitment=h.header.commitment[::-1])
    h.delta_object(data, header=DeltaFile.from_bytes(data).header)


STORE_CASES: list[tuple[str, Callable[[Held], None], str, int]] = [
    # (case, how the next version is damaged, refusal reason, HTTP status of the replica's refusal)
    ("manifest: not JSON", _manifest_raw(b"{not json"), "format", 422),
    ("manifest: empty", _manifest_raw(b""), "format", 422),
    ("manifest: wrong schema", _manifest_raw(b'{"version": "three", "objects": 5}'), "format", 422),
    ("manifest: objects not a list", _manifest_raw(json.dumps({
        "version": 3, "commitment": "c", "base_commitment": "b", "state_digest": "s", "created": 0,
        "objects": {"kind": "delta"}}).encode()), "format", 422),
    ("manifest: key ../latest.json", _key_outside("../latest.json"), "format", 422),
    ("manifest: key /etc/passwd", _key_outside("/etc/passwd"), "format", 422),
    ("manifest: key manifests/v00000000.json", _key_outside("manifests/v00000000.json"), "format", 422),
    ("manifest: key latest.json", _key_outside("latest.json"), "format", 422),
    ("manifest: key deltas/../latest.json", _key_outside("deltas/../latest.json"), "format", 422),
    ("manifest: key deltas/ (a folder)", _key_outside("deltas/"), "format", 422),
    ("latest: names a version with no manifest", _latest_raw(b'{"version": 9, "commitment": "c"}'), "missing", 404),
    ("delta: garbage header", _garbage_header, "format", 422),
    ("delta: header length 2**60", lambda h: h.delta_object((1 << 60).to_bytes(8, "little") + b"{}"),
     "format", 422),
    ("delta: empty object", lambda h: h.delta_object(b""), "format", 422),
    ("delta: a plain checkpoint", lambda h: h.delta_object(safetensors.torch.save(
        {"w": torch.zeros(4, dtype=torch.bfloat16)})), "format", 422),
    ("delta: truncated to half", lambda h: h.delta_object(h.delta()[: len(h.delta()) // 2]), "format", 422),
    ("delta: not the object the manifest names", _swapped_delta, "corrupt", 422),
    ("delta: wrong base commitment", _wrong_base, "wrong_base", 409),
    ("anchor: a tensor's bytes flipped", lambda h: h.anchor_object(h.new_state(), h.new_state(), _flip_in_data),
     "corrupt", 422),
    ("latest: not JSON", _latest_raw(b"{garbage"), "format", 422),
    ("anchor: another state than the manifest's", lambda h: h.anchor_object(h.new_state(12), h.new_state(11)),
     "corrupt", 422),
]



class StoreRestore:
    """Put a store folder back exactly as it was (a case's damage removed)."""

    def __init__(self, root: Path):
        self.root, self.saved = root, snapshot(root)

    def __call__(self) -> None:
        for p in sorted(self.root.rglob("*"), reverse=True):
            rel = str(p.relative_to(self.root))
            if rel not in self.saved:
                p.unlink() if p.is_file() else p.rmdir()
        for rel, data in self.saved.items():
            p = self.root / rel
            if data is None:
                p.mkdir(exist_ok=True)
            elif not p.exists() or p.read_bytes() != data:
                p.write_bytes(data)


def library_refuses(h: Held, reason: str) -> None:
    """A reader from nothing (``reconstruct``) and a follower at ``h`` (``Chain.plan`` from what it
    holds, then ``apply_delta``) both get ``DeltaError(reason)``; the follower's state is untouched."""
    chain = Chain(open_store(str(h.store_dir), create=False))
    before = snapshot(h.store_dir)
    try:
        reconstruct(chain)
        raise AssertionError("reconstruct accepted it")
    except DeltaError as e:
        assert e.reason == reason and e.message, f"reconstruct: {e}"
    held = {n: t.clone() for n, t in h.state.items()}
    try:
        chain.forget()
        target = chain.latest().version
        for ref in chain.plan(h.header.version, target, h.header.commitment):
            if ref.kind == "anchor":
                DeltaFile.open(chain.download(ref, h.store_dir.parent / "a.safetensors")).state()
            else:
                apply_delta(chain.fetch(ref), held, version=h.header.version, commitment=h.header.commitment)
        raise AssertionError("the follower accepted it")
    except DeltaError as e:
        assert e.reason == reason, f"follower: {e}"
    assert same_bits(held, h.state), "the follower's state changed"
    assert snapshot(h.store_dir) == before, "reading changed the store"


@pytest.fixture(scope="module")
def small_chain(tmp_path_factory) -> Held:
    """A library-only chain (v0 anchor, v1, v2) of a small state."""
    root = tmp_path_factory.mktemp("bad-store")
    g = torch.Generator().manual_seed(0)
    state = {"w": (torch.randn(64, 48, generator=g) * 0.02).bfloat16(), "n": torch.ones(48, dtype=torch.bfloat16)}
    with DeltaPublisher(state, str(root / "store"), keep_anchors=100) as pub:
        for seed in (1, 2):
            for n, t in perturb(state, 0.02, seed).items():
                state[n].copy_(t)
            pub.publish()
    s, h = reconstruct(Chain(open_store(str(root / "store"), create=False)))
    assert h.version == 2
    return Held(root / "store", s, h)


def _library_case(small_chain: Held, make, reason: str) -> None:
    restore = StoreRestore(small_chain.store_dir)
    try:
        make(small_chain)
        library_refuses(small_chain, reason)
    finally:
        restore()


def test_store_objects_library(small_chain: Held, tally):
    sweep(tally, "store objects: refused by Chain/reconstruct",
          [Case(name, (make, reason)) for name, make, reason, _ in STORE_CASES],
          lambda c: _library_case(small_chain, *c.data))


@pytest.fixture(scope="module")
def rig_held(rig: Rig) -> Held:
    state, header = reconstruct(Chain(open_store(str(rig.store), create=False)), 2)
    return Held(rig.store, state, header)


def _replica_case(rig: Rig, held: Held, make, reason: str, status: int) -> None:
    restore = StoreRestore(rig.store)
    update = Case("", _update(b"{}"), (status,), reason)
    try:
        make(held)
        http_check(rig)(update)
    finally:
        restore()
        rig.recover(held.header.version)


@pytest.mark.slow
def test_store_objects_replica(rig: Rig, rig_held: Held, tally):
    sweep(tally, "store objects: refused by a replica's /update",
          [Case(name, (make, reason, status)) for name, make, reason, status in STORE_CASES],
          lambda c: _replica_case(rig, rig_held, *c.data))


# =============================================================================== CLI files


@pytest.fixture(scope="module")
def cli_work(template, tmp_path_factory) -> Path:  # noqa: F811 - the fixture imported above
    """test_cli_errors' workspace plus a delta, an anchor and every kind of bad file."""
    work = tmp_path_factory.mktemp("cli") / "w"
    shutil.copytree(template, work)
    (work / "store" / "writer.lock").unlink(missing_ok=True)
    assert cli(work, "diff", "v3.safetensors", "new.safetensors", "-o", "d.safetensors")[0] == 0
    assert cli(work, "pull", "store", "-o", "anchor.safetensors")[0] == 0
    real = (work / "base.safetensors").read_bytes()
    (work / "empty.safetensors").write_bytes(b"")
    (work / "truncated.safetensors").write_bytes(real[: len(real) // 2])
    (work / "cut-header.safetensors").write_bytes(real[:20])
    (work / "random.safetensors").write_bytes(torch.randint(0, 256, (4096,), generator=torch.Generator()
                                                            .manual_seed(1), dtype=torch.uint8).numpy().tobytes())
    (work / "config.json").write_text('{"model_type": "qwen3"}')
    (work / "empty-folder").mkdir()
    (work / "a-file-store").write_text("not a store\n")
    bad = work / "garbled-store"
    shutil.copytree(work / "store", bad)
    (bad / "manifests" / "v00000002.json").write_bytes(b"{not json")
    return work


def cli(cwd: Path, *args) -> tuple[int, str, str]:
    """``deltasync ARGS`` in this process (the same entry point as the console script), so the
    sweep costs no interpreter start per case."""
    from shared.cli import app

    out, err = StringIO(), StringIO()
    code = 0
    with chdir(cwd), redirect_stdout(out), redirect_stderr(err):
        try:
            app([str(a) for a in args], prog_name="deltasync")
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else 1
    return code, out.getvalue(), err.getvalue()


BAD_FILES = ["missing.safetensors", "empty.safetensors", "truncated.safetensors", "cut-header.safetensors",
             "random.safetensors", "notes.txt", "config.json", "huge-header.safetensors", "empty-folder"]
# (command with X where the bad file goes): every slot that takes a file
SLOTS = [("digest", "X"), ("inspect", "X"), ("apply", "X", "d.safetensors", "-o", "out.safetensors"),
         ("apply", "base.safetensors", "X", "-o", "out.safetensors"),
         ("diff", "X", "new.safetensors", "-o", "out.safetensors"),
         ("diff", "base.safetensors", "X", "-o", "out.safetensors"), ("push", "store", "X")]
WRONG_KIND = [
    ("a delta as the checkpoint to push", ("push", "store", "d.safetensors")),
    ("a delta as BASE", ("apply", "d.safetensors", "d.safetensors", "-o", "out.safetensors")),
    ("a delta as NEW", ("diff", "base.safetensors", "d.safetensors", "-o", "out.safetensors")),
    ("an anchor as DELTA", ("apply", "base.safetensors", "anchor.safetensors", "-o", "out.safetensors")),
    ("a plain checkpoint as DELTA", ("apply", "base.safetensors", "new.safetensors", "-o", "out.safetensors")),
    ("a plain checkpoint to inspect", ("inspect", "new.safetensors")),
    ("a file as a store (log)", ("log", "a-file-store")),
    ("a file as a store (pull)", ("pull", "a-file-store", "-o", "out.safetensors")),
    ("a file as a store (fsck)", ("fsck", "a-file-store")),
    ("a file as a store (push)", ("push", "a-file-store", "base.safetensors")),
    ("a missing store (fsck)", ("fsck", "no-such-store")),
    ("a missing store (log)", ("log", "no-such-store")),
    ("a delta to digest", ("digest", "d.safetensors")),
    ("a store with a garbled manifest (pull)", ("pull", "garbled-store", "-o", "out.safetensors", "--version", "2")),
    ("a store with a garbled manifest (push)", ("push", "garbled-store", "new.safetensors")),
]


def cli_refused(work: Path, args: tuple) -> None:
    before = snapshot(work)
    code, out, err = cli(work, *args)
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert code == 1, f"exit {code}: {(out + err)[-300:]}"
    assert "Traceback" not in err + out, err[-300:]
    assert out == "" and len(lines) == 1 and lines[0].startswith("error: "), (out + err)[-300:]
    after = snapshot(work)
    assert after == before, f"wrote or changed {sorted(set(after) ^ set(before))[:3] or 'a file'}"


def test_cli_files(cli_work: Path, tally):
    cases = [Case(f"{' '.join(s)} with X = {f}", tuple(f if a == "X" else a for a in s)) for s in SLOTS
             for f in BAD_FILES]
    sweep(tally, "deltasync: missing, empty, truncated or foreign files", cases,
          lambda c: cli_refused(cli_work, c.data))


def test_cli_wrong_kinds(cli_work: Path, tally):
    sweep(tally, "deltasync: files and stores of the wrong kind", [Case(n, a) for n, a in WRONG_KIND],
          lambda c: cli_refused(cli_work, c.data))


def test_fsck_reports_a_garbled_store_without_changing_it(cli_work: Path, tally):
    """fsck's answer is a report (several lines), not one error: exit 1, the problem named."""
    def check(case: Case) -> None:
        before = snapshot(cli_work)
        code, out, err = cli(cli_work, "fsck", "garbled-store", *case.data)
        assert code == 1 and "Traceback" not in out + err, (code, out + err)
        assert "v00000002" in out or "v2" in out, out
        assert snapshot(cli_work) == before

    sweep(tally, "deltasync fsck: a garbled store", [Case("fsck", ()), Case("fsck --json", ("--json",))], check)
