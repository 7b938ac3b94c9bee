"""The code sandbox: a forked process pool that runs model-written Python and grades answers.

Each worker slot has two long-lived processes started from a clean interpreter (never forked
from the caller): a "light" one with the math-related standard library imported, and a "full"
one that also has numpy, sympy and math-verify, warmed up. Every call runs in a fresh child
forked from one of them: code that imports only what the light one has goes there (a smaller
process forks faster); the rest, and every answer check, goes to the full one.

Guaranteed (each has an adversarial test in tests/test_sandbox.py):
  1. Nothing the code does raises in the caller: it gets an ExecResult with status ok,
     error (exception, syntax error, exit code != 0), timeout, oom or killed.
  2. At `timeout` seconds (wall clock) every process of the call is killed, grandchildren
     that called setsid included; no process of a call outlives it.
  3. Address space is capped at `memory_mb` above the worker's own; MemoryError -> "oom".
  4. stdout keeps its first `max_output` characters, stderr its last (where the error is);
     `truncated` says either was cut. No file, stdout included, can grow past 16 MB.
  5. Each call is a new process in a new empty directory (removed afterwards) with new
     random seeds: nothing set in one call is visible in the next.
  6. The caller's environment variables (tokens, keys) are not visible.
  7. A worker that dies is replaced; the call it was running returns "killed".
As root, where the kernel allows namespaces (`Sandbox.isolation` reports what held), also:
  8. Calls run as an unprivileged uid of their own (one per slot) with no_new_privs and at
     most 64 processes: fork bombs stop, and the trainer or the tests cannot be signalled.
  9. No network: each worker has a new network namespace in which no interface is up.
 10. Each worker has a private mount namespace where every mount is read-only and /tmp is a
     fresh root-owned tmpfs: a call can write only inside its own directory.
Not guaranteed: without root or namespaces 8-10 do not hold (code runs as the caller). A call
can read world-readable files, list processes in /proc and burn CPU until its timeout; kernel
keyrings and POSIX message queues of its uid outlive it. The dropped uid can import only what
its worker imported (Python lives under /root here). The worker compiles the code before it
forks. An answer check is as safe as math-verify's parser, run inside the same confinement.
"""
import argparse, ast, builtins, functools, itertools, json, os, queue, random, select, shutil
import signal, subprocess, sys, tempfile, threading, time, traceback, types
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

MAX_FILE, OOM_EXIT = 16 << 20, 101  # RLIMIT_FSIZE in bytes; the child's exit code for MemoryError


@dataclass
class ExecResult:
    status: str  # "ok", "error", "timeout", "oom" or "killed"
    stdout: str
    stderr: str
    seconds: float
    truncated: bool = False


KILLED = {"status": "killed", "stdout": "", "stderr": "the sandbox worker died", "seconds": 0.0}

# -----------------------------------------------------------------------------
# Caller side: a queue of jobs, one dispatcher thread per worker slot

_slots = itertools.count()  # slot numbers, unique within this process


