"""The daemon under a power plan: background requests refused with 503 + Retry-After while the plan
says so, interactive ones still served (paced); /health and /metrics show readings and plan."""

from __future__ import annotations

import httpx
import openai
import pytest

import edgeinfer
from edgeinfer.errors import InvalidArgumentError
from edgeinfer.power.policy import Policy
from edgeinfer.power.readings import Readings
from edgeinfer.server.config import ServeConfig, load_config

from test_server import KEY, Running

HOT = Readings(temp_c=90.0, throttle_temp_c=85.0, battery_pct=70.0, on_ac=True)
COOL = Readings(temp_c=45.0, throttle_temp_c=85.0, battery_pct=70.0, on_ac=True)
BG = {"x-edgeinfer-priority": "background"}


class Switch:
    def __init__(self, readings: Readings):
        self.now = readings

    def read(self) -> Readings:
        return self.now


@pytest.fixture(scope="module")
def hot_srv():
    model = edgeinfer.load(power=Policy("balanced", hold_s=0.0, max_tokens_per_s=200.0))
    sensors = Switch(HOT)
    model.power.sensors = sensors
    model.power.tick()
    r = Running(ServeConfig(api_key=KEY, slots=2, queue=2, max_tokens_limit=64), model)
    r.sensors = sensors
    yield r
    r.stop()
    model.power.stop()


def _set(srv, readings):
    """The device reads `readings` from now on: ticks until the controller's median of the last
    temperatures is theirs (one reading alone is taken for a glitch)."""
    from edgeinfer.power.controller import TEMP_MEDIAN_OF

    srv.sensors.now = readings
    for _ in range(TEMP_MEDIAN_OF):
        srv.server.model.power.tick()


def test_background_is_refused_while_hot_and_interactive_runs_paced(hot_srv):
    _set(hot_srv, HOT)
    cl = hot_srv.client()
    with pytest.raises(openai.APIStatusError) as e:
        cl.with_options(default_headers=BG).completions.create(model="stories260K-int8", prompt="Once", max_tokens=8)
    assert e.value.status_code == 503
    assert int(e.value.response.headers["retry-after"]) >= 1
    assert e.value.body["code"] == "power_background_refused" and "power plan" in e.value.body["message"]
    before = hot_srv.server.model.power.paced_s_total
    ok = cl.completions.create(model="stories260K-int8", prompt="Once", max_tokens=20, extra_body={"ignore_eos": True})
    assert ok.usage.completion_tokens == 20
    assert hot_srv.server.model.power.paced_s_total > before  # 200 tok/s cap: stories260K decodes faster


def test_background_is_admitted_when_cool(hot_srv):
    _set(hot_srv, COOL)
    cl = hot_srv.client().with_options(default_headers=BG)
    assert cl.completions.create(model="stories260K-int8", prompt="Once", max_tokens=4).usage.completion_tokens >= 1
    _set(hot_srv, HOT)


def test_health_and_metrics_show_readings_and_plan(hot_srv):
    _set(hot_srv, HOT)
    h = httpx.get(hot_srv.url + "/health", headers={"authorization": f"Bearer {KEY}"}).json()
    assert httpx.get(hot_srv.url + "/health").json()["power"] is None  # no key: no device details
    assert h["power"]["policy"] == "balanced" and h["power"]["readings"]["temp_c"] == 90.0
    assert h["power"]["plan"]["admit_background"] is False and h["power"]["plan"]["level"] == "hot"
    m = httpx.get(hot_srv.url + "/metrics", headers={"authorization": f"Bearer {KEY}"}).text
    assert "edgeinfer_power_temperature_celsius 90.0" in m
    assert "edgeinfer_power_plan_admit_background 0.0" in m
    assert "edgeinfer_power_plan_hot 1.0" in m


def test_bad_priority_header_is_a_400(hot_srv):
    r = httpx.post(hot_srv.url + "/v1/completions", json={"prompt": "Once", "max_tokens": 2},
                   headers={"authorization": f"Bearer {KEY}", "x-edgeinfer-priority": "urgent!!"})
    assert r.status_code == 400 and "x-edgeinfer-priority" in r.json()["error"]["message"]


def test_power_settings_are_checked():
    assert ServeConfig().power_policy() == Policy("balanced")
    assert ServeConfig(power="off").power_policy() is None
    assert ServeConfig(power="thermal-guard", max_temp_c=70).power_policy().max_temp_c == 70
    for bad in ({"power": "turbo"}, {"power": 3}, {"power": "off", "max_temp_c": 70},
                {"power": "battery", "min_battery_pct": 300}, {"power_budget_w": -1}):
        with pytest.raises(InvalidArgumentError):
            ServeConfig(**bad)


def test_power_settings_from_toml(tmp_path):
    f = tmp_path / "serve.toml"
    f.write_text('power = "battery"\nmin-battery-pct = 40\nmax-tokens-per-s = 12.5\n')
    c = load_config(str(f), {})
    assert c.power_policy() == Policy("battery", min_battery_pct=40, max_tokens_per_s=12.5)


def test_a_background_request_queued_while_cool_is_refused_at_its_slot_once_hot():
    """A hostile round: one admitted while cool waited in the queue, the device turned hot, and it ran
    anyway when its turn came, paced, holding the slot 18.7 s while a new background request got 503.
    The refusal now also applies when it reaches its slot: the same 503, Retry-After and code."""
    import threading
    import time

    model = edgeinfer.load(power=Policy("balanced", hold_s=0.0, max_tokens_per_s=20.0))
    sensors = Switch(COOL)
    model.power.sensors = sensors
    model.power.tick()
    r = Running(ServeConfig(slots=1, queue=2, max_tokens_limit=64), model)
    r.sensors = sensors
    try:
        got = {}

        def post(name, headers, n):
            got[name] = httpx.post(r.url + "/v1/completions", headers=headers, timeout=120,
                                   json={"model": "stories260K-int8", "prompt": "Once", "max_tokens": n,
                                         "ignore_eos": True})

        first = threading.Thread(target=post, args=("interactive", {}, 40))  # ~2 s at 20 tok/s: holds the slot
        first.start()
        deadline = time.monotonic() + 30
        while not r.server.scheduler.jobs and time.monotonic() < deadline:
            time.sleep(0.01)
        queued = threading.Thread(target=post, args=("background", BG, 4))
        queued.start()
        while len(r.server.scheduler.jobs) < 2 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert len(r.server.scheduler.jobs) == 2  # admitted while cool, now waiting for the slot
        _set(r, HOT)
        first.join()
        queued.join()
        assert got["interactive"].status_code == 200
        bg = got["background"]
        assert bg.status_code == 503 and bg.json()["error"]["code"] == "power_background_refused", bg.text
        assert int(bg.headers["retry-after"]) >= 1
    finally:
        r.stop()
        model.power.stop()
