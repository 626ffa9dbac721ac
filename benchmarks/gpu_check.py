"""The GPU paths, checked on one CUDA device and written as JSON (the CPU CI cannot run them).

    python benchmarks/gpu_check.py --tokenizer DIR [--out FILE] [--steps 40]

A verifier with SmolLM2-135M's shapes and random weights (the real weights are too large to send to a lent GPU
machine) and SmolLM2's tokenizer (DIR holds its tokenizer files). Each check records ok/numbers and the script goes
on after a failing one; the exit status is non-zero if any failed.

- capture: HF hidden-state capture on the GPU equals the CPU capture (fp32).
- train-<drafter>: our Engine without DeepSpeed, bf16 autocast chosen by `autocast_dtype: auto`, every drafter:
  loss falls and weights move; step time bf16 vs fp32 on the same batches.
- deepspeed-zero{2,3}: the Engine through DeepSpeed on NCCL (world size 1), bf16: loss falls, a CPU tensor
  all-reduces over NCCL, and a saved state loads back to the same weights.
- decode-<drafter>: the reference speculative decoder on the GPU, fp32 verifier: its tokens equal verifier.generate.
Default FILE: benchmarks/results/gpu_check.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
import torch  # noqa: E402

from pipeline.config.schema import DeepSpeedConfig, TrainingConfig  # noqa: E402
from pipeline.drafters import DRAFTERS  # noqa: E402  (every registered drafter, in registration order)
from pipeline.errors import PipelineError, require  # noqa: E402
from pipeline.fsutil import atomic_write_text, output_file_problem  # noqa: E402

DEVICE = "cuda"
LOSS_WINDOW = 5  # steps: the loss checks compare the mean of the first and of the last LOSS_WINDOW
SMOLLM2_SHAPE = {"hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
                 "num_key_value_heads": 3, "head_dim": 64, "vocab_size": 49152, "max_position_embeddings": 8192,
                 "rms_norm_eps": 1e-5, "tie_word_embeddings": True, "rope_theta": 100000.0}


def load_tokenizer(folder: Path):
    """The tokenizer in `folder` (--tokenizer). Raises PipelineError naming --tokenizer when the folder is missing or
    holds no tokenizer transformers can load."""
    require(folder.is_dir(), f"--tokenizer {folder}: no such folder (give SmolLM2's tokenizer folder)")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError) as error:
        first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
        raise PipelineError(f"--tokenizer {folder}: no tokenizer transformers can load ({first})") from None


def make_verifier(folder: Path, tokenizer) -> Path:
    """A random SmolLM2-shaped Llama saved with SmolLM2's tokenizer; peaky init so greedy picks have clear margins."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**SMOLLM2_SHAPE, initializer_range=0.05, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder, safe_serialization=True)
    tokenizer.save_pretrained(folder)
    return folder


