"""Running model-written Python in a sandbox that holds as root and as a user: bubblewrap (``bwrap``, from
the distribution's ``bubblewrap`` package), a seccomp filter and rlimits.

What the sandboxed process gets:

- **Its own namespaces** (user, mount, network, PID, IPC, UTS, cgroup): no network, no other process to
  see or signal, and a file system of the interpreter's folder and the system's libraries, read-only, plus
  a scratch ``/tmp`` (``/dev`` holds the usual device nodes and is read-only). No project file, no home folder.
- **An unprivileged uid with no capabilities.** Inside it is uid/gid 65534 with an empty capability set and
  ``no_new_privs``, in every case. When flowrl runs as root, bubblewrap itself runs as the host's
  ``nobody`` (65534), so the sandbox is ``nobody`` on the host as well; that needs an interpreter the
  ``nobody`` user can read (the trainer's own, else ``/usr/bin/python3``). With none (say Python under a
  private ``/root``), bubblewrap runs as root and drops every capability before the code starts
  (`Sandbox.host_uid` says which).
- **A seccomp filter** that fails with EPERM every syscall that makes a process or thread (fork bombs,
  subprocesses, threads: the whole tree is one process, so per-process rlimits bound all of it), mounts
  or remounts, ptrace and cross-process memory access, new or joined namespaces, keyrings, BPF, perf,
  io_uring, kernel modules and the like; syscalls of a foreign ABI (x32, i386 through ``int 0x80``) are
  refused outright; so are memfd files and SysV shared memory and message queues, memory that outlives
  the address-space limit, and ``prctl(PR_SET_PDEATHSIG)`` (the death with its parent, kept). x86-64 and
  aarch64 (elsewhere: rlimits alone).
- **A cleared environment** with an explicit allow-list (`ENVIRONMENT`): the trainer's variables (API keys,
  tokens) are not in the process or in its PID 1's ``/proc/1/environ``.
- **A new session, death with its parent**, and a wall-clock limit that kills the whole namespace.
- **Limits on everything it can use** (`Limits`): CPU seconds, memory (address space plus the scratch
  ``/tmp``, a size-capped tmpfs that counts against `Limits.memory_bytes`), file size, open files,
  processes, and the bytes it may print or return; more ends the run.
- **A memory cgroup of its own, where root can make one** (`Sandbox.cgroup`): as root, with a memory
  controller it can write (cgroup v1, or v2 where the trainer's cgroup may have children with controllers),
  each run gets a fresh child cgroup of the trainer's, capped at `Limits.memory_bytes` plus
  `CGROUP_ALLOWANCE` (bubblewrap itself), with no swap and `Limits.processes` pids; the child enters it
  before it execs bubblewrap, and it is removed after the run. Too much memory there ends the run (the
  kernel's OOM killer, inside the cgroup only: status ``crashed``) or fails the allocation.

What bounds what: the address space (RLIMIT_AS) bounds the process's own memory; the tmpfs size bounds the
bytes of the files in ``/tmp``; neither counts the kernel's memory for the process -- above all the inodes
and directory entries of files in ``/tmp`` (tmpfs counts bytes, not files: ~600k empty files hold ~600 MB
of kernel memory), also page tables and socket buffers. The memory cgroup counts all of it. Without one
(an unprivileged user, no writable memory controller, cgroup v2 whose rules forbid it) that kernel memory
is bounded only by what the code can make in its CPU seconds and wall-clock time, and it is freed when the
run ends (the tmpfs goes with its mount namespace).

The untrusted process only computes (`run_job`): a job (JSON on stdin) says what to call or which inputs to
feed the program, and it writes one JSON row per test back. Verdicts are made outside, by the trusted
parent (`flowrl.tasks.code_tests`), against expected values that never enter the sandbox -- so nothing the
code does in its own process (patching the harness, writing fake rows, exiting early) can forge a pass.
Assert tests run inside the sandbox (``mode="asserts"``) remain for trusted code only: there the process
itself reports pass or fail, which code under test can forge.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import os
import platform
import resource
import secrets
import shutil
import stat
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from flowrl.errors import ConfigError

#: the sandbox's uid and gid inside, and on the host when flowrl runs as root (``nobody``)
SANDBOX_ID = 65534
#: the whole environment the sandboxed process sees
ENVIRONMENT = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "PYTHONIOENCODING": "utf-8"}

#: what the sandboxed interpreter runs: the job (JSON) on stdin; on the original stdout one JSON row per
#: test; what the code prints goes to stderr. Modes: ``calls`` (call a function the code defines with
#: literal arguments, return its value as tagged plain data), ``stdio`` (run the code as a program per
#: input -- the input a file on fd 0, fd 1 a fresh file -- and return what it printed), ``asserts`` (exec
#: each test after the code; forgeable: trusted code).
_HARNESS = r"""
import io, json, os, signal, sys
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # a file over the size limit: an error, not the run's end
job = json.loads(sys.stdin.read())
sys.stdin = io.StringIO("")
out = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)
sys.stdout = sys.stderr
cap = job["cap"]
def send(row):
    out.write(json.dumps(row, allow_nan=False) + "\n")
    out.flush()
