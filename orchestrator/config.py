"""The orchestrator's settings (`[orchestrator]` and `[data]` of a run config), and `StepShape`: what the
orchestrator must know of how the trainer consumes samples.
"""

from __future__ import annotations

import ipaddress
import re
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, field_validator, model_validator

from environments.curriculum import CurriculumConfig
from protocol.models import SamplingParams
from protocol.operator_models import BanScope
from protocol.proxies import proxy_networks

DEMO_JOIN_TOKEN = "demo-join-token"
DEMO_ADMIN_TOKEN = "demo-admin-token"


class FieldMap(BaseModel):
    """Which columns of a dataset row are the prompt, the answer, the system prompt, the id and the metadata."""

    model_config = ConfigDict(extra="forbid")

    prompt: str = "prompt"
    answer: str = "answer"
    system: str = Field("",
        description="a column with a per-row system prompt; empty: data.system_prompt for every row")
    id: str = Field("",
        description="a column with a stable prompt id; empty: `prompt_id` or `id` if present, else a hash of "
                    "the prompt")
    meta: list[str] | None = Field(None, description="columns the reward sees as item.meta; None: every other column")


class DataConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    task: str = Field(
        "toy", description="the task that makes prompts and scores completions: a built-in (toy, countdown, math, "
        "lookup, reasoning_gym) or your own 'package.module:TaskClass' (docs/tasks.md)",
    )
    path: str = Field(
        "", description="a JSONL, JSON, parquet or arrow file, a folder of such files (split by file name), or a "
        "`datasets.save_to_disk` folder; empty: generate the task's synthetic prompts",
    )
    split: str = Field("train", description="the split to read from a folder with splits")
    fields: FieldMap = FieldMap()
    answer_pattern: str = Field(
        "", description="a regex over the answer column whose group 1 (or whole match) is the final answer, "
        "e.g. '####\\s*(.+)' for GSM8K; empty: the whole answer",
    )
    system_prompt: str = Field("", description="system prompt of every row (unless fields.system names a column)")
    chat_template: Literal["auto", "on", "off"] = Field(
        "auto", description="render prompts with tokenizer.apply_chat_template; auto: if the tokenizer has a chat "
        "template",
    )
    chat_template_jinja: str = Field("",
        description="a Jinja chat template that replaces the tokenizer's own (or gives one to a tokenizer without)")
    max_prompt_tokens: int = Field(0, ge=0,
        description="prompts longer than this (after the chat template) are dropped and counted; 0: the protocol's "
        "limit")
    num_prompts: int = Field(4096, ge=1, description="prompts a task makes when it does not stream")
    stream: bool | None = Field(
        None, description="prompts from the task's procedural stream (Task.item(seed, index, level)): a fresh one "
        "for every lease, without end; None: the task's default (reasoning_gym streams; toy, countdown, math make "
        "num_prompts). Needs an empty data.path",
    )
    curriculum: CurriculumConfig = Field(
        default_factory=CurriculumConfig, description="move a streamed task's difficulty level by the online pass rate",
    )
    pass_rate_column: str = "pass_rate"
    min_pass_rate: float | None = Field(None, ge=0, le=1, description="offline difficulty filter")
    max_pass_rate: float | None = Field(None, ge=0, le=1)
    task_params: dict[str, Any] = {}
    reward: str = Field(
        "", pattern=r"^([\w.]+:[\w.]+)?$",
        description="a reward plug-in `module:function` ((text, item) -> float in [0, 1]), run sandboxed with a time "
        "limit; empty: the task's own reward",
    )
    reward_params: dict[str, Any] = Field(default_factory=dict, description="keyword arguments of the reward plug-in")

    @model_validator(mode="after")
    def _stream_needs_a_task(self) -> "DataConfig":
        if self.path and (self.stream or self.curriculum.enabled):
            raise ValueError("data.stream and data.curriculum make prompts with the task: data.path must be empty")
        return self

    @field_validator("answer_pattern")
    @classmethod
    def _compiles(cls, v: str) -> str:
        if v:
            try:
                re.compile(v)
            except re.error as exc:
                raise ValueError(f"not a regular expression: {exc}") from None
        return v


class EvalConfig(BaseModel):
    """Evaluation during training: held-out prompts leased to the swarm, pinned to the evaluated version,
    verified like any task and never trained on (orchestrator/evaluation.py)."""

    model_config = ConfigDict(extra="forbid")

    every_steps: int = Field(0, ge=0,
        description="evaluate every policy version that is a multiple of this (version 0 included); 0: off")
    num_prompts: int = Field(16, ge=1, description="held-out prompts per evaluation")
    samples_per_prompt: int | None = Field(
        None, ge=1, le=64,
        description="k: samples per held-out prompt; empty: orchestrator.samples_per_prompt (then eval leases look "
        "like training ones)"
    )
    path: str = Field("",
        description="a dataset of held-out prompts (read like data.path); empty: data.path with eval.split, or else "
        "num_prompts held out of the run's prompts")
    split: str = Field("",
        description="the split of held-out prompts (e.g. 'test'): of eval.path, or of data.path when eval.path is "
                    "empty")
    pass_threshold: float = Field(1.0, description="a completion passes (for pass@k) when its reward is at least this")
    pass_at: list[int] = Field(default_factory=lambda: [1],
        description="pass@k reported for these k (and for k = samples_per_prompt)")


