"""`--splitwise-role` and `--kv-transfer-config` (vLLM's JSON shape), and the `kv_transfer_params` a
request carries (vLLM's NixlConnector fields, which vllm-router forwards between the two servers).

What the router sends (vllm-router 0.1.17, `--vllm-pd-disaggregation --kv-connector nixl`):
- to the prefill server, the client's body with max_tokens=1, stream=false and
  `kv_transfer_params = {"do_remote_decode": true, "do_remote_prefill": false, "remote_*": null}`;
- to the decode server, the client's body with the `kv_transfer_params` of the prefill answer.
The prefill answer's `kv_transfer_params` is ours to fill: vLLM's fields (`do_remote_prefill`,
`remote_engine_id`, `remote_request_id`, `remote_host`, `remote_port`, `remote_block_ids`, `tp_size`)
plus `remote_num_tokens`, the tokens whose KV `remote_block_ids` holds (prompt - 1: the decode server
computes the last prompt token itself, as vLLM's does, and samples the first output token).
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Optional, Union

from fastdeploy.json_flag import json_object

SPLITWISE_ROLES = ("mixed", "prefill", "decode")
CONNECTORS = ("NixlConnector",)
KV_ROLES = ("kv_both", "kv_producer", "kv_consumer")
FAILURE_POLICIES = ("recompute", "fail")
DEFAULT_SIDE_CHANNEL_PORT = 5600      # vLLM's VLLM_NIXL_SIDE_CHANNEL_PORT default
DEFAULT_ABORT_TIMEOUT_S = 480.0       # vLLM's VLLM_NIXL_ABORT_REQUEST_TIMEOUT default
DEFAULT_HANDSHAKE_TIMEOUT_S = 10.0
DEFAULT_TRANSFER_TIMEOUT_S = 60.0


@dataclass(frozen=True)
class KVTransferConfig:
    """What one server does in a disaggregated deployment and how its transfer engine is reached."""

    splitwise_role: str = "mixed"      # upstream FastDeploy: prefill | decode | mixed (both, or neither)
    kv_connector: str = "NixlConnector"
    kv_role: str = "kv_both"
    engine_id: str = ""                # "" = made up at start-up
    side_channel_host: str = "127.0.0.1"  # where the decode server reaches this server's side channel
    side_channel_port: int = DEFAULT_SIDE_CHANNEL_PORT
    kv_load_failure_policy: str = "recompute"  # a decode request whose transfer fails: recompute | fail
    abort_timeout_s: float = DEFAULT_ABORT_TIMEOUT_S   # a prefill's pages are freed if nobody read them by then
    handshake_timeout_s: float = DEFAULT_HANDSHAKE_TIMEOUT_S
    transfer_timeout_s: float = DEFAULT_TRANSFER_TIMEOUT_S

    @property
    def produces(self) -> bool:
        """Takes prefill requests whose KV a decode server reads (do_remote_decode)."""
        return self.splitwise_role != "decode" and self.kv_role != "kv_consumer"

    @property
    def consumes(self) -> bool:
        """Takes decode requests whose prompt KV it reads from a prefill server (do_remote_prefill)."""
        return self.splitwise_role != "prefill" and self.kv_role != "kv_producer"

    @classmethod
    def parse(cls, splitwise_role: str, text: Union[None, str, dict]) -> Optional["KVTransferConfig"]:
        """None for a plain server (role mixed, no config); ValueError naming the bad field otherwise."""
        if splitwise_role not in SPLITWISE_ROLES:
            raise ValueError(f"--splitwise-role must be one of {', '.join(SPLITWISE_ROLES)}, got {splitwise_role!r}")
        if text is None:
            if splitwise_role == "mixed":
                return None
            text = {}
        spec = dict(json_object(text, "--kv-transfer-config", "of vLLM's KVTransferConfig fields"))
        extra = spec.pop("kv_connector_extra_config", None) or {}
        if not isinstance(extra, dict):
            raise ValueError("--kv-transfer-config: kv_connector_extra_config must be a JSON object")
        # Fields of vLLM's KVTransferConfig this engine does not use are accepted and ignored.
        for ignored in ("kv_buffer_device", "kv_buffer_size", "kv_rank", "kv_parallel_size", "kv_ip", "kv_port",
                        "kv_connector_module_path", "enable_permute_local_kv"):
            spec.pop(ignored, None)
        fields = {**spec, **extra}
        env_port = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_PORT")
        env_host = os.environ.get("VLLM_NIXL_SIDE_CHANNEL_HOST")
        kw = dict(splitwise_role=splitwise_role)
        if env_host:
            kw["side_channel_host"] = env_host
        if env_port:
            kw["side_channel_port"] = env_port
        names = {f for f in cls.__dataclass_fields__ if f != "splitwise_role"}
        unknown = sorted(set(fields) - names)
        if unknown:
            raise ValueError(f"--kv-transfer-config: unknown field(s) {', '.join(unknown)} (known: "
                             f"{', '.join(sorted(names))})")
        kw.update(fields)
        config = cls(**kw)
        return config._checked()

    def _checked(self) -> "KVTransferConfig":
        if self.kv_connector not in CONNECTORS:
            raise ValueError(f"--kv-transfer-config: kv_connector {self.kv_connector!r} is not built here "
                             f"(only {', '.join(CONNECTORS)})")
        if self.kv_role not in KV_ROLES:
            raise ValueError(f"--kv-transfer-config: kv_role must be one of {', '.join(KV_ROLES)}")
        if self.kv_load_failure_policy not in FAILURE_POLICIES:
            raise ValueError(f"--kv-transfer-config: kv_load_failure_policy must be one of "
                             f"{', '.join(FAILURE_POLICIES)}")
        try:
            port = int(self.side_channel_port)
        except (TypeError, ValueError):
            raise ValueError(f"side_channel_port must be a port number, got {self.side_channel_port!r}") from None
        if not 0 <= port < 65536:
            raise ValueError(f"side_channel_port must be in 1..65535 (0: any free port), got {port}")
        for name in ("abort_timeout_s", "handshake_timeout_s", "transfer_timeout_s"):
            value = getattr(self, name)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"--kv-transfer-config: {name} must be a positive number of seconds")
        if not self.produces and not self.consumes:
            raise ValueError(f"--splitwise-role {self.splitwise_role} with kv_role {self.kv_role} can neither "
                             f"send nor receive KV")
        object.__setattr__(self, "side_channel_port", port)
        return self


@dataclass(frozen=True)
class RemotePrefill:
    """A decode request's source of KV: the prefill server's parked pages (its kv_transfer_params)."""

    engine_id: str
    request_id: str
    host: str
    port: int
    rows: list          # per table row, the prefill's entries for tokens [0, num_tokens): -1 = not sent
    num_tokens: int     # tokens whose KV the rows hold
    tp_size: int = 1


def parse_kv_transfer_params(params, config: Optional[KVTransferConfig], num_prompt_tokens: int):
    """What a request's kv_transfer_params ask of this server: "hand_off" (prefill: keep the pages for the
    decode server), a RemotePrefill (decode: read them), or None (a plain request). ValueError with the
    client's mistake otherwise (a 400)."""
    if params is None:
        return None
    if not isinstance(params, dict):
        raise ValueError("kv_transfer_params must be a JSON object")
    remote_decode, remote_prefill = params.get("do_remote_decode"), params.get("do_remote_prefill")
    for name, value in (("do_remote_decode", remote_decode), ("do_remote_prefill", remote_prefill)):
        if value is not None and not isinstance(value, bool):
            raise ValueError(f"kv_transfer_params.{name} must be true or false")
    if not remote_decode and not remote_prefill:
        return None
    if remote_decode and remote_prefill:
        raise ValueError("kv_transfer_params: do_remote_decode and do_remote_prefill cannot both be true")
    if config is None:
        raise ValueError("kv_transfer_params: this server moves no KV (start it with --splitwise-role and "
                         "--kv-transfer-config)")
    if remote_decode:
        if not config.produces:
            raise ValueError(f"kv_transfer_params.do_remote_decode: this server's role is {config.splitwise_role}; "
                             f"it does not hand KV to a decode server")
        return "hand_off"
    if not config.consumes:
        raise ValueError(f"kv_transfer_params.do_remote_prefill: this server's role is {config.splitwise_role}; it "
                         f"does not read KV from a prefill server")
    return _remote_prefill(params, num_prompt_tokens)


