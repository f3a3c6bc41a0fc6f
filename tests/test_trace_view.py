"""`kvflow trace` (the step table and its plot) and `kvflow generate --explain`.

The golden files in tests/data/ come from a recorded run of the scheduler with the fake model
of core_helpers; `python tests/test_trace_view.py` records them again after a deliberate
change to the scheduler or to the table's layout."""
from __future__ import annotations

import csv
import io
import json
import os
import random
import re

import pytest

from core_helpers import FakeRunner, make_request, make_scheduler
from kvflow.engine.step_trace import StepTrace
from kvflow.entrypoints.cli import main
from kvflow.trace.narrate import Before, Queued, narrate, snapshot
from kvflow.trace.plot import TITLES, save_plot
from kvflow.trace.reader import load_trace
from kvflow.trace.table import HEADER, render

DATA = os.path.join(os.path.dirname(__file__), "data")
GOLDEN_TRACE = os.path.join(DATA, "trace_small.jsonl")
GOLDEN_TABLE = os.path.join(DATA, "trace_small.txt")

# The --explain scenario: A's prompt is longer than the budget (chunked prefill), B joins while
# A decodes, the pool is too small for all three (B is preempted, C waits for blocks), and B
# resumes from its own cached block.
SMALL = dict(budget=16, block_size=4, num_blocks=8,
             requests=[("A", 20, 6, 0), ("B", 7, 4, 2), ("C", 12, 5, 5)])


def record_run(path, requests, budget, block_size, num_blocks, max_num_seqs=16, on_step=None,
               **config):
    """Drive the scheduler and the fake model through `requests` ((id, prompt length,
    max_tokens, arrival step[, priority]), ...), writing the trace the way EngineCore does;
    `config`: more SchedulerConfig fields (policy, max_admission_skips)."""
    sched = make_scheduler(num_blocks=num_blocks, block_size=block_size, budget=budget,
                           max_num_seqs=max_num_seqs, max_model_len=1024, **config)
    runner, trace = FakeRunner(), StepTrace(path, budget, block_size, num_blocks)
    todo = sorted(requests, key=lambda r: r[3])
    tick = 0
    while todo or sched.has_unfinished_requests():
        arrived = []
        while todo and todo[0][3] <= tick:
            rid, prompt_len, max_tokens, _, *priority = todo.pop(0)
            sched.add_request(make_request(rid, prompt_len, max_tokens, *priority))
            arrived.append(rid)
        tick += 1
        before = snapshot(sched, arrived) if on_step else None
        out = sched.schedule()
        if out.is_empty:
            continue
        updates = sched.update_from_output(out, runner.execute(out))
        kv = sched.kv_cache_manager
        trace.record(out, updates, 0.0, 0.0, kv.num_free_blocks,
                     kv.block_pool.num_cached_free_blocks)
        if on_step:
            for u in updates:
                if u.finish_reason is not None:
                    before.finish_reasons[u.request.request_id] = u.finish_reason.value
            on_step(out, before)
    trace.close()


