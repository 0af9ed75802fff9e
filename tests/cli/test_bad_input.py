"""Every number, path and file a user gives, tried wrong through the real ``taskd`` command.

Each ends at once with exit code 2 and one true line on stderr, never a
traceback: bounds on counts (the wire's int32, a sane number of workers) and
durations (a day), signals nobody can catch, files that are not UTF-8 or not
PEM, directories that do not exist or cannot be written, hosts that do not
resolve, tokens gRPC cannot send, and no temporary directory at all.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT

#: Ceiling of one command's run; each ends in well under a second when it refuses its input at once.
TIMEOUT = 60.0


def taskd(
    *argv: str, env: dict[str, str] | None = None, mounts: str = "", program: str | None = None
) -> subprocess.CompletedProcess[str]:
    """``python -m taskd_core ARGV`` (or ``program ARGV``) as a user runs it; ``mounts``: shell commands
    run first in a private mount namespace (as root), to make directories read-only for the command alone."""
    command = [*([program] if program else [sys.executable, "-m", "taskd_core"]), *argv]
    if mounts:
        script = f"{mounts} && exec {shlex.join(command)}"
        command = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script]
    return subprocess.run(
        command,
        capture_output=True,
        text=True,
        timeout=TIMEOUT,
        cwd=ROOT,
        env={**os.environ, **(env or {})},
    )


def refused(done: subprocess.CompletedProcess[str], message: str) -> None:
    """Exit 2, no traceback, and ``message`` in the last line of stderr."""
    assert done.returncode == 2, done.stderr[-3000:]
    assert "Traceback" not in done.stderr, done.stderr[-3000:]
    assert message in done.stderr.strip().splitlines()[-1], done.stderr[-3000:]


@pytest.fixture(scope="module")
def private_mounts() -> None:
    """Skip unless this process may make mount namespaces (root with CAP_SYS_ADMIN and unshare)."""
    if shutil.which("unshare") is None or os.geteuid() != 0:
        pytest.skip("needs root and unshare(1) to make a directory read-only for one command")
    done = subprocess.run(
        [
            "unshare",
            "--mount",
            "--propagation",
            "private",
            "mount",
            "-t",
            "tmpfs",
            "-o",
            "ro",
            "none",
            "/mnt",
        ],
        capture_output=True,
        timeout=TIMEOUT,
    )
    if done.returncode != 0:
        pytest.skip(f"cannot make a private mount namespace here: {done.stderr.decode(errors='replace')}")


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (
            ["run", "--nproc", "1000000000", "--", "true"],
            "--nproc/--nproc-per-node: '1000000000' is more than 1024",
        ),
        (["run", "--nnodes", "99999999", "--", "true"], "--nnodes: '99999999' is more than 65536"),
        (
            ["run", "--max-cycles", "99999999999", "--", "true"],
            "--max-cycles: '99999999999' is more than 2147483647",
        ),
        (
            ["run", "--stop-timeout", "1e308", "--", "true"],
            "--stop-timeout: '1e308' is more than 86400 seconds (a day)",
        ),
        (
            ["run", "--hang-ceiling", "1e308", "--", "true"],
            "--hang-ceiling: '1e308' is more than 86400 seconds",
        ),
        (["run", "--dump-signal", "KILL", "--", "true"], "--dump-signal: SIGKILL cannot be caught"),
        (["run", "--dump-signal", "19", "--", "true"], "--dump-signal: SIGSTOP cannot be caught"),
        (
            ["controller", "--max-cycles", "99999999999"],
            "--max-cycles: '99999999999' is more than 2147483647",
        ),
        (["controller", "--report-timeout", "1e308"], "--report-timeout: '1e308' is more than 86400 seconds"),
        (["controller", "--keepalive-interval", "1e308"], "--keepalive-interval: '1e308' is more than 86400"),
        (["status", "--timeout", "1e308"], "--timeout: '1e308' is more than 86400 seconds"),
        (["events", "j", "--after", "99999999999999999999"], "--after: '99999999999999999999' is more than"),
        (["status", "--controller", "::::"], "--controller: controller address: '::::' is not HOST:PORT"),
    ],
)
def test_numbers_past_their_bounds_are_usage_errors(argv: list[str], message: str) -> None:
    refused(taskd(*argv), message)


def test_the_interval_of_events_is_a_finite_number_of_seconds(controller) -> None:
    refused(
        taskd("events", "j", "--controller", controller.address, "--interval", "nan"),
        "--interval must be a positive number of seconds up to 86400 (a day), not nan",
    )


def test_a_log_dir_under_a_file_is_refused_before_any_worker_starts(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("")
    refused(
        taskd("run", "--log-dir", str(tmp_path / "file" / "logs"), "--", "true"),
        f"{tmp_path / 'file'} is a file, not a directory",
    )


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (
            b"[defaults]\nmax_cycles = 1 # \xff\xfe\n",
            "not UTF-8 text (byte 28 is 0xff); TOML files are UTF-8",
        ),
        (b"[defaults]\nmax_cycles = 99999999999\n", "[defaults] max_cycles: must be at most 2147483647"),
        (b"[defaults]\nreport_timeout = 1e308\n", "[defaults] report_timeout: must be at most 86400 seconds"),
    ],
)
def test_a_bad_policy_file_is_one_line(tmp_path: Path, content: bytes, message: str) -> None:
    (tmp_path / "policy.toml").write_bytes(content)
    refused(
        taskd(
            "controller",
            "--state",
            ":memory:",
            "--listen",
            "127.0.0.1:0",
            "--policy",
            str(tmp_path / "policy.toml"),
        ),
        message,
    )


def test_a_port_file_in_a_missing_directory_is_refused_before_serving(tmp_path: Path) -> None:
    port_file = tmp_path / "no" / "such" / "port"
    refused(
        taskd("controller", "--state", ":memory:", "--listen", "127.0.0.1:0", "--port-file", str(port_file)),
        f"--port-file {port_file}: directory {port_file.parent} does not exist; create it first",
    )


def test_bad_tls_material_says_which_file_and_why(tmp_path: Path, pki) -> None:
    junk = tmp_path / "junk.pem"
    junk.write_text("not a certificate\n")
    base = ["controller", "--state", ":memory:", "--listen", "127.0.0.1:0"]
    refused(
        taskd(*base, "--tls-cert", str(junk), "--tls-key", pki.server_key),
        f"TLS certificate {junk}: no PEM certificate in it; check --tls-cert",
    )
    refused(
        taskd(*base, "--tls-cert", pki.server_cert, "--tls-key", str(junk)),
        f"TLS key {junk}: not the unencrypted PEM private key of {pki.server_cert}; check --tls-key",
    )
    refused(
        taskd(
            *base, "--tls-cert", pki.server_cert, "--tls-key", pki.server_key, "--tls-client-ca", str(junk)
        ),
        f"TLS client CA {junk}: no PEM certificate in it",
    )


def test_listen_addresses_that_cannot_be_bound_say_why(controller) -> None:
    refused(
        taskd("controller", "--state", ":memory:", "--insecure", "--listen", "no-such-host.invalid:0"),
        "--listen no-such-host.invalid:0: cannot resolve 'no-such-host.invalid'",
    )
    refused(
        taskd("controller", "--state", ":memory:", "--insecure", "--listen", "192.0.2.254:0"),
        "cannot bind on 192.0.2.254 (not an address of this machine",
    )
    refused(
        taskd("controller", "--state", ":memory:", "--listen", controller.address),
        "cannot bind on 127.0.0.1 (the port is in use; pick a free port)",
    )


@pytest.mark.parametrize("argv", [["run", "--", "true"], ["status"]])
def test_a_token_grpc_cannot_send_is_refused_at_once(argv: list[str], controller) -> None:
    """gRPC metadata is ASCII: a non-ASCII token would only fail deep in gRPC's C core, again and again."""
    done = taskd(
        *argv,
        *(["--controller", controller.address] if argv == ["status"] else []),
        env={"TASKD_JOB_TOKEN": "tökén"},
    )
    refused(done, "TASKD_JOB_TOKEN: must be printable ASCII without spaces")


