"""Training benchmarks on SmolLM2, written as JSON.

    python benchmarks/training.py step-time [--length 384] [--repeats 5] [--num-speculative-tokens 4] [--drafters ...]
                                            [--their-embeddings as-loaded|frozen] [--out FILE]
        One training step (forward + loss + backward, fp32, one thread) of each drafter at SmolLM2-135M's sizes,
        ours (`training_loss`) against the speculators package's own model and eager CPU loss, loaded with its
        from_pretrained from our export of the very same weights. One sequence of --length tokens (the first 32 a
        prompt, the rest loss-carrying); both sides compute every position at every depth (no anchor or depth
        sparsification). Ours and theirs alternate within each repeat after one warm-up each. Reports the median
        seconds of each and ours/theirs (goal <= 0.8, issue 17). speculators' P-EAGLE trains its token embedding by
        default (ours only with drafter.embed_requires_grad=true); --their-embeddings frozen times it without that
        gradient.
        Default FILE: benchmarks/results/training_step_time.json.

    python benchmarks/training.py throughput --root DIR [--steps 20] [--drafters ...] [--work DIR2]
                                             [--override KEY=VALUE ...] [--out FILE]
        `jobs/train.py` for each drafter on 1 and then 2 workers, on the SmolLM2 store already generated under DIR
        (e.g. by `python jobs/run_pipeline.py paths.root=DIR`). Each run gets a fresh output root whose prompts,
        regenerated and stores folders link to DIR's, so the store is reused and runs never see each other's
        checkpoints or MLflow runs. Reads train.tokens_per_s from each run's MLflow store and reports it per world
        size, per worker, and the 2-worker / 1-worker scaling. --override passes the Hydra overrides the store
        under DIR was made with (if any), so the runs find it.
        Default FILE: benchmarks/results/training_throughput.json.

    python benchmarks/training.py feed --root DIR [--rows 4000] [--consume 150] [--step-seconds 0.25] [--repeats 2]
                                       [--out FILE]
        The training feed (pipeline/training/feed.py) on DIR's store as a training worker holds it: a plan of --rows
        micro-batches of one sample each, taken by a Ray task that sleeps --step-seconds before each micro-batch
        as a training step would. Reports the CPU seconds that task's process spends per micro-batch (reading the
        store, and Ray Data's executor thread) and the waits for the next micro-batch, for the whole plan as one
        stream (what the feed did before its windows) and in the feed's default windows, alternating --repeats
        times. Default FILE: benchmarks/results/feed_overhead.json.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from pipeline.errors import PipelineError  # noqa: E402
from pipeline.fsutil import output_file_problem  # noqa: E402

DRAFTERS = ["eagle3", "peagle", "dflash", "dspark"]
K = 4  # the CPU drafter configs' num_speculative_tokens
PROMPT_TOKENS = 32  # leading tokens of the benchmark sequence that carry no loss
GOAL_OURS_OVER_THEIRS = 0.8  # issue 17: our step at most 0.8 of speculators' on every drafter
STORE_FOLDERS = ("prompts", "regenerated", "stores")
TOKENS_PER_S_COUNTS = (
    "train.tokens_per_s (pipeline/training/loop.py _Window.metrics): the loss-carrying tokens (loss_mask == 1, i.e. "
    "assistant tokens; prompt tokens are computed but not counted) of every rank's micro-batches, summed over all "
    "ranks by an all-reduce, divided by rank 0's wall-clock time of the logging window. With log_every = "
    "max_steps the one window is every step of the run, the first (warm-up) step included; Ray/DeepSpeed start-up "
    "and the checkpoint written after the last step are not in it."
)


def one_line(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip().splitlines()
    return text[0][:300] if text else type(error).__name__


def write_json(result: dict, out: str | Path) -> Path:
    """Atomic: a reader sees the old file or the whole new one, never half of it."""
    from pipeline.fsutil import atomic_write_text

    out = Path(out)
    atomic_write_text(out, json.dumps(result, indent=2) + "\n")
    return out


def check_store_root(root: Path, flag: str = "--root") -> None:
    """`root` holds a generated store: the prompt, regenerated and store folders and a store manifest the pipeline
    reads (pipeline/data/store.py: load_manifest). Raises PipelineError naming `flag` or the manifest's field."""
    from pipeline.data.store import load_manifest

    missing = [folder for folder in STORE_FOLDERS if not (root / folder).is_dir()]
    manifests = sorted(root.glob("stores/*/manifest.json"))
    if missing or not manifests:
        raise PipelineError(f"{flag} {root}: needs a generated store (missing {missing or ['stores/*/manifest.json']})"
                            f"; make it with `python jobs/generate.py paths.root={root}`")
    for manifest in manifests:
        load_manifest(manifest.parent)


