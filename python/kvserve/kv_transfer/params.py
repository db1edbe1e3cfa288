"""`kv_transfer_params`: the handshake of vLLM's disaggregated serving, as its routers send it.

A router (vllm-router `--vllm-pd-disaggregation`, vLLM's toy proxies) sends the request to a
prefill engine with max_tokens 1 and {"do_remote_decode": true}; that engine answers with the
parameters a decode engine needs to pull the prompt's KV ({"do_remote_prefill": true,
"remote_host", "remote_port", "remote_request_id", ...}), and the router sends the original
request to the decode engine with them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass


@dataclass(frozen=True)
class KVTransferParams:
    """A request's part in a transfer. do_remote_decode: compute the prompt here and hold its KV
    for a decode engine to pull (the producer). do_remote_prefill: pull the prompt's KV from the
    producer named by remote_host/remote_port/remote_request_id instead of computing it (the
    consumer). remote_engine_id names the producer (a check that the pull reaches the engine
    that holds the request); remote_block_ids are the producer's blocks, informational."""

    do_remote_decode: bool = False
    do_remote_prefill: bool = False
    remote_engine_id: str | None = None
    remote_request_id: str | None = None
    remote_host: str | None = None
    remote_port: int | None = None
    remote_block_ids: list | None = None
    tp_size: int = 1

    @classmethod
    def from_dict(cls, value: dict | "KVTransferParams" | None) -> "KVTransferParams | None":
        """Parses a request's kv_transfer_params (unknown keys, such as other connectors'
        fields, are ignored; null values are absent). Raises ValueError for a malformed one."""
        if value is None or isinstance(value, KVTransferParams):
            return value
        if not isinstance(value, dict):
            raise ValueError(f"kv_transfer_params must be an object, got {type(value).__name__}")
        fields = {k: v for k, v in value.items() if k in cls.__dataclass_fields__ and v is not None}
        for name in ("do_remote_decode", "do_remote_prefill"):
            if not isinstance(fields.get(name, False), bool):
                raise ValueError(f"kv_transfer_params.{name} must be a boolean")
        for name in ("remote_engine_id", "remote_request_id", "remote_host"):
            if not isinstance(fields.get(name, ""), str):
                raise ValueError(f"kv_transfer_params.{name} must be a string")
        port = fields.get("remote_port", 1)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise ValueError(f"kv_transfer_params.remote_port must be a port number, got {port!r}")
        tp = fields.get("tp_size", 1)
        if tp != 1:
            raise ValueError(f"kv_transfer_params.tp_size {tp!r}: only producers of one rank "
                             "are supported")
        params = cls(**fields)
        if params.do_remote_decode and params.do_remote_prefill:
            raise ValueError("kv_transfer_params: do_remote_decode and do_remote_prefill are "
                             "exclusive (a request is either prefilled here or pulled here)")
        if params.do_remote_prefill:
            missing = [n for n in ("remote_host", "remote_port", "remote_request_id")
                       if getattr(params, n) is None]
            if missing:
                raise ValueError(f"kv_transfer_params with do_remote_prefill needs "
                                 f"{', '.join(missing)} (the producer's answer)")
        return params

    def to_dict(self) -> dict:
        return asdict(self)
