"""The per-step trace: one JSON object per step (who ran, how many tokens, which blocks) and what
the scheduler decided in it and why (admitted, skipped for blocks, preempted for whom)."""
from __future__ import annotations

import json
from typing import IO

from kvflow.core.scheduler import RequestUpdate
from kvflow.core.scheduler_output import SchedulerOutput


class StepTrace:
    def __init__(self, path: str, budget: int, block_size: int, num_blocks: int) -> None:
        self._file: IO[str] = open(path, "w", encoding="utf-8")
        self._header = {"budget": budget, "block_size": block_size, "num_blocks": num_blocks}
        self._finished_last_step: set[str] = set()

    def record(self, out: SchedulerOutput, updates: list[RequestUpdate], start: float,
               step_time: float, num_free_blocks: int, num_cached_free_blocks: int = 0,
               kv_transfers: list[dict] | None = None) -> None:
        sampled = {u.request.request_id: u.new_token_ids[0] for u in updates if u.new_token_ids}
        # speculative decoding: drafts checked and accepted, per request that had drafts
        spec = {u.request.request_id: u for u in updates if u.num_draft_tokens}
        # finished_req_ids also repeats last step's finishes; only aborts since then are new here
        finished = sorted(out.finished_req_ids - self._finished_last_step)
        ended = [u.request.request_id for u in updates if u.finish_reason is not None]
        self._finished_last_step = set(ended)
        finished += ended
        resumed = set(out.resumed_req_ids)
        reqs = []
        for rid, n in out.num_scheduled_tokens.items():
            entry = {
                "id": rid,
                "phase": "prefill" if out.is_prefill[rid] else "decode",
                "tokens": n,
                "num_computed_tokens": out.num_computed_tokens[rid],
                "blocks": out.block_ids[rid],
                "sampled": sampled.get(rid),
            }
            if rid in spec:
                u = spec[rid]
                entry["drafted"] = u.num_draft_tokens
                entry["accepted"] = u.num_accepted_tokens
                entry["new_tokens"] = len(u.new_token_ids)
            if rid in out.num_cached_tokens:  # admitted this step
                entry["cached_tokens"] = out.num_cached_tokens[rid]
                entry["admitted"] = "resumed" if rid in resumed else "new"
            reqs.append(entry)
        record = {
            "step": out.step,
            "time": start,
            "step_time": step_time,
            "num_scheduled_tokens": out.total_num_scheduled_tokens,
            "requests": reqs,
            "preempted": list(out.preempted_req_ids),
            "finished": finished,
            "free_blocks": num_free_blocks,
            "cached_free_blocks": num_cached_free_blocks,
            **self._header,
        }
        # the decisions' reasons, where there are any
        if out.preempted_for:
            record["preempted_for"] = out.preempted_for
        if out.block_checks:
            record["block_checks"] = {rid: {"need": c.need, "free": c.free, "promised": c.promised}
                                      for rid, c in out.block_checks.items()}
        if out.skipped_req_ids:
            record["skipped"] = out.skipped_req_ids
        if out.prefix_cache_bypassed:
            record["prefix_cache_bypassed"] = out.prefix_cache_bypassed
        if out.admission_stop is not None:
            record["admission_stop"] = out.admission_stop.value
        # images: whose encoder ran (indices into each request's images), how many image
        # tokens that was, and whose chunk stopped short of an image run, and why
        if out.scheduled_encoder_inputs:
            record["encoder_inputs"] = out.scheduled_encoder_inputs
            record["num_encoder_tokens"] = out.num_encoder_tokens
        if out.encoder_cuts:
            record["encoder_cuts"] = out.encoder_cuts
        # prefill/decode disaggregation: pulls started, requests still waiting for their K/V,
        # and transfers that ended since the last traced step (loaded, failed, leases ended)
        if out.kv_loads:
            record["kv_loads"] = [{"id": ld.req_id, "blocks": len(ld.local_block_ids),
                                   "first_token": ld.first_token, "num_tokens": ld.num_tokens}
                                  for ld in out.kv_loads]
        if out.waiting_for_remote_kv_ids:
            record["waiting_for_remote_kv"] = out.waiting_for_remote_kv_ids
        if kv_transfers:
            record["kv_transfers"] = kv_transfers
        self._file.write(json.dumps(record) + "\n")
        self._file.flush()

    def close(self) -> None:
        self._file.close()
