"""sandbox.py, adversarially: one test per guarantee in its docstring (the numbers in brackets).
Most tests share one two-slot Sandbox; the ones that kill workers or close a sandbox get their own."""
import errno
import marshal
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

import sandbox  # noqa: E402
from infra import isolation  # noqa: E402
from sandbox import SANDBOX_FAILURE, Sandbox, default_workers  # noqa: E402

TIMEOUT = 3.0  # generous: the slowest legitimate call here (sympy, on a busy machine) takes ~1 s
CAP_MB = 256  # the memory cap of the sandbox the memory tests use
SECRET = "hunter2-do-not-leak"
ESCAPING_SLEEPER = "import os, time\nif os.fork() == 0:\n    os.setsid()\n    time.sleep(60)\ntime.sleep(60)"


@pytest.fixture(scope="module")
def sb():
    os.environ["SANDBOX_TEST_SECRET"] = SECRET  # in the caller's environment before the workers start
    with Sandbox(workers=2, timeout=TIMEOUT, memory_mb=512, max_output=1000) as box:
        yield box
    del os.environ["SANDBOX_TEST_SECRET"]


@pytest.fixture(scope="module")
def roomy():
    """One slot with time to spare on a busy machine, and a small memory cap (CAP_MB) to reach in it."""
    with Sandbox(workers=1, timeout=20.0, memory_mb=CAP_MB) as box:
        yield box


@pytest.fixture(scope="module")
def lone():
    """One slot of its own, for the tests that kill or stop its workers (each leaves it working again)."""
    with Sandbox(workers=1, timeout=TIMEOUT, memory_mb=512) as box:
        yield box


def worker_of(box, kind):
    """The slot's `kind` worker process ("light" or "full"): the one a call of that kind runs in."""
    (proc,) = [p for (_, k), p in box._procs.items() if k == kind]
    return proc


def children(pid):
    return [int(child) for child in open(f"/proc/{pid}/task/{pid}/children").read().split()]


def server_of(box, kind):
    """The pid that forks the `kind` worker's calls: the worker, or (in a PID namespace) its one child."""
    pid = worker_of(box, kind).pid
    return children(pid)[0] if box.isolation.get("pid") else pid


def wait_for_a_call(box, kind):
    """Wait until the `kind` worker's call is running: a child of the worker as the calls' user, or (not
    as root) any child (the worker forks a call's child before its request comes)."""
    deadline = time.monotonic() + 10
    while not [pid for pid in children(server_of(box, kind)) if not box.isolation.get("user")
               or int(open(f"/proc/{pid}/status").read().split("\nUid:")[1].split()[0]) in box._uids]:
        assert time.monotonic() < deadline, "the call never started"
        time.sleep(0.01)


def needs(box, what):
    """Skip where `what` did not hold (a mechanism the sandbox does not report, it is tested for anyway)."""
    if not box.isolation.get(what, True):
        pytest.skip(f"no '{what}' isolation here: {getattr(box, 'missing', {}).get(what)} ({box.isolation})")


@pytest.fixture
def world_readable():
    """A folder anyone may read, outside the calls' scratch, like the project's data/ (pytest's tmp_path is
    its owner's alone); removed after the test."""
    path = Path(tempfile.mkdtemp(prefix="sandbox-test-"))
    path.chmod(0o755)
    yield path
    shutil.rmtree(path)


def processes_of(uids):
    """pids of live processes owned by any of `uids` (the calls' unprivileged users)."""
    found = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            status = open(f"/proc/{pid}/status").read()
        except OSError:
            continue
        uid = int(status.split("\nUid:")[1].split()[0])
        if uid in uids and "\nState:\tZ" not in status:
            found.append(int(pid))
    return found


def assert_nothing_left(box):
    deadline = time.monotonic() + 1.0  # the kernel needs a moment to tear down killed processes
    while (left := processes_of(set(box._uids))) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not left, f"processes of the sandbox's users survived their call: {left}"


# -----------------------------------------------------------------------------
# Running code [1]


def test_last_bare_expression_is_printed_like_a_notebook(sb):
    assert sb.run("x = 6\nx * 7").stdout == "42\n"
    assert sb.run("print('hi')").stdout == "hi\n", "a None-valued last expression must print nothing more"
    assert sb.run("import sympy as sp\nsp.Rational(1, 3) + 1").stdout == "4/3\n"


@pytest.mark.parametrize("code, status, in_stderr", [
    ("import os\nos._exit(3)", "error", ""),
    ("import sys\nsys.exit(2)", "error", ""),
    ("import sys\nsys.exit(0)", "ok", ""),
    ("import sys\nsys.exit('bye')", "error", "bye"),
    ("raise ValueError('boom')", "error", "ValueError: boom"),
    ("def f(:\n    pass", "error", "SyntaxError"),
    ("def f(n):\n    return f(n + 1)\nf(0)", "error", "RecursionError"),
    ("x = 1\x00", "error", "null"),
])
def test_failures_come_back_as_results_not_exceptions(sb, code, status, in_stderr):
    r = sb.run(code)
    assert r.status == status and in_stderr in r.stderr, r


