"""The code sandbox: a forked process pool that runs model-written Python and grades answers.

Each slot has two long-lived workers started from a clean interpreter (never forked from the caller):
"light" (the standard library math code uses most) and "full" (more of it, numpy, sympy, math-verify,
warmed up). Each call runs in a fresh child forked from "full" if its code names a module only "full"
has, else from "light", whose smaller memory forks faster.

Guaranteed (each has an adversarial test in tests/test_sandbox.py):
  1. Nothing the code does raises in the caller: it gets an ExecResult, status ok, error (exception,
     syntax error, exit code != 0), timeout, oom or killed.
  2. At `timeout` seconds (wall clock) every process of the call is killed, grandchildren that
     called setsid included: no process of a call outlives it.
  3. Address space is capped at `memory_mb` above the worker's own; MemoryError -> "oom".
  4. stdout keeps its first `max_output` characters, stderr its last (where the error is);
     `truncated` says either was cut. No file, stdout included, grows past 16 MB.
  5. Each call is a new process in a new empty directory (removed after it) with new random seeds:
     nothing set in one call is visible in the next.
  6. The caller's environment variables (tokens, keys) are not visible.
  7. A worker that dies is replaced; the call it was running returns "killed".
As root, where the kernel allows namespaces (`Sandbox.isolation` says what held), also:
  8. A call runs as an unprivileged uid (one per slot), no_new_privs, at most 64 processes: fork
     bombs stop, and it cannot signal the trainer or the tests.
  9. No network: each worker has a new network namespace in which no interface is up.
 10. Each worker has a private mount namespace where all mounts are read-only and /tmp is a fresh
     tmpfs (/dev/shm if Python runs from /tmp): a call can write only inside its own directory.
Not guaranteed: 8-10 without root or namespaces (code then runs as the caller). A call can read
world-readable files, list /proc and burn CPU until its timeout; keyrings and POSIX message queues
of its uid outlive it. The dropped uid can import only what its worker imported (Python lives
under /root here). Workers compile the untrusted code (never run it) before forking.
"""
import ast, builtins, contextlib, ctypes, functools, itertools, linecache, marshal, os, random, re, resource
import select, shutil, signal, sys, tempfile, time, traceback, types
from dataclasses import dataclass

if __name__ != "__main__" or sys.argv[1:2] != ["--worker"]:  # the caller's side only: a worker that
    import argparse, subprocess, threading  # has not imported these forks faster
    from concurrent.futures import ThreadPoolExecutor

MAX_FILE, OOM_EXIT = 16 << 20, 101  # RLIMIT_FSIZE in bytes; the child's exit code for MemoryError


@dataclass
class ExecResult:
    status: str  # "ok", "error", "timeout", "oom" or "killed"
    stdout: str
    stderr: str
    seconds: float
    truncated: bool = False


KILLED = {"status": "killed", "stdout": "", "stderr": "the sandbox worker died", "seconds": 0.0}
# An answer check runs confined, like the model's code; \boxed{} makes "3/4", "\frac{3}{4}", "0.75" parse.
VERIFY = """from math_verify import parse, verify
gold, answer = (parse("\\\\boxed{{" + s + "}}") for s in ({gold!r}, {answer!r}))
print(bool(gold and answer and verify(gold, answer)))"""

# -----------------------------------------------------------------------------
# Caller side: a pool of threads, one per worker slot, each talking to its slot's two workers

_slots = itertools.count()  # slot numbers, unique within this process


