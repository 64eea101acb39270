# Wordle env Space (Hugging Face Docker Space, app_port 7860). No torch.
# Build from a rendered Space folder:  deltasync spaces render out && docker build -t wordle-env out/env
# Run:                                 docker run -p 7860:7860 wordle-env
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    GRADIO_ANALYTICS_ENABLED=False

# The Wordle dictionary: Debian's wamerican word list (/usr/share/dict/american-english).
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends wamerican && rm -rf /var/lib/apt/lists/*

# Spaces run containers as uid 1000 with its home writable.
RUN useradd --create-home --uid 1000 user
ENV HOME=/home/user PATH=/home/user/.local/bin:$PATH
WORKDIR /home/user/app

# requirements.txt: the env extra of pyproject.toml, exactly pinned (written by `deltasync spaces render`).
COPY --chown=1000:1000 requirements.txt ./
RUN pip install -r requirements.txt
COPY --chown=1000:1000 . .
RUN pip install --no-deps .
USER 1000

EXPOSE 7860
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s \
    CMD ["sh", "-c", "python -c \"import urllib.request; urllib.request.urlopen('http://127.0.0.1:${PORT:-7860}/health', timeout=4)\""]
CMD ["python", "-m", "env_space", "--host", "0.0.0.0"]
