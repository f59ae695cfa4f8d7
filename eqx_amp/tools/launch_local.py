"""Runs a program as N local processes of JAX's multi-process runtime.

On a cluster the scheduler starts one process per host and JAX finds the coordinator
itself (`jax.distributed.initialize()` with no arguments under SLURM, Open MPI or on a
Cloud TPU). On one machine this module does the scheduler's part: it starts the
command N times, each copy with the variables a program reads to call
`jax.distributed.initialize` (`JAX_COORDINATOR_ADDRESS`, a free port on 127.0.0.1;
`JAX_NUM_PROCESSES`; `JAX_PROCESS_ID`), and with `--cpu-devices K` gives each process
K CPU devices that talk through gloo, so that a multi-host script runs, collectives
and all, on a laptop or in CI:

```bash
python -m eqx_amp.tools.launch_local 2 --cpu-devices 4 -- python examples/fsdp.py --multi-host
```

Each process's output is printed as it comes, every line prefixed with `[i]`. When
one process fails the others are stopped (a process waiting in a collective for a peer
that is gone would wait for ever), and the exit status is the failed process's; a run
that outlives `--timeout` is stopped with status 124. It imports nothing but the
standard library, and never JAX: the processes it starts do.

In a program (the tests use it this way):

```python
from eqx_amp.tools.launch_local import launch

results = launch(["python", "train.py"], 2, cpu_devices=4, timeout=300, check=True)
print(results[1].output)  # everything process 1 printed
```
"""

import argparse
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Literal


TIMED_OUT = 124  # the exit status of `timeout(1)`, for a run that outlived its limit
_USAGE = "python -m eqx_amp.tools.launch_local N [--cpu-devices K] [--timeout S] -- COMMAND..."


@dataclasses.dataclass(frozen=True)
class ProcessResult:
    """How one of the processes ended.

    - `process_id`: its `JAX_PROCESS_ID`.
    - `returncode`: its exit status (negative: the signal that stopped it).
    - `status`: `"ok"` (exit status 0), `"failed"` (it exited with another status),
      `"timed out"` (stopped at the timeout) or `"stopped"` (stopped because another
      process failed).
    - `output`: everything it wrote to stdout and stderr, interleaved as written.
    """

    process_id: int
    returncode: int
    status: Literal["ok", "failed", "timed out", "stopped"]
    output: str


class LaunchError(RuntimeError):
    """A process of `launch(..., check=True)` failed or timed out; the message holds
    the output of every process."""

    def __init__(self, results: Sequence[ProcessResult]):
        self.results = list(results)
        super().__init__(format_results(self.results))


def format_results(results: Sequence[ProcessResult], tail: int = 8000) -> str:
    """One section per process, its status and the last `tail` characters of its
    output: what to show when a run failed."""
    sections = []
    for r in results:
        output = r.output if len(r.output) <= tail else "..." + r.output[-tail:]
        sections.append(
            f"--- process {r.process_id}: {r.status} (exit status {r.returncode}) ---\n"
            f"{output.rstrip()}"
        )
    return "\n".join(sections)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def process_env(
    process_id: int,
    num_processes: int,
    port: int,
    cpu_devices: int | None = None,
    base: Mapping[str, str] | None = None,
) -> dict[str, str]:
    """The environment of process `process_id`: `base` (default: this process's)
    with the coordinator's address, the process count and id, and, with
    `cpu_devices`, JAX on the CPU with that many devices and gloo collectives."""
    env = dict(os.environ if base is None else base)
    env.update(
        JAX_COORDINATOR_ADDRESS=f"127.0.0.1:{port}",
        JAX_NUM_PROCESSES=str(num_processes),
        JAX_PROCESS_ID=str(process_id),
        # Lines arrive as printed, so that a failure shows each process's last words.
        PYTHONUNBUFFERED="1",
    )
    if cpu_devices is not None:
        env.update(
            JAX_PLATFORMS="cpu",
            JAX_NUM_CPU_DEVICES=str(cpu_devices),
            JAX_CPU_COLLECTIVES_IMPLEMENTATION="gloo",
        )
    return env


def _check_arguments(command, num_processes, cpu_devices, timeout) -> list[str]:
    def positive_int(value) -> bool:
        return isinstance(value, int) and not isinstance(value, bool) and value >= 1

    if not positive_int(num_processes):
        raise ValueError(f"`num_processes` must be an int >= 1, got {num_processes!r}.")
    if cpu_devices is not None and not positive_int(cpu_devices):
        raise ValueError(
            f"`cpu_devices` must be None or an int >= 1, got {cpu_devices!r}."
        )
    if timeout is not None and not (isinstance(timeout, (int, float)) and timeout > 0):
        raise ValueError(
            f"`timeout` must be None or a number of seconds > 0, got {timeout!r}."
        )
    if isinstance(command, str) or not command:
        raise ValueError(
            "`command` must be a non-empty list of strings, the program and its "
            f"arguments (as for `subprocess.run`), got {command!r}."
        )
    command = list(command)
    if not all(isinstance(part, str) for part in command):
        raise ValueError(f"`command` must hold strings only, got {command!r}.")
    return command


def _stop(process: subprocess.Popen) -> None:
    """Stops the process and whatever it started (its own session)."""
    try:
        if hasattr(os, "killpg"):
            os.killpg(process.pid, signal.SIGKILL)
        else:
            process.kill()
    except (ProcessLookupError, PermissionError):
        pass


def _read(process: subprocess.Popen, lines: list[str], prefix: str | None) -> None:
    assert process.stdout is not None
    for line in process.stdout:
        lines.append(line)
        if prefix is not None:
            sys.stdout.write(prefix + line)
            sys.stdout.flush()