def test_traceback_shows_the_users_code_not_the_sandbox(sb):
    r = sb.run("def f(n):\n    return 1 / n\nf(0)")
    assert "ZeroDivisionError" in r.stderr and "return 1 / n" in r.stderr
    assert "sandbox.py" not in r.stderr, f"the sandbox's own frames leak into the traceback: {r.stderr}"


def test_warnings_quote_the_calls_own_line(sb):
    r = sb.run("import warnings\nx = 1\nwarnings.warn('careful')")
    want = "<code>:3: UserWarning: careful\n  warnings.warn('careful')\n"
    assert r.stderr == want, f"wrong source line: {r.stderr}"


def test_input_reads_the_given_stdin(sb):
    assert sb.run("print(input() + input())", "ab\ncd\n").stdout == "abcd\n"


def test_input_without_stdin_is_an_eof_error(sb):
    r = sb.run("input()")
    assert r.status == "error" and "EOFError" in r.stderr


def test_common_imports_work_as_the_unprivileged_user(sb):
    code = """
from sympy import *
import math, cmath, fractions, decimal, itertools, functools, collections, re, random, heapq, bisect
import statistics, string, json, datetime, operator
import numpy as np
import sympy as sp
x, y = symbols('x y')
print(factorint(360), solve(x**2 - 4, x), simplify(sin(x)**2 + cos(x)**2), integrate(x * exp(x), x))
print(limit(sin(x) / x, x, 0), series(cos(x), x, 0, 4), summation(1 / 2**x, (x, 1, oo)), isprime(97))
print(Matrix([[1, 2], [3, 4]]).inv(), nsimplify(0.125), N(pi, 30), binomial(10, 3), totient(36))
print(linsolve([x + y - 3, x - y - 1], [x, y]), solveset(x**2 - 1, x), roots(x**3 - 1))
print(Poly(x**2 + 1).degree(), divisors(12), primerange(1, 20), gcd(12, 18), lcm(4, 6))
print(expand((x + 1)**3), factor(x**2 - 1), diff(sin(x), x))
print(np.linalg.solve(np.eye(2), [1, 2]), np.fft.fft([1, 0, 0, 0]))
print(np.polyfit([0, 1, 2], [1, 3, 5], 1).round(6))
print(np.random.default_rng(0).integers(10), np.arange(6).reshape(2, 3).sum(axis=0), np.linalg.det(np.eye(3)))
print(fractions.Fraction(3, 4) + 1, decimal.Decimal(1) / 7, math.comb(10, 3), cmath.sqrt(-1))
print(statistics.mean([1, 2]), list(itertools.permutations(range(3)))[:2], collections.Counter('aab'))
print(functools.reduce(operator.mul, [1, 2, 3]), re.findall(r'\\d+', 'a1b22'), heapq.nsmallest(2, [3, 1, 2]))
print(bisect.bisect([1, 2, 3], 2), json.dumps({'a': 1}), datetime.date(2024, 1, 1).weekday())
print(string.ascii_lowercase[:3], random.random() < 1, 'é'.encode('utf-16')[:2])
"""
    r = sb.run(code)
    assert r.status == "ok", f"a common import or lazy import fails for the unprivileged user:\n{r.stderr}"


def test_standard_library_works_in_the_light_worker(sb):
    code = """
import math, cmath, fractions, decimal, itertools, functools, collections, re, random, heapq, bisect
import statistics, string, operator, time, copy, typing, numbers
print(time.strptime('2024-01-02', '%Y-%m-%d').tm_yday, 'é'.encode('utf-16')[:2], 'x'.encode('cp1252'))
print(fractions.Fraction(1, 3) ** 2, decimal.Decimal(2).sqrt(), statistics.median([3, 1, 2]))
print(math.isqrt(10**20), copy.deepcopy([1, [2]]), cmath.sqrt(-4), collections.Counter('aab').most_common(1))
print(random.random() < 1)
"""
    assert not sb._heavy.search(code), "the test meant to run in the light worker"
    r = sb.run(code)
    assert r.status == "ok", f"a standard-library (lazy) import fails in the light worker:\n{r.stderr}"


def test_modules_only_the_full_worker_has_send_code_there(sb):
    code = """
import json, datetime, textwrap, unicodedata, hashlib, base64, calendar, difflib, zlib, queue, threading
print(datetime.datetime.strptime('2024-01-02', '%Y-%m-%d').isoformat(), json.dumps({'a': 1}))
print(queue.Queue().empty(), unicodedata.name('é'), hashlib.sha256(b'').hexdigest()[:8])
print(difflib.SequenceMatcher(None, 'ab', 'ac').ratio())
"""
    for module in ("json", "hashlib", "numpy", "sympy"):
        assert sb._heavy.search(f"import {module}"), f"code importing {module} must run in the full worker"
    r = sb.run(code)
    assert r.status == "ok", f"a standard-library import fails in the full worker:\n{r.stderr}"


