"""Training that survives: the job killed and rerun continues the same loss curve, a lost worker is replaced from
the last checkpoint, and a checkpoint of 2 workers continues on 1 (DeepSpeed's universal checkpoint). ZeRO-3 follows
the single-worker loss curve, and its checkpoints' val.tau is the reference decoder's tau on them."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import mlflow
import pytest

from pipeline.config import compose
from pipeline.errors import PipelineError
from pipeline.integrity import is_intact
from pipeline.paths import StagePaths
from pipeline.runner import run_stages
from pipeline.tracking import tracking_uri
from tests.conftest import tiny_overrides, write_jsonl

REPO = Path(__file__).resolve().parents[2]
STEPS = 30


def train_overrides(root: Path, verifier: str, prompts: Path, *extra: str) -> list[str]:
    return tiny_overrides(root, verifier, prompts) + [
        "data.num_train=8", "data.num_eval=1", f"training.max_steps={STEPS}", "training.checkpoint_every=3",
        "training.log_every=1", "training.keep_checkpoints=10", *extra]


def start_train(overrides: list[str]) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    return subprocess.Popen([sys.executable, str(REPO / "jobs" / "train.py"), *overrides], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)


def finish(process: subprocess.Popen) -> None:
    _, stderr = process.communicate(timeout=900)
    assert process.returncode == 0, stderr[-3000:]


def losses_by_step(cfg) -> dict[int, float]:
    """The last train.loss logged for each step, over every run of the experiment (a resumed run logs again)."""
    client = mlflow.MlflowClient(tracking_uri(cfg))
    experiment = client.get_experiment_by_name(cfg.tracking.experiment_name)
    runs = client.search_runs([experiment.experiment_id], filter_string="tags.stage = 'train'",
                              order_by=["attributes.start_time ASC"])
    losses: dict[int, float] = {}
    for run in runs:
        for metric in sorted(client.get_metric_history(run.info.run_id, "train.loss"), key=lambda m: m.timestamp):
            losses[metric.step] = metric.value
    return losses


def rerun_losses(cfg) -> dict[int, float]:
    """train.loss by step as the latest train run of the experiment logged it."""
    client = mlflow.MlflowClient(tracking_uri(cfg))
    experiment = client.get_experiment_by_name(cfg.tracking.experiment_name)
    latest = client.search_runs([experiment.experiment_id], filter_string="tags.stage = 'train'",
                                order_by=["attributes.start_time DESC"], max_results=1)[0]
    return {m.step: m.value for m in client.get_metric_history(latest.info.run_id, "train.loss")}


def resumed_from(cfg) -> list[float]:
    """Steps the train runs resumed from (logged by rank 0 when it loads a checkpoint)."""
    client = mlflow.MlflowClient(tracking_uri(cfg))
    experiment = client.get_experiment_by_name(cfg.tracking.experiment_name)
    runs = client.search_runs([experiment.experiment_id], filter_string="tags.stage = 'train'")
    return sorted(m.value for r in runs for m in client.get_metric_history(r.info.run_id, "train.resumed_from_step"))


def checkpoint_steps(cfg) -> list[int]:
    """Steps of the checkpoints Ray Train has finished copying into storage: one it is still copying fails its
    integrity check (its train_state.json may be there but empty)."""
    folders = Path(cfg.cluster.storage_path).glob("train-*/checkpoint_*")
    return sorted(json.loads((folder / "train_state.json").read_text())["step"] for folder in folders
                  if is_intact(folder))


@pytest.fixture(scope="module")
def store(tmp_path_factory, tiny_verifier_path, ray_local):
    """One generated store, shared by every run below through a common output root for the generate stages."""
    root = tmp_path_factory.mktemp("resume")
    prompts = write_jsonl(root / "prompts.jsonl", [
        {"messages": [{"role": "user", "content": f"Describe the number {i} in {i % 3 + 2} words."}]}
        for i in range(9)])
    run_stages(compose(train_overrides(root / "generated", tiny_verifier_path, prompts)), "generate",
               ["prompts", "regenerate", "capture"])
    return root, prompts


def with_store(store, tiny_verifier_path, name: str, *extra: str):
    """A fresh output root holding a copy of the generated prompts/regenerated/store folders."""
    import shutil

    root, prompts = store
    target = root / name
    for folder in ("prompts", "regenerated", "stores"):
        shutil.copytree(root / "generated" / folder, target / folder)
    return compose(train_overrides(target, tiny_verifier_path, prompts, *extra)), train_overrides(
        target, tiny_verifier_path, prompts, *extra)


@pytest.fixture(scope="module")
def reference(store, tiny_verifier_path):
    """The uninterrupted run the others are compared with (in this process: its loss curve is the same)."""
    cfg, _ = with_store(store, tiny_verifier_path, "reference")
    run_stages(cfg, "train", ["train"])
    return cfg, losses_by_step(cfg)


def wait_for(condition, process: subprocess.Popen, what: str) -> None:
    deadline = time.time() + 600
    while not condition() and process.poll() is None and time.time() < deadline:
        time.sleep(0.1)
    assert process.poll() is None and condition(), f"the run ended or stalled before {what}"


@pytest.mark.slow
def test_a_lost_worker_is_replaced_and_a_killed_job_continues_the_same_loss_curve(store, tiny_verifier_path,
                                                                                  reference):
    """One job meets both faults: a training worker is killed (Ray Train replaces the worker group from the last
    checkpoint it registered), then the whole job and its local Ray are killed (a rerun continues from the last
    checkpoint, though it logs every second step: a logging setting keys no new run). After each restart the loss
    curve is the uninterrupted run's."""
    cfg, overrides = with_store(store, tiny_verifier_path, "killed")
    process = start_train(overrides)
    # A worker writes a checkpoint's files, then waits until the controller has taken its previous report (Ray
    # Train holds one per worker): the third checkpoint on disk means the first one is registered for a restart.
    wait_for(lambda: len(checkpoint_steps(cfg)) >= 3, process, "its third checkpoint")
    # this job's workers only (its own session), never those of another Ray on the machine
    workers = subprocess.run(["pgrep", "-s", str(process.pid), "-f", "ray::RayTrainWorker"], capture_output=True,
                             text=True).stdout.split()
    assert workers, "no training worker to kill"
    os.kill(int(workers[-1]), signal.SIGKILL)
    # checkpoints of steps past any written before the kill come from the replaced workers; two of them: the
    # first is registered
    before_kill = max(checkpoint_steps(cfg))
    wait_for(lambda: len([s for s in checkpoint_steps(cfg) if s > before_kill + 3]) >= 2, process,
             "two checkpoints after the worker was replaced")
    os.killpg(process.pid, signal.SIGKILL)  # the job and its local Ray, as a crash would
    process.wait()
    last_checkpoint = max(checkpoint_steps(cfg))
    assert last_checkpoint < STEPS
    finish(start_train([("training.log_every=2" if o == "training.log_every=1" else o) for o in overrides]))
    _, expected = reference
    losses = losses_by_step(cfg)
    state = json.loads((StagePaths(cfg).final_checkpoint / "train_state.json").read_text())
    assert state["step"] == STEPS and state["world_size"] == 2
    worker_restart, rerun = resumed_from(cfg)  # both continued from a checkpoint; neither started over
    # the rerun resumes from the newest checkpoint on disk, not from the older one Ray Train's snapshot registered
    assert 3 <= worker_restart <= before_kill and worker_restart < rerun == last_checkpoint
    for step in range(int(worker_restart) + 1, int(rerun) + 1):
        assert abs(losses[step] - expected[step]) <= 1e-3, (step, losses[step], expected[step])
    # the rerun logs every second step and each checkpoint's, each the mean loss of the steps since its last log
    logged = rerun_losses(cfg)
    assert sorted(logged) == [s for s in range(int(rerun) + 1, STEPS + 1) if s % 2 == 0 or s % 3 == 0]
    previous = int(rerun)
    for step in sorted(logged):
        window = [expected[s] for s in range(previous + 1, step + 1)]
        assert abs(logged[step] - sum(window) / len(window)) <= 1e-3, (step, logged[step], window)
        previous = step


