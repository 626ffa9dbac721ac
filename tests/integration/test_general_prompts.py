"""The `general` prompt source on the real SmolLM2, offline: HumanEval plus the verifier's own code, math and chat
requests, the same for the same seed, deduplicated, and never handed back by an eval set."""

from __future__ import annotations

import pytest

from pipeline.config import compose
from pipeline.data.prompts import load_prompts
from pipeline.data.synthesize import PromptWriter
from pipeline.evaluation.eval_sets import eval_sets, trained_prompts
from tests.conftest import go_offline

# Two domains, one batch each: the mechanism at a fraction of the default's 3 x 800 requests.
SMALL = ["data.source=general", "data.synthetic.domains=[code,chat]", "data.synthetic.per_domain=6",
         "data.synthetic.batch_size=6", "data.synthetic.max_new_tokens=40", "data.synthetic.backend=hf"]


def writer(cfg, smollm2_path: str, cache_root) -> PromptWriter:
    return PromptWriter(path=smollm2_path, identity={"name": cfg.verifier.name}, compute_dtype="float32",
                        cache_root=cache_root, cluster=cfg.cluster)


@pytest.fixture(scope="module")
def general(tmp_path_factory, smollm2_path, ray_local):
    cfg = compose(SMALL)
    monkeypatch = pytest.MonkeyPatch()
    go_offline(monkeypatch)  # no hub: everything comes from packages and the verifier
    try:
        first = load_prompts(cfg.data, writer(cfg, smollm2_path, tmp_path_factory.mktemp("a")))
        second = load_prompts(cfg.data, writer(cfg, smollm2_path, tmp_path_factory.mktemp("b")))
    finally:
        monkeypatch.undo()
    return cfg, first, second


def test_the_verifier_writes_requests_the_same_way_for_the_same_seed(general):
    _, first, second = general
    assert first["sample_id"] == second["sample_id"]  # sampled afresh in another folder: the same prompts
    written = [row["messages"][0]["content"] for row in first][164:]
    assert len(first) > 164 and written  # HumanEval's 164, then the verifier's own
    assert len(set(first["sample_id"])) == len(first)
    assert all(len(text.split()) >= 3 and "<|im_" not in text for text in written), written


def test_an_eval_set_of_the_verifiers_requests_leaves_out_every_training_prompt(general, smollm2_path, tmp_path):
    """The code eval set sampled with the training data's own seed repeats its first batch exactly; those
    prompts are left out and the rest are new."""
    cfg, train, _ = general
    evaluation = compose([*SMALL, "evaluation.datasets=[code]", "evaluation.prompts_per_set=12",
                          "++evaluation.sets.code.synthetic.seed=0", "++evaluation.sets.code.synthetic.per_domain=12",
                          "++evaluation.sets.code.synthetic.batch_size=6",
                          "++evaluation.sets.code.synthetic.max_new_tokens=40",
                          "++evaluation.sets.code.synthetic.backend=hf"]).evaluation
    trained = trained_prompts(train)
    sets = eval_sets(evaluation, [], trained, writer(cfg, smollm2_path, tmp_path))
    from pipeline.data.prompts import prompt_key

    assert sets["code"] and not {prompt_key(c) for c in sets["code"]} & trained