class Sandbox:
    def __init__(self, workers=None, timeout=5.0, memory_mb=1024, max_output=1000):
        self.timeout, self.memory_mb, self.max_output = timeout, memory_mb, max_output
        self.isolation = {}  # {"user", "network", "filesystem"} -> bool, as the workers found
        self._procs, self._modules, self._lock, self._closed = {}, {}, threading.Lock(), False
        # default: one worker per core, the cores shared among the node's ranks under torchrun
        self.workers = workers or max(1, (os.cpu_count() or 1) // int(os.environ.get("LOCAL_WORLD_SIZE", 1)))
        self._uids = [2**30 + (os.getpid() << 8) + next(_slots) % 256 for _ in range(self.workers)]
        self._slot, uids = threading.local(), iter(self._uids)  # each thread of the pool owns a slot:
        self._pool = ThreadPoolExecutor(len(self._uids), initializer=lambda: setattr(self._slot, "uid", next(uids)))
        with ThreadPoolExecutor(2 * len(self._uids)) as ex:  # start all workers at once
            if None in ex.map(self._spawn, *zip(*itertools.product(self._uids, ("light", "full")))):
                self.close()
                raise RuntimeError("sandbox workers failed to start (their stderr is above)\n"
                                   "---> HINT: run `python sandbox.py --worker full 0 5 1024 1000` to see why")
        # code naming a module that only the full worker has (or a way to import anything) runs there
        heavy = sorted(self._modules["full"] - self._modules["light"]) + ["__import__", "importlib", "exec", "eval"]
        self._heavy = re.compile(r"\b(?:%s)\b" % "|".join(heavy))

    def submit(self, code, stdin=""):
        """Run `code` with `stdin` as its standard input: a Future[ExecResult]. Thread-safe."""
        return self._pool.submit(self._execute, str(code), str(stdin))

    def run(self, code, stdin=""):
        return self.submit(code, stdin).result()

    def run_batch(self, jobs):
        """jobs: code strings or (code, stdin) pairs; returns the results in the same order."""
        return [f.result() for f in [self.submit(*j) if isinstance(j, tuple) else self.submit(j) for j in jobs]]

    def submit_verify(self, answer, gold):
        """Future[bool]: is `answer` equivalent to `gold` (math-verify)? False on timeout or crash."""
        code = VERIFY.format(answer=str(answer), gold=str(gold))
        return self._pool.submit(lambda: (r := self._execute(code, "")).status == "ok" and r.stdout == "True\n")

    def verify_batch(self, pairs):
        return [f.result() for f in [self.submit_verify(a, g) for a, g in pairs]]

    def _execute(self, code, stdin):  # (in a thread of the pool)
        uid, kind = self._slot.uid, "full" if self._heavy.search(code) else "light"
        if (proc := self._procs.get((uid, kind))) is None or proc.poll() is not None:
            proc = self._spawn(uid, kind)  # it died while idle: replace it first (not once closed)
        if (reply := _ask(proc, (code, stdin), self.timeout + 10, self._lock) if proc else None) is None:
            _stop(proc, self._lock, wait=0)
            self._spawn(uid, kind)  # replace the worker that died or hung
        return ExecResult(**(reply or KILLED))

    def _spawn(self, uid, kind):
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
               "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        args = [sys.executable, "-I", "-B", os.path.abspath(__file__), "--worker", kind, str(uid),
                str(self.timeout), str(self.memory_mb), str(self.max_output)]
        self._procs[uid, kind] = proc = None if self._closed else subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, start_new_session=True)
        if proc is None or (ready := _ask(proc, None, 120.0, self._lock)) is None:
            return _stop(proc, self._lock, wait=0)
        self.isolation, self._modules[kind] = ready["isolation"], {m.split(".")[0] for m in ready["modules"]}
        return proc

    def close(self):
        """Stop the workers (each kills its running call first); calls not yet run return "killed"."""
        self._closed = True
        for proc in list(self._procs.values()):
            _stop(proc, self._lock)
        self._pool.shutdown()
        for proc in list(self._procs.values()):  # (one may have been replaced meanwhile)
            _stop(proc, self._lock)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _ask(proc, request, timeout, lock):
    """Send one request (None: none) and return the reply, None if the worker is gone (marshal: same Python)."""
    try:
        with lock:  # (so that close() cannot close a worker's stdin in the middle of a write)
            proc.stdin.write(b"" if request is None else marshal.dumps(request))
            proc.stdin.flush()
        if select.select([proc.stdout], [], [], timeout)[0]:  # a reply comes whole, or not at all
            return marshal.load(proc.stdout)
    except (OSError, ValueError, EOFError):
        pass
    return None