class Sandbox:
    def __init__(self, workers=None, timeout=5.0, memory_mb=1024, max_output=1000):
        self.timeout, self.memory_mb, self.max_output = timeout, memory_mb, max_output
        self.isolation = {}  # {"user", "network", "filesystem"} -> bool, as the workers found
        self._jobs, self._lock, self._procs, self._closed = queue.SimpleQueue(), threading.Lock(), {}, False
        self._light_modules = set()
        n = workers or os.cpu_count() or 1
        self._uids = [2**30 + (os.getpid() << 8) + next(_slots) % 256 for _ in range(n)]  # pid < 2**22
        started = [threading.Event() for _ in range(n)]
        self._threads = [threading.Thread(target=self._serve, args=a, daemon=True) for a in zip(self._uids, started)]
        for t in self._threads:
            t.start()
        for ev in started:
            ev.wait()
        if len(self._procs) < 2 * n:
            self.close()
            raise RuntimeError("sandbox workers failed to start (their stderr is above)\n"
                               "---> HINT: run `python sandbox.py --worker full 0 5 1024 1000` to see why")

    def submit(self, code, stdin=""):
        """Run `code` with `stdin` as its standard input: a Future[ExecResult]. Thread-safe."""
        return self._put({"kind": "exec", "code": str(code), "stdin": str(stdin)}, lambda r: r)

    def run(self, code, stdin=""):
        return self.submit(code, stdin).result()

    def run_batch(self, jobs):
        """jobs: code strings or (code, stdin) pairs; returns the results in the same order."""
        futures = [self.submit(*j) if isinstance(j, tuple) else self.submit(j) for j in jobs]
        return [f.result() for f in futures]

    def submit_verify(self, answer, gold):
        """Future[bool]: is `answer` equivalent to `gold` (math-verify)? False on timeout or crash."""
        job = {"kind": "verify", "answer": str(answer), "gold": str(gold)}
        return self._put(job, lambda r: r.status == "ok" and r.stdout == "True\n")

    def verify_batch(self, pairs):
        futures = [self.submit_verify(a, g) for a, g in pairs]
        return [f.result() for f in futures]

    def _put(self, job, convert):
        if self._closed:
            raise RuntimeError("this Sandbox is closed")
        future = Future()
        self._jobs.put((future, job, convert))
        return future

    def _serve(self, uid, started):
        procs = {kind: self._spawn(uid, kind) for kind in ("light", "full")}
        started.set()
        while (job := self._jobs.get()) is not None:
            future, request, convert = job
            if not future.set_running_or_notify_cancel():
                continue
            light = request["kind"] == "exec" and _runs_light(request["code"], self._light_modules)
            kind = "light" if light else "full"
            reply = _ask(procs[kind], request, self.timeout + 10.0, self._lock) if procs[kind] else None
            if reply is None:  # the worker died or hung: replace it
                _stop(procs[kind], self._lock, wait=0)
                procs[kind] = None if self._closed else self._spawn(uid, kind)
            future.set_result(convert(ExecResult(**(reply or KILLED))))
        for proc in procs.values():
            _stop(proc, self._lock)

    def _spawn(self, uid, kind):
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
               "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        args = [sys.executable, "-I", "-B", os.path.abspath(__file__), "--worker", kind, str(uid),
                str(self.timeout), str(self.memory_mb), str(self.max_output)]
        proc = subprocess.Popen(args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env, bufsize=0)
        ready = _ask(proc, None, 120.0, self._lock)
        if ready is None or self._closed:
            _stop(proc, self._lock, wait=0)
            return None
        self.isolation, self._procs[uid, kind] = ready["isolation"], proc
        if kind == "light":
            self._light_modules = set(ready["modules"])
        return proc

    def close(self):
        """Stop the workers (each kills its running call first); queued jobs return "killed"."""
        self._closed = True
        for _ in self._threads:
            self._jobs.put(None)
        for proc in list(self._procs.values()):
            _stop(proc, self._lock)
        for t in self._threads:
            t.join()
        while not self._jobs.empty():
            job = self._jobs.get()
            if job is not None and job[0].set_running_or_notify_cancel():
                job[0].set_result(job[2](ExecResult(**KILLED)))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _runs_light(code, modules):
    """Does `code` import only modules that the light worker has loaded?"""
    if not any(word in code for word in ("import", "exec", "eval")):
        return True
    if len(code) > 50_000 or any(word in code for word in ("__import__", "importlib", "exec", "eval")):
        return False
    try:
        nodes = list(ast.walk(ast.parse(code)))
    except Exception:
        return True  # it fails to compile the same way in either worker
    return all(a.name in modules for n in nodes if isinstance(n, ast.Import) for a in n.names) and \
        all(n.module in modules for n in nodes if isinstance(n, ast.ImportFrom) and n.level == 0)


def _ask(proc, request, timeout, lock):
    """Send one request line (None: only read) and return the reply, or None if the worker is
    gone. The lock stops close() from closing a worker's stdin in the middle of a write."""
    try:
        with lock:
            data = b"" if request is None else json.dumps(request).encode() + b"\n"
            while data:
                data = data[os.write(proc.stdin.fileno(), data):]
        line, deadline = b"", time.monotonic() + timeout
        while not line.endswith(b"\n"):
            if not select.select([proc.stdout], [], [], max(0.0, deadline - time.monotonic()))[0]:
                return None
            if not (chunk := os.read(proc.stdout.fileno(), 1 << 20)):
                return None
            line += chunk
        return json.loads(line)
    except (OSError, ValueError):
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

