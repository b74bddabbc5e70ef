"""Running model-written Python against test cases, isolated by bubblewrap (``bwrap``, from the
distribution's ``bubblewrap`` package).

Each run is a fresh process in its own user, network, PID, IPC and UTS namespaces. It sees only
the interpreter's folder and the system's libraries, both read-only, and a scratch ``/tmp``; there
is no network and no project file. Limits come from rlimits: CPU time, address space, file size,
open files and processes. A wall-clock timeout kills the whole namespace, and output past a cap is
cut off and the run killed. A seccomp filter refuses every new process or thread (x86-64), so fork
bombs and subprocesses fail at once (elsewhere the process rlimit bounds them, except for root).

`run_tests` execs the response, then each test (an ``assert`` statement, say) in the same
namespace, and reports pass or fail per test. The harness prints a secret line only after the last
test, so code that exits early (``os._exit(0)``) cannot pass. Code that goes after the harness's
own frames can still forge its results: the sandbox protects the machine, not the reward.
"""

from __future__ import annotations

import json
import os
import resource
import secrets
import shutil
import subprocess
import sys
import tempfile
from dataclasses import dataclass

from flowrl.errors import ConfigError

#: what the sandboxed interpreter runs: the job (JSON: code, tests, nonce) on stdin; on the original stdout
#: one result line per test and the nonce line at the end; the code's own output goes to stderr
_HARNESS = r"""
import json, os, sys
job = json.loads(sys.stdin.read())
out = os.fdopen(os.dup(1), "w")
os.dup2(2, 1)  # what the code prints goes with its errors, apart from the results
def run(source, name):
    try:
        exec(compile(source, name, "exec"), space)
        return True
    except BaseException:
        return False
space = {"__name__": "__main__"}
loaded = run(job.pop("code"), "<response>")
nonce, tests = job.pop("nonce"), job.pop("tests")
for i, test in enumerate(tests):
    out.write(("1" if loaded and run(test, "<test %d>" % i) else "0") + "\n")
    out.flush()
out.write(nonce + "\n")
out.flush()
"""


@dataclass(frozen=True)
class Limits:
    """What one sandboxed run may use."""

    wall_s: float = 5.0
    cpu_s: int = 4
    memory_bytes: int = 512 * 2**20  # address space
    file_bytes: int = 16 * 2**20  # largest file written (in the scratch /tmp)
    processes: int = 64  # per user (where the seccomp filter does not refuse new processes outright)
    output_bytes: int = 64 * 2**10  # stdout + stderr kept; more kills the run
    open_files: int = 64


@dataclass(frozen=True)
class Result:
    passed: tuple[bool, ...]  # per test
    status: str  # ok | timeout | output | crashed | forged
    output: str  # what the code printed (cut at the cap)


def bwrap() -> str:
    """The bubblewrap binary, or a ConfigError saying how to install it."""
    found = shutil.which("bwrap")
    if found is None:
        raise ConfigError(
            "the code sandbox needs bubblewrap ('bwrap'): install your distribution's package "
            "(apt-get install bubblewrap, dnf install bubblewrap) and run again."
        )
    return found


#: x86-64 syscalls that make a process or thread (clone, fork, vfork, clone3): the seccomp filter refuses them
_SPAWNING = {0xC000003E: (56, 57, 58, 435)}


def seccomp_program() -> bytes | None:
    """A classic-BPF seccomp filter that fails every syscall starting a process or thread with EPERM (fork
    bombs, subprocesses, threads), or None on an architecture it does not know (then rlimits alone)."""
    import platform
    import struct

    arch = {"x86_64": 0xC000003E}.get(platform.machine())
    if arch is None:
        return None
    blocked = _SPAWNING[arch]
    n = len(blocked)
    ld, jeq, ret = 0x20, 0x15, 0x06
    allow, eperm = 0x7FFF0000, 0x00050000 | 1
    prog = [(ld, 0, 0, 4), (jeq, 0, n + 1, arch), (ld, 0, 0, 0)]  # arch, else allow; the syscall number
    prog += [(jeq, n - j, 0, nr) for j, nr in enumerate(blocked)]
    prog += [(ret, 0, 0, allow), (ret, 0, 0, eperm)]
    return b"".join(struct.pack("HBBI", *ins) for ins in prog)