@pytest.mark.slow
def test_two_workers_continue_on_one_from_a_zero_checkpoint(store, tiny_verifier_path, reference):
    reference_cfg, expected = reference
    midway = next(p.parent for p in Path(reference_cfg.cluster.storage_path).glob(
        "train-*/checkpoint_*/train_state.json") if json.loads(p.read_text())["step"] == 6)
    cfg, _ = with_store(store, tiny_verifier_path, "one-worker", "training.num_workers=1",
                        f"training.resume_from={midway}")
    run_stages(cfg, "train", ["train"])
    state = json.loads((StagePaths(cfg).final_checkpoint / "train_state.json").read_text())
    assert state["step"] == STEPS and state["world_size"] == 1 and state["global_batch"] == 4
    losses = losses_by_step(cfg)
    assert min(losses) == 7 and resumed_from(cfg) == [6]
    # one worker averages over the 4 sequences, two workers averaged two means of 2: close, not bit-equal
    for step in range(7, STEPS + 1):
        assert losses[step] == pytest.approx(expected[step], rel=0.05), step


@pytest.mark.slow  # it needs the reference run (a training job) that the slow tests here share
def test_a_checkpoint_of_another_drafter_is_refused_before_training(store, tiny_verifier_path, reference):
    reference_cfg, _ = reference
    final = StagePaths(reference_cfg).final_checkpoint
    # steps left to train after the checkpoint's (one at max_steps is refused before its drafter is read)
    cfg, _ = with_store(store, tiny_verifier_path, "other", "drafter=eagle3", f"training.resume_from={final}",
                        f"training.max_steps={STEPS + 10}")
    with pytest.raises(PipelineError, match="has algorithm 'peagle', this run has 'eagle3'"):
        run_stages(cfg, "train", ["train"])


