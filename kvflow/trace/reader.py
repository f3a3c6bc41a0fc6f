"""Load a step trace (JSONL, one object per engine step) into plain dataclasses.

Each line holds the step's plan and the scheduler's reasons for it (admitted, skipped for
blocks, preempted for whom; traces written before those were recorded load with them empty).
Besides what each line records, loading derives what a reader of the trace asks next: which
blocks each request was given in a step, and which blocks a finish or a preemption returned
to the pool."""
from __future__ import annotations

import json
from dataclasses import dataclass, field

from kvflow.core.scheduler_output import BlockCheck


@dataclass(slots=True)
class RequestStep:
    """One request's part in one step."""

    id: str
    phase: str  # "prefill" | "decode"
    tokens: int  # tokens computed this step
    num_computed_tokens: int  # before this step
    blocks: list[int]  # the whole block table after this step's allocation
    sampled: int | None  # token sampled at the end of this step, if any
    cached_tokens: int | None = None  # prompt tokens found in the prefix cache (admitted only)
    admitted: str | None = None  # "new" | "resumed" when admitted in this step
    new_blocks: list[int] = field(default_factory=list)  # derived: allocated in this step
    drafted: int = 0  # speculative decoding: drafts checked this step
    accepted: int = 0  # of which accepted


@dataclass(slots=True)
class Step:
    """One engine step as the trace recorded it."""

    step: int
    time: float
    step_time: float
    num_scheduled_tokens: int
    budget: int
    block_size: int
    num_blocks: int
    free_blocks: int  # after the step (finished requests' blocks already returned)
    preempted: list[str]
    finished: list[str]
    requests: list[RequestStep]
    cached_free_blocks: int | None = None  # free blocks still holding a cached prefix
    # the scheduler's reasons: preempted id -> whose need for a block preempted it; the block
    # check of each waiting request admission weighed; who was skipped for lack of blocks; why
    # admission stopped short of the end of the queue (an AdmissionStop value)
    preempted_for: dict[str, str] = field(default_factory=dict)
    block_checks: dict[str, BlockCheck] = field(default_factory=dict)
    skipped: list[str] = field(default_factory=list)
    admission_stop: str | None = None
    # admitted id -> why it did not look up the prefix cache ("prompt_logprobs", "pooling")
    prefix_cache_bypassed: dict[str, str] = field(default_factory=dict)
    # derived: id -> blocks its finish or preemption returned to the pool (shared ones stay)
    freed: dict[str, list[int]] = field(default_factory=dict)
    # prefill/decode disaggregation: pulls planned in the step, and transfers that ended (dicts
    # with "id" and "event": lent, loaded, load_failed, load_cancelled, lease_done, ...)
    kv_loads: list[dict] = field(default_factory=list)
    kv_transfers: list[dict] = field(default_factory=list)
    # images: id -> the indices of its images encoded in the step; id -> why its chunk stopped
    # short of an image run ("image_run": tokens, "encoder_budget": the encoder's)
    encoder_inputs: dict[str, list[int]] = field(default_factory=dict)
    encoder_cuts: dict[str, str] = field(default_factory=dict)

    @property
    def used_blocks(self) -> int:
        return self.num_blocks - self.free_blocks

    @property
    def prefill_tokens(self) -> int:
        return sum(r.tokens for r in self.requests if r.phase == "prefill")

    @property
    def decode_tokens(self) -> int:
        return sum(r.tokens for r in self.requests if r.phase == "decode")


@dataclass
class Trace:
    steps: list[Step]

    @property
    def request_ids(self) -> list[str]:
        """Every request that ran, in order of first appearance."""
        seen: dict[str, None] = {}
        for s in self.steps:
            for r in s.requests:
                seen.setdefault(r.id, None)
        return list(seen)

    @property
    def budget(self) -> int:
        return self.steps[0].budget if self.steps else 0

    @property
    def num_blocks(self) -> int:
        return self.steps[0].num_blocks if self.steps else 0


_REQUIRED = ("step", "num_scheduled_tokens", "budget", "block_size", "num_blocks",
             "free_blocks", "requests")


