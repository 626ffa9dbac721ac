"""The evaluation's pieces without a model run: the speculation profile on a tiny verifier, eval sets that never
hand back a training prompt, the report files, and vLLM's counters read with the metric spec."""

from __future__ import annotations

import json

import pytest
from omegaconf import OmegaConf

from pipeline.config.schema import EvaluationConfig
from pipeline.errors import PipelineError
from pipeline.evaluation.eval_sets import eval_sets, trained_prompts
from pipeline.evaluation.profile import speculation_profile
from pipeline.evaluation.reference_decoder import SpeculativeDecoder, verifier_greedy
from pipeline.evaluation.report import write_report
from pipeline.evaluation.vllm_check import compare
from pipeline.metrics import served_figures
from pipeline.verifier import load_verifier
from tests.conftest import write_jsonl
from tests.unit.test_reference_decoder import PROMPTS, OracleDrafter, drafter_for, prompt_tokens


def test_profile_of_an_oracle_drafter_grows_tau_with_k(tiny_verifier_path):
    verifier, tokenizer = load_verifier(tiny_verifier_path)
    inner = drafter_for(tiny_verifier_path, verifier, tokenizer)
    prompt = prompt_tokens(tokenizer, PROMPTS[0])
    oracle = OracleDrafter(inner.spec, verifier_greedy(verifier, prompt, 24, ()), len(prompt))
    profile = speculation_profile(lambda k: SpeculativeDecoder(verifier, oracle, k), [prompt], 24, (), 4)
    taus = [row["tau"] for row in profile["per_k"]]
    # K=1, every draft accepted: 12 steps of 2 tokens after the prefill's one (the last one runs past
    # max_new_tokens and still counts, as in vLLM)
    assert taus[0] == pytest.approx(2.0)
    assert taus == sorted(taus) and taus[-1] > 4.0
    assert [row["k"] for row in profile["per_k"]] == [1, 2, 3, 4]
    assert profile["recommended_k"] == max(profile["per_k"], key=lambda r: r["predicted_speedup"])["k"]
    assert all(row["verify_ms_per_step"] > 0 and row["draft_ms_per_step"] >= 0 for row in profile["per_k"])


def test_an_eval_set_is_decoded_under_a_progress_bar_of_its_requests(tiny_verifier_path, capsys):
    """Evaluation was the one long stage without a bar: minutes with one log line per set."""
    from pipeline.evaluation.stage import evaluate_prompts

    verifier, tokenizer = load_verifier(tiny_verifier_path)
    drafter = drafter_for(tiny_verifier_path, verifier, tokenizer, num_speculative_tokens=2)
    eval_cfg = OmegaConf.merge(OmegaConf.structured(EvaluationConfig),
                               {"num_speculative_tokens": 2, "max_new_tokens": 4, "batch_size": 2})
    conversations = [[{"role": "user", "content": text}] for text in PROMPTS[:3]]
    summary, counts = evaluate_prompts(verifier, tokenizer, drafter, conversations, eval_cfg, "code")
    assert len(counts) == summary["num_requests"] == 3
    bar = capsys.readouterr().err
    assert "evaluate code" in bar and "3/3" in bar and "request" in bar


def test_prompts_longer_than_the_served_context_are_left_out_and_counted(tiny_verifier_path, caplog):
    """A held-out prompt of 20,000 tokens on an 8,192-token verifier ran for minutes, using 12 GB, with no word;
    vLLM's cross-check (evaluation.vllm.max_model_len) could never serve it."""
    from transformers import AutoConfig, AutoTokenizer

    from pipeline.evaluation.stage import fitting_prompts, prompt_token_limit

    config = AutoConfig.from_pretrained(tiny_verifier_path)
    eval_cfg = OmegaConf.merge(OmegaConf.structured(EvaluationConfig), {"max_new_tokens": 16})
    assert prompt_token_limit(config, eval_cfg) == min(config.max_position_embeddings, 2048) - 16
    config.max_position_embeddings = 100
    assert prompt_token_limit(config, eval_cfg) == 84
    eval_cfg.profile_max_new_tokens = 40  # the profile's decode is the longest
    assert prompt_token_limit(config, eval_cfg) == 60
    config.max_position_embeddings, eval_cfg.profile_max_new_tokens = 8192, None
    assert prompt_token_limit(config, eval_cfg) == 2048 - 16  # vLLM's context, which the cross-check serves
    eval_cfg.vllm.enabled = "false"
    assert prompt_token_limit(config, eval_cfg) == 8192 - 16  # no cross-check: the verifier's own
    tokenizer = AutoTokenizer.from_pretrained(tiny_verifier_path)
    short, long = [{"role": "user", "content": "hi"}], [{"role": "user", "content": "word " * 500}]
    with caplog.at_level("WARNING"):
        assert fitting_prompts("held_out", [short, long, short], tokenizer, 84) == [short, short]
    assert "held_out: left out 1 of 3 prompts longer than 84 tokens" in caplog.text
    with pytest.raises(PipelineError, match=r"^evaluation\.datasets: every prompt of eval set 'chat' is longer "
                                            r"than 84 tokens"):
        fitting_prompts("chat", [long], tokenizer, 84)


