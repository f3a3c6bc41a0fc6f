"""LoRA adapters kept alike on every tensor- and pipeline-parallel rank.

The driver reads and checks an adapter first (a bad one is refused there, and nothing is sent);
then a LoRAUpdate goes to every rank in the step stream, between the steps already sent and
the next one, so each rank registers it at the same point of the step sequence. Slots are
assigned per step from the step's adapters and the rank's own history of steps, adds and
removes (model/lora.py's LoRASlots), which is the same on every rank: no slot numbers travel.
Each rank reads the adapter from the path it was given, keeps its part (model/lora_shard.py)
and answers in the rendezvous store; where one cannot, the driver drops the adapter on every
rank and refuses the load (a ValueError naming the rank), and the engine goes on."""
from __future__ import annotations

import time

from kvflow.distributed.messages import LoRAUpdate


def reply_key(seq: int, rank: int) -> str:
    return f"lora/{seq}/{rank}"


def apply_lora_update(runner, update: LoRAUpdate, store, rank: int) -> None:
    """On a rank other than the driver: drop, then register, as the driver did; answer."""
    lora = runner.lora
    errors = []
    for lid in update.remove:
        if lora is not None:
            lora.remove(lid)
    for request in update.add:
        try:
            if lora is None:
                raise ValueError("this rank has no LoRA slots (enable_lora)")
            lora.add(request)
        except Exception as e:  # noqa: BLE001 - the driver reports it and refuses the load
            errors.append(f"{type(e).__name__}: {e}" if not isinstance(e, ValueError) else str(e))
    if update.seq:
        store.set(reply_key(update.seq, rank), "; ".join(errors))


def wait_for_replies(store, seq: int, ranks: range, check_health, timeout_s: float) -> dict[int, str]:
    """Every rank's answer to update `seq`: rank -> why it could not load (ranks that did are
    left out). `check_health` raises when a rank has died; TimeoutError past `timeout_s`."""
    pending, errors = set(ranks), {}
    deadline = time.monotonic() + timeout_s
    while pending:
        for r in sorted(pending):
            key = reply_key(seq, r)
            if store.check([key]):
                why = store.get(key).decode()
                store.delete_key(key)
                pending.discard(r)
                if why:
                    errors[r] = why
        if pending:
            check_health()
            if time.monotonic() > deadline:
                raise TimeoutError(f"ranks {sorted(pending)} did not answer within {timeout_s:.0f}s")
            time.sleep(0.01)
    return errors
