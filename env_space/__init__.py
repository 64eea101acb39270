"""Env Space: a Wordle environment server speaking the OpenEnv protocol.

Run it with ``python -m env_space --port PORT``; see ``env_space/README.md``.
Submodules are imported lazily so that ``env_space.wordle`` stays usable
without the server dependencies.
"""

__version__ = "0.1.0"
