"""The code sandbox: a forked process pool that runs model-written Python and grades answers.

Each slot has two workers, each started from a clean interpreter: "light" (the modules math code uses most)
and "full" (also numpy, sympy, math-verify, warmed up). A call runs in a fresh child forked from "full" if
its code names a module only "full" has, else from "light" (less memory: faster forks). The child reads its
request; its output goes to the caller kernel to kernel. So no worker holds a call's code, input or output.

Guaranteed (each has an adversarial test in tests/test_sandbox.py):
  - Nothing the code does raises in the caller; its ExecResult's status says ok, error (see exit_code),
    timeout or oom: an uncaught MemoryError or the kernel's OOM killer, never an exit code.
  - At `timeout` seconds (wall clock) every process of the call is killed, setsid grandchildren included.
  - Each process's address space is capped at `memory_mb` above the worker's.
  - stdout keeps its first `max_output` characters, stderr its last (`truncated` if cut); no file > 16 MB.
  - Each call is a new process in a new empty directory (removed after it) with new random seeds: nothing
    of one call (files, SysV IPC objects, globals, output) reaches the next; nor the caller's environment.
  - A call whose worker died, hung (silent past timeout + GRACE s), could not start or was closed returns
    SANDBOX_FAILURE; the worker is replaced. Start-up waits while workers use CPU, else raises.
Where the kernel allows (infra/isolation.py; `Sandbox.isolation`: what held, `Sandbox.missing`: why not):
  - landlock: a call opens only the interpreter, the standard library, installed packages, loaded shared
    libraries (read-only), /proc, a few devices and its directory: no project, dataset or run output file,
    whatever its permissions; no TCP; it signals only its own processes.
  - seccomp: no user namespace, io_uring, key ring or POSIX message queue; no socket but IPv4 and IPv6.
  And as root:
  - user: calls run as an unprivileged uid (one per slot; never 0 nor the caller's), no_new_privs, at most
    64 processes: fork bombs stop, and a call cannot signal its worker, the trainer or the tests.
  - pid: each worker is process 1 of a PID namespace of its own: a call sees no process but its own.
  - network: no interface is up in the workers' network namespace.
  - filesystem: all mounts read-only but a fresh tmpfs: a call writes only in its directory, <= 10,000 files.
  - memory: a call's processes, memfd, tmpfs and SysV pages stay under `memory_mb` together.
Not guaranteed: what did not hold (without root, a call that kills or stops its worker, or leaves too many
files to remove in GRACE, gets SANDBOX_FAILURE; without the cgroup, memory is capped per process). A call
burns CPU to its timeout, can stat (not open) any path, and two calls that cooperate can still signal
through timing or process ids. It imports only what its worker imported and files its uid may read.
"""
import ast, builtins, collections, contextlib, ctypes, itertools, linecache, marshal, os, random, re
import resource, select, shutil, signal, subprocess, sys, tempfile, threading, time, traceback, types
from concurrent.futures import ThreadPoolExecutor

if __name__ == "__main__":  # a worker: `python -I` left the project's folder off sys.path (see _worker)
    sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from infra import isolation  # noqa: E402

