"""Broadcast settings (`[shardcast]` of a run config). `DEFAULTS` is where every shardcast default lives:
the origin, relays, client and their commands take their keyword defaults from it."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field


class ShardcastConfig(BaseModel):
    """Broadcast of policy versions: origin -> relays -> workers."""

    model_config = ConfigDict(extra="forbid")

    shard_bytes: int = Field(64 << 20, ge=1 << 10, description="target size of one safetensors shard")
    keep_versions: int = Field(3, ge=1, description="versions kept by the origin and each relay")
    host: str = "127.0.0.1"
    origin_port: int = Field(0, ge=0, le=65535, description="0 picks a free port")
    num_relays: int = Field(1, ge=0, description="relays started by `swarmrl run`")
    relay_poll_interval_s: float = Field(0.5, gt=0)
    relay_parallelism: int = Field(2, ge=1, le=64, description="shards a relay fetches at once (few: each is servable only once complete)")
    relay_shard_wait_s: float = Field(10.0, ge=0, description="how long a relay holds a request for a listed shard still on its way (then 503)")
    delete_grace_s: float = Field(120.0, ge=0, description="a version beyond keep_versions is deleted only after nobody touched it this long")
    client_parallelism: int = Field(8, ge=1, le=64)
    client_retries: int = Field(5, ge=0)
    request_timeout_s: float = Field(30.0, gt=0)
    advertise_origin_url: str = Field("", description="the origin's URL as others reach it (e.g. a Kubernetes Service); default: where it binds")
    advertise_relay_urls: list[str] = Field(
        default_factory=list,
        description="relays outside this process tree (e.g. a Kubernetes relay Service) that workers are told to pull from",
    )
    signing_key_path: str | None = Field(None, description="ed25519 private key (PEM); a new one per run if unset")


DEFAULTS = ShardcastConfig()
