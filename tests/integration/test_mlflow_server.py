"""The MLflow server of infra/k8s/mlflow.yaml, started here with the manifest's own command line: PostgreSQL
(pgserver's binaries) as the backend store and an S3 server (moto) as the artifact store, as on the cluster. A job's
run, its artifact and a registered version go through it, and the serving job's resolution downloads the speculator
back through the server's artifact proxy."""

from __future__ import annotations

import base64
import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest
import yaml

from pipeline.config import compose
from pipeline.serving.process import free_port
from pipeline.serving.registry import resolve
from pipeline.tracking import Tracker

REPO = Path(__file__).resolve().parents[2]
BUCKET = "speculators-mlflow"
# Stand-ins for the values the manifest and its secrets give on the cluster.
S3_CREDENTIALS = {"AWS_ACCESS_KEY_ID": "test-key", "AWS_SECRET_ACCESS_KEY": "test-secret",
                  "AWS_DEFAULT_REGION": "us-east-1"}


def mlflow_container() -> dict:
    documents = yaml.safe_load_all((REPO / "infra" / "k8s" / "mlflow.yaml").read_text())
    deployment = next(d for d in documents if d["kind"] == "Deployment" and d["metadata"]["name"] == "mlflow")
    return deployment["spec"]["template"]["spec"]["containers"][0]


def expand(value: str, env: dict[str, str]) -> str:
    """Kubernetes' $(NAME) expansion of an env value, from the variables defined before it."""
    return re.sub(r"\$\((\w+)\)", lambda match: env[match[1]], value)


def container_env(container: dict, secrets: dict[str, dict[str, str]], local: dict[str, str]) -> dict[str, str]:
    """The container's environment as Kubernetes builds it: envFrom secrets, then env in order (secretKeyRef
    values from `secrets`, $(NAME) expanded from what came before), with the plain values named in `local`
    replaced by this machine's."""
    env = {}
    for source in container.get("envFrom", []):
        env.update(secrets[source["secretRef"]["name"]])
    for item in container["env"]:
        if "valueFrom" in item:
            ref = item["valueFrom"]["secretKeyRef"]
            env[item["name"]] = secrets[ref["name"]][ref["key"]]
        else:
            env[item["name"]] = local.get(item["name"], expand(item["value"], env))
    return env


def process_tree_argv(pid: int) -> list[str]:
    """The command lines of a process and all its descendants (the server's uvicorn workers)."""
    import psutil

    parent = psutil.Process(pid)
    return [" ".join(p.cmdline()) for p in [parent, *parent.children(recursive=True)]]


def get(url: str, host: str, headers: dict | None = None) -> int:
    request = urllib.request.Request(url, headers={"Host": host, **(headers or {})})
    try:
        with urllib.request.urlopen(request, timeout=10) as response:
            return response.status
    except urllib.error.HTTPError as error:
        return error.code
    except urllib.error.URLError:
        return 0  # not listening yet


def query(postgres, sql: str, *params) -> list[tuple]:
    import psycopg2

    with psycopg2.connect(host=str(postgres.pgdata), dbname="mlflow", user="postgres") as connection:
        with connection.cursor() as cursor:
            cursor.execute(sql, params)
            return cursor.fetchall()


@pytest.fixture
def postgres(tmp_path):
    import pgserver
    server = pgserver.get_server(tmp_path / "pg", cleanup_mode="stop")
    server.psql("CREATE DATABASE mlflow;")
    yield server
    server.cleanup()


@pytest.fixture
def s3():
    import boto3
    from moto.server import ThreadedMotoServer

    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    client = boto3.client("s3", endpoint_url=endpoint, **{
        "aws_access_key_id": S3_CREDENTIALS["AWS_ACCESS_KEY_ID"],
        "aws_secret_access_key": S3_CREDENTIALS["AWS_SECRET_ACCESS_KEY"],
        "region_name": S3_CREDENTIALS["AWS_DEFAULT_REGION"]})
    client.create_bucket(Bucket=BUCKET)
    yield endpoint, client
    server.stop()


ADMIN_PASSWORD = "admin-password-of-this-test"


