"""`eqx_amp.tools.launch_local`, hostile: bad arguments, a missing command, a child
that fails or hangs. The children here are small Python programs without JAX; the
multi-process runs of JAX itself are in `tests/test_multiprocess.py`."""

import subprocess
import sys

import pytest

from eqx_amp.tools import launch_local
from eqx_amp.tools.launch_local import LaunchError, launch, main, process_env


PY = sys.executable


@pytest.mark.parametrize("n", [0, -1, 1.5, "2", True, None])
def test_bad_process_count(n):
    with pytest.raises(ValueError, match=r"`num_processes` must be an int >= 1"):
        launch([PY, "-c", "pass"], n)


@pytest.mark.parametrize("k", [0, -2, 2.0, True])
def test_bad_cpu_devices(k):
    with pytest.raises(ValueError, match=r"`cpu_devices` must be None or an int >= 1"):
        launch([PY, "-c", "pass"], 2, cpu_devices=k)


@pytest.mark.parametrize("t", [0, -1, "10"])
def test_bad_timeout(t):
    with pytest.raises(ValueError, match=r"`timeout` must be None or a number"):
        launch([PY, "-c", "pass"], 2, timeout=t)


@pytest.mark.parametrize("command", [[], "python train.py", [PY, 3]])
def test_bad_command(command):
    with pytest.raises(ValueError, match=r"`command` must"):
        launch(command, 2)


def test_process_env_names_the_coordinator_and_the_process():
    env = process_env(1, 4, 1234, cpu_devices=2, base={"KEEP": "1"})
    assert env == {
        "KEEP": "1",
        "JAX_COORDINATOR_ADDRESS": "127.0.0.1:1234",
        "JAX_NUM_PROCESSES": "4",
        "JAX_PROCESS_ID": "1",
        "PYTHONUNBUFFERED": "1",
        "JAX_PLATFORMS": "cpu",
        "JAX_NUM_CPU_DEVICES": "2",
        "JAX_CPU_COLLECTIVES_IMPLEMENTATION": "gloo",
    }
    assert "JAX_NUM_CPU_DEVICES" not in process_env(0, 1, 1234, base={})


def test_usage_errors_of_the_command_line(capsys):
    assert main(["2", "python"]) == 2  # no `--`
    assert "no `--` before the command" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["2", "--"])
    assert e.value.code == 2
    assert "no command after `--`" in capsys.readouterr().err
    with pytest.raises(SystemExit) as e:
        main(["zero", "--", PY])
    assert e.value.code == 2
    with pytest.raises(SystemExit) as e:
        main(["0", "--", PY, "-c", "pass"])
    assert "`num_processes` must be an int >= 1" in capsys.readouterr().err


# The tests below start processes: the slow tier.


@pytest.mark.slow
def test_every_process_gets_its_id_and_output():
    code = "import os; print(os.environ['JAX_PROCESS_ID'], os.environ['JAX_NUM_PROCESSES'])"
    results = launch([PY, "-c", code], 3, timeout=60, check=True)
    assert [r.output for r in results] == ["0 3\n", "1 3\n", "2 3\n"]
    assert [r.status for r in results] == ["ok"] * 3
    addresses = {
        r.output
        for r in launch(
            [PY, "-c", "import os; print(os.environ['JAX_COORDINATOR_ADDRESS'])"], 2
        )
    }
    assert len(addresses) == 1 and addresses.pop().startswith("127.0.0.1:")


@pytest.mark.slow
def test_missing_program():
    with pytest.raises(FileNotFoundError):
        launch(["no-such-program-eqx-amp"], 2, timeout=30)


@pytest.mark.slow
def test_a_failing_child_stops_the_others_and_shows_every_output():
    # Process 1 fails at once; process 0 would wait for ever, as it would in a
    # collective whose peer is gone.
    code = (
        "import os, sys, time\n"
        "print('process', os.environ['JAX_PROCESS_ID'], 'started', flush=True)\n"
        "if os.environ['JAX_PROCESS_ID'] == '1':\n"
        "    sys.exit('process 1 gives up')\n"
        "time.sleep(600)\n"
    )
    with pytest.raises(LaunchError) as e:
        launch([PY, "-c", code], 2, timeout=120, grace=1, check=True)
    statuses = [(r.status, r.returncode) for r in e.value.results]
    assert statuses[0][0] == "stopped" and statuses[0][1] < 0
    assert statuses[1] == ("failed", 1)
    message = str(e.value)
    assert "--- process 0: stopped" in message and "process 0 started" in message
    assert "--- process 1: failed (exit status 1)" in message
    assert "process 1 gives up" in message


@pytest.mark.slow
def test_timeout_stops_every_process():
    results = launch([PY, "-c", "import time; time.sleep(600)"], 2, timeout=1)
    assert [r.status for r in results] == ["timed out", "timed out"]


@pytest.mark.slow
def test_command_line_exit_status_and_prefixed_output():
    code = (
        "import os, sys; print('hello from', os.environ['JAX_PROCESS_ID']); "
        "sys.exit(3 if os.environ['JAX_PROCESS_ID'] == '1' else 0)"
    )
    result = subprocess.run(
        [PY, "-m", launch_local.__name__, "2", "--", PY, "-c", code],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 3
    assert "[0] hello from 0" in result.stdout
    assert "[1] hello from 1" in result.stdout
    assert "launch_local: process 1 failed (exit status 3)" in result.stderr
    timed_out = subprocess.run(
        [PY, "-m", launch_local.__name__, "1", "--timeout", "1", "--"]
        + [PY, "-c", "import time; time.sleep(600)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert timed_out.returncode == launch_local.TIMED_OUT == 124
    assert "process 0 timed out" in timed_out.stderr