LIGHT = """math cmath fractions decimal itertools functools collections collections.abc re random
string heapq bisect statistics operator json datetime time copy array struct numbers typing
dataclasses enum textwrap pprint io traceback linecache hashlib base64 calendar secrets
unicodedata csv socket encodings.idna encodings.utf_16 encodings.utf_32 encodings.latin_1""".split()
FULL = LIGHT + "numpy numpy.linalg numpy.fft numpy.polynomial numpy.random numpy.ma mpmath sympy math_verify".split()
SYMPY_ALL = """assumptions calculus combinatorics concrete core discrete functions geometry holonomic integrals
logic matrices ntheory polys series sets simplify solvers stats tensor vector""".split()  # every module: sympy imports lazily
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWNET, MS_REC, MS_PRIVATE = 0x20000, 0x8000000, 0x40000000, 0x4000, 0x40000
PR_SET_PDEATHSIG, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 36, 38


@functools.cache
def _libc():
    import ctypes
    return ctypes.PyDLL(None, use_errno=True)  # PyDLL: calls keep the GIL (see _fork)


def _fork():
    """fork() without Python's at-fork hooks: threading's alone costs every call ~0.4 ms of
    copy-on-write faults. Safe here: the worker has one thread and holds no locks."""
    if (pid := _libc().fork()) < 0:
        raise OSError("fork failed")
    return pid


def _isolate(tmpfs_mb):
    """As root, move this worker (and so every call it forks) into new network, IPC and mount
    namespaces: no interface is up, every mount is read-only, /tmp is a fresh tmpfs."""
    got = {"user": os.geteuid() == 0, "network": False, "filesystem": False}
    if os.geteuid() == 0:
        import ctypes, struct
        libc = _libc()
        got["network"] = libc.unshare(CLONE_NEWNET | CLONE_NEWIPC) == 0
        if libc.unshare(CLONE_NEWNS) == 0 and libc.mount(None, b"/", None, MS_REC | MS_PRIVATE, None) == 0:
            attr = struct.pack("QQQQ", 1, 0, 0, 0)  # mount_setattr(AT_FDCWD, "/", AT_RECURSIVE, RDONLY)
            ro = libc.syscall(ctypes.c_long(442), -100, b"/", 0x8000, attr, ctypes.c_size_t(len(attr)))
            opts = f"size={tmpfs_mb}m,mode=755".encode()
            got["filesystem"] = ro == 0 and libc.mount(b"tmpfs", b"/tmp", b"tmpfs", 6, opts) == 0  # nosuid,nodev
    return got


def _kill_all(uid, pid=None):
    """SIGKILL the call's child `pid` and everything it started. As root, a helper process that
    becomes the call's uid kills all that uid owns (setsid cannot escape that); otherwise the
    process group and the worker's children (a subreaper inherits the call's orphans) die."""
    victims = [] if pid is None else [pid]
    if uid is None:
        victims += [int(p) for p in open(f"/proc/self/task/{os.getpid()}/children").read().split()]
    for p, kill in itertools.product(victims, (os.kill, os.killpg)):
        try:
            kill(p, signal.SIGKILL)
        except OSError:
            pass
    if uid is not None and os.fork() == 0:
        try:
            os.setgid(uid), os.setuid(uid), os.kill(-1, signal.SIGKILL)
        finally:
            os._exit(0)


def _reap_leftovers(uid):
    """Kill and reap whatever the last call left running (usually nothing: one syscall)."""
    while True:
        try:
            if os.waitpid(-1, os.WNOHANG)[0] == 0:  # a child of ours is still alive
                _kill_all(uid)
                time.sleep(0.005)
        except ChildProcessError:
            return


def _read(fd, limit, tail):
    """The first (or last) `limit` characters of a captured stream, and whether it was cut."""
    size, n = os.fstat(fd).st_size, 4 * limit + 4
    text = os.pread(fd, n, max(0, size - n) if tail else 0).decode("utf-8", "replace")
    return (text[-limit:] if tail else text[:limit]), size > n or len(text) > limit