def test_named_eval_sets_leave_out_the_prompts_the_drafter_trained_on(tmp_path):
    rows = [{"messages": [{"role": "user", "content": f"question {i}"}]} for i in range(6)]
    cfg = OmegaConf.merge(OmegaConf.structured(EvaluationConfig), {
        "name": "t", "datasets": ["held_out", "mine"], "prompts_per_set": 3,
        "sets": {"mine": {"source": "jsonl", "path": str(write_jsonl(tmp_path / "mine.jsonl", rows))}}})
    trained = trained_prompts([rows[i] for i in (0, 2)])
    held_out = [{"messages": [{"role": "user", "content": "held"}, {"role": "assistant", "content": "answer"}]}]
    sets = eval_sets(cfg, held_out, trained)
    assert list(sets) == ["held_out", "mine"]
    assert sets["held_out"] == [[{"role": "user", "content": "held"}]]  # the answer is not part of the prompt
    assert [m[0]["content"] for m in sets["mine"]] == ["question 1", "question 3", "question 4"]
    # prompts too long for the context are left out before the set is cut, so others take their place
    too_long = {"question 1", "question 3"}
    sets = eval_sets(cfg, held_out, trained, fit=lambda name, conversations: [
        c for c in conversations if c[0]["content"] not in too_long])
    assert [m[0]["content"] for m in sets["mine"]] == ["question 4", "question 5"]


def test_a_trained_prompt_is_left_out_whatever_its_answer_or_system_prompt(tmp_path):
    """The overlap was judged on the whole conversation: an eval set of the training prompts with reference
    answers, or a training split framed by data.system_prompt, handed back every prompt the drafter trained on."""
    asked = [f"question {i}" for i in range(4)]
    rows = [{"messages": [{"role": "user", "content": q}, {"role": "assistant", "content": f"answer {i}"}]}
            for i, q in enumerate(asked)]
    cfg = OmegaConf.merge(OmegaConf.structured(EvaluationConfig), {
        "name": "t", "datasets": ["mine"], "prompts_per_set": 4,
        "sets": {"mine": {"source": "jsonl", "path": str(write_jsonl(tmp_path / "mine.jsonl", rows))}}})
    train = [{"messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": q}]}
             for q in asked[:3]]
    assert [m[0]["content"] for m in eval_sets(cfg, [], trained_prompts(train))["mine"]] == ["question 3"]


def test_an_eval_set_file_edited_after_the_evaluation_key_was_made_is_refused(tmp_path):
    """The evaluation key hashed the set's file at the job's start, and the evaluate stage reads it after training:
    an edit in between was measured and saved (and later reused) as the old file's report."""
    from pipeline.config import compose
    from pipeline.paths import StagePaths

    questions = write_jsonl(tmp_path / "mine.jsonl", [{"prompt": f"question {i}"} for i in range(4)])
    paths = StagePaths(compose(["evaluation.datasets=[held_out,mine]",
                                f"+evaluation.sets.mine={{source: jsonl, path: '{questions}'}}"]))
    cfg = OmegaConf.merge(OmegaConf.structured(EvaluationConfig), {
        "name": "t", "datasets": ["mine"], "prompts_per_set": 4,
        "sets": {"mine": {"source": "jsonl", "path": str(questions)}}})
    assert len(eval_sets(cfg, [], set(), file_sha256=paths.eval_set_sha256)["mine"]) == 4  # unchanged: read
    write_jsonl(questions, [{"prompt": "another question"}])
    with pytest.raises(PipelineError, match=r"^evaluation\.sets\.mine\.path: prompt file .* changed after this job"):
        eval_sets(cfg, [], set(), file_sha256=paths.eval_set_sha256)


