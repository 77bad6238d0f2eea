"""Inside a zygote (see warm.py): fork a child that behaves as `python ARGS` would, and report how it ended."""
import os
import signal
import sys
import tempfile
import time


def serve(request, private_fds):
    out = tempfile.NamedTemporaryFile("wb", prefix="warm-out-", delete=False)
    err = tempfile.NamedTemporaryFile("wb", prefix="warm-err-", delete=False)
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:  # the child: never returns
        code = 1
        try:
            for fd in private_fds:
                os.close(fd)
            code = _be_python(request, out.fileno(), err.fileno())
        finally:
            os._exit(code)
    out.close()
    err.close()
    deadline = time.monotonic() + request["timeout"]
    timed_out = False
    while True:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        if time.monotonic() > deadline:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
            timed_out, status = True, 9
            break
        time.sleep(0.02)
    return {"returncode": os.waitstatus_to_exitcode(status) if not timed_out else -9, "timed_out": timed_out,
            "stdout": out.name, "stderr": err.name}


def _be_python(request, out_fd, err_fd):
    """Run the request as `python ARGS` would (-c CODE, -m MODULE, or a script), in this process."""
    import atexit
    import io
    import runpy
    import traceback

    if request["input"] is not None:
        with tempfile.TemporaryFile("w+b") as stdin:
            stdin.write(request["input"].encode())
            stdin.seek(0)
            os.dup2(stdin.fileno(), 0)
    os.dup2(out_fd, 1)
    os.dup2(err_fd, 2)
    sys.stdin = io.TextIOWrapper(io.FileIO(0, "r", closefd=False), encoding="utf-8")
    sys.stdout = io.TextIOWrapper(io.FileIO(1, "w", closefd=False), encoding="utf-8")
    sys.stderr = io.TextIOWrapper(io.FileIO(2, "w", closefd=False), encoding="utf-8", errors="backslashreplace",
                                  line_buffering=True)
    sys.__stdout__, sys.__stderr__, sys.__stdin__ = sys.stdout, sys.stderr, sys.stdin
    os.environ.clear()
    os.environ.update(request["env"])
    os.chdir(request["cwd"])
    # PYTHONPATH goes where Python puts it at start-up: after the script's directory, before site-packages
    extra = [os.path.abspath(p) for p in request["env"].get("PYTHONPATH", "").split(os.pathsep) if p]
    sys.path[1:1] = extra
    if extra:
        import importlib

        importlib.invalidate_caches()
    if request.get("run_pth"):  # the zygote started without DSPATCH: run dspatch.pth as `site` would have
        _run_dspatch_pth()
    args = request["args"]
    code = 0
    try:
        if args[0] == "-c":
            sys.argv = ["-c", *args[2:]]
            sys.path[0] = ""
            main = type(sys)("__main__")
            sys.modules["__main__"] = main
            exec(compile(args[1], "<string>", "exec"), vars(main))
        elif args[0] == "-m":
            sys.argv = [args[1], *args[2:]]
            sys.path[0] = os.getcwd()
            runpy.run_module(args[1], run_name="__main__", alter_sys=True)
        else:
            sys.argv = list(args)
            sys.path[0] = os.path.dirname(os.path.abspath(args[0]))
            runpy.run_path(args[0], run_name="__main__")
    except SystemExit as e:
        if e.code is None:
            code = 0
        elif isinstance(e.code, int):
            code = e.code
        else:
            print(e.code, file=sys.stderr)
            code = 1
    except BaseException:  # as the interpreter ends on an uncaught exception: through sys.excepthook
        sys.excepthook(*sys.exc_info())
        code = 1
    try:
        atexit._run_exitfuncs()
    except BaseException:
        traceback.print_exc()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except Exception:
            pass
    return code


def _run_dspatch_pth():
    """The installed dspatch.pth's import lines, executed as `site.addpackage` executes them."""
    import site

    for folder in site.getsitepackages():
        path = os.path.join(folder, "dspatch.pth")
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    if line.startswith(("import ", "import\t")):
                        exec(line)
            return