def _remote_prefill(params: dict, num_prompt_tokens: int) -> RemotePrefill:
    def field(name, kind, what):
        value = params.get(name)
        if not isinstance(value, kind) or isinstance(value, bool):
            raise ValueError(f"kv_transfer_params.{name} must be {what} (do_remote_prefill needs the prefill "
                             f"server's answer), got {value!r}")
        return value

    engine_id = field("remote_engine_id", str, "a string")
    request_id = field("remote_request_id", str, "a string")
    host = field("remote_host", str, "a host name or address")
    port = field("remote_port", int, "a port number")
    if not 0 < port < 65536:
        raise ValueError(f"kv_transfer_params.remote_port must be in 1..65535, got {port}")
    num_tokens = field("remote_num_tokens", int, "the number of tokens the blocks hold")
    tp_size = params.get("tp_size", 1)
    if not isinstance(tp_size, int) or isinstance(tp_size, bool) or tp_size < 1:
        raise ValueError(f"kv_transfer_params.tp_size must be a positive integer, got {tp_size!r}")
    rows = params.get("remote_block_ids")
    if not isinstance(rows, list) or not rows or not all(
            isinstance(row, list) and all(isinstance(b, int) and not isinstance(b, bool) and b >= -1 for b in row)
            for row in rows):
        raise ValueError("kv_transfer_params.remote_block_ids must be a non-empty list of lists of block ids "
                         "(-1 for a page not sent)")
    if num_tokens != num_prompt_tokens - 1:
        raise ValueError(f"kv_transfer_params.remote_num_tokens is {num_tokens}, but this prompt has "
                         f"{num_prompt_tokens} tokens here (the prefill server's KV covers prompt - 1 tokens): "
                         f"the two servers tokenized different prompts")
    return RemotePrefill(engine_id, request_id, host, port, rows, num_tokens, tp_size)
