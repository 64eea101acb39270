"""Runs ``python -m shared.cli ARGS`` in a fresh process per command, forked from a process that
has already imported what the CLI imports (torch alone takes ~2 of the ~3 s each start costs on
a 2-core machine, and the CLI tests run about 200 commands).

Each command is a child of this process: its own pid, working folder, environment, stdin from
/dev/null, stdout and stderr to files, ``shared/cli.py`` itself executed afresh as ``__main__``
(so what it reads from the environment at import, e.g. ``DELTASYNC_DEBUG``, is the command's),
and its exit the interpreter's own (a traceback and status 1 for an uncaught exception, threads
joined, atexit handlers run) up to the teardown of modules, which it skips.
What differs from a cold start: modules the CLI imports stay imported (and numba's kernels
loaded, see :func:`_warm`), so anything *they* read from the environment at import time (huggingface_hub's endpoint) comes from this process's
environment, which the caller sets when it starts it.

Protocol: one JSON request per line on stdin (argv, cwd, env, stdout, stderr: paths); back on
stdout, ``{"pid": N}`` once the child runs and ``{"code": N}`` when it has exited.
"""

from __future__ import annotations

import atexit
import contextlib
import io
import json
import os
import runpy
import sys
import tempfile


def _run(request: dict) -> None:
    """In the child: become the command, run it, exit."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    out = os.open(request["stdout"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    err = os.open(request["stderr"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC)
    for fd, target in ((null, 0), (out, 1), (err, 2)):
        os.dup2(fd, target)
        os.close(fd)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8")
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8",
                                  errors="backslashreplace", line_buffering=True)
    sys.argv = ["-m", *request["argv"]]
    status = [0]
    # Registered first, so it runs last: after the interpreter has printed an uncaught error,
    # joined the non-daemon threads and run every other atexit handler, exit with the status it
    # would give, skipping only the teardown of modules (1.5 s here with torch imported).
    atexit.register(lambda: (sys.stdout.flush(), sys.stderr.flush(), os._exit(status[0])))
    try:
        runpy.run_module("shared.cli", run_name="__main__", alter_sys=True)
    except SystemExit as e:
        status[0] = e.code if isinstance(e.code, int) else int(e.code is not None)
        raise
    except BaseException:
        status[0] = 1
        raise
    raise SystemExit(0)


def _warm(cli) -> None:
    """Run a diff, an apply, two pushes and a pull of a small bf16 + fp32 state here, once: each
    numba kernel's first call in a process loads it from the cache (~1 s a command otherwise),
    and every child inherits the loaded kernels. The files stay far below the 4 MiB at which
    blake3 starts its thread pool, which a forked child would inherit without its threads."""
    import torch
    from shared.checkpoint import save_state

    with tempfile.TemporaryDirectory(prefix="deltasync-warm-") as tmp, \
            contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        a, b, c, d, p = (f"{tmp}/{name}.safetensors" for name in "abcdp")
        store = f"{tmp}/store"
        g = torch.Generator().manual_seed(0)
        old = {"w": torch.randn(256, 256, generator=g).bfloat16(), "m": torch.randn(4096, generator=g)}
        new = {k: t.clone() for k, t in old.items()}
        for t in new.values():
            t.view(-1)[::97] += 1e-2
        save_state(old, a)
        save_state(new, b)
        for argv in (["diff", a, b, "-o", d], ["apply", a, d, "-o", c], ["push", store, a], ["push", store, b],
                     ["pull", store, "-o", p], ["digest", p]):
            cli.app(argv, standalone_mode=False)


def main() -> None:
    import shared.cli  # what it imports stays imported, for every child

    _warm(shared.cli)
    del sys.modules["shared.cli"]  # while each child runs the module itself afresh, as -m does

    replies = os.fdopen(os.dup(1), "w")
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            _run(request)  # never returns: the child exits from there
        replies.write(json.dumps({"pid": pid}) + "\n")
        replies.flush()
        _, status = os.waitpid(pid, 0)
        replies.write(json.dumps({"code": os.waitstatus_to_exitcode(status)}) + "\n")
        replies.flush()


if __name__ == "__main__":
    main()
