"""End to end in a real browser: `kvflow serve` with the default model, headless Chromium on
/dashboard, a few streaming requests. The page must show them running (and the one that does
not fit waiting, until a slot frees), the block map must change as their caches grow, and
everything must be gone once they finish. Screenshots go to test-artifacts/; with
KVFLOW_UPDATE_DOCS=1 the test also refreshes docs/dashboard.png for the README.

Chromium and its driver come from Debian (`make test` installs them; this test does too when it
runs as root without them). Selenium downloads nothing: the driver's path is given."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
import threading
import time

import httpx
import pytest

from server_helpers import REPO as ROOT
from server_helpers import ServerProcess

pytestmark = pytest.mark.slow  # loads a model (make test-fast leaves it out)

ARTIFACTS = os.path.join(ROOT, "test-artifacts")
CHROMIUM, CHROMEDRIVER = "/usr/bin/chromium", "/usr/bin/chromedriver"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync",
                  "--disable-dev-shm-usage", "--window-size=1280,800", "--hide-scrollbars"]
MAX_NUM_SEQS = 3  # four requests: one of them must wait
# A shared opening (more than one 16-token block) so that prefix caching shares blocks.
PREFIX = ("You are a storyteller. Every story you tell is set in a small harbour town, has a "
          "lighthouse keeper in it, and ends with the sea. ")
# (prompt, max_tokens): the short one finishes first and makes room for the one that waits.
# It must outlast the page seeing three running and the fourth arriving (about a second: the
# page gets a state every 0.25 s) however fast the engine decodes: 96 tokens lasted 2.5 s at
# ~26 ms a token, but only ~0.5 s once a batch-3 step took ~5 ms (the one-call decode step),
# and the fourth then never waited. 400 tokens last 2 s even at 5 ms; the long ones run
# hundreds of steps past it.
REQUESTS = [("Tell the one about the storm.", 400), ("Tell the one about the lost cat.", 900),
            ("Tell the one about the festival.", 900), ("Tell the one about the old map.", 900)]


def ensure_chromium() -> None:
    """Debian's chromium and chromium-driver; installed here if missing (CI runs as root)."""
    if os.access(CHROMIUM, os.X_OK) and os.access(CHROMEDRIVER, os.X_OK):
        return
    assert os.geteuid() == 0, ("chromium is missing: run `make browser` "
                               "(apt-get install chromium chromium-driver)")
    env = dict(os.environ, DEBIAN_FRONTEND="noninteractive")
    subprocess.run(["apt-get", "update", "-q"], check=True, env=env, stdout=subprocess.DEVNULL)
    subprocess.run(["apt-get", "install", "-y", "-q", "chromium", "chromium-driver"], check=True,
                   env=env, stdout=subprocess.DEVNULL)


@pytest.fixture(scope="module")
def server():
    srv = ServerProcess("--num-blocks", "256", "--block-size", "16", "--max-model-len", "1024",
                        "--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", "128")
    try:
        yield srv.url
    finally:
        srv.close()


@pytest.fixture(scope="module")
def browser():
    ensure_chromium()
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    profile = tempfile.mkdtemp(prefix="kvflow-chromium-")
    options = webdriver.ChromeOptions()
    options.binary_location = CHROMIUM
    for flag in CHROMIUM_FLAGS + [f"--user-data-dir={profile}"]:
        options.add_argument(flag)
    driver = webdriver.Chrome(service=Service(CHROMEDRIVER), options=options)
    try:
        yield driver
    finally:
        driver.quit()
        shutil.rmtree(profile, ignore_errors=True)


def stream_completion(url: str, prompt: str, max_tokens: int, ids: list[str],
                      done: list[str]) -> None:
    body = {"prompt": PREFIX + prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=120) as r:
        assert r.status_code == 200
        for line in r.iter_lines():
            if line.startswith("data: {"):
                chunk = json.loads(line[6:])
                if not ids or ids[-1] != chunk["id"]:
                    ids.append(chunk["id"])
    done.append(prompt)


