"""A specialist's Serve metrics: `ServeMetrics` against Ray's real metric classes (Ray checks every
tag set against the metric's declared keys, so a wrong tag fails here, not in a replica), and
`replica_metrics` outside a Serve replica (no-op metrics)."""

from __future__ import annotations

import pytest

from specialists.metrics import SPECULATION_STATUSES, NullMetrics


def test_serve_metrics_tags_fit_rays_metric_keys() -> None:
    from ray.serve import metrics

    from specialists.serve_metrics import ServeMetrics

    m = ServeMetrics("shell", metrics)
    m.observe(0.05, [0.01, 0.02], 3, 0.5, {"drafted": 4, "accepted": 2, "mean_accepted_length": 1.5}, "on")
    m.observe(None, [], 0, 0.0, {}, "off")
    for status in SPECULATION_STATUSES:
        m.set_status(status)
    with pytest.raises(ValueError):  # the check above can fail: Ray refuses a tag set without a declared key
        m.requests.inc(1, m.tags)


def test_replica_metrics_outside_a_replica_are_null() -> None:
    from specialists.deployment import replica_metrics

    assert isinstance(replica_metrics("shell"), NullMetrics)
    import ray.serve  # noqa: F401 - Serve imported, still not a replica

    assert isinstance(replica_metrics("shell"), NullMetrics)
