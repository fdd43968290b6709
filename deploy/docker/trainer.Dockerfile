# syntax=docker/dockerfile:1.7
# Trainer: FSDP2 learner (torch + NeMo AutoModel, CUDA) over the Redis trajectory stream, run by torchrun.
# Build from the repository root:  docker build -f deploy/docker/trainer.Dockerfile -t molt-trainer .
# Installs exactly requirements/gpu.lock (torch, NeMo AutoModel, CUDA 13 wheels: python 3.11, linux
# x86_64) on the CUDA runtime image, both pinned by version and digest: the same combination as the
# rollout image. Run: torchrun --nproc-per-node 8 -m services.trainer --actor.model_name_or_path DIR ...
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-runtime-ubuntu24.04@sha256:c3fde347d52d578c84fd644bc177bc7ec333feaf11550d990da4084d7612e4c7
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.13.0@sha256:cdc6093146eb3ff6a40107b38f008b789e050e77ad87865e381d9917da55a168
FROM ${UV_IMAGE} AS uv

FROM ${CUDA_IMAGE}
ENV PYTHONUNBUFFERED=1 \
    UV_NO_CACHE=1 \
    UV_LINK_MODE=copy \
    UV_PYTHON_INSTALL_DIR=/opt/python \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HUB_OFFLINE=1 \
    MOLT_SERVER__HOST=0.0.0.0
COPY --from=uv /uv /usr/local/bin/uv
# Triton (torch.compile, NeMo kernels) compiles C launchers at run time. uid 1000 is the chart's
# runAsUser (the base image's "ubuntu" user had it); /checkpoints belongs to it, so a fresh compose
# volume mounted there is writable.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && (userdel -r ubuntu 2>/dev/null || true) \
 && useradd --create-home --uid 1000 molt \
 && uv venv --python 3.11 /opt/venv \
 && mkdir -p /checkpoints && chown molt /checkpoints

COPY requirements/gpu.lock ./requirements/gpu.lock
RUN uv pip install -r requirements/gpu.lock
# Optional: flash-attn (the trainer's default kernel on GPU where installed) compiles for a long time and
# is not in the lock; without it the trainer runs sdpa.
ARG FLASH_ATTN_VERSION=""
RUN if [ -n "$FLASH_ATTN_VERSION" ]; then uv pip install -c /requirements/gpu.lock --no-build-isolation "flash-attn==${FLASH_ATTN_VERSION}"; fi

WORKDIR /app
COPY pyproject.toml README.md* ./
COPY proto ./proto
COPY molt ./molt
COPY services ./services
# gRPC stubs are generated, not committed (they must match the installed protobuf runtime): grpcio-tools
# is constrained to the lock's grpcio/protobuf, used once, then removed.
RUN uv pip install --no-deps . \
 && uv pip install -c /requirements/gpu.lock grpcio-tools \
 && python -m molt.proto_build \
 && uv pip install --no-deps --reinstall . \
 && uv pip uninstall grpcio-tools

# molt_build_info{revision}: docker build --build-arg MOLT_BUILD_REVISION=$(git rev-parse HEAD) ...
ARG MOLT_BUILD_REVISION=unknown
ENV MOLT_BUILD_REVISION=${MOLT_BUILD_REVISION}
USER molt
EXPOSE 9400 29500
CMD ["torchrun", "--standalone", "--nproc-per-node", "1", "-m", "services.trainer", "--help"]
