"""Bad input to the benchmark CLIs and to `jobs/render_infra.py --check`: one line naming the flag, a non-zero exit,
no traceback, and nothing created, emptied or written before the input was checked. No Ray, no training: each
case fails in its argument checks."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from benchmarks.gpu_check import load_tokenizer
from benchmarks.serving import served_target
from pipeline.config import compose
from pipeline.errors import PipelineError
from pipeline.paths import StagePaths

REPO = Path(__file__).resolve().parents[2]


# what the capture stage writes for a store with no shard yet: the benchmarks' store check reads it as a store
EMPTY_STORE_MANIFEST = json.dumps({"layer_ids": [1], "shards": [], "num_samples": 0, "num_tokens": 0, "bytes": 0})


def _cli(script: str, *args: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(REPO / script), *args], cwd=cwd, capture_output=True, text=True,
                          timeout=60, env={**os.environ, "PYTHONPATH": str(REPO)})


def _one_line(result: subprocess.CompletedProcess, expected: str) -> None:
    assert result.returncode != 0
    assert "Traceback" not in result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert expected in last, result.stderr


def test_serving_names_a_missing_root(tmp_path):
    missing = tmp_path / "nowhere"
    _one_line(_cli("benchmarks/serving.py", "--root", str(missing), cwd=tmp_path), f"--root {missing}: no such folder")
    assert not missing.exists()


@pytest.mark.parametrize("flag", ["--clients", "--requests", "--max-tokens"])
def test_serving_refuses_a_count_below_one(tmp_path, flag):
    _one_line(_cli("benchmarks/serving.py", "--root", str(tmp_path), flag, "0", cwd=tmp_path), f"{flag} 0")


def test_serving_names_a_root_without_its_mlflow_store_and_creates_none(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    (StagePaths(compose([f"paths.root={tmp_path}"])).prompts / "train").mkdir(parents=True)
    with pytest.raises(PipelineError, match=r"^--root .*: no MLflow store at .*mlflow\.db"):
        served_target(tmp_path, [])
    assert not (tmp_path / "mlflow").exists()


def test_serving_names_a_root_without_training_prompts(tmp_path):
    with pytest.raises(PipelineError, match=r"^--root .*: no training prompts at "):
        served_target(tmp_path, [])
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("args, expected", [
    (["--before-root", "{missing}", "--after-root", "{missing}"], "--before-root {missing}: no such folder"),
    (["--before-root", "{empty}", "--after-root", "{empty}"], "--before-root {empty}: no MLflow store"),
    (["--before", "no-such-ref-anywhere"], "--before no-such-ref-anywhere: no such commit"),
])
def test_pipeline_time_checks_the_roots_before_creating_anything(tmp_path, args, expected):
    missing, empty = tmp_path / "nowhere", tmp_path / "empty"
    empty.mkdir()
    names = {"missing": missing, "empty": empty}
    out = tmp_path / "results" / "pipeline_time.json"
    result = _cli("benchmarks/pipeline_time.py", *[a.format(**names) for a in args], "--out", str(out),
                  cwd=tmp_path)
    _one_line(result, expected.format(**names))
    assert not missing.exists() and list(empty.iterdir()) == [] and not out.parent.exists()


def test_the_feed_benchmark_checks_the_store_as_training_does(tmp_path):
    store = tmp_path / "stores" / "key"
    store.mkdir(parents=True)
    shard = {"file": "shard-0123456789abcdef.safetensors", "sha256": "0" * 64, "sample_ids": ["a"], "num_tokens": 3}
    (store / "manifest.json").write_text(json.dumps({"layer_ids": [1], "shards": [shard], "num_samples": 1,
                                                     "num_tokens": 3, "bytes": 10}))
    result = _cli("benchmarks/training.py", "feed", "--root", str(tmp_path), cwd=tmp_path)
    _one_line(result, f"--root {tmp_path}: store: shard '{store / shard['file']}' listed in the manifest is missing")
    assert result.returncode == 2 and result.stderr.startswith("error: --root ")  # as the jobs print bad input


@pytest.mark.parametrize("damage, expected", [
    ("mlflow_db", "--before-root {root}: its MLflow store mlflow/mlflow.db cannot be read ("),
    ("report", "--before-root {report}: not an evaluation report (needs datasets.held_out.pooled_tau"),
    ("report_text", "--before-root: '{report}' is not readable JSON"),
])
def test_pipeline_time_names_a_damaged_root_in_one_line(tmp_path, damage, expected):
    root = tmp_path / "root"
    (root / "mlflow").mkdir(parents=True)
    (root / "eval" / "key").mkdir(parents=True)
    report = root / "eval" / "key" / "report.json"
    report.write_text("{not json" if damage == "report_text" else "{}")
    if damage == "mlflow_db":
        (root / "mlflow" / "mlflow.db").write_text("not a database")
    else:  # a real MLflow store with one finished job, so the report is what fails
        import mlflow

        client = mlflow.MlflowClient(f"sqlite:///{root / 'mlflow' / 'mlflow.db'}")
        job = client.create_run(client.create_experiment("speculators"))
        client.set_terminated(job.info.run_id)
    out = tmp_path / "results" / "pipeline_time.json"
    result = _cli("benchmarks/pipeline_time.py", "--before-root", str(root), "--after-root", str(root), "--out",
                  str(out), cwd=tmp_path)
    _one_line(result, expected.format(root=root, report=report))
    assert not out.parent.exists()


@pytest.mark.parametrize("args, expected", [
    (["--before", "HEAD", "training.lr=-1"], "training.lr: must be > 0"),
    (["--before", "HEAD", "training.no_such_key=1"], "training.no_such_key"),
    (["--before", "HEAD", "--out", "{folder}"], "--out {folder}: is a folder"),
    (["--before", "HEAD", "--out", "{file}/x.json"], "--out {file}/x.json: a folder above it is a file"),
])
def test_pipeline_time_refuses_bad_overrides_and_out_before_making_a_worktree(tmp_path, args, expected):
    folder, file = tmp_path / "folder", tmp_path / "a-file"
    folder.mkdir()
    file.write_text("x")
    worktrees = subprocess.run(["git", "worktree", "list"], cwd=REPO, capture_output=True, text=True).stdout
    scratch = set(Path(tempfile.gettempdir()).glob("pipeline-time-*"))
    args = [a.format(folder=folder, file=file) for a in args]
    if "--out" not in args:
        args += ["--out", str(tmp_path / "results" / "out.json")]
    _one_line(_cli("benchmarks/pipeline_time.py", *args, cwd=tmp_path), expected.format(folder=folder, file=file))
    assert subprocess.run(["git", "worktree", "list"], cwd=REPO, capture_output=True, text=True).stdout == worktrees
    assert set(Path(tempfile.gettempdir()).glob("pipeline-time-*")) == scratch
    assert not (tmp_path / "results").exists() and list(folder.iterdir()) == []


@pytest.mark.parametrize("text, expected", [
    ("[" * 100_000 + "]" * 100_000, "--update: '{out}' is not readable JSON (nested too deeply)"),
    ('{"drafters": {"peagle": [1]}}', "--out {out}: --update needs an earlier quality_curve JSON object"),
], ids=["nested_too_deeply", "drafter_not_an_object"])  # short ids: the test id reaches the child's environment
def test_quality_curve_update_names_a_file_it_cannot_add_to(tmp_path, text, expected):
    for folder in ("prompts", "regenerated", "stores/key"):
        (tmp_path / "root" / folder).mkdir(parents=True)
    (tmp_path / "root" / "stores" / "key" / "manifest.json").write_text(EMPTY_STORE_MANIFEST)
    out = tmp_path / "curve.json"
    out.write_text(text)
    result = _cli("benchmarks/quality_curve.py", "--root", str(tmp_path / "root"), "--work", str(tmp_path / "work"),
                  "--out", str(out), "--update", cwd=tmp_path)
    _one_line(result, expected.format(out=out))
    assert out.read_text() == text and not (tmp_path / "work").exists()


@pytest.mark.parametrize("args, expected", [
    (["--points", "0"], "--points 0: must be at least 1"),
    (["--steps", "0"], "--steps 0: must be at least 1"),
    (["--steps", "-5"], "--steps -5: must be at least 1"),
    (["--steps", "4", "--points", "5"], "--points 5: more checkpoints than --steps 4"),
    (["--prompts-per-set", "0"], "--prompts-per-set 0: must be at least 1"),
    (["--max-new-tokens", "-1"], "--max-new-tokens -1: must be at least 1"),
])
def test_quality_curve_checks_its_numbers_before_emptying_the_work_folder(tmp_path, args, expected):
    work = tmp_path / "work"
    kept = work / "peagle" / "kept.txt"  # fresh_root would delete work/peagle
    kept.parent.mkdir(parents=True)
    kept.write_text("still here")
    result = _cli("benchmarks/quality_curve.py", "--root", str(tmp_path), "--work", str(work), *args, cwd=tmp_path)
    _one_line(result, expected)
    assert kept.read_text() == "still here"


def test_quality_curve_never_empties_a_work_folder_that_holds_the_root(tmp_path):
    root = tmp_path / "peagle" / "root"
    for folder in ("prompts", "regenerated", "stores/key"):
        (root / folder).mkdir(parents=True)
    (root / "stores" / "key" / "manifest.json").write_text(EMPTY_STORE_MANIFEST)
    result = _cli("benchmarks/quality_curve.py", "--root", str(root), "--work", str(tmp_path), "--drafters", "peagle",
                  cwd=tmp_path)
    _one_line(result, f"--work {tmp_path}: {tmp_path / 'peagle'} would be emptied")
    assert (root / "stores" / "key" / "manifest.json").is_file()


@pytest.mark.parametrize("kind", ["missing", "file"])
def test_gpu_check_names_a_bad_tokenizer(tmp_path, kind):
    folder = tmp_path / "tokenizer"
    if kind == "file":
        folder.write_text("not a folder")
    with pytest.raises(PipelineError, match=rf"^--tokenizer {folder}: no such folder"):
        load_tokenizer(folder)


def _render_infra_main():
    spec = importlib.util.spec_from_file_location("render_infra", REPO / "jobs" / "render_infra.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.main


@pytest.mark.parametrize("layout, expected", [
    ("missing", "not a folder, so no manifest to check"),
    ("empty", "no k8s/*.yaml manifests to check"),
    ("k8s_without_yaml", "no k8s/*.yaml manifests to check"),
])
def test_render_infra_check_fails_without_manifests(tmp_path, monkeypatch, capsys, layout, expected):
    out = tmp_path / "infra"
    if layout != "missing":
        out.mkdir()
    if layout == "k8s_without_yaml":
        (out / "k8s").mkdir()
        (out / "k8s" / "notes.txt").write_text("no manifest")
    monkeypatch.setattr(sys, "argv", ["render_infra.py", "--check", "--out", str(out)])
    assert _render_infra_main()() == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --out {out}: ") and expected in lines[0]
    assert out.exists() == (layout != "missing")


def test_render_infra_names_an_out_folder_it_cannot_write(tmp_path, monkeypatch, capsys):
    blocker = tmp_path / "a-file"
    blocker.write_text("not a folder")
    out = blocker / "infra"
    monkeypatch.setattr(sys, "argv", ["render_infra.py", "--out", str(out), "--experiment", "qwen3_8b_peagle"])
    assert _render_infra_main()() == 2
    lines = capsys.readouterr().err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: --out {out}: cannot write "), lines
    assert blocker.read_text() == "not a folder"


def test_machine_info_says_whether_auto_autocast_trains_in_bf16(monkeypatch):
    """Every benchmark JSON records what training.autocast_dtype=auto picks here and the oneDNN cap that can hide
    AVX512-BF16 (an AVX512 machine capped at AVX2 trains in fp32), so rows from different CPUs can be told apart."""
    from benchmarks.training import machine_info
    from pipeline.training.precision import native_bf16, resolve_autocast

    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX2")
    info = machine_info()
    assert info["onednn_max_cpu_isa"] == "AVX2"
    assert info["native_bf16"] is native_bf16("cpu")
    assert (resolve_autocast("auto", "cpu") is not None) == info["native_bf16"]


# Each tool that writes --out, with the least arguments it needs to reach the --out check.
OUT_WRITERS = [
    ("benchmarks/serving.py", ["--root", "{root}"]), ("benchmarks/gpu_check.py", ["--tokenizer", "{root}"]),
    ("benchmarks/drafters.py", ["harness"]), ("benchmarks/generation.py", []),
    ("benchmarks/training.py", ["step-time"]), ("benchmarks/versus_speculators.py", ["--root", "{root}"]),
]


@pytest.mark.parametrize("script, args", OUT_WRITERS, ids=lambda value: value if isinstance(value, str) else None)
def test_an_out_file_under_a_file_is_one_line_before_the_run(tmp_path, script, args):
    """serving.py and gpu_check.py wrote --out only after their whole run (a traceback then); the others checked
    for a folder only."""
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    out = blocker / "result.json"
    result = _cli(script, *[a.format(root=tmp_path) for a in args], "--out", str(out), cwd=tmp_path)
    _one_line(result, f"--out {out}: a folder above it is a file")


@pytest.mark.parametrize("script, args", OUT_WRITERS, ids=lambda value: value if isinstance(value, str) else None)
def test_an_out_file_where_no_file_can_be_made_is_one_line_before_the_run(tmp_path, script, args):
    """A folder that takes no new file (sysfs refuses even root) failed only at the final write, with a
    traceback after the whole run."""
    out = Path("/sys/result.json")
    result = _cli(script, *[a.format(root=tmp_path) for a in args], "--out", str(out), cwd=tmp_path)
    _one_line(result, f"--out {out}: cannot write in /sys (")


def test_an_output_file_problem_names_a_folder_and_a_file_above():
    from pipeline.fsutil import output_file_problem

    with tempfile.TemporaryDirectory() as folder:
        assert output_file_problem(Path(folder)) == f"--out {folder}: is a folder; give the JSON file to write"
        assert output_file_problem(Path(folder) / "new" / "x.json") is None
        (Path(folder) / "f").write_text("")
        assert output_file_problem(Path(folder) / "f" / "x.json", "--json") == \
            f"--json {Path(folder) / 'f' / 'x.json'}: a folder above it is a file"


def test_an_eval_set_the_pipeline_would_refuse_is_one_line_before_any_drafter_runs(tmp_path):
    """versus_speculators ran every drafter's job, each refused 'bogus', and exited 0 with a JSON of errors."""
    from benchmarks.training import STORE_FOLDERS

    for folder in STORE_FOLDERS:
        (tmp_path / folder).mkdir(parents=True, exist_ok=True)
    (tmp_path / "stores" / "x").mkdir(parents=True, exist_ok=True)
    (tmp_path / "stores" / "x" / "manifest.json").write_text(EMPTY_STORE_MANIFEST)
    out = tmp_path / "versus.json"
    result = _cli("benchmarks/versus_speculators.py", "--root", str(tmp_path), "--eval-sets", "bogus",
                  "--out", str(out), cwd=tmp_path)
    _one_line(result, "evaluation.datasets: unknown eval set 'bogus'")
    assert not out.exists() and not (tmp_path / "bench-versus-speculators").exists()


