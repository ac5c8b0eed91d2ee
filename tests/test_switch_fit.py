"""Item 7 of #20: a switch whose peak exceeds device memory is flagged, and staging is chosen under
the device's memory when no budget is given (`plan --json`, the live job's plan)."""
import json

import numpy as np
import pytest
from hypothesis import given, settings, strategies as hs

from parashift import models, vps
from parashift.cli import main
from parashift.vps.transition import assign_stages, budget_array, check_fit, live_fit, stage_peaks, state_buffers

GiB = 2**30
GPT = models.gpt(4, 64, 4, kv_heads=4, ffn=128, vocab=256, seq_len=16, name="fit-gpt", dtype="fp32", pad_vocab=8)


def _plan(capsys, memory: str, *extra: str) -> dict:
    assert main(["plan", "--model", "llama2-7b", "--src", "dp=1,tp=8", "--dst", "dp=2,tp=4",
                 "--cluster", f"a800-1x8:memory={memory}", "--json", *extra]) == 0
    return json.loads(capsys.readouterr().out)


def test_plan_json_flags_a_switch_that_does_not_fit_with_its_numbers(capsys):
    one = _plan(capsys, "80GiB")        # fits in one stage: no staging chosen
    assert one["fits"] and one["memory_budget"] is None and one["budget_auto"]
    assert one["device_memory"] == 80 * GiB and 40 * GiB < one["peak_bytes"] <= 80 * GiB
    small = _plan(capsys, "12GiB")      # the new layout alone (about 22 GiB a device) cannot fit
    assert small["fits"] is False and small["device_memory"] == 12 * GiB
    assert small["peak_bytes"] == one["peak_bytes"] > small["device_memory"]
    assert "more than its budget of 12.00 GiB" in small["fit_problem"]


def test_plan_stages_automatically_under_the_device_memory(capsys):
    one = _plan(capsys, "80GiB")
    auto = _plan(capsys, "30GiB")
    assert auto["budget_auto"] and auto["memory_budget"] == 30 * GiB and auto["stages"] > 1
    assert auto["fits"] and auto["peak_bytes"] <= 30 * GiB < one["peak_bytes"]
    given_ = _plan(capsys, "30GiB", "--switch-memory-budget", "40GiB")   # the user's budget wins
    assert not given_["budget_auto"] and given_["memory_budget"] == 40 * GiB
    assert given_["fits"] is False and given_["peak_bytes"] > 30 * GiB    # ... and is flagged when over memory


@settings(max_examples=15, deadline=None)
@given(frac=hs.floats(0.3, 1.0))
def test_stage_peaks_stay_under_the_budget_and_one_stage_is_everything_at_once(frac):
    plan = vps.plan_switch("llama2-7b", "dp=1,tp=8", "dp=2,tp=4", cluster="a800-1x8")
    buf = state_buffers(plan)
    one = stage_peaks(assign_stages(plan, None, buf))
    # brute force: one stage holds every old buffer, every new one not reused in place, and all staging
    want = np.bincount(buf.dev, weights=buf.old + np.where(buf.reused, 0, buf.new) + buf.sent + buf.received)
    assert np.allclose(one, want)
    budget = float(one.max()) * frac
    try:
        st = assign_stages(plan, budget_array(budget, len(one)), buf)
    except Exception:
        assert not check_fit(plan, budget)["fits"]
        return
    assert np.all(stage_peaks(st) <= budget + 1e-6)
    assert check_fit(plan, budget)["fits"]


def test_live_switch_stages_under_the_process_memory_when_no_budget_is_given():
    devs = (0, 1, 2, 3)
    whole = live_fit(GPT, "tp=4", "dp=4", devs, devs, device_memory=2**40)
    assert whole["fits"] and whole["memory_budget"] is None and whole["stages"] == 1
    mem = int(whole["peak_bytes"] * 0.8)
    auto = live_fit(GPT, "tp=4", "dp=4", devs, devs, device_memory=mem)
    assert auto["fits"] and auto["memory_budget"] == mem and auto["stages"] > 1 and auto["peak_bytes"] <= mem
    tiny = live_fit(GPT, "tp=4", "dp=4", devs, devs, device_memory=1024)
    assert tiny["fits"] is False and tiny["memory_budget"] is None and tiny["peak_bytes"] > 1024
    planned = vps.transition.plan_live_switch(GPT, "tp=4", "dp=4", devs, devs, memory_budget=auto["memory_budget"])
    assert planned.program.meta["stages"] == auto["stages"] > 1