# -----------------------------------------------------------------------------
# Time, memory and output limits [2-4]


@pytest.mark.parametrize("code", ["while True:\n    pass", "import time\ntime.sleep(60)"])
def test_endless_code_is_killed_near_the_timeout(sb, code):
    start = time.monotonic()
    r = sb.run(code)
    assert r.status == "timeout", r
    assert TIMEOUT <= r.seconds < TIMEOUT + 1.0 and time.monotonic() - start < TIMEOUT + 2.0, r


# Two allocations too big at once, and one that grows (not touched, so fast even on a busy machine).
@pytest.mark.parametrize("code", ["x = bytearray(10**10)", "x = ' ' * 2**33",
                                  "import numpy as np\na = []\nwhile True:\n    a.append(np.empty(10**7))"])
def test_memory_bomb_is_oom(sb, code):
    r = sb.run(code)
    assert r.status == "oom" and "MemoryError" in r.stderr, r


def test_a_reasonable_allocation_fits_under_the_memory_cap(sb):
    assert sb.run("import numpy as np\nprint(np.ones(10_000_000).sum())").stdout == "10000000.0\n"


def test_fork_bomb_is_contained_and_leaves_no_process(sb):
    needs(sb, "user")
    r = sb.run("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass")
    assert r.status in ("timeout", "error"), r
    assert_nothing_left(sb)
    assert sb.run("print('alive')").stdout == "alive\n", "the sandbox does not work after a fork bomb"


def test_grandchild_that_outlives_its_parent_is_killed(sb):
    code = """
import os, time
if os.fork() == 0:
    os.setsid()                     # leave the call's session and process group
    if (pid := os.fork()) == 0:
        time.sleep(60)
        os._exit(0)
    print(pid, flush=True)
    os._exit(0)
_ = os.wait()
"""
    r = sb.run(code)
    if not sb.isolation.get("pid"):  # (in a PID namespace, the pid it printed is not ours to look up)
        pid = int(r.stdout)
        time.sleep(0.1)
        alive = os.path.exists(f"/proc/{pid}") and "\nState:\tZ" not in open(f"/proc/{pid}/status").read()
        assert not alive, f"grandchild {pid} escaped with setsid and outlived its call"
    if sb.isolation.get("user"):
        assert_nothing_left(sb)


def test_endless_output_is_truncated(sb):
    r = sb.run("while True:\n    print('x' * 100)")
    assert r.truncated and r.stdout == ("x" * 100 + "\n") * 9 + "x" * 91, r.stdout[-200:]
    assert r.status in ("error", "timeout")


def test_huge_output_is_truncated_head_for_stdout_tail_for_stderr(sb):
    r = sb.run("import sys\nprint('a' * 10**6 + 'END')\nprint('b' * 10**6 + 'LAST', file=sys.stderr)")
    assert r.status == "ok" and r.truncated
    assert r.stdout == "a" * 1000 and r.stderr == "b" * 995 + "LAST\n"


# -----------------------------------------------------------------------------
# Isolation [5, 6, 8-10]


def test_state_set_in_one_call_is_absent_in_the_next(sb):
    setter = "import sys\nx = 41\nsys.leak = 1\nopen('f.txt', 'w').write('hi')\n__builtins__.leak = 2"
    checker = ("import os, sys\nprint('x' in globals(), hasattr(sys, 'leak'), os.listdir('.'),"
               " hasattr(__builtins__, 'leak'))")
    for _ in range(6):  # two slots: some checker surely follows a setter in the same worker
        assert sb.run(setter).status == "ok"
        assert sb.run(checker).stdout == "False False [] False\n"


def test_sysv_shared_memory_does_not_outlive_its_call(sb):
    needs(sb, "user")
    prefix = "import ctypes\nlibc = ctypes.CDLL(None)\n"
    for _ in range(6):
        created = sb.run(prefix + "print(libc.shmget(0x5EED, 4096, 0o1666) >= 0)")  # 0o1000: IPC_CREAT
        assert created.stdout == "True\n", created
        found = sb.run(prefix + "print(libc.shmget(0x5EED, 0, 0o666) >= 0)")
        assert found.stdout == "False\n", "a SysV shared memory segment outlived its call"


def test_calls_do_not_share_random_streams(sb):
    draws = sb.run_batch(["import random\nrandom.random()"] * 6 + ["import numpy\nnumpy.random.rand()"] * 6)
    assert len({r.stdout for r in draws[:6]}) == 6 and len({r.stdout for r in draws[6:]}) == 6


