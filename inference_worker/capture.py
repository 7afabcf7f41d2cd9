"""Runs inside vLLM's worker: captures final-norm hidden states during generation, builds proofs from
them while generation goes on, and hot-reloads weights.

This class is a vLLM *worker extension* (`LLM(worker_extension_cls=...)`): vLLM mixes it into its Worker,
in whatever process the worker lives in (our process in in-process mode, the engine core process in
multiprocess mode), and `llm.collective_rpc("<method>", args=...)` calls its methods by name. Arguments
and results are plain Python values and bytes, so the same calls work across processes; tensors never
cross a process boundary, only proofs (and, on request, raw hidden-state bytes for tests).

Capture: the model runner calls `model.compute_logits(h)` once per step
with the final-norm hidden states of exactly the positions sampled at that step, one row per scheduled
request, in the order of `model_runner.input_batch.req_ids`. We wrap `compute_logits` to keep each row,
keyed by the sequence position of the token it samples (`optimistic_seq_lens_cpu`: prompt + tokens so
far). A row of a partial (chunked) prefill samples a token that vLLM discards; its position lies inside
the prompt, so it is never used. No second forward pass is run.

Proofs are per 32-token chunk and chunks are independent, so as soon as a request has 32 new rows the
chunk goes to a background thread that builds its proof while vLLM keeps generating (vLLM's CPU worker
uses one torch thread; the proof thread's numpy / torch kernels release the GIL). At the end only the
last, partial chunk of each completion is left to build.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any

import numpy as np
import torch

log = logging.getLogger(__name__)

CHUNK = 32  # protocol.limits.PROOF_CHUNK_TOKENS (no protocol import here: this runs inside vLLM's worker)


def match_request(internal_id: str, external_ids: set[str]) -> str | None:
    """vLLM's engine id is the caller's request id plus "-<random suffix>"; map it back."""
    if internal_id in external_ids:
        return internal_id
    head = internal_id.rsplit("-", 1)[0]
    return head if head in external_ids else None


class _Request:
    __slots__ = ("prompt_len", "rows", "proofs")

    def __init__(self, prompt_len: int):
        self.prompt_len = prompt_len
        self.rows: dict[int, torch.Tensor] = {}  # completion token index -> hidden row
        self.proofs: dict[int, bytes] = {}  # chunk index -> proof of its 32 rows (built in the background)


class _ProofThread:
    """Builds proofs of full chunks handed over during generation, several chunks per call."""

    def __init__(self):
        self.jobs: queue.Queue = queue.Queue()
        self.error: BaseException | None = None
        self.busy_s = 0.0  # time spent building proofs (for the benchmark's breakdown)
        self._thread = threading.Thread(target=self._run, name="swarmrl-proofs", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        from verifier.proofs import build_proofs_many

        while True:
            batch = [self.jobs.get()]
            while True:
                try:
                    batch.append(self.jobs.get_nowait())
                except queue.Empty:
                    break
            started = time.perf_counter()
            try:
                built = build_proofs_many([rows for _, _, rows in batch])
                for (req, chunk, _), proofs in zip(batch, built):
                    req.proofs[chunk] = proofs[0]
            except BaseException as exc:  # surfaced by the next take
                self.error = exc
            finally:
                self.busy_s += time.perf_counter() - started
                for _ in batch:
                    self.jobs.task_done()


class HiddenStateCapture:
    """Worker extension. Method names carry a `swarmrl_` prefix: vLLM refuses names that clash with Worker's."""

    def swarmrl_capture_install(self) -> bool:
        """Wrap the model's `compute_logits` once; the capture stays off until `swarmrl_capture_start`."""
        runner = self.model_runner
        model = runner.model
        if getattr(model, "_swarmrl_capture", None) is not None:
            return True
        state: dict[str, Any] = {"on": False, "proofs": False, "requests": {}, "fallback": {}, "builder": None,
            "record_s": 0.0}
        original = model.compute_logits

        def compute_logits(hidden_states: torch.Tensor, *args, **kwargs):
            if state["on"]:
                started = time.perf_counter()
                _record(runner, state, hidden_states)
                state["record_s"] += time.perf_counter() - started
            return original(hidden_states, *args, **kwargs)

        model.compute_logits = compute_logits
        model._swarmrl_capture = state
        return True

    def _swarmrl_state(self) -> dict[str, Any]:
        state = getattr(self.model_runner.model, "_swarmrl_capture", None)
        if state is None:
            raise RuntimeError("hidden-state capture is not installed; call swarmrl_capture_install first")
        return state

    def swarmrl_capture_start(self, build_proofs: bool = True) -> None:
        state = self._swarmrl_state()
        state["requests"], state["fallback"] = {}, {}
        state["proofs"] = build_proofs
        state["record_s"] = 0.0
        if build_proofs and state["builder"] is None:
            state["builder"] = _ProofThread()
        if state["builder"] is not None:
            state["builder"].busy_s = 0.0
        state["on"] = True

    def swarmrl_capture_take(self, lengths: dict[str, list[int]], build_proofs: bool = True,
        return_hidden: bool = False) -> dict[str, Any]:
        """Stop capturing; return `{"requests": {request id: {"proofs": [...], ("hidden", "shape")}}, "stats": {...}}`.

        `lengths[request_id] = [prompt_tokens, completion_tokens]`. Row t of a request's hidden states
        [T, H] is the one that sampled completion token t (sequence position prompt_tokens + t).
        `stats`: seconds spent recording rows during generation, in the background proof thread, and
        in this call (all on the worker's side).
        """
        take_started = time.perf_counter()
        state = self._swarmrl_state()
        state["on"] = False
        requests, fallback = state["requests"], state["fallback"]
        state["requests"], state["fallback"] = {}, {}
        builder: _ProofThread | None = state["builder"]
        if builder is not None:
            builder.jobs.join()  # chunks handed over during generation are done
            if builder.error is not None:
                err, builder.error = builder.error, None
                raise RuntimeError(f"proof building failed: {err}") from err
        wanted = set(lengths)
        by_id: dict[str, _Request] = {}
        rows_fallback: dict[str, list[torch.Tensor]] = {}
        for internal, req in requests.items():
            rid = match_request(internal, wanted)
            if rid is not None:
                by_id[rid] = req
        for internal, rows in fallback.items():
            rid = match_request(internal, wanted)
            if rid is not None:
                rows_fallback[rid] = rows

        hidden: dict[str, torch.Tensor] = {}
        for rid, (prompt_len, num_tokens) in lengths.items():
            req = by_id.get(rid)
            if req is not None:
                missing = [t for t in range(num_tokens) if t not in req.rows]
                if missing:
                    raise RuntimeError(f"request {rid}: no hidden state captured for tokens {missing[:5]}")
                hidden[rid] = torch.stack([req.rows[t] for t in range(num_tokens)])
            else:
                # No position information (another vLLM version): the last T rows; chunked prefill may
                # have added discarded rows before them.
                got = rows_fallback.get(rid, [])
                if len(got) < num_tokens:
                    raise RuntimeError(f"request {rid}: captured {len(got)} hidden states for {num_tokens} tokens")
                hidden[rid] = torch.stack(got[len(got) - num_tokens :])

        out: dict[str, dict[str, Any]] = {rid: {} for rid in lengths}
        if build_proofs:
            from verifier.proofs import build_proofs_many

            # Chunks not proven during generation: each completion's last (partial) chunk, a chunk that
            # took a row the engine then discarded, or everything without position information.
            todo: list[tuple[str, int, torch.Tensor]] = []
            for rid, (_, num_tokens) in lengths.items():
                req = by_id.get(rid)
                for chunk in range((num_tokens + CHUNK - 1) // CHUNK):
                    full = (chunk + 1) * CHUNK <= num_tokens
                    if not (req is not None and full and chunk in req.proofs):
                        todo.append((rid, chunk, hidden[rid][chunk * CHUNK : (chunk + 1) * CHUNK]))
            built = build_proofs_many([rows for _, _, rows in todo]) if todo else []
            late = {(rid, chunk): proofs[0] for (rid, chunk, _), proofs in zip(todo, built)}
            for rid, (_, num_tokens) in lengths.items():
                req = by_id.get(rid)
                out[rid]["proofs"] = [
                    late[(rid, chunk)] if (rid, chunk) in late else req.proofs[chunk]
                    for chunk in range((num_tokens + CHUNK - 1) // CHUNK)
                ]
        if return_hidden:
            for rid, h in hidden.items():
                h32 = h.float().cpu().contiguous()
                out[rid]["hidden"] = h32.numpy().tobytes()
                out[rid]["shape"] = list(h32.shape)
        stats = {
            "record_s": state["record_s"],
            "proof_thread_s": builder.busy_s if builder is not None else 0.0,
            "take_s": time.perf_counter() - take_started,
        }
        return {"requests": out, "stats": stats}

    def swarmrl_reload(self, weights_path: str | None = None, weights: list | None = None) -> None:
        """Load `*.safetensors` from `weights_path`, or (in-process only) `weights` = [(name, tensor)], into
        the running model, in place.

        vLLM's CPU build repacks linear weights into oneDNN GEMMs. With tied embeddings the reload
        updates `embed_tokens` but leaves the lm_head's packed GEMM holding the old matrix (a bug of the
        CPU build), so we repack the lm_head from the (shared, reloaded) weight.
        """
        from vllm.config import set_current_vllm_config

        if weights is not None:
            self.reload_weights(weights_iterator=iter(weights))
        elif self.vllm_config.load_config.load_format == "dummy":
            # An engine started on dummy weights (a base model folder without weights, base_model.py): vLLM's
            # dummy loader cannot read a path, so the tensors are read here.
            self.reload_weights(weights_iterator=_safetensors_tensors(weights_path))
        else:
            self.reload_weights(weights_path=weights_path)
        model = self.model_runner.model
        if getattr(model.config, "tie_word_embeddings", False) and hasattr(model, "lm_head"):
            head = model.lm_head
            method = getattr(head, "quant_method", None)
            if method is not None and hasattr(method, "process_weights_after_loading"):
                with set_current_vllm_config(self.vllm_config):
                    method.process_weights_after_loading(head)

    def swarmrl_hidden_size(self) -> int:
        return int(self.model_runner.model.config.hidden_size)


def _safetensors_tensors(folder: str | None):
    from pathlib import Path

    from safetensors import safe_open

    if not folder:
        raise ValueError("an engine on dummy weights reloads from a version folder, and none was given")
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)


def _record(runner, state: dict[str, Any], hidden_states: torch.Tensor) -> None:
    """One model step: file each sampled row under its request and completion-token index."""
    n = int(hidden_states.shape[0])
    ids = runner.input_batch.req_ids[:n]
    seq_lens = getattr(runner, "optimistic_seq_lens_cpu", None)
    rows = hidden_states.detach().clone()
    if seq_lens is None or len(ids) != n:
        for i, rid in enumerate(ids):
            state["fallback"].setdefault(rid, []).append(rows[i])
        return
    # The token sampled from row i lands at position seq_len (= tokens in the sequence before it).
    positions = seq_lens[:n].tolist()
    requests: dict[str, _Request] = state["requests"]
    builder: _ProofThread | None = state["builder"] if state["proofs"] else None
    for i, rid in enumerate(ids):
        req = requests.get(rid)
        if req is None:
            cached = runner.requests.get(rid)
            if cached is None:
                continue
            req = requests[rid] = _Request(int(cached.num_prompt_tokens))
        t = positions[i] - req.prompt_len
        if t < 0:
            continue  # a partial prefill chunk: vLLM discards this sample
        req.rows[t] = rows[i]
        if builder is not None and (t + 1) % CHUNK == 0:
            chunk = t // CHUNK
            start = chunk * CHUNK
            if all(s in req.rows for s in range(start, t + 1)):
                builder.jobs.put((req, chunk, torch.stack([req.rows[s] for s in range(start, t + 1)])))


def hidden_from_bytes(entry: dict[str, Any]) -> torch.Tensor:
    """Inverse of `return_hidden=True` in `swarmrl_capture_take`: float32 [T, H]."""
    return torch.from_numpy(np.frombuffer(entry["hidden"], dtype=np.float32).reshape(entry["shape"]).copy())
