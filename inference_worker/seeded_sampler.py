"""The seeded sampler inside vLLM: a logits processor that leaves each seeded row only its seed's winner.

Where it runs (vLLM 0.32 v1, `vllm/v1/sample/sampler.py`, `Sampler.forward`):
1. raw logprobs = log_softmax(logits) are computed first, from the unprocessed logits
   (`logprobs_mode="raw_logprobs"`, the default); the reported logprob of each sampled token comes
   from there, so what we do to the logits below never changes it;
2. the logits are cast to float32 and the processors that are *not* argmax-invariant run
   (`apply_logits_processors`); this is one of them, so it sees the raw float32 logits, before
   temperature, top-k and top-p, and it also runs for greedy requests;
3. then greedy requests take the argmax; random ones get temperature, top-k / top-p and vLLM's own
   exponential race.

Each of our requests reaches vLLM as a greedy request (temperature 0) whose `extra_args` carry the
lease's seed and (temperature, top_k, top_p). For those rows this processor computes the seeded draw of
`protocol.sampling` from the raw logits at position = offset + number of output tokens so far (offset: a
multi-turn episode's turn starts where it sits in the episode, 0 otherwise), and turns the row
into "-inf everywhere except the winner", so vLLM's argmax picks exactly that token. Nothing of vLLM's
own sampling (its per-request generators, temperature, top-k / top-p sort) runs for them, and there is
no second forward pass. The noise is counter-based, so a discarded draw (a chunked-prefill row) or a
preempted and resumed request needs nothing rewound.

vLLM builds one instance per model runner, in whatever process the runner lives in: pass the class by
its qualified name (`SEEDED_SAMPLER`) in `LLM(logits_processors=[...])` and it works in-process and in
multiprocess mode alike. Requests without our extra args are left alone.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
import torch
from vllm.v1.sample.logits_processor import BatchUpdate, LogitsProcessor, MoveDirectionality

from protocol import prf, sampling

if TYPE_CHECKING:
    from vllm import SamplingParams as VllmSamplingParams
    from vllm.config import VllmConfig

SEEDED_SAMPLER = "inference_worker.seeded_sampler:SeededSampler"
EXTRA_ARGS_KEY = "swarmrl_seeded"


def extra_args(seed: int, temperature: float, top_k: int, top_p: float, offset: int = 0) -> dict:
    """What a request carries for this processor (plain values: they cross vLLM's msgpack transport).

    `offset`: the draw position of the request's first output token. A multi-turn episode's later turns
    start at the turn's index in the episode, so environment tokens consume positions and no draw of one
    turn can be reused in another. 0 (single-turn) is sent as the 4-value form of before."""
    values = [int(seed), float(temperature), int(top_k), float(top_p)]
    return {EXTRA_ARGS_KEY: values + [int(offset)] if offset else values}


def _request_settings(params: "VllmSamplingParams") -> tuple[int, float, int, float, int] | None:
    args = (params.extra_args or {}).get(EXTRA_ARGS_KEY)
    if args is None:
        return None
    seed, temperature, top_k, top_p, *offset = args
    return int(seed), float(temperature), int(top_k), float(top_p), int(offset[0]) if offset else 0


class _Row:
    __slots__ = ("seed", "temperature", "top_k", "top_p", "offset", "output_ids")

    def __init__(self, settings: tuple[int, float, int, float, int], output_ids: list[int]):
        self.seed, self.temperature, self.top_k, self.top_p, self.offset = settings
        self.output_ids = output_ids  # vLLM's live list of this request's output tokens (a reference)


class _Layout:
    """Per-row state of the current seeded rows (device tensors, host seed states); rebuilt only when
    the batch changes."""

    def __init__(self, rows: dict[int, _Row], vocab_size: int, device: torch.device):
        self.indices = sorted(rows)
        self.rows = [rows[i] for i in self.indices]
        self.index_tensor = torch.tensor(self.indices, dtype=torch.int64, device=device)
        self.seed_states = prf.seed_state_np([r.seed for r in self.rows])
        self.offsets = np.fromiter((r.offset for r in self.rows), dtype=np.uint32, count=len(self.rows))
        self.params = sampling.DrawParams.build(
            [r.temperature for r in self.rows], [r.top_k for r in self.rows], [r.top_p for r in self.rows], vocab_size,
            device
        )


class SeededSampler(LogitsProcessor):
    """vLLM (V1 interface) logits processor: each seeded row becomes -inf except its seed's winner."""

    @classmethod
    def validate_params(cls, params: "VllmSamplingParams") -> None:
        """Refuse a malformed request before it reaches the engine core (vLLM calls this per request)."""
        args = (params.extra_args or {}).get(EXTRA_ARGS_KEY)
        if args is None:
            return
        if not (isinstance(args, (list, tuple)) and len(args) in (4, 5)):
            raise ValueError(f"{EXTRA_ARGS_KEY} must be [seed, temperature, top_k, top_p(, offset)], got {args!r}")
        seed, temperature, top_k, top_p, *offset = args
        if not 0 <= int(seed) < 2**63 or float(temperature) < 0 or not 0 < float(top_p) <= 1 or int(top_k) < -1 or (
            offset and not 0 <= int(offset[0]) < 2**31):
            raise ValueError(f"bad seeded-sampling settings {args!r}")
        if params.temperature != 0.0:
            raise ValueError("a seeded request must reach vLLM as greedy (temperature 0): this processor draws")

    def __init__(self, vllm_config: "VllmConfig", device: torch.device, is_pin_memory: bool):
        self.device = torch.device(device)
        self.rows: dict[int, _Row] = {}  # persistent-batch index -> row
        self.layout: _Layout | None = None
        self.token_words: torch.Tensor | None = None  # PRF words of the whole vocabulary, made once

    def is_argmax_invariant(self) -> bool:
        # It decides the argmax: it must run before greedy sampling too (vLLM's "non argmax-invariant").
        return False

    def update_state(self, batch_update: BatchUpdate | None) -> None:
        if not batch_update:
            return
        # vLLM's documented order: removed, then added, then moved.
        for index in batch_update.removed:
            self.rows.pop(index, None)
        for index, params, _, output_ids in batch_update.added:
            settings = _request_settings(params)
            if settings is None:
                self.rows.pop(index, None)
            else:
                self.rows[index] = _Row(settings, output_ids)
        for a, b, direction in batch_update.moved:
            row_a, row_b = self.rows.pop(a, None), self.rows.pop(b, None)
            if row_a is not None:
                self.rows[b] = row_a
            if row_b is not None and direction == MoveDirectionality.SWAP:
                self.rows[a] = row_b
        self.layout = None

    def apply(self, logits: torch.Tensor) -> torch.Tensor:
        if not self.rows:
            return logits
        batch, vocab = logits.shape
        if self.token_words is None or self.token_words.shape[0] != vocab:
            self.token_words = prf.token_words(torch.arange(vocab, device=self.device))
        layout = self.layout
        if layout is None:
            layout = self.layout = _Layout(self.rows, vocab, self.device)
        # Indices are sorted and distinct: they cover the batch iff there are `batch` of them ending at batch - 1.
        whole_batch = len(layout.indices) == batch and layout.indices[-1] == batch - 1
        # Row states on the host, where the positions are (tokens generated so far): a few numpy ops.
        positions = layout.offsets + np.fromiter((len(r.output_ids) for r in layout.rows), dtype=np.uint32,
            count=len(layout.rows))
        states = torch.from_numpy(prf.row_state_np(layout.seed_states, positions).astype(np.int64)).to(self.device,
            non_blocking=True)
        rows = logits if whole_batch else logits.index_select(0, layout.index_tensor)
        winners = sampling.draw(rows, states, self.token_words, layout.params).view(-1, 1)
        if whole_batch:
            logits.fill_(float("-inf")).scatter_(1, winners, 0.0)
        else:
            one_hot = torch.full_like(rows, float("-inf")).scatter_(1, winners, 0.0)
            logits.index_copy_(0, layout.index_tensor, one_hot)
        return logits

