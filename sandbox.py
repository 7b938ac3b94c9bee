"""The code sandbox: a forked process pool that runs model-written Python and grades answers.

Each worker slot has two long-lived processes started from a clean interpreter (never forked
from the caller): a "light" one with the standard library that math code uses, and a "full"
one that also has numpy, sympy and math-verify, warmed up. Every call runs in a fresh child
forked from one of them: code importing only what the light one has goes there (a smaller
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
forks. An answer check is as safe as math-verify's parser, run in the same confinement.
"""
import argparse, ast, builtins, functools, itertools, json, os, queue, random, select, shutil
import resource, signal, subprocess, sys, tempfile, threading, time, traceback, types
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
# Answer checks are code too. Each side is wrapped in \boxed{} so that plain answers such as "3/4",
# "\frac{3}{4}" or "0.75" parse; math-verify's own (signal-based) timeouts stay on as well.
VERIFY = """from math_verify import parse, verify
gold, answer = (parse("\\\\boxed{{" + s + "}}") for s in ({gold!r}, {answer!r}))
print(bool(gold and answer and verify(gold, answer)))"""

# -----------------------------------------------------------------------------
# Caller side: a queue of jobs, one dispatcher thread per worker slot

_slots = itertools.count()  # slot numbers, unique within this process


class Sandbox:
    def __init__(self, workers=None, timeout=5.0, memory_mb=1024, max_output=1000):
        self.timeout, self.memory_mb, self.max_output = timeout, memory_mb, max_output
        self.isolation = {}  # {"user", "network", "filesystem"} -> bool, as the workers found
        self._jobs, self._lock, self._procs, self._closed, self._modules = queue.SimpleQueue(), threading.Lock(), {}, False, {}
        self._uids = [2**30 + (os.getpid() << 8) + next(_slots) % 256 for _ in range(workers or os.cpu_count() or 1)]
        self._threads = [threading.Thread(target=self._serve, args=(uid,), daemon=True) for uid in self._uids]
        with ThreadPoolExecutor(2 * len(self._uids)) as ex:  # start all workers at once
            started = list(ex.map(self._spawn, *zip(*itertools.product(self._uids, ("light", "full")))))
        if None in started:
            self.close()
            raise RuntimeError("sandbox workers failed to start (their stderr is above)\n"
                               "---> HINT: run `python sandbox.py --worker full 0 5 1024 1000` to see why")
        # code that mentions a module only the full worker has (or could import anything) runs there
        self._heavy = sorted(self._modules["full"] - self._modules["light"]) + ["__import__", "importlib", "exec", "eval"]
        for t in self._threads:
            t.start()

    def submit(self, code, stdin=""):
        """Run `code` with `stdin` as its standard input: a Future[ExecResult]. Thread-safe."""
        return self._put({"code": str(code), "stdin": str(stdin)}, lambda r: r)

    def run(self, code, stdin=""):
        return self.submit(code, stdin).result()

    def run_batch(self, jobs):
        """jobs: code strings or (code, stdin) pairs; returns the results in the same order."""
        futures = [self.submit(*j) if isinstance(j, tuple) else self.submit(j) for j in jobs]
        return [f.result() for f in futures]

    def submit_verify(self, answer, gold):
        """Future[bool]: is `answer` equivalent to `gold` (math-verify)? False on timeout or crash."""
        job = {"code": VERIFY.format(answer=str(answer), gold=str(gold)), "stdin": ""}
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

    def _serve(self, uid):
        while (job := self._jobs.get()) is not None:
            future, request, convert = job
            if not future.set_running_or_notify_cancel():
                continue
            heavy = any(word in request["code"] for word in self._heavy)
            proc = self._procs.get((uid, kind := "full" if heavy else "light"))
            if (reply := proc and _ask(proc, request, self.timeout + 10.0, self._lock)) is None:
                _stop(proc, self._lock, wait=0)
            future.set_result(convert(ExecResult(**(reply or KILLED))))
            if reply is None:
                self._spawn(uid, kind)  # replace the worker that died or hung

    def _spawn(self, uid, kind):
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
               "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        args = [sys.executable, "-I", "-B", os.path.abspath(__file__), "--worker", kind, str(uid),
                str(self.timeout), str(self.memory_mb), str(self.max_output)]
        self._procs[uid, kind] = proc = None if self._closed else subprocess.Popen(
            args, stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        if proc is None or (ready := _ask(proc, None, 120.0, self._lock)) is None:
            return _stop(proc, self._lock, wait=0)
        self.isolation, self._modules[kind] = ready["isolation"], {m.split(".")[0] for m in ready["modules"]}
        return proc

    def close(self):
        """Stop the workers (each kills its running call first); queued jobs return "killed"."""
        self._closed = True
        for _ in self._threads:
            self._jobs.put(None)
        for proc in list(self._procs.values()):
            _stop(proc, self._lock)
        for t in filter(threading.Thread.is_alive, self._threads):
            t.join()
        while not self._jobs.empty():
            if (job := self._jobs.get()) is not None and job[0].set_running_or_notify_cancel():
                job[0].set_result(job[2](ExecResult(**KILLED)))

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _ask(proc, request, timeout, lock):
    """Send one request (None: none) and return the reply line, or None if the worker is gone.
    The lock stops close() from closing a worker's stdin in the middle of a write."""
    try:
        with lock:
            proc.stdin.write(b"" if request is None else json.dumps(request).encode() + b"\n")
            proc.stdin.flush()
        if select.select([proc.stdout], [], [], timeout)[0]:  # a reply arrives whole, or not at all
            return json.loads(proc.stdout.readline())
    except (OSError, ValueError):
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

LIGHT = """math cmath fractions decimal itertools functools collections collections.abc re random string heapq
bisect statistics operator json datetime time copy array struct numbers typing dataclasses enum textwrap pprint
io traceback linecache hashlib base64 calendar secrets unicodedata csv socket encodings.idna encodings.utf_16
encodings.utf_32 encodings.latin_1""".split()
FULL = LIGHT + "numpy numpy.linalg numpy.fft numpy.polynomial numpy.random numpy.ma mpmath sympy math_verify".split()
SYMPY_ALL = """assumptions calculus combinatorics concrete core discrete functions geometry holonomic integrals logic
matrices ntheory polys series sets simplify solvers stats tensor vector""".split()  # sympy imports lazily: all now
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
    """Run one request in a fresh forked child; the reply (None: the caller is gone). What can be
    done before the fork is, so that the child pays little copy-on-write."""
    try:  # compile like a notebook cell: a bare last expression gets its repr printed
        tree = ast.parse(source := request["code"], "<code>")
        last = tree.body.pop() if tree.body and isinstance(tree.body[-1], ast.Expr) else None
        body, last = compile(tree, "<code>", "exec"), last and compile(ast.Expression(last.value), "<code>", "eval")
    except Exception as e:
        err = "".join(traceback.format_exception_only(e))
        return dict(KILLED, status="error", stderr=err[-cfg.max_output:], truncated=len(err) > cfg.max_output)
    fds = [os.memfd_create(name) for name in ("stdin", "stdout", "stderr")]
    os.write(fds[0], request.get("stdin", "").encode()), os.lseek(fds[0], 0, os.SEEK_SET)
    os.mkdir(cwd := f"{cfg.tmp}/{next(cfg.calls)}", 0o700)
    if cfg.uid is not None:
        os.chown(cwd, cfg.uid, cfg.uid)
    tempfile.tempdir = cwd
    random.seed(seed := int.from_bytes(os.urandom(4), "little"))
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(seed)
    sys.stdout.flush(), sys.stderr.flush()
    start = time.monotonic()
    if (pid := _fork()) == 0:
        _child(source, body, last, cwd, fds, cfg)  # never returns
    pidfd = os.pidfd_open(pid)
    ready = select.select([pidfd, cfg.parent_fd], [], [], cfg.timeout)[0]  # the parent's pipe stirs at EOF
    if pidfd not in ready:
        _kill_all(cfg.uid, pid)
    code, seconds = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), time.monotonic() - start
    _reap_leftovers(cfg.uid)
    if any(os.pread(fd, 4096, 0).count(b"\n") > 1 for fd in cfg.ipc):  # the call left SysV IPC objects:
        _libc().unshare(CLONE_NEWIPC)  # leave them behind in the old namespace
        cfg.ipc = [os.close(fd) or os.open(f"/proc/sysvipc/{k}", os.O_RDONLY) for fd, k in zip(cfg.ipc, ("shm", "sem", "msg"))]
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