@pytest.mark.slow  # it needs the reference run too
@pytest.mark.parametrize("max_steps", [STEPS, STEPS - 1])
def test_a_given_checkpoint_at_or_past_max_steps_is_refused_not_copied_as_a_shorter_run(store, tiny_verifier_path,
                                                                                        reference, max_steps):
    """Its copy would be another run's result under this run's key (and a shorter schedule it never followed)."""
    reference_cfg, _ = reference
    final = StagePaths(reference_cfg).final_checkpoint
    cfg, _ = with_store(store, tiny_verifier_path, f"short-{max_steps}", f"training.max_steps={max_steps}",
                        f"training.resume_from={final}")
    where = re.escape(str(final))
    with pytest.raises(PipelineError, match=rf"^training\.max_steps: {max_steps} leaves nothing to train after "
                                            rf"step {STEPS}, which training\.resume_from '{where}' already holds$"):
        run_stages(cfg, "train", ["train"])
    assert not StagePaths(cfg).final_checkpoint.exists()


@pytest.mark.slow  # it needs the reference run too
def test_a_final_checkpoint_made_from_the_runs_last_checkpoint_is_recorded_as_a_trained_one(store, tiny_verifier_path,
                                                                                           reference):
    """A job stopped after its last step's checkpoint but before final/ was made: the rerun made final/ of that
    checkpoint, and its train run carried no train.checkpoint, train.key or checkpoint artifact."""
    reference_cfg, _ = reference
    final = StagePaths(reference_cfg).final_checkpoint
    kept = final.rename(final.with_name("final.kept"))  # put back below: the other tests read the reference's
    try:
        results = run_stages(reference_cfg, "train", ["train"])
        client = mlflow.MlflowClient(tracking_uri(reference_cfg))
        train_run = client.search_runs(
            [client.get_experiment_by_name(reference_cfg.tracking.experiment_name).experiment_id],
            f"tags.mlflow.parentRunId = '{results['_parent_run_id']}'")[0]
        assert json.loads((final / "train_state.json").read_text())["step"] == STEPS
        assert train_run.data.tags["train.checkpoint"] == str(final) and train_run.data.tags["train.reused"] == "False"
        assert train_run.data.tags["train.key"] == StagePaths(reference_cfg).train_key
        assert train_run.data.metrics["train.resumed_from_step"] == STEPS  # the lineage: which run trained it
        assert {a.path for a in client.list_artifacts(train_run.info.run_id, "checkpoint")} == {
            "checkpoint/spec.json", "checkpoint/drafter.safetensors", "checkpoint/train_state.json"}
    finally:
        import shutil

        shutil.rmtree(final, ignore_errors=True)
        kept.rename(final)


