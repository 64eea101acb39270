"""DeltaSync shared library: exact sparse bf16 weight deltas, version chains and stores.

Pure Python + torch; imports no web framework, so the trainer, the rollout server and
notebooks can all use it.
"""

__version__ = "0.1.0"
