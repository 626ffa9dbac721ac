"""The generation stage as users meet it: killed with SIGKILL and rerun, a corrupt shard, a foreign tokenizer, and
the awkward rows of real prompt files. Runs `jobs/generate.py` in subprocesses on the tiny verifier."""

from __future__ import annotations

import json
import os
import random
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import datasets
import mlflow
import pytest

from pipeline.config import compose
from pipeline.data.store import load_manifest, verify_store
from pipeline.entry import run_job
from pipeline.errors import PipelineError
from pipeline.paths import StagePaths
from pipeline.runner import run_stages
from pipeline.tracking import tracking_uri
from tests.conftest import tiny_overrides, write_jsonl

REPO = Path(__file__).resolve().parents[2]
NUM_PROMPTS = 16


def generate_overrides(root: Path, verifier: str, prompts: Path) -> list[str]:
    # 2 samples per batch: 8 regeneration parts and 8 store shards, so there is a run to interrupt.
    return tiny_overrides(root, verifier, prompts) + [
        f"data.num_train={NUM_PROMPTS}", "data.num_eval=1", "generation.batch_size=2"]


def start_generate(overrides: list[str]) -> subprocess.Popen:
    env = {**os.environ, "HYDRA_FULL_ERROR": "0"}
    # its own session: SIGKILL to the group takes the job and the local Ray it started down together, as a crash would
    return subprocess.Popen([sys.executable, str(REPO / "jobs" / "generate.py"), *overrides], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)


def finished_batches(paths: StagePaths) -> int:
    return len(list(paths.regenerated_parts.glob("part-*.parquet"))) + len(list(paths.store.glob("shard-*")))


@pytest.fixture(scope="module")
def killed_then_rerun(tmp_path_factory, tiny_verifier_path):
    root = tmp_path_factory.mktemp("killed")
    prompts = write_jsonl(root / "prompts.jsonl", [
        {"messages": [{"role": "user", "content": f"List {i} fruits and {i + 1} colours."}]}
        for i in range(NUM_PROMPTS + 1)])
    overrides = generate_overrides(root / "out", tiny_verifier_path, prompts)
    paths = StagePaths(compose(overrides))
    # a random point among the 16 finished batches (8 parts, then 8 shards), fixed by the seed to stay reproducible
    kill_after = random.Random(4).randint(1, 14)
    process = start_generate(overrides)
    deadline = time.time() + 600
    while finished_batches(paths) < kill_after and process.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    assert process.poll() is None, f"the job ended before batch {kill_after}: {process.stderr.read()[-2000:]}"
    os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    at_kill = {"parts": sorted(p.name for p in paths.regenerated_parts.glob("part-*")),
               "shards": sorted(p.name for p in paths.store.glob("shard-*")), "kill_after": kill_after}
    rerun = start_generate(overrides)
    _, stderr = rerun.communicate(timeout=900)
    assert rerun.returncode == 0, stderr[-3000:]
    return compose(overrides), paths, at_kill


def test_after_sigkill_and_rerun_every_sample_is_stored_exactly_once(killed_then_rerun):
    cfg, paths, at_kill = killed_then_rerun
    assert len(at_kill["parts"]) + len(at_kill["shards"]) >= at_kill["kill_after"]
    manifest = verify_store(paths.store)  # every sha256 matches
    stored = [sid for shard in manifest["shards"] for sid in shard["sample_ids"]]
    regenerated = datasets.load_from_disk(str(paths.regenerated))
    assert len(stored) == len(set(stored)) == NUM_PROMPTS
    assert sorted(stored) == sorted(regenerated["sample_id"]) and len(set(regenerated["sample_id"])) == NUM_PROMPTS
    assert not list(paths.store.glob(".shard-*")) and not paths.regenerated_parts.exists()
    # the shards finished before the kill were kept, not recomputed
    assert set(at_kill["shards"]) <= {s["file"] for s in manifest["shards"]}


