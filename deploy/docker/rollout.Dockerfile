# syntax=docker/dockerfile:1.7
# Rollout pod: one vLLM engine (CUDA) behind token-in/token-out HTTP + the gRPC weight receiver.
# Build from the repository root:  docker build -f deploy/docker/rollout.Dockerfile -t molt-rollout .
# Installs exactly requirements/gpu.lock (vLLM, torch, CUDA 13 wheels: python 3.11, linux x86_64) on
# the CUDA runtime image, both pinned by version and digest; the node needs the NVIDIA driver and the
# NVIDIA container toolkit. Run: python -m services.rollout --model.path DIR --server.port 8000 --grpc.port 50051
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
# Triton compiles a small C launcher at run time: vLLM needs a C compiler in the image. uid 1000 is
# the chart's runAsUser (the base image's "ubuntu" user had it).
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && (userdel -r ubuntu 2>/dev/null || true) \
 && useradd --create-home --uid 1000 molt \
 && uv venv --python 3.11 /opt/venv

# The locked engine stack first (the big, rarely changing layer), then the project on top.
COPY requirements/gpu.lock ./requirements/gpu.lock
RUN uv pip install -r requirements/gpu.lock

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
EXPOSE 8000 50051
CMD ["python", "-m", "services.rollout", "--help"]
