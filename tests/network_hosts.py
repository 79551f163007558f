"""Test hosts that share no loopback and no memory: network namespaces joined by veth pairs to a bridge,
with addresses the test assigns; everything made is removed afterwards. Where the machine refuses
namespaces (no CAP_NET_ADMIN), the caller skips, saying why.

    with network_hosts("prefill", "decode") as hosts:
        ns, address, outside = hosts["prefill"]   # run a command there: ("ip", "netns", "exec", ns, ...)

`outside` is the host-side end of that host's veth: its counters are the host's traffic, and
`ip link set OUTSIDE down` cuts the host off.
"""

from __future__ import annotations

import contextlib
import random
import subprocess


def ip(*args: str, ns: str = "") -> None:
    cmd = ["ip", *(["-n", ns] if ns else []), *args]
    done = subprocess.run(cmd, capture_output=True, text=True)
    if done.returncode:
        raise OSError(f"{' '.join(cmd)}: {done.stderr.strip()}")


@contextlib.contextmanager
def network_hosts(*names: str):
    """{name: (namespace, address, outside veth end)}; raises NamespacesRefused where the machine refuses."""
    tag = f"{random.randrange(16 ** 4):04x}"
    subnet = f"10.213.{random.randrange(1, 250)}"
    bridge, hosts, made = f"fdbr{tag}", {}, []
    try:
        ip("link", "add", bridge, "type", "bridge")
        made.append(("link", bridge))
        ip("addr", "add", f"{subnet}.1/24", "dev", bridge)
        ip("link", "set", bridge, "up")
        for k, name in enumerate(names):
            ns, outside = f"fd{k}{tag}", f"fd{k}{tag}h"
            ip("netns", "add", ns)
            made.append(("netns", ns))
            ip("link", "add", outside, "type", "veth", "peer", "name", "eth0", "netns", ns)
            ip("link", "set", outside, "master", bridge)
            ip("link", "set", outside, "up")
            ip("addr", "add", f"{subnet}.{k + 2}/24", "dev", "eth0", ns=ns)
            ip("link", "set", "eth0", "up", ns=ns)
            ip("link", "set", "lo", "up", ns=ns)
            hosts[name] = (ns, f"{subnet}.{k + 2}", outside)
    except OSError as e:
        _remove(made)
        raise NamespacesRefused(f"this machine refuses network namespaces for the test hosts: {e}") from e
    try:
        yield hosts
    finally:
        _remove(made)


class NamespacesRefused(OSError):
    pass


def hosts_or_skip(*names: str):
    """For a module-scoped fixture (`yield from hosts_or_skip("a", "b")`): the hosts, or a skip saying why."""
    import pytest

    try:
        with network_hosts(*names) as hosts:
            yield hosts
    except NamespacesRefused as e:
        pytest.skip(str(e))


def _remove(made: list) -> None:
    for kind, name in reversed(made):
        subprocess.run(["ip", kind, "del", name], capture_output=True)  # a namespace takes its veth end along
