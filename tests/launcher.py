"""Launch `python -m titan_fold.train` on N CPU ranks as torchrun does, importing torch once;
any command as `python -m MODULE ARGS` in one process the same way; and a test's worker
function on N gloo ranks (fork_ranks).

On 2 cores, every torchrun rank spends ~7 CPU-seconds importing torch, torchtitan (which
pulls in inductor, datasets, pandas) and titan_fold before it trains: an 8-rank launch
burns a minute on imports. Here one zygote process imports the trainer once per test
session and forks the ranks of each launch from that state (it never ran an op or made a
process group). Each rank gets torchrun's environment (RANK, LOCAL_RANK, WORLD_SIZE,
LOCAL_WORLD_SIZE, GROUP_RANK, MASTER_ADDR/PORT, TORCHELASTIC_RESTART_COUNT, an error file), fresh RNG
seeds, the launch's extra environment and working folder, and runs the command's own
module as `python -m` runs it (as `__main__`, `sys.argv` as `-m` sets it). As with torchrun,
the first rank that fails stops the others; the launch returns every rank's exit code. A
launch of 0 ranks is one plain process without torchrun's environment: how the tests run
the CLIs (hf, upcycle, layout, plan, plot) and check their exit code, stdout and stderr, at
about 0.1 s instead of the 3-4 s a fresh interpreter spends on imports. What torchrun's
agent itself does (restarts, rendezvous, signal forwarding) stays tested through real
torchrun (tests/test_checkpoint.py's fault test, tests/test_reliability.py's runs).

Ranks are never forked from the test process itself: after earlier tests it holds objects
that need threads a forked child does not have. A trainer's process group left in reference
cycles, collected in the child, joins its TCPStore's event-loop thread and waits forever;
a lock held by another thread at the fork stays held. A launch that outlives its timeout
has each rank's Python stacks written (faulthandler, SIGABRT), then is killed. Each rank that a
signal ended (that SIGABRT, a crash's SIGSEGV) gets a line naming it and its stacks at the end of
the launch's stderr, where a failure's message quotes it.

A worker's rank that fails a test's assertion (tests/outcomes/failures.py) exits ASSERTION_FAILED;
run_ranks then raises AssertionError, and RanksFailed for any other failure (an exception, a
signal, a timeout), so that a crash never passes for a wrong value. Each exception that ends a
rank, and each timeout, also goes to the failure log the mutation runner reads.
"""

import atexit
import faulthandler
import importlib
import inspect
import json
import os
import runpy
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback

from outcomes import failures

# after a failure the other ranks get SETTLE_S to end on their own (a refusal ends every rank, the
# slowest of a loaded machine's a little later), then SIGTERM, then SIGKILL GRACE_S after it
SETTLE_S = 5
GRACE_S = 10
ASSERTION_FAILED = 3  # a worker's exit code when it failed a test's assertion


class RanksFailed(Exception):
    """Ranks that failed other than on a test's assertion: an exception, a signal, a timeout."""


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def end_rank_checks(out_dir: str, rank: int, failures: list[str]) -> None:
    """The end of a forked gloo rank's checks (mp.start_processes workers): its failures into
    out_dir/rank<rank>.txt, then the process group's teardown."""
    import torch.distributed as dist

    with open(os.path.join(out_dir, f"rank{rank}.txt"), "w") as f:
        f.write("\n".join(failures))
    dist.barrier()
    dist.destroy_process_group()


def rank_failures(out_dir: str, world: int) -> list[str]:
    """The failures end_rank_checks wrote, of the ranks that had any."""
    return [f for r in range(world) if (f := open(os.path.join(out_dir, f"rank{r}.txt")).read())]


def start_rank(rank: int, port: int, world: int, backend: str = "gloo") -> None:
    """The start of a forked rank (fork_ranks' workers): the rendezvous address, torch on one
    thread (the ranks share the cores), then the process group."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group(backend, rank=rank, world_size=world, timeout=timedelta(seconds=300))


def run_ranks(worker, world: int, out_dir, *args, timeout: float = 900) -> None:
    """worker(rank, port, out_dir, *args) on `world` ranks forked from the zygote, the worker
    imported there from its test module; args travel as JSON (lists stay lists). Raises with
    the ranks' stderr when one fails or the launch outlives `timeout` seconds: AssertionError
    when a rank failed a test's assertion (its peers may fail after it), RanksFailed otherwise."""
    out_dir = str(out_dir)
    stdout, stderr = os.path.join(out_dir, "ranks.stdout"), os.path.join(out_dir, "ranks.stderr")
    call = [inspect.getmodulename(inspect.getfile(worker)), worker.__name__, [out_dir, *args]]
    codes = ZYGOTE.launch(world, [], stdout, stderr, timeout=timeout, call=call)
    if any(codes):
        failure = AssertionError if ASSERTION_FAILED in codes else RanksFailed
        with open(stderr, errors="replace") as f:
            raise failure(
                f"{worker.__name__} on {world} ranks: exit codes {codes} "
                f"(-{int(signal.SIGABRT)}: still running after {timeout} s)\n{f.read()[-12000:]}"
            )


