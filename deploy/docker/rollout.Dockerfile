# syntax=docker/dockerfile:1.7
# Rollout pod: one vLLM engine (CUDA) behind token-in/token-out HTTP + the gRPC weight receiver.
# Build from the repository root:  docker build -f deploy/docker/rollout.Dockerfile -t molt-rollout .
# The CUDA runtime comes with the torch/vLLM wheels; the node needs the NVIDIA driver and the
# NVIDIA container toolkit. Run: python -m services.rollout --model.path DIR --server.port 8000 --grpc.port 50051
ARG PYTHON_VERSION=3.12
FROM python:${PYTHON_VERSION}-slim-bookworm

ENV PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HUB_OFFLINE=1 \
    MOLT_SERVER__HOST=0.0.0.0
# Triton compiles a small C launcher at run time: vLLM needs a C compiler in the image.
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && python -m venv /opt/venv \
 && useradd --create-home --uid 1000 molt

# The engine first (the big, rarely changing layer), then the project on top.
ARG VLLM_VERSION=0.33.0
RUN pip install "vllm==${VLLM_VERSION}"

WORKDIR /app
COPY pyproject.toml README.md* ./
COPY proto ./proto
COPY molt ./molt
COPY services ./services
# gRPC stubs are generated, not committed (they must match the installed protobuf runtime).
RUN pip install . grpcio-tools \
 && python -m molt.proto_build \
 && pip install --no-deps --force-reinstall . \
 && pip uninstall -y grpcio-tools

USER molt
EXPOSE 8000 50051
CMD ["python", "-m", "services.rollout", "--help"]