def test_the_manifest_records_what_a_store_user_needs(killed_then_rerun):
    _, paths, _ = killed_then_rerun
    manifest = load_manifest(paths.store)
    for key in ("layer_ids", "dtype", "compression", "hidden_size", "verifier", "chat_template_hash",
                "tokenizer_fingerprint", "projected_bytes", "num_tokens"):
        assert manifest[key] is not None, key
    assert manifest["projected_bytes"] <= manifest["bytes"] <= manifest["projected_bytes"] + 4096 * len(
        manifest["shards"])


def copy_outputs(cfg, tmp_path: Path) -> tuple:
    """A private copy of the finished outputs, to damage without touching the module's store."""
    root = tmp_path / "copy"
    shutil.copytree(cfg.paths.root, root, ignore=shutil.ignore_patterns("mlflow", "ray"))
    copied = compose([*cfg_overrides(cfg), f"paths.root={root}"])
    return copied, StagePaths(copied)


def cfg_overrides(cfg) -> list[str]:
    return [f"verifier.path={cfg.verifier.path}", "verifier=hf", "verifier.name=tiny", "experiment=smoke",
            "data=jsonl", f"data.path={cfg.data.path}", f"data.num_train={NUM_PROMPTS}", "data.num_eval=1",
            "generation.batch_size=2", "generation.max_new_tokens=12"]