def test_the_parents_secret_environment_is_not_visible(sb):
    r = sb.run("import os\nprint(dict(os.environ))")
    assert r.status == "ok" and SECRET not in r.stdout
    r = sb.run(f"print(open('/proc/{os.getpid()}/environ').read())")
    assert SECRET not in r.stdout + r.stderr, "the call can read the test process's environment"


def test_code_cannot_kill_its_worker_or_the_test_process(sb):
    needs(sb, "user")
    for target in ("os.getppid()", str(os.getpid())):  # (in a PID namespace the test process is not there)
        r = sb.run(f"import os, signal\nos.kill({target}, signal.SIGKILL)")
        assert r.status == "error" and ("PermissionError" in r.stderr or "ProcessLookupError" in r.stderr), r
    # All it may signal: none (in a PID namespace there is no one else at all: ProcessLookupError)
    r = sb.run("import os, signal\ntry:\n    os.kill(-1, signal.SIGKILL)\n"
               "except ProcessLookupError:\n    pass\nprint('alone')")
    assert r.stdout == "alone\n" and sb.run("print(1)").stdout == "1\n"


def test_a_python_that_lives_under_tmp_still_imports(sb, tmp_path):
    # A clone in /tmp runs its .venv from there: the fresh tmpfs must not hide it from the worker.
    needs(sb, "filesystem")
    if not str(tmp_path).startswith("/tmp/"):
        pytest.skip(f"pytest's temporary directory {tmp_path} is not under /tmp")
    (tmp_path / "venv").symlink_to(os.path.realpath(sys.prefix))
    (tmp_path / "sandbox.py").symlink_to(os.path.join(ROOT, "sandbox.py"))
    (tmp_path / "infra").symlink_to(os.path.join(ROOT, "infra"))
    script = ("from sandbox import Sandbox\n"
              "with Sandbox(workers=1) as sb:\n"
              "    print(sb.run('import numpy, sympy; print(numpy.int64(6) * 7, sympy.factorint(12))'))")
    out = subprocess.run([str(tmp_path / "venv/bin/python"), "-c", script], cwd=tmp_path, capture_output=True,
                         text=True, timeout=300)
    assert "status='ok', stdout='42 {2: 2, 3: 1}" in out.stdout, f"a sandbox run from /tmp failed: {out}"


def test_files_cannot_be_written_outside_the_call_directory(sb):
    needs(sb, "filesystem")
    targets = ["/tmp/x", "/var/tmp/x", "/dev/shm/x", "/x", "/etc/x", f"{ROOT}/x", f"{ROOT}/sandbox.py",
               "../x"]
    code = f"""
import os
written = []
for path in {targets!r}:
    for attempt in (lambda: open(path, 'a').write('x'), lambda: os.mkdir(path + 'd')):
        try:
            attempt()
            written.append(path)
        except OSError:
            pass
open('mine.txt', 'w').write('fine')
print(written, open('mine.txt').read())
"""
    r = sb.run(code)
    assert r.stdout == "[] fine\n", f"the call wrote outside its directory: {r}"
    assert not any(os.path.exists(p) for p in ("/x", "/tmp/x", f"{ROOT}/x", "/dev/shm/x", "/var/tmp/x"))


def test_a_tree_deeper_than_pythons_recursion_limit_is_removed_and_the_worker_lives(roomy):
    # shutil.rmtree recurses once per level: a 3,000-deep tree made it raise RecursionError in the worker.
    # (Under Landlock, which checks each access from the tree's top, making it takes a second or more.)
    code = "import os\nfor _ in range(3000):\n    os.mkdir('d')\n    os.chdir('d')\nprint('deep')"
    for _ in range(3):  # (the same worker each time)
        r = roomy.run(code)
        assert r.status == "ok" and r.stdout == "deep\n", f"the clean-up after the call failed: {r}"


def test_a_call_creates_at_most_10000_files_so_its_clean_up_fits_the_grace(sb):
    # Uncapped, 3 s of mkdir left ~100,000 directories: removing them took longer than making them.
    needs(sb, "filesystem")
    with Sandbox(workers=1, timeout=60.0) as roomy:  # (a loaded machine must not turn this into a timeout)
        for _ in range(3):  # (each clean-up must free the files: the next call makes as many)
            r = roomy.run("import os\ni = 0\nwhile True:\n    os.mkdir(str(i))\n    i += 1")
            assert r.status == "error" and "No space left on device" in r.stderr, r
            assert 9_900 < int(r.stderr.rsplit("'", 2)[1]) < 10_000, r.stderr  # (the name it failed on)


def test_network_connect_to_a_local_listener_fails(sb):
    needs(sb, "network")
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        port = server.getsockname()[1]
        connect = f"socket.create_connection(('127.0.0.1', {port}), timeout=1)"
        r = sb.run(f"import socket\n{connect}\nprint('connected')")
    assert r.status == "error" and "connected" not in r.stdout, r


