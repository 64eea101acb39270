"""trl's own vLLM client reads everything it needs from a rollout Space."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.slow


def test_trl_vllm_client_against_a_rollout_space(services):
    from accelerate.state import PartialState
    from trl.experimental.async_grpo.vllm_client import VLLMClient

    PartialState()  # trl's client logs through accelerate, which needs its state (trl's trainer makes it)
    client = VLLMClient(services.rollout.url, server_timeout=60)
    client.wait_for_server_ready(poll_interval_s=0.2)
    assert client.get_max_model_len() == 2048
    assert client.get_dtype() == "torch.bfloat16"
    info = client.get_server_info()
    assert info["lora_config"] is None and info["parallel_config"]["data_parallel_size"] == 1
    assert client.get_world_size() == 1
