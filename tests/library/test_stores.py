"""Stores beyond the local folder: S3 for real against moto's server on loopback; Hub URIs parsed."""

from __future__ import annotations

import subprocess
import sys
import time

import httpx
import pytest

from shared.chain import Chain, reconstruct
from shared.process import free_port
from shared.stores import open_store

from .helpers import same_bits
from .test_chain import publish_chain


@pytest.fixture(scope="module")
def s3_endpoint():
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            httpx.get(url, timeout=1)
            break
        except httpx.HTTPError:
            time.sleep(0.2)
    else:
        proc.kill()
        pytest.fail("moto server did not start")
    yield url
    proc.terminate()
    proc.wait(timeout=10)


def test_s3_store_round_trip(s3_endpoint, monkeypatch):
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "testing")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "testing")
    monkeypatch.setenv("AWS_DEFAULT_REGION", "us-east-1")
    opts = {"client_kwargs": {"endpoint_url": s3_endpoint}}
    store = open_store("s3://deltasync-test/run1", **opts)
    store.fs.mkdir("deltasync-test")
    states, _ = publish_chain(store, 6)
    chain = Chain(open_store("s3://deltasync-test/run1", **opts))  # a fresh reader
    assert chain.latest().version == 6
    for v in chain.versions():
        assert same_bits(reconstruct(chain, v)[0], states[v])
    assert not any(".tmp-" in k for k in chain.store.list("deltas"))


def test_hub_bucket_uris(monkeypatch):
    """Only parsing is exercised here: the Hub cannot be reached from this machine."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    store = open_store("hf://buckets/my-org/rl-deltas/run1")
    assert type(store.fs).__name__ == "HfFileSystem"
    assert store.path("latest.json") == "buckets/my-org/rl-deltas/run1/latest.json"
    with pytest.raises(ValueError, match="Storage Buckets"):
        open_store("hf://my-org/my-model")