TOOL_TIMEOUT = 5.0  # seconds a tool call may run: Sandbox's default, and the tool's in train.py and eval.py
SANDBOX_FAILURE = "sandbox_failure"  # a call's status when the sandbox failed, not the code: see above
GRACE = 10.0  # seconds past a call's timeout for its worker to clean up and reply: then it is hung
STALLED = 60.0  # a starting worker that uses no CPU for this long (seconds) is stuck: see _ask
LIBC = ctypes.PyDLL(None, use_errno=True)  # PyDLL: calls keep the GIL (see the fork in _call)
# exit_code: the call's (-N: killed by signal N; None: it timed out, or the sandbox failed)
ExecResult = collections.namedtuple("ExecResult", "status stdout stderr seconds truncated exit_code",
                                    defaults=[None])
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
    def __init__(self, workers=None, timeout=TOOL_TIMEOUT, memory_mb=1024, max_output=1000):
        self.timeout, self.max_output = timeout, max_output
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
        if self.missing:  # what the workers could not set up, and why (see the module's docstring)
            print("sandbox: running without " + "; ".join(f"{k} ({why})" for k, why in self.missing.items()),
                  "---> HINT: docs/sandbox.md says what each guarantees and needs", sep="\n", file=sys.stderr)

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
        if reply is None:
            return ExecResult(SANDBOX_FAILURE, "", "sandbox failed", 0.0, False)
        stdout, stderr = (b.decode("utf-8", "replace") for b in reply["output"])
        cut = reply["sizes"] != reply["kept"] or max(len(stdout), len(stderr)) > self.max_output
        stdout, stderr = stdout[:self.max_output], stderr[-self.max_output:]
        code = reply["code"]  # (None: it ran to the timeout)
        last = stderr.rstrip().rsplit("\n", 1)[-1]  # an uncaught MemoryError's traceback ends with its name
        memory = reply["oom"] or code == 1 and re.match(r"[\w.]*MemoryError\b", last)  # (numpy's one too)
        status = "timeout" if code is None else "oom" if memory else "ok" if code == 0 else "error"
        return ExecResult(status, stdout, stderr, reply["seconds"], cut, code)

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
        self.isolation = ready["held"]  # {"landlock", "seccomp", "user", "pid", ...} -> bool: what held
        self.missing = ready["missing"]  # what did not, and why
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
        seen = None  # the CPU time of the worker and its children (as root, it runs in its child)
        while not select.select([proc.stdout], [], [], timeout or STALLED)[0]:
            family = f"/proc/{proc.pid}/task/{proc.pid}/children"
            pids = [] if timeout else [proc.pid, *open(family).read().split()]
            cpu = [open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()[11:13] for pid in pids]
            if not cpu or cpu == seen:
                return None
            seen = cpu
        reply = marshal.load(proc.stdout)  # a reply comes whole, or not at all
        if "kept" in reply:  # a call's: then the bytes it kept of stdout and of stderr
            reply["output"] = [proc.stdout.read(n) for n in reply["kept"]]
            if [len(b) for b in reply["output"]] != list(reply["kept"]):
                return None  # (the worker died in the middle of it)
        return reply
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


def _call(cfg):
    """Run the request on stdin in a forked child that reads it itself; reply; clean up. False: it is gone."""
    fds = [os.memfd_create(name) for name in ("stdin", "stdout", "stderr")]
    cwd = f"{cfg.tmp}/{time.monotonic_ns()}"  # a new name (cheaper than tempfile.mkdtemp)
    os.mkdir(cwd, 0o700)
    if cfg.uid is not None:
        os.chown(cwd, cfg.uid, cfg.uid)
    random.seed()  # from os.urandom
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed(int.from_bytes(os.urandom(4), "little"))  # (faster than seed())
    start = time.monotonic()
    # libc's fork: os.fork's hooks cost ~0.4 ms (bench/sandbox_speed.py), for locks and threads we lack
    pid = LIBC.fork()
    if pid == 0:  # the child: confine itself, take its request, run the cell, exit (it never returns)
        code = 1
        try:
            os.setsid()
            isolation.confine_call(cfg.cgroup, cfg.ruleset if cfg.uid is None else None)
            source, stdin = marshal.load(cfg.requests)
            if stdin:
                os.pwrite(fds[0], stdin.encode(errors="replace"), 0)  # (its offset stays at 0)
            for target, fd in enumerate(fds):
                os.dup2(fd, target)
            os.closerange(3, 1 << 16)
            os.chdir(cwd)
            if cfg.uid is not None:  # (the worker has no supplementary groups, and the calls' rlimits)
                os.setgid(cfg.uid)
                os.setuid(cfg.uid)
            if not cfg.held["pid"]:  # (in a PID namespace it dies with its worker, process 1, anyway)
                LIBC.prctl(isolation.PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # (setuid clears it)
            code = _run(source)
        finally:
            with contextlib.suppress(BaseException):
                sys.stdout.flush()
                sys.stderr.flush()
            os._exit(code)
    pidfd = os.pidfd_open(pid)
    cfg.hangup.register(pidfd, select.POLLIN)  # (its exit; stdin's hang-up: the caller is gone)
    ready = {fd for fd, _ in cfg.hangup.poll(cfg.timeout * 1e3)}
    cfg.hangup.unregister(pidfd)
    seconds = time.monotonic() - start
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]) if pidfd in ready else None
    isolation.kill_leftovers(cfg.children, cfg.uid, cfg.cleaner.pid)  # (the call too): its output is final
    ooms, cfg.ooms = cfg.ooms, isolation.oom_kills(cfg.cgroup)
    if 0 not in ready and any(event & select.POLLIN for _, event in cfg.waiting.poll(0)):  # (still there)
        raise RuntimeError("sandbox worker: a call's child died before it read its request: none can answer")
    sizes = [os.fstat(fd).st_size for fd in fds[1:]]
    kept = [min(size, 4 * cfg.max_output + 4) for size in sizes]  # enough bytes for max_output characters
    header = dict(code=code, oom=cfg.ooms != ooms, seconds=seconds, sizes=sizes, kept=kept)
    if 0 not in ready:  # the header, then stdout's head and stderr's tail, which never enter this process
        parts = [(fds[1], 0, kept[0]), (fds[2], sizes[1] - kept[1], kept[1])]
        isolation.send(cfg.replies.fileno(), cfg.staging, marshal.dumps(header), parts)
    cfg.ipc = isolation.sysv_leftovers(cfg.ipc, cfg.buffer)  # (clean-up after the reply: the caller has it)
    cfg.cleaner.remove(cwd)
    for fd in fds + [pidfd]:
        os.close(fd)
    return 0 not in ready


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
        return 1  # (a MemoryError is told by its traceback: see Sandbox._execute)


