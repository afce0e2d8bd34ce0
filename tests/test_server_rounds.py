"""The aggregation server's rounds against a real mosquitto: the model it aggregates equals
the in-process strategy's, rounds close when every sampled device answered, declined or
the deadline passed, a hostile update is screened out, and a fleet of 100 is accounted for."""

from __future__ import annotations

import time

import pytest
import torch
from server_sim import (
    FLEET,
    D,
    SimDevice,
    close_all,
    expected_global,
    make_server,
    round_orders,
    wait_for,
)

from wakefl.protocol import messages as M
from wakefl.protocol import topics


@pytest.mark.parametrize("cluster", [False, True])
def test_aggregate_equals_in_process_strategy(mqtt_broker, tmp_path, cluster):
    reg = {"a": "speaker", "b": "speaker", "c": "tv"}
    devs = [SimDevice(mqtt_broker.url, d, t) for d, t in reg.items()]
    srv = make_server(
        mqtt_broker,
        tmp_path,
        reg,
        rounds=3,
        round_timeout=20,
        strategy_args={"cluster_by_group": True} if cluster else {},
    )
    try:
        final = srv.run()
        wait_for(lambda: all(d.final is not None for d in devs), 10, "the end announcement")
    finally:
        close_all(devs)
    assert final.round_id == 3
    assert [r.closed_by for r in srv.reports] == ["all"] * 3
    want = expected_global(devs, 3, len(reg), cluster, round_orders(tmp_path / "server", 3))
    torch.testing.assert_close(final.global_params, want, rtol=0, atol=1e-6)
    torch.testing.assert_close(devs[0].final.global_params, want, rtol=0, atol=1e-6)
    assert not srv.rejections


def test_silent_device_round_closes_at_deadline(mqtt_broker, tmp_path):
    reg = {"a": "speaker", "b": "tv", "mute": "tv"}
    devs = [SimDevice(mqtt_broker.url, d, t, answer=(d != "mute")) for d, t in reg.items()]
    srv = make_server(mqtt_broker, tmp_path, reg, rounds=2, round_timeout=1.5)
    try:
        t0 = time.monotonic()
        final = srv.run()
        wall = time.monotonic() - t0
    finally:
        close_all(devs)
    assert final.round_id == 2
    assert [r.closed_by for r in srv.reports] == ["deadline", "deadline"]
    assert all(sorted(r.reported) == ["a", "b"] for r in srv.reports)
    assert 3.0 <= wall < 10.0


def test_hundred_devices_every_update_accounted_for(mqtt_broker, tmp_path):
    reg = {f"d{i:03d}": f"type{i % 5}" for i in range(100)}
    devs = [SimDevice(mqtt_broker.url, d, t, resend_s=5) for d, t in reg.items()]
    srv = make_server(mqtt_broker, tmp_path, reg, rounds=2, round_timeout=60)
    try:
        final = srv.run()
    finally:
        close_all(devs)
    assert final.round_id == 2
    for rep in srv.reports:
        assert len(rep.reported) == 100 and rep.closed_by == "all"
    assert all(set(d.acked) == {1, 2} for d in devs)
    dup = srv.rejections.get("duplicate", 0)
    assert sum(srv.rejections.values()) == dup  # only re-sends, nothing else refused


