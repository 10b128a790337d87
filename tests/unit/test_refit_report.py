"""``refit send|recv`` reports: a job that received no push (the sender job closed first) still
reports in one line and one JSON object, with zeros, never an IndexError traceback."""

from __future__ import annotations

import json

from streamer.refit.job import RefitReport


def test_a_job_without_a_push_reports_zeros() -> None:
    r = RefitReport("recv", "reshard", "gloo", [], [], 0, 0, 0, False, None, True)
    assert r.median_s == 0.0
    assert r.text().startswith("refit recv (reshard): 0 step(s), median 0.000 s, best 0.000 s")
    d = json.loads(json.dumps(r.to_dict()))
    assert d["steps"] == 0 and d["median_s"] == 0.0 and d["peak_buffer_bytes"] == 0
