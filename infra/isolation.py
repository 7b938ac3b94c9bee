"""The kernel mechanisms that confine sandbox.py's workers and their calls; each function says what it does.

A worker (one process per slot and kind) sets them up once, and every call it forks inherits them, so
they cost a call nothing but the move into its memory cgroup (and, without root, a Landlock domain of
its own: confine_call). `attempt` records for each what held and why not; sandbox.py reports that as
Sandbox.isolation and Sandbox.missing. A Cleaner, started before the worker confines itself, removes the
files calls leave.

- memory_cgroup: a memory cgroup for the worker's calls, nested in the worker's own: all of a call's
  processes, memfd, tmpfs and SysV pages count together against its cap; the kernel's OOM killer stops
  the call there and counts the kill (oom_kills), which is what makes a status `oom`.
- pid_namespace: the worker runs as process 1 of a new PID namespace: a call sees no process of the
  machine (the trainer's command line and its --data file), and dies if its worker dies.
- network_namespace: no interface up, no one else's SysV IPC objects.
- mount_namespace: every mount read-only, a fresh /proc (hidepid=2: a call sees only its own processes),
  a tmpfs on /dev/shm for the calls' directories.
- landlock: what the worker and its calls may open: the interpreter, its standard library, the
  installed packages and loaded shared libraries (read-only), /proc, a few devices, the scratch tmpfs;
  no TCP; signals and abstract unix sockets only among the worker's own processes.
- seccomp_filter: no user namespace (unshare, clone; clone3 and io_uring answer "not implemented", as a
  filter cannot read their arguments), no socket but IPv4 and IPv6 (so no unix socket anywhere, only
  socketpair), no key rings and no POSIX message queues (they would outlive a call).

Constants are from the kernel's uapi headers (x86_64 and aarch64).
"""
import contextlib, ctypes, errno, marshal, os, resource, shutil, signal, site, struct, sys, time

LIBC = ctypes.CDLL(None, use_errno=True)
CLONE_NEWNS, CLONE_NEWIPC, CLONE_NEWNET = 0x20000, 0x8000000, 0x40000000  # unshare (linux/sched.h)
CLONE_NEWPID, CLONE_NEWUSER = 0x20000000, 0x10000000
MS_NOSUID, MS_NODEV, MS_NOEXEC, MS_PRIVATE = 2, 4, 8, 0x40000  # mount (sys/mount.h)
SYS_MOUNT_SETATTR = ctypes.c_long(442)  # new syscalls share numbers on x86_64 and aarch64 (since 5.1)
AT_FDCWD, AT_RECURSIVE, MOUNT_ATTR_RDONLY = -100, 0x8000, 1  # mount_setattr (linux/mount.h)
PR_SET_PDEATHSIG, PR_SET_SECCOMP, PR_SET_CHILD_SUBREAPER, PR_SET_NO_NEW_PRIVS = 1, 22, 36, 38  # prctl
SECCOMP_MODE_FILTER = 2
SYS_LANDLOCK_CREATE_RULESET, SYS_LANDLOCK_ADD_RULE, SYS_LANDLOCK_RESTRICT_SELF = 444, 445, 446
LANDLOCK_CREATE_RULESET_VERSION, LANDLOCK_RULE_PATH_BENEATH = 1, 1
FS_EXECUTE, FS_WRITE_FILE, FS_READ_FILE, FS_READ_DIR = 1, 2, 4, 8  # Landlock's rights (linux/landlock.h)
FS_TRUNCATE = 1 << 14  # (ABI 3)
FS_RIGHTS = {1: (1 << 13) - 1, 2: (1 << 14) - 1, 3: (1 << 15) - 1, 5: (1 << 16) - 1}  # ABI -> all it has
NET_ALL, SCOPE_ALL = 3, 3  # ABI 4: bind and connect TCP; ABI 6: abstract unix sockets and signals
DEVICES = ["/dev/null", "/dev/zero", "/dev/full", "/dev/random", "/dev/urandom"]
RM = shutil.which("rm") or "/bin/rm"  # what removes a call's files (see Cleaner)
DEVICE_RIGHTS = FS_WRITE_FILE | FS_READ_FILE | FS_TRUNCATE  # (a rule on a file holds only file rights)
# The syscalls seccomp_filter filters, per machine (asm/unistd_64.h, asm-generic/unistd.h)
SYSCALLS = {"x86_64": dict(arch=0xC000003E, socket=41, clone=56, unshare=272, clone3=435,
                           io_uring=(425, 426, 427), keys=(248, 249, 250), mq_open=240),
            "aarch64": dict(arch=0xC00000B7, socket=198, clone=220, unshare=97, clone3=435,
                            io_uring=(425, 426, 427), keys=(217, 218, 219), mq_open=180)}
