"""The sandbox benchmark: the forked pool of sandbox.py against subprocess.run([python, "-c", code]) per
call, the way most RL code runs tools, at the same concurrency, on three workloads; then a burst of 1,000
submissions at once. With --before (another sandbox.py, e.g. `git show <commit>:sandbox.py > FILE`) the
same run measures that pool too, and a call of print(1+1) one at a time through both, interleaved: its
latency (the median over rounds of their ratio) and the CPU it costs the workers and the caller (in all).
Then what os.fork's at-fork hooks cost in a process with the light worker's modules, against libc's fork,
which sandbox.py uses. The last line is the ratio:
`speedup vs subprocess: tiny <x>, sympy <y>, error <z>[; before: ...; print(1+1) after/before: ...]`.

    python bench/sandbox_speed.py [--rounds 3] [--workers N] [--before FILE]
"""
import argparse
import importlib.util
import os
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the project root
import sandbox  # noqa: E402

WORKLOADS = {
    "tiny": "print(sum(i * i for i in range(100)))",
    # a sympy cell that shares no call with the workers' warm-up
    "sympy": "import sympy as sp\nx = sp.symbols('x')\n"
             "print(sp.solve(x**2 - 5*x + 6, x), sp.factorint(2**32 + 1))",
    "error": "def f(n):\n    return 1 / n\nf(0)",
}
BURST = 1000
TICK = os.sysconf("SC_CLK_TCK")
# os.fork against libc's fork in a fresh process with the light worker's modules: CPU per fork and exit
FORKS = f"""
import ctypes, os, resource, sys
for name in {sandbox.LIGHT!r}:
    __import__(name)
libc = ctypes.PyDLL(None)
def cpu():
    return sum(getattr(resource.getrusage(who), f) for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN)
               for f in ("ru_utime", "ru_stime"))
seconds = dict(os=0.0, libc=0.0)
for _ in range(10):  # interleaved rounds
    for name, fork in (("os", os.fork), ("libc", libc.fork)):
        start = cpu()
        for _ in range(100):
            if fork() == 0:
                os._exit(0)
            os.wait()
        seconds[name] += (cpu() - start) / 1000
print(seconds["os"], seconds["libc"])
"""

parser = argparse.ArgumentParser(description="the sandbox's pool against a subprocess per call")
parser.add_argument("--rounds", type=int, default=3, help="interleaved rounds of pool and subprocess runs")
parser.add_argument("--workers", type=int, default=os.cpu_count() or 1, help="pool workers and concurrency")
parser.add_argument("--before", help="another sandbox.py to measure in the same run (the code before)")
parser.add_argument("--calls", type=int, default=100, help="print(1+1) calls a round and pool (--before)")
parser.add_argument("--latency-rounds", type=int, default=30, help="interleaved print(1+1) rounds (--before)")
args = parser.parse_args()


def timed(call, code):
    start = time.perf_counter()
    call(code)
    return time.perf_counter() - start


def naive(code):
    return subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)


