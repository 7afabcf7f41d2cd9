"""The trainer: staleness filter, packed micro-batches, the decoupled PPO step, publishing, checkpoints.

One call to `Trainer.step(samples)` is one batch of verified samples, read top to bottom:
  1. filter stale: drop samples more than `max_staleness` versions behind (counted, never trained on);
  2. plan: split the rest into `mini_batches` optimizer steps, each packed into micro-batches within the
     token budget (gradient accumulation over micro-batches);
  3. proximal and reference logprobs, with the weights at the start of the call (no grad);
  4. optimizer steps: forward/backward (bf16 autocast optional), grad-norm clip, AdamW, LR schedule; a
     non-finite loss or gradient norm skips the step (counted; the weights never see it);
  5. publish: version += 1 per optimizer step taken (version N = the weights after N optimizer steps);
  6. checkpoint every `checkpoint_every` versions.
Its pieces: the model and its logprobs (policy_model.py), the plan of micro-batches (packing.py), the loss
and the step's metrics (loss.py), AdamW and the LR schedule (optimizer.py), calls all ranks make (ranks.py).

With `defer_io=True` (the batch loop's background writer, trainer/background.py), steps 5 and 6 only take
copies of the state (`pending_publish`, `pending_checkpoint`) and the writer publishes and checkpoints
them while the next step trains.

"No proximal" (None) has one meaning: the weights have not moved since the start of the call, so the
proximal logprobs are the detached logprobs of the training forward itself (the same numbers as a
separate no-grad pass, for one forward less). That is always true of the first optimizer step.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections import Counter
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch import nn

from protocol import staleness
from trainer import checkpoint as ckpt
from trainer import distributed as dist_utils
from trainer.config import TrainerConfig
from trainer.loss import STAT_KEYS, ppo_loss, step_metrics
from trainer.optimizer import make_optimizer
from trainer.packing import MicroBatch, plan_micro_batches
from trainer.policy_model import forward_logprobs, load_model
from trainer.ranks import collective
from trainer.samples import TrainSample

log = logging.getLogger(__name__)

# Publishes (version, weights) and returns the published version's model hash (or None if it has none).
PublishFn = Callable[[int, Mapping[str, torch.Tensor]], "str | None"]


class Trainer:
    def __init__(
        self,
        config: TrainerConfig,
        model_dir: Path,
        run_dir: Path,
        publish: PublishFn | None = None,
        *,
        resume: bool = True,
        sampling_temperature: float = 1.0,
        defer_io: bool = False,
    ) -> None:
        """`sampling_temperature`: the workers' (the leases'); every logprob of the loss is of logits / T,
        as the verifier's behaviour logprobs are (greedy, T = 0, counts as 1)."""
        self.config = config
        self.temperature = sampling_temperature if sampling_temperature > 0 else 1.0
        self.defer_io = defer_io
        self.pending_publish: list[tuple[int, dict[str, torch.Tensor]]] = []  # (version, weights) for the writer
        self.pending_checkpoint: dict[str, Any] | None = None  # save_checkpoint's arguments, for the writer
        # Whether a checkpoint's state is copied: only for a background writer, which reads it while the next
        # step trains (the batch loop decides). At 0.6B the copy is ~7 GB: fp32 weights and AdamW's moments.
        self.snapshot_copies = defer_io
        self.model_dir = Path(model_dir)
        self.run_dir = Path(run_dir)
        self.publish_fn = publish
        # Rank 0 of a Ray group announces its collective calls through this (trainer/ranks.py); else None.
        self.announce: Callable[[str, tuple], None] | None = None
        self._in_collective = False
        self._shard_writes = 0  # names each checkpoint's folder of optimizer shards alike on every rank
        if config.num_threads:
            torch.set_num_threads(config.num_threads)
        self.device = dist_utils.local_device(
            ("cuda" if torch.cuda.is_available() else "cpu") if config.device == "auto" else config.device
        )
        self.env = dist_utils.init_from_env(self.device)
        self.ckpt_root = ckpt.checkpoint_root(self.run_dir)
        if self.env.is_main:
            ckpt.remove_partial(self.ckpt_root)
        latest = ckpt.latest_checkpoint(self.ckpt_root) if resume else None
        latest = dist_utils.broadcast_object(latest, self.env)  # every rank resumes from rank 0's choice

        torch.manual_seed(config.seed)
        model = load_model(self.model_dir, self.device, config.attention)
        self.model_config = model.config
        # LoRA: adapters on the frozen base, trained in place (self.model stays the transformers module);
        # `self.peft` extracts the adapter that each version publishes, bound to the base's model hash.
        self.peft = None
        if config.lora.enabled:
            from trainer import lora

            if self.env.enabled:
                raise NotImplementedError("trainer.lora runs on one rank (the N-rank trainer trains the full model)")
            self.base_hash = lora.base_hash(self.model_dir)
            self.peft = lora.attach(model, config.lora)
        self.reference: nn.Module | None = None
        if config.loss.kl_coef > 0:
            # The frozen reference is the base model; every rank holds a full copy (forward only).
            self.reference = load_model(self.model_dir, self.device, config.attention).eval().requires_grad_(False)
        self.model = dist_utils.wrap_model(model, self.env, config.distributed, self.device)
        self.model.train()
        self.optimizer, self.scheduler = make_optimizer(self.model, config)
        self.version = 0
        self.published_version = -1
        self.last_published: dict[int, str] = {}  # versions the last step published -> model hash
        self.last_staleness: staleness.StalenessTally | None = None  # what the last step trained and dropped
        self.data_cursor: dict[str, Any] = {}
        self.totals: Counter[str] = Counter()
        if latest is not None:
            self._load(latest)
        elif self.publish_fn is not None:
            self._publish(now=True)  # version 0: the base model, before anything can ask for it

    # ---------------------------------------------------------------- resume / checkpoints

    @classmethod
    def resume(cls, config: TrainerConfig, run_dir: Path, publish: PublishFn | None = None,
        sampling_temperature: float = 1.0) -> "Trainer":
        """A trainer restored from the latest checkpoint in run_dir (raises if there is none)."""
        latest = ckpt.latest_checkpoint(ckpt.checkpoint_root(Path(run_dir)))
        if latest is None:
            raise FileNotFoundError(f"no checkpoint under {ckpt.checkpoint_root(Path(run_dir))}")
        _, _, state = ckpt.read_checkpoint(latest)
        return cls(config, Path(state["base_model_dir"]), run_dir, publish, resume=True,
            sampling_temperature=sampling_temperature)

    def _load(self, path: Path) -> None:
        model_state, train_state, trainer_state = ckpt.read_checkpoint(path)
        dist_utils.load_full_state(self.model, self.optimizer, model_state, train_state.get("optimizer"), self.env)
        if "optimizer" not in train_state:  # written by a group of ranks: each reads its shard
            dist_utils.load_optimizer_shards(self.model, self.optimizer, Path(path) / ckpt.OPTIMIZER_DIR)
        self.scheduler.load_state_dict(train_state["scheduler"])
        ckpt.set_rng_state(train_state["rng"])
        self.version = int(trainer_state["step"])
        self.published_version = int(trainer_state["published_version"])
        self.data_cursor = dict(trainer_state.get("data_cursor", {}))
        self.totals = Counter(trainer_state.get("totals", {}))
        log.info("resumed", extra={"checkpoint": str(path), "version": self.version})

    @collective
    def save_checkpoint(self) -> Path | None:
        """Write a checkpoint of the current state (rank 0 writes; every rank must call it)."""
        state = self.checkpoint_state()
        return ckpt.save_checkpoint(**state) if state is not None else None

    @collective
    def checkpoint_state(self) -> dict[str, Any] | None:
        """`checkpoint.save_checkpoint`'s arguments for the current state, as copies that the next step
        cannot change (every rank takes part; None off rank 0)."""
        # the model/ folder: exportable, loads anywhere
        model_state = dist_utils.full_model_state(self.model, self.env, copy=self.snapshot_copies)
        train_state: dict[str, Any] = {"scheduler": self.scheduler.state_dict(), "rng": ckpt.rng_state()}
        shards = None
        if self.env.enabled:
            # No rank gathers the whole optimizer state (twice the model): each writes its own shard now,
            # into a folder that rank 0's checkpoint takes in when it is written (in the background).
            self._shard_writes += 1
            shards = self.ckpt_root / f"{ckpt.SHARDS_PREFIX}{self.version:08d}-{self._shard_writes}"
            dist_utils.save_optimizer_shards(self.model, self.optimizer, shards)
        else:
            train_state["optimizer"] = self.optimizer.state_dict()
        if not self.env.is_main:
            return None
        return dict(
            root=self.ckpt_root,
            step=self.version,
            model_state=model_state,  # full_model_state made it a CPU copy already
            model_config=self.model_config,
            base_model_dir=self.model_dir,
            train_state=ckpt.detached_copy(train_state) if self.snapshot_copies else train_state,
            optimizer_shards=shards,
            trainer_state=copy.deepcopy({
                "step": self.version,
                "published_version": self.published_version,
                "data_cursor": self.data_cursor,
                "base_model_dir": str(self.model_dir.resolve()),
                "totals": dict(self.totals),
                **({"lora": {"rank": self.config.lora.rank, "alpha": self.config.lora.alpha}} if self.peft is not None
                else {}),
            }),
            keep=self.config.keep_checkpoints,
        )

    @collective
    def state_dict_for_publish(self) -> dict[str, torch.Tensor]:
        """The weights as published: a cast of the float32 master to `publish_dtype` (a fresh copy); with
        LoRA, the adapter version (adapter tensors, config and base hash; trainer/lora.py)."""
        if self.peft is not None:
            from trainer import lora

            return lora.adapter_state(self.peft, self.base_hash, getattr(torch, self.config.publish_dtype))
        state = dist_utils.full_model_state(self.model, self.env)
        state = ckpt.publishable_state(state, getattr(self.model_config, "tie_word_embeddings", False))
        if self.config.publish_dtype != "float32":
            from shardcast.precision import cast_for_publishing

            state = cast_for_publishing(state, getattr(torch, self.config.publish_dtype))
        return state

    def export(self, out_dir: Path) -> Path:
        """Write the current weights as a plain transformers folder (via a checkpoint of this version)."""
        latest = ckpt.latest_checkpoint(self.ckpt_root)
        if latest is None or latest.name != f"step_{self.version:08d}":
            latest = self.save_checkpoint()
        if not self.env.is_main:
            return Path(out_dir)
        return ckpt.export_checkpoint(latest, out_dir)

    def _publish(self, now: bool = False) -> float:
        if self.publish_fn is None:
            return 0.0
        t = time.perf_counter()
        state = self.state_dict_for_publish()
        if self.defer_io and not now:  # the writer publishes it (full_model_state made a CPU copy)
            if self.env.is_main:
                self.pending_publish.append((self.version, state))
            self.published_version = self.version
            return time.perf_counter() - t
        if self.env.is_main:
            model_hash = self.publish_fn(self.version, state)
            self.last_published[self.version] = model_hash if isinstance(model_hash, str) else ""
        self.published_version = self.version
        return time.perf_counter() - t

    # ---------------------------------------------------------------- the step

    @collective
    def step(self, samples: Sequence[TrainSample]) -> dict[str, float]:
        """Train on one batch of verified samples; returns metrics. Every rank passes the same samples.
        The versions it publishes, with their model hashes, are in `last_published`; what it trained and
        dropped as stale, by version gap, in `last_staleness` (the batch loop reports that, not a recount)."""
        t_start = time.perf_counter()
        cfg = self.config
        start_version = self.version
        self.last_published = {}

        # 1. Drop samples more than max_staleness versions behind (counted, never trained on).
        kept, metrics = self._filter_stale(samples, start_version)
        if not kept:
            log.warning("no sample within max_staleness; no optimizer step", extra={"dropped": len(samples)})
            metrics.update(version=float(self.version), **{"time/compute": time.perf_counter() - t_start})
            return metrics
        metrics["reward/mean"] = float(np.mean([s.reward for s in kept]))

        # 2. One plan of packed micro-batches per optimizer step.
        n_steps = min(cfg.mini_batches, len(kept))
        plans = [plan_micro_batches([kept[i] for i in chunk], cfg, self.env, self.device)
            for chunk in np.array_split(np.arange(len(kept)), n_steps)]

        # 3. Proximal logprobs: the weights at the start of the step. For the first optimizer step they are
        #    the current weights, so the training forward's own detached logprobs serve (None); later
        #    steps need them computed now, before the weights move. Reference logprobs for the KL term.
        proximal = [None] + [[self._logprobs_no_grad(self.model, mb) for mb in plan] for plan in plans[1:]]
        reference = [[self._logprobs_no_grad(self.reference, mb) for mb in plan]
            for plan in plans] if self.reference is not None else None

        # 4. Optimizer steps; 5. each one publishes a version (unless its gradient was not finite).
        sums: Counter[str] = Counter()
        iw_max, tokens, time_publish, skipped = 0.0, 0, 0.0, 0
        for k, plan in enumerate(plans):
            step_sums, step_iw_max, step_tokens, stepped = self._optimizer_step(plan, proximal[k], reference[k]
                if reference else None)
            sums.update(step_sums)
            iw_max, tokens = max(iw_max, step_iw_max), tokens + step_tokens
            if not stepped:
                skipped += 1
                continue
            self.version += 1
            time_publish += self._publish()
        self.totals["optimizer_steps_skipped"] += skipped
        metrics.update(step_metrics(sums, n_steps, iw_max, tokens))
        metrics.update({"version": float(self.version), "optimizer_steps": float(n_steps - skipped),
            "optimizer_steps_skipped": float(skipped), "time/publish": time_publish})
        compute = time.perf_counter() - t_start - time_publish
        metrics["time/compute"] = compute
        metrics["tokens_per_s"] = tokens / compute if compute > 0 else 0.0

        # 6. Checkpoint every `checkpoint_every` versions.
        if self.version // cfg.checkpoint_every > start_version // cfg.checkpoint_every:
            t = time.perf_counter()
            if self.defer_io:
                self.pending_checkpoint = self.checkpoint_state()
                metrics["time/snapshot"] = time.perf_counter() - t
            else:
                self.save_checkpoint()
                metrics["time/checkpoint"] = time.perf_counter() - t
        return metrics

    def _filter_stale(self, samples: Sequence[TrainSample], start_version: int) -> tuple[list[TrainSample], dict[str,
        float]]:
        """The samples the step trains, by the step's one staleness tally (kept in `last_staleness`), and its
        metrics: staleness/<gap> counts every sample received, dropped ones included."""
        vocab = self.model_config.vocab_size
        for s in samples:
            if max(s.prompt_ids.max(), s.completion_ids.max()) >= vocab:
                raise ValueError(f"sample {s.sample_id!r} has a token id >= the model's vocab size {vocab}")
            if staleness.staleness(start_version, s.behaviour_version) < 0:
                raise ValueError(
                    f"sample {s.sample_id!r} claims behaviour version {s.behaviour_version} "
                    f"> trainer version {start_version}"
                )
        tally = staleness.tally(start_version, self.config.max_staleness, [(s.behaviour_version, 1) for s in samples])
        self.last_staleness = tally
        kept = [s for s in samples if tally.trains(s.behaviour_version)]
        self.totals["samples_dropped_stale"] += tally.num_dropped
        metrics = {
            "samples/received": float(len(samples)),
            "samples/dropped_stale": float(tally.num_dropped),
            "samples/trained": float(tally.num_trained),
        }
        metrics.update({f"staleness/{gap}": float(n) for gap, n in tally.received().items()})
        return kept, metrics

    @torch.no_grad()
    def _logprobs_no_grad(self, model: nn.Module, mb: MicroBatch) -> torch.Tensor:
        return forward_logprobs(model, mb, self.config.bf16, self.temperature)[0]

    def _optimizer_step(self, plan, proximal, reference) -> tuple[Counter, float, int, bool]:
        """Backward over the plan, clip, step. A non-finite loss or gradient norm (e.g. a huge reward
        under Dr. GRPO) skips the step: the gradients are dropped and the weights stay as they were.
        Returns (metric sums, largest importance weight, tokens, whether the weights moved)."""
        sums, iw_max, tokens = self._backward(plan, proximal, reference)
        grad_norm = dist_utils.clip_grad_norm([p for p in self.model.parameters() if p.grad is not None],
            self.config.grad_clip)
        sums["lr"] = self.optimizer.param_groups[0]["lr"]  # the rate this step used
        stepped = math.isfinite(grad_norm) and math.isfinite(sums["loss"])
        if stepped:
            self.optimizer.step()
            self.scheduler.step()
            sums["grad_norm"] = grad_norm
        else:
            log.warning("non-finite loss or gradient norm; optimizer step skipped", extra={"grad_norm": grad_norm,
                "loss": sums["loss"]})
        self.optimizer.zero_grad(set_to_none=True)
        return sums, iw_max, tokens, stepped

    def _backward(self, plan, proximal, reference) -> tuple[Counter, float, int]:
        cfg = self.config
        sums: Counter[str] = Counter()
        iw_max = 0.0
        tokens = 0
        scale = float(self.env.world_size)  # gradients are averaged over ranks; our loss wants their sum
        for j, mb in enumerate(plan):
            logprobs, entropy = forward_logprobs(self.model, mb, cfg.bf16, self.temperature)
            prox = proximal[j] if proximal is not None else logprobs.detach()
            loss, stats = ppo_loss(
                logprobs,
                prox,
                mb.behaviour_logprobs,
                mb.advantages,
                mb.weights,
                cfg.loss,
                ref_logprobs=reference[j] if reference is not None else None,
                entropy=entropy if cfg.loss.entropy_coef > 0 else entropy.detach(),
            )
            (loss * scale).backward()
            if mb.num_sequences == 0:
                continue  # a placeholder that keeps ranks in step
            sums["loss"] += float(loss.detach())
            for key, v in stats.items():
                if key == "importance_weight_max":
                    iw_max = max(iw_max, float(v))
                else:
                    sums[key] += float(v)
            tokens += mb.num_tokens
        if self.env.enabled:
            # The same keys on every rank, even one that ran only placeholders.
            keys = ["loss", *STAT_KEYS] + (["kl"] if self.reference is not None else [])
            vec = dist_utils.all_reduce(torch.tensor([sums[k] for k in keys] + [float(tokens)], dtype=torch.float64),
                self.env)
            sums = Counter({k: float(v) for k, v in zip(keys, vec[:-1].tolist())})
            tokens = int(vec[-1])
            iw_max = float(dist_utils.all_reduce(torch.tensor([iw_max]), self.env, op="max"))
        return sums, iw_max, tokens
