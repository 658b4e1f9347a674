"""`ncclscope run` on a script with `dist.monitored_barrier` between collectives (runtime/usertrace/ops.py).

gloo runs a monitored barrier as tagged sends and receives, which its group counter counts (rank 0 receives
from and answers every member: twice as many as the others), and torch's collective counter leaves the barrier
itself out. The tracer numbers the barriers on a channel of their own, "world/barriers" (they once shared "#1"
with the first collective: a false mismatch on a healthy job), and once numbered every collective after a
barrier ahead on rank 0."""
from __future__ import annotations

import textwrap

import pyarrow.ipc as ipc
import pytest

SCRIPT = textwrap.dedent('''
    import datetime, torch, torch.distributed as dist
    torch.set_num_threads(1)
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=20))
    x = torch.ones(4)
    for step in range(3):
        dist.all_reduce(x)
        dist.monitored_barrier(timeout=datetime.timedelta(seconds=20))
    dist.all_reduce(x)
    dist.destroy_process_group()
''')


@pytest.mark.spawn
@pytest.mark.e2e
def test_collectives_keep_one_numbering_across_monitored_barriers(tmp_path, zygote):
    script = tmp_path / "mb.py"
    script.write_text(SCRIPT)
    run = tmp_path / "run"
    p = zygote.cli("user-monitored-barrier", ["run", "--nproc", "3", "--out", str(run), "--", str(script)],
                   timeout=300)
    assert p.returncode == 0, p.stderr
    assert any(ln.startswith("OK") for ln in p.stderr.splitlines()), p.stderr
    for r in range(3):
        ev = ipc.open_stream(run / f"rank-{r:05d}" / "events.arrows").read_all().to_pandas()
        begins = ev[ev["phase"] == "begin"]
        ar = begins[begins["op_name"] == "all_reduce"]["collective_seq_id"].tolist()
        mb = begins[begins["op_name"] == "monitored_barrier"]
        assert ar == [1, 2, 3, 4] and mb["collective_seq_id"].tolist() == [1, 2, 3], (r, ar, mb)
        assert set(mb["process_group"]) == {"world/barriers"}
    # loaded with the rank's Flight Recorder dump merged: FR numbers the collectives after a barrier otherwise
    # (it counts the barrier's sends and receives), so none of its entries may come back as a phantom op
    from ncclscope.load.foreign import load_any
    ops = load_any(run).ops
    for r in range(3):
        mine = ops[(ops["rank"] == r).to_numpy() & (ops["op_name"].astype(str) == "all_reduce").to_numpy()]
        assert mine["collective_seq_id"].tolist() == [1, 2, 3, 4], (r, mine)
