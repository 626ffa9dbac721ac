"""What a newcomer sees in MLflow, read back through MLflow's own API from a real SQLite store: the experiment opens
in the model-training view, runs are named for what they are, every registered version carries the model card the
export folder holds as README.md, and registering the same export again reuses its version."""

from __future__ import annotations

import dataclasses
import json
import shlex
from pathlib import Path

import mlflow
import pytest
from safetensors.torch import save_file

from pipeline.checkpoint import save_checkpoint
from pipeline.config import compose
from pipeline.context import Context
from pipeline.drafters.build import build_drafter
from pipeline.errors import PipelineError
from pipeline.export import stage as export_stage
from pipeline.export.model_card import model_card, with_gate_decision, without_gate_decision
from pipeline.export.speculators_format import export_digest
from pipeline.integrity import seal
from pipeline.paths import StagePaths
from pipeline.tracking import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, Tracker, child_run_name, parent_run_name
from tests.unit.tiny_drafters import tiny_spec, verifier_tensors

LINEAGE = {"lineage.prompts_key": "p1", "lineage.regenerated_key": "r1", "lineage.store_key": "s1",
           "lineage.train_key": "t1", "lineage.parent_run_id": "run0"}


def report(signature: str = "sig-a") -> dict:
    """An evaluation report of the shape pipeline/evaluation/stage.py writes (the fields the card reads)."""
    per_set = {"held_out": {"pooled_tau": 1.8125, "per_request_tau": 1.7933, "num_requests": 8},
               "humaneval": {"pooled_tau": 2.2461, "per_request_tau": 2.2017, "num_requests": 6}}
    return {"pooled_tau": 2.0017, "per_request_tau": 1.9683, "num_requests": 14,
            "conditional_acceptance": [0.6125, 0.4211, 0.25, 0.1], "cumulative_acceptance": [0.6125, 0.2579, 0.0645,
                                                                                          0.0072],
            "datasets": per_set, "num_speculative_tokens": 4, "temperature": 0.0, "signature": signature,
            "profile": {"recommended_k": 3, "per_k": []}}


# The defaults the expected names and card lines below spell out, pinned so a change of default leaves them true.
PINNED = ["verifier=smollm2", "data=humaneval", "data.num_train=48", "data.num_eval=8", "drafter=peagle",
          "drafter.num_speculative_tokens=4", "training.max_steps=300", "training.lr=0.002",
          "training.micro_batch_size=1", "training.num_workers=2", "training.grad_accum_steps=1", "deepspeed=zero2",
          "generation.backend=hf", "generation.capture_backend=null", "evaluation.datasets=[held_out]",
          "evaluation.num_speculative_tokens=4"]


@pytest.fixture
def cfg(tmp_path):
    return compose([f"paths.root={tmp_path}", *PINNED])


def test_run_names_say_what_each_run_is(cfg):
    assert parent_run_name(cfg, "pipeline") == "pipeline · SmolLM2-135M-Instruct · peagle K=4 · 300 steps"
    assert parent_run_name(cfg, "train") == "train · SmolLM2-135M-Instruct · peagle K=4 · 300 steps"
    assert parent_run_name(cfg, "evaluate") == "evaluate · SmolLM2-135M-Instruct · peagle K=4 · held_out"
    assert parent_run_name(cfg, "generate") == "generate · SmolLM2-135M-Instruct · humaneval · 48 prompts"
    names = {stage: child_run_name(cfg, stage) for stage in
             ("prompts", "regenerate", "capture", "train", "evaluate", "export", "vllm_eval", "promote", "other")}
    assert names == {
        "prompts": "prompts · humaneval · 48 train + 8 held out",
        "regenerate": "regenerate · humaneval · 48 prompts",
        "capture": "capture · humaneval · 48 prompts",
        "train": "train · peagle · 300 steps",
        "evaluate": "evaluate · held_out · K=4",
        "export": "export · peagle K=4",
        "vllm_eval": "vllm_eval · held_out · K=4",
        "promote": "promote · champion",
        "other": "other",
    }
    other = compose([*PINNED, "drafter=dflash", "drafter.num_speculative_tokens=8", "training.max_steps=20",
                     "evaluation.datasets=[held_out,humaneval]", "evaluation.num_speculative_tokens=3"])
    assert parent_run_name(other, "pipeline") == "pipeline · SmolLM2-135M-Instruct · dflash K=8 · 20 steps"
    assert parent_run_name(other, "evaluate") == ("evaluate · SmolLM2-135M-Instruct · dflash K=8 · "
                                                  "held_out, humaneval")
    assert child_run_name(other, "evaluate") == "evaluate · held_out, humaneval · K=3"  # the K it evaluates at


