"""The step table: one row per step, one line in it per request (`B: prefill 7`, `A: decode 1`),
with the token sampled, the block table, the step's total against the budget, free blocks,
preemptions and finishes. Rendered as aligned text, GitHub markdown or CSV."""
from __future__ import annotations

import csv
import io
from collections.abc import Callable

from kvflow.trace.reader import RequestStep, Step

FORMATS = ("text", "markdown", "csv")
TokenText = Callable[[int], str]

REQUEST_COLUMNS = ("scheduled", "sampled", "blocks")
STEP_COLUMNS = ("tokens/budget", "free/total", "events")
HEADER = ("step",) + REQUEST_COLUMNS + STEP_COLUMNS


def block_ranges(ids: list[int]) -> str:
    """[0, 1, 2, 3, 8, 9] -> '0-3,8-9': block tables are mostly runs of consecutive ids."""
    parts: list[str] = []
    start = prev = None
    for b in ids:
        if prev is not None and b == prev + 1:
            prev = b
            continue
        if start is not None:
            parts.append(f"{start}" if start == prev else f"{start}-{prev}")
        start = prev = b
    if start is not None:
        parts.append(f"{start}" if start == prev else f"{start}-{prev}")
    return ",".join(parts)


def _scheduled(r: RequestStep) -> str:
    cached = f" (cached {r.cached_tokens})" if r.cached_tokens else ""
    return f"{r.id}: {r.phase} {r.tokens}{cached}"


def _sampled(r: RequestStep, token_text: TokenText | None) -> str:
    if r.sampled is None:
        return "-"
    return repr(token_text(r.sampled)) if token_text else str(r.sampled)


def _blocks(r: RequestStep) -> str:
    return f"{len(r.blocks)} [{block_ranges(r.blocks)}]"


def events(s: Step) -> str:
    """'preempted C (freed 6-8); finished A (freed 0-5)'; with disaggregation also 'finished A
    (lent 0-5)', 'B: pulling (3 blocks)', 'B: loaded (3 blocks)', 'A: lease_done'."""
    parts = []
    lent = {t["id"] for t in s.kv_transfers if t["event"] == "lent"}
    for kind, ids in (("preempted", s.preempted), ("finished", s.finished)):
        for rid in ids:
            freed = s.freed.get(rid)
            verb = "lent" if rid in lent else "freed"  # kept for a decode instance
            parts.append(f"{kind} {rid}" + (f" ({verb} {block_ranges(freed)})" if freed else ""))
    for ld in s.kv_loads:
        parts.append(f"pulling {ld['id']} ({ld.get('blocks', '?')} blocks)")
    for t in s.kv_transfers:
        if t["event"] != "lent":
            extra = f" ({t['blocks']} blocks)" if "blocks" in t else ""
            parts.append(f"{t['id']}: {t['event']}{extra}")
    return "; ".join(parts)


def step_cells(s: Step, token_text: TokenText | None = None) -> tuple[list[list[str]], list[str]]:
    """Per-request cells (one list per request line) and the step's own cells."""
    lines = [[_scheduled(r), _sampled(r, token_text), _blocks(r)] for r in s.requests]
    own = [f"{s.num_scheduled_tokens}/{s.budget}", f"{s.free_blocks}/{s.num_blocks}", events(s)]
    return lines or [["-", "-", "-"]], own


def text_lines(s: Step, token_text: TokenText | None = None) -> list[list[str]]:
    """The step as rows of cells: its first line carries the step's cells, later ones are blank there."""
    lines, own = step_cells(s, token_text)
    rows = [[str(s.step), *lines[0], *own]]
    rows += [["", *line, "", "", ""] for line in lines[1:]]
    return rows


def align(rows: list[list[str]], widths: list[int] | None = None) -> list[str]:
    widths = widths or column_widths(rows)
    out = []
    for row in rows:
        cells = [row[0].rjust(widths[0])] + [c.ljust(w) for c, w in zip(row[1:], widths[1:])]
        out.append("  ".join(cells).rstrip())
    return out


def column_widths(rows: list[list[str]]) -> list[int]:
    return [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]


def render_text(steps: list[Step], token_text: TokenText | None = None) -> str:
    rows = [list(HEADER)] + [row for s in steps for row in text_lines(s, token_text)]
    return "\n".join(align(rows)) + "\n"


def _md(cell: str) -> str:
    return cell.replace("\\", "\\\\").replace("|", "\\|").replace("\n", "\\n")


def render_markdown(steps: list[Step], token_text: TokenText | None = None) -> str:
    out = ["| " + " | ".join(HEADER) + " |", "|" + "---:|" + "---|" * (len(HEADER) - 1)]
    for s in steps:
        lines, own = step_cells(s, token_text)
        per_request = ["<br>".join(_md(line[i]) for line in lines) for i in range(len(REQUEST_COLUMNS))]
        out.append("| " + " | ".join([str(s.step), *per_request, *map(_md, own)]) + " |")
    return "\n".join(out) + "\n"


CSV_HEADER = ("step", "request", "phase", "tokens", "num_computed_tokens", "cached_tokens",
              "sampled", "sampled_text", "num_blocks", "blocks", "new_blocks", "step_tokens",
              "budget", "free_blocks", "total_blocks", "step_time", "preempted", "finished")


def render_csv(steps: list[Step], token_text: TokenText | None = None) -> str:
    """One row per (step, request): the tidy shape for pandas or a spreadsheet; a step that
    only preempted or finished requests gets one row with the request fields empty."""
    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(CSV_HEADER)
    for s in steps:
        own = [s.num_scheduled_tokens, s.budget, s.free_blocks, s.num_blocks, f"{s.step_time:.6f}",
               " ".join(s.preempted), " ".join(s.finished)]
        for r in s.requests or [None]:
            if r is None:
                w.writerow([s.step] + [""] * 10 + own)
                continue
            text = token_text(r.sampled) if token_text and r.sampled is not None else ""
            w.writerow([s.step, r.id, r.phase, r.tokens, r.num_computed_tokens,
                        "" if r.cached_tokens is None else r.cached_tokens,
                        "" if r.sampled is None else r.sampled, text, len(r.blocks),
                        " ".join(map(str, r.blocks)), " ".join(map(str, r.new_blocks)), *own])
    return buf.getvalue()


def render(steps: list[Step], fmt: str = "text", token_text: TokenText | None = None) -> str:
    """The step table in `fmt` (text, markdown or csv)."""
    if fmt not in FORMATS:
        raise ValueError(f"format must be one of {', '.join(FORMATS)}, got {fmt!r}")
    return {"text": render_text, "markdown": render_markdown, "csv": render_csv}[fmt](steps, token_text)