class _HostileDevice(SimDevice):
    """Answers each round with an update `scale` times its honest step (or entries of
    `fill`) and claims zero variance."""

    def __init__(self, *a, scale: float = 1.0, fill: float | None = None, **kw):
        self.scale, self.fill = scale, fill
        super().__init__(*a, **kw)

    def update_for(self, down: M.Downlink) -> M.Uplink:
        honest = super().update_for(down)
        if self.fill is not None:
            params = torch.full((D,), self.fill) * torch.tensor([1.0, -1.0]).repeat(D // 2)
        else:
            params = down.global_params + self.scale * (honest.params - down.global_params)
        return M.Uplink(
            FLEET,
            down.run_id,
            self.dev,
            self.typ,
            down.round_id,
            params,
            num_samples=honest.num_samples,
            record={**honest.record, "has_variance": 1.0, "sigma_sq": 0.0},
        )


@pytest.mark.parametrize("attack", [{"fill": 3e38}, {"scale": 1e6}])
def test_one_hostile_update_cannot_move_the_global_model(mqtt_broker, tmp_path, attack):
    honest = {"a": "speaker", "b": "speaker", "c": "tv"}
    reg = {**honest, "evil": "tv"}
    devs = [SimDevice(mqtt_broker.url, d, t) for d, t in honest.items()]
    evil = _HostileDevice(mqtt_broker.url, "evil", "tv", **attack)
    srv = make_server(mqtt_broker, tmp_path, reg, rounds=2, round_timeout=20)
    try:
        final = srv.run()
    finally:
        close_all([*devs, evil])
    assert all(r.screened.get("evil", "").startswith("refuse") for r in srv.reports)
    assert srv.rejections["outlier"] == 2
    # the run as if evil had sent nothing (same registry size, so the same activity rate)
    order = {
        r: [d for d in rows if d != "evil"]
        for r, rows in round_orders(tmp_path / "server", 2).items()
    }
    want = expected_global(devs, 2, len(reg), False, order)
    torch.testing.assert_close(final.global_params, want, rtol=0, atol=1e-6)
    assert float(final.global_params.abs().max()) < 10


class _DecliningDevice(SimDevice):
    def _work(self):
        while not self._stop.is_set():
            time.sleep(0.05)
            with self._lock:
                down, self._todo = self._todo, None
            if down is not None and down.round_id not in self.sent:
                self.sent[down.round_id] = None  # type: ignore[assignment]
                self.client.publish(
                    topics.uplink(FLEET, self.dev),
                    M.encode(
                        M.Decline(
                            FLEET, down.run_id, self.dev, down.round_id, "local data unreadable"
                        )
                    ),
                    qos=1,
                )


def test_declining_device_lets_the_round_close_without_waiting_for_the_deadline(
    mqtt_broker, tmp_path
):
    reg = {"a": "speaker", "b": "tv", "broken": "tv"}
    devs = [
        SimDevice(mqtt_broker.url, "a", "speaker"),
        SimDevice(mqtt_broker.url, "b", "tv"),
        _DecliningDevice(mqtt_broker.url, "broken", "tv"),
    ]
    srv = make_server(mqtt_broker, tmp_path, reg, rounds=2, round_timeout=60)
    try:
        t0 = time.monotonic()
        srv.run()
        wall = time.monotonic() - t0
    finally:
        close_all(devs)
    assert wall < 20
    for rep in srv.reports:
        assert rep.closed_by == "all" and sorted(rep.reported) == ["a", "b"]
        assert rep.declined == {"broken": "local data unreadable"}
    assert not srv.rejections


def test_static_registry_with_an_offline_device_still_runs_rounds(mqtt_broker, tmp_path):
    reg = {"a": "speaker", "b": "tv", "never": "tv"}
    devs = [SimDevice(mqtt_broker.url, d, t) for d, t in reg.items() if d != "never"]
    srv = make_server(mqtt_broker, tmp_path, reg, rounds=2, round_timeout=10, start_grace_s=1.0)
    try:
        t0 = time.monotonic()
        final = srv.run()
        wall = time.monotonic() - t0
    finally:
        close_all(devs)
    assert final.round_id == 2 and wall < 15
    assert all(r.sampled == ["a", "b"] and r.closed_by == "all" for r in srv.reports)
    # round 1 waited out the start grace for "never"; its line tells that wait apart
    first = srv.reports[0]
    assert first.phases_s["wait"] >= 1.0 and "after waiting" in first.time_words()
    assert srv.reports[1].phases_s["wait"] < first.phases_s["wait"]
    assert 0 <= first.phases_s["open"] < first.phases_s["wait"] <= first.wall_s


@pytest.mark.parametrize(
    ("wall", "waited", "says"),
    [
        (62.0, 60.6, "in 1.40 s, after waiting 60.6 s for devices to come online"),
        (1.4, 0.0, "in 1.40 s"),
        (1.4, 0.01, "in 1.40 s"),  # a wait too short to mention
        (12.5, None, "in 12.50 s"),  # a resumed round, or a report without phases
    ],
)
def test_a_rounds_closing_line_tells_the_wait_for_devices_apart(wall, waited, says):
    from wakefl.server.server_config import RoundReport

    phases = {} if waited is None else {"wait": waited, "open": 0.1}
    assert RoundReport(1, ["a"], {}, "", wall, "all", phases).time_words() == says


@pytest.mark.parametrize(
    ("rate", "registry", "quorum", "want"),
    [
        (0.3, 10, None, 3),
        (0.25, 10, None, 2),
        (0.1, 5, None, 1),
        (0.25, 10, 4, 4),
        (1.0, 3, None, 3),
    ],
)
def test_server_samples_the_paper_count_raised_to_its_quorum(
    tmp_path, rate, registry, quorum, want
):
    # floor(C M), at least 1 (rules.sampled_count), as the simulation and the studies
    # count: 0.3 * 10 is 3.0000000000000004 in floating point, which ceil made 4.
    reg = {f"d{i}": "speaker" for i in range(registry)}
    srv = make_server(
        type("B", (), {"url": "mqtt://127.0.0.1:1"})(),
        tmp_path,
        reg,
        activity_rate=rate,
        min_clients=quorum,
    )
    try:
        picked = srv._sample(1, sorted(reg), registry)
        assert len(picked) == want and set(picked) <= set(reg)
        assert len(srv._sample(1, ["d0", "d1"], registry)) == min(want, 2)  # among the online
    finally:
        srv.store.close()


@pytest.mark.parametrize(
    ("extra", "says"),
    [
        (
            ["--strategy", "fedavg-w", "--group-by", "device_type"],
            "does not take one of --group-by",
        ),
        (["--strategy-arg", "lrr=0.1"], "does not take one of --strategy-arg lrr"),
        (["--strategy-arg", "lr=abc"], "bad --strategy-arg value"),
        (["--strategy-arg", "lr=[1]"], "bad --strategy-arg value"),
        (["--strategy-arg", "l_max=-3"], "l_max"),
        (["--strategy-arg", "lr=1e999"], "learning rate"),
        (["--strategy-arg", "lr"], "KEY=VALUE"),
        (["--strategy", "nope"], "unknown strategy"),
        (["--strategy", "fedavg-w", "--role", "coordinator"], "Self-FL strategies only"),
        (["--role", "coordinator", "--group-by", "device_type"], "cluster mode"),
    ],
)
def test_the_cli_turns_every_bad_strategy_argument_into_one_line(tmp_path, capsys, extra, says):
    from wakefl.tools.cli import main

    # Refused before any broker is contacted: the URL is never dialled.
    argv = ["server", "--broker", "mqtt://127.0.0.1:1", "--state", str(tmp_path / "s")]
    assert main(argv + ["--rounds", "1", "--devices", "a:x", *extra]) == 2
    err = capsys.readouterr().err.strip()
    assert "wakefl: error: " in err and "\n" not in err and "Traceback" not in err
    assert says in err, err
