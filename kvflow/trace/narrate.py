"""One plain sentence per step: what the scheduler decided and why (budget left, blocks given,
who waits and for what, who finished and what was freed).

The sentence is built from the step's trace record plus a snapshot of the queues taken just
before the step; the arithmetic follows the scheduler's rules (DESIGN.md, "The core's
contract") so every number in it can be checked against the table above it."""
from __future__ import annotations

from dataclasses import dataclass, field

from kvflow.trace.reader import RequestStep, Step
from kvflow.trace.table import block_ranges


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(slots=True)
class Queued:
    """A request as it stood just before a step."""

    id: str
    num_tokens: int  # prompt + output so far
    num_prompt_tokens: int
    num_computed_tokens: int
    num_blocks: int  # blocks it holds
    resumed: bool = False  # waiting after a preemption
    need_blocks: int = 0  # waiting only: free blocks admission would take for the whole prompt
    evictable: int = 0  # waiting only: of those, cache hits sitting in the free queue
    cached_tokens: int = 0  # waiting only: prompt tokens the prefix cache would give it
    num_skips: int = 0


@dataclass
class Before:
    """The queues and the pool just before a step."""

    arrived: list[str]
    running: list[Queued]
    waiting: list[Queued]
    free_blocks: int
    max_num_seqs: int = 128
    max_admission_skips: int = 16
    finish_reasons: dict[str, str] = field(default_factory=dict)  # filled after the step


def snapshot(sched, arrived: list[str] | None = None) -> Before:
    """The queues and the pool of a `Scheduler` now, before its next step."""
    kv = sched.kv_cache_manager

    def queued(req, waiting: bool) -> Queued:
        q = Queued(req.request_id, req.num_tokens, req.num_prompt_tokens, req.num_computed_tokens,
                   len(kv.get_block_ids(req.request_id)), resumed=req.num_preemptions > 0,
                   num_skips=req.num_skips)
        if waiting:  # the admission arithmetic of Scheduler._admit, through public methods
            computed, q.cached_tokens = kv.get_computed_blocks(req)
            q.evictable = kv.num_evictable(computed)
            q.need_blocks = kv.num_blocks_needed(req, req.num_tokens) - len(computed) + q.evictable
        return q

    return Before(list(arrived or []), [queued(r, False) for r in sched.running],
                  [queued(r, True) for r in sched.waiting], kv.num_free_blocks,
                  sched.config.max_num_seqs, sched.config.max_admission_skips)


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


def _admit_clause(r: RequestStep, q: Queued, came: str, free: int, left: int, block_size: int) -> str:
    fresh = _fresh(r, block_size)
    cached = r.cached_tokens or 0
    todo = q.num_tokens - cached
    if q.resumed:
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
                f"prefix cache ({_blocks_phrase(hits, new=False)}), the rest needs "
                f"{_s(q.need_blocks, 'block')} and {_are_free(free)}")
    else:
        head = (f"{r.id}{came} is admitted: its {q.num_tokens}-token prompt needs "
                f"{_s(q.need_blocks, 'block')} and {_are_free(free)}")
    parts = []
    if r.tokens < todo:
        why = "all the budget left" if r.tokens == left else "its per-step cap"
        parts.append(f"it prefills {r.tokens} of {todo} ({why}: chunked prefill)")
    elif not q.resumed:
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


def _preempt_clause(requester: str, victim: str, freed: list[int]) -> str:
    goes = "goes" if len(freed) == 1 else "go"
    back = f": {_blocks_phrase(freed, new=False)} {goes} back to the pool and" if freed else " and"
    if victim == requester:
        return (f"{victim} needs a new block for its next token and none is free, so {victim}, "
                f"the most recently admitted, is preempted{back} {victim} will be recomputed later")
    return (f"{requester} needs a new block and none is free, so the most recently admitted "
            f"request, {victim}, is preempted{back} {victim} will be recomputed later")


def _running_phase(step: Step, before: Before, clauses: list[str]) -> tuple[int, int]:
    """Running requests go first, in admission order; when one lacks a block, the most recently
    admitted is preempted. Returns the budget and free blocks left for admission."""
    bs = step.block_size
    entries = {r.id: r for r in step.requests}
    left, free = step.budget, before.free_blocks
    victims = list(step.preempted)
    gone: set[str] = set()
    for q in before.running:
        r = entries.get(q.id)
        if q.id in gone:
            continue  # preempted for someone else
        if r is None and q.id not in victims:
            clauses.append(f"{q.id} gets no tokens this step: the budget is used up")
            continue
        need = len(_fresh(r, bs)) if r is not None else 1
        while victims and (r is None or need > free):
            v = victims.pop(0)
            gone.add(v)
            free += len(step.freed.get(v, []))
            clauses.append(_preempt_clause(q.id, v, step.freed.get(v, [])))
            if v == q.id:
                break
        if r is not None:
            clauses.append(_running_clause(r, q, left, bs))
            free -= need
            left -= r.tokens
    return left, free


def _admission_phase(step: Step, before: Before, left: int, free: int, clauses: list[str]) -> None:
    """Then waiting requests in queue order while budget, max_num_seqs and blocks allow; a request
    is admitted only if its whole remaining prompt fits in the blocks nobody was promised."""
    bs = step.block_size
    entries = {r.id: r for r in step.requests}
    sizes = {q.id: q.num_tokens for q in before.running}
    pending = sum(cdiv(sizes[r.id], bs) - len(r.blocks) for r in step.requests
                  if r.id in sizes and r.phase == "prefill"
                  and r.num_computed_tokens + r.tokens < sizes[r.id])
    num_running = len(before.running) - len(step.preempted)
    blocked_by = None
    for q in before.waiting:
        r = entries.get(q.id)
        came = " arrives and" if q.id in before.arrived else ""
        if r is not None:
            clauses.append(_admit_clause(r, q, came, free, left, bs))
            free -= len(_fresh(r, bs)) + q.evictable
            pending += cdiv(q.num_tokens, bs) - len(r.blocks)
            left -= r.tokens
            num_running += 1
            continue
        waits = f"{q.id}{came} waits"
        if step.preempted:
            clauses.append(f"{waits}: nothing is admitted in a step that preempts")
        elif blocked_by is not None:
            clauses.append(f"{waits} behind {blocked_by}, which has been passed over long enough")
        elif left <= 0:
            clauses.append(f"{waits}: no budget left")
        elif num_running >= before.max_num_seqs:
            clauses.append(f"{waits}: {before.max_num_seqs} requests already run (max_num_seqs)")
        else:
            what = (f"its {q.num_tokens} tokens need" if q.resumed
                    else f"its {q.num_tokens}-token prompt needs")
            free_now = _are_free(free) if free <= 0 else "only " + _are_free(free)
            promised = f", {pending} of them promised to unfinished prompts" if pending > 0 else ""
            clauses.append(f"{waits}: {what} {_s(q.need_blocks, 'block')} but {free_now}{promised}")
            if q.num_skips >= before.max_admission_skips:
                blocked_by = q.id


def narrate(step: Step, before: Before) -> str:
    """The sentence for `step`, given the queues just before it."""
    clauses: list[str] = []
    left, free = _running_phase(step, before, clauses)
    _admission_phase(step, before, left, free, clauses)
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