def test_verify_names_a_corrupt_shard_and_training_refuses_the_store(killed_then_rerun, tmp_path):
    cfg, _, _ = killed_then_rerun
    copied, paths = copy_outputs(cfg, tmp_path)
    victim = paths.store / load_manifest(paths.store)["shards"][3]["file"]
    data = bytearray(victim.read_bytes())
    data[len(data) // 2] ^= 0x01
    victim.write_bytes(bytes(data))
    result = subprocess.run([sys.executable, str(REPO / "jobs" / "verify_store.py"), str(paths.store)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 2 and victim.name in result.stderr and "corrupt" in result.stderr
    with pytest.raises(PipelineError, match=victim.name):
        run_stages(copied, "train", ["train"])
    ok = subprocess.run([sys.executable, str(REPO / "jobs" / "verify_store.py"), str(cfg_store(cfg))],
                        capture_output=True, text=True, timeout=120)
    assert ok.returncode == 0 and ok.stdout.startswith("ok:")


def cfg_store(cfg) -> Path:
    return StagePaths(cfg).store


def test_a_store_or_regenerated_set_from_another_tokenizer_is_refused(killed_then_rerun, tmp_path):
    cfg, _, _ = killed_then_rerun
    copied, paths = copy_outputs(cfg, tmp_path)
    manifest = load_manifest(paths.store)
    (paths.store / "manifest.json").write_text(json.dumps({**manifest, "tokenizer_fingerprint": "0" * 16}))
    with pytest.raises(PipelineError, match="different tokenizer"):
        run_stages(copied, "train", ["train"])
    info = paths.regenerated / "regeneration.json"
    info.write_text(json.dumps({**json.loads(info.read_text()), "tokenizer_fingerprint": "0" * 16}))
    with pytest.raises(PipelineError, match="tokenized with a different tokenizer"):
        run_stages(copied, "generate", ["capture"])


@pytest.mark.parametrize("layers, message", [(None, "'num_verifier_layers' is missing; recapture"),
                                             (99, "was captured from 99 verifier layers")])
def test_a_store_without_the_verifiers_layer_count_is_refused_before_training(killed_then_rerun, tmp_path, layers,
                                                                                message):
    cfg, _, _ = killed_then_rerun
    copied, paths = copy_outputs(cfg, tmp_path)
    manifest = load_manifest(paths.store)
    manifest.pop("num_verifier_layers")
    if layers is not None:
        manifest["num_verifier_layers"] = layers
    (paths.store / "manifest.json").write_text(json.dumps(manifest))
    with pytest.raises(PipelineError, match=message):
        run_stages(copied, "train", ["train"])


def test_a_tokenizer_larger_than_the_verifier_vocabulary_is_refused(tmp_path, tiny_verifier_path, capsys):
    from transformers import AutoTokenizer

    verifier = tmp_path / "verifier"
    shutil.copytree(tiny_verifier_path, verifier)
    tokenizer = AutoTokenizer.from_pretrained(verifier)
    tokenizer.add_tokens([f"<extra_{i}>" for i in range(8)])
    tokenizer.save_pretrained(verifier)
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}"} for i in range(4)])
    cfg = compose(tiny_overrides(tmp_path / "out", str(verifier), prompts) + ["data.num_train=3", "data.num_eval=1"])
    assert run_job(cfg, "generate") == 2
    assert "tokenizer has" in capsys.readouterr().err and not (tmp_path / "out" / "stores").exists()


def test_awkward_rows_are_reported_skips_and_the_rest_is_stored(tmp_path, tiny_verifier_path, ray_local):
    prompts = tmp_path / "awkward.jsonl"
    rows = [{"messages": [{"role": "user", "content": f"Name {i} animals."}]} for i in range(5)]
    rows.append({"messages": [{"role": "user", "content": "word " * 500}]})  # longer than max_length
    rows.append({"messages": []})  # empty conversation
    rows.append({"conversations": [{"from": "human", "value": "Hi"}, {"from": "gpt", "value": "Hello"},
                                   {"from": "human", "value": "And then?"}]})  # multi-turn ShareGPT
    write_jsonl(prompts, rows)
    cfg = compose(tiny_overrides(tmp_path, tiny_verifier_path, prompts) + [
        "data.num_train=6", "data.num_eval=1", "generation.max_length=256", "generation.overlength=drop"])
    results = run_stages(cfg, "generate", ["prompts", "regenerate", "capture"])
    train, _ = results["prompts"]
    assert any(m["content"].startswith("word word") for row in train for m in row["messages"])  # seed 0 keeps it
    assert results["capture"]["num_samples"] == 5  # 6 training conversations, the long one skipped
    multi_turn = next(r for r in results["regenerate"] if len(r["messages"]) == 4)
    assert [m["role"] for m in multi_turn["messages"]] == ["user", "assistant", "user", "assistant"]
    assert multi_turn["messages"][1]["content"] != "Hello"  # the verifier's own answer replaced the source's
    client = mlflow.MlflowClient(tracking_uri(cfg))
    experiment = client.get_experiment_by_name(cfg.tracking.experiment_name)
    regenerate_run = next(r for r in client.search_runs([experiment.experiment_id])
                          if r.data.tags.get("stage") == "regenerate")
    assert regenerate_run.data.metrics["regenerate.skipped"] == 1


def test_keep_mode_reports_a_conversation_without_an_answer(tmp_path, tiny_verifier_path, ray_local):
    prompts = write_jsonl(tmp_path / "sft.jsonl", [
        {"messages": [{"role": "user", "content": f"Q{i}"}, {"role": "assistant", "content": f"A{i}"}]}
        for i in range(4)] + [{"messages": [{"role": "user", "content": "unanswered"}]}])
    cfg = compose(tiny_overrides(tmp_path, tiny_verifier_path, prompts) + [
        "data.num_train=4", "data.num_eval=1", "generation.responses=keep"])
    results = run_stages(cfg, "generate", ["prompts", "regenerate", "capture"])
    train, _ = results["prompts"]
    assert any(row["messages"][0]["content"] == "unanswered" for row in train)  # seed 0 keeps it for training
    assert len(results["regenerate"]) == 3 and results["capture"]["num_samples"] == 3
    assert all(r["messages"][1]["content"].startswith("A") for r in results["regenerate"])


def test_a_store_over_the_size_budget_is_refused_before_any_work(tmp_path, tiny_verifier_path, capsys):
    prompts = write_jsonl(tmp_path / "p.jsonl", [{"prompt": f"q{i}"} for i in range(8)])
    cfg = compose(tiny_overrides(tmp_path / "out", tiny_verifier_path, prompts) + ["generation.max_store_gb=0.00001"])
    assert run_job(cfg, "generate") == 2
    assert "generation.max_store_gb" in capsys.readouterr().err
    assert not (tmp_path / "out" / "stores").exists() and not (tmp_path / "out" / "regenerated").exists()
