"""Load during updates (issue 9): a bounded number of concurrent completions, streaming and not,
plain and chat, against one replica while a trainer publishes versions and notifies it.

The publisher announces every other version itself (``mode=wait``: requests in flight finish on
the old weights); the test asks for the others with ``mode=keep`` (requests in flight freeze and
go on under the new weights), so some responses span two versions. No request may fail, and
every response (every stream's finishing chunks) must name the
version(s) that produced it: versions that were published, no older than the one the replica had
confirmed when the request was sent, no newer than the newest published when it ended, and, where
a response spans several, spans that tile its tokens in version order. Each version must serve
some responses before the next is published, and the replica must be exact at the end.
"""

from __future__ import annotations

import asyncio
import itertools
import json
from dataclasses import dataclass, field
from pathlib import Path

import httpx
import pytest
from rollout.chain_helpers import FakeTrainer

from reliability.servers import AUTH, TOKEN, Server, launch, wait_ready
from shared.publisher import PublishReport

pytestmark = pytest.mark.slow
PROMPTS = ["The quick brown", "Guess the five letter word:", "0 1 2 3"]
KINDS = [("/v1/completions", False), ("/v1/completions", True), ("/v1/chat/completions", False),
         ("/v1/chat/completions", True)]


@dataclass(frozen=True)
class Size:
    requests: int  # at least this many requests in all
    versions: int  # versions published while they run
    concurrency: int  # requests in flight at most
    per_version: int  # responses generated on each version alone before the next is published
    timeout_s: float
    label: str = ""  # tells its rows apart in the reliability table


LONG = Size(requests=2000, versions=60, concurrency=16, per_version=6, timeout_s=3000, label=" (long run)")


@dataclass
class Outcome:
    case: str
    lo: int  # the version the replica had confirmed when the request was sent
    hi: int = -1  # the newest version published when the response ended
    error: str | None = None  # the request failed (transport, status, stream error)
    problems: list[str] = field(default_factory=list)  # labelling that is wrong
    labels: list[list[int | None]] = field(default_factory=list)  # per labelled payload: versions named

    @property
    def ok(self) -> bool:
        return self.error is None and not self.problems


