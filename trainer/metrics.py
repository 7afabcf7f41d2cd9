"""Prometheus view of `Trainer.step`'s metrics, for whoever serves /metrics (the orchestrator).

    exporter = TrainerMetrics(registry)
    exporter.observe(trainer.step(samples))

Gauges hold the latest step's values; counters accumulate time, tokens and sample counts. Names follow
ARCHITECTURE.md's "say what to do" rule: a high swarmrl_trainer_wait_for_rollouts_seconds_total share
means the workers are the bottleneck.
"""

from __future__ import annotations

from collections.abc import Mapping

from prometheus_client import CollectorRegistry, Counter, Gauge

# metric key in Trainer.step's dict -> (gauge name, help)
_GAUGES = {
    "loss": ("loss", "Loss of the latest optimizer step"),
    "policy_loss": ("policy_loss", "Clipped-surrogate part of the latest loss"),
    "clip_frac": ("clip_fraction", "Fraction of completion tokens whose ratio was clipped (no gradient)"),
    "importance_weight/mean": ("importance_weight_mean", "Mean truncated importance weight pi_prox/mu"),
    "importance_weight/max": ("importance_weight_max", "Largest truncated importance weight"),
    "importance_weight/truncated_frac": ("importance_weight_truncated_fraction", "Fraction of tokens whose weight hit the cap c"),
    "mismatch_kl": ("mismatch_kl", "KL(behaviour || proximal) per token: train/inference mismatch; rising is a warning"),
    "entropy": ("entropy", "Mean next-token entropy on completion tokens"),
    "kl": ("reference_kl", "k3 KL to the frozen reference per token"),
    "grad_norm": ("grad_norm", "Gradient norm before clipping"),
    "lr": ("learning_rate", "Learning rate of the latest step"),
    "tokens_per_s": ("tokens_per_second", "Training tokens per second of compute"),
    "version": ("policy_version", "Policy version after the latest step"),
    "reward/mean": ("reward_mean", "Mean reward of the trained samples"),
}
# metric key -> (counter name, help)
_COUNTERS = {
    "time/wait_for_rollouts": ("wait_for_rollouts_seconds", "Time the trainer waited for samples; high: workers are the bottleneck"),
    "time/compute": ("compute_seconds", "Time spent computing training steps"),
    "time/publish": ("publish_seconds", "Time spent publishing versions"),
    "time/checkpoint": ("checkpoint_seconds", "Time spent writing checkpoints"),
    "tokens": ("tokens", "Tokens trained on"),
    "samples/trained": ("samples_trained", "Samples trained on"),
    "samples/dropped_stale": ("samples_dropped_stale", "Samples dropped for exceeding max_staleness"),
}


class TrainerMetrics:
    def __init__(self, registry: CollectorRegistry, prefix: str = "swarmrl_trainer_") -> None:
        self.gauges = {k: Gauge(prefix + n, h, registry=registry) for k, (n, h) in _GAUGES.items()}
        self.counters = {k: Counter(prefix + n, h, registry=registry) for k, (n, h) in _COUNTERS.items()}
        self.staleness = Counter(prefix + "samples_by_staleness", "Samples received, by version gap", ["gap"], registry=registry)

    def observe(self, metrics: Mapping[str, float]) -> None:
        for key, gauge in self.gauges.items():
            if key in metrics:
                gauge.set(metrics[key])
        for key, counter in self.counters.items():
            if metrics.get(key, 0) > 0:
                counter.inc(metrics[key])
        for key, value in metrics.items():
            if key.startswith("staleness/"):
                self.staleness.labels(gap=key.split("/", 1)[1]).inc(value)