def tag(v, depth=0):
    if depth > 64:
        raise ValueError("a value nested deeper than 64")
    t = type(v)
    if v is None or t is bool or t is str:
        return v
    if t is int:  # past 2**53 in hex: no decimal digit limit on either side, and exact in any JSON reader
        return v if -2**53 < v < 2**53 else {"i": "%x" % v}
    if t is float:
        return v if v - v == 0 else {"f": repr(v)}
    if t is list:
        return [tag(x, depth + 1) for x in v]
    if t is tuple:
        return {"t": [tag(x, depth + 1) for x in v]}
    if t is set or t is frozenset:
        return {"s" if t is set else "fs": [tag(x, depth + 1) for x in v]}
    if t is dict:
        return {"d": [[tag(k, depth + 1), tag(x, depth + 1)] for k, x in v.items()]}
    if t is bytes:
        return {"b": v.hex()}
    raise TypeError("returned a %s, not plain data" % t.__name__)
mode, code = job["mode"], job["code"]
if mode == "asserts":
    space = {"__name__": "__main__"}
    def run(source, name):
        try:
            exec(compile(source, name, "exec"), space)
            return True
        except BaseException:
            return False
    loaded = run(code, "<response>")
    for i, test in enumerate(job["tests"]):
        send([i, "ok" if loaded and run(test, "<test %d>" % i) else "failed", None])
    send([-1, "end", job["nonce"]])
elif mode == "calls":
    space, why = {"__name__": "__main__"}, None
    try:
        exec(compile(code, "<response>", "exec"), space)
    except BaseException as e:
        why = "the code did not load: %s" % type(e).__name__
    def untag(v):
        if type(v) is list:
            return [untag(x) for x in v]
        if type(v) is dict:
            ((k, b),) = v.items()
            if k in ("t", "s", "fs"):
                return {"t": tuple, "s": set, "fs": frozenset}[k](untag(x) for x in b)
            if k == "d":
                return {untag(a): untag(x) for a, x in b}
            return float(b) if k == "f" else bytes.fromhex(b) if k == "b" else int(b, 16)
        return v
    def given(text):  # a literal, or arguments the parent computed, as tagged plain data
        if type(text) is dict:
            return untag(text["v"])
        import ast  # a literal plain data cannot carry (1j): parsed here, imported only then
        return ast.literal_eval(text)
    for i, (name, args, kwargs) in enumerate(job["calls"]):
        try:
            if why:
                raise RuntimeError(why)
            value = space[name] if args == "" else space[name](*given(args), **given(kwargs))  # "": a read
            text = json.dumps([i, "ok", tag(value)])
        except BaseException as e:
            text = json.dumps([i, "error", type(e).__name__])
        out.write(text + "\n")
        out.flush()
    send([-1, "done", None])