def _worker(payload=None):
    """The worker: its settings (from stdin, or `payload` from first_steps), then calls till stdin closes."""
    import gc, importlib, io, pkgutil, warnings
    project = sys.path.pop(0)  # (put there for infra/ at the top: the calls must not import from it)
    requests = os.fdopen(0, "rb")  # (a call's child reads its request from here, then puts its stdin on 0)
    config = marshal.loads(bytes.fromhex(payload)) if payload else marshal.load(requests)  # kind, uid, ...
    if config["uid"] in (0, os.getuid()):  # as root, kill_leftovers kills every process of the calls' uid
        sys.exit(f"sandbox worker: refusing uid {config['uid']} for the calls (it is root's or the caller's)")
    root, kind = os.geteuid() == 0, config["kind"]
    if payload is None:  # (else we run in the PID namespace that first_steps made)
        isolation.first_steps(config, [sys.executable, "-I", "-B", os.path.abspath(__file__), "--worker"])
    replies = os.fdopen(os.dup(1), "wb", buffering=0)
    os.dup2(2, 1)  # stray prints go to stderr; the calls inherit this and all up to the imports
    sys.stdout.reconfigure(line_buffering=True, errors="backslashreplace")
    isolation.worker_limits(root)
    isolation.namespaces(config)
    cleaner = isolation.Cleaner()  # (small and unconfined: before the imports, and Landlock)
    for name in FULL if kind == "full" else LIGHT:
        importlib.import_module(name)
    with warnings.catch_warnings(action="ignore"):  # (sympy has installed its own filters by now)
        for pkg in (importlib.import_module("sympy." + name) for name in SYMPY_ALL if kind == "full"):
            for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + "."):
                if ".tests" not in m.name and ".benchmarks" not in m.name:
                    importlib.import_module(m.name)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        for cell in WARM[kind == "light":]:
            _run(cell)
    gc.collect()
    gc.freeze()  # the warm heap stays out of the children's garbage collections
    base_mb = int(open("/proc/self/statm").read().split()[0]) * os.sysconf("SC_PAGE_SIZE") >> 20
    resource.setrlimit(resource.RLIMIT_AS, ((base_mb + config["memory_mb"]) << 20,) * 2)  # (for the calls)
    tmp = tempfile.mkdtemp(dir="/dev/shm" if config["held"]["filesystem"] else None)
    os.chmod(tmp, 0o711)  # calls may pass through to their own directories, not list or change it
    waiting, hangup = select.poll(), select.poll()
    waiting.register(0, select.POLLIN)  # a request (or the caller's hang-up)
    hangup.register(0, 0)  # only the caller's hang-up, not a request that a call's child reads
    config["uid"] = config["uid"] if root else None  # (without root, calls run as the caller)
    cfg = types.SimpleNamespace(**config, requests=requests, replies=replies, tmp=tmp, waiting=waiting,
                                hangup=hangup, staging=os.memfd_create("reply"), cleaner=cleaner,
                                buffer=bytearray(4096), ooms=isolation.oom_kills(config["cgroup"]),
                                children=os.open("/proc/thread-self/children", os.O_RDONLY),
                                ipc=isolation.sysv_files() if root else [])
    isolation.kill_leftovers(cfg.children, cfg.uid, cfg.cleaner.pid, force=root)  # a dead predecessor's
    paths = isolation.readable_paths(project)  # (after the imports: their shared libraries are loaded)
    # Last, as they bind this process too: every call it forks inherits them, at no cost a call (as root)
    cfg.ruleset = isolation.attempt(config, "landlock", lambda: isolation.landlock(paths, tmp), False)
    isolation.attempt(config, "seccomp", isolation.seccomp_filter, False)
    ready = dict(held=config["held"], missing=config["missing"], modules=sorted(sys.modules))
    replies.write(marshal.dumps(ready))
    while waiting.poll()[0][1] & select.POLLIN and _call(cfg):  # (else the caller closed the requests)
        continue
    shutil.rmtree(cfg.tmp, ignore_errors=True)


if __name__ == "__main__" and sys.argv[1:2] == ["--worker"]:
    _worker(*sys.argv[2:3])