def run_cli(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def small_trace(tmp_path):
    path = str(tmp_path / "small.jsonl")
    record_run(path, **SMALL)
    return path


# -- the table ---------------------------------------------------------------------------

def test_table_of_the_recorded_run_matches_the_golden_table(capsys):
    with open(GOLDEN_TABLE, encoding="utf-8") as f:
        golden = f.read()
    rc, out, _ = run_cli(capsys, "trace", GOLDEN_TRACE)
    assert rc == 0
    assert out == golden


def test_recording_the_small_run_again_gives_the_stored_trace(tmp_path):
    path = small_trace(tmp_path)

    def records(p):
        with open(p, encoding="utf-8") as f:
            return [{k: v for k, v in json.loads(line).items() if k not in ("time", "step_time")}
                    for line in f]
    assert records(path) == records(GOLDEN_TRACE), (
        "the scheduler now plans the small run differently: if that is intended, record the "
        "golden files again with `python tests/test_trace_view.py`")


def test_table_rows_follow_the_scheduler_outputs(tmp_path, capsys):
    outs = []
    path = str(tmp_path / "t.jsonl")
    record_run(path, **SMALL, on_step=lambda out, _: outs.append(out))
    rc, text, _ = run_cli(capsys, "trace", path, "--format", "csv")
    assert rc == 0
    rows = list(csv.DictReader(io.StringIO(text)))
    by_step = {o.step: o for o in outs}
    assert len(rows) == sum(len(o.num_scheduled_tokens) for o in outs)
    for row in rows:
        out = by_step[int(row["step"])]
        rid = row["request"]
        assert int(row["tokens"]) == out.num_scheduled_tokens[rid]
        assert int(row["num_computed_tokens"]) == out.num_computed_tokens[rid]
        assert [int(b) for b in row["blocks"].split()] == out.block_ids[rid]
        assert int(row["num_blocks"]) == len(out.block_ids[rid])
        assert int(row["step_tokens"]) == out.total_num_scheduled_tokens <= int(row["budget"])
        assert row["preempted"].split() == list(out.preempted_req_ids)


def test_each_finish_is_reported_once_with_the_blocks_it_freed():
    trace = load_trace(GOLDEN_TRACE)
    finished = [rid for s in trace.steps for rid in s.finished]
    assert sorted(finished) == sorted(trace.request_ids)  # everyone finishes, once
    for s in trace.steps:
        for rid in s.finished:
            last = [r for t in trace.steps if t.step <= s.step for r in t.requests if r.id == rid][-1]
            assert s.freed[rid] == last.blocks
    assert any(s.preempted for s in trace.steps), "the small run is meant to show a preemption"


def test_requests_filter_keeps_only_those_requests(capsys):
    rc, out, _ = run_cli(capsys, "trace", GOLDEN_TRACE, "--requests", "B")
    assert rc == 0
    lines = out.splitlines()[1:]
    # B's own lines, and the step that preempted it (no request of interest ran there)
    assert lines and all(re.search(r"\bB: (prefill|decode)|-  .* preempted B", ln) for ln in lines)
    assert "A:" not in out and "C:" not in out
    assert "preempted B" in out and "finished B" in out


def test_steps_filter_is_a_python_style_range(capsys):
    def steps_shown(spec):
        rc, out, _ = run_cli(capsys, "trace", GOLDEN_TRACE, "--steps", spec, "--format", "csv")
        assert rc == 0
        return sorted({int(r["step"]) for r in csv.DictReader(io.StringIO(out))})
    assert steps_shown("2:5") == [2, 3, 4]
    assert steps_shown("6") == [6]
    assert steps_shown(":2") == [0, 1]
    last = load_trace(GOLDEN_TRACE).steps[-1].step
    assert steps_shown("10:") == list(range(10, last + 1))


def test_markdown_has_one_row_per_step(capsys):
    rc, out, _ = run_cli(capsys, "trace", GOLDEN_TRACE, "--format", "markdown")
    assert rc == 0
    lines = out.splitlines()
    steps = load_trace(GOLDEN_TRACE).steps
    assert lines[0] == "| " + " | ".join(HEADER) + " |"
    assert len(lines) == 2 + len(steps)
    for line, s in zip(lines[2:], steps):
        cells = re.split(r"(?<!\\)\|", line)[1:-1]
        assert len(cells) == len(HEADER)
        assert int(cells[0]) == s.step
        cached = lambda r: f" (cached {r.cached_tokens})" if r.cached_tokens else ""  # noqa: E731
        assert cells[1].strip().split("<br>") == [f"{r.id}: {r.phase} {r.tokens}{cached(r)}"
                                                  for r in s.requests]


def test_unknown_request_and_empty_range_are_clear_errors(capsys, tmp_path):
    rc, _, err = run_cli(capsys, "trace", GOLDEN_TRACE, "--requests", "Z")
    assert rc == 2 and "no request Z" in err and "A, B, C" in err
    rc, _, err = run_cli(capsys, "trace", GOLDEN_TRACE, "--steps", "500:")
    assert rc == 2 and "no steps match" in err
    rc, _, err = run_cli(capsys, "trace", str(tmp_path / "missing.jsonl"))
    assert rc == 2 and "cannot read trace" in err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"step": 0}\n')
    rc, _, err = run_cli(capsys, "trace", str(bad))
    assert rc == 2 and "bad.jsonl:1" in err


# -- the plot ----------------------------------------------------------------------------

