"""molt.agents.sandbox: what its docs promise, checked on the real bwrap for each kind of worker.

The sandbox takes one of three paths, chosen by who runs the worker: root with CAP_SYS_ADMIN (a dev box,
CI) runs bwrap without a user namespace; a non-root worker (the images' uid 1000) runs it in one; root
without CAP_SYS_ADMIN (a container run as root) starts bwrap as nobody, which then takes the user-namespace
path. This process is one of them. When it is root, the other two run too: a child worker dropped to that
identity with setpriv (and, where the interpreter sits under a directory only root may enter, such as
/root, a private mount namespace that makes that one directory enterable). Each worker runs the same
probes through ``run_python`` and reports them as JSON; the tests assert the promises on each report.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import pytest

from molt.agents import sandbox
from molt.agents.sandbox import SANDBOX_UID, bwrap_status, run_python
from tests.unit.test_agents_sandbox import _alive_with

ROOT = Path(__file__).resolve().parents[2]
needs_bwrap = pytest.mark.skipif(not bwrap_status()[0], reason=f"no OS sandbox on this host: {bwrap_status()[1]}")

SECRET = "sk-worker-secret-claims"
WORKER_UID = 1000  # the images' user (deploy/docker/*.Dockerfile)
# Docker's default capability set: what root in a container holds (no CAP_SYS_ADMIN).
CONTAINER_ROOT_CAPS = (
    "-all,+chown,+dac_override,+fsetid,+fowner,+mknod,+net_raw,+setgid,+setuid,+setfcap,+setpcap,"
    "+net_bind_service,+sys_chroot,+kill,+audit_write"
)
TMP_CAP = 4 << 20  # MOLT_SANDBOX_TMP_BYTES in the probes that size it

# What a worker runs in the sandbox to say who the tool's code is, as JSON.
IDENTITY_CODE = r"""
import json, os, socket
status = {}
try:
    status = dict(line.split(':', 1) for line in open('/proc/self/status').read().splitlines() if ':' in line)
except OSError:
    pass
try:
    os.setuid(0)
    setuid0 = 'allowed'
except OSError as e:
    setuid0 = type(e).__name__
try:
    userns = os.readlink('/proc/self/ns/user')
except OSError:
    userns = None
try:
    passwd = open('/etc/passwd').read()
except OSError as e:
    passwd = e.strerror
print(json.dumps({
    'uid': os.getuid(), 'euid': os.geteuid(), 'gid': os.getgid(), 'groups': os.getgroups(),
    'caps': {k: int(status[k].strip(), 16) for k in ('CapInh', 'CapPrm', 'CapEff', 'CapAmb') if k in status},
    'no_new_privs': int(status['NoNewPrivs'].strip()) if 'NoNewPrivs' in status else None,
    'setuid0': setuid0, 'userns': userns, 'interfaces': sorted(n for _, n in socket.if_nameindex()),
    'env': sorted(os.environ), 'passwd_has_nobody': 'nobody:' in passwd,
}))
"""

# The worker: each probe through run_python, one JSON report on the last line of stdout.
WORKER = r"""
import asyncio, json, os, sys, time, uuid
from pathlib import Path
from molt.agents import sandbox
from molt.agents.sandbox import run_python

IDENTITY_CODE, ROOT = sys.argv[1], sys.argv[2]

def alive(marker):
    found = []
    for entry in Path('/proc').iterdir():
        try:
            if entry.name.isdigit() and marker.encode() in (entry / 'cmdline').read_bytes():
                found.append(entry)
        except OSError:
            pass
    return found

def host_uid(entry):
    for line in (entry / 'status').read_text().splitlines():
        if line.startswith('Uid:'):
            return [int(u) for u in line.split()[1:]]

async def gone(marker, grace_s=3.0):
    deadline = time.monotonic() + grace_s
    while alive(marker):
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.05)
    return True

def sleeper(marker):
    return f"[sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}]"

