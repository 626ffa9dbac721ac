"""The MLflow server of infra/k8s/mlflow.yaml, started here with the manifest's own command line: PostgreSQL
(pgserver's binaries) as the backend store and an S3 server (moto) as the artifact store, as on the cluster. A job's
run, its artifact and a registered version go through it, and the serving job's resolution downloads the speculator
back through the server's artifact proxy."""

from __future__ import annotations

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


def expand(argument: str, env: dict[str, str]) -> str:
    """Kubernetes' $(NAME) expansion of container args."""
    return re.sub(r"\$\((\w+)\)", lambda match: env[match[1]], argument)


def local_command(container: dict, env: dict[str, str], port: int) -> list[str]:
    """The manifest's command with its args expanded, listening on loopback with one worker (2 cores here)."""
    local = {"--host": "127.0.0.1", "--port": str(port), "--workers": "1"}
    args = []
    for argument in container["args"]:
        name = argument.split("=", 1)[0]
        args.append(f"{name}={local[name]}" if name in local else expand(argument, env))
    return [sys.executable, "-m", *container["command"], *args]


def get(url: str, host: str) -> int:
    request = urllib.request.Request(url, headers={"Host": host})
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


@pytest.fixture
def mlflow_server(postgres, s3, tmp_path):
    container = mlflow_container()
    env = {item["name"]: item["value"] for item in container["env"]}
    assert env["MLFLOW_ARTIFACTS_DESTINATION"] == f"s3://{BUCKET}"
    # The secrets' keys (mlflow-db, mlflow-s3), with this machine's values; the database on a unix socket.
    env.update(POSTGRES_USER="postgres", POSTGRES_PASSWORD="", POSTGRES_HOST="",
               POSTGRES_DB=f"mlflow?host={postgres.pgdata}", MLFLOW_S3_ENDPOINT_URL=s3[0], **S3_CREDENTIALS)
    port = free_port()
    log = (tmp_path / "mlflow.log").open("w")
    process = subprocess.Popen(local_command(container, env, port), env={**env, "PATH": str(Path(sys.executable).parent)
                                                                              + ":/usr/bin:/bin"},
                               stdout=log, stderr=subprocess.STDOUT, cwd=tmp_path)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 180
        while get(f"{url}/health", f"127.0.0.1:{port}") != 200:
            assert process.poll() is None, (tmp_path / "mlflow.log").read_text()[-3000:]
            assert time.monotonic() < deadline, (tmp_path / "mlflow.log").read_text()[-3000:]
            time.sleep(1)
        yield url, port
    finally:
        process.terminate()
        process.wait(timeout=30)


def test_the_manifests_mlflow_server_keeps_runs_in_postgres_and_artifacts_in_s3(mlflow_server, postgres, s3,
                                                                                 tmp_path):
    url, port = mlflow_server
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

    # The names the jobs and a port-forward use are admitted; any other Host header is refused. (The readiness
    # probe's /health is exempt from the check, whatever --allowed-hosts says.)
    api = f"{url}/api/2.0/mlflow/experiments/search?max_results=1"
    assert get(api, "mlflow.mlflow.svc.cluster.local:5000") == 200
    assert get(api, f"localhost:{port}") == 200
    assert get(api, "10.12.0.7:5000") == 403 and get(api, "evil.example.com") == 403
