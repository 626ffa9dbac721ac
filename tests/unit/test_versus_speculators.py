"""The pieces of benchmarks/versus_speculators.py that could silently change what their side trains: Muon's
orthogonalisation in fp32 and the packed row their trainer would build."""

from __future__ import annotations

import pytest
import torch

from benchmarks.versus_speculators import earlier_result, orthogonalize_in_fp32, record, their_batch
from pipeline.errors import PipelineError


@pytest.mark.parametrize("shape", [(96, 40), (40, 96)])
def test_orthogonalisation_in_fp32_is_torchs_muon_step_within_bf16(shape):
    from torch.optim import _muon

    grad = torch.randn(*shape, generator=torch.Generator().manual_seed(0))
    coefficients = (_muon.DEFAULT_A, _muon.DEFAULT_B, _muon.DEFAULT_C)
    theirs = _muon._zeropower_via_newtonschulz(grad, coefficients, _muon.DEFAULT_NS_STEPS, 1e-7)
    ours = orthogonalize_in_fp32(grad, coefficients, _muon.DEFAULT_NS_STEPS, 1e-7)
    assert ours.dtype == theirs.dtype == torch.bfloat16 and ours.shape == theirs.shape
    assert torch.allclose(ours.float(), theirs.float(), atol=0.02), (ours.float() - theirs.float()).abs().max()
    singular_values = torch.linalg.svdvals(ours.float())
    assert singular_values.min() > 0.4 and singular_values.max() < 1.6  # orthogonalised (Muon's S' ~ U(0.5, 1.5))


def sample(length: int, offset: int) -> dict:
    return {"input_ids": torch.arange(length) + offset, "aux": torch.randn(length, 6), "last": torch.randn(length, 2),
            "loss_mask": torch.tensor([0] * 2 + [1] * (length - 2))}


def test_two_documents_pack_into_one_row_shifted_as_their_eagle_trainer_shifts_them():
    batch = their_batch("peagle", [sample(5, 100), sample(4, 200)])
    assert batch["input_ids"].shape == (1, 7)  # each document loses one position to the shift
    assert batch["input_ids"][0].tolist() == [101, 102, 103, 104, 201, 202, 203]
    assert batch["document_ids"][0].tolist() == [0, 0, 0, 0, 1, 1, 1]
    assert batch["hidden_states"].shape == (1, 7, 6) and batch["verifier_last_hidden_states"].shape == (1, 7, 2)
    assert batch["position_ids"][0].tolist()[4] < batch["position_ids"][0].tolist()[3]  # restarts per document


def test_block_drafters_pack_without_a_shift():
    batch = their_batch("dflash", [sample(5, 100), sample(4, 200)])
    assert batch["input_ids"][0].tolist() == [100, 101, 102, 103, 104, 200, 201, 202, 203]
    assert batch["loss_mask"][0].tolist() == [0, 0, 1, 1, 1, 0, 0, 1, 1]


@pytest.mark.parametrize("algorithm", ["dflash", "dspark"])
def test_their_block_drafter_gets_the_same_loss_and_gradients_without_padding_anchors(algorithm, tmp_path,
                                                                                       tiny_verifier_path):
    """Lowering their max_anchors to the row's candidates (the benchmark's speed-up of their side) changes neither
    their loss nor a gradient: the blocks cut off were padding."""
    from transformers import AutoConfig

    from benchmarks.versus_speculators import build_theirs, their_call_kwargs, their_defaults, without_padding_anchors
    from pipeline.drafters import drafter_config
    from pipeline.drafters.build import build_drafter, make_spec, verifier_head_tensors
    from pipeline.export.speculators_format import export_speculators

    cfg = drafter_config(algorithm, num_speculative_tokens=3, **({"markov_rank": 8} if algorithm == "dspark" else {}))
    spec = make_spec(cfg, AutoConfig.from_pretrained(tiny_verifier_path), "tiny", tiny_verifier_path, 0)
    export = export_speculators(build_drafter(spec, verifier_head_tensors(tiny_verifier_path)), tmp_path / "ours")
    defaults = their_defaults(algorithm)
    model = build_theirs(algorithm, export, tiny_verifier_path, defaults, [])
    kwargs = their_call_kwargs(algorithm, model, defaults)
    assert kwargs["max_anchors"] == 512
    generator = torch.Generator().manual_seed(0)
    hidden, vocab = spec.hidden_size, spec.vocab_size
    samples = [{"input_ids": torch.randint(0, vocab, (length,), generator=generator),
                "aux": torch.randn(length, len(spec.aux_layer_ids) * hidden, generator=generator),
                "last": torch.randn(length, hidden, generator=generator),
                "loss_mask": torch.tensor([0] * 5 + [1] * (length - 5))} for length in (30, 22)]
    batch = their_batch(algorithm, samples)
    trimmed = without_padding_anchors(kwargs, batch["loss_mask"], model.block_size)
    assert trimmed["max_anchors"] == 25 + 17 - model.block_size  # loss positions but the row's last block

    def loss_and_grads(call):
        model.zero_grad()
        torch.manual_seed(1)
        loss = model(**batch, **call)[1]
        loss.backward()
        return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    padded_loss, padded_grads = loss_and_grads(kwargs)
    loss, grads = loss_and_grads(trimmed)
    assert torch.allclose(loss, padded_loss, rtol=1e-5), (loss, padded_loss)
    assert grads.keys() == padded_grads.keys() and grads
    for name, grad in grads.items():
        assert torch.allclose(grad, padded_grads[name], rtol=1e-4, atol=1e-6), name
    few = without_padding_anchors({**kwargs, "max_anchors": 4}, batch["loss_mask"], model.block_size)
    assert few["max_anchors"] == 4  # never more anchors than their setting


def test_update_keeps_other_records_and_never_replaces_a_measurement_with_a_failure(tmp_path):
    import json

    settings = {"root": "/r", "steps": 3, "eval_sets": ["code"], "prompts_per_set": 1, "max_new_tokens": 4,
                "overrides": []}
    measured = {"ours_over_theirs": {"code": 1.1}}
    out = tmp_path / "versus.json"
    out.write_text(json.dumps({**settings, "drafters": {"peagle": measured}, "recipe_trials": [{"tried": 1}]}))
    earlier = earlier_result(out, settings)
    assert earlier["recipe_trials"] == [{"tried": 1}]
    record(earlier, "peagle", {"error": "RuntimeError: boom"})
    assert earlier["drafters"]["peagle"]["ours_over_theirs"] == {"code": 1.1}
    assert earlier["drafters"]["peagle"]["last_error"] == "RuntimeError: boom"
    record(earlier, "dflash", {"error": "RuntimeError: boom"})  # nothing measured before: the failure is the result
    assert earlier["drafters"]["dflash"] == {"error": "RuntimeError: boom"}
    with pytest.raises(PipelineError, match="steps"):
        earlier_result(out, {**settings, "steps": 4})


@pytest.mark.parametrize("text, message", [
    ("[" * 100_000 + "]" * 100_000, "is not readable JSON (nested too deeply)"),
    ('{"drafters": ["peagle"]}', "'drafters' must map each drafter to its result"),
    ('{"drafters": {"peagle": 3}}', "'drafters' must map each drafter to its result"),
], ids=["nested_too_deeply", "drafters_a_list", "drafter_not_an_object"])
def test_update_refuses_a_file_it_cannot_add_to_in_one_line(tmp_path, text, message):
    out = tmp_path / "versus.json"
    out.write_text(text)
    with pytest.raises(PipelineError) as refused:
        earlier_result(out, {})
    assert message in str(refused.value) and "\n" not in str(refused.value)