# -----------------------------------------------------------------------------
# Against a policy that looks for answers: what a call can see, keep and hold [9-14]


ANSWER = "answer-4f1c9e"  # what a fake data file holds for its question


def test_a_call_sees_no_process_but_its_own(sb):
    needs(sb, "pid")
    r = sb.run("import os\nprint(sorted(int(p) for p in os.listdir('/proc') if p.isdigit()), os.getpid())")
    listed, own = r.stdout.rsplit(" ", 1)
    assert listed == f"[{int(own)}]", f"a call lists other processes in /proc: {r.stdout[:300]}"


def test_a_call_cannot_find_the_trainers_data_through_proc(sb, world_readable):
    # A trainer started with --data <file>: the call looks for it in /proc/*/cmdline and reads the file.
    needs(sb, "pid")
    data = world_readable / "rl.jsonl"
    data.write_text(f'{{"question": "2 + 2", "answer": "{ANSWER}"}}\n')
    data.chmod(0o644)
    trainer = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)", "--data", str(data)])
    code = """
import os
found = []
for pid in filter(str.isdigit, os.listdir('/proc')):
    try:
        argv = open(f'/proc/{pid}/cmdline', 'rb').read().split(b'\\0')
        found.append(open(argv[argv.index(b'--data') + 1]).read())
    except (OSError, ValueError, IndexError):
        pass
print(found)
"""
    try:
        time.sleep(0.2)  # (the trainer's command line is in /proc once it has started)
        r = sb.run(code)
    finally:
        trainer.kill()
        trainer.wait()
    assert r.status == "ok" and ANSWER not in r.stdout, f"the call found the trainer's data: {r}"


def test_a_call_cannot_read_world_readable_files_outside_its_scratch(sb, world_readable):
    needs(sb, "landlock")
    data = world_readable / "test.jsonl"
    data.write_text(ANSWER)
    data.chmod(0o644)
    targets = [str(data), str(world_readable), os.path.join(ROOT, "sandbox.py"), ROOT, "/etc/passwd", "/"]
    code = f"""
import os
read = []
for path in {targets!r}:
    try:
        read.append(os.listdir(path) if os.path.isdir(path) else open(path).read(100))
    except OSError:
        pass
lib = next(line.split()[-1] for line in open('/proc/self/maps') if '/libc' in line)
print(read, len(open(lib, 'rb').read(4)))  # (what Python runs on stays readable)
"""
    r = sb.run(code)
    assert r.stdout == "[] 4\n", f"the call read files outside its scratch, or not its own libraries: {r}"


def test_the_previous_calls_output_is_not_in_the_next_calls_memory(lone):
    # The worker used to hold each reply when it forked the next call, which could read it from its memory.
    scan = """
import ctypes
want = {reversed!r}  # the token, reversed: this code never holds it the right way round
hits = 0
for fields in [line.split() for line in open('/proc/self/maps')]:  # (its own memory, as ctypes reads it)
    if fields[1].startswith('rw') and not fields[-1].startswith('[v'):
        start, end = (int(x, 16) for x in fields[0].split('-'))
        hits += ctypes.string_at(start, end - start)[::-1].count(want)
print(hits)
"""
    for _ in range(3):
        token = lone.run("import os\nprint(os.urandom(16).hex())").stdout.strip()
        r = lone.run(scan.format(reversed=token[::-1].encode()))
        assert r.status == "ok" and r.stdout == "0\n", f"the next call found the previous call's output: {r}"


MEMFD_HOARD = """
import os
held = []
for i in range(64):  # 64 x 8 MB = 512 MB, twice the cap
    held.append(os.memfd_create(str(i)))
    os.write(held[-1], b'x' * (8 << 20))
    print(8 * len(held), flush=True)
"""
FORKED_HOARDERS = """
import os, time
r, w = os.pipe()
os.set_blocking(r, False)
children, holding = set(), set()
for _ in range(4):  # 4 x 100 MB, each under the cap by itself
    if (pid := os.fork()) == 0:
        x = b'x' * (100 << 20)
        os.write(w, b'%9d' % os.getpid())
        time.sleep(60)
    children.add(pid)
deadline = time.monotonic() + 15
while children - holding and time.monotonic() < deadline:  # until each child alive holds its 100 MB
    time.sleep(0.05)
    try:
        while (pid := os.waitpid(-1, os.WNOHANG)[0]) > 0:
            children.discard(pid)
        holding |= {int(pid) for pid in os.read(r, 1024).split()}
    except (ChildProcessError, BlockingIOError):
        pass
print(100 * len(children & holding), flush=True)
"""


