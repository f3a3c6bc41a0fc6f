"""KVConnector: what the engine core asks of anything that moves KV blocks beyond this
process (vLLM's `KVConnectorBase_V1` split). Prefill/decode transfer is one connector
(pd_connector.py); an offload tier would be another, behind the same hooks.

Scheduler-side hooks run on the engine core's thread around the scheduler's step; the
worker-side hook touches the KV cache itself. The scheduler keeps its own states for this
(`waiting_for_remote_kv`, leases, the step's `kv_loads`): a connector reads and answers them,
it never schedules."""
from __future__ import annotations

from kvflow.kv_transfer.params import KVTransferParams
from kvflow.kv_transfer.stats import KVTransferStats


class KVConnector:
    """The hooks, each a no-op here; a connector overrides those it needs."""

    # -- scheduler side: a request --------------------------------------------------------
    def check_request(self, prompt_token_ids: list[int], params) -> None:
        """ValueError (a 400) if this engine cannot do what the request's
        kv_transfer_params ask; run as the core queues it."""

    def request_refused(self, params: KVTransferParams) -> None:
        """A request carrying `params` was refused: let go of what it holds elsewhere."""

    def request_queued(self, request) -> None:
        """A request is in the scheduler's queue (for blocks, or for its KV to arrive)."""

    def requests_aborted(self, scheduler) -> None:
        """Requests ended by an abort: stop the work they were waiting for."""

    # -- scheduler side: the step ---------------------------------------------------------
    def before_schedule(self, scheduler) -> None:
        """Apply what finished since the last step (transfers done or failed, leases ended)."""

    def after_schedule(self, scheduler, sched_out) -> None:
        """Start the transfers the step planned."""

    def wait_idle(self, scheduler) -> None:
        """Nothing to run this step: wait briefly for news instead of spinning."""

    def after_update(self, scheduler) -> dict[str, KVTransferParams]:
        """After the step's tokens are applied: what each finished request's answer carries
        (request id -> where its blocks can be pulled from)."""
        return {}

    def take_trace_events(self) -> list[dict]:
        """Transfer events since the last call, for the step trace."""
        return []

    def stats(self, scheduler) -> KVTransferStats | None:
        return None

    # -- worker side ----------------------------------------------------------------------
    def write_received(self, event) -> None:
        """Write blocks that arrived into this engine's KV cache (ValueError: they do not fit)."""

    # -- the connector itself -------------------------------------------------------------
    @property
    def wakeup_socket(self):
        """Readable when the connector has news (the core loop polls it); None: never."""
        return None

    def describe(self) -> str:
        """The start-up line's words for it."""
        return ""

    def shutdown(self) -> None:
        pass
