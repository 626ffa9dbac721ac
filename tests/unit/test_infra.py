"""The cluster files: rendered from Hydra and committed without drift, valid against the Kubernetes and KubeRay
schemas offline, the RayService serving what jobs/serve.py serves, GPU counts that fit each cluster's shape, and
images that install the way the README does."""

from __future__ import annotations

import copy
import json
import re
from pathlib import Path

import pytest
import yaml

from pipeline.config import compose, validate
from pipeline.errors import PipelineError
from pipeline.infra.kuberay import DRIVER_RESOURCE, pipeline_entrypoint
from pipeline.infra.render import CLUSTER_SHAPES, EXPERIMENTS, rendered_files
from pipeline.infra.schemas import file_problems, manifest_problems
from pipeline.serving.job import serve_config_for
from pipeline.tracking import tracking_uri
from pipeline.verifier import resolve_verifier_path

REPO = Path(__file__).resolve().parents[2]
INFRA = REPO / "infra"
MANIFESTS = sorted((INFRA / "k8s").glob("*.yaml"))
# The seed scenarios: (experiment, drafter, GPUs, tensor parallel of the vLLM engines, eval set beside held_out).
SCENARIOS = {"qwen3_8b_peagle": ("peagle", 1, 1, "gsm8k"),
             "qwen3_30b_a3b_dflash": ("dflash", 2, 2, "humaneval"),
             "gemma4_31b_dspark": ("dspark", 2, 2, "humaneval")}


def load(path: Path) -> dict:
    return yaml.safe_load(path.read_text())


def test_the_committed_cluster_files_are_what_the_hydra_config_renders():
    rendered = rendered_files([])
    assert len(rendered) == 2 * len(CLUSTER_SHAPES) + 2 * len(EXPERIMENTS)
    for relative, text in rendered.items():
        committed = INFRA / relative
        assert committed.is_file(), f"{relative} is not committed: run python jobs/render_infra.py"
        assert committed.read_text() == text, f"{relative} differs from its Hydra config: run jobs/render_infra.py"


@pytest.mark.parametrize("path", MANIFESTS, ids=lambda path: path.name)
def test_every_manifest_is_valid_against_the_kubernetes_and_kuberay_schemas(path):
    assert file_problems(path) == []


def test_the_validation_names_what_is_wrong():
    job = load(INFRA / "k8s" / "rayjob-qwen3_8b_peagle.yaml")
    cluster = ["spec", "rayClusterSpec"]

    def broken(path: list, value) -> dict:
        document = copy.deepcopy(job)
        node = document
        for key in path[:-1]:
            node = node[key]
        node[path[-1]] = value
        return document

    workers = [*cluster, "workerGroupSpecs", 0]
    assert manifest_problems(broken([*workers, "replicas"], "two")) == [
        "spec.rayClusterSpec.workerGroupSpecs[0].replicas: 'two' is not of type 'integer'"]
    assert "'entrypiont' was unexpected" in manifest_problems(broken(["spec", "entrypiont"], "x"))[0]
    container = [*cluster, "headGroupSpec", "template", "spec", "containers", 0]
    assert any("'imagee' was unexpected" in p for p in manifest_problems(broken([*container, "imagee"], "x")))
    assert any("resources" in p for p in manifest_problems(broken([*container, "resources"], {"limits": []})))
    deployment = next(d for d in yaml.safe_load_all((INFRA / "k8s" / "mlflow.yaml").read_text())
                      if d["kind"] == "Deployment")
    deployment["spec"]["replicas"] = "one"
    assert manifest_problems(deployment) and "replicas" in manifest_problems(deployment)[0]
    assert manifest_problems({"apiVersion": "ray.io/v1", "kind": "RayThing"})
    assert manifest_problems({"apiVersion": 1, "kind": "Pod"}) == [
        "<root>: not a Kubernetes object (apiVersion and kind are required)"]


