"""KubeRay custom resources (RayCluster, RayJob, RayService) built from the Hydra config.

The cluster's shape (`cluster.num_nodes` x `cluster.gpus_per_node`), its image, volume and secret come from
`cluster`; the RayJob's entrypoint is the pipeline job with the same experiment; the RayService's serveConfigV2 is
the Serve config `jobs/serve.py` builds for the same config. `jobs/render_infra.py` writes them as YAML.
"""

from __future__ import annotations

import json
import shlex
from collections.abc import Sequence
from typing import Any

import yaml

from pipeline.config.schema import PipelineConfig

API_VERSION = "ray.io/v1"
APP_DIR = "/app"  # where the images install the repository (infra/docker/*.Dockerfile)
SHARED_VOLUME = "shared"
# A custom resource only GPU pods have. The job driver asks for it (RayJob entrypointResources, `ray job submit
# --entrypoint-resources`) without asking for a GPU, so Ray leaves CUDA_VISIBLE_DEVICES alone and the driver's
# evaluate stage sees the pod's GPUs while the training workers (one per GPU) still get every GPU.
DRIVER_RESOURCE = "pipeline_driver"


def resource_name(cfg: PipelineConfig, kind: str) -> str:
    """Kubernetes names: lowercase letters, digits and '-'."""
    base = cfg.experiment if cfg.experiment not in ("default", None) else cfg.cluster.name
    return f"{kind}-{base}".replace("_", "-").lower()


def _metadata(cfg: PipelineConfig, name: str) -> dict:
    return {"name": name, "namespace": cfg.cluster.kubernetes.namespace,
            "labels": {"app.kubernetes.io/part-of": "speculators", "speculators/cluster": cfg.cluster.name}}


# What runs where, and so which secrets a pod needs. `head` schedules no work (num-cpus 0) in a RayJob or a
# job-submit RayCluster: the job driver runs on a GPU pod (DRIVER_RESOURCE). A RayService's head builds the Serve
# app (Serve's build task asks for no CPU): it resolves the champion from MLflow and reads the API key there.
TRAINING, SERVING = "training", "serving"


def pod_secrets(cfg: PipelineConfig, workload: str, group: str) -> list[str]:
    """The secrets (names) a pod of `group` ("head" or "worker") in a `workload` cluster gets as its environment:
    only the ones its work reads, so a training pod never holds the serving API key and an idle head holds none."""
    k8s = cfg.cluster.kubernetes
    if workload == SERVING:
        return [k8s.hf_secret, k8s.mlflow_secret, k8s.serving_secret]
    return [] if group == "head" else [k8s.hf_secret, k8s.mlflow_secret]


def _env(cfg: PipelineConfig) -> list[dict]:
    """Every pod: the MLflow server, a shared HF cache. Credentials come from the secrets (envFrom), not from here."""
    env = [{"name": "HF_HOME", "value": f"{cfg.cluster.kubernetes.shared_mount}/hf"},
           {"name": "RAY_USAGE_STATS_ENABLED", "value": "0"}]
    if cfg.cluster.mlflow_uri:
        env.insert(0, {"name": "MLFLOW_TRACKING_URI", "value": str(cfg.cluster.mlflow_uri)})
    return env


# No privilege beyond the image's own user: no escalation (setuid), no Linux capabilities. Ray, NCCL and vLLM
# need none of them; the GPUs come through the device plugin.
def _container_security() -> dict:
    return {"allowPrivilegeEscalation": False, "capabilities": {"drop": ["ALL"]}}


def _pod_security(cfg: PipelineConfig) -> dict:
    k8s = cfg.cluster.kubernetes
    return {"runAsNonRoot": True, "runAsUser": int(k8s.run_as_user), "runAsGroup": int(k8s.run_as_group),
            "fsGroup": int(k8s.run_as_group), "seccompProfile": {"type": "RuntimeDefault"}}


def _container(cfg: PipelineConfig, name: str, resources: dict, ports: list[dict], secrets: list[str]) -> dict:
    k8s = cfg.cluster.kubernetes
    container = {
        "name": name,
        "image": k8s.image,
        "imagePullPolicy": "IfNotPresent",
        "workingDir": APP_DIR,
        "env": _env(cfg),
        "resources": {"requests": dict(resources), "limits": dict(resources)},
        # KubeRay adds a memory-backed /dev/shm itself (NCCL and vLLM's workers share tensors through it).
        "volumeMounts": [{"name": SHARED_VOLUME, "mountPath": k8s.shared_mount}],
        "securityContext": _container_security(),
    }
    if secrets:
        container["envFrom"] = [{"secretRef": {"name": name, "optional": True}} for name in secrets]
    if ports:
        container["ports"] = ports
    return container


def _pod_template(cfg: PipelineConfig, container: dict, gpu: bool) -> dict:
    spec: dict[str, Any] = {
        "securityContext": _pod_security(cfg),
        "containers": [container],
        "volumes": [{"name": SHARED_VOLUME,
                     "persistentVolumeClaim": {"claimName": cfg.cluster.kubernetes.shared_volume_claim}}],
    }
    if gpu:
        spec["tolerations"] = [{"key": "nvidia.com/gpu", "operator": "Exists", "effect": "NoSchedule"}]
    return {"metadata": {"labels": {"app.kubernetes.io/part-of": "speculators"}}, "spec": spec}


