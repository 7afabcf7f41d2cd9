"""Reverse proxies an operator trusts (a Kubernetes ingress controller's pods): every client behind one arrives
from the proxy's address, so a per-address budget must not treat a proxy as one client. The API then takes the
client's address from X-Forwarded-For (orchestrator/server.py); the shard servers, which budget only
connections, leave the proxy's connections uncapped per address (the total cap still holds)."""

from __future__ import annotations

import ipaddress
from collections.abc import Iterable

Network = ipaddress.IPv4Network | ipaddress.IPv6Network


def proxy_networks(entries: Iterable[str]) -> tuple[Network, ...]:
    """Addresses or CIDR networks; ValueError naming the first entry that is neither."""
    nets = []
    for entry in entries:
        try:
            nets.append(ipaddress.ip_network(entry, strict=False))
        except ValueError:
            raise ValueError(f"trusted_proxies: {entry!r} is not an IP address or network (e.g. 10.0.0.0/8)") from None
    return tuple(nets)


def is_proxy(address: str, networks: tuple[Network, ...]) -> bool:
    if not networks:
        return False
    try:
        ip = ipaddress.ip_address(address)
    except ValueError:
        return False
    return any(ip in net for net in networks)