def failures(result: Any, where: str = "") -> list[str]:
    """Every part of a benchmark's result that records a failure (an "error" entry): "<where>: <message>"."""
    found: list[str] = []
    if isinstance(result, dict):
        if isinstance(result.get("error"), str):
            found.append(f"{where or 'result'}: {result['error']}")
        for key, value in result.items():
            found += failures(value, f"{where}.{key}" if where else str(key)) if key != "error" else []
    elif isinstance(result, list):
        for index, value in enumerate(result):
            found += failures(value, f"{where}[{index}]")
    return found


def exit_if_any_failed(result: Any, out: Path | str) -> None:
    """A benchmark whose parts failed (recorded in its JSON, so the others' figures are kept) exits 1 after
    writing it, with one line naming them: a script or CI must not read it as a pass."""
    found = failures(result)
    if found:
        listed = "; ".join(found)
        print(f"error: {len(found)} part(s) of the benchmark failed (recorded in {out}): "
              f"{listed if len(listed) <= 800 else listed[:800] + ' ...'}", file=sys.stderr)
        sys.exit(1)


def machine_info() -> dict:
    import importlib.metadata

    import torch

    cpu_model = None
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu_model = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    versions = {}
    for package in ("torch", "transformers", "speculators", "deepspeed", "ray"):
        try:
            versions[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            versions[package] = None
    from pipeline.training.precision import native_bf16

    return {
        "cpu_count": os.cpu_count(), "usable_cpus": len(os.sched_getaffinity(0)), "cpu_model": cpu_model,
        "cpu_capability": torch.backends.cpu.get_cpu_capability(), "torch_threads": torch.get_num_threads(),
        "python": platform.python_version(), "versions": versions,
        # What training.autocast_dtype=auto picks on this CPU: bf16 where oneDNN computes it natively, else fp32.
        # ONEDNN_MAX_CPU_ISA=AVX2 hides AVX512-BF16, so an AVX512 machine then trains in fp32 as an AVX2 one does.
        "native_bf16": native_bf16("cpu"), "onednn_max_cpu_isa": os.environ.get("ONEDNN_MAX_CPU_ISA"),
    }


# ---------------------------------------------------------------------------------------------------- step-time


def smollm2_verifier():
    """(cfg, folder, HF config) of the real SmolLM2 verifier, as the tests' smollm2_path fixture resolves it."""
    from pipeline.config import compose
    from pipeline.families import load_verifier_config
    from pipeline.verifier import resolve_verifier_path

    cfg = compose(["verifier=smollm2"])
    path = resolve_verifier_path(cfg.verifier)
    return cfg, path, load_verifier_config(path)


def build_ours(algorithm: str, verifier_name: str, verifier_path: str, verifier_config, depth: int):
    """Our drafter as the parity test builds it, and the options every position and every depth train under."""
    import torch
    from omegaconf import OmegaConf

    from pipeline.drafters import drafter_config
    from pipeline.drafters.build import build_drafter, make_spec, verifier_head_tensors

    cfg = drafter_config(algorithm, num_speculative_tokens=depth)
    spec = make_spec(cfg, verifier_config, verifier_name, verifier_path, default_mask_token_id=0)
    torch.manual_seed(0)
    model = build_drafter(spec, verifier_head_tensors(verifier_path)).float().train()
    return model, OmegaConf.to_object(cfg).deterministic()


def load_theirs(folder: Path):
    """Speculators' own model from our export, loaded as the parity test loads it (eager attention)."""
    from speculators import SpeculatorModel
    from speculators.config import SpeculatorModelConfig

    config = SpeculatorModelConfig.from_pretrained(str(folder))
    config.transformer_layer_config._attn_implementation = "eager"
    return SpeculatorModel.from_pretrained(str(folder), config=config).float().train()


def their_call(algorithm: str, model, aux, input_ids, loss_mask, pre_norm_last, options, depth: int):
    """(tensors, kwargs) of one speculators training forward on the same sequence, laid out as speculators'
    trainer feeds it: EAGLE-3 and P-EAGLE shift the batch first (their shift_batch), DFlash and DSpark do not."""
    import torch
    from speculators.losses import resolve_loss_config

    if algorithm in ("eagle3", "peagle"):
        from speculators.models.eagle3.data import shift_batch

        length = int(input_ids.shape[0])
        batch = shift_batch({"input_ids": input_ids, "hidden_states": aux, "verifier_last_hidden_states": pre_norm_last,
                             "loss_mask": loss_mask, "lengths": torch.tensor([length]),
                             "position_ids": torch.arange(length)})
        input_ids, aux = batch["input_ids"], batch["hidden_states"]
        pre_norm_last, loss_mask = batch["verifier_last_hidden_states"], batch["loss_mask"]
    tensors = {"hidden_states": aux[None], "input_ids": input_ids[None], "loss_mask": loss_mask[None],
               "verifier_last_hidden_states": pre_norm_last[None], "document_ids": torch.zeros_like(input_ids)[None]}
    kwargs = {"loss_config": resolve_loss_config("kl_div", "eager")}  # their default losses are Triton kernels
    if algorithm == "eagle3":
        kwargs.update(ttt_steps=depth, ttt_step_loss_decay=1.0)  # every TTT step weighs 1, as ours
    elif algorithm == "peagle":
        # Ratios of 1 keep (nearly) every anchor at every depth: ours runs with depth_keep_decay = 1.0.
        kwargs.update(max_anchors=None, num_depths=depth, down_sample_ratio=1.0, down_sample_ratio_min=1.0)
    else:
        # Their select_anchors draws max_anchors blocks among the loss positions outside the last block; asking
        # for all of them is their "every position" (padding blocks beyond that would only add work).
        anchors = int(loss_mask[: -model.block_size].bool().sum())
        kwargs.update(max_anchors=anchors, gamma=options.loss_decay_gamma)
        if algorithm == "dspark":
            kwargs.update(tv_loss_fn=resolve_loss_config("tv", "eager")["tv"][0],
                          confidence_head_alpha=options.confidence_loss_weight)
    return tensors, kwargs


def timed_step(model, compute_loss) -> tuple[float, float]:
    """Seconds of one forward + loss + backward, and the loss."""
    model.zero_grad(set_to_none=True)
    started = time.perf_counter()
    loss = compute_loss()
    loss.backward()
    seconds = time.perf_counter() - started
    return seconds, float(loss.detach())


def describe(value):
    """A JSON-able view of one speculators kwarg (loss configs and loss functions by name)."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if isinstance(value, dict):
        return {k: describe(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)):
        return [describe(v) for v in value]
    return f"{getattr(value, '__module__', '')}.{getattr(value, '__qualname__', type(value).__name__)}"


def trainable(model) -> int:
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def bench_drafter(algorithm: str, verifier, length: int, repeats: int, depth: int,
                  freeze_their_embeddings: bool = False) -> dict:
    import tempfile

    import torch

    from pipeline.export.speculators_format import export_speculators

    cfg, verifier_path, verifier_config = verifier
    try:
        ours, options = build_ours(algorithm, cfg.verifier.name, verifier_path, verifier_config, depth)
    except Exception as error:  # noqa: BLE001 - one drafter's failure is a result, not the end of the benchmark
        return {"error": f"ours: {one_line(error)}"}
    hidden, vocab = ours.spec.hidden_size, ours.spec.vocab_size
    num_aux = len(ours.spec.aux_layer_ids)
    generator = torch.Generator().manual_seed(0)
    aux = torch.randn(length, num_aux * hidden, generator=generator)
    input_ids = torch.randint(0, vocab, (length,), generator=generator)
    pre_norm_last = torch.randn(length, hidden, generator=generator)
    loss_mask = torch.ones(length, dtype=torch.long)
    loss_mask[:PROMPT_TOKENS] = 0

    result: dict = {"aux_layers": num_aux, "ours_trainable_params": trainable(ours),
                    # DFlash/DSpark weigh each block position by this (EAGLE-3 and P-EAGLE have none).
                    "ours_position_weighting": getattr(getattr(options, "position_weighting", None), "value", None)}
    theirs, their_error = None, None
    with tempfile.TemporaryDirectory() as folder:
        try:
            theirs = load_theirs(export_speculators(ours, Path(folder) / algorithm, dtype=torch.float32))
        except Exception as error:  # noqa: BLE001
            their_error = f"theirs (load): {one_line(error)}"
    # Ours is trained on the verifier's post-norm final state, speculators on the pre-norm one (it applies the
    # verifier's norm itself): feed each its own kind of the same state, so both distil the same teacher.
    if theirs is not None:
        with torch.no_grad():
            last = theirs.verifier_norm(pre_norm_last).detach()
        if freeze_their_embeddings:
            theirs.embed_tokens.weight.requires_grad_(False)
        # speculators' P-EAGLE config defaults to embed_requires_grad=True (ours never trains the embedding).
        result["theirs_embed_trainable"] = bool(theirs.embed_tokens.weight.requires_grad)
        result["theirs_trainable_params"] = trainable(theirs)
    else:
        last = pre_norm_last
    sample = {"aux": aux, "last": last, "input_ids": input_ids, "loss_mask": loss_mask}

    def ours_loss():
        return ours.training_loss([sample], options, torch.Generator().manual_seed(0))[0]

    def theirs_loss():
        return theirs(**tensors, **kwargs)[1]

    try:
        _, result["ours_loss"] = timed_step(ours, ours_loss)  # warm-up
    except Exception as error:  # noqa: BLE001
        return {**result, "error": f"ours: {one_line(error)}"}
    if theirs is not None:
        try:
            tensors, kwargs = their_call(algorithm, theirs, aux, input_ids, loss_mask, pre_norm_last, options, depth)
            result["theirs_kwargs"] = {k: describe(v) for k, v in kwargs.items()}
            _, result["theirs_loss"] = timed_step(theirs, theirs_loss)  # warm-up
        except Exception as error:  # noqa: BLE001
            their_error, theirs = f"theirs: {one_line(error)}", None

    ours_s, theirs_s = [], []
    for _ in range(repeats):
        seconds, result["ours_loss"] = timed_step(ours, ours_loss)
        ours_s.append(seconds)
        if theirs is not None:
            seconds, result["theirs_loss"] = timed_step(theirs, theirs_loss)
            theirs_s.append(seconds)
    result["ours_s"] = round(statistics.median(ours_s), 4)
    result["ours_runs_s"] = [round(s, 4) for s in ours_s]
    if theirs_s:
        result["theirs_s"] = round(statistics.median(theirs_s), 4)
        result["theirs_runs_s"] = [round(s, 4) for s in theirs_s]
        result["ours_over_theirs"] = round(result["ours_s"] / result["theirs_s"], 3)
    if their_error:
        result["error"] = their_error
    for key in ("ours_loss", "theirs_loss"):
        if key in result:
            result[key] = round(result[key], 5)
    return result


def step_time(args) -> dict:
    import torch

    torch.set_num_threads(1)
    k = args.num_speculative_tokens
    if args.length < PROMPT_TOKENS + 2 * (k + 2):
        raise PipelineError(f"--length {args.length}: too short for a {PROMPT_TOKENS}-token prompt and K={k} (at "
                            f"least {PROMPT_TOKENS + 2 * (k + 2)})")
    verifier = smollm2_verifier()
    config = verifier[2]
    results = {
        "machine": machine_info(), "verifier": verifier[0].verifier.name,
        "verifier_shapes": {"hidden_size": int(config.hidden_size), "vocab_size": int(config.vocab_size),
                            "num_hidden_layers": int(config.num_hidden_layers)},
        "length": args.length, "prompt_tokens": PROMPT_TOKENS, "k": k, "repeats": args.repeats,
        "dtype": "float32", "threads": 1, "goal_ours_over_theirs": GOAL_OURS_OVER_THEIRS,
        "their_embeddings": args.their_embeddings,
        "note": "seconds are the median of --repeats steps (forward + loss + backward), ours and theirs alternating "
                "after one warm-up each; ours: training_loss with max_anchors=None, depth_keep_decay=1.0; theirs: "
                "speculators' forward with its eager kl_div loss, inputs laid out as its trainer does (shift_batch "
                "for EAGLE-3/P-EAGLE). Both distil the same teacher, but the losses are not expected to be equal: "
                "ours is a soft cross-entropy (kl_div + the teacher's entropy) averaged over all rows, theirs is "
                "kl_div normalised their way (EAGLE-3: summed over TTT steps), and the two sides keep slightly "
                "different row sets at the sequence's ends.",
        "drafters": {},
    }
    for algorithm in args.drafters:
        print(f"[step-time] {algorithm} ...", file=sys.stderr, flush=True)
        results["drafters"][algorithm] = bench_drafter(algorithm, verifier, args.length, args.repeats, k,
                                                       args.their_embeddings == "frozen")
        print(f"[step-time] {algorithm}: {json.dumps(results['drafters'][algorithm])}", file=sys.stderr, flush=True)
        gc.collect()
    return results


# --------------------------------------------------------------------------------------------------- throughput


def fresh_root(root: Path, target: Path) -> None:
    """An output root of its own that reuses root's generated prompts, regenerated set and store (symlinks)."""
    if target.is_symlink() or target.is_file():
        target.unlink()
    elif target.exists():
        shutil.rmtree(target)  # links inside are removed, never followed
    target.mkdir(parents=True)
    for folder in STORE_FOLDERS:
        (target / folder).symlink_to(root / folder, target_is_directory=True)


def check_work(root: Path, work: Path, names: list[str]) -> None:
    """Refuse (PipelineError naming --work) a work folder whose per-run roots, which fresh_root empties, would hold
    --root itself."""
    for name in names:
        if root.is_relative_to(work / name):
            raise PipelineError(f"--work {work}: {work / name} would be emptied, and it holds --root {root}")


def check_overrides(runs: list[list[str]]) -> None:
    """Compose and validate each run's overrides before any run root is emptied: a mistyped --override, or a
    value the job would refuse (an unknown eval set), is one line naming it."""
    from pipeline.config import compose, validate

    for overrides in runs:
        try:
            validate(compose(overrides))
        except PipelineError as error:
            raise PipelineError(f"--override: {error}") from None


def read_train_run(overrides: list[str], subroot: Path) -> dict:
    """The last train.tokens_per_s (and what came with it) of the newest stage=train run in subroot's MLflow."""
    import mlflow

    from pipeline.config import compose

    cfg = compose(overrides)
    uri = str(cfg.tracking.tracking_uri or f"sqlite:///{subroot / 'mlflow' / 'mlflow.db'}")
    client = mlflow.MlflowClient(uri)
    experiment = client.get_experiment_by_name(cfg.tracking.experiment_name)
    if experiment is None:
        raise RuntimeError(f"no MLflow experiment '{cfg.tracking.experiment_name}' at {uri}")
    runs = client.search_runs([experiment.experiment_id], filter_string="tags.stage = 'train'",
                              order_by=["attributes.start_time DESC"], max_results=1)
    if not runs:
        raise RuntimeError(f"no stage=train run in experiment '{cfg.tracking.experiment_name}' at {uri}")
    run = runs[0]
    history = sorted(client.get_metric_history(run.info.run_id, "train.tokens_per_s"),
                     key=lambda m: (m.step, m.timestamp))
    if not history:
        raise RuntimeError(f"run {run.info.run_id} logged no train.tokens_per_s")
    metrics = run.data.metrics
    return {"tokens_per_s": history[-1].value, "at_step": history[-1].step, "run_id": run.info.run_id,
            "logged_world_size": metrics.get("train.world_size"), "zero_stage": metrics.get("train.zero_stage"),
            "micro_batch_size": metrics.get("train.micro_batch_size"), "autocast": run.data.tags.get("train.autocast"),
            "final_loss": metrics.get("train.loss")}


def throughput_overrides(subroot: Path, drafter: str, workers: int, args) -> list[str]:
    return [f"paths.root={subroot}", f"drafter={drafter}", f"training.num_workers={workers}",
            f"training.max_steps={args.steps}", f"training.log_every={args.steps}",
            f"training.checkpoint_every={args.steps}", "training.val_samples=0", *args.override]


def throughput(args) -> dict:
    root = Path(args.root).expanduser().resolve()
    check_store_root(root)
    work = Path(args.work).expanduser().resolve() if args.work else root / "bench-training-throughput"
    check_work(root, work, [f"{drafter}-w{workers}" for drafter in args.drafters for workers in (1, 2)])
    check_overrides([throughput_overrides(work / f"{drafter}-w{workers}", drafter, workers, args)
                     for drafter in args.drafters for workers in (1, 2)])  # the very lists the runs use
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    results = {"machine": machine_info(), "root": str(root), "work": str(work), "steps": args.steps,
               "extra_overrides": args.override, "tokens_per_s_counts": TOKENS_PER_S_COUNTS, "drafters": {}}
    for drafter in args.drafters:
        per_world: dict = {}
        for workers in (1, 2):
            subroot = work / f"{drafter}-w{workers}"
            fresh_root(root, subroot)
            overrides = throughput_overrides(subroot, drafter, workers, args)
            print(f"[throughput] {drafter} x{workers}: jobs/train.py {' '.join(overrides)}", file=sys.stderr,
                  flush=True)
            started = time.time()
            try:
                done = subprocess.run([sys.executable, str(REPO / "jobs" / "train.py"), *overrides], cwd=REPO,
                                      env=env, capture_output=True, text=True, timeout=args.timeout)
            except subprocess.TimeoutExpired:
                per_world[str(workers)] = {"error": f"jobs/train.py ran past {args.timeout}s"}
                continue
            entry: dict = {"wall_s": round(time.time() - started, 1)}
            if done.returncode != 0:
                tail = [line for line in done.stderr.strip().splitlines() if line.strip()][-1:] or ["(no stderr)"]
                per_world[str(workers)] = {**entry, "error": f"exit {done.returncode}: {tail[0][:300]}"}
                continue
            try:
                entry.update(read_train_run(overrides, subroot))
            except Exception as error:  # noqa: BLE001
                per_world[str(workers)] = {**entry, "error": one_line(error)}
                continue
            entry["tokens_per_s_per_worker"] = entry["tokens_per_s"] / workers
            entry["tokens_per_s"] = round(entry["tokens_per_s"], 1)
            entry["tokens_per_s_per_worker"] = round(entry["tokens_per_s_per_worker"], 1)
            per_world[str(workers)] = entry
            print(f"[throughput] {drafter} x{workers}: {json.dumps(entry)}", file=sys.stderr, flush=True)
        one, two = per_world.get("1", {}), per_world.get("2", {})
        summary = {"workers": per_world}
        if "tokens_per_s" in one and "tokens_per_s" in two and one["tokens_per_s"] > 0:
            scaling = two["tokens_per_s"] / one["tokens_per_s"]
            summary["scaling_2_over_1"] = round(scaling, 3)
            summary["parallel_efficiency"] = round(scaling / 2, 3)
        results["drafters"][drafter] = summary
    return results


def feed_run(store: Path, plan: list[dict], layers: tuple[list[int], int], consume: int, step_seconds: float,
             window: int) -> dict:
    """One worker-like consumer of the feed, in a Ray task: CPU seconds per micro-batch and the waits.
    layers: (aux layer ids, last layer id) read from the store."""
    import ray

    from pipeline.training.feed import stream_micro_batches

    @ray.remote(num_cpus=0)
    def consumer() -> dict:
        stream = stream_micro_batches(plan, str(store), *layers, prefetch=2, window=window)
        next(stream)  # the first micro-batch pays the stream's start, as a run's first step does
        cpu, wall, waits = time.process_time(), time.perf_counter(), []
        for _ in range(consume):
            time.sleep(step_seconds)
            started = time.perf_counter()
            next(stream)
            waits.append(time.perf_counter() - started)
        cpu, wall = time.process_time() - cpu, time.perf_counter() - wall
        return {"cpu_s_per_micro_batch": round(cpu / consume, 4), "busy_cores": round(cpu / wall, 3),
                "waited_s": round(sum(waits), 3), "longest_wait_s": round(max(waits), 3)}

    return ray.get(consumer.remote())


def feed(args) -> dict:
    import ray

    from pipeline.data.store import sample_locations, verify_store
    from pipeline.drafters.build import default_aux_layer_ids
    from pipeline.training.feed import WINDOW_MICRO_BATCHES, plan_row

    stores = sorted(Path(args.root).expanduser().resolve().glob("stores/*/manifest.json"))
    if not stores:
        raise PipelineError(f"--root {args.root}: has no stores/*/manifest.json; make one with "
                         f"`python jobs/run_pipeline.py paths.root={args.root}`")
    store = stores[0].parent
    try:  # every shard whole, as the train stage checks before its workers read the store
        manifest = verify_store(store)
    except PipelineError as error:
        raise PipelineError(f"--root {args.root}: {error}") from None
    if "num_verifier_layers" not in manifest:
        raise PipelineError(f"--root {args.root}: store manifest {store / 'manifest.json'} has no "
                            "'num_verifier_layers'")
    locations = sample_locations(store, manifest)
    plan = [plan_row(i + 1, 0, [locations[i % len(locations)]]) for i in range(args.rows)]
    # the layers EAGLE-3 reads, and the last one for its targets
    layers = (default_aux_layer_ids("eagle3", int(manifest["num_verifier_layers"])), manifest["layer_ids"][-1])
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    modes = {"one_stream": args.rows, "windows": WINDOW_MICRO_BATCHES}
    runs: dict[str, list[dict]] = {mode: [] for mode in modes}
    for _ in range(args.repeats):
        for mode, window in modes.items():
            runs[mode].append(feed_run(store, plan, layers, args.consume, args.step_seconds, window))
            print(f"[feed] {mode}: {json.dumps(runs[mode][-1])}", file=sys.stderr, flush=True)
    ray.shutdown()
    median = {mode: statistics.median(run["cpu_s_per_micro_batch"] for run in results)
              for mode, results in runs.items()}
    return {"machine": machine_info(), "store": str(store), "rows": args.rows, "consumed": args.consume,
            "step_seconds": args.step_seconds, "window": WINDOW_MICRO_BATCHES, "runs": runs,
            "median_cpu_s_per_micro_batch": median,
            "windows_over_one_stream": round(median["windows"] / median["one_stream"], 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)
    steps = sub.add_parser("step-time", help="one training step, ours vs speculators")
    steps.add_argument("--length", type=int, default=384)
    steps.add_argument("--repeats", type=int, default=5)
    steps.add_argument("--num-speculative-tokens", type=int, default=K, help="num_speculative_tokens (draft depth)")
    steps.add_argument("--drafters", nargs="+", default=DRAFTERS, choices=DRAFTERS)
    steps.add_argument("--their-embeddings", choices=("as-loaded", "frozen"), default="as-loaded",
                       help="speculators' P-EAGLE trains its embedding by default; frozen matches ours")
    steps.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "training_step_time.json"))
    scaling = sub.add_parser("throughput", help="jobs/train.py tokens/s on 1 and 2 workers")
    scaling.add_argument("--root", required=True, help="a pipeline output root holding a generated SmolLM2 store")
    scaling.add_argument("--steps", type=int, default=20)
    scaling.add_argument("--drafters", nargs="+", default=DRAFTERS, choices=DRAFTERS)
    scaling.add_argument("--work", default=None,
                         help="where the per-run roots go (default: ROOT/bench-training-throughput)")
    scaling.add_argument("--override", nargs="*", default=[],
                         help="more Hydra overrides for every run (those the store under --root was made with)")
    scaling.add_argument("--timeout", type=int, default=3600, help="seconds per jobs/train.py run")
    scaling.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "training_throughput.json"))
    feeding = sub.add_parser("feed", help="CPU the training feed spends per micro-batch, one stream vs windows")
    feeding.add_argument("--root", required=True, help="a pipeline output root holding a generated store")
    feeding.add_argument("--rows", type=int, default=4000, help="micro-batches planned (a long run's worth)")
    feeding.add_argument("--consume", type=int, default=150, help="micro-batches taken and timed")
    feeding.add_argument("--step-seconds", type=float, default=0.25, help="the stand-in training step")
    feeding.add_argument("--repeats", type=int, default=2)
    feeding.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "feed_overhead.json"))
    args = parser.parse_args()
    counts = {"step-time": ("length", "repeats", "num_speculative_tokens"), "throughput": ("steps", "timeout"),
              "feed": ("rows", "consume", "repeats")}[args.command]
    for flag in counts:
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1")
    if output_file_problem(args.out):
        parser.error(output_file_problem(args.out))
    result = {"step-time": step_time, "throughput": throughput, "feed": feed}[args.command](args)
    out = write_json(result, args.out)
    print(json.dumps(result, indent=2))
    print(f"written to {out}", file=sys.stderr)
    exit_if_any_failed(result, out)


if __name__ == "__main__":
    try:
        main()
    except PipelineError as error:  # bad input: one line and exit 2, as the jobs print it (pipeline/entry.py)
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
