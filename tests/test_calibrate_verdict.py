"""The calibration verdict: held-out step-time error against the probes' own measurement noise."""
import math

from hypothesis import given, strategies as st

from parashift.calibrate.verdict import Verdict, step_noise


def test_within_twice_the_noise_is_as_good_as_the_measurements_allow():
    v = Verdict(("dp=2", "pp=2"), (0.100, 0.200), (0.104, 0.190), (0.03, 0.05))
    assert math.isclose(v.held_out_ape, (0.04 + 0.05) / 2) and math.isclose(v.noise_level, 0.04)
    assert v.ok and "as well as these measurements allow" in v.text()


def test_beyond_the_noise_the_verdict_says_what_to_do():
    v = Verdict(("dp=2", "pp=2"), (0.100, 0.200), (0.300, 0.050), (0.01, 0.01))
    assert not v.ok and "--runs" in v.text() and "more than 2x" in v.text()
    assert v.to_json()["probes"][0]["held_out_predicted"] == 0.300


@given(st.lists(st.floats(0.001, 10.0), min_size=1, max_size=20))
def test_step_noise_is_the_median_relative_deviation(times):
    med = sorted(times)[len(times) // 2] if len(times) % 2 else None
    n = step_noise(times)
    assert n >= 0 and (len(times) > 1 or n == 0)
    if med is not None and len(set(times)) == 1:
        assert n == 0