else:
    try:
        program, why = compile(code, "<response>", "exec"), None
    except BaseException as e:
        program, why = None, "the code did not compile: %s" % type(e).__name__
    def scratch(data=b""):
        fd = os.open("/tmp", os.O_TMPFILE | os.O_RDWR, 0o600)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, 0)
        return fd
    for i, given in enumerate(job["inputs"]):
        status = "ok"
        try:  # the input on fd 0 and a fresh file on fd 1: open(0), os.write(1, ...) and sys.__stdout__ work
            os.dup2(2, 0)  # fds 0 and 1 taken (the code may have closed them), so the files land above
            os.dup2(2, 1)
            for target, fd in ((0, scratch(given.encode())), (1, scratch())):
                os.dup2(fd, target)
                os.close(fd)
            sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
            sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8", write_through=True)
            if why:
                raise RuntimeError(why)
            exec(program, {"__name__": "__main__"})
        except SystemExit as e:
            status = "ok" if e.code in (None, 0) else "exit %r" % (e.code,)
        except BaseException as e:
            status = "error %s" % type(e).__name__
        for stream in (sys.stdout, sys.__stdout__):
            try:
                stream.flush()
            except BaseException:
                status = "error output"
        try:
            os.lseek(1, 0, 0)
            printed = b""
            while len(printed) <= cap:
                chunk = os.read(1, cap + 1 - len(printed))
                if not chunk:
                    break
                printed += chunk
        except BaseException:
            printed = b""
            status = "error output"
        if len(printed) > cap:
            status, printed = "error output", b""
        os.dup2(2, 1)
        sys.stdout = sys.stderr
        printed = printed.decode("utf-8", "replace")
        send([i, status, printed])
    send([-1, "done", None])