def _call(request, cfg):
    """Run one request in a fresh forked child; the reply (None: the caller is gone). All that
    can be done before the fork is, so the child pays little copy-on-write."""
    if request["kind"] == "verify":
        job = lambda: print(_equivalent(request["answer"], request["gold"])) or 0
    else:
        try:  # compile like a notebook cell: a bare last expression gets its repr printed
            tree = ast.parse(code := request["code"], "<code>")
            last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
            body, last = compile(tree, "<code>", "exec"), last and compile(ast.Expression(last.value), "<code>", "eval")
        except Exception as e:
            err = "".join(traceback.format_exception_only(e))
            return dict(KILLED, status="error", stderr=err[-cfg.max_output:], truncated=len(err) > cfg.max_output)
        job = lambda: _run_code(code, body, last)
    fds = [os.memfd_create(name) for name in ("stdin", "stdout", "stderr")]
    os.write(fds[0], request.get("stdin", "").encode()), os.lseek(fds[0], 0, os.SEEK_SET)
    tempfile.tempdir = cwd = tempfile.mkdtemp(prefix="call-", dir=cfg.tmp)
    if cfg.uid is not None:
        os.chown(cwd, cfg.uid, cfg.uid)
    random.seed(seed := int.from_bytes(os.urandom(4), "little"))
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed)
    sys.stdout.flush(), sys.stderr.flush()
    start = time.monotonic()
    if (pid := _fork()) == 0:
        _child(job, cwd, fds, cfg)  # never returns
    pidfd = os.pidfd_open(pid)
    ready = select.select([pidfd, cfg.parent_fd], [], [], cfg.timeout)[0]  # the parent's pipe stirs at EOF
    if pidfd not in ready:
        _kill_all(cfg.uid, pid)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    seconds = time.monotonic() - start
    _reap_leftovers(cfg.uid)
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


def _child(job, cwd, fds, cfg):
    """The forked child: confine itself, then run the job. Never returns."""
    import resource as r
    code = 1
    try:
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, 1 << 16)
        os.chdir(cwd)
        limits = {r.RLIMIT_AS: cfg.limit_mb << 20, r.RLIMIT_CPU: int(cfg.timeout) + 1, r.RLIMIT_FSIZE: MAX_FILE,
                  r.RLIMIT_CORE: 0, **({} if cfg.uid is None else {r.RLIMIT_NPROC: 64})}
        for res, lim in limits.items():  # (the CPU limit's hard value: SIGKILL a second after SIGXCPU)
            r.setrlimit(res, (lim, lim + (res == r.RLIMIT_CPU)))
        if cfg.uid is not None:
            os.setgroups([]), os.setgid(cfg.uid), os.setuid(cfg.uid)
        _libc().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        code = job()
    except MemoryError:
        code = OOM_EXIT
    except BaseException as e:  # the confinement itself failed
        os.write(2, f"sandbox: {e!r}\n".encode())
    finally:
        try:
            sys.stdout.flush(), sys.stderr.flush()
        finally:
            os._exit(code)


def _run_code(source, body, last):
    """Run a compiled cell; return the exit code."""
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
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)
        return 1
    except BaseException as e:
        import linecache
        linecache.cache["<code>"] = (len(source), None, source.splitlines(True), "<code>")
        tb = e.__traceback__  # from the user's first frame on: none of ours
        while tb is not None and tb.tb_frame.f_code.co_filename != "<code>":
            tb = tb.tb_next
        sys.stderr.write("".join(traceback.format_exception(type(e), e, tb)))
        return 1


def _equivalent(answer, gold):
    """math-verify with each side wrapped in \\boxed{}, so that plain answers such as "3/4",
    "\\frac{3}{4}" or "0.75" parse. Its own (signal-based) timeouts stay on too."""
    from math_verify import parse, verify
    g, a = parse("\\boxed{" + gold + "}"), parse("\\boxed{" + answer + "}")
    return bool(g and a and verify(g, a))