def _check_png(path):
    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n"
    assert 10_000 < os.path.getsize(path) < 1_000_000


def test_plot_writes_a_png_with_the_three_panels(tmp_path, capsys):
    png = str(tmp_path / "small.png")
    rc, _, err = run_cli(capsys, "trace", GOLDEN_TRACE, "--plot", png)
    assert rc == 0 and png in err
    _check_png(png)
    steps = load_trace(GOLDEN_TRACE).steps
    fig = save_plot(steps, str(tmp_path / "again.png"))
    assert [ax.get_title(loc="left") for ax in fig.axes] == list(TITLES)
    timeline, tokens, blocks = fig.axes
    assert [t.get_text() for t in timeline.get_yticklabels()] == ["A", "B", "C"]
    labels = lambda ax: [t.get_text() for t in ax.get_legend().get_texts()]  # noqa: E731
    assert labels(timeline) == ["prefill chunk", "decode", "preempted", "finished"]
    assert labels(tokens) == ["prefill tokens", "decode tokens", "budget (16)"]
    # B's preemption leaves cached blocks in the free queue: the blocks panel shows them.
    assert "free, holding a cached prefix" in labels(blocks)


def test_plot_stays_readable_for_500_requests(tmp_path):
    rng = random.Random(0)
    reqs = [(f"r{i}", rng.randint(10, 200), rng.randint(4, 40), rng.randint(0, 200))
            for i in range(500)]
    path = str(tmp_path / "big.jsonl")
    record_run(path, reqs, budget=512, block_size=16, num_blocks=400, max_num_seqs=64)
    png = str(tmp_path / "big.png")
    fig = save_plot(load_trace(path).steps, png)
    _check_png(png)
    timeline = fig.axes[0]
    assert timeline.get_yticks().size == 0  # 500 names would be a black smear
    assert timeline.get_ylabel() == "500 requests"
    assert fig.get_size_inches()[1] < 12


# -- kvflow generate --explain -----------------------------------------------------------

def test_sentences_account_for_every_queued_request(tmp_path):
    """Each sentence names every request that was running or waiting, and its numbers are
    the step's own (five requests: preemptions of others, cache hits, waits)."""
    said = []
    path = str(tmp_path / "five.jsonl")
    five = [("A", 48, 10, 0), ("B", 12, 24, 1), ("C", 30, 8, 3), ("D", 8, 16, 6), ("E", 20, 12, 9)]
    record_run(path, five, budget=24, block_size=8, num_blocks=14,
               on_step=lambda out, before: said.append(before))
    steps = load_trace(path).steps
    assert len(steps) == len(said)
    texts = [narrate(s, b) for s, b in zip(steps, said)]
    for s, before, text in zip(steps, said, texts):
        for q in before.running + before.waiting:
            assert re.search(rf"\b{q.id}\b", text), (s.step, q.id, text)
        assert f"{s.num_scheduled_tokens} of {s.budget} tokens used" in text
        assert f"{s.free_blocks} of {s.num_blocks} blocks free" in text
        for rid in s.finished:
            assert f"{rid} finishes" in text
    joined = " ".join(texts)
    assert "the most recently admitted request" in joined  # someone preempted for another
    assert "is resumed after its preemption" in joined


# A (priority 5) runs first; B (priority 0) joins and is the first to need a block when none is
# left: FCFS preempts B itself (the most recently admitted), the priority policy preempts A.
TWO = dict(requests=[("A", 6, 10, 0, 5), ("B", 8, 10, 1, 0)], budget=16, block_size=4,
           num_blocks=6)


def _preemption_sentence(tmp_path, policy):
    said = []
    path = str(tmp_path / f"{policy}.jsonl")
    record_run(path, **TWO, policy=policy, on_step=lambda out, before: said.append(before))
    steps = load_trace(path).steps
    hits = [(s, narrate(s, b)) for s, b in zip(steps, said) if s.preempted]
    assert len(hits) == 1, [t for _, t in hits]
    return hits[0]


def test_narration_names_whom_the_priority_policy_preempts(tmp_path):
    step, text = _preemption_sentence(tmp_path, "priority")
    assert step.preempted == ["A"] and step.preempted_for == {"A": "B"}
    assert ("B needs a new block and none is left for it, so the lowest-priority running "
            "request (priority 5), A, is preempted") in text
    assert "most recently admitted" not in text
    assert "B decodes 1 token" in text