async def main():
    out = {'euid': os.geteuid(), 'support': list(sandbox.bwrap_status()),
           'root_without_userns': sandbox._root_without_userns(), 'spawn_as': sandbox._spawn_as().get('user'),
           'worker_userns': os.readlink('/proc/self/ns/user')}
    if not out['support'][0]:
        print(json.dumps(out))
        return
    r = await run_python(IDENTITY_CODE)
    out['identity'] = json.loads(r.stdout) if r.ok else r.stderr

    # The sandbox's processes as the host sees them; then the call is cancelled (an episode timeout).
    marker = f'molt-claims-{uuid.uuid4().hex}'
    code = f'import subprocess, sys, time\nsubprocess.Popen({sleeper(marker)})\ntime.sleep(60)'
    task = asyncio.ensure_future(run_python(code, timeout_s=30))
    deadline, uids = time.monotonic() + 15, []
    while not uids and time.monotonic() < deadline and not task.done():
        await asyncio.sleep(0.05)
        uids = [host_uid(e) for e in alive(marker)]
    out['host_uids'] = uids
    task.cancel()
    try:
        await task
    except asyncio.CancelledError:
        pass
    out['gone_after_cancel'] = await gone(marker)

    places = ['/tmp/scratch', '/dev/shm/x', '/dev/x', '/etc/x', '/x', '/usr/x', f'{ROOT}/escape-{uuid.uuid4().hex}',
              f'{sys.prefix}/escape-{uuid.uuid4().hex}']
    code = ('import json\nout = {}\nfor p in %r:\n    try:\n        open(p, "w").write("x")\n'
            '        out[p] = "written"\n    except OSError as e:\n        out[p] = e.strerror\n'
            'print(json.dumps(out))') % places
    r = await run_python(code)
    out['writes'] = json.loads(r.stdout) if r.ok else r.stderr
    out['escaped'] = [p for p in places[1:] if os.path.exists(p)]

    r1 = await run_python("open('/tmp/left-behind', 'w').write('x')\nprint('wrote')")
    r2 = await run_python("import os\nprint(os.path.exists('/tmp/left-behind'), sorted(os.listdir('/tmp')))")
    out['scratch_next_call'] = [r1.stdout, r2.stdout]

    os.environ.update(MOLT_SANDBOX_MAX_PROCS='8', MOLT_SANDBOX_TMP_BYTES=str(%(tmp_cap)d))
    code = ('import json, resource\nprint(json.dumps({n: resource.getrlimit(getattr(resource, "RLIMIT_" + n))'
            ' for n in ("AS", "CPU", "FSIZE", "NPROC", "CORE")}))')
    r = await run_python(code, timeout_s=5, mem_bytes=512 << 20)
    out['rlimits'] = json.loads(r.stdout) if r.ok else r.stderr

    marker = f'molt-claims-bomb-{uuid.uuid4().hex}'
    code = ('import os, sys\nn = 0\ntry:\n    for _ in range(200):\n        if os.fork() == 0:\n'
            f'            os.execv(sys.executable, {sleeper(marker)})\n'
            "        n += 1\nexcept OSError as e:\n    print('refused after', n, e.strerror)")
    r = await run_python(code, timeout_s=20)
    out['fork_bomb'] = [r.stdout, r.stderr]
    out['bomb_gone'] = await gone(marker)

    code = ("import os\ns = os.statvfs('/tmp')\nprint(s.f_blocks * s.f_frsize, flush=True)\n"
            "open('a', 'wb').write(b'a' * (3 << 20))\nprint('first file written', flush=True)\n"
            "open('b', 'wb').write(b'b' * (3 << 20))\nprint('second file written')")
    r = await run_python(code)
    out['tmp_cap'] = {'stdout': r.stdout, 'exit_code': r.exit_code, 'observation': r.as_observation()}
    out['after_tmp_cap'] = (await run_python('print(6 * 7)')).stdout
    print(json.dumps(out))

