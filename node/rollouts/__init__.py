from node.rollouts.base import Completion, RolloutBackend


def build_rollout_backend(config, model, tokenizer, policy_version: int) -> RolloutBackend:
    """The backend named by `config.rollout.backend`, holding the given policy."""
    if config.rollout.backend == "transformers":
        from node.rollouts.transformers_backend import TransformersBackend

        return TransformersBackend(config.rollout, model, tokenizer, policy_version)
    from node.rollouts.vllm_backend import VLLMBackend

    return VLLMBackend(config, model, tokenizer, policy_version)


__all__ = ["Completion", "RolloutBackend", "build_rollout_backend"]
