"""What one generate call yields besides completions: its statistics, its refusal, a turn's finish reason
(shared by the single-turn engine and the multi-turn turn loop)."""

from __future__ import annotations

from dataclasses import dataclass

from protocol.models import FinishReason


class LeaseNotGeneratable(ValueError):
    """The lease cannot be generated as asked (e.g. prompt + max_tokens exceed the model's length)."""


@dataclass
class GenerationStats:
    completions: int = 0
    tokens: int = 0
    seconds: float = 0.0  # wall time of `generate`, proofs included
    # Where the proof work went (worker side): recording rows in the model step (critical path), the
    # background proof thread (overlaps generation), and the final collection (critical path).
    capture_record_s: float = 0.0
    proof_thread_s: float = 0.0
    capture_take_s: float = 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.tokens / self.seconds if self.seconds > 0 else 0.0


def finish_reason(vllm_reason: str | None, num_tokens: int, max_tokens: int) -> FinishReason:
    if vllm_reason == "stop":
        return FinishReason.stop
    if vllm_reason == "length" and num_tokens == max_tokens:
        return FinishReason.length
    raise RuntimeError(f"unexpected vLLM finish reason {vllm_reason!r} after {num_tokens} tokens (max_tokens "
        f"{max_tokens})")