@pytest.mark.parametrize("code", [MEMFD_HOARD, FORKED_HOARDERS], ids=["memfd", "forked children"])
def test_a_call_holds_no_more_than_its_memory_cap_in_all(roomy, code):
    # memory_mb capped each process (and memfd pages not at all): 512 MB of memfds, 4 x 100 MB of children.
    needs(roomy, "memory")
    r = roomy.run(code)
    held = int(r.stdout.split()[-1]) if r.stdout.split() else 0
    assert r.status == "oom" and held < CAP_MB, f"a call held {held} MB under a {CAP_MB} MB cap: {r}"


def test_a_call_cannot_make_a_user_namespace_or_use_io_uring(sb):
    # unshare(CLONE_NEWUSER) gave full capabilities in a new namespace; io_uring would bypass the filter.
    needs(sb, "seccomp")
    code = f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
print(libc.unshare({isolation.CLONE_NEWUSER}), ctypes.get_errno())
params = ctypes.create_string_buffer(120)
print(libc.syscall(425, 8, params), ctypes.get_errno())  # io_uring_setup (the same number everywhere)
"""
    r = sb.run(code)
    assert r.stdout == f"-1 {errno.EPERM}\n-1 {errno.ENOSYS}\n", f"a user namespace or io_uring: {r}"


def test_a_call_cannot_connect_to_a_host_unix_socket(sb, world_readable):
    # "No network" held for IP and abstract sockets, not for a 0777 socket file on the host (X11, D-Bus...).
    needs(sb, "seccomp")
    path = str(world_readable / "host.sock")
    with socket.socket(socket.AF_UNIX) as server:
        server.bind(path)
        os.chmod(path, 0o777)
        server.listen()
        r = sb.run(f"import socket\nsocket.socket(socket.AF_UNIX).connect({path!r})\nprint('connected')")
        server.setblocking(False)
        with pytest.raises(BlockingIOError):
            server.accept()
    assert r.status == "error" and "connected" not in r.stdout, f"the call reached a host unix socket: {r}"


def test_key_rings_and_posix_message_queues_are_refused(sb):
    # Both outlive a call (a uid's key rings, an IPC namespace's queues): the next call could read them.
    needs(sb, "seccomp")
    add_key = isolation.SYSCALLS[os.uname().machine]["keys"][0]
    code = f"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
print(libc.syscall({add_key}, b'user', b'note', b'{ANSWER}', {len(ANSWER)}, -4), ctypes.get_errno())
print(libc.mq_open(b'/note', os.O_CREAT | os.O_RDWR, 0o600, None), ctypes.get_errno())
"""
    r = sb.run(code)
    assert r.stdout == f"-1 {errno.EPERM}\n-1 {errno.EPERM}\n", f"a key or a message queue was made: {r}"


@pytest.mark.parametrize("code", ["import sys\nsys.exit(101)", "import os\nos._exit(101)"])
def test_an_exit_code_is_an_error_with_its_code_not_oom(sb, code):
    r = sb.run(code)
    assert r.status == "error" and r.exit_code == 101, f"exit code 101 was taken for something else: {r}"


# -----------------------------------------------------------------------------
# Concurrency and workers [1, 7, 8]


def test_1000_submissions_from_several_threads_get_their_own_output(sb):
    def worker(t):
        calls = range(t * 125, (t + 1) * 125)
        futures = [(i, sb.submit(f"print({i}, input())", f"{i * 7}\n")) for i in calls]
        return [f.result().stdout == f"{i} {i * 7}\n" for i, f in futures]
    with ThreadPoolExecutor(8) as ex:
        results = [ok for oks in ex.map(worker, range(8)) for ok in oks]
    assert len(results) == 1000 and all(results), f"{results.count(False)} calls got someone else's output"


def test_a_worker_killed_during_a_call_is_a_sandbox_failure_and_is_replaced(lone):
    future = lone.submit(ESCAPING_SLEEPER)  # (a light call: a time.sleep, and a setsid child that sleeps)
    wait_for_a_call(lone, "light")
    for proc in list(lone._procs.values()):  # both workers: the light one mid-call, the full one idle
        proc.send_signal(signal.SIGKILL)
    r = future.result(timeout=30)
    assert r.status == SANDBOX_FAILURE, f"the sandbox's failure was reported as the code's: {r}"
    assert lone.run("print('back')").stdout == "back\n", "the killed worker was not replaced"
    r = lone.run("import sympy\nsympy.Integer(7)")
    assert r.stdout == "7\n", f"a worker killed while idle fails the next call: {r}"
    if lone.isolation.get("user"):
        assert_nothing_left(lone)  # the replacement kills what the dead worker's call left


def test_a_worker_killed_during_an_answer_check_leaves_that_verdict_none(lone):
    # One slot runs the checks in order: the first (math-verify on a tower of powers) runs until the timeout.
    pairs = [("10^{10^{10^{10}}}", "1"), ("\\frac{1}{2}", "0.5"), ("3", "4"), ("x^2", "x^2")]
    with ThreadPoolExecutor(1) as ex:
        verdicts = ex.submit(lone.verify_batch, pairs)
        wait_for_a_call(lone, "full")
        worker_of(lone, "full").send_signal(signal.SIGKILL)
        assert verdicts.result(timeout=120) == [None, True, False, True], "only the killed check is undecided"
    assert lone.verify_batch([("0.75", "3/4")]) == [True], "the pool did not recover"


