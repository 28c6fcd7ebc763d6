# syntax=docker/dockerfile:1
# Three targets, one file:
#   export   torch (CPU build) + onnx: runs addnorm-export into the artifacts volume
#   api      slim serving image: onnxruntime + FastAPI, no torch
#   api-gpu  the same on CUDA: onnxruntime-gpu on an NVIDIA CUDA 13 / cuDNN 9 runtime image
#   ray      the serving side with Ray Serve (service/ray_serve.py): compose profile `ray`, deploy/ray/rayservice.yaml
ARG PYTHON_IMAGE=python:3.11-slim
# Recent onnxruntime-gpu wheels on PyPI are built for CUDA 13 with cuDNN 9 (1.31.1 declares nvidia-*-cu13 extras;
# 1.30 is reported to run on this base): the base image must match, and the host needs a driver for CUDA 13.
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04

FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
RUN useradd --create-home --uid 10001 addnorm && mkdir -p /artifacts && chown addnorm /artifacts
WORKDIR /app
COPY pyproject.toml README.md ./
COPY model ./model
COPY export ./export
COPY service ./service
COPY bench ./bench

FROM base AS export
# The CPU wheel index keeps the multi-GB CUDA build of torch out of this image.
RUN pip install --extra-index-url https://download.pytorch.org/whl/cpu "torch==2.13.0" \
 && pip install --extra-index-url https://download.pytorch.org/whl/cpu ".[export]"
USER addnorm
ENTRYPOINT ["addnorm-export"]
CMD ["--out", "/artifacts/default", "--if-missing"]

FROM base AS api
RUN pip install . && python -c "import importlib.util as u; assert u.find_spec('torch') is None"
USER addnorm
ENV ADDNORM_MODEL_DIR=/artifacts/default ADDNORM_HOST=0.0.0.0 ADDNORM_PORT=8000 ADDNORM_GRPC_PORT=8001
EXPOSE 8000 8001
HEALTHCHECK --interval=10s --timeout=3s --start-period=20s --retries=3 \
  CMD python -c "import sys, urllib.request as u; sys.exit(u.urlopen('http://127.0.0.1:8000/health/ready').status != 200)"
ENTRYPOINT ["addnorm-serve"]

FROM base AS ray
COPY deploy ./deploy
RUN pip install ".[ray]" && python -c "import importlib.util as u; assert u.find_spec('torch') is None"
USER addnorm
# Ray's proxy binds all interfaces inside the container; the compose file publishes it on loopback only.
ENV ADDNORM_MODEL_DIR=/artifacts/default RAY_SERVE_DEFAULT_HTTP_HOST=0.0.0.0
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=3s --start-period=60s --retries=3 \
  CMD python -c "import sys, urllib.request as u; sys.exit(u.urlopen('http://127.0.0.1:8000/health/ready').status != 200)"
CMD ["serve", "run", "service.ray_serve:build", "model_dir=/artifacts/default", "replicas=2"]

FROM ${CUDA_IMAGE} AS api-gpu
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/* && python3 -m venv /opt/venv \
 && useradd --create-home --uid 10001 addnorm && mkdir -p /artifacts && chown addnorm /artifacts
WORKDIR /app
COPY pyproject.toml README.md ./
COPY model ./model
COPY export ./export
COPY service ./service
COPY bench ./bench
# onnxruntime and onnxruntime-gpu install the same module: drop the CPU one, then lay the GPU one down whole.
RUN pip install ".[gpu]" && pip uninstall -y onnxruntime \
 && pip install --force-reinstall --no-deps "onnxruntime-gpu>=1.30"
USER addnorm
ENV ADDNORM_MODEL_DIR=/artifacts/default ADDNORM_HOST=0.0.0.0 ADDNORM_PORT=8000 ADDNORM_GRPC_PORT=8001 \
    ADDNORM_PROVIDERS=cuda
EXPOSE 8000 8001
HEALTHCHECK --interval=10s --timeout=3s --start-period=30s --retries=3 \
  CMD python -c "import sys, urllib.request as u; sys.exit(u.urlopen('http://127.0.0.1:8000/health/ready').status != 200)"
ENTRYPOINT ["addnorm-serve"]
