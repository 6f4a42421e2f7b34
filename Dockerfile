# The image an island's segments run in on Kubernetes (islands[].pool.image; docs/clusters.md): the
# project and its Kubernetes extra installed, run as a non-root user. Its code is what the image holds:
# a segment's Job runs the worker's engine command, which loads `flows.deployments.segment` from here.
#   docker build -t REGISTRY/archipelago:TAG .                       # CPU torch
#   docker build --build-arg TORCH_INDEX_URL=https://download.pytorch.org/whl/cu128 -t REGISTRY/archipelago:TAG-cuda .
FROM python:3.11-slim

# Where torch's wheel comes from: its CPU build by default, a CUDA build from that CUDA version's index.
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/cpu
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false

WORKDIR /opt/archipelago
COPY pyproject.toml README.md ./
# torch alone from its index, at the version pyproject.toml pins, in a layer of its own: rebuilding
# after a code change reuses it. Every other package comes from the package index.
RUN python -m pip install --index-url "$TORCH_INDEX_URL" "$(python -c 'import tomllib; \
print(next(d for d in tomllib.load(open("pyproject.toml", "rb"))["project"]["dependencies"] if d.startswith("torch==")))')"
COPY flows flows
COPY tasks tasks
COPY training training
COPY eval eval
COPY infra infra
RUN python -m pip install ".[kubernetes]" && rm -rf /opt/archipelago

# A numeric user, so that Kubernetes can check runAsNonRoot (the pool's pods require it).
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin archipelago
USER 10001
WORKDIR /home/archipelago
