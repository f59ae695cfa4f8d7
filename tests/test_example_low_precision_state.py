"""`examples/low_precision_state.py` on tiny settings: the 4-8 byte training states
track the float32 master's loss.

Its own module, so that `pytest -n auto --dist loadscope` (CI's slow tier) can run it
beside the other examples rather than after them on one worker."""

import pytest

from .helpers import run_example


pytestmark = pytest.mark.slow


def test_low_precision_state_halves_the_state_and_tracks_the_float32_master():
    pytest.importorskip("sklearn")
    out = run_example("low_precision_state.py", "--seeds", "1", "--steps", "20")
    rows = {}
    for line in out.splitlines():
        if line.startswith("| digits") or line.startswith("| char"):
            cells = [c.strip() for c in line.strip("|").split("|")]
            rows[(cells[0], cells[1])] = (float(cells[2]), float(cells[3].split()[0]))
    for task in ("digits CNN", "char transformer"):
        per_weight = {name: rows[(task, name)][0] for t, name in rows if t == task}
        assert per_weight["f32"] == 12.0
        assert 13.9 <= per_weight["AMP, f32 master"] <= 14.0
        assert per_weight["bf16 + Kahan, bf16 moments"] <= 8.01
        assert per_weight["bf16 + SR, 8-bit moments"] <= 4.1
        master = rows[(task, "AMP, f32 master")][1]
        for name in ("bf16 + Kahan, bf16 moments", "bf16 + SR, 8-bit moments"):
            assert abs(rows[(task, name)][1] - master) < 0.05 * master, (task, name)