def test_a_worker_that_cannot_restart_is_a_sandbox_failure_until_it_can(lone, monkeypatch):
    worker_of(lone, "light").send_signal(signal.SIGKILL)
    worker_of(lone, "light").wait()
    with monkeypatch.context() as patch:
        patch.setattr(sys, "executable", "/bin/false")  # a "Python" that exits at once: no replacement starts
        for _ in range(2):  # (each call tries again)
            r = lone.run("print('hello')")
            assert r.status == SANDBOX_FAILURE, r
    assert lone.run("print('back')").stdout == "back\n", "the worker did not restart once it could"


def test_a_hung_worker_is_a_sandbox_failure_after_timeout_plus_grace(lone, monkeypatch):
    monkeypatch.setattr(sandbox, "GRACE", 2.0)
    r = lone.run("import time\ntime.sleep(60)")
    assert r.status == "timeout", f"a call stopped at its own timeout is the code's doing: {r}"
    os.kill(server_of(lone, "light"), signal.SIGSTOP)  # alive, but it will never reply
    start = time.monotonic()
    r = lone.run("print('hello')")
    waited = time.monotonic() - start
    assert r.status == SANDBOX_FAILURE, r
    assert TIMEOUT + 2.0 <= waited < TIMEOUT + 2.0 + 3.0, f"gave up on a hung worker after {waited:.1f} s"
    assert lone.run("print('back')").stdout == "back\n", "the hung worker was not replaced"


def test_close_kills_running_calls_and_leaves_no_process():
    box = Sandbox(workers=1, timeout=30.0)
    procs = list(box._procs.values())
    future = box.submit(ESCAPING_SLEEPER)
    queued = box.submit("print('never')")  # (one slot: it waits for the first)
    time.sleep(1.0)
    start = time.monotonic()
    box.close()
    assert time.monotonic() - start < 5.0, "close() waited for a running call"
    for f in (future, queued):  # closing the sandbox is not the code's doing
        assert f.result(timeout=1).status == SANDBOX_FAILURE, f.result()
    assert all(p.poll() is not None for p in procs), "a worker survived close()"
    if box.isolation.get("user"):
        assert_nothing_left(box)


def test_a_worker_asked_for_uid_0_or_the_callers_uid_refuses_and_kills_nothing(tmp_path):
    # As root, a worker's clean-up kills every process of the calls' uid: with uid 0 or the caller's, the
    # trainer's too. A PID namespace (as root) keeps what a worker that did not refuse would kill inside it.
    for uid in (0, os.getuid()):
        config = tmp_path / f"config{uid}"
        settings = dict(kind="light", uid=uid, timeout=5.0, memory_mb=512, max_output=1000)
        config.write_bytes(marshal.dumps(settings))
        worker = shlex.join([sys.executable, "-I", os.path.join(ROOT, "sandbox.py"), "--worker"])
        script = (f"sleep 30 & {worker} < {shlex.quote(str(config))}; echo $?; "
                  "kill -0 $! && echo alive; kill $!")  # the worker's exit code; is the bystander alive?
        isolate = ["unshare", "--pid", "--fork", "--mount-proc", "--kill-child"] if os.geteuid() == 0 else []
        out = subprocess.run(isolate + ["sh", "-c", script], capture_output=True, text=True, timeout=120)
        assert f"refusing uid {uid}" in out.stderr, f"a worker accepted uid {uid}: {out}"
        assert out.stdout.split() == ["1", "alive"], f"a worker asked for uid {uid} killed a bystander: {out}"


def test_a_pool_whose_workers_cannot_start_raises_with_a_hint(monkeypatch):
    monkeypatch.setattr(sys, "executable", "/bin/false")  # a "Python" that exits at once
    with pytest.raises(RuntimeError, match="did not start(.|\n)*---> HINT") as error:
        Sandbox(workers=2)
    assert "uid 0" not in str(error.value) and "4 of 4" in str(error.value), error.value