PAGE_STATE = """
const ids = (sel) => [...document.querySelectorAll(sel + ' .req')].map(e => e.dataset.id);
const summary = document.getElementById('block-summary');
return {status: document.getElementById('status').textContent,
        running: ids('#running'), waiting: ids('#waiting'),
        used: summary.dataset.used === undefined ? null : Number(summary.dataset.used),
        cached: Number(summary.dataset.cached),
        blocks: document.getElementById('blocks').toDataURL(),
        latency: document.getElementById('latency-summary').textContent};
"""


def wait_for(driver, predicate, timeout: float, what: str):
    deadline = time.time() + timeout
    while True:
        state = driver.execute_script(PAGE_STATE)
        if predicate(state):
            return state
        assert time.time() < deadline, f"page never showed {what}; last state: " + repr(
            {k: v for k, v in state.items() if k != "blocks"})
        time.sleep(0.1)


def test_dashboard_follows_requests_from_waiting_to_running_to_gone(server, browser):
    browser.get(server + "/dashboard")
    idle = wait_for(browser, lambda s: s["status"] == "live" and s["used"] == 0, 20,
                    "a live, empty engine")
    assert idle["running"] == [] and idle["waiting"] == []

    ids: list[list[str]] = [[] for _ in REQUESTS]
    done: list[str] = []
    threads = [threading.Thread(target=stream_completion, args=(server, p, n, i, done), daemon=True)
               for (p, n), i in zip(REQUESTS, ids)]
    # the first three (the short one among them) must be running before the last one arrives,
    # so that the one left waiting is a long one (threads alone do not fix the arrival order)
    for t in threads[:MAX_NUM_SEQS]:
        t.start()
    wait_for(browser, lambda s: len(s["running"]) == MAX_NUM_SEQS, 60,
             f"the first {MAX_NUM_SEQS} requests running")
    threads[MAX_NUM_SEQS].start()

    busy = wait_for(browser, lambda s: len(s["running"]) == MAX_NUM_SEQS and s["waiting"], 60,
                    f"{MAX_NUM_SEQS} running requests and one waiting")
    assert busy["used"] > 0 and busy["blocks"] != idle["blocks"]
    shown = set(busy["running"]) | set(busy["waiting"])

    os.makedirs(ARTIFACTS, exist_ok=True)
    grown = wait_for(browser, lambda s: s["used"] is not None and s["used"] > busy["used"], 60,
                     "the block map growing as the caches grow")
    assert grown["blocks"] != busy["blocks"]
    browser.save_screenshot(os.path.join(ARTIFACTS, "dashboard-busy.png"))

    # the short one finishes (its own blocks stay cached) and the one that waited takes its slot
    waited = busy["waiting"][0]
    late = wait_for(browser, lambda s: waited in s["running"] and s["latency"].startswith(
        "1 finished"), 60, "the waiting request running after the short one finished")
    assert late["waiting"] == [] and len(late["running"]) == MAX_NUM_SEQS and late["cached"] > 0
    shot = os.path.join(ARTIFACTS, "dashboard.png")
    browser.save_screenshot(shot)
    assert os.path.getsize(shot) > 10_000
    if os.environ.get("KVFLOW_UPDATE_DOCS"):
        shutil.copyfile(shot, os.path.join(ROOT, "docs", "dashboard.png"))

    final = wait_for(browser, lambda s: not s["running"] and not s["waiting"] and s["used"] == 0
                     and s["latency"].startswith(f"{len(REQUESTS)} finished"), 90,
                     "every request gone, no block in use and four latencies")
    for t in threads:
        t.join(30)
    assert sorted(done) == sorted(p for p, _ in REQUESTS)
    # the page named the very requests the server streamed (core ids add "-<sample index>")
    assert {s.rsplit("-", 1)[0] for s in shown} == {i[0] for i in ids}
    assert final["blocks"] != grown["blocks"] and final["cached"] > 0
    browser.save_screenshot(os.path.join(ARTIFACTS, "dashboard-idle.png"))
