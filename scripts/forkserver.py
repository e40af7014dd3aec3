"""Run many short Python commands without paying torch's and transformers' import in every one.

scripts/gpu_check.sh's dry run on a CPU (tests/test_benchmarks.py) runs some twenty ``python -m quantplan ...``
steps, each a job on a tiny model that takes well under a second: most of each step's time was the import of torch,
transformers and quantplan (4-5 s of CPU each). The server imports them once and forks a child for every command; the
child is a fresh copy of that process (nothing one command does is seen by the next), runs the command as
``python`` would (``-m module``, ``-c code`` or a script path, with its arguments), with the client's working
folder, environment, standard streams and exit status::

    python scripts/forkserver.py serve SOCKET &       # imports, then answers one command at a time
    python scripts/forkserver.py run SOCKET -m quantplan jobs   # what `python -m quantplan jobs` does

The client waits for the server to listen (its imports take seconds) and fails, saying so, when it does not.
Environment variables a library reads when it is imported are the server's: start it with the commands' environment.
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import socket
import struct
import sys
import time
import traceback

WAIT_S = 300  # how long a client waits for the server to listen (it is importing torch on a busy machine)
PRELOAD = ("torch", "transformers", "transformers.models.llama.modeling_llama", "quantplan.cli.main")


def serve(path: str) -> int:
    try:
        for name in PRELOAD:
            __import__(name)
    except BaseException:  # said to every client (else each would wait WAIT_S for a server that is gone)
        with open(path + ".failed", "w") as out:
            out.write(traceback.format_exc())
        raise
    parent = os.getppid()
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # a client connects only once the server listens
    server.listen(1)
    server.settimeout(1.0)
    try:
        while os.getppid() == parent:  # the script that started it is gone: so is the server
            try:
                conn, _ = server.accept()
            except TimeoutError:
                continue
            with conn:
                conn.settimeout(None)
                _answer(conn, server)
    finally:
        server.close()
        if os.path.exists(path):
            os.unlink(path)
    return 0


def _answer(conn: socket.socket, server: socket.socket) -> None:
    msg, fds, _, _ = socket.recv_fds(conn, 1 << 16, 3)  # the streams come with the first bytes
    while chunk := conn.recv(1 << 16):  # the rest of the request, to the client's end of writing
        msg += chunk
    if len(fds) != 3:
        for fd in fds:
            os.close(fd)
        conn.sendall(struct.pack("!i", 2))
        return
    request = json.loads(msg)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        server.close()
        conn.close()
        for target, fd in enumerate(fds):
            os.dup2(fd, target)
            os.close(fd)
        os._exit(_run(request["argv"], request["env"], request["cwd"]))
    for fd in fds:
        os.close(fd)
    _, status = os.waitpid(pid, 0)
    conn.sendall(struct.pack("!i", os.waitstatus_to_exitcode(status)))


def _run(argv: list[str], env: dict[str, str], cwd: str) -> int:
    """``python ARGV`` in this (forked) process: its exit status."""
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    code = 0
    try:
        if argv[0] == "-m":
            sys.argv = [argv[1], *argv[2:]]
            sys.path.insert(0, cwd)
            runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
        elif argv[0] == "-c":
            sys.argv = ["-c", *argv[2:]]
            sys.path.insert(0, "")
            exec(compile(argv[1], "<string>", "exec"), {"__name__": "__main__"})
        else:
            sys.argv = list(argv)
            sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as stop:
        if stop.code is None:
            code = 0
        elif isinstance(stop.code, int):
            code = stop.code
        else:
            print(stop.code, file=sys.stderr)
            code = 1
    except BaseException:
        traceback.print_exc()
        code = 1
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def run(path: str, argv: list[str]) -> int:
    deadline = time.monotonic() + WAIT_S
    while not os.path.exists(path):
        if os.path.exists(path + ".failed"):
            with open(path + ".failed") as failed:
                print(f"forkserver: the server failed to start:\n{failed.read()}", file=sys.stderr)
            return 2
        if time.monotonic() > deadline:
            print(f"forkserver: nothing listens on {path} after {WAIT_S} s", file=sys.stderr)
            return 2
        time.sleep(0.1)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
        conn.connect(path)
        msg = json.dumps({"argv": argv, "env": dict(os.environ), "cwd": os.getcwd()}).encode()
        socket.send_fds(conn, [msg], [0, 1, 2])
        conn.shutdown(socket.SHUT_WR)
        reply = b""
        while len(reply) < 4:
            chunk = conn.recv(4 - len(reply))
            if not chunk:
                print("forkserver: the server closed the connection without an exit status", file=sys.stderr)
                return 2
            reply += chunk
    return int(struct.unpack("!i", reply)[0])


def main(args: list[str]) -> int:
    if len(args) == 2 and args[0] == "serve":
        return serve(args[1])
    if len(args) >= 3 and args[0] == "run" and (args[2] not in ("-m", "-c") or len(args) >= 4):
        return run(args[1], args[2:])
    print("usage: forkserver.py serve SOCKET | run SOCKET (-m MODULE | -c CODE | SCRIPT) [ARG ...]", file=sys.stderr)
    return 2


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
