"""What the regenerate and capture stages share: a Ray Data actor pool that streams token-budget batches through
verifier actors, the vLLM engine options, the verifier's tokenizer and config, and the store-size budget.

Both stages run as Ray Data pipelines with one verifier per actor (`generation.num_actors`, `generation.use_gpu`): the
driver packs samples into token-budget batches, actors write each finished batch straight to disk (a Parquet part
or a safetensors shard, written then renamed), and the driver streams their one-row summaries into a progress bar.
A killed run keeps every finished batch; the rerun does only what no finished file holds. Scaling out is a config
change, not a code change.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import TYPE_CHECKING, Iterator

from pipeline.context import Context
from pipeline.errors import PipelineError, remote_cause
from pipeline.families import load_verifier_config

if TYPE_CHECKING:
    from pipeline.config.schema import GenerationConfig

log = logging.getLogger(__name__)

GIB = 1024**3
REGENERATION_INFO = "regeneration.json"  # written beside the regenerated set: its tokenizer, backend, skips


def stream_batches(items: list[dict], worker_cls: type, kwargs: dict, gen_cfg: GenerationConfig) -> Iterator[dict]:
    """Run `worker_cls` over every item (one token-budget batch each) on an actor pool; yield summaries as they
    finish."""
    import ray

    dataset = ray.data.from_items(items, override_num_blocks=len(items))
    mapped = dataset.map_batches(
        worker_cls,
        fn_constructor_kwargs=kwargs,
        batch_size=1,
        batch_format="pandas",
        compute=ray.data.ActorPoolStrategy(size=gen_cfg.num_actors),
        num_cpus=gen_cfg.cpus_per_actor,
        num_gpus=gen_cfg.tensor_parallel_size if gen_cfg.use_gpu else 0,
    )
    from pipeline.cluster import raise_if_stopped

    try:
        for row in mapped.iter_rows():
            raise_if_stopped()  # a stop signal whose exception a finalizer swallowed in the wait
            yield row
    except Exception as error:  # Ray wraps the actor's exception; finished batches are already safe on disk
        raise PipelineError(f"{worker_cls.__name__}: a verifier actor failed: {remote_cause(error)}; "
                            "finished batches are kept, rerun to continue") from error


def progress(total: int, description: str):
    from pipeline.logs import progress_bar

    return progress_bar(total, description, unit="sample")


def vllm_options(gen_cfg: GenerationConfig, capture: bool = False) -> dict:
    """The vLLM engine's settings. Capture prefills a whole sample and asks for one token (vLLM returns hidden
    states only for a request that runs), so a sample of exactly generation.max_length tokens needs a context one
    longer: with max_model_len = max_length vLLM refused the samples regeneration had truncated to that length."""
    max_model_len = int(gen_cfg.max_length) + (1 if capture else 0)
    return {"max_model_len": max_model_len, "gpu_memory_utilization": float(gen_cfg.gpu_memory_utilization),
            "kv_cache_gb": gen_cfg.kv_cache_gb,
            "tensor_parallel_size": int(gen_cfg.tensor_parallel_size)}


def load_tokenizer(ctx: Context):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(ctx.verifier_path)
    vocab_size = int(load_verifier_config(ctx.verifier_path).vocab_size)
    if len(tokenizer) > vocab_size:
        raise PipelineError(f"verifier.path: its tokenizer has {len(tokenizer)} tokens but the model's vocabulary "
                            f"has {vocab_size}: the tokenizer does not belong to this verifier")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


def refuse_over_budget(projected_bytes: int, what: str, gen_cfg: GenerationConfig) -> None:
    log.info("%s: projected store size %.3f GiB (generation.max_store_gb=%s)", what, projected_bytes / GIB,
             gen_cfg.max_store_gb)
    if projected_bytes > gen_cfg.max_store_gb * GIB:
        raise PipelineError(
            f"generation.max_store_gb: the store would take {projected_bytes / GIB:.2f} GiB, over the limit of "
            f"{gen_cfg.max_store_gb} GiB (samples x tokens x layers x hidden x bytes); raise the limit, use "
            f"generation.compression=fp8, or capture fewer samples")


def check_each_once(sample_ids: list[str], expected: set[str], what: str) -> None:
    duplicated = [sid for sid, count in Counter(sample_ids).items() if count > 1]
    if duplicated:
        raise PipelineError(f"{what}: samples {duplicated[:3]} were written twice")
    missing = expected - set(sample_ids)
    if missing:
        raise PipelineError(f"{what}: {len(missing)} samples are missing, e.g. {sorted(missing)[:3]}")


def verifier_config(ctx: Context):
    return load_verifier_config(ctx.verifier_path)


def capture_layer_ids(ctx: Context, num_verifier_layers: int) -> list[int]:
    """Every layer any drafter reads by default (or the configured aux layers), plus the last layer, whose
    post-norm state gives the training targets."""
    from pipeline.drafters.build import store_layer_ids

    return store_layer_ids(ctx.cfg.drafter.aux_layer_ids, num_verifier_layers)