def prompts(count: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(100, vocab - 100, (count, length), generator=generator).tolist()


def drafter_config(name: str):
    """conf/drafter/<name>.yaml as `drafter=<name>` composes it."""
    from pipeline.config import compose

    return compose([f"drafter={name}"]).drafter


def build(name: str, verifier_path: Path, device):
    from transformers import AutoTokenizer

    from pipeline.drafters.build import build_drafter, default_mask_token_id, make_spec
    from pipeline.families import load_verifier_config

    spec = make_spec(drafter_config(name), load_verifier_config(verifier_path), "random-smollm2",
                     str(verifier_path), default_mask_token_id(AutoTokenizer.from_pretrained(verifier_path)))
    torch.manual_seed(0)
    return build_drafter(spec).to(device)


def capture_samples(verifier_path: Path, layer_ids: list[int], count: int, out: list) -> dict:
    """Regenerate greedy responses and capture hidden states on the GPU; compare one batch with the CPU.
    The training samples are appended to `out`."""
    from pipeline.generation.hf_backend import HFVerifier

    gpu = HFVerifier(str(verifier_path), "float32", threads=8)
    started = time.time()
    asked = prompts(count, 48, gpu.tokenizer.vocab_size)
    responses = gpu.generate(asked, [80] * count, temperature=0.0, top_p=1.0, seed=0)
    generate_s = time.time() - started
    sequences = [p + r for p, r in zip(asked, responses)]
    last = gpu.model.config.num_hidden_layers
    started = time.time()
    captured = []
    for i in range(0, count, 8):
        captured += gpu.capture(sequences[i:i + 8], layer_ids + [last])
    synchronize()
    capture_s = time.time() - started
    compared = min(4, count)
    on_cpu = HFVerifier.__new__(HFVerifier)
    on_cpu.model, on_cpu.tokenizer = gpu.model.to("cpu"), gpu.tokenizer
    reference = on_cpu.capture(sequences[:compared], layer_ids + [last])
    worst = max(float((captured[r][i] - reference[r][i]).abs().max() / reference[r][i].abs().max().clamp_min(1e-6))
                for r in range(compared) for i in layer_ids + [last])
    gpu.model.to(DEVICE)
    out.append([{"sample_id": f"s{n}", "input_ids": torch.tensor(seq),
                 "loss_mask": torch.tensor([0] * 48 + [1] * (len(seq) - 48)),
                 "aux": torch.cat([h[i] for i in layer_ids], -1), "last": h[last]}
                for n, (seq, h) in enumerate(zip(sequences, captured))])
    return {"ok": worst < 1e-3, "gpu_vs_cpu_max_rel_diff": worst, "generate_s": generate_s, "capture_s": capture_s,
            "samples": count, "mean_tokens": statistics.mean(len(s) for s in sequences),
            "response_lengths": [len(r) for r in responses[:8]]}


def training_config(steps: int) -> TrainingConfig:
    return TrainingConfig(lr=2e-3, weight_decay=0.0, warmup_steps=2, max_steps=steps, grad_clip=1.0,
                          grad_accum_steps=1)


def train(engine, samples: list[dict], options, steps: int, autocast,
          batch: int = 4) -> tuple[list[float], float]:
    """(losses, seconds per step after the first) over `steps` optimizer steps of `batch` samples."""
    losses, times = [], []
    generator = torch.Generator()
    for step in range(steps):
        generator.manual_seed(step)
        chosen = [samples[(step * batch + i) % len(samples)] for i in range(batch)]
        synchronize()
        started = time.time()
        with torch.autocast(DEVICE, dtype=autocast, enabled=autocast is not None):
            loss, _, _ = engine.module.training_loss(chosen, options, generator)
        engine.backward_and_step(loss)
        losses.append(float(loss))
        synchronize()
        times.append(time.time() - started)
    return losses, statistics.median(times[1:])


def trainable_copy(model) -> dict:
    return {k: v.detach().float().cpu().clone() for k, v in model.named_parameters() if v.requires_grad}


def moved(before: dict, model) -> float:
    after = trainable_copy(model)
    return max(float((after[k] - before[k]).abs().max()) for k in before)


def check_training(name: str, verifier_path: Path, samples: list[dict], steps: int) -> dict:
    from omegaconf import OmegaConf

    from pipeline.training.engine import Engine
    from pipeline.training.precision import resolve_autocast

    options = OmegaConf.to_object(drafter_config(name))
    autocast = resolve_autocast("auto", DEVICE)
    result = {"autocast": str(autocast)}
    for label, dtype in (("bf16", autocast), ("fp32", None)):
        model = build(name, verifier_path, "cpu").train()
        before = trainable_copy(model)
        engine = Engine(model, training_config(steps), DeepSpeedConfig(enabled=False), micro_batch=4)
        losses, step_s = train(engine, samples, options, steps if label == "bf16" else 10, dtype)
        result[label] = {"first_loss": losses[0], "last_loss": losses[-1], "step_s": step_s,
                         "weights_moved": moved(before, engine.module)}
        if label == "bf16":
            head = statistics.mean(losses[:LOSS_WINDOW])
            tail = statistics.mean(losses[-LOSS_WINDOW:])
            result["bf16"].update({"mean_first5": head, "mean_last5": tail})
            result["ok"] = tail < head and result["bf16"]["weights_moved"] > 0 and (
                autocast == torch.bfloat16 or DEVICE == "cpu")
            if not result["ok"]:
                result["error"] = (f"mean loss of the first {LOSS_WINDOW} steps {head:.4f}, of the last {tail:.4f}; "
                                   f"weights moved {result['bf16']['weights_moved']}; autocast {autocast}")
            result["model"] = engine.module
    result["bf16_over_fp32_step_time"] = result["bf16"]["step_s"] / result["fp32"]["step_s"]
    return result


def init_single_process_group() -> None:
    os.environ.update({"RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1",
                       "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": os.environ.get("MASTER_PORT", "29533"),
                       "DS_ACCELERATOR": "cuda"})


def check_deepspeed(stage: int, verifier_path: Path, samples: list[dict], steps: int) -> dict:
    from omegaconf import OmegaConf

    from pipeline.training import dist
    from pipeline.training.engine import Engine
    from pipeline.training.resume import DEEPSPEED_DIR, DEEPSPEED_TAG

    init_single_process_group()
    options = OmegaConf.to_object(drafter_config("peagle"))
    ds = DeepSpeedConfig(enabled=True, zero_stage=stage, bf16=True)
    model = build("peagle", verifier_path, "cpu").train()
    engine = Engine(model, training_config(steps), ds, micro_batch=4)
    losses, step_s = train(engine, samples, options, steps, torch.bfloat16)
    reduced = dist.all_reduce_sum(torch.tensor([1.5, 2.0]))  # a CPU tensor through NCCL
    with tempfile.TemporaryDirectory() as tmp:
        engine.save_state(Path(tmp))
        with engine.full_weights():
            saved = trainable_copy(engine.module)
        reloaded = Engine(build("peagle", verifier_path, "cpu").train(), training_config(steps), ds, micro_batch=4)
        reloaded.engine.load_checkpoint(str(Path(tmp) / DEEPSPEED_DIR), tag=DEEPSPEED_TAG)
        with reloaded.full_weights():
            difference = max(float((trainable_copy(reloaded.module)[k] - saved[k]).abs().max()) for k in saved)
    head, tail = statistics.mean(losses[:LOSS_WINDOW]), statistics.mean(losses[-LOSS_WINDOW:])
    return {"ok": tail < head and difference == 0.0 and reduced.tolist() == [1.5, 2.0],
            "backend": torch.distributed.get_backend(), "zero_stage": engine.zero_stage(),
            "mean_first5": head, "mean_last5": tail, "step_s": step_s, "reload_max_abs_diff": difference,
            "cpu_tensor_all_reduce": reduced.tolist()}


def check_decoding(name: str, model, verifier_path: Path, count: int = 4, new_tokens: int = 48) -> dict:
    from pipeline.evaluation.reference_decoder import SpeculativeDecoder, verifier_greedy
    from pipeline.verifier import load_verifier

    verifier, tokenizer = load_verifier(str(verifier_path), "float32")
    drafter = model.float().eval().to(verifier.device)
    decoder = SpeculativeDecoder(verifier, drafter, drafter.spec.num_speculative_tokens)
    mismatches, taus, started = 0, [], time.time()
    for prompt in prompts(count, 40, tokenizer.vocab_size, seed=7):
        ours, counts = decoder.generate(prompt, new_tokens, (tokenizer.eos_token_id,))
        mismatches += ours != verifier_greedy(verifier, prompt, new_tokens, (tokenizer.eos_token_id,))
        taus.append(counts.tau)
    return {"ok": mismatches == 0 and verifier.device.type == DEVICE, "device": str(verifier.device),
            "mismatched_prompts": mismatches, "prompts": count, "mean_tau": statistics.mean(taus),
            "seconds": time.time() - started}


def run_check(results: dict, key: str, check, *args):
    started = time.time()
    try:
        results[key] = check(*args)
    except Exception as error:  # one broken path must not hide the others
        results[key] = {"ok": False, "error": f"{type(error).__name__}: {error}"[:500],
                        "traceback": traceback.format_exc()[-2000:]}
    results[key]["check_s"] = time.time() - started
    failed = "" if results[key]["ok"] else f"FAILED: {results[key].get('error', 'see the JSON')}"
    print(key, failed or "ok", flush=True)
    return results[key]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--tokenizer", required=True, type=Path)
    parser.add_argument("--out", default=REPO / "benchmarks" / "results" / "gpu_check.json", type=Path)
    parser.add_argument("--steps", default=40, type=int)
    parser.add_argument("--samples", default=32, type=int)
    parser.add_argument("--cpu-dry-run", action="store_true", help="debug the script itself on the CPU (no NCCL)")
    args = parser.parse_args()
    if args.steps < 2 * LOSS_WINDOW:  # the loss check compares the first and the last LOSS_WINDOW steps
        parser.error(f"--steps {args.steps}: must be at least {2 * LOSS_WINDOW} (the mean loss of the first "
                     f"{LOSS_WINDOW} steps is compared with the last {LOSS_WINDOW})")
    if args.samples < 1:
        parser.error(f"--samples {args.samples}: must be at least 1")
    if output_file_problem(args.out):  # written after every check has run: said now
        parser.error(output_file_problem(args.out))
    tokenizer = load_tokenizer(args.tokenizer)  # before the device check, so bad input is named on any machine
    global DEVICE
    DEVICE = "cpu" if args.cpu_dry_run else "cuda"
    if DEVICE == "cuda" and not torch.cuda.is_available():
        print("gpu_check: no CUDA device (--cpu-dry-run checks the script itself)", file=sys.stderr)
        return 2
    results: dict = {"device": torch.cuda.get_device_name(0) if DEVICE == "cuda" else "cpu", "torch": torch.__version__,
                     "python": platform.python_version(),
                     "bf16_supported": DEVICE == "cuda" and torch.cuda.is_bf16_supported()}
    with tempfile.TemporaryDirectory() as tmp:
        verifier_path = make_verifier(Path(tmp) / "verifier", tokenizer)
        layer_ids = sorted({i for name in DRAFTERS for i in build(name, verifier_path, "cpu").spec.aux_layer_ids})
        captured: list = []
        run_check(results, "capture", capture_samples, verifier_path, layer_ids, args.samples, captured)
        samples = captured[0] if captured else None
        if samples is not None:
            for name in DRAFTERS:
                trained = run_check(results, f"train-{name}", check_training, name, verifier_path,
                                    [by_drafter(s, name, layer_ids, verifier_path) for s in samples], args.steps)
                model = trained.pop("model", None)
                if model is not None:
                    run_check(results, f"decode-{name}", check_decoding, name, model, verifier_path)
            for stage in (2, 3) if DEVICE == "cuda" else ():
                run_check(results, f"deepspeed-zero{stage}", check_deepspeed, stage, verifier_path,
                          [by_drafter(s, "peagle", layer_ids, verifier_path) for s in samples], 20)
    results["all_ok"] = all(v.get("ok", True) for v in results.values() if isinstance(v, dict))
    atomic_write_text(Path(args.out), json.dumps(results, indent=2, default=str))
    print(json.dumps(results, indent=2, default=str))
    return 0 if results["all_ok"] else 1


_SPECS: dict = {}


def synchronize() -> None:
    if DEVICE == "cuda":
        torch.cuda.synchronize()


def by_drafter(sample: dict, name: str, layer_ids: list[int], verifier_path: Path) -> dict:
    """The sample with `aux` holding this drafter's layers only (the capture holds every drafter's)."""
    if name not in _SPECS:
        _SPECS[name] = build(name, verifier_path, "cpu").spec.aux_layer_ids
    hidden = sample["aux"].shape[-1] // len(layer_ids)
    parts = [sample["aux"][:, layer_ids.index(i) * hidden:(layer_ids.index(i) + 1) * hidden] for i in _SPECS[name]]
    return {**sample, "aux": torch.cat(parts, -1)}


if __name__ == "__main__":
    try:
        sys.exit(main())
    except PipelineError as error:  # bad input: one line, as the jobs print it (pipeline/entry.py run_guarded)
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