def test_narration_names_whom_fcfs_preempts(tmp_path):
    step, text = _preemption_sentence(tmp_path, "fcfs")
    assert step.preempted == ["B"] and step.preempted_for == {"B": "B"}
    assert "so B itself, the most recently admitted request, is preempted" in text
    assert "A decodes 1 token" in text


@pytest.mark.parametrize("skips", [16, 1])
def test_narration_gives_the_schedulers_reasons_for_waiting(tmp_path, skips):
    """Skipped for blocks (with admission's own numbers), stopped by the budget or by
    max_num_seqs, held behind a request passed over long enough: each as the trace recorded it."""
    said = []
    path = str(tmp_path / "waits.jsonl")
    reqs = [("A", 30, 4, 0), ("B", 20, 2, 0), ("C", 3, 2, 0), ("D", 3, 2, 0), ("E", 3, 2, 0)]
    record_run(path, reqs, budget=16, block_size=4, num_blocks=10, max_num_seqs=2 if skips > 1 else 4,
               max_admission_skips=skips, on_step=lambda out, before: said.append(before))
    steps = load_trace(path).steps
    seen = set()
    for s, before in zip(steps, said):
        text = narrate(s, before)
        for rid in s.skipped:
            c = s.block_checks[rid]
            free = "none is free" if c.free == 0 else ("only 1 is free" if c.free == 1
                                                        else f"only {c.free} are free")
            assert not c.fits
            assert f"{rid} waits: its 20-token prompt needs {c.need} blocks but {free}" in text
        for rid, c in s.block_checks.items():
            if rid not in s.skipped:
                assert c.fits and re.search(rf"{rid}( arrives and)? is admitted", text)
        waiting = [q.id for q in before.waiting if q.id not in s.block_checks]
        reason = {"budget": "waits: no budget left",
                  "max_num_seqs": "waits: 2 requests already run (max_num_seqs)",
                  "held": f"waits behind {s.skipped[-1] if s.skipped else ''}, which has been "
                          "passed over long enough"}.get(s.admission_stop)
        for rid in waiting:
            assert re.search(rf"{rid}( arrives and)? {re.escape(reason or 'waits')}", text), text
        seen |= {s.admission_stop} | ({"skipped"} if s.skipped else set())
    assert seen >= ({"skipped", "budget", "max_num_seqs"} if skips > 1 else {"skipped", "held"})


def test_old_traces_without_decisions_still_load_and_read(tmp_path):
    """Traces written before the scheduler recorded its reasons load with them empty."""
    path = tmp_path / "old.jsonl"
    path.write_text(json.dumps({
        "step": 0, "time": 0.0, "step_time": 0.0, "num_scheduled_tokens": 8,
        "requests": [{"id": "A", "phase": "prefill", "tokens": 8, "num_computed_tokens": 0,
                      "blocks": [0, 1], "sampled": 5, "cached_tokens": 0}],
        "preempted": ["Z"], "finished": [], "free_blocks": 6, "budget": 16, "block_size": 4,
        "num_blocks": 8}) + "\n")
    step = load_trace(str(path)).steps[0]
    assert step.preempted_for == {} and step.block_checks == {} and step.skipped == []
    assert step.requests[0].admitted is None
    before = Before([], [], [Queued("A", 8, 8, 0), Queued("W", 4, 4, 0)])
    text = narrate(step, before)
    assert "A is admitted; it prefills all 8" in text and "Z is preempted" in text
    assert "W waits" in text


