"""``env_space.app:app``: the server with default settings, for ``uvicorn env_space.app:app`` and the
``app`` entry of the Space's openenv.yaml (``python -m env_space`` takes flags instead)."""

from env_space.server import create_app

app = create_app()
