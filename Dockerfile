# The image an island's segments run in on Kubernetes (islands[].pool.image; docs/clusters.md): the
# project with its Kubernetes and tracker extras installed, run as a non-root user. Its code is what the
# image holds: a segment's Job runs the worker's engine command, which loads `flows.deployments.segment`
# from here. torch is a CUDA build by default (its wheel brings the CUDA runtime; the node's NVIDIA
# driver must support that CUDA version), or the CPU build:
#   docker build -t REGISTRY/archipelago:VERSION .                                   # torch for CUDA 12.8
#   docker build --build-arg TORCH_VARIANT=cuXYZ -t REGISTRY/archipelago:VERSION-cuXYZ .   # another CUDA build
#   docker build --build-arg TORCH_VARIANT=cpu -t REGISTRY/archipelago:VERSION-cpu .  # CPU islands only
FROM python:3.11-slim

# Which torch build: a CUDA version's as the PyTorch index names it (cu128, ...) or cpu; its wheels
# come from that build's index (TORCH_INDEX_URL, for a mirror).
ARG TORCH_VARIANT=cu128
ARG TORCH_INDEX_URL=https://download.pytorch.org/whl/${TORCH_VARIANT}
ENV PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PREFECT_SERVER_ANALYTICS_ENABLED=false \
    ARCHIPELAGO_TORCH_VARIANT=${TORCH_VARIANT} NVIDIA_VISIBLE_DEVICES=all NVIDIA_DRIVER_CAPABILITIES=compute,utility

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
# The experiment trackers' extras too: a spec's tracking.backend works on its islands' workers (docs/tracking.md).
RUN python -m pip install ".[kubernetes,tensorboard,mlflow,wandb]" && rm -rf /opt/archipelago

# A numeric user, so that Kubernetes can check runAsNonRoot (the pool's pods require it).
RUN useradd --uid 10001 --create-home --shell /usr/sbin/nologin archipelago
USER 10001
WORKDIR /home/archipelago
