# Trainer Space, CPU variant (small models): trl's AsyncGRPOTrainer + the Gradio page on one port.
# Build from a rendered Space folder:  deltasync spaces render out --cpu && docker build -t trainer-cpu out/trainer
# Run:  docker run -p 7860:7860 -e DELTASYNC_MODEL=Qwen/Qwen3-0.6B \
#         -e DELTASYNC_STORE=hf://buckets/<ns>/<bucket>/run1 -e DELTASYNC_REPLICAS=https://<ns>-deltasync-rollout.hf.space \
#         -e DELTASYNC_ENV_URL=https://<ns>-deltasync-wordle.hf.space -e DELTASYNC_TOKEN=... -e HF_TOKEN=... trainer-cpu
FROM python:3.11-slim

# TOKENIZERS_PARALLELISM is not a secret (DL3064 matches on the name).
# hadolint ignore=DL3064
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    GRADIO_ANALYTICS_ENABLED=False \
    TOKENIZERS_PARALLELISM=false

# A compiler for torch.compile / triton and numba's first use.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 1000 user
ENV HOME=/home/user PATH=/home/user/.local/bin:$PATH HF_HOME=/home/user/.cache/huggingface \
    DELTASYNC_OUTPUT_DIR=/home/user/runs
WORKDIR /home/user/app

# torch first from PyTorch's CPU index (PyPI's build is CUDA), then requirements.txt: the trainer extra of
# pyproject.toml, exactly pinned. Without CUDA the trainer swaps FlashAttention-3 for plain-torch attention.
COPY --chown=1000:1000 requirements.txt ./
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu && \
    pip install -r requirements.txt
COPY --chown=1000:1000 . .
RUN pip install --no-deps .
USER 1000
# numba's kernels compiled into the image, so that a first version need not wait for them (~15 s);
# numba uses this cache only on the kind of CPU it was built on (the Space also warms up at start).
ENV NUMBA_CACHE_DIR=/home/user/.cache/numba
RUN deltasync warmup

EXPOSE 7860
HEALTHCHECK --interval=30s --timeout=5s --start-period=120s \
    CMD ["sh", "-c", "python -c \"import urllib.request; urllib.request.urlopen('http://127.0.0.1:${PORT:-7860}/health', timeout=4)\""]
# Start and Stop on the page ask for DELTASYNC_TRAINER_TOKEN (or else DELTASYNC_TOKEN); with neither set
# the server refuses to start.
CMD ["python", "-m", "trainer_space", "--host", "0.0.0.0"]
