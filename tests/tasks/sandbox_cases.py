"""Escapes and forgeries tried against the code sandbox, as data: the test modules run each as root (this
process) and as an unprivileged user (this file run by that user: `python sandbox_cases.py REPO`, which
prints one JSON line of outcomes). Standard library only: the user runs a system interpreter."""

# ruff: noqa: E501 - the cases are code as data, one per entry
from __future__ import annotations

import json
import os
import sys

SECRET = "flowrl-secret-token-5f3a"  # set in the trainer's environment: the sandbox must not see it
SCRATCH = 32 * 2**20
MEMORY = 512 * 2**20

_LIBC = "import ctypes, os\nlibc = ctypes.CDLL(None, use_errno=True)\nlibc.syscall.restype = ctypes.c_long\n"

# (name, code defining probe(): True only if the attempt got out)
CONTAINMENT = [
    ("no network", "import socket\ndef probe():\n    try:\n        socket.create_connection(('1.1.1.1', 53), timeout=1)\n"
     "        return True\n    except OSError:\n        return [n for _, n in socket.if_nameindex()] != ['lo']"),
    ("no project files", "def probe(path={repo!r}):\n    import os\n    return os.path.exists(path) or os.path.exists('/proc/1/root' + path)"),
    ("no host secrets", "import os\ndef probe():\n    return any(os.path.exists(p) for p in ('/etc/shadow', '/root', '/home', '/sys/fs/cgroup'))"),
    ("no trainer environment", "import os\ndef probe():\n    seen = repr(dict(os.environ))\n"
     "    for pid in [p for p in os.listdir('/proc') if p.isdigit()]:\n        try:\n"
     "            seen += open('/proc/%s/environ' % pid, 'rb').read().decode(errors='replace')\n"
     "        except OSError:\n            pass\n    return {secret!r} in seen or 'PWD=/' + 'work' in seen"),
    ("unprivileged uid and groups", "import os\ndef probe():\n    return (os.getuid(), os.geteuid(), os.getgid()) != (65534,) * 3 "
     "or 0 in os.getgroups()"),
    ("no capabilities", "def probe():\n    status = open('/proc/self/status').read()\n"
     "    caps = [l.split()[1] for l in status.splitlines() if l.startswith(('CapEff', 'CapPrm', 'CapBnd', 'CapAmb'))]\n"
     "    return any(int(c, 16) for c in caps) or 'NoNewPrivs:\\t1' not in status"),
    ("cannot become root", "import os\ndef probe():\n    try:\n        os.setuid(0)\n        return True\n"
     "    except OSError:\n        return False"),
    ("no writes outside the scratch folder", "def probe():\n    for path in ('/usr/flowrl_escaped', {prefix!r} + '/flowrl_escaped', '/flowrl_escaped'):\n"
     "        try:\n            open(path, 'w').write('x')\n            return True\n        except OSError:\n            pass\n    return False"),
    ("no remount read-write", _LIBC + "def probe():\n    hit = False\n    for path in (b'/usr', {prefix!r}.encode(), b'/'):\n"
     "        hit |= libc.mount(None, path, None, 32 | 4096, None) == 0  # MS_REMOUNT | MS_BIND\n"
     "        hit |= libc.mount(None, path, None, 32, None) == 0\n"
     "        try:\n            open(path.decode() + '/flowrl_escaped', 'w').write('x')\n            hit = True\n"
     "        except OSError:\n            pass\n    return hit"),
    ("no new mounts", _LIBC + "def probe():\n    return libc.mount(b'none', b'/tmp', b'tmpfs', 0, None) == 0 or "
     "libc.mount(b'/usr', b'/tmp', None, 4096, None) == 0 or libc.umount2(b'/usr', 2) == 0"),
    ("no new namespaces", _LIBC + "def probe():\n    return any(libc.unshare(flag) == 0 for flag in "
     "(0x10000000, 0x00020000, 0x40000000, 0x20000000)) or libc.setns(3, 0) == 0 or libc.chroot(b'/tmp') == 0"),
    ("no ptrace", _LIBC + "def probe():\n    return any(libc.ptrace(16, pid, 0, 0) == 0 for pid in (1, os.getppid())) or "
     "libc.ptrace(0, 0, 0, 0) == 0"),
    ("one process, no other process's memory", _LIBC + "def probe():\n"
     "    others = [p for p in os.listdir('/proc') if p.isdigit() and int(p) != os.getpid()]\n"
     "    return libc.syscall(310, 1, 0, 0, 0, 0, 0) >= 0 or bool(others)"),
    ("no keyrings, bpf, perf, userfaultfd, io_uring", _LIBC + "def probe():\n    params = ctypes.create_string_buffer(256)\n"
     "    return any(r >= 0 for r in (libc.syscall(250, 0, -3, 0), libc.syscall(321, 0, 0, 0), "
     "libc.syscall(298, 0, 0, -1, -1, 0), libc.syscall(323, 0), libc.syscall(425, 4, params)))"),
    ("no x32 syscalls", _LIBC + "def probe():\n    import platform\n    if platform.machine() != 'x86_64':\n        return False\n"
     "    return libc.syscall(0x40000000 + 39) > 0 or libc.syscall(0x40000000 + 165, 0, 0, 0, 0, 0) == 0"),
    ("no i386 syscalls", "import ctypes, mmap, platform\ndef probe():\n    if platform.machine() != 'x86_64':\n        return False\n"
     "    page = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)\n"
     "    page.write(bytes([0xB8, 20, 0, 0, 0, 0xCD, 0x80, 0xC3]))  # mov eax, 20 (getpid); int 0x80; ret\n"
     "    address = ctypes.addressof(ctypes.c_char.from_buffer(page))\n"
     "    return ctypes.CFUNCTYPE(ctypes.c_int)(address)() > 0"),
    ("no fork bomb", "import os\ndef probe():\n    made = 0\n    for _ in range(200):\n        try:\n"
     "            if os.fork() == 0:\n                while True:\n                    pass\n            made += 1\n"
     "        except OSError:\n            pass\n    return made > 0"),
    ("no subprocess", "import subprocess\ndef probe():\n    try:\n        subprocess.run(['true'])\n        return True\n"
     "    except OSError:\n        return False"),
    ("no threads", "import threading\ndef probe():\n    try:\n        threading.Thread(target=lambda: None).start()\n"
     "        return True\n    except RuntimeError:\n        return False"),
    ("memory is capped", "def probe():\n    try:\n        x = bytearray(8 * 2**30)\n        return True\n"
     "    except MemoryError:\n        return False"),
    ("the scratch folder is capped", "def probe():\n    written = 0\n    try:\n        for i in range(1024):\n"
     "            with open('/tmp/f%d' % i, 'wb') as fh:\n                fh.write(b'x' * 2**20)\n"
     "            written += 2**20\n    except OSError:\n        pass\n    return written > {scratch}"),
    ("the scratch folder counts against memory", "def probe():\n    written, held = 0, []\n    try:\n"
     "        for i in range(1024):\n            with open('/tmp/f%d' % i, 'wb') as fh:\n                fh.write(b'x' * 2**20)\n"
     "            written += 2**20\n    except OSError:\n        pass\n    try:\n        while True:\n"
     "            held.append(bytearray(16 * 2**20))\n    except MemoryError:\n        pass\n"
     "    return written + 16 * 2**20 * len(held) > {memory}"),
    # tmpfs's size= counts bytes, not files: each empty file holds ~1 KB of kernel memory (inode, dentry)
    # that RLIMIT_AS does not count either. It holds 400 MiB, then makes 400k empty files (~400 MB more):
    # all of them is past the memory limit. Held only by the memory cgroup (as root, `CGROUP_ONLY`)
    ("empty files in the scratch folder count against memory", "import os\ndef probe():\n"
     "    held = b'x' * (400 * 2**20)\n    made = 0\n    try:\n        while made < 400000:\n"
     "            os.close(os.open('/tmp/%x' % made, os.O_CREAT | os.O_WRONLY, 0o600))\n            made += 1\n"
     "    except OSError:\n        return False\n    return len(held) + made * 1000 > {memory}"),
    ("one file is capped", "def probe():\n    try:\n        with open('/tmp/big', 'wb') as fh:\n"
     "            for _ in range(64):\n                fh.write(b'x' * 2**20)\n        return True\n"
     "    except OSError:\n        return False"),
    ("no unsized tmpfs in /dev", "def probe():\n    written = 0\n    for folder in ('/dev/shm', '/dev'):\n        try:\n"
     "            with open(folder + '/flowrl_fill', 'wb') as fh:\n                fh.write(b'x' * 2**20)\n"
     "            written += 1\n        except OSError:\n            pass\n    return written > 0"),
    ("no memfd files outside the memory limit", "import os\ndef probe():\n    try:\n        fd = os.memfd_create('m')\n"
     "        os.write(fd, b'x' * 2**20)\n        return True\n    except OSError:\n        return False"),
    ("no SysV shared memory or message queues", _LIBC + "def probe():\n"
     "    return libc.shmget(0, 2**20, 0o1600) >= 0 or libc.msgget(0, 0o1600) >= 0"),
    ("/dev/null still works", "import os\ndef probe():\n    try:\n        open('/dev/null', 'w').write('x')\n"
     "        return len(open('/dev/urandom', 'rb').read(4)) != 4\n    except OSError:\n        return True"),
    ("cannot clear its death signal", _LIBC + "def probe():\n    return libc.prctl(1, 0, 0, 0, 0) == 0"),
    ("open files are capped", "def probe():\n    held = []\n    try:\n        for i in range(10000):\n"
     "            held.append(open('/proc/self/status'))\n    except OSError:\n        pass\n    return len(held) > 100"),
    ("no kernel knobs", "def probe():\n    for path in ('/proc/sys/kernel/core_pattern', '/proc/sysrq-trigger', '/proc/sys/vm/drop_caches'):\n"
     "        try:\n            open(path, 'w').write('1')\n            return True\n        except OSError:\n            pass\n"
     "    return False"),
    ("no devices", "import os\ndef probe():\n    return any(os.path.exists(d) for d in ('/dev/mem', '/dev/kmsg', '/dev/sda', '/dev/tty0'))"),
    ("kill its parent", "import os, signal\ndef probe():\n    for pid in (os.getppid(), 1, -1):\n        try:\n"
     "            os.kill(pid, signal.SIGKILL)\n        except OSError:\n            pass\n    return False"),
    ("an infinite loop ends", "def probe():\n    while True:\n        pass"),
    ("a long sleep ends", "import time\ndef probe():\n    time.sleep(3600)\n    return True"),
    ("huge printing is cut", "import sys\ndef probe():\n    for _ in range(10000):\n        sys.stdout.write('x' * 65536)\n"
     "    return True"),
    ("a huge return value ends the run", "def probe():\n    return ['x' * 1000] * 100000"),
]  # fmt: skip