AF_INET, AF_INET6 = 2, 10
RET_ALLOW, RET_ERRNO = 0x7FFF0000, 0x00050000  # seccomp's actions (linux/seccomp.h)
LD_ABS, JEQ, JGE, JSET, RET = 0x20, 0x15, 0x35, 0x45, 0x06  # classic BPF opcodes (linux/filter.h)


def _check(result, what):
    if result != 0:
        raise OSError(ctypes.get_errno(), f"{what}: {os.strerror(ctypes.get_errno())}")


def attempt(report, name, step, needs_root=True):
    """step()'s result, or None if it failed: report["held"][name] says which, report["missing"][name] why."""
    report["held"][name] = False
    try:
        if needs_root and os.geteuid() != 0:
            raise OSError("not root")
        result = step()
    except OSError as e:
        report["missing"][name] = str(e)
        return None
    report["held"][name] = True
    return result


def worker_limits(root):
    """What every worker sets on itself: orphans of its calls come back to it, no exec raises privileges,
    no file past 16 MB (a write fails rather than kills), no core dumps; as root, at most 64 processes
    (they bind a call once it is not root) and no supplementary groups (the calls must have none)."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    LIBC.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    LIBC.prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0)
    resource.setrlimit(resource.RLIMIT_FSIZE, (16 << 20, 16 << 20))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if root:
        resource.setrlimit(resource.RLIMIT_NPROC, (64, 64))
        os.setgroups([])


def first_steps(config, argv):
    """In the process the caller started (as root): a memory cgroup for the calls, then `argv` (this worker
    again, given `config` as hex) as process 1 of a new PID namespace; returns only if that failed."""
    root = os.geteuid() == 0
    config.update(held={"user": root}, missing={} if root else {"user": "not root"})
    cgroup = config["cgroup"] = attempt(config, "memory", lambda: memory_cgroup(config["memory_mb"]))
    payload = marshal.dumps(dict(config, held=dict(config["held"], pid=True))).hex()
    attempt(config, "pid", lambda: pid_namespace(argv + [payload], cgroup[1:] if cgroup else (),
                                                 on_exit=lambda: cgroup and remove_cgroup(cgroup[0])))


def pid_namespace(argv, keep, on_exit):
    """Run `argv` (exec'd afresh: a forked copy would share this process's memory, and every call forked
    from it would cost more) as process 1 of a new PID namespace, with the fds `keep`; this process waits
    for it, calls `on_exit` and exits with its code. Raises if the kernel refuses."""
    _check(LIBC.unshare(CLONE_NEWPID), "unshare(CLONE_NEWPID)")
    pid = os.fork()
    if pid == 0:
        LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # it dies with us (our caller killed us)
        for fd in keep:
            os.set_inheritable(fd, True)
        os.execv(argv[0], argv)
    os.close(0)  # (the child answers the requests: the caller must see EOF when it exits, not when we do)
    os.close(1)
    code = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
    on_exit()
    os._exit(code if code >= 0 else 1)


def namespaces(config):
    """The worker's network, IPC and mount namespaces (as root; see attempt); a PID namespace without a
    /proc of its own would list the machine's processes, so it does not count then."""
    attempt(config, "network", network_namespace)
    attempt(config, "filesystem", lambda: mount_namespace(config["memory_mb"]))
    if config["held"]["pid"] and not config["held"]["filesystem"]:
        config["held"]["pid"], config["missing"]["pid"] = False, "no mount namespace for a /proc of its own"


def network_namespace():
    """New network and SysV IPC namespaces: no interface is up (not even lo), no one else's IPC objects."""
    _check(LIBC.unshare(CLONE_NEWNET | CLONE_NEWIPC), "unshare(CLONE_NEWNET | CLONE_NEWIPC)")


