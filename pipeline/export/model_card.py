"""The model card of an exported speculator: one markdown text for the registered version's description and the
export folder's README.md (the Hugging Face convention).

Pure: it reads the config, the export's config.json, the evaluation report and the lineage it is given, and
returns text. The stage writes it and the tracker hands it to MLflow.
"""

from __future__ import annotations

import json
import shlex
from typing import Any, Optional

from omegaconf import OmegaConf

from pipeline.config.schema import PipelineConfig, TrainingConfig
from pipeline.export.vllm_config import speculative_method

CARD_FILE = "README.md"


def _table(header: list[str], rows: list[list[Any]], align: Optional[list[str]] = None) -> list[str]:
    align = align or ["---"] * len(header)
    return [f"| {' | '.join(header)} |", f"| {' | '.join(align)} |",
            *[f"| {' | '.join(str(cell) for cell in row)} |" for row in rows]]


def _tau_rows(report: dict) -> list[list[Any]]:
    rows = [[name, f"{result['pooled_tau']:.3f}", f"{result['per_request_tau']:.3f}", result["num_requests"]]
            for name, result in report["datasets"].items()]
    if len(rows) > 1:
        rows.append(["all sets", f"{report['pooled_tau']:.3f}", f"{report['per_request_tau']:.3f}",
                     report.get("num_requests", sum(r[3] for r in rows))])
    return rows


def _acceptance_rows(report: dict) -> list[list[Any]]:
    return [[k, f"{alpha:.3f}", f"{cumulative:.3f}"] for k, (alpha, cumulative) in
            enumerate(zip(report["conditional_acceptance"], report["cumulative_acceptance"]), start=1)]


def evaluation_section(report: Optional[dict]) -> list[str]:
    """The card's acceptance figures: tau per eval set, acceptance per draft position, K, temperature and the
    speculation profile's recommended K. Returns markdown lines; with no report, a line saying so."""
    lines = ["## Acceptance", ""]
    if not report:
        return lines + ["Not evaluated: this export was made without an evaluation report.", ""]
    temperature = float(report["temperature"])
    mode = "greedy" if temperature == 0 else "rejection sampling"
    lines += [f"Measured with the pipeline's lossless reference decoder at K={report['num_speculative_tokens']} "
              f"draft tokens, temperature {temperature:g} ({mode}). τ is the number of tokens each verifier "
              "step emits (accepted drafts + 1): pooled over every step of a set, and averaged per request.", ""]
    lines += _table(["eval set", "pooled τ", "per-request τ", "requests"], _tau_rows(report),
                    ["---", "---:", "---:", "---:"])
    lines += ["", "Per draft position k: α_k is the acceptance of position k given positions 1..k-1 were "
              "accepted; the cumulative acceptance is the share of steps accepting positions 1..k.", ""]
    lines += _table(["k", "α_k", "cumulative acceptance"], _acceptance_rows(report), ["---:", "---:", "---:"])
    profile = report.get("profile")
    if profile:
        lines += ["", f"Recommended K (speculation profile, best predicted speed-up): {profile['recommended_k']}"]
    return lines + [""]


def _batch(training: TrainingConfig) -> str:
    accumulation = int(training.grad_accum_steps)
    return (f"micro-batch {training.micro_batch_size} × {training.num_workers} workers × {accumulation} "
            "accumulation steps")


def _deepspeed(cfg: PipelineConfig) -> str:
    return f"ZeRO stage {cfg.deepspeed.zero_stage}" if cfg.deepspeed.enabled else "off (plain PyTorch)"


def _generation(cfg: PipelineConfig) -> str:
    capture = cfg.generation.capture_backend
    backend = cfg.generation.backend
    return f"{backend} (hidden states captured with {capture})" if capture and capture != backend else backend


def training_section(cfg: PipelineConfig, export_config: dict) -> list[str]:
    """How the drafter was trained: verifier, prompt set, generation backend, drafter config, optimisation and
    DeepSpeed. Returns markdown lines; raises KeyError when the export's config.json lacks its verifier."""
    verifier_path = export_config["speculators_config"]["verifier"]["name_or_path"]
    drafter = json.dumps(OmegaConf.to_container(cfg.drafter, resolve=True), sort_keys=True)
    data, training = cfg.data, cfg.training
    rows = [
        ["verifier", f"{cfg.verifier.name} (`{verifier_path}`)"],
        ["prompt set", f"{data.name} (source {data.source}, {data.num_train} training prompts)"],
        ["generation backend", _generation(cfg)],
        ["drafter", f"{cfg.drafter.name} (`{export_config['speculators_model_type']}` in the speculators format)"],
        ["drafter config", f"`{drafter}`"],
        ["training", f"{training.max_steps} steps, lr {training.lr:g}, {_batch(training)}"],
        ["DeepSpeed", _deepspeed(cfg)],
    ]
    return ["## Training", "", *_table(["", ""], rows), ""]


