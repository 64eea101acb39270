# Rollout Space, GPU: vLLM's own image at the version pyproject.toml pins, plus the DeltaSync worker extension.
# Build from a rendered Space folder:  deltasync spaces render out && docker build -t rollout out/rollout
# Run:  docker run --gpus all -p 7860:7860 -e MODEL=Qwen/Qwen3-0.6B \
#         -e DELTASYNC_STORE=hf://buckets/<ns>/<bucket>/run1 -e DELTASYNC_TOKEN=... -e HF_TOKEN=... rollout
# Extra vLLM engine options go in the VLLM_ARGS variable (e.g. "--max-model-len 4096").
FROM vllm/vllm-openai:v0.32.0

# TOKENIZERS_PARALLELISM is not a secret (DL3064 matches on the name).
# hadolint ignore=DL3064
ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    TOKENIZERS_PARALLELISM=false

# Spaces run containers as uid 1000 (the base image may already have one, e.g. Ubuntu's "ubuntu").
RUN (id -u 1000 >/dev/null 2>&1 || useradd --create-home --uid 1000 user) && \
    mkdir -p /home/user/app && chown -R 1000:1000 /home/user
ENV HOME=/home/user HF_HOME=/home/user/.cache/huggingface
WORKDIR /home/user/app

# vLLM (and its CUDA torch) come with the image; requirements.txt is the rest of the rollout extra of
# pyproject.toml, exactly pinned. The check fails the build if the image's vLLM is not the pinned one.
COPY --chown=1000:1000 requirements.txt ./
RUN python3 -m pip install -r requirements.txt && \
    python3 -c "import vllm, sys; sys.exit(vllm.__version__ != '0.32.0')"
COPY --chown=1000:1000 . .
RUN python3 -m pip install --no-deps .
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
    CMD ["sh", "-c", "python3 -c \"import urllib.request; urllib.request.urlopen('http://127.0.0.1:${PORT:-7860}/health', timeout=4)\""]
# The image's ENTRYPOINT is `vllm serve`; this Space runs its own server instead.
ENTRYPOINT []
# Secrets arrive as environment variables: DELTASYNC_TOKEN (required on a public address), VLLM_API_KEY, HF_TOKEN.
CMD ["sh", "-c", "exec python3 -m rollout_space --model \"$MODEL\" --host 0.0.0.0 --port \"${PORT:-7860}\" $VLLM_ARGS"]