def _stop(proc, lock, wait=5.0):
    """A worker whose stdin closes kills its running call, cleans up and exits."""
    if proc is not None:
        try:
            with lock:
                proc.stdin.close()
            proc.wait(timeout=wait)
        except (OSError, ValueError, subprocess.TimeoutExpired):
            proc.kill(), proc.wait()


# -----------------------------------------------------------------------------
# Worker side: `python sandbox.py --worker KIND UID TIMEOUT MEMORY_MB MAX_OUTPUT`

LIGHT = """math cmath fractions decimal itertools functools collections re random string heapq bisect statistics operator
time copy typing numbers _strptime encodings.idna encodings.utf_16 encodings.utf_32 encodings.latin_1 encodings.cp1252""".split()
FULL = LIGHT + """json datetime array struct dataclasses enum textwrap pprint io traceback linecache hashlib base64 calendar
secrets unicodedata csv socket difflib zlib queue threading subprocess logging argparse numpy numpy.linalg numpy.fft
numpy.polynomial numpy.random numpy.ma mpmath sympy math_verify""".split()
SYMPY_ALL = """assumptions calculus combinatorics concrete core discrete functions geometry holonomic integrals logic
matrices ntheory polys series sets simplify solvers stats tensor vector""".split()  # sympy imports lazily: all now
# Warm-up cells, run like calls: sympy and math-verify fill caches on first use, the traceback printer too
WARM = ["from sympy import *\nfrom math_verify import parse, verify\nx = Symbol('x')\nsolve(x**2 - 1), factorint(360)\n"
        "simplify(sin(x)**2 + cos(x)**2), integrate(x * exp(x), x), limit(sin(x) / x, x, 0), series(cos(x), x, 0, 4)\n"
        "verify(parse('\\\\boxed{\\\\frac{1}{2}}'), parse('\\\\boxed{0.5}'))", "x = [1]\nx[0] / 0"]
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWNET, MS_REC, MS_PRIVATE = 0x20000, 0x8000000, 0x40000000, 0x4000, 0x40000
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38
IPC = [f"/proc/sysvipc/{k}" for k in ("shm", "sem", "msg")]


@functools.cache
def _libc():
    return ctypes.PyDLL(None, use_errno=True)  # PyDLL: calls keep the GIL (see the fork in _call)


def _isolate(tmpfs_mb):
    """As root, move this worker (and so every call it forks) into new network, IPC and mount
    namespaces: no interface is up, every mount is read-only, /tmp is a fresh tmpfs (/dev/shm when
    this Python or its packages live under /tmp, which the tmpfs would hide from the imports)."""
    got, libc = {"user": os.geteuid() == 0, "network": False, "filesystem": False}, _libc()
    used = [sys.prefix, sys.base_prefix, __file__] + sys.path
    under_tmp = any(q.startswith("/tmp/") for p in used if p for q in (os.path.abspath(p), os.path.realpath(p)))
    scratch = b"/dev/shm" if under_tmp else b"/tmp"
    if os.geteuid() == 0:
        got["network"] = libc.unshare(CLONE_NEWNET | CLONE_NEWIPC) == 0
        if libc.unshare(CLONE_NEWNS) == 0 and libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) == 0:
            attr = (ctypes.c_uint64 * 4)(1, 0, 0, 0)  # mount_setattr(AT_FDCWD, "/", AT_RECURSIVE, RDONLY)
            ro = libc.syscall(ctypes.c_long(442), -100, b"/", 0x8000, attr, ctypes.c_size_t(32))
            opts = f"size={tmpfs_mb}m,mode=755".encode()
            got["filesystem"] = ro == 0 and libc.mount(b"tmpfs", scratch, b"tmpfs", 6, opts) == 0  # nosuid,nodev
    return got, scratch.decode() if got["filesystem"] else None


