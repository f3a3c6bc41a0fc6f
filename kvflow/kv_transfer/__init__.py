"""Prefill/decode disaggregation: the request field that carries a transfer (`params`), the
producer's lease table (`lease`), the wire messages (`messages`), the raw bytes (`blocks`),
shared-memory staging (`shm`) and the agent that serves and pulls KV blocks (`agent`).
docs/disaggregation.md."""
