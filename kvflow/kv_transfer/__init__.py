"""Prefill/decode disaggregation: the request field that carries a transfer (`params`), the
producer's lease table (`lease`), the wire messages (`messages`) and the agent that serves and
pulls KV blocks over ZeroMQ or shared memory (`agent`). docs/disaggregation.md."""