def _kill_leftovers(cfg, force=False):
    """Kill and reap all that calls left running (usually nothing: one read). As root, a helper that
    becomes the calls' uid kills all that uid owns (setsid cannot escape that); else the worker's
    children and their process groups die (the worker is a subreaper: a call's orphans come to it)."""
    while force or os.pread(cfg.children, 1, 0):  # the worker has children, zombies included
        if not force and os.waitpid(-1, os.WNOHANG)[0]:
            continue  # (reaped one)
        if cfg.uid is None:
            for pid, kill in itertools.product(os.pread(cfg.children, 1 << 16, 0).split(), (os.kill, os.killpg)):
                with contextlib.suppress(OSError):
                    kill(int(pid), signal.SIGKILL)
        elif os.fork() == 0:
            with contextlib.suppress(BaseException):
                os.setgid(cfg.uid), os.setuid(cfg.uid), os.kill(-1, signal.SIGKILL)
            os._exit(0)
        force = False
        time.sleep(0.005)


def _read(fd, limit, tail):
    """The first (or last) `limit` characters of a captured stream, and whether it was cut."""
    size, n = os.fstat(fd).st_size, 4 * limit + 4
    text = os.pread(fd, n, max(0, size - n) if tail else 0).decode("utf-8", "replace")
    return (text[-limit:] if tail else text[:limit]), size > n or len(text) > limit


def _compile(source):
    """Compile a cell like a notebook does: (its body, its bare last expression or None). Its lines go
    in linecache, for the tracebacks and warnings of the child that runs it."""
    linecache.cache["<code>"] = (len(source), None, source.splitlines(True), "<code>")
    tree = ast.parse(source, "<code>")
    last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
    return compile(tree, "<code>", "exec"), last and compile(ast.Expression(last.value), "<code>", "eval")


def _call(source, stdin, cfg):
    """Run one request in a fresh forked child; the reply (None: the caller is gone). After the fork,
    each page either process writes costs a fault and a copy: the worker prepares all it can first."""
    try:
        body, last = _compile(source)
    except Exception as e:
        err = "".join(traceback.format_exception_only(e))
        return dict(KILLED, status="error", stderr=err[-cfg.max_output:], truncated=len(err) > cfg.max_output)
    fds = [os.memfd_create(name) for name in ("stdin", "stdout", "stderr")]
    os.write(fds[0], stdin.encode(errors="replace")), os.lseek(fds[0], 0, os.SEEK_SET)
    os.mkdir(cwd := f"{cfg.tmp}/{next(cfg.calls)}", 0o700)
    if cfg.uid is not None:
        os.chown(cwd, cfg.uid, cfg.uid)
    tempfile.tempdir = cwd
    random.seed(seed := int.from_bytes(os.urandom(4), "little"))
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed)
    sys.stdout.flush(), sys.stderr.flush()
    start = time.monotonic()
    # libc's fork, not os.fork: Python's at-fork hooks (threading's alone) cost ~0.4 ms of copy-on-write
    # faults per call. Safe: the worker has one thread and holds no locks.
    if (pid := _libc().fork()) == 0:
        _child(body, last, cwd, fds, cfg)  # never returns
    pidfd = os.pidfd_open(pid)
    ready = select.select([pidfd, cfg.parent_fd], [], [], cfg.timeout)[0]  # the caller's pipe stirs at EOF
    if pidfd not in ready:  # kill the child and its process group (and all else it started, just below)
        for kill in (os.kill, os.killpg):
            with contextlib.suppress(OSError):
                kill(pid, signal.SIGKILL)
    code, seconds = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), time.monotonic() - start
    _kill_leftovers(cfg)
    if any(os.pread(fd, 4096, 0).count(b"\n") > 1 for fd in cfg.ipc):  # it left SysV IPC objects: leave
        _libc().unshare(CLONE_NEWIPC)  # them behind in the old namespace
        cfg.ipc = [os.close(fd) or os.open(path, os.O_RDONLY) for fd, path in zip(cfg.ipc, IPC)]
    (stdout, cut_out), (stderr, cut_err) = _read(fds[1], cfg.max_output, False), _read(fds[2], cfg.max_output, True)
    for fd in fds + [pidfd]:
        os.close(fd)
    try:
        os.rmdir(cwd)  # usually empty
    except OSError:
        shutil.rmtree(cwd, ignore_errors=True)
    if cfg.parent_fd in ready:
        return None
    status = "timeout" if pidfd not in ready or code == -signal.SIGXCPU else {0: "ok", OOM_EXIT: "oom"}.get(code, "error")
    if code < 0 and status == "error":
        stderr = (stderr + f"\n(killed by {signal.Signals(-code).name})")[-cfg.max_output:]
    return {"status": status, "stdout": stdout, "stderr": stderr, "seconds": seconds, "truncated": cut_out or cut_err}


