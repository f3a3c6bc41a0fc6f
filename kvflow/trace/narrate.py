"""One plain sentence per step: what the scheduler decided and why (budget left, blocks given,
who waits and for what, who was preempted for whom, who finished and what was freed).

The decisions and their reasons are the scheduler's own, read from the step's trace record
(`admitted`, `block_checks`, `skipped`, `admission_stop`, `preempted_for`); a snapshot of the
queues taken just before the step says only who was there and how long each was, so that a
request the scheduler did not reach is named too."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvflow.core.scheduler_output import BlockCheck
from kvflow.trace.reader import RequestStep, Step
from kvflow.trace.table import block_ranges


@dataclass(slots=True)
class Queued:
    """A request as it stood just before a step."""

    id: str
    num_tokens: int  # prompt + output so far
    num_prompt_tokens: int
    num_computed_tokens: int
    resumed: bool = False  # waiting after a preemption
    priority: int = 0


@dataclass
class Before:
    """The queues just before a step, and the rules' settings that the sentences name."""

    arrived: list[str]
    running: list[Queued]
    waiting: list[Queued]
    max_num_seqs: int = 128
    policy: str = "fcfs"  # who is preempted: fcfs, the most recently admitted; priority, the lowest
    finish_reasons: dict[str, str] = field(default_factory=dict)  # filled after the step


def snapshot(sched, arrived: list[str] | None = None) -> Before:
    """The queues of a `Scheduler` now, before its next step."""
    def queued(req) -> Queued:
        return Queued(req.request_id, req.num_tokens, req.num_prompt_tokens,
                      req.num_computed_tokens, resumed=req.num_preemptions > 0,
                      priority=req.priority)

    return Before(list(arrived or []), [queued(r) for r in sched.running],
                  [queued(r) for r in sched.waiting], sched.config.max_num_seqs,
                  sched.config.policy)


def _s(n: int, word: str) -> str:
    return f"{n} {word}" if n == 1 else f"{n} {word}s"


def _are_free(n: int) -> str:
    return "none is free" if n <= 0 else ("1 is free" if n == 1 else f"{n} are free")


def _blocks_phrase(ids: list[int], new: bool = True) -> str:
    if not ids:
        return ""
    word = "block" if len(ids) == 1 else "blocks"
    return f"{'new ' if new else ''}{word} {block_ranges(ids)}"


def _fresh(r: RequestStep, block_size: int) -> list[int]:
    """Blocks newly taken from the pool (cache hits are reused, not new)."""
    hits = (r.cached_tokens or 0) // block_size
    return r.new_blocks[hits:] if hits else r.new_blocks


def _running_clause(r: RequestStep, q: Queued, left: int, block_size: int) -> str:
    fresh = _fresh(r, block_size)
    if r.phase == "decode" and r.drafted:
        return (f"{r.id} checks {r.drafted} draft tokens after its newest token and accepts "
                f"{r.accepted}" + (f", into {_blocks_phrase(fresh)}" if fresh else ""))
    if r.phase == "decode":
        return f"{r.id} decodes 1 token" + (f" into {_blocks_phrase(fresh)}" if fresh else "")
    remaining = q.num_tokens - q.num_computed_tokens
    where = f" into {_blocks_phrase(fresh)}" if fresh else ""
    if r.tokens == remaining:
        last = "its last prompt token" if r.tokens == 1 else f"its last {r.tokens} prompt tokens"
        what = f"{r.id} prefills {last}{where}"
        return what + (" and samples its first token" if r.sampled is not None else "")
    why = "all the budget left" if r.tokens == left else "its per-step cap"
    return f"{r.id} prefills {r.tokens} more of its {remaining} remaining prompt tokens ({why}){where}"


def _what_needs(q: Queued) -> str:
    return f"its {q.num_tokens} tokens need" if q.resumed else f"its {q.num_tokens}-token prompt needs"


