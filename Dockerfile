# CPU image of swarm-node; its default command runs isolated training on the embedded
# default model, with the state in the volume /state.
#   docker build -t swarm-node .
#   docker run --rm -it -v swarm-state:/state swarm-node
FROM python:3.11-slim

ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 SWARM_NODE_CACHE=/state/cache
WORKDIR /app

# torch first, from the CPU index, so no later requirement resolves to a CUDA build.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0
COPY pyproject.toml README.md ./
COPY node ./node
COPY protocol ./protocol
COPY configs ./configs
RUN pip install .

VOLUME ["/state"]
ENTRYPOINT ["swarm-node"]
CMD ["train", "--config", "/app/configs/isolated.yaml", "--state-dir", "/state/node"]
