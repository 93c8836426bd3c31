# syntax=docker/dockerfile:1
# The planner image: CPU-only PyTorch, Megatron-Core (pinned by a build argument) and the planner.
#
#   docker build -t batch-planner:0.1.0 .
#   docker run --rm -p 50051:50051 -p 9400:9400 batch-planner:0.1.0 --workers 2
#
# Megatron-Core defaults to the Megatron-LM dev commit pinned in deps/megatron-core.env, which has
# DefaultDynamicCPScheduler (dynamic CP, the product's main path) and DpBalancedScheduler. The
# archive form needs no git in the image; another revision or a release (hybrid CP only):
#   docker build --build-arg MEGATRON_CORE_SPEC='megatron-core @ https://github.com/NVIDIA/Megatron-LM/archive/<rev>.tar.gz' .
#   docker build --build-arg MEGATRON_CORE_SPEC='git+https://github.com/NVIDIA/Megatron-LM@<rev>' .
#   docker build --build-arg MEGATRON_CORE_SPEC='megatron-core==0.19.2' .
#
# The base image is pinned by its full version tag. To pin it by digest as well, pass
#   --build-arg PYTHON_IMAGE=python:3.12.12-slim-bookworm@sha256:<digest>
# with the digest your registry reports (docs/deployment.md).

ARG PYTHON_IMAGE=python:3.12.12-slim-bookworm
# Declared before the first stage, so that both stages (the install and the image's label) read
# the same value.
ARG MEGATRON_CORE_SPEC="megatron-core @ https://github.com/NVIDIA/Megatron-LM/archive/d48bd6be0a85cc0d6d3cc71e8750cf357cc6bdb1.tar.gz"

FROM ${PYTHON_IMAGE} AS build
ARG TORCH_VERSION=2.14.1
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ARG MEGATRON_CORE_SPEC
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PYTHONDONTWRITEBYTECODE=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]

# git only when the Megatron-Core spec is a git URL; the build stage is not shipped, so its
# apt packages are not pinned (Debian replaces old versions in point releases).
# hadolint ignore=DL3008
RUN if [[ "${MEGATRON_CORE_SPEC}" == *git+* ]]; then \
      apt-get update \
      && apt-get install -y --no-install-recommends git \
      && rm -rf /var/lib/apt/lists/*; \
    fi

RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH

# CPU-only torch first, from PyTorch's CPU wheel index: the default wheel pulls several GB of CUDA
# libraries the planner never uses. Everything installed after it keeps this torch.
RUN pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /src
# Everything else at the versions and hashes of requirements/image.lock (the project's own
# dependencies stay ranges in pyproject.toml); torch is the one package outside it (above).
COPY requirements/image.lock ./requirements/image.lock
RUN pip install --no-cache-dir --require-hashes --no-deps -r requirements/image.lock
COPY pyproject.toml README.md ./
COPY batch_planner ./batch_planner
COPY planner_server ./planner_server
COPY trainer_client ./trainer_client
# Megatron-Core's optional C++ dataset helper is skipped without a compiler; the planner does not
# use it. The planner package itself is installed non-editable, so /src is not needed at run time.
# --no-deps: the lock has every dependency (it resolves them with the 0.19.2 release, whose
# dependencies the dev build shares); MEGATRON_CORE_SPEC then replaces only Megatron-Core itself.
RUN pip install --no-cache-dir --no-deps "${MEGATRON_CORE_SPEC}" . \
    && python -c "import torch, megatron.core, planner_server.server; assert torch.version.cuda is None, 'not the CPU build of torch'" \
    && find /opt/venv -name '__pycache__' -prune -exec rm -rf {} +

FROM ${PYTHON_IMAGE} AS runtime
# OCI annotations; a release build passes the commit and the build time:
#   --build-arg REVISION="$(git rev-parse HEAD)" --build-arg CREATED="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
ARG PYTHON_IMAGE
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown
ARG MEGATRON_CORE_SPEC
LABEL org.opencontainers.image.title="batch-planner" \
      org.opencontainers.image.description="Megatron-Core context-parallel schedulers behind a gRPC service" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.base.name="${PYTHON_IMAGE}" \
      io.github.megatron-batch-planner.megatron-core="${MEGATRON_CORE_SPEC}"
RUN groupadd --system --gid 10001 planner \
    && useradd --system --uid 10001 --gid planner --home-dir /home/planner --create-home --shell /usr/sbin/nologin planner
COPY --from=build /opt/venv /opt/venv
# The root filesystem is read-only in the Helm chart: temporary files (the forkserver's socket)
# and caches go to /tmp, where the chart mounts an emptyDir.
ENV PATH=/opt/venv/bin:$PATH \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    TMPDIR=/tmp \
    XDG_CACHE_HOME=/tmp/.cache \
    PLANNER_HOST=[::] \
    PLANNER_PORT=50051 \
    PLANNER_METRICS_PORT=9400
USER 10001:10001
WORKDIR /home/planner
# 50051: gRPC (Plan, GetCapabilities, grpc.health.v1, reflection); 9400: Prometheus /metrics;
# 50052: plaintext grpc.health.v1 only, for Kubernetes probes.
EXPOSE 50051 9400 50052
# No HEALTHCHECK: Kubernetes probes the gRPC health service on the probe port itself
# (helm/batch-planner).
ENTRYPOINT ["planner-server"]