def test_runs_are_named_in_mlflow_and_keep_their_tags(cfg):
    tracker = Tracker(cfg)
    with tracker.parent_run("pipeline") as parent_id, tracker.child_run("train") as child_id:
        pass
    parent, child = tracker.client.get_run(parent_id), tracker.client.get_run(child_id)
    assert parent.info.run_name == "pipeline · SmolLM2-135M-Instruct · peagle K=4 · 300 steps"
    assert parent.data.tags["job"] == "pipeline" and parent.data.tags["experiment"] == cfg.experiment
    assert child.info.run_name == "train · peagle · 300 steps"
    assert child.data.tags["stage"] == "train" and child.data.tags["mlflow.parentRunId"] == parent_id


def test_the_experiment_opens_in_the_model_training_view(cfg, tmp_path):
    tracker = Tracker(cfg)
    experiment = tracker.client.get_experiment(tracker.experiment_id)
    assert experiment.tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND == "custom_model_development"

    client = mlflow.MlflowClient(tracker.uri)
    older = client.create_experiment("made-before-the-tag")  # an experiment an earlier version created
    chosen = client.create_experiment("chosen", tags={EXPERIMENT_KIND_TAG: "genai_development"})
    for name in ("made-before-the-tag", "chosen"):
        Tracker(compose([f"paths.root={tmp_path}", f"tracking.experiment_name={name}"]))
    assert client.get_experiment(older).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    assert client.get_experiment(chosen).tags[EXPERIMENT_KIND_TAG] == "genai_development"  # someone's choice


def test_the_card_holds_the_figures_the_training_and_the_serving_commands(cfg):
    config = {"speculators_model_type": "peagle",
              "speculators_config": {"verifier": {"name_or_path": "/models/smollm2"}}}
    card = model_card(cfg, config, "/out/export/t1", report(), {**LINEAGE, "export.sha256": "abc"}, ("m", "3"))
    assert card.startswith("# m version 3\n")
    for line in ("| held_out | 1.812 | 1.793 | 8 |", "| humaneval | 2.246 | 2.202 | 6 |",
                 "| all sets | 2.002 | 1.968 | 14 |", "| 1 | 0.613 | 0.613 |", "| 4 | 0.100 | 0.007 |"):
        assert line in card.splitlines()
    assert "K=4 draft tokens, temperature 0 (greedy)" in card
    assert "Recommended K (speculation profile, best predicted speed-up): 3" in card
    for fact in ("SmolLM2-135M-Instruct (`/models/smollm2`)", "humaneval (source humaneval, 48 training prompts)",
                 "| generation backend | hf |", '"depth_keep_decay": 0.8', "300 steps, lr 0.002",
                 "micro-batch 1 × 2 workers × 1 accumulation steps", "ZeRO stage 2", "| lineage.store_key | `s1` |",
                 "| export.sha256 | `abc` |"):
        assert fact in card
    serve = next(line for line in card.splitlines() if line.startswith("vllm serve"))
    words = shlex.split(serve)
    assert words[:3] == ["vllm", "serve", "/models/smollm2"] and words[3] == "--speculative-config"
    assert json.loads(words[4]) == {"model": "/out/export/t1", "num_speculative_tokens": 4, "method": "eagle3",
                                    "parallel_drafting": True}
    assert "python jobs/serve.py serving.model=models:/m/3" in card.splitlines()


