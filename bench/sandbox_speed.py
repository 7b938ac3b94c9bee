"""The sandbox benchmark: the forked pool of sandbox.py against subprocess.run([python, "-c", code]) per
call, the way most RL code runs tools, at the same concurrency, on three workloads; then a burst of 1,000
submissions at once. The last line is the ratio: `speedup vs subprocess: tiny <x>, sympy <y>, error <z>`.

    python bench/sandbox_speed.py [--rounds 3] [--workers N]
"""
import argparse
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project root
from sandbox import Sandbox  # noqa: E402

WORKLOADS = {
    "tiny": "print(sum(i * i for i in range(100)))",
    # a sympy cell that shares no call with the workers' warm-up
    "sympy": "import sympy as sp\nx = sp.symbols('x')\n"
             "print(sp.solve(x**2 - 5*x + 6, x), sp.factorint(2**32 + 1))",
    "error": "def f(n):\n    return 1 / n\nf(0)",
}
BURST = 1000

parser = argparse.ArgumentParser(description="the sandbox's pool against a subprocess per call")
parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of pool and subprocess runs")
parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="pool workers and concurrency")
args = parser.parse_args()


def timed(call, code):
    start = time.perf_counter()
    call(code)
    return time.perf_counter() - start


def naive(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)


# -----------------------------------------------------------------------------
# Each workload through the pool and through a subprocess per call, in interleaved rounds: the machine may
# be shared, so both should see the same load

n = args.workers
speedups = []
with Sandbox(workers=n) as sb, ThreadPoolExecutor(n) as ex:
    print(f"{n} workers, concurrency {n}, {args.rounds} interleaved rounds, isolation {sb.isolation}")
    for name, code in WORKLOADS.items():
        sb.run_batch([code] * 2 * n)  # warm-up
        calls = {"pool": (sb.run, 100 if name == "sympy" else 600),
                 "subprocess": (naive, (2 if name == "sympy" else 12) * n)}
        seconds = dict.fromkeys(calls, 0.0)
        latencies = {who: [] for who in calls}
        for _ in range(args.rounds):
            for who, (call, count) in calls.items():
                start = time.perf_counter()
                latencies[who] += ex.map(lambda _: timed(call, code), range(count))
                seconds[who] += time.perf_counter() - start
        rates = {}
        for who, lat in latencies.items():
            lat = sorted(lat)
            rates[who] = len(lat) / seconds[who]
            print(f"{name:6} {who:10} {rates[who]:8.1f} calls/s  p50 {lat[len(lat) // 2] * 1e3:7.1f} ms  "
                  f"p99 {lat[int(0.99 * len(lat))] * 1e3:7.1f} ms")
        speedups.append(f"{name} {rates['pool'] / rates['subprocess']:.1f}")

    # -------------------------------------------------------------------------
    # A burst: all submitted at once, each latency from its own submission

    burst = []
    for _ in range(BURST):
        submitted = time.perf_counter()
        future = sb.submit(WORKLOADS["tiny"])
        future.add_done_callback(lambda f, t=submitted: burst.append(time.perf_counter() - t))
    while len(burst) < BURST:
        time.sleep(0.01)
    burst.sort()
    print(f"burst of {BURST} tiny submissions: p50 {burst[BURST // 2] * 1e3:.1f} ms  "
          f"p99 {burst[int(0.99 * BURST)] * 1e3:.1f} ms")

print("speedup vs subprocess: " + ", ".join(speedups))
