"""Run by test_terminal_nonroot.py as an unprivileged user: exercises the sandbox's non-root
mechanisms and prints what happened as JSON."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
import tempfile

from miles_env_terminal.sandbox import Sandbox, SandboxLimits


def main() -> None:
    disabled = json.loads(sys.argv[1])
    limits = SandboxLimits(
        wall_s=4, cpu_s=1, memory_mb=256, max_processes=16, disable_layers=disabled
    )
    out: dict[str, object] = {"uid": os.getuid()}
    # a unix listener of this same user (an ssh agent, a session bus): the sandbox runs as
    # this uid, so only the sandbox's own rules keep it from connecting
    folder = tempfile.mkdtemp(prefix="miles-nonroot-")
    os.chmod(folder, 0o755)
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(os.path.join(folder, "x.sock"))
    listener.listen(4)
    listener.setblocking(False)
    unix = f"import socket; socket.socket(socket.AF_UNIX).connect({folder + '/x.sock'!r})"
    with Sandbox(limits) as sb:
        out["mechanisms"] = sb.mechanisms
        out["warnings"] = sb.warnings
        runs = {
            "bomb": ":(){ :|:& };:",
            "pyfork": "python3 -c 'import os\nwhile True: os.fork()'",
            "network": "python3 -c \"import socket; socket.create_connection(('127.0.0.1', 80))\"",
            "outside": "echo x > /tmp/miles_terminal_nonroot_escape",
            "kill_caller": f"kill -9 {os.getpid()}",
            "background": "setsid sleep 300 & echo ok",
            "ok": "echo hi > f && cat f",
            "unix": f'python3 -c "{unix}"',
            "dev": "ls /dev/shm",
        }
        for name, command in runs.items():
            r = sb.run(command)
            out[name] = {"exit": r.exit_code, "violations": r.violations, "stdout": r.stdout}
    left = []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and entry != str(os.getpid()):
            try:
                if os.stat(f"/proc/{entry}").st_uid == os.getuid():
                    with open(f"/proc/{entry}/cmdline", "rb") as fh:
                        left.append(fh.read().decode(errors="replace"))
            except OSError:
                pass
    out["left"] = left
    out["escaped"] = os.path.exists("/tmp/miles_terminal_nonroot_escape")
    try:
        listener.accept()[0].close()
        out["unix_connected"] = True
    except BlockingIOError:
        out["unix_connected"] = False
    listener.close()
    shutil.rmtree(folder, ignore_errors=True)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