def fork_ranks(worker, world: int, out_dir, *args, timeout: float = 900) -> list[str]:
    """run_ranks -> the failures the ranks wrote with end_rank_checks."""
    run_ranks(worker, world, out_dir, *args, timeout=timeout)
    return rank_failures(str(out_dir), world)


def expert_meshes(layouts, world: int):
    """For each (ep, etp) of layouts: (ep, etp, mesh, ep_mesh, etp_mesh), mesh the (edp, ep, etp)
    CPU mesh of world ranks, etp_mesh None at etp 1."""
    from torch.distributed.device_mesh import init_device_mesh

    for ep, etp in layouts:
        mesh = init_device_mesh("cpu", (world // (ep * etp), ep, etp), mesh_dim_names=("edp", "ep", "etp"))
        yield ep, etp, mesh, mesh["ep"], mesh["etp"] if etp > 1 else None


def run_checks(checks, label: str) -> list[str]:
    """Each (name, check) of checks run; -> "<label> <name>:" and the traceback of each that failed
    a test's assertion (any other exception, an AssertionError of titan_fold's included, ends the rank)."""
    found = []
    for name, check in checks:
        try:
            check()
        except AssertionError as e:
            if not failures.is_test_assertion(e):
                raise
            found.append(f"{label} {name}:\n{traceback.format_exc()}")
    return found


def _rank(rank: int, nproc: int, port: int, request: dict) -> int:
    """Body of one forked rank (of a plain process when nproc is 0); returns its exit code."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the zygote
    except (OSError, AttributeError):
        pass
    os.setpgid(0, 0)
    os.chdir(request["cwd"])
    os.environ.update(request["env"])
    if nproc:
        os.environ.update(
            RANK=str(rank),
            LOCAL_RANK=str(rank),
            WORLD_SIZE=str(nproc),
            LOCAL_WORLD_SIZE=str(nproc),
            GROUP_RANK="0",
            GROUP_WORLD_SIZE="1",
            ROLE_RANK=str(rank),
            ROLE_WORLD_SIZE=str(nproc),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            TORCHELASTIC_RESTART_COUNT="0",
            # torchrun's layout <attempt folder>/<local rank>/error.json: the first rank to fail
            # with a UserError prints its line (common/errors.py), before the others are stopped
            TORCHELASTIC_ERROR_FILE=os.path.join(request["attempt"], str(rank), "error.json"),
        )
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        os.dup2(os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644), fd)
    sys.stdin = open(os.devnull)
    # a fatal signal (SIGSEGV, or SIGABRT at a launch's timeout) writes the rank's Python stacks
    # into its own file, which _launch appends to stderr after the launch, one rank at a time
    faulthandler.enable(open(_stacks_file(request["attempt"], rank), "w"), all_threads=True)
    import torch

    # a fresh process's RNG states, not the zygote's (identical in every rank); Python's
    # `random` reseeds itself after a fork
    torch.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    try:
        if request["call"]:
            module, function, args = request["call"]
            getattr(importlib.import_module(module), function)(rank, port, *args)
        else:
            module = request["module"]
            sys.modules.pop(module, None)  # `-m` runs the module's code afresh as __main__
            sys.argv = [module, *request["argv"]]  # run_module sets argv[0] to the file, as `-m` does
            runpy.run_module(module, run_name="__main__", alter_sys=True)
    except SystemExit as e:
        if e.code is None or isinstance(e.code, int):
            return e.code or 0
        print(e.code, file=sys.stderr)  # what the interpreter does with sys.exit("message")
        return 1
    except BaseException as e:
        traceback.print_exc()
        failures.note_exception(e)
        return ASSERTION_FAILED if request["call"] and failures.is_test_assertion(e) else 1
    return 0


def _stacks_file(attempt: str, rank: int) -> str:
    return os.path.join(attempt, f"stacks{rank}.txt")


def _report_signals(request: dict, codes: list[int]) -> None:
    """For each rank a signal ended: a line naming the rank and the signal, then the stacks its
    faulthandler wrote, at the end of the launch's stderr (where a failure's message quotes it)."""
    with open(request["stderr"], "a") as err:
        for rank, code in enumerate(codes):
            if code < 0:
                # without faulthandler's list of extension modules, a long line of no use here
                stacks = open(_stacks_file(request["attempt"], rank)).read().split("\nExtension modules:")[0]
                err.write(f"rank {rank} ended by {signal.Signals(-code).name}\n{stacks}")


def _launch(request: dict) -> list[int]:
    """Fork the ranks of one launch and wait for them; -> exit codes (-N: killed by signal N)."""
    nproc, port = request["nproc"], free_port()
    ranks = max(nproc, 1)
    request = {**request, "attempt": tempfile.mkdtemp(prefix="attempt_")}
    for rank in range(nproc):
        os.mkdir(os.path.join(request["attempt"], str(rank)))
    sys.stdout.flush()
    sys.stderr.flush()
    pids = []
    for rank in range(ranks):
        pid = os.fork()
        if pid == 0:
            code = 1
            try:
                code = _rank(rank, nproc, port, request)
            finally:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(code)
        pids.append(pid)
    codes: dict[int, int] = {}
    deadline, term_at, stop_at = time.monotonic() + request["timeout"], None, None
    while len(codes) < ranks:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid:
            codes[pid] = os.waitstatus_to_exitcode(status)
            if codes[pid] != 0 and term_at is None:
                term_at = time.monotonic() + SETTLE_S
            continue
        now = time.monotonic()
        if term_at is not None and now > term_at and stop_at is None:
            stop_at = now + GRACE_S
            _signal([p for p in pids if p not in codes], signal.SIGTERM)
        if now > deadline:  # the stacks first (faulthandler), then the kill
            failures.note("timeout", f"ranks still running after {request['timeout']} s")
            _signal([p for p in pids if p not in codes], signal.SIGABRT)
            deadline, stop_at = float("inf"), min(stop_at or float("inf"), now + GRACE_S)
        elif stop_at is not None and now > stop_at:
            _signal([p for p in pids if p not in codes], signal.SIGKILL)
            deadline = stop_at = float("inf")
        time.sleep(0.05)
    exit_codes = [codes[p] for p in pids]
    _report_signals(request, exit_codes)
    shutil.rmtree(request["attempt"], ignore_errors=True)
    return exit_codes


def _signal(pids, sig):
    for p in pids:
        try:
            os.killpg(p, sig)
        except ProcessLookupError:
            pass


def serve() -> None:
    """The zygote: import the trainer, then one launch per request line on stdin."""
    replies = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # what imports print must not mix with the replies
    import titan_fold.trainer.fold_trainer  # noqa: F401  (what every rank would import; the CLIs import a part of it)

    for line in sys.stdin:
        replies.write(json.dumps(_launch(json.loads(line))) + "\n")


class Zygote:
    """The test session's side: starts the zygote on first use, stops it at exit."""

    def __init__(self):
        self.proc = None

    def launch(
        self,
        nproc: int,
        argv: list[str],
        stdout: str,
        stderr: str,
        env: dict | None = None,
        timeout: float = 900,
        module: str = "titan_fold.train",
        call: list | None = None,
    ) -> list[int]:
        """`python -m MODULE ARGV` on NPROC ranks with torchrun's environment (0: one plain
        process), stdout and stderr appended to those files; -> every rank's exit code. With
        `call` [module, function, args], each rank runs function(rank, port, *args) instead."""
        if self.proc is None or self.proc.poll() is not None:
            here = os.path.dirname(os.path.abspath(__file__))
            self.proc = subprocess.Popen(
                [sys.executable, os.path.join(here, "launcher.py")],
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                text=True,
                env=dict(os.environ, OMP_NUM_THREADS="1"),
            )
            atexit.register(self.close)
        request = dict(
            nproc=nproc,
            module=module,
            argv=list(argv),
            stdout=stdout,
            stderr=stderr,
            env=env or {},
            cwd=os.getcwd(),
            timeout=timeout,
            call=call,
        )
        self.proc.stdin.write(json.dumps(request) + "\n")
        self.proc.stdin.flush()
        reply = self.proc.stdout.readline()
        assert reply, f"the launcher died (exit code {self.proc.wait()})"
        return json.loads(reply)

    def close(self):
        """End of stdin ends an idle zygote; one still in a launch (an interrupted session)
        is killed, and its ranks with it (PR_SET_PDEATHSIG)."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.stdin.close()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


ZYGOTE = Zygote()

if __name__ == "__main__":
    serve()
