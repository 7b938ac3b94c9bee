"""The code sandbox: a forked process pool that runs model-written Python and grades answers.

Each slot has two workers, each started from a clean interpreter: "light" (the modules math code uses most)
and "full" (also numpy, sympy, math-verify, warmed up). A call runs in a fresh child forked from "full" if
its code names a module only "full" has, else from "light" (less memory: faster forks).

Guaranteed (each has an adversarial test in tests/test_sandbox.py):
  - Nothing the code does raises in the caller; its ExecResult's status says ok, error, timeout or oom.
  - At `timeout` seconds (wall clock) every process of the call is killed, setsid grandchildren included.
  - Address space is capped at `memory_mb` above the worker's own; MemoryError -> "oom".
  - stdout keeps its first `max_output` characters, stderr its last (`truncated` if cut); no file > 16 MB.
  - Each call is a new process in a new empty directory (removed after it) with new random seeds:
    nothing set in one call (files, SysV IPC objects, globals) is visible in the next.
  - The caller's environment variables (tokens, keys) are not visible.
  - A call whose worker died, hung (silent past timeout + GRACE s), could not start or was closed returns
    SANDBOX_FAILURE; the worker is replaced. Start-up waits while workers use CPU, else raises.
As root, where the kernel allows namespaces (`Sandbox.isolation` says what held), also:
  - Calls run as an unprivileged uid (one per slot; never 0 nor the caller's), no_new_privs, at most 64
    processes: fork bombs stop, and a call cannot signal its worker, the trainer or the tests.
  - No network: no interface is up in the workers' network namespace.
  - All mounts are read-only but a fresh tmpfs: a call writes only in its own directory, <= 10,000 files.
Not guaranteed: these without root or namespaces (there a call that kills or stops its worker, or leaves
too many files to remove in GRACE, gets SANDBOX_FAILURE). A call can read world-readable files, list /proc,
burn CPU to its timeout; its uid's keyrings and POSIX queues outlive it; it imports only its worker's modules.
"""
import ast, builtins, collections, contextlib, ctypes, itertools, linecache, marshal, os, random, re
import resource, select, shutil, signal, subprocess, sys, tempfile, threading, time, traceback, types
from concurrent.futures import ThreadPoolExecutor

SANDBOX_FAILURE = "sandbox_failure"  # a call's status when the sandbox failed, not the code: see above
OOM_EXIT = 101  # the child's exit code for MemoryError
GRACE = 10.0  # seconds past a call's timeout for its worker to clean up and reply: then it is hung
STALLED = 60.0  # a starting worker that uses no CPU for this long (seconds) is stuck: see _ask
LIBC = ctypes.PyDLL(None, use_errno=True)  # PyDLL: calls keep the GIL (see the fork in _call)
ExecResult = collections.namedtuple("ExecResult", ["status", "stdout", "stderr", "seconds", "truncated"])
_slots = itertools.count()  # slot numbers, unique within this process
# An answer check runs confined, like the model's code; \boxed{} makes "3/4", "\frac{3}{4}", "0.75" parse.
VERIFY = """from math_verify import parse, verify
gold, answer = (parse("\\\\boxed{{" + s + "}}") for s in ({gold!r}, {answer!r}))
print(bool(gold and answer and verify(gold, answer)))"""

# --- Caller side: a pool of threads, one per worker slot, each talking to its slot's two workers ---


