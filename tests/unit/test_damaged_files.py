"""Files the pipeline wrote (or was given) that were damaged afterwards: each is refused in one line naming the field
and the file, never a traceback, and a damaged store shard is never counted as captured on a rerun."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from pipeline.errors import PipelineError, read_json


@pytest.mark.parametrize("content", [b'{"step": 3', b"\xff\xfe{}", b"[" * 100_000 + b"]" * 100_000],
                         ids=["truncated", "not-utf8", "nested"])
def test_a_damaged_json_file_is_one_line_naming_the_field_and_file(tmp_path, content):
    path = tmp_path / "train_state.json"
    path.write_bytes(content)
    with pytest.raises(PipelineError, match=rf"^training\.resume_from: '{path}' is not readable JSON \("):
        read_json(path, "training.resume_from")


def test_a_jsonl_line_nested_too_deeply_is_refused_by_its_number(tmp_path):
    from pipeline.data.rows import read_jsonl

    path = tmp_path / "prompts.jsonl"
    path.write_text('{"prompt": "fine"}\n{"prompt": ' + "[" * 100_000 + "]" * 100_000 + "}\n")
    with pytest.raises(PipelineError, match=r"^data\.path: line 2 of .* is JSON nested too deeply to read"):
        list(read_jsonl(path))


def test_a_truncated_saved_dataset_is_one_line_naming_the_folder(tmp_path):
    import datasets

    from pipeline.context import load_saved_dataset, save_dataset_atomic

    folder = tmp_path / "prompts" / "train"
    save_dataset_atomic(datasets.Dataset.from_dict({"sample_id": ["a", "b"], "text": ["x", "y"]}), folder)
    assert len(load_saved_dataset(folder, "prompts")) == 2
    for arrow in folder.glob("*.arrow"):
        arrow.write_bytes(arrow.read_bytes()[:50])
    with pytest.raises(PipelineError, match=rf"^prompts: the saved dataset '{folder}' cannot be read \(.*delete it"):
        load_saved_dataset(folder, "prompts")


def _shard(path: Path) -> Path:
    save_file({"offsets": torch.tensor([0, 3, 5]), "hidden": torch.zeros(5, 4)}, str(path),
              metadata={"sample_ids": json.dumps(["a", "b"])})
    return path


def test_a_truncated_or_stray_shard_is_never_counted_as_captured(tmp_path):
    from pipeline.data.store import read_shard_entry, scan_shards

    whole = _shard(tmp_path / "shard-00000000000000aa.safetensors")
    entry = read_shard_entry(whole)
    assert entry["num_tokens"] == 5 and entry["sample_ids"] == ["a", "b"]
    assert scan_shards(tmp_path, {whole.name: entry}) == [entry]
    whole.write_bytes(whole.read_bytes()[:100])  # the manifest still lists it: a rerun must not trust the name
    with pytest.raises(PipelineError, match=rf"^store: shard '{whole}' is damaged .*delete it and rerun"):
        scan_shards(tmp_path, {whole.name: entry})
    whole.unlink()
    stray = tmp_path / "shard-00000000000000bb.safetensors"
    stray.write_text("garbage")
    with pytest.raises(PipelineError, match=rf"^store: shard '{stray}' is damaged"):
        scan_shards(tmp_path)
    longer = _shard(tmp_path / "shard-00000000000000cc.safetensors")
    stray.unlink()
    longer.write_bytes(longer.read_bytes() + b"\0")
    with pytest.raises(PipelineError, match="is damaged"):
        scan_shards(tmp_path)


def test_a_shard_written_again_after_the_manifest_is_read_afresh_not_taken_at_its_old_sha256(tmp_path):
    """A shard captured again under its old name (the name is its sample ids' hash) by a run stopped before it
    wrote the manifest kept the old entry: the store it then wrote failed every train run as corrupt."""
    import os

    from pipeline.data.store import MANIFEST, entries_still_current, read_shard_entry, scan_shards

    kept, again = _shard(tmp_path / "shard-00000000000000aa.safetensors"), _shard(
        tmp_path / "shard-00000000000000bb.safetensors")
    manifest = {"shards": [read_shard_entry(kept), {**read_shard_entry(again), "sha256": "0" * 64}]}
    (tmp_path / MANIFEST).write_text(json.dumps(manifest))
    written = (tmp_path / MANIFEST).stat().st_mtime_ns
    os.utime(kept, ns=(written - 10**9, written - 10**9))
    os.utime(again, ns=(written + 10**9, written + 10**9))  # captured again after the manifest
    current = entries_still_current(tmp_path, manifest)
    assert list(current) == [kept.name] and entries_still_current(tmp_path, None) == {}
    assert scan_shards(tmp_path, current)[1]["sha256"] == read_shard_entry(again)["sha256"] != "0" * 64


@pytest.mark.parametrize("tensors, metadata", [({"x": torch.zeros(2)}, None),
                                               ({"offsets": torch.tensor([0, 3])}, {"sample_ids": "not json"}),
                                               ({"x": torch.zeros(2)}, {"sample_ids": "[\"a\"]"}),
                                               ({"offsets": torch.tensor([0, 3])}, {"sample_ids": "[1]"})],
                         ids=["no metadata", "ids not json", "no offsets", "ids not strings"])
def test_a_foreign_shard_in_the_store_folder_is_one_line_naming_it(tmp_path, tensors, metadata):
    from pipeline.data.store import scan_shards

    stray = tmp_path / "shard-00000000000000dd.safetensors"
    save_file(tensors, str(stray), metadata=metadata)
    with pytest.raises(PipelineError, match=rf"^store: shard '{stray}' is not one this pipeline wrote .*delete it"):
        scan_shards(tmp_path)


@pytest.mark.parametrize("damage", ["truncated", "other columns"])
def test_a_damaged_regeneration_part_is_one_line_naming_it(tmp_path, damage):
    import pandas as pd

    from pipeline.generation.parts import read_parts, write_part

    rows = [{"sample_id": "a", "messages_json": "[]", "input_ids": [1, 2], "loss_mask": [0, 1], "skip_reason": None,
             "truncated": False}]
    part = tmp_path / write_part(tmp_path, rows)
    assert list(read_parts(tmp_path)["sample_id"]) == ["a"]
    if damage == "truncated":
        part.write_bytes(part.read_bytes()[:40])
    else:
        pd.DataFrame({"x": [1]}).to_parquet(part)
    with pytest.raises(PipelineError, match=rf"^regenerate: part '{part}' (is damaged|lacks the columns).*delete it"):
        read_parts(tmp_path)


def _sealed_checkpoint(folder: Path, weights: bytes) -> Path:
    from pipeline.integrity import seal

    folder.mkdir(parents=True, exist_ok=True)
    (folder / "model.safetensors").write_bytes(weights)
    seal(folder)
    return folder


def _set_figures() -> dict:
    return {"num_requests": 2, "verify_steps": 20, "pooled_tau": 1.5, "per_request_tau": 1.45,
            "conditional_acceptance": [0.4, 0.2, 0.1, 0.0], "cumulative_acceptance": [0.4, 0.08, 0.01, 0.0]}


def _finished_report_figures() -> dict:
    """A report with every figure a later stage reads, of the kind the evaluate stage writes."""
    profile = {"num_prompts": 2, "plain_ms_per_token": 20.0, "recommended_k": 2, "max_new_tokens": 16,
               "per_k": [{"k": 1, "tau": 1.4, "draft_ms_per_step": 3.0, "verify_ms_per_step": 22.0,
                          "predicted_speedup": 1.2, "measured_speedup": 1.1}]}
    return {**_set_figures(), "drafts_per_step": 4.0, "num_speculative_tokens": 4, "max_new_tokens": 32,
            "temperature": 0.0, "greedy_mismatches": [], "datasets": {"held_out": _set_figures()},
            "profile": profile, "drafter": "peagle", "verifier": "SmolLM2-135M-Instruct", "checkpoint": "/c",
            "signature": "0123456789abcdef"}


def _cross_check_figures() -> dict:
    return {"tau": 1.5, "tau_gap": 0.01, "cumulative_acceptance": [0.4, 0.08, 0.01, 0.0], "num_requests": 2,
            "reference_tau": 1.5}


def _report_of(checkpoint: Path, **fields) -> dict:
    from pipeline.integrity import folder_digest

    return {**_finished_report_figures(), "checkpoint": str(checkpoint),
            "checkpoint_digest": folder_digest(checkpoint), **fields}


def test_a_damaged_or_incomplete_evaluation_report_is_measured_again(tmp_path):
    from pipeline.evaluation.stage import REQUESTS_FILE, _finished_report

    checkpoint = _sealed_checkpoint(tmp_path / "final", b"weights")
    (tmp_path / REQUESTS_FILE).write_text("[]")
    (tmp_path / "report.json").write_text(json.dumps(_report_of(checkpoint)))
    assert _finished_report(tmp_path, checkpoint)["pooled_tau"] == 1.5
    (tmp_path / "report.json").write_text('{"checkpoint": "')
    assert _finished_report(tmp_path, checkpoint) is None
    # valid JSON without the fields later stages read: a KeyError in _metrics before
    (tmp_path / "report.json").write_text(json.dumps({"checkpoint": str(checkpoint)}))
    assert _finished_report(tmp_path, checkpoint) is None


def test_a_report_of_other_weights_at_the_same_path_is_not_reused(tmp_path):
    """A final checkpoint made again (after failing its integrity check) sits at the same path: its report and
    vLLM cross-check are the old weights', so they are measured again, and a later job will not export or gate
    with them."""
    import shutil

    from pipeline.evaluation.stage import REQUESTS_FILE, _finished_report
    from pipeline.evaluation.vllm_check import RESULT_FILE, load_result

    checkpoint = _sealed_checkpoint(tmp_path / "final", b"old weights")
    report = _report_of(checkpoint)
    (tmp_path / REQUESTS_FILE).write_text("[]")
    (tmp_path / "report.json").write_text(json.dumps(report))
    served = {**_cross_check_figures(), "checkpoint_digest": report["checkpoint_digest"]}
    (tmp_path / RESULT_FILE).write_text(json.dumps(served))
    assert load_result(tmp_path, report) == served
    shutil.rmtree(checkpoint)
    _sealed_checkpoint(checkpoint, b"new weights")
    assert _finished_report(tmp_path, checkpoint) is None
    assert load_result(tmp_path, _report_of(checkpoint)) == {}


def test_a_report_written_before_reports_named_their_weights_is_kept_while_its_checkpoint_is(tmp_path):
    """No digest in it: it counts while it is newer than the checkpoint's integrity records and nothing was set
    aside beside the checkpoint since, so an existing root does not evaluate again."""
    import os

    from pipeline.evaluation.stage import REQUESTS_FILE, _finished_report
    from pipeline.evaluation.vllm_check import RESULT_FILE, load_result
    from pipeline.integrity import record_paths

    checkpoint = _sealed_checkpoint(tmp_path / "final", b"weights")
    legacy = {key: value for key, value in _report_of(checkpoint).items() if key != "checkpoint_digest"}
    (tmp_path / REQUESTS_FILE).write_text("[]")
    (tmp_path / "report.json").write_text(json.dumps(legacy))
    for record in record_paths(checkpoint):
        os.utime(record, (1_000, 1_000))
    assert _finished_report(tmp_path, checkpoint) == legacy
    served = _cross_check_figures()  # no digest either: measured with the report
    (tmp_path / RESULT_FILE).write_text(json.dumps(served))
    assert load_result(tmp_path, legacy) == served
    (tmp_path / "final.damaged-20261206T000000Z").mkdir()  # a checkpoint was made again since
    assert _finished_report(tmp_path, checkpoint) is None
    (tmp_path / "final.damaged-20261206T000000Z").rmdir()
    os.utime(tmp_path / "report.json", (500, 500))  # older than the checkpoint's records
    assert _finished_report(tmp_path, checkpoint) is None


def test_an_export_sealed_before_its_checkpoint_is_not_cross_checked_in_vllm(tmp_path):
    import os

    from pipeline.integrity import record_paths
    from pipeline.stages import _check_export_is_of_checkpoint

    export = _sealed_checkpoint(tmp_path / "export", b"exported")
    checkpoint = _sealed_checkpoint(tmp_path / "final", b"weights")
    for folder, when in ((export, 2_000), (checkpoint, 1_000)):
        for record in record_paths(folder):
            os.utime(record, (when, when))
    _check_export_is_of_checkpoint(export, checkpoint)  # exported after training: fine
    for record in record_paths(checkpoint):
        os.utime(record, (3_000, 3_000))
    with pytest.raises(PipelineError, match=rf"^vllm_eval: the export at {export} was made before the checkpoint"):
        _check_export_is_of_checkpoint(export, checkpoint)


@pytest.mark.parametrize("spec_json", ["{", "{}", "[]"])
def test_resume_from_a_folder_whose_spec_is_not_a_drafter_spec_is_one_line(tmp_path, spec_json):
    from pipeline.drafters.spec import DrafterSpec
    from pipeline.training.resume import SPEC_FILE, STATE_FILE, read_resume_point

    (tmp_path / SPEC_FILE).write_text(spec_json)
    (tmp_path / STATE_FILE).write_text("{}")
    with pytest.raises(PipelineError, match=r"^training\.resume_from: "):
        read_resume_point(tmp_path, DrafterSpec.__new__(DrafterSpec))


@pytest.mark.parametrize("content", ['{"tau": 1.', "[]", "null", '{"tau": 1.2}'],
                         ids=["truncated", "a list", "null", "fields missing"])
def test_a_damaged_vllm_cross_check_is_one_line_naming_the_file(tmp_path, content):
    from pipeline.evaluation.vllm_check import RESULT_FILE, load_result

    assert load_result(tmp_path) == {}  # none yet
    (tmp_path / RESULT_FILE).write_text(content)
    with pytest.raises(PipelineError, match=rf"^vllm_eval: '{tmp_path / RESULT_FILE}' "
                                            r"(is not readable JSON|holds|is not a finished cross-check \(no tau_gap)"):
        load_result(tmp_path)


@pytest.mark.parametrize("field,value,problem", [
    ("tau_gap", "0.01", "tau_gap not a number"), ("tau", None, "tau not a number"),
    ("num_requests", True, "num_requests not a whole number"), ("num_requests", 2.0, "num_requests not a whole"),
    ("reference_tau", [1.5], "reference_tau not a number"),
    ("cumulative_acceptance", [0.4, "x"], "cumulative_acceptance.1 not a number"),
    ("requests_matching_reference", "2", "requests_matching_reference not a whole number")])
def test_a_vllm_cross_check_whose_figures_are_not_of_their_kind_is_one_line(tmp_path, field, value, problem):
    """The gate compares them with thresholds and the stage logs them as metrics: text there was a TypeError in
    the promote stage."""
    from pipeline.evaluation.vllm_check import RESULT_FILE, load_result

    (tmp_path / RESULT_FILE).write_text(json.dumps(_cross_check_figures()))
    assert load_result(tmp_path)["tau"] == 1.5
    (tmp_path / RESULT_FILE).write_text(json.dumps({**_cross_check_figures(), field: value}))
    with pytest.raises(PipelineError, match=rf"^vllm_eval: '.*' is not a finished cross-check \({problem}"):
        load_result(tmp_path)


@pytest.mark.parametrize("path,value,problem", [
    (["pooled_tau"], "1.5", "pooled_tau not a number"),
    (["num_speculative_tokens"], True, "num_speculative_tokens not a whole number"),
    (["max_new_tokens"], 32.5, "max_new_tokens not a whole number"),
    (["temperature"], "0", "temperature not a number"),
    (["per_request_tau"], None, "per_request_tau not a number"),
    (["datasets"], [], "datasets not an object"),
    (["datasets", "held_out", "per_request_tau"], "1.4", "datasets.held_out.per_request_tau not a number"),
    (["datasets", "held_out", "conditional_acceptance"], 0.4, "datasets.held_out.conditional_acceptance not a "),
    (["profile", "recommended_k"], "2", "profile.recommended_k not a whole number"),
    (["profile", "recommended_k"], 0, "profile.recommended_k input should be greater than or equal to 1"),
    (["profile", "per_k", 0, "tau"], "x", "profile.per_k.0.tau not a number"),
    (["signature"], 7, "signature not text")])
def test_a_report_whose_figures_are_not_of_their_kind_is_one_line(tmp_path, path, value, problem):
    """Nested figures too: a reused report's per-set tau is logged as a metric and formatted in the model card,
    where text was a ValueError deep in the stage."""
    from pipeline.evaluation.stage import load_report

    report = _finished_report_figures()
    (tmp_path / "report.json").write_text(json.dumps(report))
    assert load_report(tmp_path) == report
    holder = report
    for key in path[:-1]:
        holder = holder[key]
    holder[path[-1]] = value
    (tmp_path / "report.json").write_text(json.dumps(report))
    with pytest.raises(PipelineError, match=rf"^evaluate: '.*' is not a finished evaluation report \({problem}"):
        load_report(tmp_path)


def test_a_report_without_a_profile_is_still_a_finished_report(tmp_path):
    from pipeline.evaluation.stage import load_report

    (tmp_path / "report.json").write_text(json.dumps({**_finished_report_figures(), "profile": None}))
    assert load_report(tmp_path)["profile"] is None


@pytest.mark.parametrize("content", ["[]", '"abc"', "null"])
def test_a_regeneration_record_that_is_not_an_object_is_one_line_naming_the_file(tmp_path, content):
    from types import SimpleNamespace

    from pipeline.generation.capture_stage import _check_regenerated_tokenizer
    from pipeline.generation.regenerate_stage import REGENERATION_INFO

    (tmp_path / REGENERATION_INFO).write_text(content)
    ctx = SimpleNamespace(paths=SimpleNamespace(regenerated=tmp_path))
    with pytest.raises(PipelineError, match=rf"^capture: '{tmp_path / REGENERATION_INFO}' holds \w+, not the "):
        _check_regenerated_tokenizer(ctx, "fingerprint")


@pytest.mark.parametrize("change", [{"num_hidden_layers": "six"}, {"layer_types": ["full_attention"]}],
                         ids=["layer count as text", "layer types of another depth"])
def test_a_verifier_config_transformers_refuses_is_one_line_naming_verifier_path(tmp_path, tiny_verifier_path, change):
    import shutil

    from pipeline.families import load_verifier_config

    verifier = tmp_path / "verifier"
    shutil.copytree(tiny_verifier_path, verifier)
    config = json.loads((verifier / "config.json").read_text())
    (verifier / "config.json").write_text(json.dumps({**config, **change}))
    with pytest.raises(PipelineError, match=rf"^verifier\.path: the config\.json of '{verifier}' is not one "
                                            "transformers accepts"):
        load_verifier_config(str(verifier))


def test_a_damaged_generation_config_is_named_not_read_as_absent(tmp_path, tiny_verifier_path):
    """Its eos ids are stop ids: read as absent, a verifier that ends turns on two ids silently stopped on one."""
    import shutil

    from transformers import AutoTokenizer

    from pipeline.verifier import verifier_stop_token_ids

    verifier = tmp_path / "verifier"
    shutil.copytree(tiny_verifier_path, verifier)
    tokenizer = AutoTokenizer.from_pretrained(verifier)
    (verifier / "generation_config.json").write_text('{"eos_token_id": [1, 2')
    with pytest.raises(PipelineError, match=rf"^verifier\.path: the generation_config\.json of '{verifier}' cannot "
                                            "be read"):
        verifier_stop_token_ids(str(verifier), tokenizer)
    (verifier / "generation_config.json").unlink()  # absent: the tokenizer's eos alone, as vLLM does
    assert verifier_stop_token_ids(str(verifier), tokenizer) == (tokenizer.eos_token_id,)