@pytest.fixture
def mlflow_server(postgres, s3, tmp_path):
    container = mlflow_container()
    assert container["command"] == ["/bin/sh", "-c"]
    # The secrets' keys (mlflow-db, mlflow-s3, mlflow-auth) with this machine's values; the database on a unix socket.
    secrets = {"mlflow-db": {"POSTGRES_USER": "postgres", "POSTGRES_PASSWORD": ""},
               "mlflow-s3": {"MLFLOW_S3_ENDPOINT_URL": s3[0], **S3_CREDENTIALS},
               "mlflow-auth": {"MLFLOW_AUTH_ADMIN_PASSWORD": ADMIN_PASSWORD,
                               "MLFLOW_FLASK_SERVER_SECRET_KEY": "csrf-key-of-this-test"}}
    # Here: the database on a unix socket, loopback, one worker (2 cores), the auth config in the test's folder.
    port = free_port()
    env = container_env(container, secrets, {
        "POSTGRES_HOST": "", "POSTGRES_DB": f"mlflow?host={postgres.pgdata}", "MLFLOW_HOST": "127.0.0.1",
        "MLFLOW_PORT": str(port), "MLFLOW_WORKERS": "1",
        "MLFLOW_AUTH_CONFIG_PATH": str(tmp_path / "auth" / "basic_auth.ini")})
    assert env["MLFLOW_ARTIFACTS_DESTINATION"] == f"s3://{BUCKET}"
    assert env["MLFLOW_BACKEND_STORE_URI"] == f"postgresql+psycopg2://postgres:@/mlflow?host={postgres.pgdata}"
    log = (tmp_path / "mlflow.log").open("w")
    process = subprocess.Popen([*container["command"], *container["args"]],
                               env={**env, "PATH": str(Path(sys.executable).parent) + ":/usr/bin:/bin"},
                               stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while get(f"{url}/health", f"127.0.0.1:{port}") != 200:
            assert process.poll() is None, (tmp_path / "mlflow.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "mlflow.log").read_text()[-3000:]
            time.sleep(1)
        yield url, port, process.pid
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_the_manifests_mlflow_server_keeps_runs_in_postgres_and_artifacts_in_s3(mlflow_server, postgres, s3,
                                                                                 tmp_path, monkeypatch):
    url, port, pid = mlflow_server
    # No secret and no database URI on any of the server's command lines (`ps` shows those to every user).
    for argv in process_tree_argv(pid):
        assert "postgresql" not in argv and ADMIN_PASSWORD not in argv and "test-secret" not in argv, argv
    # Every API call needs a login; the jobs' (MLFLOW_TRACKING_USERNAME / _PASSWORD, from their secret) works.
    api = f"{url}/api/2.0/mlflow/experiments/search?max_results=1"
    assert get(api, f"127.0.0.1:{port}") == 401
    monkeypatch.setenv("MLFLOW_TRACKING_USERNAME", "admin")
    monkeypatch.setenv("MLFLOW_TRACKING_PASSWORD", ADMIN_PASSWORD)
    tracker = Tracker(compose([f"paths.root={tmp_path}", f"tracking.tracking_uri={url}"]))
    export = tmp_path / "export"
    export.mkdir()
    (export / "config.json").write_text(json.dumps({"speculators_model_type": "peagle"}))
    from pipeline.integrity import seal

    seal(export)  # as the export stage seals it
    with tracker.parent_run("evaluate") as run_id:
        tracker.log_metrics({"eval.pooled_tau": 1.5})
        tracker.log_artifact(export, "speculator")
        version = tracker.register("m", "speculator", run_id, {"eval.recommended_k": "3"})
    tracker.set_alias("m", "champion", version)

    resolved = resolve(tracker.client, "models:/m@champion", tmp_path / "downloads")
    assert json.loads((resolved.local_dir / "config.json").read_text()) == {"speculators_model_type": "peagle"}
    assert resolved.recommended_k == 3
    keys = [item["Key"] for item in s3[1].list_objects_v2(Bucket=BUCKET).get("Contents", [])]
    assert any(key.endswith("speculator/config.json") and run_id in key for key in keys), keys
    # The run and the alias live in PostgreSQL, not in a local file store.
    assert query(postgres, "SELECT status FROM runs WHERE run_uuid = %s", run_id) == [("FINISHED",)]
    assert query(postgres, "SELECT alias, version FROM registered_model_aliases WHERE name = %s", "m") == [
        ("champion", int(version))]
    # The basic-auth app keeps its users in the same database: the admin, created from the secret on first start.
    assert query(postgres, "SELECT username, is_admin FROM users") == [("admin", True)]

    # The names the jobs and a port-forward use are admitted; any other Host header is refused. (The readiness
    # probe's /health is exempt from the check, whatever the allowed hosts say.)
    login = {"Authorization": "Basic " + base64.b64encode(f"admin:{ADMIN_PASSWORD}".encode()).decode()}
    assert get(api, "mlflow.mlflow.svc.cluster.local:5000", login) == 200
    assert get(api, f"localhost:{port}", login) == 200
    assert get(api, "10.12.0.7:5000", login) == 403 and get(api, "evil.example.com", login) == 403
    wrong = {"Authorization": "Basic " + base64.b64encode(b"admin:wrong").decode()}
    assert get(api, f"localhost:{port}", wrong) == 401
