"""A rollout backend whose answers the test chooses: the node's real scorer then grades them."""

from __future__ import annotations

import threading
from collections.abc import Callable

from tests.helpers.common import CLI_TIMEOUT_S

from node.rollouts.base import Completion, RolloutBackend


class ScriptedBackend(RolloutBackend):
    """Answers training questions with the texts `script(backend, prompts, call) -> [n texts per prompt]` gives.

    Node(config, rollout_backend=ScriptedBackend.factory(script)) puts it where the sampler would be. The
    test tells it the questions' answers (`remember`); `right` and `wrong` then give a prompt's right answer
    and a wrong one. Prompts it was not told of (the held-out evaluation) get unscorable answers."""

    def __init__(self, tokenizer, script: Callable[["ScriptedBackend", list[str], int], list[list[str]]]):
        self.tokenizer = tokenizer
        self.script = script
        self.calls = 0
        self.answers: dict[str, str] = {}

    @classmethod
    def factory(cls, script) -> Callable:
        return lambda model, tokenizer, policy_version: cls(tokenizer, script)

    def remember(self, prompt_answers: dict[str, str]) -> None:
        self.answers.update(prompt_answers)

    def right(self, prompt: str) -> str:
        return self.answers[prompt]

    def wrong(self, prompt: str) -> str:
        return str(int(self.answers[prompt]) + 1)  # off by one: scores 0

    def generate(self, prompts: list[str], n: int, seed: int, greedy: bool = False) -> list[list[Completion]]:
        # not a training round's questions (the held-out evaluation)
        if not any(prompt in self.answers for prompt in prompts):
            texts = [["?"] * n for _ in prompts]
        else:
            texts = self.script(self, prompts, self.calls)
            self.calls += 1
        out = []
        for prompt, group in zip(prompts, texts):
            assert len(group) == n, f"the script gave {len(group)} answers for {n} samples"
            prompt_ids = self.tokenizer.encode(prompt, add_special_tokens=False)
            out.append(
                [
                    Completion(
                        prompt_ids,
                        self.tokenizer.encode(text, add_special_tokens=False) + [self.tokenizer.eos_token_id],
                        text,
                        None,
                        "stop",
                        policy_version=-1,
                    )
                    for text in group
                ]
            )
        return out

    def sync_weights(self, model, policy_version: int) -> None:
        pass


def hanging_node(config, hang_at_call: int):
    """A real, loaded Node whose `hang_at_call`-th training generation blocks (every other answers one right of
    four): (node, hanging, release), `hanging` set once it blocks, which lasts until the test sets `release`."""
    from node.loop import Node

    release, hanging = threading.Event(), threading.Event()

    def script(backend, prompts, call):
        if call == hang_at_call:
            hanging.set()
            release.wait(CLI_TIMEOUT_S)
        return [[backend.right(p), backend.wrong(p), backend.wrong(p), backend.wrong(p)] for p in prompts]

    node = Node(config, rollout_backend=ScriptedBackend.factory(script))
    node.load()  # the answers of the questions its rounds draw, for the backend to grade its texts
    node.backend.remember({node.tasks.prompt(q): q.answer for q in node.tasks.batch(first_draw=0, count=40)})
    return node, hanging, release