# Every anchor and every depth: the drafter's loss then draws nothing at random, so runs can match step for step.
DETERMINISTIC = ["drafter.max_anchors=null", "drafter.depth_keep_decay=1.0", "training.autocast_dtype=null",
                 "training.max_steps=6", "training.micro_batch_size=1"]


def loss_curve(store, verifier: str, name: str, *extra: str) -> dict[int, float]:
    cfg, _ = with_store(store, verifier, name, *DETERMINISTIC, *extra)
    run_stages(cfg, "train", ["train"])
    return losses_by_step(cfg)


PACKING = ["training.max_tokens_per_micro_batch=200"]


# val.tau at every checkpoint, which picks the final one: measured on the ZeRO-3 run below (rank 0 decodes the
# full weights gathered from the shards) rather than in a training run of its own. Both runs hold out the same two
# samples, so their loss curves still match; the high learning rate makes the checkpoints' acceptance differ.
VAL_TAU = ["training.val_samples=2", "training.val_tau_samples=2", "training.val_tau_max_new_tokens=12",
           "training.select_best_by=val.tau", "training.checkpoint_every=2", "training.lr=0.05"]


@pytest.fixture(scope="module")
def single_worker_curve(store, tiny_verifier_path) -> dict[int, float]:
    return loss_curve(store, tiny_verifier_path, "single", "deepspeed=none", "training.num_workers=1",
                      "training.grad_accum_steps=2", *PACKING, *VAL_TAU)


@pytest.mark.slow
# ZeRO-3 in CI (it shards parameters, gradients and optimizer state: the most that can go wrong); ZeRO-2 and ZeRO-3
# with offload, a training run each, with `-m extended`.
@pytest.mark.parametrize("zero", [pytest.param("zero2", marks=pytest.mark.extended), "zero3",
                                  pytest.param("zero3_offload", marks=pytest.mark.extended)])
def test_zero_on_two_workers_follows_the_single_worker_loss_curve(store, tiny_verifier_path, single_worker_curve,
                                                                   zero):
    """The same global batch (1 worker accumulating 2 packed micro-batches vs 2 workers of 1 packed micro-batch):
    the same samples at every step, so the same gradients up to summation order and the same loss at every step.
    Packing to a token budget is part of the global order, so every ZeRO stage runs packed. The sharded run's
    checkpoints carry val.tau (check_val_tau)."""
    single = single_worker_curve
    cfg, _ = with_store(store, tiny_verifier_path, zero, *DETERMINISTIC, f"deepspeed={zero}",
                        "training.num_workers=2", *PACKING, *VAL_TAU)
    run_stages(cfg, "train", ["train"])
    sharded = losses_by_step(cfg)
    assert sorted(single) == sorted(sharded) == list(range(1, 7))
    assert single[6] < single[1]  # it trained
    for step in single:
        assert sharded[step] == pytest.approx(single[step], rel=1e-3, abs=1e-4), (step, sharded, single)
    client = mlflow.MlflowClient(tracking_uri(cfg))
    experiment = client.get_experiment_by_name(cfg.tracking.experiment_name)
    [run] = client.search_runs([experiment.experiment_id], filter_string="tags.stage = 'train'")
    assert run.data.metrics["train.sequences_per_micro_batch"] > 1.5  # the budget really packed several
    state = json.loads((StagePaths(cfg).final_checkpoint / "train_state.json").read_text())
    assert state["token_budget"] == 200
    check_val_tau(cfg, run, tiny_verifier_path)