def test_a_card_without_evaluation_or_registry_says_so(cfg):
    config = {"speculators_model_type": "dflash", "speculators_config": {"verifier": {"name_or_path": "v"}}}
    cfg.generation.backend = "vllm"
    cfg.generation.capture_backend = "hf"
    card = model_card(cfg, config, "/e", None, LINEAGE)
    assert "| generation backend | vllm (hidden states captured with hf) |" in card
    assert "Not evaluated: this export was made without an evaluation report." in card
    assert "jobs/serve.py" not in card and '"method": "dflash"' in card
    assert '"num_speculative_tokens": 4' in card  # the drafter's K when nothing was evaluated


@pytest.fixture
def export(cfg, tmp_path):
    """Run the export stage as the runner does (a child run of a parent run) on a tiny P-EAGLE checkpoint."""
    verifier = tmp_path / "verifier"  # where a checkpoint's drafter finds the verifier's embedding when loaded
    verifier.mkdir()
    embedding, head = verifier_tensors()
    save_file({"model.embed_tokens.weight": embedding, "lm_head.weight": head}, str(verifier / "model.safetensors"))
    spec = dataclasses.replace(tiny_spec("peagle"), verifier_path=str(verifier))
    checkpoint = tmp_path / "checkpoint"
    save_checkpoint(checkpoint, build_drafter(spec, (embedding, head)), {"step": 6})
    seal(checkpoint, rank=0, world_size=1)
    ctx = Context(cfg=cfg, paths=StagePaths(cfg), tracker=Tracker(cfg))

    def run(evaluation: dict | None) -> dict:
        with ctx.tracker.parent_run("evaluate"), ctx.tracker.child_run("export") as run_id:
            return export_stage.run(ctx, checkpoint, evaluation, run_id, LINEAGE)
    return ctx, run


def test_each_version_carries_the_card_the_export_folder_holds(export):
    ctx, run = export
    result = run(report())
    version = ctx.tracker.client.get_model_version(result["registered_model"], result["version"])
    readme = (ctx.paths.export / "README.md").read_text()
    assert version.description == readme
    assert readme.startswith(f"# SmolLM2-135M-Instruct-peagle version {result['version']}\n")
    assert "| held_out | 1.812 | 1.793 | 8 |" in readme and "| humaneval | 2.246 | 2.202 | 6 |" in readme
    assert f"serving.model=models:/SmolLM2-135M-Instruct-peagle/{result['version']}" in readme
    assert version.tags["export.sha256"] == result["sha256"] == export_digest(ctx.paths.export)
    logged = ctx.tracker.client.download_artifacts(version.run_id, "speculator/README.md", str(ctx.paths.root))
    assert open(logged).read() == readme  # the card was in the folder before it was logged


def test_registering_the_same_export_twice_yields_one_version(export):
    ctx, run = export
    first = run(report())
    name = first["registered_model"]
    card = ctx.tracker.client.get_model_version(name, first["version"]).description
    ctx.tracker.describe_version(name, first["version"],  # as a promote stage leaves it
                                 with_gate_decision(card, name, first["version"], False, "tau too low", "champion"))
    ctx.cfg.data.name = "relabelled"  # a label only: the same export, whose folder keeps the version's card
    again = run(report())
    assert (again["version"], again["reused"]) == (first["version"], True) and not first["reused"]
    assert (ctx.paths.export / "README.md").read_text() == card and "relabelled" not in card  # without the gate's
    assert len(ctx.tracker.client.search_model_versions(f"name = '{name}'")) == 1
    export_runs = ctx.tracker.client.search_runs([ctx.tracker.experiment_id], "tags.stage = 'export'")
    assert sorted(r.data.tags["registry.reused"] for r in export_runs) == ["False", "True"]

    other = run(report(signature="sig-b"))  # the same weights under another evaluation: its own figures
    unevaluated = run(None)
    assert len({first["version"], other["version"], unevaluated["version"]}) == 3
    card = ctx.tracker.client.get_model_version(name, unevaluated["version"]).description
    assert "Not evaluated" in card and card == (ctx.paths.export / "README.md").read_text()
    assert run(None)["version"] == unevaluated["version"]


