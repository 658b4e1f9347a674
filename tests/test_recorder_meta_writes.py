"""rank.json is rewritten whole by one rename per write, each write through a temporary file of its own: two
writers at once (a signal's end record, the sampler's thread, the script's own) never leave one document over
another's tail (seed 20261217 #78)."""
from __future__ import annotations

import json
import threading

from ncclscope.runtime.recorder import Recorder


def test_concurrent_metadata_writes_leave_one_whole_document(tmp_path) -> None:
    rec = Recorder(tmp_path, rank=0, world_size=1)
    try:
        errors: list[BaseException] = []

        def write(tag: str) -> None:
            try:
                for i in range(200):
                    rec.write_meta(end={"status": "error", "message": tag * (1 + i % 50), "time_ns": i})
            except BaseException as exc:      # a rename whose temporary file another writer took
                errors.append(exc)
        threads = [threading.Thread(target=write, args=(t,)) for t in ("a", "bb", "ccc")]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert not errors, errors
        rank_dir = next(p for p in tmp_path.iterdir() if p.is_dir())
        json.loads((rank_dir / "rank.json").read_text())        # one whole document
        assert not list(rank_dir.glob("*.tmp")), list(rank_dir.glob("*.tmp"))
    finally:
        rec.close("ok", "")
