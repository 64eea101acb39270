"""Rollout Space: a vLLM replica behind FastAPI that applies exact sparse bf16 deltas in place.

``python -m rollout_space --model M --store S --port P``; see ``rollout_space/README.md``.
"""
