"""Tiny random drafters of every algorithm for CPU unit tests (a 32-wide llama-shaped verifier, 50 tokens)."""

from __future__ import annotations

import torch

from pipeline.drafters import DRAFTERS
from pipeline.drafters.build import build_drafter
from pipeline.drafters.spec import DrafterSpec

HIDDEN, VOCAB = 32, 50
ALGORITHMS = sorted(DRAFTERS)


def tiny_options(algorithm: str = "peagle", **overrides):
    """The drafter's own options (its config_class) at their schema defaults, with 8 anchors a sample."""
    return DRAFTERS[algorithm].config_class(**{"max_anchors": 8, **overrides})


def tiny_spec(algorithm: str = "peagle", num_speculative_tokens: int = 4, draft_token_ids=None, **extra) -> DrafterSpec:
    layer = {"model_type": "llama", "hidden_size": HIDDEN, "intermediate_size": 64, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 8, "rms_norm_eps": 1e-6, "vocab_size": VOCAB,
             "max_position_embeddings": 256}
    cls = DRAFTERS[algorithm]
    defaults = {"causal_block": False, "markov_rank": 8, "norm_before_fc": False, "norm_output": False,
                "embed_requires_grad": False, "conv_kernel_size": 2, "conv_group_size": 16, "selector_rank": 8,
                "selector_top_k": 16}
    values = {**defaults, **extra}
    return DrafterSpec(algorithm=algorithm, verifier_name="tiny", verifier_path="-",
                       transformer_layer_config=cls.adapt_layer_config(layer), aux_layer_ids=[1, 2, 3],
                       num_speculative_tokens=num_speculative_tokens, mask_token_id=VOCAB - 1,
                       draft_token_ids=draft_token_ids,
                       extra={k: values[k] for k in cls.extra_keys})


def verifier_tensors(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(VOCAB, HIDDEN, generator=generator), torch.randn(VOCAB, HIDDEN, generator=generator)


def tiny_drafter(algorithm: str = "peagle", num_speculative_tokens: int = 4, **kwargs):
    torch.manual_seed(0)
    return build_drafter(tiny_spec(algorithm, num_speculative_tokens, **kwargs), verifier_tensors()).float()


def tiny_samples(count: int = 2, length: int = 24, prompt: int = 6, seed: int = 5) -> list[dict]:
    generator = torch.Generator().manual_seed(seed)
    return [{"aux": torch.randn(length, 3 * HIDDEN, generator=generator),
             "last": torch.randn(length, HIDDEN, generator=generator) * 3,
             "input_ids": torch.randint(0, VOCAB - 1, (length,), generator=generator),
             "loss_mask": torch.tensor([0] * prompt + [1] * (length - prompt))} for _ in range(count)]