def _against_free(check: BlockCheck, conj: str) -> str:
    """'3 blocks and 4 are free', from admission's own block check."""
    free = _are_free(check.free)
    if conj == "but" and check.free > 0:
        free = "only " + free
    promised = (f", {check.promised} of them promised to unfinished prompts"
                if check.promised > 0 else "")
    return f"{_s(check.need, 'block')} {conj} {free}{promised}"


def _admit_clause(r: RequestStep, q: Queued, came: str, check: BlockCheck | None, left: int,
                  block_size: int) -> str:
    fresh = _fresh(r, block_size)
    cached = r.cached_tokens or 0
    todo = q.num_tokens - cached
    resumed = r.admitted == "resumed" if r.admitted else q.resumed
    if resumed:
        head = f"{r.id} is resumed after its preemption"
        if cached:
            hits = r.new_blocks[:cached // block_size]
            head += (f": {cached} of its {q.num_tokens} tokens are still in the prefix cache "
                     f"({_blocks_phrase(hits, new=False)}), so it recomputes only the other {todo}")
        else:
            head += f" and recomputes its {q.num_tokens} tokens"
    elif cached:
        hits = r.new_blocks[:cached // block_size]
        head = (f"{r.id}{came} is admitted: {cached} of its {q.num_tokens} prompt tokens are in the "
                f"prefix cache ({_blocks_phrase(hits, new=False)})")
        if check is not None:
            head += f", the rest needs {_against_free(check, 'and')}"
    else:
        head = f"{r.id}{came} is admitted"
        if check is not None:
            head += f": {_what_needs(q)} {_against_free(check, 'and')}"
    parts = []
    if r.tokens < todo:
        why = "all the budget left" if r.tokens == left else "its per-step cap"
        parts.append(f"it prefills {r.tokens} of {todo} ({why}: chunked prefill)")
    elif not resumed:
        parts.append(f"it prefills the other {todo}" if cached else f"it prefills all {todo}")
    if fresh:
        parts.append(f"into {_blocks_phrase(fresh)}")
    if r.sampled is not None:
        first = q.num_tokens == q.num_prompt_tokens
        parts.append("and samples its first token" if first else "and samples its next token")
    sep = "; " if parts and parts[0].startswith("it ") else " "
    return (head + sep + " ".join(parts)).rstrip()


def _finish_clause(rid: str, reason: str | None, step: Step) -> str:
    why = {"length": " (max_tokens reached)", "stop": " (stop token)", "abort": " (aborted)"}.get(
        reason or "", "")
    freed = step.freed.get(rid, [])
    back = f" and returns {_blocks_phrase(freed, new=False)} to the pool" if freed else ""
    held = next((r.blocks for r in step.requests if r.id == rid), [])
    kept = [b for b in held if b not in freed]
    if kept:  # prefix-cache sharing: the blocks stay with whoever else holds them
        sharers = [r.id for r in step.requests if r.id != rid and set(r.blocks) & set(kept)]
        back += (f"; {_blocks_phrase(kept, new=False)} stay in use, shared with "
                 f"{', '.join(sharers) or 'other requests'}")
    return f"{rid} finishes{why}{back}"


def _preempt_clause(requester: str, victim: str, freed: list[int], before: Before) -> str:
    goes = "goes" if len(freed) == 1 else "go"
    back = f": {_blocks_phrase(freed, new=False)} {goes} back to the pool and" if freed else " and"
    if before.policy == "priority":
        prio = next((q.priority for q in before.running if q.id == victim), None)
        rule = "the lowest-priority running request" + (f" (priority {prio})" if prio is not None
                                                         else "")
    else:
        rule = "the most recently admitted request"
    if victim == requester:
        return (f"{victim} needs a new block and none is left for it, so {victim} itself, "
                f"{rule}, is preempted{back} {victim} will be recomputed later")
    return (f"{requester} needs a new block and none is left for it, so {rule}, {victim}, "
            f"is preempted{back} {victim} will be recomputed later")


def _running_phase(step: Step, before: Before, clauses: list[str]) -> int:
    """Running requests go first, in admission order; each preemption is told where the
    scheduler made it, for the request whose need caused it. Returns the budget left."""
    bs = step.block_size
    entries = {r.id: r for r in step.requests}
    left = step.budget
    caused: dict[str, list[str]] = {}
    for v in step.preempted:
        caused.setdefault(step.preempted_for.get(v, ""), []).append(v)
    told: set[str] = set()
    for q in before.running:
        if q.id in told:
            continue  # preempted for someone before it
        for v in caused.get(q.id, ()):
            told.add(v)
            clauses.append(_preempt_clause(q.id, v, step.freed.get(v, []), before))
        r = entries.get(q.id)
        if r is not None:
            clauses.append(_running_clause(r, q, left, bs))
            left -= r.tokens
        elif q.id not in step.preempted:
            clauses.append(f"{q.id} gets no tokens this step: the budget is used up")
    for v in step.preempted:  # a trace written before preempted_for was recorded
        if v not in told:
            clauses.append(f"{v} is preempted and will be recomputed later")
    return left


_STOPS = {
    "preemption": "nothing is admitted in a step that preempts",
    "budget": "no budget left",
    "encoder_budget": "the next image run does not fit what is left of the step's token or "
                      "encoder budget (a run is computed whole)",
}


_BYPASS = {"prompt_logprobs": "its prompt logprobs read every prompt position",
           "pooling": "its embedding pools every prompt position"}


def _admission_phase(step: Step, before: Before, left: int, clauses: list[str]) -> None:
    """Then waiting requests in queue order, each as admission decided: admitted when its whole
    remaining prompt fit in the blocks nobody was promised, skipped when not, or not reached
    (the step's `admission_stop` says why)."""
    bs = step.block_size
    entries = {r.id: r for r in step.requests}
    skipped = set(step.skipped)
    held = step.skipped[-1] if step.admission_stop == "held" and step.skipped else None
    for q in before.waiting:
        r = entries.get(q.id)
        came = " arrives and" if q.id in before.arrived else ""
        check = step.block_checks.get(q.id)
        if r is not None:
            clause = _admit_clause(r, q, came, check, left, bs)
            why = step.prefix_cache_bypassed.get(q.id)
            if why is not None:
                clause += (f" ({_BYPASS.get(why, why)}: it does not look up the prefix cache and "
                           "computes its whole prompt)")
            clauses.append(clause)
            left -= r.tokens
            continue
        waits = f"{q.id}{came} waits"
        if q.id in skipped:
            clauses.append(f"{waits}: {_what_needs(q)} " + (_against_free(check, "but") if check
                                                          else "more blocks than are free"))
        elif held is not None:
            clauses.append(f"{waits} behind {held}, which has been passed over long enough")
        elif step.admission_stop == "max_num_seqs":
            clauses.append(f"{waits}: {before.max_num_seqs} requests already run (max_num_seqs)")
        elif step.admission_stop in _STOPS:
            clauses.append(f"{waits}: {_STOPS[step.admission_stop]}")
        else:
            clauses.append(waits)


def narrate(step: Step, before: Before) -> str:
    """The sentence for `step`, given the queues just before it."""
    clauses: list[str] = []
    left = _running_phase(step, before, clauses)
    _admission_phase(step, before, left, clauses)
    for rid in step.finished:
        clauses.append(_finish_clause(rid, before.finish_reasons.get(rid), step))
    used, budget = step.num_scheduled_tokens, step.budget
    tail = f"budget: {used} of {budget} tokens used" + (f", {budget - used} left" if used < budget
                                                        else ", none left")
    tail += f"; {step.free_blocks} of {step.num_blocks} blocks free"
    if step.cached_free_blocks:
        n = step.cached_free_blocks
        tail += f" ({n} of them {'keeps' if n == 1 else 'keep'} a cached prefix)"
    sentence = "; ".join(clauses + [tail])
    return sentence[0].upper() + sentence[1:] + "."