def _head_group(cfg: PipelineConfig, workload: str) -> dict:
    k8s = cfg.cluster.kubernetes
    ports = [{"containerPort": 6379, "name": "gcs-server"}, {"containerPort": 8265, "name": "dashboard"},
             {"containerPort": 10001, "name": "client"}, {"containerPort": 8000, "name": "serve"}]
    container = _container(cfg, "ray-head", {"cpu": str(k8s.head_cpus), "memory": k8s.head_memory}, ports,
                           pod_secrets(cfg, workload, "head"))
    # The head schedules no GPU work (num-gpus 0) and takes no training or engine CPUs (num-cpus 0): the
    # drivers, the Serve controller and the router run there.
    return {"rayStartParams": {"dashboard-host": "0.0.0.0", "num-cpus": "0", "num-gpus": "0"},
            "template": _pod_template(cfg, container, gpu=False)}


def _worker_group(cfg: PipelineConfig, workload: str) -> dict:
    cluster = cfg.cluster
    resources = {"cpu": str(cluster.cpus_per_node), "memory": cluster.kubernetes.worker_memory,
                 "nvidia.com/gpu": str(cluster.gpus_per_node)}
    container = _container(cfg, "ray-worker", resources, [], pod_secrets(cfg, workload, "worker"))
    # Ray detects the GPUs and their type (accelerator_type:A100) itself. DRIVER_RESOURCE places the job driver on
    # a GPU pod, where evaluation runs the verifier once training has released the GPUs; the group's `resources`
    # field (KubeRay writes `ray start --resources`) rather than a hand-quoted rayStartParams string.
    return {"groupName": f"{str(cluster.accelerator_type or 'gpu').lower()}-x{cluster.gpus_per_node}",
            "replicas": int(cluster.num_nodes), "minReplicas": int(cluster.num_nodes),
            "maxReplicas": int(cluster.num_nodes), "rayStartParams": {},
            "resources": {DRIVER_RESOURCE: "1"}, "template": _pod_template(cfg, container, gpu=True)}


def ray_cluster_spec(cfg: PipelineConfig, workload: str = TRAINING) -> dict:
    """The RayCluster spec of `cluster`: one head pod, `num_nodes` GPU pods on the shared volume. `workload`
    (TRAINING or SERVING) decides which secrets its pods get (pod_secrets)."""
    return {"rayVersion": cfg.cluster.kubernetes.ray_version, "enableInTreeAutoscaling": False,
            # Ray's token authentication, the token from a secret you create (never in the repository).
            "authOptions": {"mode": "token", "secretName": cfg.cluster.kubernetes.ray_auth_secret},
            "headGroupSpec": _head_group(cfg, workload), "workerGroupSpecs": [_worker_group(cfg, workload)]}


def ray_cluster(cfg: PipelineConfig) -> dict:
    """A long-lived cluster to `ray job submit` to (port-forward its dashboard, 8265)."""
    return {"apiVersion": API_VERSION, "kind": "RayCluster",
            "metadata": _metadata(cfg, f"speculators-{cfg.cluster.name}".replace("_", "-")),
            "spec": ray_cluster_spec(cfg)}


def job_overrides(overrides: list[str]) -> list[str]:
    """The render-time overrides the job itself must see: all but those that only shape the manifests."""
    return [o for o in overrides if not o.lstrip("+~").startswith(("cluster.kubernetes.", "cluster.launcher."))]


def pipeline_entrypoint(cfg: PipelineConfig, overrides: Sequence[str] = ()) -> str:
    """The job a RayJob runs: the whole pipeline for this experiment and the job's overrides (what `ray job
    submit` runs by hand)."""
    return " ".join([f"python {APP_DIR}/jobs/run_pipeline.py", f"experiment={cfg.experiment}",
                     *(shlex.quote(o) for o in job_overrides(list(overrides)))])


def driver_resources() -> str:
    return json.dumps({DRIVER_RESOURCE: 1})


def ray_job(cfg: PipelineConfig, overrides: Sequence[str] = ()) -> dict:
    """The pipeline on a cluster of its own that KubeRay deletes five minutes after the job ends (time to read
    its logs; the outputs stay on the volume and in MLflow)."""
    return {"apiVersion": API_VERSION, "kind": "RayJob", "metadata": _metadata(cfg, resource_name(cfg, "pipeline")),
            "spec": {"entrypoint": pipeline_entrypoint(cfg, overrides), "entrypointResources": driver_resources(),
                     "submissionMode": "K8sJobMode",
                     "shutdownAfterJobFinishes": True, "ttlSecondsAfterFinished": 300, "backoffLimit": 0,
                     "rayClusterSpec": ray_cluster_spec(cfg)}}


def ray_service(cfg: PipelineConfig, serve_config: dict) -> dict:
    """The champion speculator behind the OpenAI endpoint; `serve_config` is jobs/serve.py's for this config."""
    return {"apiVersion": API_VERSION, "kind": "RayService", "metadata": _metadata(cfg, resource_name(cfg, "serve")),
            "spec": {"serveConfigV2": yaml.safe_dump(serve_config, sort_keys=False),
                     "rayClusterConfig": ray_cluster_spec(cfg, SERVING)}}