"""


@dataclass(frozen=True)
class Limits:
    """What one sandboxed run may use."""

    wall_s: float = 5.0
    cpu_s: int = 4
    memory_bytes: int = 512 * 2**20  # address space + the scratch /tmp
    scratch_bytes: int = 32 * 2**20  # the tmpfs at /tmp, part of memory_bytes
    file_bytes: int = 16 * 2**20  # largest file written
    processes: int = 64  # per host user (where the seccomp filter does not refuse new processes outright)
    output_bytes: int = 64 * 2**10  # what the code prints (stderr) kept; more is cut
    result_bytes: int = 2 * 2**20  # the rows it returns; more ends the run ("output")
    open_files: int = 64

    def __post_init__(self) -> None:
        if not 0 < self.scratch_bytes < self.memory_bytes:
            raise ConfigError(
                f"sandbox limits: scratch_bytes={self.scratch_bytes} must be above 0 and below "
                f"memory_bytes={self.memory_bytes} (the scratch /tmp counts against the memory limit)"
            )


DEFAULT_LIMITS = Limits()


@dataclass(frozen=True)
class Run:
    """What a sandboxed run sent back: its rows (one JSON text each, not yet trusted) and how it ended."""

    rows: tuple[str, ...]
    status: str  # ok | timeout | output | crashed
    output: str  # what the code printed (cut at the cap)
    returncode: int | None = None


@dataclass(frozen=True)
class Sandbox:
    """How runs are launched here: the interpreter, and the host uid the sandboxed process has."""

    python: str
    prefix: str  # the interpreter's installation, bound read-only
    host_uid: int  # SANDBOX_ID, or the caller's own uid (unprivileged), or 0 (root with no capabilities)
    command: tuple[str, ...] = field(default=())
    #: "v1" or "v2" where each run gets a memory cgroup of its own, None where it cannot (not root, no
    #: writable memory controller, v2's rules): then RLIMIT_AS and the tmpfs size alone bound memory
    cgroup: str | None = None
    #: the folders each run's cgroup is made in: v1 the memory one, then the pids one if any; v2 one
    cgroup_parents: tuple[str, ...] = ()


def bwrap() -> str:
    """The bubblewrap binary, or a ConfigError saying how to install it."""
    found = shutil.which("bwrap")
    if found is None:
        raise ConfigError(
            "the code sandbox needs bubblewrap ('bwrap'): install your distribution's package "
            "(apt-get install bubblewrap, dnf install bubblewrap) and run again."
        )
    return found


# ------------------------------------------------------------------ seccomp

#: per audit architecture: the syscalls refused with EPERM -- new processes and threads; mounts; ptrace and
#: other processes' memory; namespaces; keyrings, BPF, perf, userfaultfd, io_uring; modules, kexec, reboot,
#: swap, clocks, personality, handles to files by inode; memory that no rlimit counts (memfd files, SysV
#: shared memory and message queues: written and let go of, they outlive RLIMIT_AS)
_REFUSED = {
    0xC000003E: (  # x86-64
        56, 57, 58, 435,  # clone fork vfork clone3
        165, 166, 155, 161, 428, 429, 430, 431, 432, 433, 442,  # mount umount2 pivot_root chroot, the fs* API
        101, 310, 311,  # ptrace process_vm_readv/writev
        272, 308,  # unshare setns
        248, 249, 250, 321, 298, 323, 425, 426, 427,  # keys, bpf, perf, userfaultfd, io_uring
        175, 176, 313, 246, 320, 169, 167, 168,  # modules, kexec, reboot, swap
        135, 103, 163, 172, 173, 153, 159, 164, 227, 305, 303, 304, 179,  # personality syslog acct iopl/ioperm ...
        319, 447, 29, 30, 31, 67, 68, 69, 70, 71,  # memfd_create memfd_secret, SysV shm and message queues
    ),
    0xC00000B7: (  # aarch64 (the generic table)
        220, 435,  # clone clone3
        40, 39, 41, 51, 428, 429, 430, 431, 432, 433, 442,
        117, 270, 271,
        97, 268,
        217, 218, 219, 280, 241, 282, 425, 426, 427,
        105, 106, 273, 104, 294, 142, 224, 225,
        92, 116, 89, 58, 171, 112, 266, 264, 265, 60,
        279, 447, 194, 195, 196, 197, 186, 187, 188, 189,
    ),
}  # fmt: skip
_ARCH = {"x86_64": 0xC000003E, "amd64": 0xC000003E, "aarch64": 0xC00000B7, "arm64": 0xC00000B7}


#: prctl's number per audit architecture: its PR_SET_PDEATHSIG (1) is refused, so the code cannot outlive a
#: trainer that dies (bubblewrap's --die-with-parent is that setting)
_PRCTL = {0xC000003E: 157, 0xC00000B7: 167}


def seccomp_program() -> bytes | None:
    """A classic-BPF seccomp filter: a foreign ABI (another audit arch, or x32's syscall numbers), every
    syscall in `_REFUSED` and ``prctl(PR_SET_PDEATHSIG, ...)`` fail with EPERM, the rest is allowed; None on
    an architecture it does not know."""
    arch = _ARCH.get(platform.machine().lower())
    if arch is None:
        return None
    refused = sorted(set(_REFUSED[arch]))
    n = len(refused)
    ld, jeq, jge, ret = 0x20, 0x15, 0x35, 0x06
    allow, eperm = 0x7FFF0000, 0x00050000 | 1
    # 0: load arch; 1: foreign arch -> EPERM; 2: load nr; 3: x32 (nr >= 2**30) -> EPERM; 4..3+n: refused ->
    # EPERM; 4+n: not prctl -> allow; 5+n: load its first argument (low half); 6+n: PR_SET_PDEATHSIG ->
    # EPERM; 7+n: allow; 8+n: EPERM (a jump's target is the next instruction's index plus its offset)
    prog = [(ld, 0, 0, 4), (jeq, 0, n + 6, arch), (ld, 0, 0, 0), (jge, n + 4, 0, 0x40000000)]
    prog += [(jeq, n + 3 - j, 0, nr) for j, nr in enumerate(refused)]
    prog += [(jeq, 0, 2, _PRCTL[arch]), (ld, 0, 0, 16), (jeq, 1, 0, 1)]
    prog += [(ret, 0, 0, allow), (ret, 0, 0, eperm)]
    return b"".join(struct.pack("HBBI", *ins) for ins in prog)


# ------------------------------------------------------------------ launching


def _world_readable(path: str) -> bool:
    """Whether a user with no rights of its own can reach and read ``path``: every folder above it
    searchable by others, the file itself readable (and executable, for a file that is)."""
    real = os.path.realpath(path)
    try:
        mode = os.stat(real).st_mode
        parts = real.split(os.sep)
        for i in range(2, len(parts)):
            if not os.stat(os.sep.join(parts[:i]) or os.sep).st_mode & stat.S_IXOTH:
                return False
    except OSError:
        return False
    need = stat.S_IROTH | (stat.S_IXOTH if mode & stat.S_IXUSR else 0)
    return mode & need == need


def _interpreters() -> list[tuple[str, str]]:
    """(interpreter, its installation prefix): the trainer's own, then the system's."""
    prefix = os.path.realpath(sys.base_prefix)
    own = os.path.join(prefix, "bin", f"python{sys.version_info[0]}.{sys.version_info[1]}")
    found = [(os.path.realpath(own), prefix)]
    system = shutil.which("python3", path="/usr/bin:/bin")
    if system is not None:
        found.append((os.path.realpath(system), "/usr"))
    return found


# ------------------------------------------------------------------ cgroups

#: memory a run's cgroup allows above `Limits.memory_bytes`: bubblewrap, its mount namespace and /proc
CGROUP_ALLOWANCE = 32 * 2**20
#: how each run's cgroup is named: then the trainer's pid, a counter and a random part
CGROUP_PREFIX = "flowrl-sandbox-"
_CGROUP_ROOT = "/sys/fs/cgroup"
_RUNS = itertools.count()
_LEFT: set[str] = set()  # cgroups of this process that were still busy when their run ended
_LEFT_LOCK = threading.Lock()


def _write(path: str, value: str) -> None:
    fd = os.open(path, os.O_WRONLY)
    try:
        os.write(fd, value.encode())
    finally:
        os.close(fd)


def _own_cgroups() -> dict[str, str]:
    """This process's cgroups from /proc/self/cgroup: v1 controller lists ("memory", "cpu,cpuacct") and
    "" (v2) -> path."""
    found: dict[str, str] = {}
    try:
        with open("/proc/self/cgroup") as fh:
            for line in fh:
                parts = line.rstrip("\n").split(":", 2)
                if len(parts) == 3 and parts[2].startswith("/"):
                    found[parts[1]] = parts[2]
    except OSError:
        pass
    return found


def _usable(parent: str) -> bool:
    """Whether a child cgroup can be made and removed in ``parent``."""
    probe = os.path.join(parent, f"{CGROUP_PREFIX}{os.getpid()}-probe-{secrets.token_hex(3)}")
    try:
        os.mkdir(probe)
    except OSError:
        return False
    try:
        os.rmdir(probe)
    except OSError:
        _LEFT.add(probe)
    return True


def _cgroup_parents() -> tuple[str | None, tuple[str, ...]]:
    """Where runs' cgroups can be made: ("v1", (memory folder, pids folder?)), ("v2", (folder,)) or (None,
    ()). Root only; the trainer's own cgroups are the parents (v1's memory controller first, then v2)."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        return None, ()
    own = _own_cgroups()
    for controllers, path in own.items():
        if "memory" in controllers.split(","):
            memory = os.path.join(_CGROUP_ROOT, controllers) + path.rstrip("/")
            if not os.path.isfile(os.path.join(memory, "memory.limit_in_bytes")) or not _usable(memory):
                return None, ()  # the memory controller is v1's here: v2 has none to give
            parents = [memory]
            pids = next((f"{_CGROUP_ROOT}/{c}{p.rstrip('/')}" for c, p in own.items() if "pids" in c.split(",")), None)
            if pids is not None and os.path.isdir(pids) and _usable(pids):
                parents.append(pids)
            return "v1", tuple(parents)
    if "" not in own:
        return None, ()
    for root in (_CGROUP_ROOT, _CGROUP_ROOT + "/unified"):
        folder = root + own[""].rstrip("/")
        try:
            with open(os.path.join(folder, "cgroup.controllers")) as fh:
                if not {"memory", "pids"} <= set(fh.read().split()):
                    continue
            with open(os.path.join(folder, "cgroup.subtree_control")) as fh:
                enabled = set(fh.read().split())
            if not {"memory", "pids"} <= enabled:  # refused (EBUSY) where the trainer's own cgroup is not
                _write(os.path.join(folder, "cgroup.subtree_control"), "+memory +pids")  # the root: skip v2
        except OSError:
            continue
        if _usable(folder):
            return "v2", (folder,)
    return None, ()