def _child(body, last, cwd, fds, cfg):
    """The forked child: confine itself, then run the cell. Never returns."""
    code = 1
    try:
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, 1 << 16)
        os.chdir(cwd)
        resource.setrlimit(resource.RLIMIT_AS, (cfg.limit_mb << 20,) * 2)  # the other limits are the worker's
        resource.setrlimit(resource.RLIMIT_CPU, (int(cfg.timeout) + 1, int(cfg.timeout) + 2))  # SIGXCPU, SIGKILL
        if cfg.uid is not None:
            os.setgroups([]), os.setgid(cfg.uid), os.setuid(cfg.uid)
        _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # (setuid clears it, so after that)
        code = _run(body, last)
    finally:
        with contextlib.suppress(BaseException):
            sys.stdout.flush(), sys.stderr.flush()
        os._exit(code)


def _run(body, last):
    """Run a compiled cell as `python -c` would, a bare last expression printed; the exit code."""
    scope = {"__name__": "__main__", "__builtins__": builtins}
    try:
        exec(body, scope)
        if last is not None and (value := eval(last, scope)) is not None:
            print(repr(value))
        return 0
    except MemoryError:
        scope.clear()
        os.write(2, b"MemoryError\n")
        return OOM_EXIT
    except SystemExit as e:  # as Python does: sys.exit(None or int), or print the message and exit 1
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException as e:  # the traceback from the user's first frame on: none of ours
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != "<code>":
            tb = tb.tb_next
        sys.stderr.write("".join(traceback.format_exception(type(e), e, tb)))
        return 1


