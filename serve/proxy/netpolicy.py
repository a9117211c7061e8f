"""Which addresses the proxy may send requests to: never, unless the operator opts in, to link-local addresses
and cloud metadata services. A proxy forwards a client's prompt (and a node's API key) to whatever URL its admin
routes were given; a URL that points at the host's metadata service (169.254.169.254 and its kin) would hand
that service's credentials to whoever reads the node's answers, the classic server-side request forgery.

The policy is checked twice: when a node is added (a literal address or a known metadata name: 400 naming it),
and whenever the proxy resolves a node's name (``PolicyResolver``, so a name that resolves, or later
re-resolves, to such an address is refused at connection time and the node is marked down).
``--allow-node-network CIDR`` opens a network the default refuses (a cluster whose nodes really are on
link-local addresses)."""

from __future__ import annotations

import ipaddress
import socket
from dataclasses import dataclass

import aiohttp
from aiohttp.abc import AbstractResolver

REFUSED_NETWORKS = tuple(ipaddress.ip_network(n) for n in (
    "169.254.0.0/16",  # IPv4 link-local: AWS, GCP, Azure and OpenStack metadata (169.254.169.254), ECS tasks
    "fe80::/10",  # IPv6 link-local
    "fd00:ec2::254/128",  # AWS metadata over IPv6
    "100.100.100.200/32",  # Alibaba Cloud metadata
))
METADATA_NAMES = frozenset({"metadata", "metadata.google.internal", "metadata.goog", "instance-data",
                            "instance-data.ec2.internal"})


@dataclass(frozen=True)
class NodeNetworkPolicy:
    """The ``refused`` networks (REFUSED_NETWORKS) and METADATA_NAMES, less the networks the operator allowed
    (--allow-node-network)."""

    allowed: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = ()
    refused: tuple[ipaddress.IPv4Network | ipaddress.IPv6Network, ...] = REFUSED_NETWORKS

    @classmethod
    def allowing(cls, networks) -> NodeNetworkPolicy:
        """The policy with ``networks`` (CIDR strings) allowed; ValueError naming a malformed one."""
        parsed = []
        for text in networks:
            try:
                parsed.append(ipaddress.ip_network(text.strip(), strict=False))
            except ValueError as e:
                raise ValueError(f"--allow-node-network {text!r}: not a network ({e}); give CIDR notation such "
                                 f"as 169.254.0.0/16") from None
        return cls(tuple(parsed))

    def refusal(self, address: str) -> str | None:
        """Why the IP ``address`` is refused, or None when it may be used."""
        ip = ipaddress.ip_address(address.strip("[]").split("%")[0])
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped
        for network in self.refused:
            if ip in network and not any(ip in allowed for allowed in self.allowed):
                kind = "a link-local address" if ip.is_link_local else "a cloud metadata address"
                return (f"{ip} is {kind} (in {network}), which the proxy refuses: such addresses can reach the "
                        f"host's metadata service; start the proxy with --allow-node-network {network} if your nodes "
                        f"really are there")
        return None

    def check_host(self, host: str) -> None:
        """ValueError naming why a node's host (a literal address or a name, as normalize_node_url writes it) is
        refused; names other than the metadata services' are checked when they are resolved (PolicyResolver)."""
        bare = host.strip("[]").rstrip(".").lower()
        if bare in METADATA_NAMES:
            raise ValueError(f"{host} is a cloud metadata service's name, which the proxy refuses")
        try:
            why = self.refusal(bare)
        except ValueError:  # a name, not an address
            return
        if why is not None:
            raise ValueError(why)


class PolicyResolver(AbstractResolver):
    """aiohttp's resolver, less the addresses ``policy`` refuses: a node whose name resolves only to those
    cannot be connected to (OSError naming why)."""

    def __init__(self, policy: NodeNetworkPolicy, inner: AbstractResolver | None = None):
        self.policy = policy
        self.inner = inner or aiohttp.ThreadedResolver()

    async def resolve(self, host: str, port: int = 0, family: socket.AddressFamily = socket.AF_INET):
        if host.rstrip(".").lower() in METADATA_NAMES:
            raise OSError(f"{host} is a cloud metadata service's name, which the proxy refuses")
        results = await self.inner.resolve(host, port, family)
        kept, refusals = [], []
        for result in results:
            why = self.policy.refusal(result["host"])
            (refusals if why else kept).append(why or result)
        if not kept:
            raise OSError(f"{host} resolves to no address the proxy may use: {refusals[0]}")
        return kept

    async def close(self) -> None:
        await self.inner.close()