def _make_cgroup(box: Sandbox, limits: Limits) -> tuple[str, ...]:
    """A fresh cgroup per parent of ``box`` with the run's limits; () where it could not be made."""
    _sweep(box)
    name = f"{CGROUP_PREFIX}{os.getpid()}-{next(_RUNS)}-{secrets.token_hex(3)}"
    made: list[str] = []
    memory = str(limits.memory_bytes + CGROUP_ALLOWANCE)
    try:
        for parent in box.cgroup_parents:
            folder = os.path.join(parent, name)
            os.mkdir(folder)
            made.append(folder)
            if box.cgroup == "v2":
                _write(os.path.join(folder, "memory.max"), memory)
                if os.path.exists(os.path.join(folder, "memory.swap.max")):
                    _write(os.path.join(folder, "memory.swap.max"), "0")
                _write(os.path.join(folder, "pids.max"), str(limits.processes))
            elif parent == box.cgroup_parents[0]:  # v1 memory: the limit first, then memory plus swap
                _write(os.path.join(folder, "memory.limit_in_bytes"), memory)
                if os.path.exists(os.path.join(folder, "memory.memsw.limit_in_bytes")):
                    _write(os.path.join(folder, "memory.memsw.limit_in_bytes"), memory)
            else:
                _write(os.path.join(folder, "pids.max"), str(limits.processes))
    except OSError:
        _remove_cgroup(tuple(made))
        return ()
    return tuple(made)


