"""Ports for a job's rendezvous: torch's TCPStore and the JAX coordination service.

A port that is free now can be taken a moment later: the kernel hands ports from its
ephemeral range to every outgoing connection on the host (gloo alone opens several per peer),
so a port drawn from that range, checked, and bound seconds later by a freshly started
process can already be someone's connection. Ports drawn here therefore come from below the
ephemeral range, where only a deliberate ``bind`` can take them.

The JAX coordination service listens on every interface (``[::]:port``), so "free" means
bindable on the wildcard address, as gRPC binds it (``SO_REUSEADDR``: a connection of ours
that closed a moment ago, still in TIME_WAIT, does not make a port busy).
"""

from __future__ import annotations

import errno
import random
import socket

# Linux's default ephemeral range; read from the kernel where it can be.
DEFAULT_EPHEMERAL = (32768, 60999)
# Not the global generator: a training script's random.seed must not make every job on a
# host draw the same ports.
_RANDOM = random.SystemRandom()
# Below this, ports are the well-known / registered services people run on hosts.
LOWEST_DRAWN = 20000


def ephemeral_port_range() -> tuple[int, int]:
    """The kernel's range for outgoing connections' local ports, inclusive."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            low, high = (int(x) for x in f.read().split())
        return low, high
    except (OSError, ValueError):
        return DEFAULT_EPHEMERAL


def port_is_free(port: int) -> bool:
    """Whether a listening socket could bind ``port`` on every interface right now: on the
    IPv4 and the IPv6 wildcard, each checked alone (a family the host lacks is skipped)."""
    for family, address in ((socket.AF_INET, "0.0.0.0"), (socket.AF_INET6, "::")):
        try:
            sock = socket.socket(family, socket.SOCK_STREAM)
        except OSError:
            continue
        with sock:
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                sock.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            try:
                sock.bind((address, port))
            except OSError as e:
                if e.errno in (errno.EADDRINUSE, errno.EACCES):
                    return False
                # any other error: this family's wildcard is unusable here (IPv6 disabled)
    return True


def drawing_range() -> tuple[int, int]:
    """The ports :func:`free_port_pair` draws from: below the ephemeral range when there is
    room there, else the ephemeral range itself (a host configured to leave nothing below)."""
    low, high = ephemeral_port_range()
    if low - LOWEST_DRAWN >= 1000:
        return LOWEST_DRAWN, low - 1
    return low, high


def free_port(span: tuple[int, int] | None = None, attempts: int = 200) -> int:
    """A free port, drawn at random from ``span`` (default :func:`drawing_range`)."""
    return _draw(span, attempts, width=1)


def free_port_pair(span: tuple[int, int] | None = None, attempts: int = 200) -> int:
    """A port P with P and P+1 both free (torch's store on P, JAX's coordinator on P+1)."""
    return _draw(span, attempts, width=2)


def _draw(span, attempts: int, width: int) -> int:
    low, high = span or drawing_range()
    if high - low + 1 < width:
        raise ValueError(f"port range {low}-{high} holds fewer than {width} ports")
    for _ in range(attempts):
        port = _RANDOM.randint(low, high - width + 1)
        if all(port_is_free(port + i) for i in range(width)):
            return port
    raise RuntimeError(f"no {width} free consecutive port(s) in {low}-{high} after {attempts} "
                       "tries: free some ports or set MASTER_PORT yourself")
