# GPU nodes (KubeRay pods, cluster-launcher workers): CUDA vLLM, DeepSpeed, Ray and the project, installed by
# infra/install.sh exactly as the README's commands do. Build from the repository root:
#   docker build -f infra/docker/gpu.Dockerfile -t <registry>/pipeline:0.1.0-gpu .
# Ray's own image: the Python (3.11) and Ray version the project pins, and what KubeRay expects in a pod.
FROM rayproject/ray:2.60.0-py311-cu128

USER root
RUN apt-get update && apt-get install -y --no-install-recommends git && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY --chown=ray:users . /app
USER ray
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN bash infra/install.sh gpu
