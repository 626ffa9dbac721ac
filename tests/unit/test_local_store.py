"""A new local MLflow store is a copy of MLflow's empty schema: MLflow opens it as its own, its Default experiment
points at the new store (not the template's folder), and an existing store is never replaced."""

from __future__ import annotations

import sqlite3

import mlflow

from pipeline.tracking.local_store import _template_path, seed_local_store


def test_a_seeded_store_is_a_working_mlflow_store_of_its_own(tmp_path):
    cache = tmp_path / "cache"
    first, second = tmp_path / "a" / "mlflow.db", tmp_path / "b" / "mlflow.db"
    for db in (first, second):
        db.parent.mkdir()
        seed_local_store(db, cache)
        assert db.exists()
    assert _template_path(cache).exists()
    client = mlflow.MlflowClient(f"sqlite:///{second}")
    experiment_id = client.create_experiment("speculators", artifact_location=(tmp_path / "b" / "art").as_uri())
    run = client.create_run(experiment_id)
    client.log_metric(run.info.run_id, "eval.tau", 1.5)
    client.create_registered_model("drafter")
    assert client.get_run(run.info.run_id).data.metrics == {"eval.tau": 1.5}
    assert [m.name for m in client.search_registered_models()] == ["drafter"]
    # each copy's Default experiment keeps its artifacts beside the copy (not the template's folder, nor ./mlruns
    # under the folder the job ran from), and nothing of the other copy
    assert client.get_experiment("0").artifact_location == str(tmp_path / "b" / "artifacts" / "0")
    assert mlflow.MlflowClient(f"sqlite:///{first}").get_experiment_by_name("speculators") is None
    with sqlite3.connect(_template_path(cache)) as template:
        assert template.execute("SELECT COUNT(*) FROM experiments").fetchone() == (1,)


def test_an_existing_store_is_never_replaced(tmp_path):
    db = tmp_path / "mlflow.db"
    client = mlflow.MlflowClient(f"sqlite:///{db}")
    client.create_experiment("kept")
    seed_local_store(db, tmp_path / "cache")
    assert mlflow.MlflowClient(f"sqlite:///{db}").get_experiment_by_name("kept") is not None
    assert not _template_path(tmp_path / "cache").exists()  # nothing was built for a store that exists


def test_without_a_writable_cache_mlflow_creates_the_store_itself(tmp_path):
    cache = tmp_path / "cache"
    cache.write_text("a file where the cache folder should be")
    db = tmp_path / "mlflow.db"
    seed_local_store(db, cache)
    assert not db.exists()
    assert mlflow.MlflowClient(f"sqlite:///{db}").create_experiment("fresh")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cache", "mlflow.db"]  # no half-written file left
