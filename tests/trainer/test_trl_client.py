"""trl's own vLLM client reads everything it needs from a key-protected rollout Space, through
the trainer's relay and only through it."""

from __future__ import annotations

import httpx
import pytest

from trainer_space.relay import AuthRelay

pytestmark = pytest.mark.slow


def test_trl_vllm_client_through_the_relay(services):
    from accelerate.state import PartialState
    from trl.experimental.async_grpo.vllm_client import VLLMClient

    PartialState()  # trl's client logs through accelerate, which needs its state (trl's trainer makes it)
    url = services.rollout.url
    assert httpx.get(f"{url}/v1/models").status_code == 401  # --api-key guards /v1/*, as in vllm serve
    assert httpx.get(f"{url}/v1/models", headers={"Authorization": "Bearer wrong"}).status_code == 401
    with AuthRelay(url, services.api_key) as relay:
        client = VLLMClient(relay.url, server_timeout=60)
        client.wait_for_server_ready(poll_interval_s=0.2)
        assert client.get_max_model_len() == 2048
        assert client.get_dtype() == "torch.bfloat16"
        info = client.get_server_info()
        assert info["lora_config"] is None and info["parallel_config"]["data_parallel_size"] == 1
        assert client.get_world_size() == 1
        r = httpx.post(f"{relay.url}/v1/completions", json={"model": str(services.model), "prompt": "Guess",
                                                             "max_tokens": 4, "return_token_ids": True})
        assert r.status_code == 200 and len(r.json()["choices"][0]["token_ids"]) >= 1
        assert "policy_version" in r.json() and "x-policy-version" in r.headers  # our fields pass through
        assert httpx.post(f"{relay.url}/v1/completions", content=b"{",  # errors pass through
                          headers={"content-type": "application/json"}).status_code == 400