#: the containment cases that only the run's memory cgroup holds (`flowrl.tasks.sandbox.Sandbox.cgroup`: as
#: root, where a memory controller can be written); without one, only the run's CPU seconds and wall-clock
#: time bound them (kernel memory is freed when the run ends): the test expects no escape only with a cgroup
CGROUP_ONLY = {"empty files in the scratch folder count against memory"}

# (name, response code put into the expr task's template "{response}"): the function must be wrong
# (f = lambda x: 0 fails every add-3 test), and each tries to make the reward say it passed
# rows for every call with every guess from 0 to 49: a forger does not know the expected values (they never
# enter the sandbox), so it would have to try them all -- and only the first row for a call counts
_FAKE = "".join(f'[{i}, "ok", {v}]\n' for v in range(50) for i in range(4))
_FAKE_STDIO = "".join(f'[{i}, "ok", "{v}\\n"]\n' for v in range(50) for i in range(2))
FORGERIES = [
    ("print pass lines", "f = lambda x: 0\nprint('1\\n1\\n1\\n1')\nprint(" + repr(_FAKE) + ")"),
    ("write fake rows to every descriptor", "import os\nf = lambda x: 0\nfor fd in range(3, 64):\n    try:\n"
     "        os.write(fd, " + repr(_FAKE.encode()) + ")\n    except OSError:\n        pass"),
    ("write fake rows then exit", "import os\nf = lambda x: 0\nfor fd in range(1, 64):\n    try:\n"
     "        os.write(fd, " + repr(_FAKE.encode()) + ")\n    except OSError:\n        pass\nos._exit(0)"),
    ("exit early", "import os\nos._exit(0)"),
    ("sys.exit while loading", "import sys\nf = lambda x: 0\nsys.exit(0)"),
    ("kill itself", "import os, signal\nf = lambda x: 0\nos.kill(os.getpid(), signal.SIGKILL)"),
    ("an always-equal object", "class E:\n    def __eq__(self, other):\n        return True\n    __ne__ = lambda s, o: False\n"
     "f = lambda x: E()"),
    ("an int subclass equal to everything", "class I(int):\n    def __eq__(self, other):\n        return True\n"
     "    def __sub__(self, other):\n        return I(1)\n    __hash__ = int.__hash__\nf = lambda x: I(0)"),
    ("a str subclass", "class S(str):\n    def __eq__(self, other):\n        return True\nf = lambda x: S('3')"),
    ("a list subclass", "class L(list):\n    def __eq__(self, other):\n        return True\nf = lambda x: L()"),
    ("NaN", "f = lambda x: float('nan')"),
    ("replace the harness's encoder", "import sys, json\nf = lambda x: 0\nmain = sys.modules['__main__']\n"
     "main.tag = lambda v, depth=0: True\njson.dumps = lambda *a, **k: '[0, \"ok\", true]'"),
    ("patch exec, compile and builtins", "import builtins\nf = lambda x: 0\nbuiltins.exec = lambda *a, **k: None\n"
     "builtins.compile = lambda *a, **k: None\nbuiltins.isinstance = lambda *a: True\nbuiltins.type = lambda *a: int"),
    ("find the expected values through frames", "import sys\nf = lambda x: 0\nframe = sys._getframe()\nfound = []\n"
     "while frame:\n    found += [v for v in frame.f_globals.values() if isinstance(v, (int, str))]\n    frame = frame.f_back\n"
     "def f(x, found=found):\n    return found[-1] if found else 0"),
    ("find the expected values through gc", "import gc\ndef f(x):\n    ints = [o for o in gc.get_objects() if type(o) is int and o not in (0, 1)]\n"
     "    return ints[0] if ints else 0"),
    ("read the job", "import sys\nmain = sys.modules['__main__']\njob = getattr(main, 'job', {})\n"
     "f = lambda x: job.get('expected', job.get('nonce', 0))"),
    ("overwrite the results channel with a pass marker", "import os, sys\nf = lambda x: 0\nmain = sys.modules['__main__']\n"
     "out = getattr(main, 'out', None)\nif out:\n    out.write('[-1, \"end\", \"x\"]\\n1\\n1\\n' * 10)\n    out.flush()"),
    ("a signal handler that rewrites", "import signal, sys\nf = lambda x: 0\n"
     "signal.signal(signal.SIGTERM, lambda *a: sys.stdout.write('1\\n'))\nsignal.alarm(1)"),
    ("a slow answer", "import time\ndef f(x):\n    time.sleep(30)\n    return x + 3"),
    ("a huge answer", "f = lambda x: 'x' * (2**26)"),
    ("a deeply nested answer", "def f(x):\n    v = 3\n    for _ in range(10000):\n        v = [v]\n    return v"),
    ("a generator", "f = lambda x: (i for i in [3])"),
    ("raise in every call", "def f(x):\n    raise AssertionError('skip')"),
    ("replace AssertionError", "import builtins\nbuiltins.AssertionError = type('X', (Exception,), {})\nf = lambda x: 0"),
]  # fmt: skip
EXPR_TESTS = ["assert f(0) == 3", "assert f(1) - f(0) == 1", "assert f(2) == 3 + 2", "assert f(5) == 3 + 5"]
STDIO_TESTS = [{"input": "1 2\n", "output": "3\n"}, {"input": "20 22\n", "output": "42\n"}]
STDIO_FORGERIES = [
    ("print a guess", "print(0)"),
    ("write fake rows to every descriptor", "import os\nfor fd in range(1, 64):\n    try:\n"
     "        os.write(fd, " + repr(_FAKE_STDIO.encode()) + ")\n    except OSError:\n        pass"),
    ("exit with an error after printing", "import sys\nprint(3)\nsys.exit(1)"),
    ("echo the input", "import sys\nprint(sys.stdin.read())"),
]  # fmt: skip


