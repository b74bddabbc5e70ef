"""The code sandbox holds as root and as an unprivileged user: every escape in `sandbox_cases.CONTAINMENT`
(network, files, remounts through ctypes, namespaces, ptrace, foreign syscall ABIs, processes and
threads, memory and scratch space, the trainer's environment, signals, time) is contained, and every
forgery in `sandbox_cases.FORGERIES` of a wrong answer scores 0. As root the cases run in this process;
as a user, in a process of a user the test creates (CI runs as root)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from flowrl.tasks import sandbox

sys.path.insert(0, str(Path(__file__).parent))
import sandbox_cases  # noqa: E402 - a plain file the unprivileged user runs too
from sandbox_cases import CGROUP_ONLY, CONTAINMENT, FORGERIES, SECRET, STDIO_FORGERIES  # noqa: E402

REPO = Path(__file__).resolve().parents[2]
USER = "flowrl-sandbox-test"
CASES = (
    ["contain: " + n for n, _ in CONTAINMENT]
    + ["forge: " + n for n, _ in FORGERIES]
    + ["forge stdio: " + n for n, _ in STDIO_FORGERIES]
)
ESCAPE_MARKERS = ("/usr/flowrl_escaped", "/flowrl_escaped")

pytestmark = pytest.mark.skipif(shutil.which("bwrap") is None, reason="needs bubblewrap")


def _check(outcome: dict, case: str) -> None:
    if case.startswith("contain: "):
        if case.removeprefix("contain: ") in CGROUP_ONLY and outcome["cgroup"] is None and outcome["escaped"]:
            pytest.xfail(  # the known hole without a cgroup, not a pass
                "no memory cgroup here (not root, or no writable memory controller): the kernel memory of "
                "empty files is bounded only by the run's CPU seconds and wall-clock time, and freed at its end"
            )
        assert outcome["escaped"] is False, (case, outcome)
    else:
        assert outcome["passed"] == 0, (case, outcome)
    for marker in (*ESCAPE_MARKERS, sandbox.sandbox().prefix + "/flowrl_escaped"):
        assert not os.path.exists(marker), marker


@pytest.fixture(scope="module")
def as_root() -> dict:
    if os.geteuid() != 0:
        pytest.skip("runs as root only where the suite does (CI)")
    os.environ["FLOWRL_SECRET"] = SECRET
    try:
        return sandbox_cases.outcomes(str(REPO))
    finally:
        del os.environ["FLOWRL_SECRET"]


def _test_user() -> tuple[int, int]:
    """A user of our own (created once), else ``nobody``; (uid, gid)."""
    import pwd

    try:
        entry = pwd.getpwnam(USER)
    except KeyError:
        if shutil.which("useradd"):
            subprocess.run(["useradd", "--system", "--no-create-home", "--shell", "/usr/sbin/nologin", USER],
                           check=False, capture_output=True)  # fmt: skip
        try:
            entry = pwd.getpwnam(USER)
        except KeyError:
            entry = pwd.getpwnam("nobody")
    return entry.pw_uid, entry.pw_gid


@pytest.fixture(scope="module")
def as_user() -> dict:
    """The cases run by an unprivileged user: the sandbox's modules copied where the user can read them,
    run with an interpreter the user can read."""
    if os.geteuid() == 0:
        uid, gid = _test_user()
        readable = [p for p, pre in sandbox._interpreters() if sandbox._world_readable(p)]
        if not readable:
            pytest.skip("no Python an unprivileged user can run")
        python = readable[0]
    else:
        uid, gid, python = os.getuid(), os.getgid(), sandbox._interpreters()[0][0]
    copy = Path(tempfile.mkdtemp(prefix="flowrl-sandbox-user-"))
    try:
        for rel in ("flowrl/__init__.py", "flowrl/errors.py", "flowrl/tasks/__init__.py", "flowrl/tasks/sandbox.py",
                    "flowrl/tasks/code_tests.py", "flowrl/tasks/bounded.py",
                    "tests/tasks/sandbox_cases.py"):  # fmt: skip
            (copy / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy(REPO / rel, copy / rel)
        for path in [copy, *copy.rglob("*")]:
            path.chmod(0o755)
        proc = subprocess.run(
            [python, "-I", str(copy / "tests/tasks/sandbox_cases.py"), str(copy), str(REPO)],
            user=uid if os.geteuid() == 0 else None,
            group=gid if os.geteuid() == 0 else None,
            extra_groups=[] if os.geteuid() == 0 else None,
            env={"PATH": "/usr/bin:/bin", "FLOWRL_SECRET": SECRET, "HOME": str(copy)},
            cwd=str(copy),
            capture_output=True,
            text=True,
            timeout=900,
        )
        assert proc.returncode == 0, proc.stderr[-3000:]
        result = json.loads(proc.stdout.strip().splitlines()[-1])
        assert result["uid"] == uid and uid != 0
        return result["outcomes"]
    finally:
        shutil.rmtree(copy, ignore_errors=True)


@pytest.mark.parametrize("case", CASES)
@pytest.mark.slow
def test_as_root_every_escape_is_contained_and_every_forgery_scores_zero(as_root, case):
    _check(as_root[case], case)


@pytest.mark.slow
@pytest.mark.parametrize("case", CASES)
def test_as_a_user_every_escape_is_contained_and_every_forgery_scores_zero(as_user, case):
    _check(as_user[case], case)


def test_a_right_answer_still_passes_every_test_through_the_same_harness():
    """The cases above score 0 because the sandbox holds, not because nothing can pass."""
    from flowrl.tasks import code_tests

    tests = code_tests.parse_tests(sandbox_cases.EXPR_TESTS, where="p")
    assert code_tests.judge("f = lambda x: x + 3", tests).passed == (True,) * 4
    stdio = code_tests.parse_tests(sandbox_cases.STDIO_TESTS, where="p")
    assert code_tests.judge("print(sum(map(int, input().split())))", stdio).passed == (True, True)


def test_the_sandbox_runs_as_nobody_on_the_host_when_root_can_hand_it_a_readable_python():
    box = sandbox.sandbox()
    if os.geteuid() == 0 and any(sandbox._world_readable(p) for p, _ in sandbox._interpreters()):
        assert box.host_uid == sandbox.SANDBOX_ID
    assert box.host_uid != 0 or os.geteuid() == 0


def _tree(pid: int) -> set[int]:
    out = subprocess.run(["pgrep", "-P", str(pid)], capture_output=True, text=True).stdout.split()
    kids = {int(k) for k in out}
    return kids.union(*(_tree(k) for k in kids)) if kids else set()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/status").read_text().split("State:")[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


def test_a_sandbox_dies_with_the_process_that_started_it():
    """Killing the trainer mid-run leaves no sandboxed process behind."""
    import sys
    import time

    script = (
        f"import sys\nsys.path.insert(0, {str(REPO)!r})\nfrom flowrl.tasks import sandbox\n"
        "sandbox.run_job({'mode': 'calls', 'code': 'import time\\ntime.sleep(60)', 'calls': []}, "
        "sandbox.Limits(wall_s=60, cpu_s=60))\n"
    )
    proc = subprocess.Popen([sys.executable, "-c", script])
    try:
        for _ in range(200):
            tree = _tree(proc.pid)
            if len(tree) >= 2:  # bwrap and the sandboxed interpreter
                break
            time.sleep(0.05)
        else:
            pytest.fail("the sandboxed process never started")
    finally:
        proc.kill()
        proc.wait()
    for _ in range(100):
        if not any(_alive(p) for p in tree):
            return
        time.sleep(0.05)
    pytest.fail(f"sandboxed processes outlived their parent: {sorted(p for p in tree if _alive(p))}")


def _run_filter(program: bytes, arch: int, nr: int, arg0: int = 0) -> int:
    """What a classic-BPF seccomp program returns for a syscall (a tiny interpreter: ld abs, jeq, jge, ret)."""
    import struct

    code = [struct.unpack("HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    data, acc, pc = {0: nr, 4: arch, 16: arg0}, 0, 0
    while True:
        op, jt, jf, k = code[pc]
        if op == 0x20:
            acc, pc = data[k], pc + 1
        elif op in (0x15, 0x35):
            taken = acc == k if op == 0x15 else acc >= k
            pc = pc + 1 + (jt if taken else jf)
        else:
            assert op == 0x06, op
            return k


def test_the_seccomp_filter_refuses_what_it_lists_and_foreign_abis_and_allows_the_rest():
    import platform

    program = sandbox.seccomp_program()
    if program is None:
        pytest.skip(f"no filter on {platform.machine()}")
    arch = sandbox._ARCH[platform.machine().lower()]
    allow, eperm = 0x7FFF0000, 0x00050001
    refused = set(sandbox._REFUSED[arch])
    for nr in range(0, 600):
        assert _run_filter(program, arch, nr, 2) == (eperm if nr in refused else allow), nr
    for nr in (0x40000000, 0x40000000 + 39, 0xFFFFFFFF):  # x32's numbers, and -1
        assert _run_filter(program, arch, nr) == eperm
    assert _run_filter(program, 0x40000003, 20) == eperm  # i386 (int 0x80)
    prctl = sandbox._PRCTL[arch]
    assert _run_filter(program, arch, prctl, 1) == eperm  # PR_SET_PDEATHSIG: would outlive a dead trainer
    assert _run_filter(program, arch, prctl, 15) == allow  # PR_SET_NAME and the rest
    assert {56, 435, 319, 29, 165, 101} <= refused or arch != 0xC000003E  # clone, clone3, memfd, shmget, mount


@pytest.mark.slow
def test_code_that_clears_its_death_signal_does_not_outlive_the_run():
    """bubblewrap's --die-with-parent is a setting the code can clear (prctl PR_SET_PDEATHSIG 0); killing
    bubblewrap alone then left the sandboxed process sleeping, reparented to init, after the run."""
    import secrets
    import time

    name = "fr" + secrets.token_hex(6)  # its /proc/PID/comm, to find it after the run
    code = (
        "import ctypes, signal, time\nlibc = ctypes.CDLL(None)\nlibc.prctl(1, 0, 0, 0, 0)\n"
        f"libc.prctl(15, {name.encode()!r}, 0, 0, 0)\n"
        "for s in (signal.SIGTERM, signal.SIGHUP, signal.SIGINT):\n    signal.signal(s, signal.SIG_IGN)\n"
        "time.sleep(60)"
    )
    run = sandbox.run_job({"mode": "calls", "code": code, "calls": []}, sandbox.Limits(wall_s=1, cpu_s=1))
    assert run.status == "timeout"

    def survivors() -> list[str]:
        found = []
        for comm in Path("/proc").glob("[0-9]*/comm"):
            try:
                if comm.read_text().strip() == name:
                    found.append(comm.parent.name)
            except OSError:
                pass
        return found

    for _ in range(40):
        if not survivors():
            return
        time.sleep(0.05)
    pytest.fail(f"a sandboxed process outlived its run: pids {survivors()}")


_FLOOD = (
    "import os\ndef probe():\n    held = b'x' * (400 * 2**20)\n    made = 0\n    while made < 1000000:\n"
    "        os.close(os.open('/tmp/%x' % made, os.O_CREAT | os.O_WRONLY, 0o600))\n        made += 1\n    return made"
)


def _own_cgroups() -> list[str]:
    return [c for c in sandbox.leftover_cgroups() if f"{sandbox.CGROUP_PREFIX}{os.getpid()}-" in c]


@pytest.mark.slow
def test_as_root_a_flood_of_empty_files_is_ended_by_the_runs_memory_cgroup_and_the_trainer_lives():
    """Empty files in the tmpfs /tmp hold kernel memory that neither RLIMIT_AS nor the tmpfs size counts.
    With CPU and time to spare (without the cgroup it makes its million files, ~1 GB, and returns), the
    run's memory cgroup ends it: killed inside the cgroup, or its file creation refused."""
    box = sandbox.sandbox()
    if box.cgroup is None:
        pytest.skip("no memory cgroup here (not root, or no writable memory controller)")
    limits = sandbox.Limits(wall_s=30, cpu_s=30, memory_bytes=512 * 2**20)
    run = sandbox.run_job({"mode": "calls", "code": _FLOOD, "calls": [["probe", "()", "{}"]]}, limits)
    assert run.status == "crashed" or (run.rows and '"error"' in run.rows[0]), run
    assert not any('"ok"' in row for row in run.rows), run
    from flowrl.tasks import code_tests  # the trainer, outside the cgroup, goes on

    tests = code_tests.parse_tests(sandbox_cases.EXPR_TESTS, where="p")
    assert code_tests.judge("f = lambda x: x + 3", tests).passed == (True,) * 4
    assert _own_cgroups() == []


@pytest.mark.slow
def test_runs_leave_no_cgroup_behind():
    """Each run's cgroup is removed after it, however the run ended (ok, error, timeout, killed)."""
    if sandbox.sandbox().cgroup is None:
        pytest.skip("no memory cgroup here (not root, or no writable memory controller)")
    limits = sandbox.Limits(wall_s=1, cpu_s=1)
    ended = ("def f():\n    return 1", "def f():\n    raise ValueError", "import time\ndef f():\n    time.sleep(9)")
    for code in (*ended, "import os\ndef f():\n    os.kill(os.getpid(), 9)", "def f():\n    while True:\n        pass"):
        sandbox.run_job({"mode": "calls", "code": code, "calls": [["f", "()", "{}"]]}, limits)
    for _ in range(5):
        sandbox.run_job({"mode": "calls", "code": "def f():\n    return 1", "calls": [["f", "()", "{}"]]})
    assert _own_cgroups() == []


def test_a_user_gets_no_cgroup_and_runs_as_before(monkeypatch):
    """Not root: no cgroup is made (the sandbox records it) and runs go on under the rlimits alone."""
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    assert sandbox._cgroup_parents() == (None, ())