def test_a_benchmark_whose_parts_failed_names_them_and_exits_1(tmp_path, capsys):
    from benchmarks.training import exit_if_any_failed, failures

    result = {"machine": {}, "drafters": {"peagle": {"ours_over_theirs": 1.1},
                                          "eagle3": {"error": "ours: exited 2"},
                                          "dflash": {"workers": {"2": {"error": "ran past 60s"}}}}}
    assert failures(result) == ["drafters.eagle3: ours: exited 2", "drafters.dflash.workers.2: ran past 60s"]
    assert failures({"drafters": {"peagle": {"ours_over_theirs": 1.1}}}) == []
    with pytest.raises(SystemExit) as exited:
        exit_if_any_failed(result, tmp_path / "r.json")
    assert exited.value.code == 1
    assert capsys.readouterr().err.startswith("error: 2 part(s) of the benchmark failed (recorded in ")


@pytest.mark.parametrize("script", ["benchmarks/quality_curve.py", "benchmarks/versus_speculators.py"])
def test_a_store_manifest_the_pipeline_would_refuse_is_one_line_before_any_work(tmp_path, script):
    """An empty `{}` manifest passed the store check, and quality_curve started regenerating the whole store."""
    for folder in ("prompts", "regenerated", "stores/key"):
        (tmp_path / "root" / folder).mkdir(parents=True)
    (tmp_path / "root" / "stores" / "key" / "manifest.json").write_text("{}")
    result = _cli(script, "--root", str(tmp_path / "root"), "--work", str(tmp_path / "work"),
                  "--out", str(tmp_path / "out.json"), cwd=tmp_path)
    _one_line(result, "'layer_ids' must be a list of layer numbers")
    assert not (tmp_path / "work").exists() and not (tmp_path / "out.json").exists()


@pytest.mark.parametrize("args", [["--before", "HEAD", "--after-root", "{tmp}"], ["--after-root", "{tmp}"],
                                  ["--before-root", "{tmp}"]])
def test_pipeline_time_refuses_a_mix_of_its_two_ways_instead_of_ignoring_one(tmp_path, args):
    result = _cli("benchmarks/pipeline_time.py", *[a.format(tmp=tmp_path) for a in args],
                  "--out", str(tmp_path / "t.json"), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "--before-root and --after-root" in result.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "t.json").exists()