def _files_of(ctx, run_id: str, path: str = "speculator") -> set[str]:
    return {entry.path.rsplit("/", 1)[-1] for entry in ctx.tracker.client.list_artifacts(run_id, path)}


def version_run(ctx, name: str, version: str) -> str:
    return ctx.tracker.client.get_model_version(name, version).run_id


def _uploaded_file(ctx, name: str, version: str, file: str) -> Path:
    """The version's file in the local store's artifact folder (where MLflow keeps what it uploaded)."""
    from urllib.parse import urlparse

    uri = ctx.tracker.client.get_run(version_run(ctx, name, version)).info.artifact_uri
    return Path(urlparse(uri).path) / "speculator" / file


def _export_runs(ctx) -> list:
    return ctx.tracker.client.search_runs([ctx.tracker.experiment_id], "tags.stage = 'export'",
                                          order_by=["attributes.start_time ASC"])


def test_a_reused_version_with_its_files_is_not_uploaded_again(export):
    ctx, run = export
    first = run(report())
    again = run(report())
    assert again["reused"] and again["version"] == first["version"]
    made, reused = _export_runs(ctx)
    assert {"config.json", "README.md"} <= _files_of(ctx, made.info.run_id)
    assert _files_of(ctx, reused.info.run_id) == set()  # the version's run holds them; nothing copied twice
    assert reused.data.tags["registry.version"] == first["version"]


def test_an_export_stopped_while_uploading_leaves_a_version_the_next_run_completes(export, monkeypatch):
    from mlflow.exceptions import MlflowException

    from pipeline.tracking import FILES_TAG

    ctx, run = export

    def stopped_upload(*args, **kwargs):
        raise KeyboardInterrupt  # Ctrl-C inside the upload

    def locked_store(*args, **kwargs):
        raise MlflowException("(sqlite3.OperationalError) database is locked")

    with monkeypatch.context() as patched:
        patched.setattr(Tracker, "log_artifact", stopped_upload)
        patched.setattr(Tracker, "delete_version", locked_store)  # the interrupted write still holds SQLite
        with pytest.raises(KeyboardInterrupt):  # what stopped the job, not the store's error
            run(report())
    name = "SmolLM2-135M-Instruct-peagle"
    (left,) = ctx.tracker.client.search_model_versions(f"name = '{name}'")
    assert FILES_TAG not in left.tags and _files_of(ctx, left.run_id) == set()
    assert _export_runs(ctx)[0].info.status == "KILLED"

    again = run(report())  # the same command again
    assert (again["version"], again["reused"]) == (str(left.version), True)
    completed = ctx.tracker.client.get_model_version(name, left.version)
    assert completed.tags[FILES_TAG] == "complete"
    assert {"config.json", "README.md"} <= _files_of(ctx, completed.run_id)  # where the version points
    assert completed.description.startswith(f"# {name} version {left.version}\n")
    assert completed.description == (ctx.paths.export / "README.md").read_text()


def test_a_version_registered_before_the_files_tag_is_not_uploaded_again(export, caplog):
    from pipeline.tracking import FILES_TAG

    ctx, run = export
    first = run(report())
    name = first["registered_model"]
    ctx.tracker.client.delete_model_version_tag(name, first["version"], FILES_TAG)  # as an older release left it
    card = ctx.tracker.client.get_model_version(name, first["version"]).description
    ctx.tracker.describe_version(name, first["version"],  # as a promote stage leaves it
                                 with_gate_decision(card, name, first["version"], True, "first champion", "champion"))
    stored = Path(ctx.tracker.client.download_artifacts(version_run(ctx, name, first["version"]),
                                                        "speculator/README.md", str(ctx.paths.root / "dl1")))
    uploaded = _uploaded_file(ctx, name, first["version"], "README.md")
    modified = uploaded.stat().st_mtime_ns
    again = run(report())
    assert again["reused"] and "incomplete files" not in caplog.text
    assert uploaded.stat().st_mtime_ns == modified and uploaded.read_text() == stored.read_text()  # not uploaded again
    version = ctx.tracker.client.get_model_version(name, first["version"])
    assert version.tags[FILES_TAG] == "complete" and "## Promotion gate" in version.description  # card kept


