# syntax=docker/dockerfile:1.7
# Trainer: FSDP2 learner (torch + NeMo AutoModel, CUDA) over the Redis trajectory stream, run by torchrun.
# Build from the repository root:  docker build -f deploy/docker/trainer.Dockerfile -t molt-trainer .
# Run: torchrun --nproc-per-node 8 -m services.trainer --actor.model_name_or_path DIR --redis.url URL ...
ARG PYTHON_VERSION=3.12
FROM python:${PYTHON_VERSION}-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HUB_OFFLINE=1 \
    MOLT_SERVER__HOST=0.0.0.0
# Triton (torch.compile, NeMo kernels) compiles C launchers at run time.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && python -m venv /opt/venv \
 && useradd --create-home --uid 1000 molt

# Same pins as pyproject's [gpu] extra: triton 3.9 breaks `import nemo_automodel`.
ARG NEMO_AUTOMODEL_VERSION=0.7.0
RUN pip install "nemo-automodel==${NEMO_AUTOMODEL_VERSION}" "triton==3.8.0"
# Optional: flash-attn (the trainer's default kernel on GPU) compiles for a long time; without it
# pass --fsdp.attn_implementation sdpa.
ARG FLASH_ATTN_VERSION=""
RUN if [ -n "$FLASH_ATTN_VERSION" ]; then pip install --no-build-isolation "flash-attn==${FLASH_ATTN_VERSION}"; fi

WORKDIR /app
COPY pyproject.toml README.md* ./
COPY proto ./proto
COPY molt ./molt
COPY services ./services
RUN pip install . grpcio-tools \
 && python -m molt.proto_build \
 && pip install --no-deps --force-reinstall . \
 && pip uninstall -y grpcio-tools

USER molt
EXPOSE 9400 29500
CMD ["torchrun", "--standalone", "--nproc-per-node", "1", "-m", "services.trainer", "--help"]
