# Trainer Space: trl's AsyncGRPOTrainer + the Gradio monitoring page on one port (Hugging Face Docker Space).
# Build from the repository root:  docker build -f dockerfiles/trainer.Dockerfile -t deltasync-trainer .
# Run:  docker run --gpus all -p 7860:7860 -e DELTASYNC_MODEL=Qwen/Qwen3-0.6B \
#         -e DELTASYNC_STORE=hf://buckets/<ns>/<bucket>/run1 -e DELTASYNC_REPLICAS=https://<ns>-rollout.hf.space \
#         -e DELTASYNC_ENV_URL=https://<ns>-wordle.hf.space -e DELTASYNC_TOKEN=... -e DELTASYNC_API_KEY=... \
#         -e DELTASYNC_TRAINER_TOKEN=... -e HF_TOKEN=... deltasync-trainer
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    GRADIO_ANALYTICS_ENABLED=False \
    TOKENIZERS_PARALLELISM=false

RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY env_space ./env_space
COPY trainer_space ./trainer_space
# CUDA torch from PyPI, trl with its FlashAttention-3 kernels (packed attention on a GPU), the trainer
# extra of pyproject.toml (trl's rollout client, Gradio, the OpenEnv client of the env Space).
RUN pip install ".[trainer]" "trl[kernels]==1.16.0"

# Spaces run containers as uid 1000; the model cache and run outputs live in its home.
RUN useradd --create-home --uid 1000 user
USER user
ENV HOME=/home/user \
    HF_HOME=/home/user/.cache/huggingface \
    DELTASYNC_OUTPUT_DIR=/home/user/runs

EXPOSE 7860
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:7860/health', timeout=4)"
# Start and Stop on the page ask for DELTASYNC_TRAINER_TOKEN (a Space secret); without it the server refuses to start.
CMD ["python", "-m", "trainer_space", "--host", "0.0.0.0", "--port", "7860"]