def _remove_cgroup(folders: tuple[str, ...], wait_s: float = 2.0) -> None:
    """Remove a run's cgroups once empty (its processes may take a moment to leave); what stays busy is
    killed, and kept to retry at the next run."""
    deadline = time.monotonic() + wait_s
    for folder in folders:
        delay = 0.001
        while True:
            try:
                os.rmdir(folder)
                break
            except FileNotFoundError:
                break
            except OSError:
                if time.monotonic() > deadline:
                    with _LEFT_LOCK:
                        _LEFT.add(folder)
                    break
                _kill_members(folder)
                time.sleep(delay)
                delay = min(delay * 2, 0.05)
        with _LEFT_LOCK:
            _LEFT.discard(folder)


def _kill_members(folder: str) -> None:
    try:
        with open(os.path.join(folder, "cgroup.procs")) as fh:
            members = [int(p) for p in fh.read().split()]
    except (OSError, ValueError):
        return
    for pid in members:
        try:
            os.kill(pid, 9)
        except OSError:
            pass


def _sweep(box: Sandbox) -> None:
    """Remove the empty cgroups of runs gone by: this process's still busy at their end, and those of
    trainers that died mid-run (their pid in the name is gone)."""
    with _LEFT_LOCK:
        left = list(_LEFT)
    for folder in left:
        _remove_cgroup((folder,), wait_s=0.0)
    for parent in box.cgroup_parents:
        try:
            names = [n for n in os.listdir(parent) if n.startswith(CGROUP_PREFIX)]
        except OSError:
            continue
        for name in names:
            pid = name[len(CGROUP_PREFIX) :].split("-", 1)[0]
            if pid.isdigit() and int(pid) != os.getpid() and not os.path.exists(f"/proc/{pid}"):
                try:
                    os.rmdir(os.path.join(parent, name))
                except OSError:
                    pass


def leftover_cgroups() -> list[str]:
    """The runs' cgroups that exist now in this process's cgroup parents (none once every run has ended)."""
    found: list[str] = []
    for parent in sandbox().cgroup_parents:
        try:
            found += [os.path.join(parent, n) for n in os.listdir(parent) if n.startswith(CGROUP_PREFIX)]
        except OSError:
            pass
    return sorted(found)


_CHOSEN: Sandbox | None = None


def sandbox() -> Sandbox:
    """How this process launches sandboxes (decided once): as root, bubblewrap runs as ``nobody`` with an
    interpreter ``nobody`` can read; else as root with no capabilities; as a user, as that user."""
    global _CHOSEN
    if _CHOSEN is None:
        found = _interpreters()
        if os.geteuid() != 0:
            python, prefix = found[0]
            _CHOSEN = Sandbox(python, prefix, os.getuid())
        else:
            readable = [
                (p, pre) for p, pre in found if _world_readable(p) and _world_readable(os.path.join(pre, "lib"))
            ]
            python, prefix = readable[0] if readable else found[0]
            version, parents = _cgroup_parents()
            _CHOSEN = Sandbox(python, prefix, SANDBOX_ID if readable else 0, cgroup=version, cgroup_parents=parents)
    return _CHOSEN


def _command(box: Sandbox, limits: Limits, seccomp_fd: int | None, info_fd: int | None = None) -> list[str]:
    args = [bwrap(), "--unshare-all", "--unshare-user", "--uid", str(SANDBOX_ID), "--gid", str(SANDBOX_ID)]
    args += ["--disable-userns", "--die-with-parent", "--new-session", "--clearenv", "--cap-drop", "ALL"]
    args += ["--hostname", "sandbox"]
    if info_fd is not None:  # bubblewrap writes the sandboxed process's host pid there (`_kill`)
        args += ["--info-fd", str(info_fd)]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    for folder in dict.fromkeys(("/usr", "/lib", "/lib64", "/bin", box.prefix)):
        if os.path.isdir(folder):
            args += ["--ro-bind", folder, folder]
    args += ["--proc", "/proc", "--dev", "/dev", "--size", str(limits.scratch_bytes), "--tmpfs", "/tmp"]
    # a read-only root and /dev (its tmpfs, /dev/shm included, has no size: files there would be memory
    # no limit counts); no PID 1 beside it
    args += ["--remount-ro", "/dev", "--remount-ro", "/", "--as-pid-1", "--chdir", "/tmp"]
    for key, value in ENVIRONMENT.items():
        args += ["--setenv", key, value]
    return [*args, box.python, "-I", "-S", "-c", _HARNESS]