class OpenJoinConfig(BaseModel):
    """Open join (orchestrator/open_join.py): a worker with no join token claims one of its own by solving a
    proof-of-work puzzle. Such a token holds one identity and is on probation until its work is accepted."""

    model_config = ConfigDict(extra="forbid")

    enabled: bool = Field(False, description="off: the open-join endpoints refuse (403); only operators' tokens join")
    difficulty_bits: int = Field(
        22, ge=0, le=40, description="leading zero bits of sha256(challenge || solution): 2**bits hashes on average, "
        "about 2 s of one core in Python's hashlib at 22 (a native or GPU hasher is far faster: the rate limits bind)",
    )
    challenge_ttl_s: float = Field(600.0, gt=0, description="a puzzle must be claimed this soon after it was issued")
    requests_per_min_per_address: float = Field(30.0, gt=0, description="puzzles and claims asked, per address")
    claims_per_hour_per_address: float = Field(4.0, gt=0, description="tokens claimed per client address (in bursts)")
    claims_per_hour_total: float = Field(120.0, gt=0, description="tokens claimed by everyone together (in bursts)")


class OrchestratorConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    host: str = "127.0.0.1"
    port: int = Field(8000, ge=0, le=65535)
    async_level: int = Field(2, ge=0, description="generation for step N may use any version >= N - async_level")
    samples_per_prompt: int = Field(8, ge=1, description="GRPO group size")
    prompts_per_lease: int = Field(4, ge=1)
    sampling: SamplingParams = SamplingParams()
    environment: str | None = Field(
        None, description="multi-turn: the environment (environments.registry) that answers each model turn; "
        "sampling.max_tokens then caps the whole episode. None: single-turn",
    )
    # A lease's deadline follows its size and its worker's verified rate (orchestrator/lease_deadlines.py).
    lease_timeout_s: float = Field(
        60.0, gt=0, description="the shortest a lease lasts (the floor of its deadline, and what toy-sized leases "
        "get); the housekeeping sweep that expires leases runs at least every quarter of it",
    )
    lease_timeout_max_s: float = Field(
        3600.0, gt=0, description="the longest a lease lasts, whatever rate its worker showed: how long anyone can "
        "hold prompts (lease_timeout_s wins if higher)",
    )
    lease_slack: float = Field(
        3.0, ge=1, description="a lease lasts this many times what it needs at its worker's measured rate: room for "
        "a slower lease than measured (longer completions, a weights pull, two leases at once)",
    )
    new_worker_tokens_per_s: float = Field(
        4.0, gt=0, description="the rate assumed for a worker with no accepted work yet, so its first leases do not "
        "expire: a Qwen3-0.6B worker on a 2-core CPU was measured at 4-7 tokens/s (docs/real-sizes.md)",
    )
    max_open_leases_per_worker: int = Field(2, ge=1)
    rate_limit_per_s: float = Field(50.0, gt=0,
        description="requests per second per worker (and per join token, times its live workers)")
    bytes_per_s_per_worker: float = Field(16 << 20, gt=0,
        description="request body bytes per second per worker (bursts of 4 s)")
    requests_in_flight_per_worker: int = Field(8, ge=1, description="requests one worker may have open at once")
    failed_auth_per_min: float = Field(30.0, gt=0,
        description="refused credentials per minute per client address before it is refused outright")
    max_connections: int = Field(2048, ge=16, description="open connections (and requests) at once; beyond, 503")
    max_connections_per_address: int = Field(128, ge=1,
        description="open connections from one client address; beyond, closed at once")
    trusted_proxies: list[str] = Field(
        default_factory=list,
        description="addresses or networks (CIDR) of the reverse proxies in front of the API (a Kubernetes ingress "
        "controller's pods): for a connection from one, the client is the last address in X-Forwarded-For that is "
        "not a trusted proxy, so every per-address budget is the volunteer's, not the proxy's, and the proxy's own "
        "connections are not capped per address. Empty: the client is the connection's peer and the header is ignored",
    )
    refusal_delay_s: float = Field(
        1.0, ge=0,
        description="a request refused for being over a budget is answered after this long (at most its retry-after): "
        "a client that ignores Retry-After waits anyway, so one connection cannot flood",
    )
    header_timeout_s: float = Field(10.0, gt=0,
        description="a request's line and headers must arrive within this (slow-loris)")
    strikes_to_ban: int = Field(3, ge=1)
    strike_decay_accepted: int = Field(
        20, ge=0,
        description="every this many accepted submissions in a row (no strike between them) remove one of the worker's "
        "strikes, never below 0; a ban is never lifted by it. A worker whose striking rejections (and lease debts) "
        "come more often "
        "than once per this many accepted submissions still gathers strikes until banned. 0: strikes never decay",
    )
    near_tie_burst: float = Field(
        8.0, ge=0,
        description="draw deviations (accepted tokens that are not the seed's exact draw) a worker may have above what "
        "noise explains (the verifier's deviation_rate x the positions that offered a second token) before a strike; "
        "it drains "
        "as it works (orchestrator/draw_deviations.py). Honest noise measured at <= 4.7% of those positions against "
        "the 10% "
        "allowed: a random walk drifting down, which passes 8 with a chance of ~1e-8",
    )
    near_tie_ban: float = Field(
        24.0, ge=0,
        description="past this many deviations above the allowance a worker is banned: strikes decay with accepted "
        "work, this bucket only with the allowance, so a worker that keeps steering however rarely is stopped",
    )
    ban_scope: BanScope = Field(BanScope.token,
        description="a ban by strikes: the worker only (identity), or its join token too (token)")
    max_identities_per_token: int = Field(8, ge=1, description="live workers per join token (a Sybil cap)")
    registrations_per_min_per_token: float = Field(6.0, gt=0)
    open_join: OpenJoinConfig = OpenJoinConfig()
    probation_share: float = Field(
        0.1, ge=0, le=1,
        description="while join tokens with a record of accepted work want leases, the tokens without one "
        "share this fraction of the async bound between them (at least one prompt): a crowd of new identities cannot "
        "crowd out "
        "the workers that deliver, and a new volunteer still gets work to earn its record",
    )
    lease_cooldown_s: float = Field(10.0, ge=0,
        description="a join token that let a whole lease go unsubmitted waits this long; doubles with its debt")
    lease_debt_per_strike: float = Field(2.0, gt=0,
        description="leases' worth of debt per strike against the worker that let them go")
    release_floor: float = Field(
        0.25, ge=0,
        description="a lease given back after its free window (once the worker could have generated and scored it) "
        "costs "
        "its token at least this many full leases' worth of debt, however early (orchestrator/release_costs.py)",
    )
    max_release_ratio: float = Field(
        0.25, ge=0, le=1,
        description="a join token that gave back more than this share of its last leases after their free window "
        "may hold only one prompt at a time until the share falls (it could be choosing which scored groups get "
        "trained)",
    )
    heartbeat_interval_s: float = Field(5.0, gt=0)
    worker_dead_after_s: float = Field(30.0, gt=0)
    request_timeout_s: float = Field(30.0, gt=0)
    # Secrets: shown as ********** by --dry-run and in the run folder's config.toml. The demo values are
    # refused on any address but loopback (`refuse_exposed_demo_secrets`).
    join_tokens: list[SecretStr] = Field(
        default_factory=lambda: [SecretStr(DEMO_JOIN_TOKEN)],
        description="join tokens from the config (more can be minted through the admin API)"
    )
    admin_token: SecretStr = SecretStr(DEMO_ADMIN_TOKEN)
    db_path: str = Field("", description="SQLite file; default <run dir>/orchestrator.sqlite")

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, v: list[str]) -> list[str]:
        proxy_networks(v)
        return v

    @model_validator(mode="after")
    def _environment_fits(self) -> "OrchestratorConfig":
        """An unknown environment fails when the config loads, not at the first verdict; and the lease's
        token cap must hold a whole episode, so that the environment's own limits are the ones that bind
        (the worker and the verifier then end turns at the same places)."""
        if self.environment is not None:
            from environments.registry import environment_class

            need = environment_class(self.environment).limits.max_episode_tokens
            if self.sampling.max_tokens < need:
                raise ValueError(f"environment {self.environment!r} needs sampling.max_tokens >= {need} (its episode "
                    f"cap), got {self.sampling.max_tokens}")
        return self