def lineage_section(lineage: dict[str, Any]) -> list[str]:
    """The content keys and runs the export descends from, in the order given. Returns markdown lines."""
    rows = [[key, f"`{value}`"] for key, value in lineage.items()]
    return ["## Lineage", "", *_table(["key", "value"], rows), ""]


def serve_commands(export_config: dict, export_dir: str, num_speculative_tokens: int,
                   registry: Optional[tuple[str, str]]) -> list[str]:
    """Shell lines serving the export: plain `vllm serve` with it as the speculator, and (after a comment line on
    the promotion gate) the pipeline's Ray Serve job on the registered version (`registry` = (name, version); left
    out when None). Returns the lines; raises KeyError when the export's config.json lacks its type or verifier."""
    from pipeline.families import vllm_engine_options

    verifier = export_config["speculators_config"]["verifier"]["name_or_path"]
    speculative = {"model": export_dir, "num_speculative_tokens": num_speculative_tokens,
                   **speculative_method(export_config["speculators_model_type"])}
    # what the pipeline's own engines add for this verifier (a multimodal one runs as its text model); a card is
    # written offline, so a hub verifier is read from the local cache only
    family_flags = "".join(f" {flag}" for flag in _cli_flags(vllm_engine_options(verifier, cached_only=True)))
    commands = [f"vllm serve {shlex.quote(verifier)}{family_flags} "
                f"--speculative-config {shlex.quote(json.dumps(speculative))}"]
    if registry:
        name, version = registry
        commands += ["# the pipeline serves a version the promotion gate promoted (see its gate.decision tag)",
                     f"python jobs/serve.py {shlex.quote(f'serving.model=models:/{name}/{version}')}"]
    return commands


def _cli_flags(engine_options: dict[str, Any]) -> list[str]:
    """vLLM engine arguments as `vllm serve` flags: `--name value` (a dict or list as JSON), a true boolean alone."""
    flags = []
    for name, value in engine_options.items():
        flag = "--" + name.replace("_", "-")
        if value is True:
            flags.append(flag)
        elif value is not False:
            flags.append(f"{flag} {shlex.quote(json.dumps(value) if isinstance(value, (dict, list)) else str(value))}")
    return flags


GATE_HEADING = "## Promotion gate"


def without_gate_decision(card: str) -> str:
    """The card as the export wrote it: without the section a promote stage added (with_gate_decision)."""
    head, found, _ = card.rpartition(f"\n{GATE_HEADING}\n")
    return head.rstrip("\n") + "\n" if found else card


def with_gate_decision(card: str, name: str, version: str, promoted: bool, reason: str, alias: str) -> str:
    """The registered version's card with the gate's decision as its last section, replacing the one an earlier
    promote stage wrote: a refused version's card says that `jobs/serve.py` needs serving.allow_unpromoted=true.
    Returns markdown."""
    kept = without_gate_decision(card).rstrip("\n")
    model = shlex.quote(f"serving.model=models:/{name}/{version}")
    if promoted:
        lines = [f"Promoted as `{alias}` ({reason}); a better version may hold the alias since."]
    else:
        lines = [f"Refused: {reason}. `jobs/serve.py` serves this version only when told to:", "", "```bash",
                 f"python jobs/serve.py {model} serving.allow_unpromoted=true", "```"]
    return "\n".join([kept, "", GATE_HEADING, "", *lines, ""])


def model_card(cfg: PipelineConfig, export_config: dict, export_dir: str, report: Optional[dict],
               lineage: dict[str, Any], registry: Optional[tuple[str, str]] = None) -> str:
    """The whole card as markdown: title, acceptance, training, lineage and serving commands. `report` is the
    evaluation's report (None: not evaluated), `registry` the (name, version) it is registered as (None: not
    registered). Raises KeyError when `export_config` is not a speculators config.json."""
    k = int(report["num_speculative_tokens"]) if report else int(cfg.drafter.num_speculative_tokens)
    title = f"{registry[0]} version {registry[1]}" if registry else f"{cfg.verifier.name} {cfg.drafter.name}"
    lines = [f"# {title}", "",
             f"A `{export_config['speculators_model_type']}` speculative-decoding drafter for "
             f"`{cfg.verifier.name}`, trained and exported by the speculators pipeline.", ""]
    lines += evaluation_section(report)
    lines += training_section(cfg, export_config)
    lines += lineage_section(lineage)
    lines += ["## Serve", "", "```bash", *serve_commands(export_config, export_dir, k, registry), "```", ""]
    return "\n".join(lines)