def _worker(kind, uid, timeout, memory_mb, max_output):
    import gc, importlib, io, pkgutil, warnings
    root = os.geteuid() == 0
    requests, replies = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0), os.dup2(2, 1)  # stray prints go to stderr
    sys.stdout.reconfigure(line_buffering=True, errors="backslashreplace")  # calls inherit all of this:
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a too-big write fails rather than kills
    _libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans of a call come back to us
    _libc().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # no exec can raise privileges (set-uid programs)
    for res, lim in [(resource.RLIMIT_FSIZE, MAX_FILE), (resource.RLIMIT_CORE, 0)] + [(resource.RLIMIT_NPROC, 64)] * root:
        resource.setrlimit(res, (lim, lim))  # (NPROC binds a call once it is not root)
    isolation, scratch = _isolate(tmpfs_mb=int(memory_mb))
    for name in FULL if kind == "full" else LIGHT:
        importlib.import_module(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (sympy has installed its own filters by now)
        for pkg in (importlib.import_module("sympy." + name) for name in SYMPY_ALL if kind == "full"):
            for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
                if ".tests" not in m.name and ".benchmarks" not in m.name:
                    importlib.import_module(m.name)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        for cell in WARM[kind == "light":]:
            _run(*_compile(cell))
    gc.collect(), gc.freeze()  # the warm heap stays out of the children's garbage collections
    base_mb = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE") >> 20
    cfg = types.SimpleNamespace(uid=int(uid) if root else None, timeout=float(timeout), max_output=int(max_output),
                                limit_mb=base_mb + int(memory_mb), tmp=tempfile.mkdtemp(dir=scratch), calls=itertools.count(),
                                parent_fd=requests.fileno(), children=os.open(f"/proc/self/task/{os.getpid()}/children", 0),
                                ipc=[os.open(p, os.O_RDONLY) for p in IPC] if root else [])
    os.chmod(cfg.tmp, 0o711)  # calls may pass through to their own directories, not list or change it
    _kill_leftovers(cfg, force=root)  # whatever a dead predecessor in this slot left running
    replies.write(marshal.dumps({"isolation": isolation, "modules": sorted(sys.modules)}))
    with contextlib.suppress(EOFError):  # (the end of the requests: the caller closed them)
        while (reply := _call(*marshal.load(requests), cfg)) is not None:
            replies.write(marshal.dumps(reply))
    shutil.rmtree(cfg.tmp, ignore_errors=True)


# -----------------------------------------------------------------------------
# Benchmark: `python sandbox.py --bench`, the pool against subprocess.run per call, same concurrency

BENCH = {"tiny": "print(sum(i * i for i in range(100)))",  # (the sympy cell is none the workers warm up with)
         "sympy": "import sympy as sp\nx = sp.symbols('x')\nprint(sp.solve(x**2 - 5*x + 6, x), sp.factorint(2**32 + 1))",
         "error": "def f(n):\n    return 1 / n\nf(0)"}


def _timed(call, code):
    start = time.perf_counter()
    call(code)
    return time.perf_counter() - start


def _bench(rounds=3):
    n, speedups, burst = os.cpu_count() or 1, [], []
    naive = lambda code: subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    with Sandbox(workers=n) as sb, ThreadPoolExecutor(n) as ex:
        print(f"{n} workers, concurrency {n}, {rounds} interleaved rounds, isolation {sb.isolation}")
        for name, code in BENCH.items():
            sb.run_batch([code] * 2 * n)  # warm-up
            runs = {"pool": (sb.run, 100 if name == "sympy" else 600), "subprocess": (naive, (2 if name == "sympy" else 12) * n)}
            seconds, latencies = dict.fromkeys(runs, 0.0), {who: [] for who in runs}
            for _, (who, (call, count)) in itertools.product(range(rounds), runs.items()):  # interleaved: the
                start = time.perf_counter()  # machine may be shared, so both should see the same load
                latencies[who] += ex.map(lambda _: _timed(call, code), range(count))
                seconds[who] += time.perf_counter() - start
            for who, lat in latencies.items():
                rate, lat = len(lat) / seconds[who], sorted(lat)
                print(f"{name:6} {who:10} {rate:8.1f} calls/s  p50 {lat[len(lat) // 2] * 1e3:7.1f} ms  "
                      f"p99 {lat[int(0.99 * len(lat))] * 1e3:7.1f} ms")
            rates = [len(latencies[who]) / seconds[who] for who in runs]
            speedups.append(f"{name} {rates[0] / rates[1]:.1f}")
        for _ in range(1000):  # a burst, all submitted at once; each latency from its own submit
            sb.submit(BENCH["tiny"]).add_done_callback(lambda f, t=time.perf_counter(): burst.append(time.perf_counter() - t))
        while len(burst) < 1000:
            time.sleep(0.01)
        burst.sort()
        print(f"burst of 1000 tiny submissions: p50 {burst[500] * 1e3:.1f} ms  p99 {burst[990] * 1e3:.1f} ms")
    print("speedup vs subprocess: " + ", ".join(speedups))


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(*sys.argv[2:])  # internal: KIND UID TIMEOUT MEMORY_MB MAX_OUTPUT, as Sandbox._spawn passes them
elif __name__ == "__main__":
    ap = argparse.ArgumentParser(description="the code sandbox; --bench measures it")
    ap.add_argument("--bench", action="store_true", help="compare the pool with subprocess.run per call")
    if ap.parse_args().bench:
        _bench()
