# CPU image of swarm-node; its default command runs isolated training on the embedded
# default model, with the state in the volume /state.
#   docker build -t swarm-node .
#   docker run --rm -it -v swarm-state:/state swarm-node
#
# Build arguments; the defaults build from the public registries. tests/test_container.py
# builds this same file from a local Debian base with a machine's own wheels (README, Docker).
#   BASE_IMAGE    any image with Python 3.11 and its venv module (`python3 -m venv`)
#   TORCH_SOURCE  pip options that say where torch 2.13.0+cpu (and its requirements) come from
#   PIP_OPTIONS   extra pip options for the other requirements, e.g. a local wheel index
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS build
ARG TORCH_SOURCE="--index-url https://download.pytorch.org/whl/cpu"
ARG PIP_OPTIONS=""
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1
# fastecdsa (libp2p) and pycosat (reasoning-gym) ship no wheels for Linux: they compile here,
# fastecdsa against GMP. The official image has Python's headers, Debian's needs python3-dev.
RUN python3 -c "import os, sysconfig; raise SystemExit(not os.path.exists(sysconfig.get_path('include') + '/Python.h'))" \
      || headers=python3-dev; \
    apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev libgmp-dev $headers \
    && rm -rf /var/lib/apt/lists/*
# A virtual environment is the one folder the final stage takes, and it installs as well on a
# base whose system Python is managed by its distribution (Debian's refuses a plain pip install).
RUN python3 -m venv /opt/swarm-node
# torch first, the CPU build, so that no later requirement resolves to a multi-GB CUDA build.
RUN /opt/swarm-node/bin/pip install $TORCH_SOURCE torch==2.13.0+cpu
COPY pyproject.toml README.md /src/
COPY node /src/node
COPY protocol /src/protocol
RUN /opt/swarm-node/bin/pip install $PIP_OPTIONS /src

# The final stage: the base and the environment; no sources, build folders or pip caches.
FROM ${BASE_IMAGE}
COPY --from=build /opt/swarm-node /opt/swarm-node
COPY configs /app/configs
ENV PATH=/opt/swarm-node/bin:$PATH PYTHONUNBUFFERED=1 SWARM_NODE_CACHE=/state/cache
WORKDIR /app
VOLUME ["/state"]
ENTRYPOINT ["swarm-node"]
CMD ["train", "--config", "/app/configs/isolated.yaml", "--state-dir", "/state/node", \
     "--set", "swarm.metrics_port=9100"]
# /readyz of the node the default command runs (its metrics port, on the container's loopback); a command of your own
# sets swarm.metrics_port and --state-dir /state/node for it to answer, or runs with --no-healthcheck. The engine marks
# the container unhealthy; `docker run --restart unless-stopped` restarts one that exits.
HEALTHCHECK --interval=30s --timeout=20s --start-period=5m --retries=3 \
  CMD ["swarm-node", "health", "--state-dir", "/state/node", "--timeout", "10"]
