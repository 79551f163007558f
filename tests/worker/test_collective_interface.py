"""The interface a rank's collectives bind is the one holding its endpoint's address, unless the user named one."""

from fastdeploy.worker.collective_interface import bind_collective_interface, interface_of


def test_the_interface_of_an_address_is_found_and_an_unknown_address_has_none():
    assert interface_of("127.0.0.1") == "lo"
    assert interface_of("192.0.2.254") is None
    assert interface_of("no-such-host.invalid") is None


def test_gloo_is_bound_to_the_endpoints_interface_unless_the_user_chose_one():
    env = {"PADDLE_CURRENT_ENDPOINT": "127.0.0.1:6170"}
    assert bind_collective_interface("gloo", env) == "lo" and env["GLOO_SOCKET_IFNAME"] == "lo"
    env = {"PADDLE_CURRENT_ENDPOINT": "127.0.0.1:6170", "NCCL_SOCKET_IFNAME": "ib0"}
    assert bind_collective_interface("nccl", env) == "ib0" and env["NCCL_SOCKET_IFNAME"] == "ib0"
    env = {"PADDLE_CURRENT_ENDPOINT": "192.0.2.254:6170"}
    assert bind_collective_interface("gloo", env) is None and "GLOO_SOCKET_IFNAME" not in env
