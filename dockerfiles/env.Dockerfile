# Wordle environment Space (Hugging Face Docker Space, app_port 7860).
# Build from the repository root:  docker build -f dockerfiles/env.Dockerfile -t wordle-env .
# Run:                             docker run -p 7860:7860 wordle-env
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    GRADIO_ANALYTICS_ENABLED=False

# The Wordle dictionary: Debian's wamerican word list (/usr/share/dict/american-english).
RUN apt-get update && apt-get install -y --no-install-recommends wamerican && rm -rf /var/lib/apt/lists/*

WORKDIR /app
COPY pyproject.toml README.md ./
COPY env_space ./env_space
# The env extra of pyproject.toml, without the base dependencies (torch, numba) it never imports.
RUN pip install --no-deps . && \
    pip install "openenv-core==0.3.0" "wordfreq==3.1.1" "gradio>=6" \
        fastapi uvicorn httpx pydantic

# Spaces run containers as uid 1000; the server writes nothing outside /tmp.
RUN useradd --create-home --uid 1000 user
USER user
ENV HOME=/home/user

EXPOSE 7860
HEALTHCHECK --interval=30s --timeout=5s --start-period=60s \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:7860/health', timeout=4)"
CMD ["python", "-m", "env_space", "--host", "0.0.0.0", "--port", "7860"]
