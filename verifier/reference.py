"""The trusted recomputation: one transformers prefill (teacher forcing) over prompt + completion.

For a completion of T tokens after a prompt of P tokens, the model runs over prompt + completion[:-1]
(the last token's own hidden state never produced anything) and row t of the result is the position
P-1+t: the final-norm hidden state that produced completion token t, and its next-token distribution.
Several sequences share one forward pass, right-padded: with a causal mask, padding at the end never
changes the real positions.
"""

from __future__ import annotations

import functools
import json
import logging
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch

from protocol.models import SamplingParams
from protocol.sampling import replay
from verifier.checks import Draw, TokenStats, token_stats

log = logging.getLogger(__name__)

_STATS_ROWS = 2048
DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class Prefill:
    hidden: torch.Tensor  # [T, H], model dtype: final-norm hidden states that produced each token
    stats: TokenStats  # per token logprob / support statistics
    draw: Draw | None = None  # with seeds: every draw replayed


def load_reference_model(config_dir: Path, weights_dir: Path | None, dtype: str = "float32", device: str = "cpu"):
    """A transformers causal LM on `device`: architecture from `config_dir` (or `weights_dir` if it has a
    config.json), weights from the `*.safetensors` in `weights_dir` (tensor names as transformers).
    A LoRA adapter version in `weights_dir` is applied to the base model in `config_dir` (`load_adapted`)."""
    from safetensors import safe_open
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardcast.adapter import is_adapter

    if dtype not in DTYPES:
        raise ValueError(f"unknown dtype {dtype!r}; choose one of {sorted(DTYPES)}")
    config_dir = Path(config_dir)
    if weights_dir is not None and is_adapter(weights_dir):
        return load_adapted(config_dir, Path(weights_dir), dtype, device)
    source = Path(weights_dir) if weights_dir is not None and (Path(
        weights_dir) / "config.json").exists() else config_dir
    config = AutoConfig.from_pretrained(source)
    if weights_dir is None:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=DTYPES[dtype]).to(device)
    else:
        files = sorted(Path(weights_dir).glob("*.safetensors"))
        if not files:
            raise FileNotFoundError(f"no *.safetensors in {weights_dir}")
        published = (Path(weights_dir) / "manifest.json").is_file()
        # Built in the compute dtype and filled one tensor at a time: a float32 build cast down, from a state
        # read whole, held three copies (5-6 GB at 0.6B in bf16), and the cast rounded the rotary
        # frequencies (`to_dtype`). Copying rounds float32 weights as a cast would.
        model = AutoModelForCausalLM.from_config(config, dtype=DTYPES[dtype])
        params, unexpected, loaded = model.state_dict(), [], set()
        with torch.no_grad():
            for f in files:
                with safe_open(str(f), framework="pt") as st:
                    for name in st.keys():
                        t = st.get_tensor(name)
                        if published:
                            _check_published_precision({name: t}, DTYPES[dtype], weights_dir)
                        if name not in params or params[name].shape != t.shape:
                            unexpected.append(name)
                        else:
                            params[name].copy_(t)
                            loaded.add(name)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        missing = [k for k in params if k not in loaded and not (tied and k == "lm_head.weight")
            and not k.endswith("inv_freq")]
        if missing or unexpected:
            raise ValueError(f"weights in {weights_dir} do not fit the model: missing {missing[:5]}, unexpected "
                f"{unexpected[:5]}")
        if tied:
            model.tie_weights()
    model = to_dtype(model, DTYPES[dtype], device)
    model.eval()
    return model


def to_dtype(model: torch.nn.Module, dtype: torch.dtype, device: str) -> torch.nn.Module:
    """The model's weights in `dtype` on `device`, its rotary inverse frequencies left in float32, as vLLM
    computes its cos/sin cache and as transformers builds them. `Module.to` would round them too: in bf16
    by up to 2^-9, turning position p by up to p x 2^-9 x inv_freq radians. (On the 0.6B model with 4
    pretraining steps, whose attention barely uses position, the logprobs over 600 tokens moved by < 0.01.)"""
    keep = {name: buf.detach().clone() for name, buf in model.named_buffers() if name.endswith("inv_freq")
        and buf.dtype == torch.float32}
    model = model.to(device=device, dtype=dtype)
    for name, buf in keep.items():
        owner, _, attr = name.rpartition(".")
        model.get_submodule(owner)._buffers[attr] = buf.to(device)
    return model


@functools.lru_cache(maxsize=4)
def _base_hash(base_dir: str) -> str:
    from shardcast.adapter import base_model_hash

    return base_model_hash(base_dir)


def load_adapted(base_dir: Path, adapter_dir: Path, dtype: str = "float32", device: str = "cpu"):
    """The base model in `base_dir` with the LoRA adapter version in `adapter_dir` merged in by peft
    (W + alpha/r * B A, in float32, then cast to `dtype`). The adapter must name this base's model hash:
    one trained on another base is refused, never verified against the wrong weights."""
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    from shardcast.adapter import load_version, unpack_adapter, write_peft_dir

    state = load_version(adapter_dir)
    _, _, base_hash = unpack_adapter(state)
    if base_hash != _base_hash(str(Path(base_dir).resolve())):
        raise ValueError(f"the adapter in {adapter_dir} is for base model {base_hash[:12]}..., not the base in "
            f"{base_dir}")
    if (Path(adapter_dir) / "manifest.json").is_file():
        _check_published_precision(state, DTYPES[dtype], adapter_dir)
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float32)
    with tempfile.TemporaryDirectory(prefix="swarmrl-adapter-") as tmp:
        model = PeftModel.from_pretrained(base, write_peft_dir(state, Path(tmp)), is_trainable=False).merge_and_unload()
    model = to_dtype(model, DTYPES[dtype], device)
    model.eval()
    return model