def test_a_version_left_without_its_card_gets_the_card_it_uploads(export):
    """A job killed after the upload but before the description: the rerun writes a new card (its own lineage), and
    must upload it too, or the description and the version's README.md disagree."""
    from pipeline.tracking import FILES_TAG

    ctx, run = export
    first = run(report())
    name = first["registered_model"]
    ctx.tracker.client.delete_model_version_tag(name, first["version"], FILES_TAG)
    ctx.tracker.describe_version(name, first["version"], "")
    label = "Z" * len(ctx.cfg.data.name)  # a new card of the same size as the uploaded one: sizes cannot tell
    ctx.cfg.data.name = label
    run(report())
    version = ctx.tracker.client.get_model_version(name, first["version"])
    assert label in version.description
    assert _uploaded_file(ctx, name, first["version"], "README.md").read_text() == version.description


def test_a_version_whose_run_is_gone_for_good_is_registered_again(export, monkeypatch):
    from mlflow.exceptions import MlflowException
    from mlflow.protos.databricks_pb2 import RESOURCE_DOES_NOT_EXIST

    ctx, run = export
    first = run(report())
    name = first["registered_model"]
    gone = ctx.tracker.client.get_model_version(name, first["version"]).run_id
    real_get_run = ctx.tracker.client.get_run

    def get_run(run_id):  # as after `mlflow gc`
        if run_id == gone:
            raise MlflowException(f"Run with id={run_id} not found", error_code=RESOURCE_DOES_NOT_EXIST)
        return real_get_run(run_id)

    monkeypatch.setattr(ctx.tracker.client, "get_run", get_run)
    again = run(report())
    assert again["version"] != first["version"] and not again["reused"]
    (kept,) = ctx.tracker.client.search_model_versions(f"name = '{name}'")
    assert str(kept.version) == again["version"] and kept.run_id != gone
    assert {"config.json", "README.md"} <= _files_of(ctx, kept.run_id)


def test_a_version_whose_upload_failed_is_removed(export, monkeypatch):
    ctx, run = export

    def failed_upload(*args, **kwargs):
        raise OSError("disk full")

    monkeypatch.setattr(Tracker, "log_artifact", failed_upload)
    with pytest.raises(OSError, match="disk full"):
        run(report())
    assert ctx.tracker.client.search_model_versions("name = 'SmolLM2-135M-Instruct-peagle'") == []


def test_an_artifact_folder_holding_a_link_is_not_uploaded(cfg, tmp_path):
    secret = tmp_path / "elsewhere" / "key.pem"
    secret.parent.mkdir()
    secret.write_text("-----BEGIN PRIVATE KEY-----")
    folder = tmp_path / "export"
    (folder / "sub").mkdir(parents=True)
    (folder / "config.json").write_text("{}")
    (folder / "sub" / "key.pem").symlink_to(secret)
    tracker = Tracker(cfg)
    with tracker.parent_run("export") as run_id:
        with pytest.raises(PipelineError, match=r"tracking: '.*sub/key\.pem' is a link"):
            tracker.log_artifact(folder, "speculator")
        with pytest.raises(PipelineError, match="is a link"):
            tracker.log_artifact(folder / "sub" / "key.pem", "speculator")
        assert tracker.client.list_artifacts(run_id) == []  # nothing was uploaded, not even config.json


