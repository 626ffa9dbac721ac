"""A bad input per stage: a one-line error naming the field or file, a non-zero exit, nothing half-written."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.config import compose
from pipeline.entry import run_job
from pipeline.errors import PipelineError
from pipeline.runner import run_stages
from tests.conftest import tiny_overrides, write_jsonl

REPO = Path(__file__).resolve().parents[2]


def run_script(job: str, *overrides: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    return subprocess.run([sys.executable, str(REPO / "jobs" / f"{job}.py"), *overrides], capture_output=True,
                          text=True, timeout=300, env=env, cwd=REPO)


def test_unknown_config_key_fails_the_job_naming_the_key(tmp_path):
    result = run_script("run_pipeline", "training.no_such_option=3", f"paths.root={tmp_path}")
    assert result.returncode != 0
    assert "no_such_option" in result.stderr


@pytest.mark.parametrize("overrides,line", [
    (["training.max_steps=many"], "error: training.max_steps: Value 'many' of type 'str' could not be converted"),
    (["training.no_such_option=3"], "error: training.no_such_option: Key 'no_such_option' not in 'TrainingConfig'"),
    (["drafter=eagle3", "drafter.markov_rank=8"], "error: drafter.markov_rank: Key 'markov_rank' not in"),
    (["drafter=medusa"], "error: drafter: 'medusa' is not one of ['dflash', 'dflash2', 'dspark', 'eagle3', 'peagle']"),
    (["experiment=qwen3_8b_eagle"], "error: experiment: 'qwen3_8b_eagle' is not one of"),  # was silently ignored
    (["scale=huge"], "error: scale: 'huge' is not one of ['toy']"),
    (["training.optimizer=sgd"], "error: training.optimizer: 'sgd' is not one of [adamw, muon]"),
    (["training.max_steps=[1"], "error: override 'training.max_steps=[1': "),
    (["drafter=null"], "error: drafter: a config group cannot be set to null; choose one of ['dflash', 'dflash2', "),
    (["~drafter"], "error: drafter.name: not set (choose one with drafter=<option>"),
    (["deepspeed.enabled=2"], "error: deepspeed.enabled: must be true or false, got 2"),  # OmegaConf reads it as true
])
def test_a_config_hydra_cannot_compose_is_one_line_naming_the_key_and_exit_2(tmp_path, overrides, line):
    """Composition errors are bad input too: one line, exit 2 (Hydra alone prints five lines and exits 1)."""
    result = run_script("train", *overrides, f"paths.root={tmp_path}")
    assert result.returncode == 2, result.stderr
    assert result.stderr.strip().splitlines() == [result.stderr.strip()]
    assert result.stderr.startswith(line), result.stderr
    assert not (tmp_path / "train").exists()


def test_missing_prompt_file_exits_2_naming_it(tmp_path, tiny_verifier_path, capsys):
    cfg = compose(tiny_overrides(tmp_path, tiny_verifier_path, tmp_path / "missing.jsonl"))
    assert run_job(cfg, "generate") == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: data.path: prompt file") and "missing.jsonl" in err[-1]
    assert not (tmp_path / "prompts").exists()


def test_empty_dataset_exits_2(tmp_path, tiny_verifier_path, capsys):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert run_job(compose(tiny_overrides(tmp_path, tiny_verifier_path, empty)), "generate") == 2
    assert "is empty" in capsys.readouterr().err


def test_verifier_path_that_does_not_exist_exits_2_before_any_work(tmp_path, capsys):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}"} for i in range(10)])
    cfg = compose(tiny_overrides(tmp_path, "/no/such/verifier", prompts))
    assert run_job(cfg, "generate") == 2
    assert "verifier.path: '/no/such/verifier' does not exist" in capsys.readouterr().err
    assert not (tmp_path / "regenerated").exists()


def test_the_job_script_exits_non_zero_with_one_line(tmp_path):
    result = run_script("generate", "data=jsonl", f"data.path={tmp_path}/absent.jsonl", f"paths.root={tmp_path}")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines()[-1].startswith("error: data.path: prompt file")


def test_training_without_a_store_names_the_missing_manifest(tmp_path, tiny_verifier_path):
    cfg = compose(tiny_overrides(tmp_path, tiny_verifier_path))
    with pytest.raises(PipelineError, match=r"no hidden-state store .* run jobs/generate.py"):
        run_stages(cfg, "train", ["train"])


def test_evaluation_without_a_trained_drafter_says_which_job_to_run(tmp_path, tiny_verifier_path):
    cfg = compose(tiny_overrides(tmp_path, tiny_verifier_path))
    with pytest.raises(PipelineError, match="no trained drafter .* run jobs/train.py"):
        run_stages(cfg, "evaluate", ["evaluate"])


def test_drafter_layers_beyond_the_verifier_are_refused(tmp_path, tiny_verifier_path):
    from transformers import AutoConfig

    from pipeline.drafters.build import make_spec

    verifier_config = AutoConfig.from_pretrained(tiny_verifier_path)
    with pytest.raises(PipelineError, match=r"drafter\.aux_layer_ids: 40 is outside"):
        make_spec(compose(["drafter.aux_layer_ids=[1,2,40]"]).drafter, verifier_config, "t", tiny_verifier_path, 0)
    with pytest.raises(PipelineError, match=r"drafter\.aux_layer_ids: \[1, 2, 2\] repeats a layer"):
        make_spec(compose(["drafter.aux_layer_ids=[1,2,2]"]).drafter, verifier_config, "t", tiny_verifier_path, 0)