@pytest.mark.parametrize("image", ["", "  ", None])
def test_a_container_without_an_image_is_a_problem_in_every_kind(image):
    """The schemas leave a container's image optional; the API server does not. Checked in KubeRay and built-in
    kinds alike, and wherever the pod template sits."""
    job = load(INFRA / "k8s" / "rayjob-qwen3_8b_peagle.yaml")
    worker = job["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["template"]["spec"]["containers"][0]
    worker["image"] = image
    assert "spec.rayClusterSpec.workerGroupSpecs[0].template.spec.containers[0].image: a container needs an " \
           f"image, got {image!r}" in manifest_problems(job)
    deployment = next(d for d in yaml.safe_load_all((INFRA / "k8s" / "mlflow.yaml").read_text())
                      if d["kind"] == "Deployment")
    deployment["spec"]["template"]["spec"]["containers"][0]["image"] = image
    assert f"spec.template.spec.containers[0].image: a container needs an image, got {image!r}" \
        in manifest_problems(deployment)


def test_a_job_whose_driver_no_pod_can_take_is_a_problem():
    """The driver asks for pipeline_driver, which only the GPU pods offer: with none of them the job never starts."""
    job = load(INFRA / "k8s" / "rayjob-qwen3_8b_peagle.yaml")
    assert manifest_problems(job) == []
    no_workers = copy.deepcopy(job)
    no_workers["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["replicas"] = 0
    unoffered = copy.deepcopy(job)
    del unoffered["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["resources"]
    for broken in (no_workers, unoffered):
        assert f"spec.entrypointResources: '{DRIVER_RESOURCE}' is offered by no pod of the cluster (no group that " \
               "can hold a pod lists it under resources), so the driver never starts" in manifest_problems(broken)
    # what KubeRay also runs: an autoscaled group, resources given to `ray start`, a job on an existing cluster
    autoscaled = copy.deepcopy(no_workers)
    autoscaled["spec"]["rayClusterSpec"]["enableInTreeAutoscaling"] = True
    autoscaled["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["maxReplicas"] = 2
    started = copy.deepcopy(unoffered)
    started["spec"]["rayClusterSpec"]["workerGroupSpecs"][0]["rayStartParams"]["resources"] = \
        f'"{{\\"{DRIVER_RESOURCE}\\": 1}}"'
    selected = copy.deepcopy(job)
    del selected["spec"]["rayClusterSpec"]
    selected["spec"]["clusterSelector"] = {"ray.io/cluster": "shared"}
    for fine in (autoscaled, started, selected):
        assert not [p for p in manifest_problems(fine) if p.startswith("spec.entrypointResources")]
    job["spec"]["entrypointResources"] = "[1]"
    assert "spec.entrypointResources: not a JSON object of resource amounts" in manifest_problems(job)


@pytest.mark.parametrize("override", ["experiment=smoke", "cluster=local", "+cluster=a100_1x", "~experiment"])
def test_render_infra_refuses_an_override_of_the_groups_it_picks_per_file(override):
    """experiment=smoke rendered rayjob-qwen3_8b_peagle.yaml running smoke on a cluster with no GPU pod."""
    refused_line = rf"^overrides: '{re.escape(override)}': render_infra renders each "
    with pytest.raises(PipelineError, match=refused_line) as refused:
        rendered_files([override], ("qwen3_8b_peagle",), ())
    # the form it suggests works: `experiment` is a label, it has no fields (experiment.<field>= was suggested)
    suggested = "training.max_steps=" if "experiment" in override else "cluster.<field>="
    assert suggested in str(refused.value) and "experiment.<field>" not in str(refused.value)
    assert rendered_files(["cluster.kubernetes.namespace=team"], ("qwen3_8b_peagle",), ())  # a field is fine


@pytest.mark.parametrize("override", ["cluster.kubernetes.image=''", "cluster.kubernetes.namespace=' x'",
                                      "cluster.kubernetes.hf_secret='  '", "cluster.launcher.project_id=''"])
def test_an_empty_name_for_the_cluster_files_is_refused_by_field(override):
    field = override.split("=")[0]
    with pytest.raises(PipelineError, match=rf"^{re.escape(field)}: must be a non-empty name"):
        validate(compose([override]))


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_the_rayservice_serves_what_jobs_serve_builds_for_the_same_config(experiment):
    from ray.serve.schema import ServeDeploySchema

    cfg = compose([f"experiment={experiment}"])
    service = load(INFRA / "k8s" / f"rayservice-{experiment}.yaml")
    served = yaml.safe_load(service["spec"]["serveConfigV2"])
    # jobs/serve.py's prepare(): serve_config_for(cfg, ctx.verifier_path, ctx.tracker.uri)
    assert served == serve_config_for(cfg, resolve_verifier_path(cfg.verifier), tracking_uri(cfg))
    ServeDeploySchema.model_validate(served)
    args = served["applications"][0]["args"]
    assert args["speculator"]["uri"] == f"models:/{cfg.verifier.name}-{cfg.drafter.name}@champion"
    assert args["speculator"]["download_dir"].startswith(cfg.cluster.kubernetes.shared_mount)  # every pod sees it
    assert args["speculator"]["tracking_uri"] == cfg.cluster.mlflow_uri
    assert args["api_key_env"] == "SPECULATOR_API_KEY" and served["http_options"]["host"] == "0.0.0.0"


@pytest.mark.parametrize("experiment", EXPERIMENTS)
def test_each_experiment_composes_with_gpu_counts_that_match_its_cluster(experiment):
    drafter, gpus, tensor_parallel, eval_set = SCENARIOS[experiment]
    cfg = compose([f"experiment={experiment}"])
    validate(cfg)
    cluster = cfg.cluster
    assert cfg.drafter.name == drafter and cfg.verifier.path and cfg.verifier.compute_dtype == "bfloat16"
    assert cluster.num_nodes * cluster.gpus_per_node == gpus == cfg.training.num_workers
    assert cfg.generation.num_actors * cfg.generation.tensor_parallel_size <= gpus
    assert cfg.generation.tensor_parallel_size == cfg.serving.tensor_parallel_size == tensor_parallel
    assert cfg.evaluation.vllm.tensor_parallel_size == tensor_parallel  # the cross-check loads the verifier too
    assert cfg.serving.autoscaling.max_replicas * tensor_parallel <= gpus
    assert cfg.evaluation.datasets == ["held_out", eval_set]
    assert cfg.tracking.tracking_uri == cluster.mlflow_uri
    assert cfg.paths.root.startswith(cluster.kubernetes.shared_mount)
    job = load(INFRA / "k8s" / f"rayjob-{experiment}.yaml")["spec"]
    workers = job["rayClusterSpec"]["workerGroupSpecs"][0]
    limits = workers["template"]["spec"]["containers"][0]["resources"]["limits"]
    assert workers["replicas"] * int(limits["nvidia.com/gpu"]) == gpus
    assert job["entrypoint"] == pipeline_entrypoint(cfg) and f"experiment={experiment}" in job["entrypoint"]
    assert json.loads(job["entrypointResources"]) == {DRIVER_RESOURCE: 1}
    assert workers["resources"] == {DRIVER_RESOURCE: "1"}


def test_render_time_overrides_reach_the_job_but_manifest_only_ones_do_not():
    overrides = ["cluster.mlflow_uri=http://mlflow.example:5000", "training.max_steps=5",
                 "cluster.kubernetes.image=registry.example/pipeline:1", "data.system_prompt=Be brief."]
    files = rendered_files(overrides, experiments=("qwen3_8b_peagle",), shapes=())
    job = yaml.safe_load(files["k8s/rayjob-qwen3_8b_peagle.yaml"])["spec"]
    assert job["entrypoint"] == ("python /app/jobs/run_pipeline.py experiment=qwen3_8b_peagle "
                                 "cluster.mlflow_uri=http://mlflow.example:5000 training.max_steps=5 "
                                 "'data.system_prompt=Be brief.'")
    head = job["rayClusterSpec"]["headGroupSpec"]["template"]["spec"]["containers"][0]
    assert head["image"] == "registry.example/pipeline:1"
    assert {"name": "MLFLOW_TRACKING_URI", "value": "http://mlflow.example:5000"} in head["env"]
    served = yaml.safe_load(yaml.safe_load(files["k8s/rayservice-qwen3_8b_peagle.yaml"])["spec"]["serveConfigV2"])
    assert served["applications"][0]["args"]["speculator"]["tracking_uri"] == "http://mlflow.example:5000"


@pytest.mark.parametrize("override,field", [
    ("training.num_workers=2", "training.num_workers"),
    ("generation.tensor_parallel_size=2", "generation.tensor_parallel_size"),
    ("serving.tensor_parallel_size=2", "serving.tensor_parallel_size"),
    ("serving.autoscaling.max_replicas=3", "serving.autoscaling.max_replicas"),
    ("evaluation.vllm.tensor_parallel_size=2", "evaluation.vllm.tensor_parallel_size"),
])
def test_gpu_counts_that_do_not_fit_the_cluster_are_refused_by_name(override, field):
    with pytest.raises(PipelineError, match=re.escape(field)):
        validate(compose(["experiment=qwen3_8b_peagle", override]))


def test_tensor_parallel_groups_must_fit_inside_one_node():
    # 2 nodes x 3 GPUs: 6 GPUs, but only 2 engines of 2 GPUs fit (one per node), not 3.
    shape = ["experiment=qwen3_30b_a3b_dflash", "cluster.num_nodes=2", "cluster.gpus_per_node=3",
             "training.num_workers=6"]
    validate(compose([*shape, "generation.num_actors=2"]))
    with pytest.raises(PipelineError, match="generation.num_actors: 3 verifier actors of 2 GPU"):
        validate(compose([*shape, "generation.num_actors=3"]))
    with pytest.raises(PipelineError, match="serving.autoscaling.max_replicas: 3 replicas of 2 GPU"):
        validate(compose([*shape, "serving.autoscaling.max_replicas=3"]))


@pytest.mark.parametrize("shape", CLUSTER_SHAPES)
def test_the_cluster_launcher_configs_are_what_ray_up_accepts(shape):
    from ray.autoscaler._private.util import prepare_config, validate_config

    launcher = load(INFRA / "ray" / f"launcher-{shape}.yaml")
    validate_config(prepare_config(copy.deepcopy(launcher)))  # what `ray up` runs before it talks to the cloud
    cfg = compose([f"cluster={shape}"])
    worker = launcher["available_node_types"]["gpu_worker"]
    assert worker["min_workers"] == worker["max_workers"] == cfg.cluster.num_nodes
    assert worker["node_config"]["machineType"].endswith(f"-{cfg.cluster.gpus_per_node}g")
    assert worker["resources"] == {DRIVER_RESOURCE: 1}
    broken = copy.deepcopy(launcher)
    broken["available_node_types"]["gpu_worker"]["min_workers"] = "one"
    with pytest.raises(Exception, match="is not of type 'integer'"):
        validate_config(prepare_config(broken))


def test_the_images_install_the_project_the_way_the_readme_does():
    readme = (REPO / "README.md").read_text()
    assert "bash infra/install.sh cpu" in readme
    for target in ("gpu", "cpu"):
        dockerfile = (INFRA / "docker" / f"{target}.Dockerfile").read_text()
        assert re.search(rf"^RUN bash infra/install.sh {target}$", dockerfile, re.M), target
        assert re.search(r"^FROM rayproject/ray:2\.60\.0-py311-", dockerfile, re.M)  # the pinned Ray and Python
    pyproject = (REPO / "pyproject.toml").read_text()
    mlflow_pin = re.search(r'"mlflow==([\d.]+)"', pyproject)[1]
    assert f'"mlflow[auth]=={mlflow_pin}"' in (INFRA / "docker" / "mlflow.Dockerfile").read_text()
    deployment = next(d for d in yaml.safe_load_all((INFRA / "k8s" / "mlflow.yaml").read_text())
                      if d["kind"] == "Deployment")
    assert deployment["spec"]["template"]["spec"]["containers"][0]["image"].endswith(f":{mlflow_pin}")
    assert compose([]).cluster.kubernetes.ray_version == re.search(r'"ray\[[\w,]+\]==([\d.]+)"', pyproject)[1]


def test_no_secret_value_is_in_the_manifests():
    for path in MANIFESTS:
        for document in yaml.safe_load_all(path.read_text()):
            assert document["kind"] != "Secret", path.name
        text = path.read_text()
        assert not re.search(r"(PASSWORD|SECRET_ACCESS_KEY|TOKEN|API_KEY)\s*\n\s*value:", text), path.name


def pod_specs(document: dict) -> list[tuple[str, dict]]:
    """(where, pod spec) of every pod a manifest makes: Ray head and worker groups, StatefulSets, Deployments."""
    spec = document.get("spec", {})
    if document["kind"] in ("Deployment", "StatefulSet"):
        return [(document["metadata"]["name"], spec["template"]["spec"])]
    cluster = spec.get("rayClusterSpec") or spec.get("rayClusterConfig") or spec
    if "headGroupSpec" not in cluster:
        return []
    return [("head", cluster["headGroupSpec"]["template"]["spec"]),
            *((group["groupName"], group["template"]["spec"]) for group in cluster["workerGroupSpecs"])]


def envfrom_secrets(pod: dict) -> set[str]:
    return {source["secretRef"]["name"] for container in pod["containers"] for source in container.get("envFrom", [])}


def test_no_pod_runs_as_root_or_with_privileges():
    pods = [(path.name, where, pod) for path in MANIFESTS for document in yaml.safe_load_all(path.read_text())
            for where, pod in pod_specs(document)]
    assert {name for name, _, _ in pods} >= {"mlflow.yaml", "raycluster-a100_2x.yaml", "rayjob-qwen3_8b_peagle.yaml",
                                              "rayservice-qwen3_8b_peagle.yaml"}
    for name, where, pod in pods:
        security = pod["securityContext"]
        assert security["runAsNonRoot"] is True and security["runAsUser"] > 0, (name, where)
        assert security["seccompProfile"] == {"type": "RuntimeDefault"}, (name, where)
        for container in pod["containers"]:
            assert container["securityContext"]["allowPrivilegeEscalation"] is False, (name, where)
            assert container["securityContext"]["capabilities"]["drop"] == ["ALL"], (name, where)


def test_each_pod_gets_only_the_secrets_its_work_reads():
    k8s = compose([]).cluster.kubernetes
    secrets = {name: {where: envfrom_secrets(pod) for document in yaml.safe_load_all((INFRA / "k8s" / name).read_text())
                      for where, pod in pod_specs(document)}
               for name in ("raycluster-a100_2x.yaml", "rayjob-qwen3_8b_peagle.yaml",
                            "rayservice-qwen3_8b_peagle.yaml")}
    training_worker = {k8s.hf_secret, k8s.mlflow_secret}
    for name in ("raycluster-a100_2x.yaml", "rayjob-qwen3_8b_peagle.yaml"):
        # the head runs no job (num-cpus 0) and so holds no secret; no training pod holds the serving API key
        assert secrets[name].pop("head") == set(), name
        assert all(got == training_worker for got in secrets[name].values()), (name, secrets[name])
    served = secrets["rayservice-qwen3_8b_peagle.yaml"].values()
    assert all(got == training_worker | {k8s.serving_secret} for got in served)
    # the MLflow server and its database read only their own secrets, never the Ray pods'
    mlflow_pods = {where: pod for document in yaml.safe_load_all((INFRA / "k8s" / "mlflow.yaml").read_text())
                   for where, pod in pod_specs(document)}
    refs = {name: envfrom_secrets(pod) | {item["valueFrom"]["secretKeyRef"]["name"] for c in pod["containers"]
                                          for item in c.get("env", []) if "valueFrom" in item}
            for name, pod in mlflow_pods.items()}
    assert refs == {"mlflow-postgres": {"mlflow-db"}, "mlflow": {"mlflow-db", "mlflow-s3", "mlflow-auth"}}


def test_the_mlflow_server_requires_a_login_and_takes_no_secret_on_its_command_line():
    deployment = next(d for d in yaml.safe_load_all((INFRA / "k8s" / "mlflow.yaml").read_text())
                      if d["kind"] == "Deployment")
    (container,) = deployment["spec"]["template"]["spec"]["containers"]
    command_line = " ".join(container["command"] + container["args"])
    assert "--app-name=basic-auth" in command_line
    assert "PASSWORD" not in command_line and "postgresql" not in command_line
    env = {item["name"]: item for item in container["env"]}
    assert "$(POSTGRES_PASSWORD)" in env["MLFLOW_BACKEND_STORE_URI"]["value"]
    # a variable expands only from those defined before it
    names = list(env)
    assert names.index("POSTGRES_PASSWORD") < names.index("MLFLOW_BACKEND_STORE_URI")