def test_the_cards_gate_section_says_how_a_refused_version_is_served_and_is_replaced_on_a_rerun(cfg):
    config = {"speculators_model_type": "peagle",
              "speculators_config": {"verifier": {"name_or_path": "/models/smollm2"}}}
    card = model_card(cfg, config, "/e", report(), LINEAGE, ("m", "3"))
    refused = with_gate_decision(card, "m", "3", False, "tau 1.2000 does not beat the champion's 1.3000", "champion")
    assert refused.startswith(card.rstrip("\n") + "\n\n## Promotion gate\n\nRefused: tau 1.2000 does not beat")
    assert "python jobs/serve.py serving.model=models:/m/3 serving.allow_unpromoted=true" in refused.splitlines()
    promoted = with_gate_decision(refused, "m", "3", True, "first champion (tau 1.300)", "champion")
    assert promoted.count("## Promotion gate") == 1 and "Refused" not in promoted  # the rerun's decision replaces it
    assert promoted.endswith("## Promotion gate\n\nPromoted as `champion` (first champion (tau 1.300)); a better "
                             "version may hold the alias since.\n")
    assert promoted.startswith(card.rstrip("\n"))
    assert without_gate_decision(promoted) == without_gate_decision(refused) == without_gate_decision(card) == card


@pytest.mark.parametrize("uri", ["postgresql://db:5432/mlflow?sslmode=require&sslkey=/etc/mlflow/client.key",
                                 "https://acct.blob.core.windows.net/c/prompts.jsonl?sv=2022-11-02&sp=r",
                                 "sqlite:////tmp/mlflow.db", "http://127.0.0.1:5000/#/experiments/1",
                                 "s3://bucket/prompts.parquet", "postgresql://db/mlflow?passfile=/home/u/.pgpass",
                                 "http://h/?bypass_cache=1", "http://h/?bypass=1",
                                 "https://h/api?token_endpoint=https://idp/token",
                                 "s3://bucket/R&D/passage_len=512/part.parquet",
                                 "wasbs://container@account.blob.core.windows.net/artifacts",
                                 "abfss://fs@account.dfs.core.windows.net/artifacts"])
def test_a_uri_without_secrets_is_not_refused(uri):
    from pipeline.tracking import refuse_credentials

    refuse_credentials(uri, "tracking.tracking_uri")  # raises nothing


@pytest.mark.parametrize("uri", ["http://h/x;password=hunter2#token=hunter2", "sqlite:////x.db?SSLPassword=hunter2",
                                 "https://h/p?sig=hunter2&sv=1", "https://h/p?AccountKey=hunter2",
                                 "https://h/p?X-Amz-Credential=hunter2", "https://h/p?passphrase=hunter2",
                                 "https://h/p?api%5Fkey=hunter2", "https://h/p?%70assword=hunter2",
                                 "mssql+pyodbc:///?odbc_connect=DRIVER%3Dx%3BPWD%3Dhunter2", "https://h/p?jwt=hunter2",
                                 "https://h/p?session_id=hunter2", "wasbs://c:hunter2@account.blob.core.windows.net/a",
                                 "postgresql://u:hun#ter2@db/mlflow", "postgresql://u:hun?ter2@db/mlflow",
                                 "https://h/p?user_pass=hunter2", "https://h/p?db_pass=hunter2",
                                 "https://h/p?mysql_passwd=hunter2", "https://h/p?db_pwd=hunter2",
                                 "https://h/p?pass_phrase=hunter2"])
def test_every_kind_of_secret_parameter_is_refused_and_masked(uri):
    from pipeline.tracking import refuse_credentials

    with pytest.raises(PipelineError, match="carries credentials") as refused:
        refuse_credentials(uri, "tracking.tracking_uri")
    assert "hunter2" not in str(refused.value) and "ter2" not in str(refused.value) and "***" in str(refused.value)


def test_two_jobs_that_create_the_experiment_at_once_both_use_it(cfg, monkeypatch):
    """A named store is opened before the stage locks: two first jobs of one config may both find no experiment
    and both create it; the second one's create is refused, and it takes the experiment the first made."""
    import mlflow as mlflow_module

    Tracker(cfg)  # the first job made it
    real_get = mlflow_module.MlflowClient.get_experiment_by_name
    reads = []

    def read_before_the_other_job_created_it(self, name):
        reads.append(name)
        return None if len(reads) == 1 else real_get(self, name)

    monkeypatch.setattr(mlflow_module.MlflowClient, "get_experiment_by_name", read_before_the_other_job_created_it)
    second = Tracker(cfg)
    assert second.experiment_id == real_get(second.client, cfg.tracking.experiment_name).experiment_id