def _entries(box: Sandbox, cgroups: tuple[str, ...]) -> tuple[str, ...]:
    """The files the child writes itself ("0") into. v1: ``tasks`` (itself, one thread: the child is one
    until it execs), which skips the kernel's global lock for moving a whole process -- that lock waits
    out an RCU grace period, ~15 ms a run; v2: ``cgroup.procs``."""
    return tuple(os.path.join(folder, "tasks" if box.cgroup == "v1" else "cgroup.procs") for folder in cgroups)


def _enter(limits: Limits, entries: tuple[str, ...], as_nobody: bool) -> None:
    """In the child, before it execs bubblewrap: into the run's cgroups (while still root), then to
    ``nobody`` (groups, gid, uid), then the rlimits -- inherited by everything it starts."""
    for entry in entries:
        _write(entry, "0")
    if as_nobody:
        os.setgroups([])
        os.setresgid(SANDBOX_ID, SANDBOX_ID, SANDBOX_ID)
        os.setresuid(SANDBOX_ID, SANDBOX_ID, SANDBOX_ID)
    _limit(limits)


def _limit(limits: Limits) -> None:
    space = limits.memory_bytes - limits.scratch_bytes
    for kind, value in (
        (resource.RLIMIT_CPU, limits.cpu_s),
        (resource.RLIMIT_AS, space),
        (resource.RLIMIT_FSIZE, limits.file_bytes),
        (resource.RLIMIT_NOFILE, limits.open_files),
        (resource.RLIMIT_NPROC, limits.processes),
        (resource.RLIMIT_CORE, 0),
        (resource.RLIMIT_MEMLOCK, 0),
    ):
        resource.setrlimit(kind, (value, value))


def run_job(job: dict, limits: Limits | None = None) -> Run:
    """Run the harness on ``job`` (its ``mode``, ``code`` and what the mode needs) in a fresh sandbox; the
    rows it sent before it ended, however it ended (a timeout keeps the rows of the tests done)."""
    limits = limits or DEFAULT_LIMITS
    box = sandbox()
    payload = json.dumps({**job, "cap": limits.output_bytes}).encode()
    program = seccomp_program()
    as_nobody = box.host_uid == SANDBOX_ID and os.geteuid() == 0
    with tempfile.TemporaryFile() as sink, tempfile.TemporaryFile() as filter_file, tempfile.TemporaryFile() as info:
        fds: tuple[int, ...] = (info.fileno(),)
        if program is not None:
            filter_file.write(program)
            filter_file.flush()
            filter_file.seek(0)
            fds += (filter_file.fileno(),)
        cgroups = _make_cgroup(box, limits) if box.cgroup else ()
        try:
            try:
                proc = _launch(box, limits, fds, program is not None, info, sink, cgroups, as_nobody)
            except subprocess.SubprocessError:
                if not cgroups:
                    raise
                _no_cgroups()  # the child could not enter its cgroup (a parent's rules): run as without
                proc = _launch(box, limits, fds, program is not None, info, sink, (), as_nobody)
            status, got = "ok", bytearray()
            try:
                status = _communicate(proc, payload, limits, got)
            finally:
                _kill(proc, info)
        finally:
            _remove_cgroup(cgroups)
        sink.seek(0)
        printed = sink.read(limits.output_bytes).decode(errors="replace")
    text = bytes(got).decode(errors="replace")
    rows = text.split("\n")
    rows = rows[:-1]  # a row is whole only with its newline: a cut one is dropped
    if status == "ok" and proc.returncode != 0:
        status = "crashed"
    return Run(rows=tuple(rows), status=status, output=printed, returncode=proc.returncode)


