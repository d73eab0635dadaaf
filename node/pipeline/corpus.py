"""The fixed offline corpus the pipeline's language-model objective trains on.

The CheckFree paper trains with a next-token loss on a fixed text corpus; we have no data
set to download, so the corpus is made here, deterministically, from the task mix:
"<prompt><answer><eos>" texts of questions drawn with `corpus_seed`, concatenated and cut
into sequences of `sequence_length` tokens (packing, no padding). The validation corpus
is made the same way from the held-out seed, so its questions never appear in training.
Every driver (and the benchmark) that uses the same config gets the same token ids.
"""

from __future__ import annotations

import torch

from node.config import NodeConfig
from node.tasks import TaskSource


def _pack(config: NodeConfig, tokenizer, seed: int, sequences: int) -> torch.Tensor:
    length = config.pipeline.sequence_length
    source = TaskSource(config.tasks, seed=seed).for_tokenizer(tokenizer)  # prompted as the node prompts this model
    stream: list[int] = []
    draw = 0
    while len(stream) < sequences * length:
        questions = source.batch(first_draw=draw, count=64)
        draw += len(questions)
        for question in questions:
            stream += tokenizer.encode(source.prompt(question) + question.answer, add_special_tokens=False) + [
                tokenizer.eos_token_id
            ]
    return torch.tensor(stream[: sequences * length], dtype=torch.long).view(sequences, length)


def training_corpus(config: NodeConfig, tokenizer) -> torch.Tensor:
    """[corpus_sequences, sequence_length] token ids."""
    return _pack(config, tokenizer, config.pipeline.corpus_seed, config.pipeline.corpus_sequences)


def validation_corpus(config: NodeConfig, tokenizer) -> torch.Tensor:
    """[validation_sequences, sequence_length] token ids from held-out questions."""
    return _pack(config, tokenizer, config.tasks.heldout_seed, config.pipeline.validation_sequences)


def micro_batch(corpus: torch.Tensor, step: int, index: int, size: int) -> torch.Tensor:
    """The `index`-th micro-batch of driver step `step`: a deterministic walk over the corpus."""
    start = ((step * 1_000_003 + index) * size) % corpus.shape[0]
    rows = [(start + k) % corpus.shape[0] for k in range(size)]
    return corpus[rows]