asyncio.run(main())
""".replace("%(tmp_cap)d", str(TMP_CAP))


def _have(*tools: str) -> bool:
    return all(shutil.which(t) for t in tools)


def _userns_allowed_for_non_root() -> bool:
    """Whether this kernel lets an unprivileged user create user namespaces (what the two dropped paths need)."""
    for knob, refuses in (
        ("/proc/sys/user/max_user_namespaces", lambda v: v == "0"),
        ("/proc/sys/kernel/unprivileged_userns_clone", lambda v: v == "0"),
        ("/proc/sys/kernel/apparmor_restrict_unprivileged_userns", lambda v: v == "1"),
    ):
        try:
            if refuses(Path(knob).read_text().strip()):
                return False
        except OSError:
            pass
    return True


def _hidden_dirs() -> dict[str, set[str]] | None:
    """Directories only their owner may enter on the way to what a dropped worker needs (the interpreter, the
    venv, the checkout, bwrap): dir -> the entries it must reach in it. None: a layout this harness cannot open."""
    needed = [sys.executable, sys.prefix, sys.base_prefix, str(ROOT), sandbox.bwrap_binary() or "/"]
    hidden: dict[str, set[str]] = {}
    for path in {os.path.realpath(p) for p in needed}:
        parts = Path(path).parts
        dirs = [Path(*parts[: i + 1]) for i in range(len(parts)) if Path(*parts[: i + 1]).is_dir()]
        blocked = [d for d in dirs if not d.stat().st_mode & 0o001]
        if not blocked:
            continue
        if len(blocked) > 1 or blocked[0] == Path(path):
            return None
        child = blocked[0] / parts[len(blocked[0].parts)]
        if not child.is_dir():
            return None
        hidden.setdefault(str(blocked[0]), set()).add(str(child))
    return hidden


def _as_identity(identity: str, hold: Path) -> list[str]:
    """The command prefix that runs a worker as ``identity`` (skips when this host cannot)."""
    if identity == "this worker":
        return []
    if os.geteuid() != 0:
        pytest.skip(f"{identity}: only a root test run can drop to another identity")
    if not _have("setpriv", "unshare", "mount"):
        pytest.skip(f"{identity}: needs setpriv, unshare and mount (util-linux)")
    hidden = _hidden_dirs()
    if hidden is None:
        pytest.skip(
            f"{identity}: the interpreter's directories are closed to other users in a way this test cannot open"
        )
    if identity == "non-root worker (uid 1000)":
        drop = ["setpriv", f"--reuid={WORKER_UID}", f"--regid={WORKER_UID}", "--clear-groups"]
    else:
        drop = ["setpriv", f"--bounding-set={CONTAINER_ROOT_CAPS}", "--inh-caps=-all"]
    if not hidden:
        return drop
    if not sandbox._root_without_userns():
        pytest.skip(f"{identity}: {sorted(hidden)} is closed to other users and this root may not mount over it")
    # Bind each needed entry aside, cover the closed directory with an enterable tmpfs, bind the entries back.
    script, n = ["set -eu"], 0
    for d, children in sorted(hidden.items()):
        for child in sorted(children):
            (hold / str(n)).mkdir(parents=True)
            script.append(f"mount --bind '{child}' '{hold / str(n)}'")
            n += 1
        script.append(f"mount -t tmpfs -o mode=0755 tmpfs '{d}'")
        for i, child in enumerate(sorted(children), start=n - len(children)):
            script += [f"mkdir -p '{child}'", f"mount --bind '{hold / str(i)}' '{child}'"]
    script.append('exec "$@"')
    return ["unshare", "--mount", "--propagation", "private", "sh", "-c", "\n".join(script), "sh", *drop]


def _worker_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith(("MOLT_SANDBOX", "PYTHON_EXECUTOR"))}
    env.update(MOLT_GATEWAY__API_KEY=SECRET, HOME="/tmp", PYTHONPATH=str(ROOT), PYTHONDONTWRITEBYTECODE="1")
    return env


IDENTITIES = ["this worker", "non-root worker (uid 1000)", "root worker without CAP_SYS_ADMIN (container)"]


@pytest.fixture(scope="module", params=IDENTITIES)
def report(request, tmp_path_factory):
    """One worker of this identity runs every probe; its JSON report."""
    if not bwrap_status()[0]:
        pytest.skip(f"no OS sandbox on this host: {bwrap_status()[1]}")
    identity = request.param
    prefix = _as_identity(identity, tmp_path_factory.mktemp("hold"))
    done = subprocess.run(
        [*prefix, sys.executable, "-c", WORKER, IDENTITY_CODE, str(ROOT)],
        cwd="/",
        env=_worker_env(),
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0 and done.stdout.strip(), (done.stdout[-2000:], done.stderr[-4000:])
    out = json.loads(done.stdout.strip().splitlines()[-1])
    out["name"] = identity
    if identity != "this worker" and not out["support"][0] and not _userns_allowed_for_non_root():
        pytest.skip(f"{identity}: this kernel refuses unprivileged user namespaces ({out['support'][1]})")
    assert out["support"][0], f"{identity}: the sandbox does not start: {out['support'][1]}"
    return out


def _expected_path(r: dict) -> str:
    if r["root_without_userns"]:
        return "no user namespace"
    return "user namespace, bwrap started as nobody" if r["euid"] == 0 else "user namespace"


def test_each_kind_of_worker_takes_its_documented_path(report):
    """Root with CAP_SYS_ADMIN: no user namespace; non-root: a user namespace; root without CAP_SYS_ADMIN (a
    container run as root): bwrap started as nobody, in a user namespace."""
    expected = {
        "non-root worker (uid 1000)": "user namespace",
        "root worker without CAP_SYS_ADMIN (container)": "user namespace, bwrap started as nobody",
    }.get(report["name"], _expected_path(report))
    assert _expected_path(report) == expected
    assert report["spawn_as"] == (SANDBOX_UID if expected.endswith("as nobody") else None)
    ident = report["identity"]
    if report["support"][2]:  # the sandbox has a /proc: its user namespace is visible
        in_worker_ns = ident["userns"] == report["worker_userns"]
        assert in_worker_ns == (expected == "no user namespace"), (ident["userns"], report["worker_userns"])


def test_tool_code_runs_as_nobody_without_capabilities_and_cannot_regain_root(report):
    ident = report["identity"]
    assert isinstance(ident, dict), ident
    assert (ident["uid"], ident["euid"], ident["gid"]) == (SANDBOX_UID, SANDBOX_UID, SANDBOX_UID)
    assert set(ident["groups"]) <= {SANDBOX_UID}
    assert ident["setuid0"] != "allowed"  # EPERM without a user namespace, EINVAL (uid 0 unmapped) in one
    if report["support"][2]:
        caps = ident["caps"]
        assert (caps["CapPrm"], caps["CapEff"], caps["CapAmb"]) == (0, 0, 0), caps
        # Without a user namespace, bwrap leaves CAP_SETUID/CAP_SETGID in the inheritable set; with no_new_privs
        # (and nosuid binds) no exec can turn them, or a setuid-root binary, back into a capability.
        assert caps["CapInh"] & ~(1 << 6 | 1 << 7) == 0, caps
        assert ident["no_new_privs"] == 1


def test_the_host_sees_the_tool_code_as_an_unprivileged_uid_never_root(report):
    """What the kernel checks for file rights and RLIMIT_NPROC: the host uid of the sandbox's processes."""
    assert report["host_uids"], "the sandbox's process was never seen"
    expected = WORKER_UID if report["name"] == "non-root worker (uid 1000)" else SANDBOX_UID
    if report["name"] == "this worker" and os.geteuid() != 0:
        expected = os.geteuid()  # a user namespace of this user
    for uids in report["host_uids"]:
        assert 0 not in uids and set(uids) == {expected}, uids