def _worker(kind, uid, timeout, memory_mb, max_output):
    import gc, importlib
    requests, replies = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0), os.dup2(2, 1)  # stray prints go to stderr
    sys.stdout.reconfigure(line_buffering=True, errors="backslashreplace")  # children inherit these
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so a too-big write fails instead of killing
    _libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans of a call come back to us
    isolation = _isolate(tmpfs_mb=int(memory_mb))
    for name in FULL if kind == "full" else LIGHT:
        importlib.import_module(name)
    if kind == "full":  # import all of sympy's math and warm it and math-verify up
        import pkgutil, warnings, sympy as sp
        warnings.simplefilter("ignore")
        for pkg in (importlib.import_module("sympy." + name) for name in SYMPY_ALL):
            for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
                if ".tests" not in m.name and ".benchmarks" not in m.name:
                    importlib.import_module(m.name)
        x = sp.Symbol("x")
        sp.solve(x**2 - 5 * x + 6, x), sp.factorint(2**32 + 1), sp.simplify(sp.sin(x)**2 + sp.cos(x)**2)
        sp.integrate(x * sp.exp(x), x), sp.limit(sp.sin(x) / x, x, 0), sp.series(sp.cos(x), x, 0, 4)
        sp.nsimplify(0.5), sp.isprime(97), sp.Matrix([[1, 2], [3, 4]]).det(), sp.roots(x**2 - 1)
        _equivalent("\\frac{1}{2}", "0.5")
    gc.collect(), gc.freeze()  # the warm heap stays out of the children's garbage collections
    base_mb = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE") >> 20
    cfg = types.SimpleNamespace(uid=int(uid) if os.geteuid() == 0 else None, timeout=float(timeout),
                                limit_mb=base_mb + int(memory_mb), max_output=int(max_output),
                                tmp=tempfile.gettempdir(), parent_fd=requests.fileno())
    if cfg.uid is not None:
        _kill_all(cfg.uid)  # whatever a dead predecessor in this slot left running
    _reap_leftovers(cfg.uid)
    replies.write(json.dumps({"isolation": isolation, "modules": sorted(sys.modules)}).encode() + b"\n")
    for line in requests:
        if (reply := _call(json.loads(line), cfg)) is None:
            break
        replies.write(json.dumps(reply).encode() + b"\n")


# -----------------------------------------------------------------------------
# Benchmark: `python sandbox.py --bench`

BENCH = {"tiny": "print(sum(i * i for i in range(100)))",
         "sympy": "import sympy as sp\nx = sp.symbols('x')\nprint(sp.solve(x**2 - 5*x + 6, x), sp.factorint(2**32 + 1))",
         "error": "def f(n):\n    return 1 / n\nf(0)"}


def _measure(call, code, count, concurrency):
    """calls/s, p50 and p99 latency (s) of `count` calls made from `concurrency` threads."""
    latencies, start = [], time.perf_counter()
    def one(_):
        t = time.perf_counter()
        call(code)
        latencies.append(time.perf_counter() - t)
    with ThreadPoolExecutor(concurrency) as ex:
        list(ex.map(one, range(count)))
    latencies.sort()
    return count / (time.perf_counter() - start), latencies[len(latencies) // 2], latencies[int(0.99 * len(latencies))]


def _bench():
    n = os.cpu_count() or 1
    naive = lambda code: subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)
    speedups = {}
    with Sandbox(workers=n) as sb:
        print(f"{n} workers, concurrency {n}, isolation {sb.isolation}")
        for name, code in BENCH.items():
            sb.run_batch([code] * 2 * n)  # warm-up
            pool = _measure(sb.run, code, 300 if name == "sympy" else 2000, n)
            base = _measure(naive, code, 4 * n if name == "sympy" else 40 * n, n)
            speedups[name] = pool[0] / base[0]
            for who, (rate, p50, p99) in (("pool", pool), ("subprocess", base)):
                print(f"{name:6s} {who:10s} {rate:8.1f} calls/s  p50 {p50 * 1e3:7.1f} ms  p99 {p99 * 1e3:7.1f} ms")
        done, futures = [], []
        for _ in range(1000):  # a burst: all at once; each latency counts from its own submit
            futures.append(sb.submit(BENCH["tiny"]))
            futures[-1].add_done_callback(lambda f, t=time.perf_counter(): done.append(time.perf_counter() - t))
        [f.result() for f in futures]
        done.sort()
        print(f"burst of 1000 tiny submissions: p50 {done[500] * 1e3:.1f} ms  p99 {done[990] * 1e3:.1f} ms")
    print("speedup vs subprocess: " + ", ".join(f"{k} {v:.1f}" for k, v in speedups.items()))


if __name__ == "__main__":
    ap = argparse.ArgumentParser(description="the code sandbox (run with --bench to measure it)")
    ap.add_argument("--bench", action="store_true", help="compare the pool with subprocess.run per call")
    ap.add_argument("--worker", nargs=5, metavar=("KIND", "UID", "TIMEOUT", "MEMORY_MB", "MAX_OUTPUT"),
                    help="internal: serve calls on stdin/stdout")
    args = ap.parse_args()
    if args.worker:
        _worker(*args.worker)
    elif args.bench:
        _bench()
