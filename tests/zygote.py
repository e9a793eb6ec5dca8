"""A process that imports torch (and transformers' model classes) once and forks test workers from there.

[Note: workers forked from a zygote]
A compiled program's worker spends most of a short test run importing: torch takes
about 2.5 s of CPU, transformers' model classes about 5 s more. The suite starts some
hundreds of workers, so ``run_torchrun`` (tests/conftest.py) starts them from this
process instead: it runs with the environment a worker gets but for the rank variables,
imports the modules in ``PRELOAD`` and nothing else (no tensor is made, no thread
started), then, for each request on its stdin, forks a child that takes the request's
environment, working directory, argv and output files and runs the program as
``python PROGRAM ARGS`` would (``runpy`` as ``__main__``, the program's folder first on
``sys.path``, atexit handlers at the end, the exit status from ``SystemExit`` or an
uncaught exception), or ``python -m MODULE ARGS`` (tests/cli_helpers.py runs the hetpar
command so). The workers still meet through torch.distributed over real
sockets, exactly as before; only the interpreter start is shared. Nothing of hetpar is
imported here, so every module that reads the environment at import reads the worker's.

Protocol: one JSON object per line on stdin, ``{"argv", "cwd", "env", "stdout",
"stderr"}`` (argv without the interpreter: ``[PROGRAM, ARGS...]`` or ``["-m", MODULE, ARGS...]``); the zygote answers ``{"pid"}`` on stdout, and ``{"exited", "rc"}`` when
that child ends (rc as ``subprocess.Popen.returncode``: negative for a signal). A
closed stdin ends the zygote. HETPAR_TEST_ZYGOTE=0 starts every worker as its own
process instead.
"""

from __future__ import annotations

import json
import os
import selectors
import signal
import sys

PRELOAD = ["torch", "torch.distributed", "torch.distributed.tensor", "torch.distributed.fsdp",
           "torch.distributed.pipelining", "torch.distributed.checkpoint", "torch.nn.functional"]
# transformers' lazy module imports a class's module on first use; these are the families the tests run
HF_CLASSES = ["GPT2LMHeadModel", "LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "MixtralForCausalLM",
              "BertForMaskedLM", "T5ForConditionalGeneration", "ViTForImageClassification", "ResNetForImageClassification",
              "AutoModelForCausalLM", "AutoConfig"]


def _preload() -> None:
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    try:
        import transformers
    except ImportError:
        return
    for name in HF_CLASSES:
        getattr(transformers, name, None)


def _child(request: dict) -> None:
    """In the forked child: become ``python argv...`` with the request's environment and output; never returns."""
    import atexit
    import runpy
    import traceback

    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGPIPE):
        signal.signal(sig, signal.SIG_DFL if sig != signal.SIGINT else signal.default_int_handler)
    code = 1
    try:
        os.environ.clear()
        os.environ.update(request["env"])
        os.chdir(request["cwd"])
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            os.dup2(out, fd)
            os.close(out)
        argv = list(request["argv"])
        try:
            if argv[0] == "-m":  # python -m MODULE ARGS: the working directory first on sys.path
                sys.argv = argv[1:]
                sys.path[0] = os.getcwd()
                runpy.run_module(argv[1], run_name="__main__", alter_sys=True)
            else:
                program = os.path.abspath(argv[0])
                sys.argv = argv
                sys.path[0] = os.path.dirname(program)
                runpy.run_path(program, run_name="__main__")
            code = 0
        except SystemExit as exc:
            if exc.code is None:
                code = 0
            elif isinstance(exc.code, int):
                code = exc.code
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:  # what the interpreter does with an uncaught exception
            traceback.print_exc()
            code = 1
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code & 0xFF)  # as the interpreter passes sys.exit's number to exit(3)


def main() -> None:
    _preload()
    out = sys.stdout
    children: set[int] = set()
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    selector = selectors.DefaultSelector()
    selector.register(0, selectors.EVENT_READ, "request")
    selector.register(wake_r, selectors.EVENT_READ, "child")
    print(json.dumps({"ready": True}), file=out, flush=True)
    pending = b""
    while True:
        for key, _ in selector.select():
            if key.data == "child":
                os.read(wake_r, 4096)
                continue
            data = os.read(0, 1 << 16)
            if not data:
                return
            pending += data
            while b"\n" in pending:
                line, pending = pending.split(b"\n", 1)
                request = json.loads(line)
                pid = os.fork()
                if pid == 0:
                    selector.close()
                    signal.set_wakeup_fd(-1)
                    os.close(wake_r)
                    os.close(wake_w)
                    _child(request)
                children.add(pid)
                print(json.dumps({"pid": pid}), file=out, flush=True)
        for pid in list(children):  # reap whatever ended, whichever event woke us
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                children.discard(pid)
                print(json.dumps({"exited": pid, "rc": os.waitstatus_to_exitcode(status)}), file=out, flush=True)


if __name__ == "__main__":
    main()