def test_cancelling_the_call_kills_the_sandbox_tree(report):
    """An episode timeout cancels the tool call: nothing the sandbox started outlives it."""
    assert report["gone_after_cancel"]


def test_only_the_size_capped_tmp_is_writable(report):
    """/tmp is the only writable place: not /dev (so no /dev/shm beside the capped /tmp), /etc, /, /usr, the
    checkout or the venv; /etc's bound files stay readable for nobody."""
    writes = report["writes"]
    assert isinstance(writes, dict), writes
    assert writes.pop("/tmp/scratch") == "written"
    # A checkout or venv under /tmp (a CI clone) is bound inside the sandbox's /tmp tmpfs, whose directories
    # above the bind are the sandbox's own: a write there lands in the capped tmpfs (``escaped`` checks the host).
    inside_tmp = {p for p, why in writes.items() if p.startswith("/tmp/") and why == "written"}
    assert all(
        why in ("Read-only file system", "Permission denied", "No such file or directory")
        for p, why in writes.items()
        if p not in inside_tmp
    ), writes
    assert report["escaped"] == []
    assert report["identity"]["passwd_has_nobody"]


def test_the_scratch_dir_is_gone_after_the_call(report):
    wrote, next_call = report["scratch_next_call"]
    # (the listing may show the directory a bind under /tmp needs, as above; never the file left behind)
    assert wrote == "wrote\n" and next_call.startswith("False [") and "left-behind" not in next_call


