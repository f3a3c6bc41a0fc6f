"""The soak of tests/test_server_robustness.py with an RSS time series of both processes.

    .venv/bin/python benchmarks/soak_rss.py [NUM_REQUESTS] [extra kvflow serve args...]

Prints frontend and engine-core RSS every 25 finished requests (32 clients at once, ~20%
cancelling): a leak shows as steady growth, a warm-up as a plateau."""
import asyncio, os, random, sys, threading, time
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "tests")); sys.path.insert(0, ROOT)
os.environ["KVFLOW_SOAK"] = "long"
import httpx, psutil
import test_server_robustness as t
from server_helpers import ServerProcess

srv = ServerProcess("--max-model-len", str(t.MAX_MODEL_LEN), "--num-blocks", str(t.NUM_BLOCKS),
                    "--block-size", str(t.BLOCK_SIZE), "--max-num-seqs", str(t.MAX_NUM_SEQS),
                    "--scheduling-policy", "priority", *sys.argv[2:])
total = int(sys.argv[1]) if len(sys.argv) > 1 else 500
eng = psutil.Process(srv.engine_pid)
outcomes = []
series = []
stop = False
def sampler():
    t0 = time.time()
    while not stop:
        series.append((time.time()-t0, len(outcomes), srv.ps.memory_info().rss, eng.memory_info().rss))
        time.sleep(2)
th = threading.Thread(target=sampler, daemon=True); th.start()
rng = random.Random(1234)
async def run():
    sem = asyncio.Semaphore(32)
    async with httpx.AsyncClient(base_url=srv.url, timeout=300, limits=httpx.Limits(max_connections=36)) as http:
        async def one(i):
            async with sem:
                await t._soak_client(http, random.Random(rng.random()), outcomes)
        await asyncio.gather(*(one(i) for i in range(total)))
asyncio.run(run())
time.sleep(3)
stop = True; th.join()
last = -1
for ts, n, fr, en in series:
    if n // 25 != last:
        last = n // 25
        print(f"t={ts:6.0f}s done={n:4d} frontend={fr/2**20:7.1f}MiB engine={en/2**20:7.1f}MiB")
ts, n, fr, en = series[-1]
print(f"END t={ts:6.0f}s done={n:4d} frontend={fr/2**20:7.1f}MiB engine={en/2**20:7.1f}MiB")
print("outcomes", {k: outcomes.count(k) for k in set(outcomes)})
srv.close()