def load(path):
    """The sandbox module in `path`, under another name (its workers run that file)."""
    spec = importlib.util.spec_from_file_location("sandbox_before", os.path.abspath(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def worker_cpu(box):
    """CPU seconds so far of a pool's workers, their children included (calls, a PID namespace's worker)."""
    def tree(pid):
        try:
            fields = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            kids = open(f"/proc/{pid}/task/{pid}/children").read().split()
        except OSError:
            return 0
        return sum(map(int, fields[11:15])) + sum(tree(kid) for kid in kids)
    return sum(tree(proc.pid) for proc in list(box._procs.values())) / TICK


# -----------------------------------------------------------------------------
# Each workload through the pool(s) and through a subprocess per call, in interleaved rounds: the machine
# may be shared, so all should see the same load

n = args.workers
pools = {"pool": sandbox.Sandbox(workers=n)}
if args.before:
    pools["before"] = load(args.before).Sandbox(workers=n)
speedups = {name: [] for name in pools}
with ThreadPoolExecutor(n) as ex:
    for name, box in pools.items():
        print(f"{name}: {n} workers, concurrency {n}, {args.rounds} interleaved rounds, {box.isolation}")
    for workload, code in WORKLOADS.items():
        for box in pools.values():
            box.run_batch([code] * 2 * n)  # warm-up
        calls = {who: (box.run, 100 if workload == "sympy" else 600) for who, box in pools.items()}
        calls["subprocess"] = (naive, (2 if workload == "sympy" else 12) * n)
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
            print(f"{workload:6} {who:10} {rates[who]:8.1f} calls/s  p50 {lat[len(lat) // 2] * 1e3:7.1f} ms  "
                  f"p99 {lat[int(0.99 * len(lat))] * 1e3:7.1f} ms")
        for who in pools:
            speedups[who].append(f"{workload} {rates[who] / rates['subprocess']:.1f}")

# -------------------------------------------------------------------------
# A burst: all submitted at once, each latency from its own submission

for name, box in pools.items():
    burst = []
    for _ in range(BURST):
        submitted = time.perf_counter()
        future = box.submit(WORKLOADS["tiny"])
        future.add_done_callback(lambda f, t=submitted: burst.append(time.perf_counter() - t))
    while len(burst) < BURST:
        time.sleep(0.01)
    burst.sort()
    print(f"{name:6} burst of {BURST} tiny submissions: p50 {burst[BURST // 2] * 1e3:.1f} ms  "
          f"p99 {burst[int(0.99 * BURST)] * 1e3:.1f} ms")
for box in pools.values():
    box.close()

# -------------------------------------------------------------------------
# print(1+1), one call at a time, through a one-slot pool of each, in interleaved rounds: the latency a
# tool call sees, and the CPU that a call costs the machine

ratio = ""
if args.before:
    boxes = {"after": sandbox.Sandbox(workers=1), "before": load(args.before).Sandbox(workers=1)}
    per_call = {who: dict(wall=[], cpu=[]) for who in boxes}
    for box in boxes.values():
        box.run_batch(["print(1+1)"] * 50)  # warm-up
    for _ in range(args.latency_rounds):
        for who, box in boxes.items():
            cpu, start = worker_cpu(box) + sum(os.times()[:2]), time.perf_counter()
            for _ in range(args.calls):
                assert box.run("print(1+1)").stdout == "2\n"
            per_call[who]["wall"].append((time.perf_counter() - start) / args.calls)
            per_call[who]["cpu"].append((worker_cpu(box) + sum(os.times()[:2]) - cpu) / args.calls)
    for who, measured in per_call.items():  # (CPU is counted in ticks, 10 ms: a mean over all rounds)
        wall, cpu = statistics.median(measured["wall"]), statistics.mean(measured["cpu"])
        print(f"print(1+1) {who:6} {wall * 1e3:6.2f} ms a call (median of {args.latency_rounds} rounds), "
              f"{cpu * 1e3:6.2f} ms of CPU (mean)")
    wall = statistics.median(a / b for a, b in zip(per_call["after"]["wall"], per_call["before"]["wall"]))
    cpu = sum(per_call["after"]["cpu"]) / sum(per_call["before"]["cpu"])
    ratio = (f"; before: {', '.join(speedups['before'])}; "
             f"print(1+1) after/before: latency {wall:.2f}, cpu {cpu:.2f}")
    for box in boxes.values():
        box.close()

os_fork, libc_fork = map(float, subprocess.run([sys.executable, "-c", FORKS], capture_output=True, text=True,
                                               check=True).stdout.split())
print(f"fork and exit with the light worker's modules: os.fork {os_fork * 1e3:.2f} ms of CPU, "
      f"libc fork {libc_fork * 1e3:.2f} ms (its at-fork hooks: {(os_fork - libc_fork) * 1e3:.2f} ms)")
print("speedup vs subprocess: " + ", ".join(speedups["pool"]) + ratio)