def parse_step(obj: dict) -> Step:
    missing = [k for k in _REQUIRED if k not in obj]
    if missing:
        raise ValueError(f"missing field(s) {', '.join(missing)}")
    reqs = [RequestStep(str(r["id"]), r["phase"], int(r["tokens"]), int(r["num_computed_tokens"]),
                        list(r["blocks"]), r.get("sampled"), r.get("cached_tokens"), r.get("admitted"),
                        drafted=int(r.get("drafted", 0)), accepted=int(r.get("accepted", 0)))
            for r in obj["requests"]]
    checks = {str(rid): BlockCheck(int(c["need"]), int(c["free"]), int(c["promised"]))
              for rid, c in obj.get("block_checks", {}).items()}
    return Step(int(obj["step"]), float(obj.get("time", 0.0)), float(obj.get("step_time", 0.0)),
                int(obj["num_scheduled_tokens"]), int(obj["budget"]), int(obj["block_size"]),
                int(obj["num_blocks"]), int(obj["free_blocks"]), [str(i) for i in obj.get("preempted", [])],
                [str(i) for i in obj.get("finished", [])], reqs, obj.get("cached_free_blocks"),
                {str(v): str(r) for v, r in obj.get("preempted_for", {}).items()}, checks,
                [str(i) for i in obj.get("skipped", [])], obj.get("admission_stop"),
                prefix_cache_bypassed={str(k): str(v) for k, v
                                       in obj.get("prefix_cache_bypassed", {}).items()},
                kv_loads=[d for d in obj.get("kv_loads", []) if isinstance(d, dict) and "id" in d],
                kv_transfers=[d for d in obj.get("kv_transfers", [])
                              if isinstance(d, dict) and "id" in d and "event" in d],
                encoder_inputs={str(k): [int(i) for i in v]
                                for k, v in obj.get("encoder_inputs", {}).items()},
                encoder_cuts={str(k): str(v) for k, v in obj.get("encoder_cuts", {}).items()})


def _release(tables: dict[str, list[int]], rid: str) -> list[int]:
    """Drop `rid`'s table; the blocks that no other request holds (prefix-cache sharing) are
    the ones that go back to the pool."""
    blocks = tables.pop(rid, [])
    shared = {b for t in tables.values() for b in t}
    return [b for b in blocks if b not in shared]


def derive(steps: list[Step]) -> list[Step]:
    """Fill `new_blocks` and `freed`, and report each finish once.

    A request that finishes in step k is also listed in step k+1's `finished` (the scheduler
    tells the runner to drop it then); only the first mention counts."""
    tables: dict[str, list[int]] = {}  # request id -> its block table as last seen
    done: set[str] = set()
    for s in steps:
        for rid in s.preempted:
            s.freed[rid] = _release(tables, rid)
        for r in s.requests:
            held = set(tables.get(r.id, ()))
            r.new_blocks = [b for b in r.blocks if b not in held]
            tables[r.id] = r.blocks
            done.discard(r.id)  # an id seen running again is a new life of that id
        finished = []
        for rid in s.finished:
            if rid in done:
                continue
            done.add(rid)
            finished.append(rid)
            s.freed[rid] = _release(tables, rid)
        s.finished = finished
    return steps


def load_trace(path: str) -> Trace:
    """Read a JSONL step trace; ValueError naming the line if one is not a step."""
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise ValueError(f"cannot read trace {path!r}: {e.strerror}") from None
    steps = []
    with f:
        for n, line in enumerate(f, 1):
            if not line.strip():
                continue
            try:
                steps.append(parse_step(json.loads(line)))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(f"{path}:{n}: not a kvflow step record ({e})") from None
    return Trace(derive(steps))


def parse_step_range(spec: str | None) -> tuple[int | None, int | None]:
    """'3:10' -> (3, 10) (end exclusive, as in Python); '5' -> (5, 6); ':4' and '7:' are open."""
    if not spec:
        return None, None
    try:
        if ":" not in spec:
            n = int(spec)
            return n, n + 1
        lo, hi = spec.split(":", 1)
        return (int(lo) if lo.strip() else None), (int(hi) if hi.strip() else None)
    except ValueError:
        raise ValueError(f"--steps expects START:END (end exclusive) or N, got {spec!r}") from None


def select(trace: Trace, requests: list[str] | None = None,
           steps: tuple[int | None, int | None] = (None, None)) -> list[Step]:
    """The steps in range that involve any of `requests` (ran, finished or were preempted),
    each keeping only those requests. Step totals, budget and free blocks stay the step's own."""
    lo, hi = steps
    wanted = set(requests) if requests else None
    out = []
    for s in trace.steps:
        if (lo is not None and s.step < lo) or (hi is not None and s.step >= hi):
            continue
        if wanted is None:
            out.append(s)
            continue
        reqs = [r for r in s.requests if r.id in wanted]
        pre = [i for i in s.preempted if i in wanted]
        fin = [i for i in s.finished if i in wanted]
        if reqs or pre or fin:
            out.append(Step(s.step, s.time, s.step_time, s.num_scheduled_tokens, s.budget,
                            s.block_size, s.num_blocks, s.free_blocks, pre, fin, reqs,
                            s.cached_free_blocks,
                            {k: v for k, v in s.preempted_for.items() if k in wanted},
                            {k: v for k, v in s.block_checks.items() if k in wanted},
                            [i for i in s.skipped if i in wanted], s.admission_stop,
                            {k: v for k, v in s.prefix_cache_bypassed.items() if k in wanted},
                            freed={k: v for k, v in s.freed.items() if k in wanted},
                            encoder_inputs={k: v for k, v in s.encoder_inputs.items() if k in wanted},
                            encoder_cuts={k: v for k, v in s.encoder_cuts.items() if k in wanted}))
    return out
