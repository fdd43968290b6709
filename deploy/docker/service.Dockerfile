# syntax=docker/dockerfile:1.7
# Slim image for the CPU services: the gateway (OpenAI/Anthropic API) and env workers. No torch.
# Env workers whose agent imports torch or vLLM (Molt's examples) run in the rollout image instead.
# Build from the repository root:  docker build -f deploy/docker/service.Dockerfile -t molt-service .
# Run: python -m services.gateway ...   or   python -m services.envs --agent NAME=examples/agents/NAME.py ...
ARG PYTHON_VERSION=3.12
FROM python:${PYTHON_VERSION}-slim-bookworm AS build
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /app
COPY pyproject.toml README.md* ./
COPY proto ./proto
COPY molt ./molt
COPY services ./services
RUN pip install . grpcio-tools \
 && python -m molt.proto_build \
 && pip install --no-deps --force-reinstall . \
 && pip uninstall -y grpcio-tools

FROM python:${PYTHON_VERSION}-slim-bookworm
ENV PYTHONUNBUFFERED=1 \
    VIRTUAL_ENV=/opt/venv \
    PATH=/opt/venv/bin:$PATH \
    HF_HUB_OFFLINE=1 \
    MOLT_SERVER__HOST=0.0.0.0
RUN useradd --create-home --uid 1000 molt
COPY --from=build /opt/venv /opt/venv
WORKDIR /app
# Agent modules the env workers load by path, relative to this WORKDIR (--agent NAME=examples/agents/NAME.py;
# molt/agents/distill_agent.py, which `molt train-rl --emit helm-values` names for distillation). Only
# molt/agents: no /app/molt/__init__.py, so `import molt` still resolves to the installed package.
COPY examples ./examples
COPY molt/agents ./molt/agents
# molt_build_info{revision}: docker build --build-arg MOLT_BUILD_REVISION=$(git rev-parse HEAD) ...
ARG MOLT_BUILD_REVISION=unknown
ENV MOLT_BUILD_REVISION=${MOLT_BUILD_REVISION}
USER molt
EXPOSE 8080 8090
CMD ["python", "-m", "services.gateway", "--help"]