def request_body(model: str, path: str, stream: bool, i: int) -> dict:
    body = {"model": model, "max_tokens": 8 + i % 17, "temperature": 1.0, "seed": i, "n": 1 + (i // 4) % 2,
            "stream": stream, "return_token_ids": True}
    if path.endswith("chat/completions"):
        return body | {"messages": [{"role": "user", "content": PROMPTS[i % len(PROMPTS)]}]}
    return body | {"prompt": PROMPTS[i % len(PROMPTS)]}


def check_labels(out: Outcome, payload: dict, tokens: dict[int, int] | None) -> None:
    """One labelled payload (a whole response, or a chunk that finishes a choice). ``tokens``:
    tokens per choice index, when the payload's choices are all finished and counted."""
    if "policy_version" not in payload:
        out.problems.append(f"unlabelled: {json.dumps(payload)[:300]}")
        return
    versions = payload.get("policy_versions", [payload["policy_version"]])
    out.labels.append(versions)
    if len(versions) > 1 and payload["policy_version"] is not None:
        out.problems.append(f"several versions {versions} but policy_version {payload['policy_version']}")
    if not all(isinstance(v, int) for v in versions):
        out.problems.append(f"names no version: {versions}")
        return
    if not (out.lo <= min(versions) and max(versions) <= out.hi):
        out.problems.append(f"names {versions}, outside v{out.lo}..v{out.hi} (confirmed at send .. published at end)")
    if len(versions) > 1:
        check_spans(out, payload.get("policy_version_spans"), versions, tokens)


def check_spans(out: Outcome, spans: list | None, versions: list[int], tokens: dict[int, int] | None) -> None:
    """Each choice's spans start at token 0, follow each other, are not empty (a version that made
    no token did not produce the response), rise in version and, where the choice's tokens were
    counted, end at its last token."""
    if not spans:
        out.problems.append(f"versions {versions} without policy_version_spans")
        return
    named = set()
    for k, choice in enumerate(spans):
        edges = [(s["start"], s["end"]) for s in choice]
        vs = [s["version"] for s in choice]
        named.update(vs)
        if not edges or edges[0][0] != 0 or any(a[1] != b[0] for a, b in itertools.pairwise(edges)) or \
                any(a >= b for a, b in itertools.pairwise(vs)) or any(a >= b for a, b in edges):
            out.problems.append(f"spans of choice {k} do not tile its tokens in version order: {choice}")
        elif tokens is not None and edges[-1][1] != tokens.get(k):
            out.problems.append(f"spans of choice {k} end at token {edges[-1][1]}, it has {tokens.get(k)}: "
                                f"{spans} (tokens per choice {tokens})")
    if named != set(versions):
        out.problems.append(f"policy_versions {versions} but spans name {sorted(named)}")


async def send(client: httpx.AsyncClient, model: str, i: int, lo: int, published) -> Outcome:
    path, stream = KINDS[i % len(KINDS)]
    out = Outcome(case=f"{path.removeprefix('/v1/')}{' (stream)' if stream else ''} during updates", lo=lo)
    body = request_body(model, path, stream, i)
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                out.error = f"HTTP {r.status_code}: {(await r.aread())[:300]!r}"
                return out
            header = r.headers.get("x-policy-version")
            if stream:
                payloads = [p async for p in sse(r, out)]
            else:
                payloads = [json.loads(await r.aread())]
        out.hi = published()
        if stream and not (header and header.isdigit() and out.lo <= int(header) <= out.hi):
            # a stream's header is sent before any token: the version served when it arrived
            out.problems.append(f"X-Policy-Version {header!r} outside v{out.lo}..v{out.hi}")
        if stream:
            check_stream(out, payloads, body["n"])
        else:
            check_response(out, payloads[0], body["n"], header)
    except (httpx.HTTPError, ValueError, LookupError, TypeError) as e:  # no answer, or a malformed one
        out.error = f"{type(e).__name__}: {e}"
    return out


async def sse(r: httpx.Response, out: Outcome):
    """The JSON payloads of an SSE stream; a missing ``[DONE]`` or an error event fails the request."""
    done = False
    async for line in r.aiter_lines():
        if not line.startswith("data: "):
            continue
        data = line[len("data: "):]
        if data == "[DONE]":
            done = True
            continue
        payload = json.loads(data)
        if "error" in payload:
            out.error = f"stream error: {data[:300]}"
        yield payload
    if not done and out.error is None:
        out.error = "stream ended without [DONE]"


def check_response(out: Outcome, body: dict, n: int, header: str | None) -> None:
    choices = body.get("choices", [])
    if sorted(c["index"] for c in choices) != list(range(n)):
        out.problems.append(f"{len(choices)} choices, asked for {n}")
    check_labels(out, body, {c["index"]: len(c.get("token_ids") or []) for c in choices})
    if header != (None if body.get("policy_version") is None else str(body["policy_version"])):
        out.problems.append(f"X-Policy-Version {header} but policy_version {body.get('policy_version')}")


def check_stream(out: Outcome, payloads: list[dict], n: int) -> None:
    """Every choice finishes in a chunk that names its version(s); chunks carry token ids."""
    if out.error:
        return
    finished: list[int] = []
    tokens = [0] * n
    for p in payloads:
        for c in p.get("choices", []):
            tokens[c["index"]] += len(c.get("token_ids") or [])
        ends = [c["index"] for c in p.get("choices", []) if c.get("finish_reason") is not None]
        if ends:
            finished += ends
            # a finishing chunk's spans are those of the choices finished so far, in the order they
            # finished: only with one choice do they say which tokens are whose
            check_labels(out, p, {0: tokens[0]} if n == 1 else None)
    if sorted(finished) != list(range(n)):
        out.problems.append(f"choices {sorted(finished)} finished, asked for {n}")


async def run_load(server: Server, trainer: FakeTrainer, size: Size, outcomes: list[Outcome]) -> None:
    """Workers keep ``size.concurrency`` requests in flight (appending to ``outcomes``) while the
    trainer publishes ``size.versions`` versions, each once ``size.per_version`` responses came
    from the one before."""
    arrived = asyncio.Condition()
    confirmed = trainer.publisher.version
    publishing = True
    counter = itertools.count()

    def published() -> int:
        return trainer.publisher.version  # set before the version is uploaded: an upper bound

    async def served(version: int) -> None:
        async with arrived:
            await arrived.wait_for(lambda: sum(o.labels and all(lb == [version] for lb in o.labels)
                                               for o in outcomes) >= size.per_version)

    def step(announce: bool) -> PublishReport:
        """One version; the publisher POSTs it to the replica, or (``announce`` false) tells no one."""
        trainer.publisher.replicas[:] = [server.url] if announce else []
        return trainer.step().wait(300)

    async def publisher(client: httpx.AsyncClient) -> None:
        nonlocal confirmed, publishing
        try:
            for k in range(size.versions):
                await served(confirmed)
                # Every other version: the test asks for mode=keep itself, so requests in flight
                # freeze, then go on under the new weights: their responses span two versions.
                keep = k % 2 == 1
                report = await asyncio.to_thread(step, not keep)
                if keep:
                    r = await client.post("/update", json={"version": report.version}, params={"mode": "keep"},
                                          headers=AUTH)
                    assert r.status_code == 200, r.text
                    answer = r.json()
                else:
                    answer = report.replicas[server.url]
                assert (answer.get("version"), answer.get("state_digest")) == \
                    (report.version, report.state_digest), answer
                confirmed = report.version
            await served(confirmed)
        finally:
            publishing = False

    async def worker() -> None:
        async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
            while publishing or len(outcomes) < size.requests:
                out = await send(client, server.model, next(counter), confirmed, published)
                async with arrived:
                    outcomes.append(out)
                    arrived.notify_all()

    async def main() -> None:
        workers = [asyncio.create_task(worker()) for _ in range(size.concurrency)]
        try:
            async with httpx.AsyncClient(base_url=server.url, timeout=300) as client:
                await publisher(client)
        finally:
            await asyncio.gather(*workers)

    await asyncio.wait_for(main(), size.timeout_s)


def load_during_updates(tiny_model_dir: Path, tmp_path: Path, size: Size, tally) -> None:
    store = tmp_path / "bucket"
    trainer = FakeTrainer(tiny_model_dir, str(store), lr=2e-5, token=TOKEN)
    server = None
    try:
        trainer.publisher.flush()  # v0: the base model
        server = wait_ready(launch(tiny_model_dir, store, tmp_path / "replica", map_cache=tmp_path / "maps"))
        outcomes: list[Outcome] = []
        try:
            asyncio.run(run_load(server, trainer, size, outcomes))
        finally:
            for case in sorted({o.case for o in outcomes}):
                mine = [o for o in outcomes if o.case == case]
                tally.request(ok=True, case=case + size.label, n=sum(o.ok for o in mine))
                tally.request(ok=False, case=case + size.label, n=sum(not o.ok for o in mine))
        failed = [(o.case, o.error) for o in outcomes if o.error]
        assert not failed, f"{len(failed)} of {len(outcomes)} requests failed: {failed[:5]}"
        mislabelled = [(o.case, o.problems) for o in outcomes if o.problems]
        assert not mislabelled, f"{len(mislabelled)} of {len(outcomes)} mislabelled: {mislabelled[:5]}"
        assert len(outcomes) >= size.requests
        # requests in flight at a mode=keep write (always some, under this load) span two versions:
        # so the span checks above did run
        assert any(len(lb) > 1 for o in outcomes for lb in o.labels), "no response spans two versions"
        named = {v for o in outcomes for lb in o.labels for v in lb}
        assert named == set(range(size.versions + 1)), sorted(named)
        trainer.publisher.flush()
        v, d = server.version(), server.live_digest()
        assert v["version"] == d["version"] == trainer.publisher.version == size.versions, (v, d)
        assert d["state_digest"] == trainer.publisher.state_digest, d
    finally:
        if server is not None:
            server.stop()
        trainer.close()


@pytest.mark.long
def test_load_during_updates_long(tiny_model_dir: Path, tmp_path: Path, tally):
    load_during_updates(tiny_model_dir, tmp_path, LONG, tally)