def mount_namespace(memory_mb, scratch="/dev/shm"):
    """A new mount namespace: every mount read-only, a fresh /proc, and a tmpfs on `scratch` for the
    calls' directories: at most `memory_mb` and 10,000 files (over /tmp it could hide Python). Files
    opened for writing before stay on the old namespace's mounts (the memory cgroup's: a read-only mount
    is refused while a writer is open)."""
    _check(LIBC.unshare(CLONE_NEWNS), "unshare(CLONE_NEWNS)")
    attr = (ctypes.c_uint64 * 4)(MOUNT_ATTR_RDONLY, 0, MS_PRIVATE, 0)  # (set, clear, propagation, -)
    _check(LIBC.syscall(SYS_MOUNT_SETATTR, AT_FDCWD, b"/", AT_RECURSIVE, attr, ctypes.sizeof(attr)),
           "mount_setattr")
    # hidepid=2: a call's /proc lists only its own uid's processes (not even its worker's)
    _check(LIBC.mount(b"proc", b"/proc", b"proc", MS_NOSUID | MS_NODEV | MS_NOEXEC, b"hidepid=2"),
           "mount /proc")
    opts = f"size={memory_mb}m,nr_inodes=10000,mode=755".encode()
    _check(LIBC.mount(b"tmpfs", scratch.encode(), b"tmpfs", MS_NOSUID | MS_NODEV, opts), f"mount {scratch}")


def kill_leftovers(children, uid, keep, force=False):
    """Kill and reap what calls left running: as root, every process of the calls' `uid` (a child does it
    as that uid); else our children (`children`: an fd of our /proc/thread-self/children) but `keep`."""
    while force or (left := set(os.pread(children, 1 << 16, 0).split()) - {b"%d" % keep}):  # (zombies too)
        if not force and os.waitpid(-1, os.WNOHANG)[0]:
            continue  # (reaped one)
        if uid is None:
            for pid in left:
                with contextlib.suppress(OSError):
                    os.kill(int(pid), signal.SIGKILL)
        elif os.fork() == 0:
            with contextlib.suppress(BaseException):  # (if setuid fails, nothing is killed)
                os.setgid(uid)
                os.setuid(uid)
                os.kill(-1, signal.SIGKILL)
            os._exit(0)
        force = False
        time.sleep(0.005)


def sysv_files():
    return [open(f"/proc/sysvipc/{kind}", "rb", buffering=0) for kind in ("shm", "sem", "msg")]


def sysv_leftovers(files, buffer):
    """The files of /proc/sysvipc to watch from now on: a new IPC namespace's if a call left SysV objects
    (they stay behind in the old one). Read into `buffer`, zeroed after: nothing of a call stays here."""
    for f in files:
        n = os.preadv(f.fileno(), [buffer], 0)
        left = buffer.count(b"\n", 0, n) > 1  # (a header line, then one per object)
        buffer[:n] = bytes(n)
        if left:
            _check(LIBC.unshare(CLONE_NEWIPC), "unshare(CLONE_NEWIPC)")
            return sysv_files()  # (the old files close)
    return files


class Cleaner:
    """A child that removes the calls' directories for the worker, with rm (any depth), so that the names
    of a call's files never enter the worker's memory, which the next call is forked with. Started before
    the worker confines itself: Landlock checks each step of a removal from the tree's top, and rm took
    seconds for a tree 3,000 levels deep under it."""

    def __init__(self):
        (requests, self._requests), (self._done, done) = os.pipe(), os.pipe()
        self.pid = os.fork()
        if self.pid == 0:
            LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)  # (it dies with the worker)
            os.dup2(requests, 0)
            os.dup2(done, 1)
            os.closerange(3, 1 << 16)  # (the worker's pipes to its caller among them)
            for path in os.fdopen(0, "rb"):
                os.spawnv(os.P_WAIT, RM, ["rm", "-rf", "--", os.fsdecode(path[:-1])])
                os.write(1, b"1")
            os._exit(0)

    def remove(self, path):
        """Remove a call's directory: at once if it is empty, else through the cleaner."""
        try:
            return os.rmdir(path)
        except OSError:  # (not empty: it left files)
            os.write(self._requests, os.fsencode(path) + b"\n")
            os.read(self._done, 1)


def send(out, staging, header, parts):
    """Write `header`, then each (fd, offset, count) of `parts`, to the pipe `out` in one write, so that
    its reader wakes once (each wake-up costs this machine an interrupt between cores): staged in the
    memfd `staging` by the kernel (copy_file_range, sendfile), the parts never enter this process."""
    os.ftruncate(staging, 0)
    end = os.pwrite(staging, header, 0)
    for fd, offset, n in parts:
        while n and (copied := os.copy_file_range(fd, staging, n, offset, end)):
            offset, end, n = offset + copied, end + copied, n - copied
    offset = 0
    while offset < end:
        offset += os.sendfile(out, staging, offset, end - offset)


# --- The memory cgroup ---------------------------------------------------------------------------------