def default_workers(cores, ranks, cgroup="/sys/fs/cgroup"):
    """Workers per rank: the usable cores (`cores` CPUs, capped by the CPU quota in the `cgroup` directory:
    v2's cpu.max "200000 100000" is 2 cores, "max ..." none; v1's cpu/cpu.cfs_quota_us over cpu.cfs_period_us,
    -1 none) over the node's `ranks`, less one per rank for its trainer and engine."""
    for files in ["cpu.max"], ["cpu/cpu.cfs_quota_us", "cpu/cpu.cfs_period_us"]:  # (cpu: often cpu,cpuacct)
        with contextlib.suppress(OSError):  # (no such file: not this format)
            quota, period = " ".join(open(f"{cgroup}/{name}").read() for name in files).split()
            cores = cores if quota in ("max", "-1") else min(cores, int(quota) // int(period))
    return max(1, cores // ranks - 1)


class Sandbox(contextlib.AbstractContextManager):  # (its __enter__ returns the sandbox)
    def __init__(self, workers=None, timeout=5.0, memory_mb=1024, max_output=1000):
        self.timeout = timeout
        self._config = dict(timeout=timeout, memory_mb=memory_mb, max_output=max_output)  # (+ kind, uid)
        self._procs = {}  # (uid, kind) -> its worker
        self._modules = {}  # kind -> its workers' modules: code naming one only "full" has runs there
        self._closed = False
        ranks = int(os.environ.get("LOCAL_WORLD_SIZE", 1))
        self.workers = workers or default_workers(len(os.sched_getaffinity(0)), ranks)
        self._uids = [2**30 + (os.getpid() << 8) + next(_slots) % 256 for _ in range(self.workers)]
        self._slot = threading.local()  # each thread of the pool owns one slot: a uid and its two workers
        uids = iter(self._uids)
        self._pool = ThreadPoolExecutor(self.workers,
                                        initializer=lambda: setattr(self._slot, "uid", next(uids)))
        kinds = ["light"] * self.workers + ["full"] * self.workers
        started = list(self._pool.map(self._spawn, self._uids * 2, kinds))
        if None in started:
            self.close()
            raise RuntimeError(f"sandbox: {started.count(None)} of {len(started)} workers did not start (an "
                               f"error above, or stuck: no CPU used in {STALLED:.0f} s)\n---> HINT: install "
                               "what an error names; if they were stuck, start fewer: Sandbox(workers=N)")
        heavy = self._modules["full"] - self._modules["light"] | {"__import__", "importlib", "exec", "eval"}
        self._heavy = re.compile(r"\b(?:%s)\b" % "|".join(sorted(heavy)))

    def submit(self, code, stdin=""):
        """Run `code` with `stdin` as its standard input: a Future[ExecResult]. Thread-safe."""
        return self._pool.submit(self._execute, str(code), str(stdin))

    def run(self, code, stdin=""):
        return self.submit(code, stdin).result()

    def run_batch(self, jobs):
        """jobs: code strings or (code, stdin) pairs; returns the results in the same order."""
        futures = [self.submit(*j) if isinstance(j, tuple) else self.submit(j) for j in jobs]
        return [f.result() for f in futures]

    def verify_batch(self, pairs):
        """(answer, gold) pairs: is each answer equivalent to its gold (math-verify)? None: SANDBOX_FAILURE"""
        results = self.run_batch([VERIFY.format(answer=str(a), gold=str(g)) for a, g in pairs])
        return [None if r.status == SANDBOX_FAILURE else r.stdout == "True\n" for r in results]

    def _execute(self, code, stdin):  # (in a thread of the pool)
        slot = self._slot.uid, "full" if self._heavy.search(code) else "light"  # (uid, kind)
        proc = self._procs[slot]
        if proc.poll() is not None:
            proc = self._spawn(*slot)  # dead or stopped below: replace it first (None: failed or closed)
        reply = _ask(proc, (code, stdin), self.timeout + GRACE) if proc else None
        if proc and reply is None:
            _stop(proc, wait=0)  # it died or hung
        return ExecResult(**reply) if reply else ExecResult(SANDBOX_FAILURE, "", "sandbox failed", 0.0, False)

    def _spawn(self, uid, kind):
        """Start the slot's worker of this kind; None if it failed (its error is on our stderr) or closed."""
        if self._closed:
            return None
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "LANG": "C.UTF-8",
               "OPENBLAS_NUM_THREADS": "1", "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
        proc = subprocess.Popen([sys.executable, "-I", "-B", os.path.abspath(__file__), "--worker"], env=env,
                                stdin=subprocess.PIPE, stdout=subprocess.PIPE, start_new_session=True)
        self._procs[uid, kind] = proc  # (then close() stops it, or it sees _closed below)
        ready = None if self._closed else _ask(proc, dict(self._config, kind=kind, uid=uid), None)
        if ready is None:
            return _stop(proc, wait=0)
        self.isolation = ready["isolation"]  # {"user", "network", "filesystem"} -> bool, as the workers found
        self._modules[kind] = {m.split(".")[0] for m in ready["modules"]}
        return proc

    def close(self):
        """Stop the workers (each kills its running call first); calls not done return SANDBOX_FAILURE."""
        self._closed = True
        for proc in list(self._procs.values()):
            _stop(proc)
        self._pool.shutdown()

    def __exit__(self, *exc):
        self.close()


def _ask(proc, request, timeout):
    """Send one request, return the reply; None if the worker is gone or silent for `timeout` s. Starting
    (None), it waits while the worker uses CPU: all ranks of a node starting at once could pass any limit."""
    try:
        proc.stdin.write(marshal.dumps(request))  # (a buffered file: close() in another thread waits)
        proc.stdin.flush()
        seen = None  # the worker's user and system CPU time at the last look
        while not select.select([proc.stdout], [], [], timeout or STALLED)[0]:
            cpu = None if timeout else open(f"/proc/{proc.pid}/stat").read().rsplit(")", 1)[1].split()[11:13]
            if cpu is None or cpu == seen:
                return None
            seen = cpu
        return marshal.load(proc.stdout)  # a reply comes whole, or not at all
    except (OSError, ValueError, EOFError):
        return None


def _stop(proc, wait=5.0):
    """A worker whose stdin closes kills its running call, cleans up and exits."""
    try:
        proc.stdin.close()
        proc.wait(timeout=wait)
    except (OSError, ValueError, subprocess.TimeoutExpired):
        proc.kill()
        proc.wait()


# --- Worker side: `python sandbox.py --worker`, its settings then requests on stdin, replies on stdout
LIGHT = """math cmath fractions decimal itertools functools collections re random string heapq bisect
statistics operator time copy typing numbers _strptime encodings.idna encodings.utf_16 encodings.utf_32
encodings.latin_1 encodings.cp1252""".split()
FULL = LIGHT + """json datetime array struct dataclasses enum textwrap pprint io traceback linecache hashlib
base64 calendar secrets unicodedata csv socket difflib zlib queue logging argparse numpy numpy.linalg
numpy.fft numpy.polynomial numpy.random numpy.ma mpmath sympy math_verify""".split()
# sympy imports its subpackages lazily: the full worker imports them all now
SYMPY_ALL = """assumptions calculus combinatorics concrete core discrete functions geometry holonomic
integrals logic matrices ntheory polys series sets simplify solvers stats tensor vector""".split()
# Warm-up cells, run like calls: sympy and math-verify fill caches on first use, the traceback printer too
WARM = ["from sympy import *\nfrom math_verify import parse, verify\nx = Symbol('x')\n"
        "solve(x**2 - 1), factorint(360), simplify(sin(x)**2 + cos(x)**2), integrate(x * exp(x), x)\n"
        "limit(sin(x) / x, x, 0), series(cos(x), x, 0, 4)\n"
        "ok = verify(parse('\\\\boxed{\\\\frac{1}{2}}'), parse('\\\\boxed{0.5}'))", "x = [1]\nx[0] / 0"]
PR_SET_PDEATHSIG = 1  # prctl (linux/prctl.h): a signal for the process when its parent dies
PR_SET_CHILD_SUBREAPER = 36  # prctl: orphaned descendants are reparented to this process
PR_SET_NO_NEW_PRIVS = 38  # prctl: no exec can raise privileges (set-uid programs)
CLONE_NEWNS = 0x20000  # unshare (linux/sched.h): a new mount namespace
CLONE_NEWIPC = 0x8000000  # unshare: a new SysV IPC namespace
CLONE_NEWNET = 0x40000000  # unshare: a new network namespace
MS_PRIVATE = 0x40000  # mount_setattr's propagation (sys/mount.h): none to or from other namespaces
SYS_MOUNT_SETATTR = ctypes.c_long(442)  # (asm/unistd_64.h) aarch64's too: syscalls since 5.1 share numbers
AT_FDCWD = -100  # mount_setattr (linux/fcntl.h): paths from the working directory
AT_RECURSIVE = 0x8000  # mount_setattr: the whole subtree
MOUNT_ATTR_RDONLY = 1  # mount_setattr (linux/mount.h): read-only
IPC = [f"/proc/sysvipc/{k}" for k in ("shm", "sem", "msg")]


def _kill_leftovers(cfg, force=False):
    """Kill and reap what calls left running: as root, all of the calls' uid; else the worker's children."""
    while force or os.pread(cfg.children, 1, 0):  # the worker has children, zombies included
        if not force and os.waitpid(-1, os.WNOHANG)[0]:
            continue  # (reaped one)
        if cfg.uid is None:
            for pid in os.pread(cfg.children, 1 << 16, 0).split():
                with contextlib.suppress(OSError):
                    os.kill(int(pid), signal.SIGKILL)
        elif os.fork() == 0:
            with contextlib.suppress(BaseException):  # (if setuid fails, nothing is killed)
                os.setgid(cfg.uid)
                os.setuid(cfg.uid)
                os.kill(-1, signal.SIGKILL)
            os._exit(0)
        force = False
        time.sleep(0.005)


def _read(fd, limit, tail):
    """The first (or last) `limit` characters of a captured stream, and whether it was cut."""
    size = os.fstat(fd).st_size
    n = 4 * limit + 4  # enough bytes for `limit` characters of UTF-8
    text = os.pread(fd, n, max(0, size - n) if tail else 0).decode("utf-8", "replace")
    return (text[-limit:] if tail else text[:limit]), size > n or len(text) > limit


def _call(source, stdin, cfg):
    """Run one request in a fresh forked child; the reply (None: the caller is gone)."""
    fds = [os.memfd_create(name) for name in ("stdin", "stdout", "stderr")]
    os.pwrite(fds[0], stdin.encode(errors="replace"), 0)  # (its offset stays at 0)
    cwd = f"{cfg.tmp}/{time.monotonic_ns()}"  # a new name (cheaper than tempfile.mkdtemp)
    os.mkdir(cwd, 0o700)
    if cfg.uid is not None:
        os.chown(cwd, cfg.uid, cfg.uid)
    random.seed()  # from os.urandom
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(int.from_bytes(os.urandom(4), "little"))  # (faster than seed())
    start = time.monotonic()
    # libc's fork: os.fork's at-fork hooks cost ~0.4 ms a call (safe: the worker has one thread, no locks)
    pid = LIBC.fork()
    if pid == 0:  # the child: confine itself, run the cell, exit (it never returns)
        code = 1
        try:
            os.setsid()
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            os.closerange(3, 1 << 16)
            os.chdir(cwd)
            resource.setrlimit(resource.RLIMIT_AS, (cfg.limit_mb << 20,) * 2)  # (the others: the worker's)
            if cfg.uid is not None:
                os.setgroups([])
                os.setgid(cfg.uid)
                os.setuid(cfg.uid)
            LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # (setuid clears it, so after that)
            code = _run(source)
        finally:
            with contextlib.suppress(BaseException):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
    pidfd = os.pidfd_open(pid)
    ready = select.select([pidfd, cfg.parent_fd], [], [], cfg.timeout)[0]  # the caller's pipe stirs at EOF
    seconds = time.monotonic() - start
    if pidfd in ready:
        code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    _kill_leftovers(cfg)  # (the call too, if it is still running)
    if any(os.pread(f.fileno(), 4096, 0).count(b"\n") > 1 for f in cfg.ipc):  # it left SysV IPC objects:
        LIBC.unshare(CLONE_NEWIPC)  # leave them behind in the old namespace
        cfg.ipc = [open(path, "rb", buffering=0) for path in IPC]  # the new one's (the old files close)
    stdout, cut_out = _read(fds[1], cfg.max_output, tail=False)
    stderr, cut_err = _read(fds[2], cfg.max_output, tail=True)
    for fd in fds + [pidfd]:
        os.close(fd)
    try:
        shutil.rmtree(cwd, ignore_errors=True)
    except RecursionError:  # a tree deeper than Python's recursion limit: rm recurses without a limit
        subprocess.run(["rm", "-rf", "--", cwd])
    if cfg.parent_fd in ready:
        return None
    status = "timeout" if pidfd not in ready else {0: "ok", OOM_EXIT: "oom"}.get(code, "error")
    return dict(status=status, stdout=stdout, stderr=stderr, seconds=seconds, truncated=cut_out or cut_err)


def _run(source):
    """Run a cell like `python -c`, but print a bare last expression's repr like a notebook; the exit code."""
    scope = {"__name__": "__main__", "__builtins__": builtins}
    try:
        linecache.cache["<code>"] = (len(source), None, source.splitlines(True), "<code>")  # for tracebacks
        tree = ast.parse(source, "<code>")
        last = [tree.body.pop()] if tree.body and isinstance(tree.body[-1], ast.Expr) else []
        exec(compile(tree, "<code>", "exec"), scope)
        exec(compile(ast.Interactive(last), "<code>", "single"), scope)  # prints its repr if not None
        return 0
    except SystemExit as e:  # as Python does: sys.exit(None or int), or print the message and exit 1
        if e.code is not None and not isinstance(e.code, int):
            print(e.code, file=sys.stderr)
        return e.code if isinstance(e.code, int) else int(e.code is not None)
    except BaseException as e:  # the traceback from the user's first frame on: none of ours
        scope.clear()  # (frees what the cell held: after a MemoryError, printing needs memory too)
        tb = e.__traceback__
        while tb is not None and tb.tb_frame.f_code.co_filename != "<code>":
            tb = tb.tb_next
        sys.stderr.write("".join(traceback.format_exception(type(e), e, tb)))
        return OOM_EXIT if isinstance(e, MemoryError) else 1


def _worker():
    import gc, importlib, io, pkgutil, warnings
    requests = os.fdopen(0, "rb")  # (a call's child puts its own stdin on fd 0)
    replies = os.fdopen(os.dup(1), "wb", buffering=0)
    config = types.SimpleNamespace(**marshal.load(requests))  # kind, uid (the calls', as root), timeout...
    if config.uid in (0, os.getuid()):  # as root, _kill_leftovers kills every process of the calls' uid
        sys.exit(f"sandbox worker: refusing uid {config.uid} for the calls (it is root's or the caller's)")
    root = os.geteuid() == 0
    os.dup2(2, 1)  # stray prints go to stderr; the calls inherit this and all up to the imports
    sys.stdout.reconfigure(line_buffering=True, errors="backslashreplace")
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a too-big write fails rather than kills
    LIBC.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)  # orphans of a call come back to us
    LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))  # no file grows past 16 MB
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    # As root: new namespaces; calls' directories on a tmpfs over /dev/shm (over /tmp it could hide Python)
    isolation = {"user": root, "network": False, "filesystem": False}
    if root:
        resource.setrlimit(resource.RLIMIT_NPROC, (64, 64))  # (binds a call once it is not root)
        isolation["network"] = LIBC.unshare(CLONE_NEWNET | CLONE_NEWIPC) == 0
        if LIBC.unshare(CLONE_NEWNS) == 0:
            attr = (ctypes.c_uint64 * 4)(MOUNT_ATTR_RDONLY, 0, MS_PRIVATE, 0)  # (set, clear, propagation, -)
            ro = LIBC.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, attr, ctypes.sizeof(attr)) == 0
            opts = f"size={config.memory_mb}m,nr_inodes=10000,mode=755".encode()  # (10,000 files at most)
            isolation["filesystem"] = ro and LIBC.mount(b"tmpfs", b"/dev/shm", b"tmpfs", 0, opts) == 0
    for name in FULL if config.kind == "full" else LIGHT:
        importlib.import_module(name)
    with warnings.catch_warnings(action="ignore"):  # (sympy has installed its own filters by now)
        for pkg in (importlib.import_module("sympy." + name) for name in SYMPY_ALL if config.kind == "full"):
            for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
                if ".tests" not in m.name and ".benchmarks" not in m.name:
                    importlib.import_module(m.name)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        for cell in WARM[config.kind == "light":]:
            _run(cell)
    gc.collect()
    gc.freeze()  # the warm heap stays out of the children's garbage collections
    base_mb = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE") >> 20
    cfg = types.SimpleNamespace(**vars(config), limit_mb=base_mb + config.memory_mb, parent_fd=0,
                                tmp=tempfile.mkdtemp(dir="/dev/shm" if isolation["filesystem"] else None),
                                children=os.open(f"/proc/self/task/{os.getpid()}/children", os.O_RDONLY),
                                ipc=[open(path, "rb", buffering=0) for path in IPC] if root else [])
    cfg.uid = config.uid if root else None  # (without root, calls run as the caller)
    os.chmod(cfg.tmp, 0o711)  # calls may pass through to their own directories, not list or change it
    _kill_leftovers(cfg, force=root)  # whatever a dead predecessor in this slot left running
    replies.write(marshal.dumps({"isolation": isolation, "modules": sorted(sys.modules)}))  # ready
    with contextlib.suppress(EOFError):  # (the end of the requests: the caller closed them)
        while (reply := _call(*marshal.load(requests), cfg)) is not None:
            replies.write(marshal.dumps(reply))
    shutil.rmtree(cfg.tmp, ignore_errors=True)


if __name__ == "__main__" and sys.argv[1:] == ["--worker"]:
    _worker()