@pytest.mark.slow
def test_explain_runs_the_real_engine_and_says_why(tmp_path, capsys):
    trace = str(tmp_path / "explain.jsonl")
    rc, out, _ = run_cli(capsys, "generate", "--explain", "--trace", trace, "--num-threads", "1")
    assert rc == 0
    steps = load_trace(trace).steps
    sentences = re.findall(r"^ +-> (.*(?:\n {9}\S.*)*)", out, flags=re.M)
    sentences = [" ".join(s.split()) for s in sentences]
    assert len(sentences) == len(steps)
    for s, text in zip(steps, sentences):
        assert f"{s.num_scheduled_tokens} of {s.budget} tokens used" in text
        assert f"{s.free_blocks} of {s.num_blocks} blocks free" in text
    assert "prefills 16 of 20 (all the budget left: chunked prefill)" in sentences[0]
    assert "into new blocks 0-3" in sentences[0]
    joined = " ".join(sentences)
    for phrase in ("is preempted", "waits:", "is resumed", "A finishes", "B finishes", "C finishes"):
        assert phrase in joined
    # the table rows above the sentences are the trace's own table (sampled tokens as text)
    table_rows = [ln for ln in out.splitlines() if re.match(r"^ +\d+  [A-Z]: |^ {6}[A-Z]: ", ln)]
    assert sum(len(s.requests) for s in steps) == len(table_rows)
    assert "What each request generated" in out


def test_explain_scenario_comes_from_the_command_line(capsys):
    rc, out, _ = run_cli(capsys, "generate", "--explain", "--explain-budget", "8",
                         "--explain-block-size", "2", "--explain-num-blocks", "20",
                         "--explain-prompts", "9,3", "--explain-arrivals", "0,1",
                         "--explain-max-tokens", "2", "--num-threads", "1")
    assert rc == 0
    assert "2 requests, a budget of 8 tokens per step, blocks of 2 tokens, 20 blocks" in out
    assert "B: 3-token prompt, arrives at step 1, generates 2 tokens" in out
    flat = " ".join(out.split())  # sentences wrap
    assert "prefills 8 of 9 (all the budget left: chunked prefill) into new blocks 0-3" in flat


def test_explain_rejects_a_scenario_that_cannot_run(capsys):
    rc, _, err = run_cli(capsys, "generate", "--explain", "--explain-prompts", "5,5",
                         "--explain-arrivals", "0")
    assert rc == 2 and "2 prompts but 1 arrivals" in err
    rc, _, err = run_cli(capsys, "generate", "--explain", "--explain-prompts", "40",
                         "--explain-arrivals", "0", "--explain-max-tokens", "8",
                         "--explain-num-blocks", "4")
    assert rc == 2 and "needs 12 blocks" in err
    rc, _, err = run_cli(capsys, "generate")
    assert rc == 2 and "prompt is required" in err


def record_golden() -> None:
    os.makedirs(DATA, exist_ok=True)
    record_run(GOLDEN_TRACE, **SMALL)
    with open(GOLDEN_TABLE, "w", encoding="utf-8") as f:
        f.write(render(load_trace(GOLDEN_TRACE).steps))
    print(f"wrote {GOLDEN_TRACE} and {GOLDEN_TABLE}")


if __name__ == "__main__":
    record_golden()


def test_the_trace_records_which_images_were_encoded_and_which_chunks_stopped_before_one(tmp_path):
    """A's image takes the step's encoder budget: B's chunk stops before its own image; the
    trace records both decisions and the reader reads them back, step by step."""
    from kvflow.request import MultiModalFeatureSpec, PlaceholderRange

    sched = make_scheduler(num_blocks=64, block_size=4, budget=32, max_num_encoder_input_tokens=6)
    for rid, offset in (("A", 2), ("B", 5)):
        req = make_request(rid, 16, 2)
        req.mm_features = [MultiModalFeatureSpec("image", rid, PlaceholderRange(offset, 6))]
        sched.add_request(req)
    path = str(tmp_path / "t.jsonl")
    trace, runner, outs = StepTrace(path, 32, 4, 64), FakeRunner(), []
    while sched.has_unfinished_requests():
        out = sched.schedule()
        updates = sched.update_from_output(out, runner.execute(out))
        trace.record(out, updates, 0.0, 0.0, sched.kv_cache_manager.num_free_blocks, 0)
        outs.append(out)
    trace.close()
    steps = load_trace(path).steps
    assert steps[0].encoder_inputs == {"A": [0]} and steps[0].encoder_cuts == {"B": "encoder_budget"}
    assert steps[0].requests[1].tokens == 5  # B: up to its image
    assert steps[1].encoder_inputs == {"B": [0]}
    assert [s.encoder_inputs for s in steps] == [o.scheduled_encoder_inputs for o in outs]