def _command(python: str, seccomp_fd: int | None) -> list[str]:
    prefix = os.path.realpath(sys.base_prefix)
    args = [bwrap(), "--unshare-all", "--die-with-parent", "--new-session", "--clearenv"]
    if seccomp_fd is not None:
        args += ["--seccomp", str(seccomp_fd)]
    for folder in ("/usr", "/lib", "/lib64", "/bin", prefix):
        if os.path.isdir(folder):
            args += ["--ro-bind", folder, folder]
    args += ["--proc", "/proc", "--dev", "/dev", "--tmpfs", "/tmp", "--chdir", "/tmp", "--setenv", "HOME", "/tmp"]
    return [*args, python, "-I", "-S", "-c", _HARNESS]


def _limit(limits: Limits) -> None:  # in the child, before bwrap: inherited by everything it starts
    resource.setrlimit(resource.RLIMIT_CPU, (limits.cpu_s, limits.cpu_s))
    resource.setrlimit(resource.RLIMIT_AS, (limits.memory_bytes, limits.memory_bytes))
    resource.setrlimit(resource.RLIMIT_FSIZE, (limits.file_bytes, limits.file_bytes))
    resource.setrlimit(resource.RLIMIT_NOFILE, (limits.open_files, limits.open_files))
    resource.setrlimit(resource.RLIMIT_NPROC, (limits.processes, limits.processes))


def code_of(response: str) -> str:
    """The code of a response: its first fenced block (```python ... ```), else the response itself."""
    start = response.find("```")
    if start < 0:
        return response
    body = response[start + 3 :]
    body = body.split("\n", 1)[1] if "\n" in body and not body.split("\n", 1)[0].strip().count(" ") else body
    end = body.find("```")
    return body if end < 0 else body[:end]


def run_tests(code: str, tests: list[str], limits: Limits = Limits()) -> Result:
    """Run ``code`` then each of ``tests`` in one sandboxed interpreter; pass or fail per test."""
    nonce = secrets.token_hex(16)
    job = json.dumps({"code": code, "tests": list(tests), "nonce": nonce}).encode()
    python = os.path.realpath(
        os.path.join(sys.base_prefix, "bin", f"python{sys.version_info[0]}.{sys.version_info[1]}")
    )
    program = seccomp_program()
    with tempfile.TemporaryFile() as sink, tempfile.TemporaryFile() as filter_file:
        fds: tuple[int, ...] = ()
        if program is not None:
            filter_file.write(program)
            filter_file.flush()
            filter_file.seek(0)
            fds = (filter_file.fileno(),)
        proc = subprocess.Popen(
            _command(python, fds[0] if fds else None),
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=sink,
            preexec_fn=lambda: _limit(limits),  # noqa: PLW1509 - rlimits must be set in the child
            start_new_session=True,
            pass_fds=fds,
        )
        status, lines = "ok", b""
        try:
            lines, _ = _communicate(proc, job, limits)
        except subprocess.TimeoutExpired:
            status = "timeout"
        except _TooMuch:
            status = "output"
        finally:
            _kill(proc)
        sink.seek(0)
        printed = sink.read(limits.output_bytes).decode(errors="replace")
    rows = lines.decode(errors="replace").splitlines()
    if status == "ok" and (not rows or rows[-1] != nonce):
        status = "forged" if proc.returncode == 0 else "crashed"
    results = [r == "1" for r in rows[: len(tests)]] if status == "ok" else []
    passed = tuple(results + [False] * (len(tests) - len(results)))
    return Result(passed=passed, status=status, output=printed)


class _TooMuch(Exception):
    pass


def _communicate(proc: subprocess.Popen, job: bytes, limits: Limits) -> tuple[bytes, bytes]:
    """Send the job, read stdout up to the cap within the wall-clock limit."""
    import selectors
    import time

    assert proc.stdin is not None and proc.stdout is not None
    try:
        proc.stdin.write(job)
        proc.stdin.close()
    except BrokenPipeError:
        pass
    deadline = time.monotonic() + limits.wall_s
    out = bytearray()
    with selectors.DefaultSelector() as sel:
        sel.register(proc.stdout, selectors.EVENT_READ)
        while True:
            left = deadline - time.monotonic()
            if left <= 0:
                raise subprocess.TimeoutExpired(proc.args, limits.wall_s)
            if not sel.select(timeout=left):
                continue
            chunk = os.read(proc.stdout.fileno(), 65536)
            if not chunk:
                break
            out += chunk
            if len(out) > limits.output_bytes:
                raise _TooMuch
    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
    return bytes(out), b""


def _kill(proc: subprocess.Popen) -> None:
    """The run and everything it started: bwrap's namespace dies with its first process."""
    if proc.poll() is None:
        try:
            os.killpg(proc.pid, 9)
        except (ProcessLookupError, PermissionError):
            proc.kill()
    proc.wait()
    for stream in (proc.stdout, proc.stdin):
        if stream is not None and not stream.closed:
            stream.close()
