"""The prefill and the decode server on two hosts of their own: two network namespaces this test makes
(each joined to a bridge by a veth pair, addresses it assigns, all removed afterwards), UCX held to TCP
on the namespaces' own interface, so the KV crosses a network link, not a shared loopback or shared
memory. vllm-router runs on the host side of the bridge. Skips, saying why, where the machine refuses
namespaces.
"""

from __future__ import annotations

import json

import pytest
from network_hosts import hosts_or_skip

pytestmark = pytest.mark.slow  # the slow tier: `pytest -m slow tests`

pytest.importorskip("nixl_cu12", reason="KV transfer needs NIXL: pip install -e \".[cpu,pd]\"")


@pytest.fixture(scope="module")
def two_hosts():
    yield from hosts_or_skip("prefill", "decode")


def test_kv_crosses_a_network_link_between_two_hosts(two_hosts, server_factory, router_factory):
    from pathlib import Path

    servers = {}
    # bytes the prefill host sent over its link (its veth end outside receives them)
    link = Path(f"/sys/class/net/{two_hosts['prefill'][2]}/statistics/rx_bytes")
    before = int(link.read_text())
    for role, (ns, address, _) in two_hosts.items():
        config = json.dumps({"kv_connector": "NixlConnector", "kv_role": "kv_both", "side_channel_host": address,
                             "side_channel_port": 5600})
        servers[role] = server_factory(
            "--splitwise-role", role, "--kv-transfer-config", config, "--num-gpu-blocks-override", "192",
            "--max-model-len", "2048", host=address, prefix=("ip", "netns", "exec", ns), wait=False,
            env={"FD_HEAD_WISE_KV_CACHE": "1", "UCX_TLS": "tcp", "UCX_NET_DEVICES": "eth0"})
    for srv in servers.values():
        srv.wait_ready()
    router = router_factory([servers["prefill"].base_url], [servers["decode"].base_url])
    from pydoc_data.topics import topics

    for key in ("if", "while"):
        prompt = " ".join(topics[key].split()[:150])
        body = {"prompt": prompt, "max_tokens": 12, "temperature": 0}
        through_router = router.http.post("/v1/completions", json=body)
        assert through_router.status_code == 200, through_router.text
        alone = servers["decode"].http.post("/v1/completions", json=body).json()  # the decode server on its own
        assert through_router.json()["choices"][0]["text"] == alone["choices"][0]["text"]
    for srv in servers.values():
        srv.wait_idle_with_all_pages_free()
    sent = servers["prefill"].metrics()["fastdeploy:kv_transfer_bytes_sent_total"]
    received = servers["decode"].metrics()["fastdeploy:kv_transfer_bytes_received_total"]
    assert sent == received > 0
    assert int(link.read_text()) - before > sent  # the pages went over the wire