def _launch(
    box: Sandbox, limits: Limits, fds: tuple[int, ...], filtered: bool, info: Any, sink: Any,
    cgroups: tuple[str, ...], as_nobody: bool,
) -> subprocess.Popen:  # fmt: skip
    entries = _entries(box, cgroups)
    return subprocess.Popen(
        _command(box, limits, fds[1] if filtered else None, info.fileno()),
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=sink,
        env=dict(ENVIRONMENT),
        preexec_fn=lambda: _enter(limits, entries, as_nobody),  # noqa: PLW1509 - must run in the child
        start_new_session=True,
        pass_fds=fds,
        cwd="/",
    )


def _no_cgroups() -> None:
    """Launch without cgroups from now on."""
    global _CHOSEN
    if _CHOSEN is not None:
        _CHOSEN = dataclasses.replace(_CHOSEN, cgroup=None, cgroup_parents=())


def _communicate(proc: subprocess.Popen, job: bytes, limits: Limits, out: bytearray) -> str:
    """Send the job, read rows into ``out`` up to the cap within the wall-clock limit; how it ended."""
    import selectors
    import time

    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(job)
        proc.stdin.close()
    except (BrokenPipeError, OSError):
        pass
    deadline = time.monotonic() + limits.wall_s
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                return "timeout"
            if not sel.select(timeout=left):
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            out += chunk
            if len(out) > limits.result_bytes:
                del out[limits.result_bytes :]
                return "output"
    try:
        proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        return "timeout"
    return "ok"


def _kill(proc: subprocess.Popen, info: Any = None) -> None:
    """The run and everything it started. The sandboxed process is PID 1 of its namespace, so killing it
    kills the namespace; it is killed by its own pid (from bubblewrap's ``--info-fd``, through a pidfd
    opened while bubblewrap, its parent, still runs): the death signal bubblewrap gives it on its own death
    is a setting the code can clear (``prctl(PR_SET_PDEATHSIG, 0)``) and then outlive the run."""
    if proc.poll() is None:
        if info is not None and _kill_child(proc.pid, info):
            try:  # bubblewrap reaps it and exits: no orphan left for an init that may never reap it
                proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                pass
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, 9)
        except (ProcessLookupError, PermissionError):
            proc.kill()
    proc.wait()
    for stream in (proc.stdout, proc.stdin):
        if stream is not None and not stream.closed:
            stream.close()


def _kill_child(parent: int, info: Any) -> bool:
    """SIGKILL the sandboxed process bubblewrap (``parent``, alive and not yet reaped) reported; whether
    it was sent."""
    import signal

    try:
        info.seek(0)
        pid = json.loads(info.read(4096).decode() or "{}").get("child-pid")
    except (ValueError, OSError, AttributeError):
        return False
    if type(pid) is not int or pid <= 1:
        return False
    if not hasattr(os, "pidfd_open") or not hasattr(signal, "pidfd_send_signal"):
        return False  # an old kernel or build: bubblewrap's group is killed alone, as before
    try:
        handle = os.pidfd_open(pid)
    except OSError:
        return False
    try:
        with open(f"/proc/{pid}/status") as fh:  # the pid still bubblewrap's child, not a reused one
            ppid = next((line.split()[1] for line in fh if line.startswith("PPid:")), "")
        if ppid == str(parent):
            signal.pidfd_send_signal(handle, signal.SIGKILL)
            return True
    except (OSError, ValueError):
        pass
    finally:
        os.close(handle)
    return False


def run_tests(code: str, tests: list[str], limits: Limits | None = None) -> Any:
    """Run ``code`` against assert tests (``assert f(2) == 4``, ``assert out``), judged outside the sandbox
    by `flowrl.tasks.code_tests` (``passed`` per test, ``status``, ``output``); a test that cannot be judged
    outside is a TestError naming it (`flowrl.tasks.code_tests.run_asserts` is the forgeable way)."""
    from flowrl.tasks import code_tests

    parsed = code_tests.parse_tests(list(tests), where="run_tests")
    return code_tests.judge(code, parsed, limits or DEFAULT_LIMITS)


def code_of(response: str) -> str:
    """The code of a response: its first fenced block (```python ... ```), else the response itself."""
    start = response.find("```")
    if start < 0:
        return response
    body = response[start + 3 :]
    body = body.split("\n", 1)[1] if "\n" in body and not body.split("\n", 1)[0].strip().count(" ") else body
    end = body.find("```")
    return body if end < 0 else body[:end]