def test_start_up_waits_for_a_slow_worker_that_uses_cpu_and_not_for_a_stuck_one(monkeypatch, tmp_path):
    monkeypatch.setattr(sandbox, "STALLED", 1.0)  # seconds without CPU time: a worker is stuck
    slow = tmp_path / "slow-python"
    stuck = tmp_path / "stuck-python"
    busy = ("import os, sys, time\nend = time.time() + 3\nwhile time.time() < end:\n    pass\n"
            "os.execv(sys.executable, [sys.executable] + sys.argv[1:])")  # busy 3 s, then the real worker
    slow.write_text(f"#!/bin/sh\nexec {shlex.quote(sys.executable)} -c {shlex.quote(busy)} \"$@\"\n")
    stuck.write_text("#!/bin/sh\nexec sleep 60\n")
    for script in (slow, stuck):
        script.chmod(0o755)
    monkeypatch.setattr(sys, "executable", str(slow))
    with Sandbox(workers=1) as box:
        assert box.run("print('up')").stdout == "up\n", "a slow worker was given up while busy starting"
    monkeypatch.setattr(sys, "executable", str(stuck))
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="did not start"):
        Sandbox(workers=1)
    assert time.monotonic() - start < 10, "a stuck worker was waited for long after it stopped using CPU"


V1 = ("cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us")  # cgroup v1's quota and period files


@pytest.mark.parametrize("cores, files, ranks, want", [
    (2, {}, 1, 1),                                     # a laptop: one core kept for trainer and engine
    (96, {"cpu.max": "max 100000\n"}, 8, 11),          # a GPU node, 8 ranks: 12 cores each, one kept
    (96, {"cpu.max": "400000 100000\n"}, 1, 3),        # a container with a 4-core quota on a 96-core machine
    (4, {"cpu.max": "800000 100000\n"}, 1, 3),         # the CPU affinity is the tighter limit
    (64, {"cpu.max": "150000 100000\n"}, 1, 1),        # a fractional quota rounds down; always one worker
    (8, {"cpu.max": "max 100000\n"}, 8, 1),            # more ranks than spare cores
    (96, dict(zip(V1, ["400000\n", "100000\n"])), 1, 3),  # cgroup v1: a 4-core quota
    (96, dict(zip(V1, ["50000\n", "10000\n"])), 1, 4),    # cgroup v1: 5 cores, another period
    (96, dict(zip(V1, ["-1\n", "100000\n"])), 8, 11),     # cgroup v1: no quota
])
def test_default_workers_are_the_usable_cores_shared_among_ranks(tmp_path, cores, files, ranks, want):
    for name, text in files.items():  # a cgroup directory as the kernel shows it
        (tmp_path / name).parent.mkdir(exist_ok=True)
        (tmp_path / name).write_text(text)
    got = default_workers(cores, ranks, str(tmp_path))
    assert got == want, f"{cores} CPUs, cgroup files {files}, {ranks} ranks: {got} workers, not {want}"


def test_default_workers_read_cgroup_v1_through_the_cpu_link(tmp_path):
    # Where v1 mounts the cpu and cpuacct controllers together, cpu/ is a link to cpu,cpuacct/.
    (tmp_path / "cpu,cpuacct").mkdir()
    (tmp_path / "cpu,cpuacct/cpu.cfs_quota_us").write_text("300000\n")
    (tmp_path / "cpu,cpuacct/cpu.cfs_period_us").write_text("100000\n")
    (tmp_path / "cpu").symlink_to("cpu,cpuacct")
    assert default_workers(64, 1, str(tmp_path)) == 2


def test_run_batch_keeps_order_and_accepts_stdin_pairs(sb):
    results = sb.run_batch(["print(1)", ("print(input())", "two\n"), "3"])
    assert [r.stdout for r in results] == ["1\n", "two\n", "3\n"]


# -----------------------------------------------------------------------------
# Answer checks


def test_verify_accepts_equivalent_forms(sb):
    pairs = [("\\frac{1}{2}", "0.5"), ("3/4", "\\frac{3}{4}"), ("0.75", "3/4"), ("1,000", "1000")]
    assert sb.verify_batch(pairs) == [True] * 4


def test_verify_rejects_different_answers(sb):
    assert sb.verify_batch([("3", "4"), ("", "4"), ("}{\\frac", "4"), ("x", "4")]) == [False] * 4


def test_verify_of_a_pathological_answer_returns_false_at_the_timeout(sb):
    # The answer made the check fail (a timeout): a wrong answer, not a sandbox failure (None).
    start = time.monotonic()
    assert sb.verify_batch([("10^{10^{10^{10}}}", "1")]) == [False]
    assert time.monotonic() - start < TIMEOUT + 2.0, "math-verify ran past the sandbox timeout"


def test_verify_from_many_threads(sb):
    pairs = [(str(i), str(i)) for i in range(20)] + [(str(i), str(i + 1)) for i in range(20)]
    with ThreadPoolExecutor(4) as ex:
        got = list(ex.map(lambda p: sb.verify_batch([p])[0], pairs))
    assert got == [True] * 20 + [False] * 20


def test_importing_the_module_is_cheap():
    heavy = ('torch', 'vllm', 'transformers', 'numpy', 'sympy')
    code = f"import sys, sandbox; print(sorted(m for m in {heavy} if m in sys.modules))"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=60)
    assert proc.stdout == "[]\n", f"importing sandbox pulls in heavy modules: {proc.stdout}"