def check_val_tau(cfg, run, verifier_path: str) -> None:
    """Every checkpoint, and only checkpoints, is validated: val.proxy_tau on the held-out samples, and val.tau,
    for which rank 0 decodes their prompts: it is what the reference decoder gives on that checkpoint's files and
    those prompts, decoded again here. select_best_by=val.tau makes the best of them the final checkpoint (the
    proxy picks through the same Ray Train ranking); each checkpoint is logged to MLflow."""
    import torch

    from pipeline.data.store import load_manifest, read_samples, sample_locations
    from pipeline.evaluation.measured_drafter import decoding_drafter
    from pipeline.evaluation.reference_decoder import SpeculativeDecoder
    from pipeline.metrics import merged
    from pipeline.training.validation import split_validation
    from pipeline.verifier import load_verifier

    client = mlflow.MlflowClient(tracking_uri(cfg))
    logged = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "val.tau")}
    proxy = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "val.proxy_tau")}
    assert sorted(logged) == sorted(proxy) == [2, 4, 6] and all(tau >= 1.0 for tau in logged.values())

    store_dir = StagePaths(cfg).store
    locations = sample_locations(store_dir, load_manifest(store_dir))
    _, held_out = split_validation(locations, 2, cfg.training.seed)
    layers = load_manifest(store_dir)["layer_ids"]
    samples = read_samples(store_dir, held_out, layers[:-1], layers[-1])
    prompts = []
    for sample in samples:
        first = sample["loss_mask"].tolist().index(1)
        prompts.append(sample["input_ids"][:first].tolist())
    verifier, tokenizer = load_verifier(verifier_path, "float32")
    measured = {}
    for state_file in Path(cfg.cluster.storage_path).glob("train-*/checkpoint_*/train_state.json"):
        drafter = decoding_drafter(state_file.parent)
        decoder = SpeculativeDecoder(verifier, drafter, cfg.evaluation.num_speculative_tokens)
        with torch.no_grad():
            counts = [c for _, c in decoder.generate_batch(prompts, 12, (tokenizer.eos_token_id,))]
        measured[json.loads(state_file.read_text())["step"]] = merged(counts).tau
    assert measured == pytest.approx(logged, abs=1e-9)
    final = json.loads((StagePaths(cfg).final_checkpoint / "train_state.json").read_text())["step"]
    assert logged[final] == max(logged.values())
    metrics = run.data.metrics
    assert metrics["train.best_val_tau"] == pytest.approx(max(logged.values()))
    assert metrics["train.best_step_by_val_tau"] == final and metrics["train.best_step"] == final
    assert proxy[metrics["train.best_step_by_proxy_tau"]] == max(proxy.values())
    defined = len(set(logged.values())) > 1 and len(set(proxy.values())) > 1  # else no rank correlation exists
    assert ("train.proxy_tau_spearman" in metrics) == defined
    assert -1.0 <= metrics.get("train.proxy_tau_spearman", 0.0) <= 1.0
    artifacts = {a.path for a in client.list_artifacts(run.info.run_id, "checkpoints")}
    assert artifacts == {"checkpoints/step-2", "checkpoints/step-4", "checkpoints/step-6"}  # every checkpoint
    assert {a.path.rsplit("/", 1)[-1] for a in client.list_artifacts(run.info.run_id, "checkpoints/step-4")} == {
        "spec.json", "drafter.safetensors", "train_state.json"}
