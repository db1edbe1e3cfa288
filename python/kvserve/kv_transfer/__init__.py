"""Prefill/decode disaggregation: a request's prompt KV computed by one engine (the producer)
and pulled into another's blocks (the consumer), driven by vLLM's `kv_transfer_params`."""

from kvserve.kv_transfer.connector import KVConnector, TorchDistributedConnector
from kvserve.kv_transfer.params import KVTransferParams

__all__ = ["KVConnector", "KVTransferParams", "TorchDistributedConnector"]