def _own_memory_cgroup():
    """(folder, version) of this process's memory cgroup: v1's memory hierarchy, or v2's."""
    mounts = {}
    for line in open("/proc/self/mountinfo"):
        fields = line.split()
        kind, options = fields[fields.index("-") + 1], fields[-1].split(",")
        if kind == "cgroup2" or (kind == "cgroup" and "memory" in options):
            mounts[kind] = fields[4]
    for line in open("/proc/self/cgroup"):
        number, controllers, path = line.rstrip("\n").split(":", 2)
        if "memory" in controllers.split(",") and "cgroup" in mounts:
            return mounts["cgroup"] + path, 1
        if number == "0" and "cgroup2" in mounts and "cgroup" not in mounts:
            return mounts["cgroup2"] + path, 2
    raise OSError(errno.ENOENT, "no memory cgroup is mounted")


def memory_cgroup(limit_mb):
    """A cgroup for one worker's calls, capped at `limit_mb` (no swap), in this process's own; removes the
    ones of dead workers. Returns (its path, an fd to move a process in with, an fd of its OOM counter)."""
    own, version = _own_memory_cgroup()
    for name in os.listdir(own):  # a worker killed with SIGKILL left its (empty) cgroup behind
        if name.startswith("sandbox-") and not os.path.exists(f"/proc/{name[8:]}"):
            with contextlib.suppress(OSError):  # (not empty: some process is still in it)
                os.rmdir(f"{own}/{name}")
    if version == 2 and "memory" not in open(f"{own}/cgroup.subtree_control").read().split():
        try:
            with open(f"{own}/cgroup.subtree_control", "w") as f:
                f.write("+memory")
        except OSError as e:  # (EBUSY: v2 lets no cgroup with processes of its own have children with it)
            raise OSError(e.errno, f"cgroup v2: {own} cannot give its children the memory controller "
                                   f"({e.strerror}); start the trainer in a cgroup delegated to it") from e
    path = f"{own}/sandbox-{os.getpid()}"
    os.makedirs(path, exist_ok=True)
    limits = {1: [("memory.limit_in_bytes", limit_mb << 20), ("memory.memsw.limit_in_bytes", limit_mb << 20)],
              2: [("memory.max", limit_mb << 20), ("memory.swap.max", 0), ("memory.oom.group", 1)]}[version]
    for name, value in limits:
        if os.path.exists(f"{path}/{name}"):  # (memsw and swap.max only where swap is accounted)
            with open(f"{path}/{name}", "w") as f:
                f.write(str(value))
    counter = os.open(f"{path}/{'memory.oom_control' if version == 1 else 'memory.events'}", os.O_RDONLY)
    # v1's tasks moves one thread (a call's child has one): unlike cgroup.procs it takes no lock that
    # waits for an RCU grace period, which on a loaded machine took a call's move from 0.05 to 14 ms (p99)
    return path, os.open(f"{path}/{'tasks' if version == 1 else 'cgroup.procs'}", os.O_WRONLY), counter


def oom_kills(cgroup):
    """The calls' cgroup's count of OOM kills so far (the `oom_kill` line of memory.oom_control or
    .events); None without one."""
    if not cgroup:
        return None
    text = os.pread(cgroup[2], 4096, 0).decode()
    return int(text.split("oom_kill ", 1)[1].split()[0]) if "oom_kill " in text else 0


def remove_cgroup(path):
    for _ in range(100):  # (its last processes may take a moment to leave)
        try:
            return os.rmdir(path)
        except FileNotFoundError:
            return None
        except OSError:
            time.sleep(0.01)


# --- Landlock and seccomp ------------------------------------------------------------------------------


def readable_paths(project):
    """What a call needs to read: the interpreter, the standard library, the installed packages and
    every shared library already loaded; never `project` (sandbox.py's folder) or a folder above it."""
    # (not sysconfig: its build variables would add 0.4 MB to every worker, and so to every fork)
    paths = {os.path.dirname(os.__file__), os.path.dirname(os.path.realpath(sys.executable))}
    paths |= {*site.getsitepackages(), *(p for p in sys.path if p.endswith("lib-dynload"))}
    paths |= {line.split(None, 5)[5].rsplit("/", 1)[0] for line in open("/proc/self/maps")
              if len(line.split(None, 5)) == 6 and line.split(None, 5)[5].startswith("/")}
    project = os.path.realpath(project) + "/"
    return sorted(p for p in paths if p and not project.startswith(os.path.realpath(p).rstrip("/") + "/"))