def test_the_documented_rlimits_are_set(report):
    """RLIMIT_AS soft = PYTHON_EXECUTOR_MEM_BYTES, hard 1.5x; RLIMIT_CPU from the timeout; RLIMIT_FSIZE 64 MiB or
    the tmpfs size if smaller; RLIMIT_NPROC = MOLT_SANDBOX_MAX_PROCS; no core files."""
    assert report["rlimits"] == {
        "AS": [512 << 20, 768 << 20],
        "CPU": [6, 7],
        "FSIZE": [TMP_CAP, TMP_CAP],
        "NPROC": [8, 8],
        "CORE": [0, 0],
    }


def test_a_fork_bomb_stops_at_max_procs_and_its_processes_die_with_the_call(report):
    stdout, stderr = report["fork_bomb"]
    assert stdout.startswith("refused after") and int(stdout.split()[2]) < 8, (stdout, stderr)
    assert report["bomb_gone"]


def test_writing_past_MOLT_SANDBOX_TMP_BYTES_fails_in_the_sandbox_and_the_worker_carries_on(report):
    """The tmpfs holds MOLT_SANDBOX_TMP_BYTES: the write past it fails with ENOSPC inside the sandbox, the tool
    call returns that error as its observation, and the next call in the same worker runs."""
    cap = report["tmp_cap"]
    size, first, *rest = cap["stdout"].splitlines()
    assert int(size) == TMP_CAP and first == "first file written" and rest == []
    assert cap["exit_code"] == 1
    assert "OSError: [Errno 28] No space left on device" in cap["observation"]
    assert report["after_tmp_cap"] == "42\n"


def test_the_environment_is_cleared_and_the_network_is_loopback_only(report):
    ident = report["identity"]
    assert set(ident["env"]) <= {*sandbox._CHILD_ENV, "PWD"}, ident["env"]
    assert SECRET not in json.dumps(ident)
    assert ident["interfaces"] == ["lo"]


# --- in this process only -------------------------------------------------------------------------------------


@needs_bwrap
async def test_the_default_tmp_is_64_mib():
    r = await run_python("import os\ns = os.statvfs('/tmp')\nprint(s.f_blocks * s.f_frsize)")
    assert r.stdout == f"{64 << 20}\n", r.stderr