def launch(
    command: Sequence[str],
    num_processes: int,
    *,
    cpu_devices: int | None = None,
    timeout: float | None = None,
    env: Mapping[str, str] | None = None,
    cwd: str | os.PathLike | None = None,
    echo: bool = False,
    check: bool = False,
    grace: float = 10.0,
) -> list[ProcessResult]:
    """Runs `command` as `num_processes` processes of one JAX multi-process job on
    this machine and waits for all of them.

    **Arguments:**

    - `command`: the program and its arguments, e.g. `["python", "train.py"]`. It
      should call `jax.distributed.initialize` with the `JAX_COORDINATOR_ADDRESS`,
      `JAX_NUM_PROCESSES` and `JAX_PROCESS_ID` it is given.
    - `num_processes`: how many processes (an int >= 1).
    - `cpu_devices`: if given, each process runs JAX on the CPU with this many
      devices (`JAX_NUM_CPU_DEVICES`) and gloo collectives between processes.
    - `timeout`: seconds after which every process still running is stopped.
    - `env`: the environment to start from (default: this process's).
    - `cwd`: the working directory of the processes.
    - `echo`: print each line of output as it comes, prefixed with `[i]`.
    - `check`: raise `LaunchError` (holding every process's output) unless every
      process exits with status 0.
    - `grace`: seconds the others get to finish after one process fails, before they
      are stopped.

    **Returns:**

    A `ProcessResult` per process, in process order.

    **Raises:**

    `ValueError` for a bad argument, `FileNotFoundError` if the program does not
    exist, and with `check=True`, `LaunchError`.

    ```python
    results = launch(["python", "train.py"], 2, cpu_devices=4, timeout=300)
    assert all(r.status == "ok" for r in results), format_results(results)
    ```
    """
    command = _check_arguments(command, num_processes, cpu_devices, timeout)
    port = free_port()
    processes, outputs, readers = [], [], []
    try:
        for i in range(num_processes):
            process = subprocess.Popen(
                command,
                env=process_env(i, num_processes, port, cpu_devices, env),
                cwd=cwd,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                errors="replace",
                start_new_session=True,
            )
            processes.append(process)
            outputs.append([])
            reader = threading.Thread(
                target=_read,
                args=(process, outputs[-1], f"[{i}] " if echo else None),
                daemon=True,
            )
            reader.start()
            readers.append(reader)
        statuses = _wait(processes, timeout, grace)
    finally:
        for process in processes:
            if process.poll() is None:
                _stop(process)
                process.wait()
    for reader in readers:
        reader.join(timeout=10)
    results = [
        ProcessResult(i, p.returncode, statuses[i], "".join(outputs[i]))
        for i, p in enumerate(processes)
    ]
    if check and any(r.status != "ok" for r in results):
        raise LaunchError(results)
    return results


def _wait(processes, timeout, grace) -> list:
    """Waits for every process; stops the rest `grace` seconds after one fails, or
    all at the timeout. Returns each one's status."""
    deadline = None if timeout is None else time.monotonic() + timeout
    stop_at = None
    statuses: list = [None] * len(processes)
    while any(s is None for s in statuses):
        now = time.monotonic()
        for i, process in enumerate(processes):
            if statuses[i] is None and process.poll() is not None:
                statuses[i] = "ok" if process.returncode == 0 else "failed"
                if process.returncode != 0 and stop_at is None:
                    stop_at = now + grace
        running = [i for i, s in enumerate(statuses) if s is None]
        reason = None
        if deadline is not None and now >= deadline:
            reason = "timed out"
        elif stop_at is not None and now >= stop_at:
            reason = "stopped"
        if reason is not None:
            for i in running:
                _stop(processes[i])
                processes[i].wait()
                statuses[i] = reason
        time.sleep(0.05)
    return statuses


def main(argv: Sequence[str] | None = None) -> int:
    """The command line: `python -m eqx_amp.tools.launch_local N [--cpu-devices K]
    [--timeout S] -- COMMAND...`. Returns 0 if every process succeeded, else the
    exit status of the first that failed (124 at the timeout)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--" not in argv:
        print(
            f"usage: {_USAGE}\nlaunch_local: no `--` before the command",
            file=sys.stderr,
        )
        return 2
    split = argv.index("--")
    own, command = argv[:split], argv[split + 1 :]
    parser = argparse.ArgumentParser(
        prog="python -m eqx_amp.tools.launch_local",
        usage=_USAGE,
        description="Runs COMMAND as N local processes of JAX's multi-process runtime.",
    )
    parser.add_argument("num_processes", type=int, metavar="N")
    parser.add_argument(
        "--cpu-devices", type=int, default=None, help="JAX CPU devices per process"
    )
    parser.add_argument(
        "--timeout", type=float, default=None, help="seconds before all are stopped"
    )
    args = parser.parse_args(own)
    if not command:
        parser.error("no command after `--`")
    try:
        results = launch(
            command,
            args.num_processes,
            cpu_devices=args.cpu_devices,
            timeout=args.timeout,
            echo=True,
        )
    except (ValueError, FileNotFoundError) as e:
        parser.error(str(e))
    bad = [r for r in results if r.status != "ok"]
    for r in bad:
        print(
            f"launch_local: process {r.process_id} {r.status} "
            f"(exit status {r.returncode})",
            file=sys.stderr,
        )
    if not bad:
        return 0
    first = next((r for r in bad if r.status == "failed"), bad[0])
    if first.status == "timed out":
        return TIMED_OUT
    # A process stopped by a signal exits as a shell reports it: 128 + the signal.
    return first.returncode if first.returncode > 0 else 128 - first.returncode


if __name__ == "__main__":
    sys.exit(main())
