"""Which network interface a rank's collectives bind.

gloo (CPU) and NCCL (GPU) each pick an interface for their own TCP connections, and advertise its
address to the other ranks. Left to themselves they take the address the machine's hostname
resolves to, which on many hosts (and in every network namespace) is 127.0.0.1: the other host's
ranks then connect to their own loopback and the group never forms ("connect [127.0.0.1]:...:
Connection refused"). The launcher already says which address is this rank's
(PADDLE_CURRENT_ENDPOINT, from `paddle.distributed.launch --ips` or the engine's own launcher), so
the worker names the interface holding that address in GLOO_SOCKET_IFNAME / NCCL_SOCKET_IFNAME,
unless the user set them.
"""

from __future__ import annotations

import fcntl
import logging
import os
import socket
import struct
from typing import Optional

logger = logging.getLogger("fastdeploy.worker.collective_interface")

SIOCGIFADDR = 0x8915  # linux/sockios.h: an interface's IPv4 address
VARIABLE = {"gloo": "GLOO_SOCKET_IFNAME", "nccl": "NCCL_SOCKET_IFNAME"}


def interface_of(address: str) -> Optional[str]:
    """The name of this host's interface holding the IPv4 `address` (a name is resolved first), or None."""
    try:
        wanted = socket.gethostbyname(address)
    except OSError:
        return None
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                reply = fcntl.ioctl(s.fileno(), SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
            except OSError:  # no IPv4 address on it
                continue
            if socket.inet_ntoa(reply[20:24]) == wanted:
                return name
    return None


def bind_collective_interface(backend: str, environ=os.environ) -> Optional[str]:
    """Set the backend's interface variable to the interface of this rank's endpoint (when the user did
    not); returns the interface the collectives will use, if known."""
    variable = VARIABLE.get(backend)
    if variable is None:
        return None
    if environ.get(variable):
        return environ[variable]
    endpoint = environ.get("PADDLE_CURRENT_ENDPOINT", "")
    host = endpoint.rsplit(":", 1)[0]
    name = interface_of(host) if host else None
    if name is None:
        logger.warning("no interface of this host holds %r (PADDLE_CURRENT_ENDPOINT): %s is left to %s, which "
                       "may advertise an address other hosts cannot reach; set %s", endpoint, variable, backend,
                       variable)
        return None
    environ[variable] = name
    logger.info("%s=%s (the interface of this rank's endpoint %s)", variable, name, endpoint)
    return name
