"""What a receiver is willing to accept: sizes, counts and lengths, checked while decoding.

These are the receiver's policy, not the wire format: a node may tighten them. Fixed
format bounds (64-char swarm ids, 2^31 token ids) live beside the fields they bound.
"""

from __future__ import annotations

from dataclasses import dataclass

from protocol.specs import MAX_CONFIG_BYTES


@dataclass(frozen=True)
class Limits:
    max_message_bytes: int = 1_000_000  # whole envelope; libp2p pubsub caps a message at 1 MiB, keep a margin
    max_questions: int = 64  # questions per RolloutBatch
    max_completions_per_question: int = 32  # completions per RolloutQuestion
    max_tokens_per_completion: int = 4096  # token ids (and logprobs) per RolloutCompletion
    max_string_chars: int = 16_384  # free texts: a completion's text
    max_name_chars: int = 256  # names: node ids, display/model names, versions, each address
    max_addresses: int = 16  # multiaddrs in a PeerStats
    max_clock_skew_s: float = 300.0  # |timestamp - receiver's clock| allowed before a message is stale

    def msgpack_limits(self) -> dict[str, int]:
        """Coarse caps handed to msgpack so that no length prefix can make it allocate more
        than some valid message could need; the exact per-field checks come afterwards.

        A spec config is JSON of at most MAX_CONFIG_BYTES, so none of its containers holds
        more items, and none of its strings more bytes, than that; a character is at most
        4 UTF-8 bytes.
        """
        items = max(
            self.max_questions,
            self.max_completions_per_question,
            self.max_tokens_per_completion,
            self.max_addresses,
            MAX_CONFIG_BYTES,
        )
        return {
            "max_str_len": max(4 * self.max_string_chars, 4 * self.max_name_chars, MAX_CONFIG_BYTES),
            "max_bin_len": self.max_message_bytes,
            "max_array_len": items,
            "max_map_len": items,
        }


DEFAULT_LIMITS = Limits()