def _check_published_precision(state: dict[str, torch.Tensor], dtype: torch.dtype, weights_dir: Path) -> None:
    """A shardcast version is checked at its published precision: a dtype that rounds the signed weights
    (e.g. verifying float32 weights in bfloat16) would check other weights than the ones workers received."""
    for name, t in state.items():
        if t.is_floating_point() and t.dtype != dtype and not (dtype == torch.float32 and t.dtype in (torch.bfloat16,
            torch.float16)):
            raise ValueError(
                f"verifier dtype {dtype} would round the published {t.dtype} weights of {weights_dir} ({name}); "
                f"verify in {t.dtype} (or float32), or publish in {dtype} (trainer.publish_dtype)"
            )


def eos_token_ids(config_dir: Path) -> set[int]:
    """Every id that ends a generation: config / generation_config / tokenizer EOS ids."""
    ids: set[int] = set()
    for name in ("generation_config.json", "config.json"):
        p = Path(config_dir) / name
        if p.exists():
            value = json.loads(p.read_text()).get("eos_token_id")
            if isinstance(value, int):
                ids.add(value)
            elif isinstance(value, list):
                ids.update(int(v) for v in value)
    return ids


@torch.inference_mode()
def prefill(
    model,
    sequences: Sequence[tuple[np.ndarray, np.ndarray]],
    sampling: Sequence[SamplingParams],
    max_batch_tokens: int = 16384,
    pad_id: int = 0,
    seeds: Sequence[int] | None = None,
    draw_slack: tuple[float, float, float] = (0.0, 0.0, 0.0),
    draw_margin: tuple[float, float] | None = None,
) -> list[Prefill]:
    """Hidden states and token statistics for each (prompt_ids, completion_ids), batched by length; with
    `seeds` (one per sequence) also the replay of every seeded draw (protocol.sampling.replay with
    `draw_slack` = (top_p_slack, logit_slack, slack_rel)), its margins in logit units, and with `draw_margin`
    = (margin, margin_rel) the positions where more than one token would pass."""
    device = model.lm_head.weight.device  # the model's; only per-token results come back to the host
    lengths = [len(p) + len(c) - 1 for p, c in sequences]
    order = sorted(range(len(sequences)), key=lambda i: lengths[i])
    results: list[Prefill | None] = [None] * len(sequences)
    batch: list[int] = []

    def run(batch: list[int]) -> None:
        width = max(lengths[i] for i in batch)
        ids = torch.full((len(batch), width), pad_id, dtype=torch.long)
        for row, i in enumerate(batch):
            p, c = sequences[i]
            seq = np.concatenate([np.asarray(p, dtype=np.int64), np.asarray(c, dtype=np.int64)[:-1]])
            ids[row, : len(seq)] = torch.from_numpy(seq)
        hidden = model.model(input_ids=ids.to(device)).last_hidden_state  # final norm applied
        rows = {i: hidden[row, len(sequences[i][0]) - 1 : len(sequences[i][0]) - 1 + len(sequences[i][1])] for row,
            i in enumerate(batch)}
        # Token statistics and draws of every completion that shares its sampling settings at once, in
        # slices of rows so that the logits of long completions over a large vocabulary stay small.
        groups: dict[tuple[float, int, float], list[int]] = {}
        for i in batch:
            groups.setdefault((sampling[i].temperature, sampling[i].top_k, sampling[i].top_p), []).append(i)
        for members in groups.values():
            h = torch.cat([rows[i] for i in members])
            tokens = torch.from_numpy(np.concatenate([np.asarray(sequences[i][1], dtype=np.int64)
                for i in members])).to(device)
            row_seeds = row_positions = None
            if seeds is not None:
                row_seeds = np.concatenate([np.full(len(sequences[i][1]), seeds[i], dtype=np.int64) for i in members])
                row_positions = np.concatenate([np.arange(len(sequences[i][1]), dtype=np.int64) for i in members])
            params = sampling[members[0]]
            to_logits = params.temperature if params.temperature > 0 else 1.0  # score units -> logits
            parts, draws = [], []
            for s in range(0, h.shape[0], _STATS_ROWS):
                logits = model.lm_head(h[s : s + _STATS_ROWS]).float()
                part_tokens = tokens[s : s + _STATS_ROWS]
                parts.append(token_stats(logits, part_tokens, params))
                if row_seeds is not None:
                    r = replay(logits, row_seeds[s : s + _STATS_ROWS], row_positions[s : s + _STATS_ROWS], part_tokens,
                               params, *draw_slack, *(draw_margin or (None, 0.0)))
                    scale = torch.maximum(logits.gather(1, r.winner.view(-1, 1)).abs(), logits.gather(1,
                        part_tokens.view(-1, 1)).abs()).view(-1)
                    draws.append(Draw(r.winner.cpu().numpy(), r.margin.double().cpu().numpy() * to_logits,
                                      r.inside.cpu().numpy(), scale.double().cpu().numpy(), r.exact.cpu().numpy(), None
                                      if r.choice is None else r.choice.cpu().numpy()))
            stats = TokenStats.concat(parts)
            draw = Draw.concat(draws) if draws else None
            offset = 0
            for i in members:
                n = len(sequences[i][1])
                results[i] = Prefill(hidden=rows[i].clone(), stats=stats.slice(offset, offset + n),
                                     draw=draw.slice(offset, offset + n) if draw is not None else None)
                offset += n

    for i in order:
        if batch and (len(batch) + 1) * max(lengths[j] for j in batch + [i]) > max_batch_tokens:
            run(batch)
            batch = []
        batch.append(i)
    if batch:
        run(batch)
    return results  # type: ignore[return-value]

