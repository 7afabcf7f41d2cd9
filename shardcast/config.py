"""Broadcast settings (`[shardcast]` of a run config). `DEFAULTS` is where every shardcast default lives:
the origin, relays, client and their commands take their keyword defaults from it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from protocol.proxies import proxy_networks


class ShardcastConfig(BaseModel):
    """Broadcast of policy versions: origin -> relays -> workers."""

    model_config = ConfigDict(extra="forbid")

    run_id: str = Field(
        "",
        pattern=r"^[\w.:-]{0,128}$",
        description="signed into every manifest; clients refuse other runs' manifests. Empty: `swarmrl run` makes "
        "`<name>-<random>` once and keeps it in the run folder (file `run_id`), so a resumed run keeps it",
    )
    shard_bytes: int = Field(64 << 20, ge=1 << 10, description="target size of one safetensors shard")
    keep_versions: int = Field(3, ge=1,
        description="versions kept by the origin and each relay (plus the delta chain back to their anchor)")
    host: str = "127.0.0.1"
    origin_port: int = Field(0, ge=0, le=65535, description="0 picks a free port")
    num_relays: int = Field(1, ge=0, description="relays started by `swarmrl run`")
    relay_poll_interval_s: float = Field(0.5, gt=0)
    relay_parallelism: int = Field(2, ge=1, le=64,
        description="shards a relay fetches at once (few: each is servable only once complete)")
    relay_shard_wait_s: float = Field(
        2.0, ge=0,
        description="how long a relay holds a request for a listed shard still on its way (then 503); below "
        "client_stall_timeout_s"
    )
    delete_grace_s: float = Field(120.0, ge=0,
        description="a version beyond keep_versions is deleted only after nobody touched it this long")
    client_parallelism: int = Field(8, ge=1, le=64)
    client_retries: int = Field(5, ge=0)
    request_timeout_s: float = Field(10.0, gt=0,
        description="deadline of one small request (a listing or a manifest), however the server drips it")

    # -- deltas (origin) -------------------------------------------------------------------------------
    deltas: bool = Field(True,
        description="publish a version as a delta against the previous one where that is smaller")
    anchor_every: int = Field(10, ge=1, description="a full anchor at least every this many versions")
    max_chain_fraction: float = Field(
        0.5, gt=0,
        description="a full anchor once the deltas since the last one would weigh more than this fraction of a full "
        "version"
    )
    delta_level: int = Field(1, ge=1, le=22,
        description="zstd level of delta sections (bench/results/delta_codec.md: 1 is as small as 3, for less CPU)")
    delta_workers: int = Field(1, ge=1, le=64, description="tensors encoded / applied at once")

    # -- a client's defence against slow or stalling sources ------------------------------------------
    client_stall_timeout_s: float = Field(5.0, gt=0,
        description="a source that sends nothing this long (headers included) is left for this file")
    client_min_rate_bytes_per_s: int = Field(
        64 << 10, ge=0,
        description="a transfer below this rate over client_rate_window_s is moved to another source (bytes kept)"
    )
    client_rate_window_s: float = Field(2.0, gt=0, description="the window over which transfer rates are judged")
    client_slow_factor: float = Field(
        0.25, ge=0, le=1,
        description="a transfer below this fraction of another source's measured rate is moved to that source"
    )
    client_slow_cooldown_s: float = Field(30.0, ge=0,
        description="a source left for being slow or stalling is not picked again for this long")
    client_shard_deadline_s: float = Field(300.0, gt=0,
        description="one file (shard or delta), all attempts together, must be verified within this long")
    client_pull_deadline_s: float = Field(1800.0, gt=0,
        description="one pull, planning to verified weights, must finish within this long")

    trusted_proxies: list[str] = Field(
        default_factory=list,
        description="addresses or networks (CIDR) of reverse proxies in front of the origin and relays (a Kubernetes "
        "ingress controller's pods): their connections carry many volunteers and are not capped per address",
    )
    advertise_origin_url: str = Field("",
        description="the origin's URL as others reach it (e.g. a Kubernetes Service); default: where it binds")
    public_origin_url: str = Field(
        "", description="the origin as volunteers reach it: their fallback when relays fail or stall; default: "
        "advertise_origin_url"
    )
    advertise_relay_urls: list[str] = Field(
        default_factory=list,
        description="relays outside this process tree (e.g. a Kubernetes relay Service) that workers are told to pull "
        "from",
    )
    signing_key_path: str | None = Field(None, description="ed25519 private key (PEM); a new one per run if unset")

    @field_validator("trusted_proxies")
    @classmethod
    def _networks(cls, v: list[str]) -> list[str]:
        proxy_networks(v)
        return v

    @model_validator(mode="after")
    def _relay_answers_before_clients_give_up(self) -> "ShardcastConfig":
        if self.relay_shard_wait_s >= self.client_stall_timeout_s:
            raise ValueError("relay_shard_wait_s must be below client_stall_timeout_s, or clients leave a relay that "
                "is just waiting for a shard")
        return self


DEFAULTS = ShardcastConfig()
