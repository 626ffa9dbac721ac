"""Offline validation of the manifests: built-in kinds against Kubernetes' own schemas (`kubernetes-validate`,
strict: an unknown field is an error), KubeRay kinds against the CRD schemas vendored in infra/schemas/kuberay/
(closed the same way: the API server would silently drop an unknown field, which hides typos), and the pod
templates inside them against Kubernetes' PodTemplate schema as well."""

from __future__ import annotations

import functools
import gzip
import json
from pathlib import Path
from typing import Any, Iterator

KUBERNETES_VERSION = "1.33"
KUBERAY_SCHEMAS = Path(__file__).resolve().parents[2] / "infra" / "schemas" / "kuberay"
KUBERAY_KINDS = {"RayCluster": "raycluster", "RayJob": "rayjob", "RayService": "rayservice"}


def _closed(schema: Any) -> Any:
    """The schema with additionalProperties: false wherever it lists properties and says nothing else."""
    if isinstance(schema, list):
        return [_closed(item) for item in schema]
    if not isinstance(schema, dict):
        return schema
    closed = {key: _closed(value) for key, value in schema.items()}
    if "properties" in schema and "additionalProperties" not in schema \
            and not schema.get("x-kubernetes-preserve-unknown-fields"):
        closed["additionalProperties"] = False
    return closed


@functools.lru_cache(maxsize=None)
def _kuberay_validator(kind: str):
    from jsonschema import Draft202012Validator

    schema = json.loads(gzip.decompress((KUBERAY_SCHEMAS / f"{KUBERAY_KINDS[kind]}.v1.json.gz").read_bytes()))
    return Draft202012Validator(_closed(schema))


def _pod_templates(spec: dict) -> Iterator[tuple[str, dict]]:
    """(field path, pod template) of a RayCluster spec, or of the one inside a RayJob / RayService."""
    prefix, cluster = next(((f"{key}.", spec[key]) for key in ("rayClusterSpec", "rayClusterConfig") if key in spec),
                           ("", spec))
    if "headGroupSpec" in cluster:
        yield f"{prefix}headGroupSpec.template", cluster["headGroupSpec"]["template"]
    for index, group in enumerate(cluster.get("workerGroupSpecs", [])):
        yield f"{prefix}workerGroupSpecs[{index}].template", group["template"]


def _kubernetes_problems(document: dict) -> list[str]:
    import kubernetes_validate

    try:
        kubernetes_validate.validate(document, KUBERNETES_VERSION, strict=True)
    except kubernetes_validate.ValidationError as error:
        return [f"{'.'.join(str(p) for p in error.path) or '<root>'}: {error.message}"]
    except kubernetes_validate.SchemaNotFoundError as error:
        return [f"kind: {error.message}"]
    return []


def manifest_problems(document: dict) -> list[str]:
    """The problems of one parsed manifest ([] = valid), each naming its field: every schema violation the KubeRay
    schema finds, the first one Kubernetes' schema finds (kubernetes-validate stops there), and every container
    without an image."""
    if not isinstance(document, dict) or not isinstance(document.get("kind"), str) \
            or not isinstance(document.get("apiVersion"), str):
        return ["<root>: not a Kubernetes object (apiVersion and kind are required)"]
    return (_schema_problems(document) + list(_container_image_problems(document))
            + _unschedulable_entrypoint(document))


def _unschedulable_entrypoint(document: dict) -> list[str]:
    """A RayJob whose driver asks for a custom resource (entrypointResources) that no pod of its cluster offers
    (the head's or a worker group's `resources`, a group with at least one replica): Ray never schedules it and
    the job waits for ever. The schemas cannot see this: each field is valid alone."""
    import json

    spec = document.get("spec") if document.get("kind") == "RayJob" else None
    if not isinstance(spec, dict) or not isinstance(spec.get("entrypointResources"), str):
        return []
    try:
        wanted = json.loads(spec["entrypointResources"])
    except ValueError:
        return ["spec.entrypointResources: not a JSON object of resource amounts"]
    if not isinstance(wanted, dict):
        return ["spec.entrypointResources: not a JSON object of resource amounts"]
    cluster = spec.get("rayClusterSpec")
    if not isinstance(cluster, dict):  # a job on an existing cluster (clusterSelector): its pods are not here
        return []
    # a group can hold a pod: replicas > 0, or the autoscaler may start one; a count of the wrong type is the schema's
    size = "maxReplicas" if cluster.get("enableInTreeAutoscaling") else "replicas"
    groups = [cluster.get("headGroupSpec") or {}] + [
        group for group in cluster.get("workerGroupSpecs") or []
        if isinstance(group, dict) and (not isinstance(group.get(size), int) or group[size] > 0)]
    offered = {name for group in groups for name in _group_resource_names(group)}
    return [f"spec.entrypointResources: '{name}' is offered by no pod of the cluster (no group that can hold a pod "
            "lists it under resources), so the driver never starts"
            for name in wanted if name not in ("CPU", "GPU", "memory") and name not in offered]


def _group_resource_names(group: dict) -> set[str]:
    """The custom resources a head or worker group's pods offer: its `resources` field, or the JSON object in
    rayStartParams.resources (`ray start --resources`, often quoted again for the shell)."""
    import json

    names = set(group["resources"]) if isinstance(group.get("resources"), dict) else set()
    params = group.get("rayStartParams")
    text = params.get("resources") if isinstance(params, dict) else None
    if isinstance(text, str):
        try:
            parsed = json.loads(text.strip().strip("'\"").replace('\\"', '"'))
        except ValueError:
            parsed = None
        names |= set(parsed) if isinstance(parsed, dict) else set()
    return names


def _schema_problems(document: dict) -> list[str]:
    kind = document["kind"]
    if not document["apiVersion"].startswith("ray.io/"):
        return _kubernetes_problems(document)
    if document["apiVersion"] != "ray.io/v1" or kind not in KUBERAY_KINDS:
        return [f"kind: {document['apiVersion']} {kind} is not a KubeRay kind this project validates"]
    problems = [f"{error.json_path.removeprefix('$.')}: {error.message}"
                for error in _kuberay_validator(kind).iter_errors(document)]
    for where, template in _pod_templates(document.get("spec", {})):
        pod_template = {"apiVersion": "v1", "kind": "PodTemplate", "metadata": {"name": "check"},
                        "template": template}
        problems += [f"spec.{where}: {problem}" for problem in _kubernetes_problems(pod_template)]
    return problems


def _container_image_problems(node: Any, where: str = "") -> Iterator[str]:
    """Containers without an image, anywhere in a manifest. The schemas leave `image` optional (for controllers
    that fill it in), but the API server refuses a pod whose container has none."""
    if isinstance(node, list):
        for index, item in enumerate(node):
            yield from _container_image_problems(item, f"{where}[{index}]")
        return
    if not isinstance(node, dict):
        return
    for key, value in node.items():
        field = f"{where}.{key}" if where else key
        if key in ("containers", "initContainers") and isinstance(value, list):
            for index, container in enumerate(value):
                image = container.get("image") if isinstance(container, dict) else None
                if not isinstance(image, str) or not image.strip():
                    yield f"{field}[{index}].image: a container needs an image, got {image!r}"
        yield from _container_image_problems(value, field)


def file_problems(path: Path) -> list[str]:
    """Every problem of every document in one manifest file, each prefixed with the file and document."""
    import yaml

    problems = []
    for index, document in enumerate(yaml.safe_load_all(path.read_text())):
        if document is not None:
            problems += [f"{path.name}[{index}] {problem}" for problem in manifest_problems(document)]
    return problems
