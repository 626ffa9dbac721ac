"""A Ray cluster-launcher config (`ray up`) of the same shape as the KubeRay manifests, for users without
Kubernetes: a CPU head on GCP, `cluster.num_nodes` A2 machines with the project's GPU image, an NFS share at the
same path the pods mount, and the same driver resource on the GPU workers."""

from __future__ import annotations

import json

from pipeline.config.schema import LauncherConfig, PipelineConfig
from pipeline.infra.kuberay import DRIVER_RESOURCE


def _docker(cfg: PipelineConfig) -> dict:
    shared = cfg.cluster.kubernetes.shared_mount
    return {"image": cfg.cluster.kubernetes.image, "container_name": "ray_container", "pull_before_run": True,
            # The MLflow URI travels in the job's config (tracking.tracking_uri) and the Serve config, not here.
            "run_options": ["--ulimit nofile=65536:65536", "--shm-size=64g", f"-v {shared}:{shared}",
                            f"--env HF_HOME={shared}/hf"],
            "worker_run_options": ["--gpus all"]}


def _node_config(machine_type: str, launcher: LauncherConfig) -> dict:
    return {"machineType": machine_type,
            "disks": [{"boot": True, "autoDelete": True, "type": "PERSISTENT",
                       "initializeParams": {"diskSizeGb": int(launcher.disk_gb),
                                            "sourceImage": "projects/deeplearning-platform-release/global/images/"
                                                           "family/common-cu124-ubuntu-2204"}}],
            # GPU machines cannot live-migrate.
            "scheduling": [{"onHostMaintenance": "TERMINATE"}]}


def _shared_mount(cfg: PipelineConfig) -> list[str]:
    shared, export = cfg.cluster.kubernetes.shared_mount, cfg.cluster.launcher.nfs_export
    return ["dpkg -s nfs-common >/dev/null 2>&1 || (sudo apt-get update -q && sudo apt-get install -y -q nfs-common)",
            f"sudo mkdir -p {shared}", f"mountpoint -q {shared} || sudo mount -t nfs {export} {shared}"]


def cluster_launcher(cfg: PipelineConfig) -> dict:
    cluster, launcher = cfg.cluster, cfg.cluster.launcher
    worker_type = str(launcher.worker_machine_type).format(gpus=cluster.gpus_per_node)
    return {
        "cluster_name": f"speculators-{cluster.name}".replace("_", "-"),
        "max_workers": int(cluster.num_nodes),
        "idle_timeout_minutes": 30,
        "provider": {"type": "gcp", "region": launcher.region, "availability_zone": launcher.availability_zone,
                     "project_id": launcher.project_id},
        "auth": {"ssh_user": "ubuntu"},
        "docker": _docker(cfg),
        "available_node_types": {
            "head": {"resources": {"CPU": 0}, "node_config": _node_config(launcher.head_machine_type, launcher)},
            "gpu_worker": {"min_workers": int(cluster.num_nodes), "max_workers": int(cluster.num_nodes),
                           "resources": {DRIVER_RESOURCE: 1},
                           # The Deep Learning VM image installs the NVIDIA driver only when asked, on first boot;
                           # `docker run --gpus all` needs it.
                           "node_config": {**_node_config(worker_type, launcher), "metadata": {"items": [
                               {"key": "install-nvidia-driver", "value": "True"}]}},
                           "initialization_commands": [*_shared_mount(cfg),
                                                       "timeout 900 sh -c 'until nvidia-smi; do sleep 10; done'"]},
        },
        "head_node_type": "head",
        # Ray's token authentication: the token `ray get-auth-token --generate` wrote here goes to every node, and
        # the client sends the same one (RAY_AUTH_MODE=token ray job submit ...).
        "file_mounts": {"~/.ray/auth_token": "~/.ray/auth_token"},
        # Every node mounts the shared NFS export before Docker starts (stage outputs, checkpoints, HF cache).
        "initialization_commands": _shared_mount(cfg),
        # The dashboard stays on the head's loopback: reach it with `ray dashboard <this file>` (an SSH tunnel).
        "head_start_ray_commands": [
            "ray stop",
            "RAY_AUTH_MODE=token ray start --head --port=6379 --num-cpus=0 --num-gpus=0 --dashboard-host=127.0.0.1 "
            "--autoscaling-config=~/ray_bootstrap_config.yaml"],
        "worker_start_ray_commands": [
            "ray stop",
            "RAY_AUTH_MODE=token ray start --address=$RAY_HEAD_IP:6379 "
            f"--resources='{json.dumps({DRIVER_RESOURCE: 1})}'"],
    }