def test_an_unreadable_eval_set_names_itself(tmp_path):
    cfg = OmegaConf.merge(OmegaConf.structured(EvaluationConfig), {
        "name": "t", "datasets": ["gone"], "sets": {"gone": {"source": "jsonl", "path": str(tmp_path / "no.jsonl")}}})
    with pytest.raises(PipelineError, match="^evaluation\\.sets\\.gone\\.path: .*does not exist"):
        eval_sets(cfg, [], set())


def summary(tau, alphas):
    return {"num_requests": 2, "verify_steps": 10, "pooled_tau": tau, "per_request_tau": tau,
            "conditional_acceptance": alphas, "cumulative_acceptance": alphas, "accepted_per_position": [1, 1],
            "drafts_per_step": 2.0}


def test_report_files_hold_every_set_and_the_profile(tmp_path):
    report = {**summary(1.5, [0.4, 0.2]), "num_speculative_tokens": 2, "drafter": "peagle", "verifier": "v",
              "datasets": {"held_out": summary(1.6, [0.5, 0.3]), "gsm8k": summary(1.4, [0.3, 0.1])},
              "profile": {"num_prompts": 2, "plain_ms_per_token": 10.0, "recommended_k": 2, "per_k": [
                  {"k": 1, "tau": 1.3, "draft_ms_per_step": 1.0, "verify_ms_per_step": 11.0,
                   "predicted_speedup": 1.08, "measured_speedup": 1.05},
                  {"k": 2, "tau": 1.5, "draft_ms_per_step": 2.0, "verify_ms_per_step": 11.5,
                   "predicted_speedup": 1.11, "measured_speedup": 1.10}]}}
    write_report(report, tmp_path)
    markdown = (tmp_path / "report.md").read_text()
    assert "| gsm8k | 2 | 1.400 |" in markdown and "| held_out | 2 | 1.600 |" in markdown
    assert "Recommended K = **2**" in markdown and "| 2 | 1.500 | 2.0 | 11.5 | 1.11 | 1.10 |" in markdown
    assert (tmp_path / "acceptance.png").read_bytes()[:4] == b"\x89PNG"
    assert json.loads((tmp_path / "report.json").read_text())["datasets"]["gsm8k"]["pooled_tau"] == 1.4
    assert not list(tmp_path.glob(".*"))  # no temporary file left behind


def test_vllm_counters_read_with_the_metric_spec():
    counters = {"num_drafts": 10, "num_draft_tokens": 40, "num_accepted_tokens": 15,
                "num_accepted_tokens_per_pos": [8, 4, 2, 1]}
    figures = served_figures(counters)
    assert figures["tau"] == pytest.approx(2.5)
    assert figures["cumulative_acceptance"] == pytest.approx([0.8, 0.4, 0.2, 0.1])
    requests = [{"prompt_ids": [1], "tokens": [5, 6]}, {"prompt_ids": [2], "tokens": [7]}]
    served = {"speculative": {"tokens": [[5, 6], [7, 8]], "counters": counters},
              "baseline": {"tokens": [[5, 6], [7, 8]]}}
    result = compare({"pooled_tau": 2.4, "temperature": 0.0}, requests, served)
    assert result["tau_gap"] == pytest.approx(0.1 / 2.4)
    assert result["requests_matching_reference"] == 1 and result["lossless"] is True
    with pytest.raises(PipelineError, match="no draft steps"):
        served_figures({**counters, "num_drafts": 0})


def test_a_near_copy_of_a_held_out_prompt_is_not_trained_on():
    """Train and held-out prompts were kept apart by the exact text: 'Explain topic 3. ' and 'explain topic 3.'
    trained while 'Explain topic 3.' was measured."""
    import datasets

    from pipeline.data.prompts import conversation_id, prompt_key, split_prompts

    asked = [f"Explain topic {i}." for i in range(6)]
    variants = [variant for question in asked for variant in (question, question + " ", question.lower(),
                                                                question.replace(" ", "  "))]
    rows = [{"sample_id": conversation_id([{"role": "user", "content": q}]),
             "messages": [{"role": "user", "content": q}]} for q in variants]
    data_cfg = OmegaConf.create({"num_train": 8, "num_eval": 2, "shuffle_seed": 0})
    train, held_out = split_prompts(datasets.Dataset.from_list(rows), data_cfg)

    def question(messages) -> str:  # what is asked, as a reader would tell copies apart
        return " ".join(messages[0]["content"].split()).lower()
    assert {question(m) for m in train["messages"]}.isdisjoint(question(m) for m in held_out["messages"])
    assert prompt_key([{"role": "user", "content": "Explain  topic 3. "}]) == prompt_key(
        [{"role": "user", "content": "explain topic 3."}])