def landlock(readable, scratch, programs=()):
    """Confine this process and all it forks from now on: it opens only the `readable` folders (read-only,
    their programs runnable), /proc (read), the DEVICES, the `programs` (to run) and everything beneath
    `scratch`; no TCP; it signals, and reaches abstract unix sockets of, only the processes it forks. It
    can no longer mount. Needs no_new_privs; returns the ruleset (see confine_call)."""
    abi = LIBC.syscall(SYS_LANDLOCK_CREATE_RULESET, None, 0, LANDLOCK_CREATE_RULESET_VERSION)
    if abi < 1:
        raise OSError(ctypes.get_errno(), f"the kernel has no Landlock ({os.strerror(ctypes.get_errno())})")
    fs = FS_RIGHTS[max(v for v in FS_RIGHTS if v <= abi)]
    attr = struct.pack("QQQ", fs, NET_ALL if abi >= 4 else 0, SCOPE_ALL if abi >= 6 else 0)
    ruleset = LIBC.syscall(SYS_LANDLOCK_CREATE_RULESET, attr, len(attr), 0)
    if ruleset < 0:
        raise OSError(ctypes.get_errno(), f"landlock_create_ruleset: {os.strerror(ctypes.get_errno())}")
    rules = [(p, FS_EXECUTE | FS_READ_FILE | FS_READ_DIR) for p in readable] + [(scratch, fs)]
    rules += [("/proc", FS_READ_FILE | FS_READ_DIR)] + [(device, DEVICE_RIGHTS) for device in DEVICES]
    rules += [(program, FS_EXECUTE | FS_READ_FILE) for program in programs]
    for path, rights in rules:
        try:
            fd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        except OSError:
            continue  # (a device or folder this machine does not have)
        rule = struct.pack("=Qi", rights & fs, fd)  # struct landlock_path_beneath_attr (packed)
        added = LIBC.syscall(SYS_LANDLOCK_ADD_RULE, ruleset, LANDLOCK_RULE_PATH_BENEATH, rule, 0)
        os.close(fd)
        _check(0 if added == 0 else -1, f"landlock_add_rule {path}")
    _check(LIBC.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0), "landlock_restrict_self")
    return ruleset  # (for confine_call)


def confine_call(cgroup, ruleset):
    """In a call's child: into the calls' memory `cgroup` (if any: its path and fds); with a `ruleset`, a
    Landlock domain of its own inside its worker's, where it cannot signal its worker (as root its uid
    already keeps it from that, and this costs a call ~0.1 ms)."""
    if cgroup:
        os.write(cgroup[1], b"0")  # (0: the writer)
    if ruleset is not None:
        _check(LIBC.syscall(SYS_LANDLOCK_RESTRICT_SELF, ruleset, 0), "landlock_restrict_self")


def seccomp_filter():
    """Install the filter the module's docstring describes on this process and all it forks from now on
    (needs no_new_privs). Another ABI's syscalls (x86_64's i386 and x32) answer "not implemented"."""
    machine = os.uname().machine
    nr = SYSCALLS.get(machine)
    if nr is None:
        raise OSError(errno.ENOSYS, f"no seccomp filter for this machine ({machine})")
    op = lambda code, k, jt=0, jf=0: struct.pack("HBBI", code, jt, jf, k)  # noqa: E731 (struct sock_filter)
    fail = lambda e: op(RET, RET_ERRNO | e)  # noqa: E731
    prog = [op(LD_ABS, 4), op(JEQ, nr["arch"], 1, 0), fail(errno.ENOSYS), op(LD_ABS, 0)]  # arch, then nr
    if machine == "x86_64":
        prog += [op(JGE, 0x40000000, 0, 1), fail(errno.ENOSYS)]
    for call in (nr["clone3"], *nr["io_uring"]):
        prog += [op(JEQ, call, 0, 1), fail(errno.ENOSYS)]
    for call in (*nr["keys"], nr["mq_open"]):
        prog += [op(JEQ, call, 0, 1), fail(errno.EPERM)]
    for call in (nr["unshare"], nr["clone"]):  # flags are the first argument (its low 32 bits at 16)
        prog += [op(JEQ, call, 0, 4), op(LD_ABS, 16), op(JSET, CLONE_NEWUSER, 0, 1), fail(errno.EPERM),
                 op(RET, RET_ALLOW)]
    prog += [op(JEQ, nr["socket"], 0, 5), op(LD_ABS, 16), op(JEQ, AF_INET, 2, 0), op(JEQ, AF_INET6, 1, 0),
             fail(errno.EACCES), op(RET, RET_ALLOW)]  # (the domain is the first argument)
    prog += [op(RET, RET_ALLOW)]
    code = ctypes.create_string_buffer(b"".join(prog))
    fprog = struct.pack("HxxxxxxQ", len(prog), ctypes.addressof(code))  # struct sock_fprog
    _check(LIBC.prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.c_char_p(fprog), 0, 0), "seccomp")
