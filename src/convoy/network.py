"""Which network interface and address a node should use to talk to the other nodes.

Gloo and NCCL pick the address their host name resolves to unless told otherwise, and on
many machines (Debian's default ``/etc/hosts``, containers, test hosts in network
namespaces) that is a loopback address the other nodes cannot reach. The launchers know the
node's real address (Ray's node IP, the address that reaches torchrun's rendezvous), so they
name the interface that holds it (``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME``) unless the
user already did.
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct

SOCKET_IFNAME_VARIABLES = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")
_SIOCGIFADDR = 0x8915  # Linux ioctl: an interface's (primary) IPv4 address


def interface_address(name: str) -> str | None:
    """The primary IPv4 address of interface ``name``, or None if it has none."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        try:
            packed = fcntl.ioctl(
                sock.fileno(), _SIOCGIFADDR, struct.pack("256s", name[:15].encode())
            )
        except OSError:
            return None
    return socket.inet_ntoa(packed[20:24])


def interface_with_address(address: str) -> str | None:
    """The name of the interface that holds IPv4 ``address`` (e.g. ``eth0``), if any."""
    for _, name in socket.if_nameindex():
        if interface_address(name) == address:
            return name
    return None


def address_towards(host: str, port: int) -> str:
    """This machine's IPv4 address on the route to ``host`` (no packet is sent)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        sock.connect((socket.gethostbyname(host), port))
        return str(sock.getsockname()[0])


def socket_interface_env(address: str) -> dict[str, str]:
    """``GLOO_SOCKET_IFNAME`` / ``NCCL_SOCKET_IFNAME`` naming the interface of ``address``,
    leaving out any the user set; empty when no interface holds it."""
    interface = interface_with_address(address)
    if interface is None:
        return {}
    return {name: interface for name in SOCKET_IFNAME_VARIABLES if not os.environ.get(name)}