def refuse_exposed_demo_secrets(config: OrchestratorConfig) -> None:
    """Refuse to serve on a non-loopback address with a demo or placeholder token: anyone who can reach the
    port could then administer the run or join it."""
    try:
        loopback = config.host == "localhost" or ipaddress.ip_address(config.host).is_loopback
    except ValueError:  # a host name
        loopback = False
    if loopback:
        return
    weak = [name for name, value in [("admin_token", config.admin_token), *(("join_tokens", t)
        for t in config.join_tokens)]
            if value.get_secret_value() in (DEMO_ADMIN_TOKEN, DEMO_JOIN_TOKEN)
            or value.get_secret_value().startswith("CHANGE-ME")]
    if weak:
        raise ValueError(
            f"orchestrator.host is {config.host}, reachable from other machines, but {', '.join(sorted(set(weak)))} "
            f"still hold the demo "
            "or placeholder value. Set them, e.g. SWARMRL_ORCHESTRATOR__ADMIN_TOKEN=$(openssl rand -hex 32) and "
            "SWARMRL_ORCHESTRATOR__JOIN_TOKENS='[\"'$(openssl rand -hex 16)'\"]' (or mint join tokens with the admin "
            "API), "
            "or bind 127.0.0.1."
        )


class StepShape(BaseModel):
    """How the trainer consumes samples, as far as leases, the async bound and staleness need to know."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    samples_per_step: int = Field(ge=1)
    mini_batches: int = Field(1, ge=1, description="optimizer steps (published versions) per batch")
    max_staleness: int = Field(ge=0)
    advantage_std: bool = True