def _child(source, body, last, cwd, fds, cfg):
    """The forked child: confine itself, then run the code. Never returns."""
    r, code = resource, 1  # (the other limits and no_new_privs are the worker's, inherited)
    try:
        os.setsid()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
        os.closerange(3, 1 << 16)
        os.chdir(cwd)
        r.setrlimit(r.RLIMIT_AS, (cfg.limit_mb << 20,) * 2)
        r.setrlimit(r.RLIMIT_CPU, (int(cfg.timeout) + 1, int(cfg.timeout) + 2))  # SIGXCPU, then SIGKILL
        if cfg.uid is not None:
            os.setgroups([]), os.setgid(cfg.uid), os.setuid(cfg.uid)
        _libc().prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # (cleared by setuid, so set after it)
        code = _run_code(source, body, last)
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


def _worker(kind, uid, timeout, memory_mb, max_output):
    import gc, importlib, pkgutil, warnings
    requests, replies = os.fdopen(os.dup(0), "rb"), os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(os.open(os.devnull, os.O_RDONLY), 0), os.dup2(2, 1)  # stray prints go to stderr
    sys.stdout.reconfigure(line_buffering=True, errors="backslashreplace")  # children inherit these
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # so a too-big write fails instead of killing
    _libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans of a call come back to us
    _libc().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)  # no exec can raise privileges (set-uid programs)
    for res, lim in ((resource.RLIMIT_FSIZE, MAX_FILE), (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, 64)):
        resource.setrlimit(res, (lim, lim))  # inherited by every call; NPROC binds once it is not root
    isolation = _isolate(tmpfs_mb=int(memory_mb))
    for name in FULL if kind == "full" else LIGHT:
        importlib.import_module(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # (sympy has installed its own filters by now)
        for pkg in (importlib.import_module("sympy." + name) for name in SYMPY_ALL if kind == "full"):
            for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
                if ".tests" not in m.name and ".benchmarks" not in m.name:
                    importlib.import_module(m.name)
    if kind == "full":  # warm sympy and math-verify up: they build caches and tables on first use
        exec("from sympy import *\nx = Symbol('x')\nsolve(x**2 - 1), factorint(2**32 + 1), simplify(sin(x)**2 + "
             "cos(x)**2), integrate(x * exp(x), x), limit(sin(x) / x, x, 0), series(cos(x), x, 0, 4)", {})
        exec(VERIFY.format(answer="\\frac{1}{2}", gold="0.5"), {})
    gc.collect(), gc.freeze()  # the warm heap stays out of the children's garbage collections
    base_mb = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE") >> 20
    cfg = types.SimpleNamespace(uid=int(uid) if os.geteuid() == 0 else None, timeout=float(timeout),
                                limit_mb=base_mb + int(memory_mb), max_output=int(max_output),
                                tmp=tempfile.mkdtemp(), parent_fd=requests.fileno(), calls=itertools.count())
    os.chmod(cfg.tmp, 0o711)  # calls may pass through to their own directories, not list or change it
    cfg.ipc = [os.open(f"/proc/sysvipc/{k}", os.O_RDONLY) for k in ("shm", "sem", "msg")] if cfg.uid is not None else []
    if cfg.uid is not None:
        _kill_all(cfg.uid)  # whatever a dead predecessor in this slot left running
    _reap_leftovers(cfg.uid)
    replies.write(json.dumps({"isolation": isolation, "modules": sorted(sys.modules)}).encode() + b"\n")
    for line in requests:
        if (reply := _call(json.loads(line), cfg)) is None:
            break
        replies.write(json.dumps(reply).encode() + b"\n")


# -----------------------------------------------------------------------------
# Benchmark: `python sandbox.py --bench`, the pool against subprocess.run per call

BENCH = {"tiny": "print(sum(i * i for i in range(100)))",
         "sympy": "import sympy as sp\nx = sp.symbols('x')\nprint(sp.solve(x**2 - 5*x + 6, x), sp.factorint(2**32 + 1))",
         "error": "def f(n):\n    return 1 / n\nf(0)"}


def _bench():
    n, speedups, done = os.cpu_count() or 1, {}, []
    naive = lambda code: subprocess.run([sys.executable, "-c", code], capture_output=True, timeout=60)

    def measure(call, code, count):  # calls/s, p50 and p99 latency in ms, from n threads
        def timed(_):
            t = time.perf_counter()
            call(code)
            return time.perf_counter() - t
        start = time.perf_counter()
        with ThreadPoolExecutor(n) as ex:
            latencies = sorted(ex.map(timed, range(count)))
        return count / (time.perf_counter() - start), 1e3 * latencies[count // 2], 1e3 * latencies[int(0.99 * count)]

    with Sandbox(workers=n) as sb:
        print(f"{n} workers, concurrency {n}, isolation {sb.isolation}")
        for name, code in BENCH.items():
            sb.run_batch([code] * 2 * n)  # warm-up
            pool = measure(sb.run, code, 300 if name == "sympy" else 2000)
            base = measure(naive, code, (4 if name == "sympy" else 40) * n)
            speedups[name] = pool[0] / base[0]
            for who, result in (("pool", pool), ("subprocess", base)):
                print("%-6s %-10s %8.1f calls/s  p50 %7.1f ms  p99 %7.1f ms" % (name, who, *result))
        for _ in range(1000):  # a burst, all submitted at once; each latency from its own submit
            sb.submit(BENCH["tiny"]).add_done_callback(lambda f, t=time.perf_counter(): done.append(time.perf_counter() - t))
        while len(done) < 1000:
            time.sleep(0.01)
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
