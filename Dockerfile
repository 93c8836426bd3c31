# syntax=docker/dockerfile:1
# The planner image: PyTorch (the CPU build unless asked otherwise), Megatron-Core (pinned by a build
# argument) and the planner.
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
# Without network (scripts/image/build does this on the CI machines): every wheel from a local
# wheelhouse mounted into the build, no index asked:
#   podman build --network none --volume "$PWD/wheels:/wheels:ro" --build-arg WHEELHOUSE=/wheels \
#     --build-arg MEGATRON_CORE_SPEC='megatron-core==0.19.0+dev.d48bd6b' .
# TORCH_VARIANT=cpu (default) refuses a CUDA build of torch; TORCH_VARIANT=cuda accepts one (where
# no CPU wheel can be had; the image is then about 5.9 GB, its nvidia-* libraries alone 3.2 GB).
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
# cpu: the build fails unless torch is the CPU build; cuda: it accepts (only) a CUDA build.
ARG TORCH_VARIANT=cpu
# Empty: packages come from the indexes. A folder in the build (a bind mount): every package comes
# from its wheels and no index is asked (PIP_NO_INDEX, PIP_FIND_LINKS in each pip install's RUN).
ARG WHEELHOUSE=""
ARG MEGATRON_CORE_SPEC
# PIP_NO_COMPILE: no bytecode at install; the image ships none (PYTHONDONTWRITEBYTECODE, and the
# __pycache__ sweep below), so compiling torch's thousands of modules would only cost build time.
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_NO_COMPILE=1 \
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

# torch first, from PyTorch's CPU wheel index by default: the default index's Linux wheel is the
# CUDA build, which pulls several GB of CUDA libraries the planner never uses. Everything installed
# after it keeps this torch. With a WHEELHOUSE, pip's --no-index (PIP_NO_INDEX) overrides the index.
RUN if [ -n "${WHEELHOUSE}" ]; then export PIP_NO_INDEX=1 PIP_FIND_LINKS="${WHEELHOUSE}"; fi; \
    pip install --no-cache-dir --index-url "${TORCH_INDEX_URL}" "torch==${TORCH_VERSION}"

WORKDIR /src
# Everything else at the versions and hashes of requirements/image.lock (the project's own
# dependencies stay ranges in pyproject.toml); torch is the one package outside it (above). The
# lock pins triton, which megatron.core imports (transformer/moe/ops/paged_stash.py) and which
# only the CUDA build of torch brings.
COPY requirements/image.lock ./requirements/image.lock
RUN if [ -n "${WHEELHOUSE}" ]; then export PIP_NO_INDEX=1 PIP_FIND_LINKS="${WHEELHOUSE}"; fi; \
    pip install --no-cache-dir --require-hashes --no-deps -r requirements/image.lock
COPY pyproject.toml README.md ./
COPY batch_planner ./batch_planner
COPY planner_server ./planner_server
COPY trainer_client ./trainer_client
COPY scripts/image/check_imports.py ./scripts/image/check_imports.py
# Megatron-Core's optional C++ dataset helper is skipped without a compiler; the planner does not
# use it. The planner package itself is installed non-editable, so /src is not needed at run time.
# --no-deps: the lock has every dependency (it resolves them with the 0.19.2 release, whose
# dependencies the dev build shares); MEGATRON_CORE_SPEC then replaces only Megatron-Core itself.
# check_imports.py: torch is the TORCH_VARIANT build, and megatron.core and the server import.
RUN if [ -n "${WHEELHOUSE}" ]; then export PIP_NO_INDEX=1 PIP_FIND_LINKS="${WHEELHOUSE}"; fi; \
    pip install --no-cache-dir --no-deps "${MEGATRON_CORE_SPEC}" . \
    && python scripts/image/check_imports.py "${TORCH_VARIANT}" \
    && find /opt/venv -name '__pycache__' -prune -exec rm -rf {} +

FROM ${PYTHON_IMAGE} AS runtime
# OCI annotations; a release build passes the commit and the build time:
#   --build-arg REVISION="$(git rev-parse HEAD)" --build-arg CREATED="$(date -u +%Y-%m-%dT%H:%M:%SZ)"
ARG PYTHON_IMAGE
ARG VERSION=0.1.0
ARG REVISION=unknown
ARG CREATED=unknown
ARG MEGATRON_CORE_SPEC
ARG TORCH_VARIANT=cpu
LABEL org.opencontainers.image.title="batch-planner" \
      org.opencontainers.image.description="Megatron-Core context-parallel schedulers behind a gRPC service" \
      org.opencontainers.image.licenses="Apache-2.0" \
      org.opencontainers.image.version="${VERSION}" \
      org.opencontainers.image.revision="${REVISION}" \
      org.opencontainers.image.created="${CREATED}" \
      org.opencontainers.image.base.name="${PYTHON_IMAGE}" \
      io.github.megatron-batch-planner.megatron-core="${MEGATRON_CORE_SPEC}" \
      io.github.megatron-batch-planner.torch-variant="${TORCH_VARIANT}"
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
    NUMBA_CACHE_DIR=/tmp/.cache/numba \
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