@pytest.mark.parametrize("bad", ["64M", "0", "-1", "1.5", "nan", "inf", "1e30"])
async def test_a_bad_MOLT_SANDBOX_TMP_BYTES_is_refused_naming_the_variable(monkeypatch, bad):
    """0 would be an uncapped tmpfs, a negative or huge value a bwrap error that names nothing."""
    monkeypatch.setenv("MOLT_SANDBOX_TMP_BYTES", bad)
    with pytest.raises(ValueError, match=f"MOLT_SANDBOX_TMP_BYTES='{bad}'"):
        await run_python("print(1)")


@pytest.mark.parametrize(
    ("name", "bad"),
    [
        ("MOLT_SANDBOX_MAX_PROCS", "0"),  # 0 and -1 would lift RLIMIT_NPROC altogether
        ("MOLT_SANDBOX_MAX_PROCS", "-1"),
        ("PYTHON_EXECUTOR_MEM_BYTES", "-1"),
        ("PYTHON_EXECUTOR_TIMEOUT", "0"),
        ("PYTHON_EXECUTOR_OUTPUT_CHARS", "lots"),
    ],
)
async def test_other_bad_limits_are_refused_naming_the_variable(monkeypatch, name, bad):
    monkeypatch.setenv(name, bad)
    with pytest.raises(ValueError, match=f"{name}='{bad}'"):
        await run_python("print(1)")


@needs_bwrap
async def test_a_fractional_timeout_from_the_environment_is_kept(monkeypatch):
    monkeypatch.setenv("PYTHON_EXECUTOR_TIMEOUT", "1.5")
    r = await run_python("import time\ntime.sleep(30)")
    assert r.timed_out and r.exit_code is None


@needs_bwrap
async def test_stderr_is_cut_to_the_output_limit_too(monkeypatch):
    monkeypatch.setenv("PYTHON_EXECUTOR_OUTPUT_CHARS", "100")
    r = await run_python("import sys\nsys.stderr.write('e' * 100000)")
    assert r.truncated and r.stderr.startswith("e" * 100) and len(r.stderr) < 150


@needs_bwrap
def test_a_worker_that_dies_takes_its_sandboxes_with_it():
    """--die-with-parent: a worker killed outright (OOM, SIGKILL) leaves no tool code running."""
    marker = f"molt-claims-orphan-{uuid.uuid4().hex}"
    code = (
        "import subprocess, sys, time\n"
        f"subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)', {marker!r}])\ntime.sleep(60)"
    )
    worker = subprocess.Popen(
        [
            sys.executable,
            "-c",
            f"import asyncio\nfrom molt.agents.sandbox import run_python\n"
            f"asyncio.run(run_python({code!r}, timeout_s=60))",
        ],
        cwd=ROOT,
        env=_worker_env(),
    )
    try:
        deadline = time.monotonic() + 30
        while not _alive_with(marker):
            assert time.monotonic() < deadline and worker.poll() is None, "the sandbox never started"
            time.sleep(0.05)
    finally:
        os.kill(worker.pid, signal.SIGKILL)
        worker.wait()
    deadline = time.monotonic() + 5
    while _alive_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert _alive_with(marker) == []


@pytest.mark.skipif(os.geteuid() != 0 or not _have("setpriv"), reason="needs a root test run and setpriv")
def test_a_root_worker_that_cannot_become_nobody_is_refused_naming_what_it_lacks():
    """Root without CAP_SYS_ADMIN and without CAP_SETUID/CAP_SETGID/CAP_KILL (capabilities all dropped) cannot
    start bwrap as nobody: the sandbox is unavailable, and the reason names those capabilities."""
    code = "from molt.agents.sandbox import bwrap_status\nprint(repr(bwrap_status()))"
    done = subprocess.run(
        [
            "setpriv",
            "--bounding-set=-all,+dac_override,+dac_read_search",
            "--inh-caps=-all",
            sys.executable,
            "-c",
            code,
        ],
        cwd=ROOT,
        env=_worker_env(),
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert "ok=False" in done.stdout and "CAP_KILL, CAP_SETGID, CAP_SETUID" in done.stdout, done.stdout
