"""What a newcomer sees in MLflow, read back through MLflow's own API from a real SQLite store: the experiment opens
in the model-training view and runs are named for what they are."""

from __future__ import annotations

import mlflow
import pytest

from pipeline.config import compose
from pipeline.tracking import EXPERIMENT_KIND, EXPERIMENT_KIND_TAG, Tracker, child_run_name, parent_run_name


@pytest.fixture
def cfg(tmp_path):
    return compose([f"paths.root={tmp_path}"])


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
    other = compose(["drafter=dflash", "drafter.num_speculative_tokens=8", "training.max_steps=20",
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
    Tracker(compose([f"paths.root={tmp_path}", "tracking.experiment_name=made-before-the-tag"]))
    Tracker(compose([f"paths.root={tmp_path}", "tracking.experiment_name=chosen"]))
    assert client.get_experiment(older).tags[EXPERIMENT_KIND_TAG] == EXPERIMENT_KIND
    assert client.get_experiment(chosen).tags[EXPERIMENT_KIND_TAG] == "genai_development"  # someone's choice