def test_no_usable_temporary_directory_is_one_line(private_mounts: None) -> None:
    # Read-only binds rather than empty mounts: the checkout (and its venv) may itself live under /tmp.
    mounts = "mount --bind -o ro /tmp /tmp && mount --bind -o ro /var/tmp /var/tmp && cd /tmp"
    done = taskd("run", "--", "true", env={"TMPDIR": "/nonexistent"}, mounts=mounts)
    refused(done, "no usable temporary directory: TMPDIR='/nonexistent' is not a writable directory")
    # taskdrun: torch's own import needs one (dill makes a temporary file when imported).
    taskdrun = str(Path(sys.executable).with_name("taskdrun"))
    done = taskd(
        "--nproc-per-node=1", "x.py", env={"TMPDIR": "/nonexistent"}, mounts=mounts, program=taskdrun
    )
    refused(
        done, "taskdrun: no usable temporary directory: TMPDIR='/nonexistent' is not a writable directory"
    )


def test_read_only_state_files_say_what_is_wrong_and_what_to_do(tmp_path: Path, private_mounts: None) -> None:
    """A state directory mounted read-only (as another user's would be): refused before anything runs."""
    state_dir = tmp_path / "state"
    state_dir.mkdir()
    (state_dir / "s.db").write_bytes(b"")
    mounts = f"mount --bind -o ro {shlex.quote(str(state_dir))} {shlex.quote(str(state_dir))}"
    state = str(state_dir / "s.db")
    refused(
        taskd("controller", "--listen", "127.0.0.1:0", "--state", state, mounts=mounts),
        f"--state {state}: directory {state_dir} is not writable by this process",
    )
    refused(
        taskd("run", "--controller-state", state, "--", "true", mounts=mounts),
        f"--controller-state {state}: directory {state_dir} is not writable by this process",
    )
    file_mount = f"mount --bind -o ro {shlex.quote(state)} {shlex.quote(state)}"
    refused(
        taskd("controller", "--listen", "127.0.0.1:0", "--state", state, mounts=file_mount),
        f"--state {state}: the file is not writable by this process",
    )


@pytest.mark.parametrize(
    "argv", [["controller", "--listen", "127.0.0.1:0", "--state", ":memory:"], ["status"]]
)
def test_a_token_file_other_users_may_read_is_refused_with_the_chmod_to_run(tmp_path: Path, argv) -> None:
    token = tmp_path / "admin.token"
    token.write_text("the-admin\n")
    token.chmod(0o644)
    refused(taskd(*argv, "--admin-token-file", str(token)), f"run chmod 600 {token}")