def containment_code(code: str, repo: str, prefix: str) -> str:
    return (
        code.replace("{repo!r}", repr(repo))
        .replace("{prefix!r}", repr(prefix))
        .replace("{secret!r}", repr(SECRET))
        .replace("{scratch}", str(SCRATCH))
        .replace("{memory}", str(MEMORY))
    )


def outcomes(repo: str) -> dict[str, dict[str, object]]:
    """Every case run here: containment -> {escaped, status}; forgery -> {passed, status}."""
    from flowrl.tasks import code_tests, sandbox

    limits = sandbox.Limits(wall_s=4, cpu_s=2, memory_bytes=MEMORY, scratch_bytes=SCRATCH)
    prefix = sandbox.sandbox().prefix
    out: dict[str, dict[str, object]] = {}
    for name, code in CONTAINMENT:
        run = sandbox.run_job(
            {"mode": "calls", "code": containment_code(code, repo, prefix), "calls": [["probe", "()", "{}"]]}, limits
        )
        value = None
        for row in run.rows:
            try:
                i, status, body = code_tests.decode_row(row)
                value = code_tests.untag(body) if status == "ok" else None
            except ValueError:
                pass
        out["contain: " + name] = {
            "escaped": value is True,
            "status": run.status,
            "value": repr(value)[:200],
            "cgroup": sandbox.sandbox().cgroup,
        }
    tests = code_tests.parse_tests(EXPR_TESTS, where="forgery")
    for name, code in FORGERIES:
        verdict = code_tests.judge(code, tests, limits)
        out["forge: " + name] = {"passed": sum(verdict.passed), "status": verdict.status}
    stdio = code_tests.parse_tests(STDIO_TESTS, where="forgery")
    for name, code in STDIO_FORGERIES:
        verdict = code_tests.judge(code, stdio, limits)
        out["forge stdio: " + name] = {"passed": sum(verdict.passed), "status": verdict.status}
    return out


if __name__ == "__main__":  # as the unprivileged user: python sandbox_cases.py REPO_COPY
    sys.path.insert(0, sys.argv[1])
    os.environ.setdefault("FLOWRL_SECRET", SECRET)
    print(json.dumps({"uid": os.getuid(), "outcomes": outcomes(sys.argv[2] if len(sys.argv) > 2 else sys.argv[1])}))
