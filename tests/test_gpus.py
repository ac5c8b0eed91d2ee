"""The GPU table: one record per kind, read alike by presets, the cost model and device detection."""
from __future__ import annotations

import dataclasses
import json
import math

import pytest

import parashift as ps
from parashift import cluster as clusters, gpus
from parashift.cost import CostModel, CostModelError, gemm_time
from parashift.errors import ClusterError, UnknownGPUError, UnknownPresetError
from parashift.exec.switch.session import switch_cluster

KINDS = [g for g in gpus.GPUS.values() if g.name != "cpu"]


@pytest.mark.parametrize("g", KINDS, ids=[g.name for g in KINDS])
def test_every_record_is_sane(g):
    rates = [g.peak(d) for d in ("fp32", "tf32", "bf16")]
    assert 0 < rates[0] <= rates[1] <= rates[2] == g.peak("fp16") == g.peak_flops
    if g.has("fp8"):
        assert g.peak("fp8") == pytest.approx(2 * g.peak("bf16"), rel=0.01)   # fp8 units: twice the bf16 rate
    if g.has("fp4"):
        assert g.has("fp8") and g.peak("fp4") == pytest.approx(2 * g.peak("fp8"))
    assert 8 * 2**30 < g.memory < 300e9 and 0.5e12 < g.hbm_bw < 10e12 and 100 < g.power <= 1200
    assert 0 < g.gemm_sustained <= 1 and 0 < g.clock <= 1
    assert g.sustained("bf16") == pytest.approx(g.peak("bf16") * g.gemm_sustained * g.clock)
    assert 1 <= g.nvlink_domain <= g.node and g.nics_per_node <= g.node and 10e9 <= g.nic_bw <= 100e9
    assert 50e9 <= g.intra_bw <= 900e9 and g.intra_latency < g.inter_latency < 1e-4
    assert g.family in ("a100", "h100", "h200", "datasheet")
    # a node that is one NVLink domain talks inside at several times its NIC share; a PCIe node does not
    assert (g.nvlink_domain == g.node) == (g.intra_bw > 2 * g.inter_bw) == (g.intra_bw >= 150e9)


def test_the_records_keep_the_relations_of_their_datasheets():
    G = gpus.GPUS
    assert G["h800"].intra_bw == G["a800"].intra_bw == G["h100"].intra_bw * 4 / 9      # 400 of 900 GB/s
    assert G["h800"].peak("fp8") == G["h100"].peak("fp8") and G["h200"].peak_flops == G["h100"].peak_flops
    assert G["gb200"].nvlink_domain == G["gb200"].node == 72 and G["b200"].nvlink_domain == 8
    assert G["gb200"].inter_bw == G["b200"].inter_bw == G["h100"].inter_bw      # one 400 Gb/s NIC per GPU
    assert not G["a100"].has("fp8") and not G["h100"].has("fp4") and G["b200"].has("fp4")
    with pytest.raises(ClusterError, match="GPU a100 has no fp8 units .*h100.*peak_fp8=") as e:   # not bf16's rate
        G["a100"].peak("fp8")
    assert "\n" not in str(e.value) and clusters.get("a100-1x8:peak_fp8=624T").gpu.peak("fp8") == 624e12
    with pytest.raises(ClusterError, match="unknown dtype 'int3'"):
        G["h100"].has("int3")
    assert G["a800"].inter_bw == G["a100"].inter_bw / 2          # 4 NICs for 8 GPUs
    assert [g.name for g in KINDS if not g.has("fp8")] == ["a100", "a100-40gb", "a800", "v100", "v100-16gb"]


def test_a_power_cap_lowers_the_clock_by_the_dies_power_law():
    """The H100 at 500 W: the exponent comes from the SXM (700 W, 132 SMs) and PCIe (350 W, 114 SMs)
    datasheet points of the same die; the peaks stay the datasheet's, compute-bound kernels slow by
    the clock, memory-bound ones do not."""
    h, pcie, cap = gpus.GPUS["h100"], gpus.GPUS["h100-pcie"], gpus.GPUS["h100-500w"]
    k = math.log(350 / 114 / (700 / 132)) / math.log(756 / 114 / (989 / 132))
    assert 4.4 < k < 4.6 and cap.clock == pytest.approx((500 / 700) ** (1 / k)) == pytest.approx(0.928, abs=1e-3)
    assert cap.peak_flops == h.peak_flops and cap.power == 500 and cap.aliases == ()
    assert cap.sustained("fp8") == pytest.approx(h.sustained("fp8") * cap.clock)
    cm, cmc = CostModel.for_gpu(h), CostModel.for_gpu(cap)
    assert cmc.peak_flops == cm.peak_flops and cmc.gemm_efficiency == pytest.approx(cm.gemm_efficiency * cap.clock)
    big = gemm_time(cm, 16384, 16384, 16384)
    assert gemm_time(cmc, 16384, 16384, 16384) / big == pytest.approx(1 / cap.clock, rel=0.01)
    assert gemm_time(cmc, 1, 8192, 8192) == gemm_time(cm, 1, 8192, 8192)       # a GEMV: HBM-bound
    with pytest.raises(ClusterError, match="between 0 and the rated power"):
        gpus.power_capped(h, 800, "h100-800w", pcie)


def test_the_cost_model_prices_each_dtype_at_its_records_rate_and_never_borrows_another_gpus():
    h = CostModel.for_cluster(clusters.get("h100-1x8"))
    assert h.peak("fp8") == 1979e12 and h.peak("bf16") == h.peak_flops and h.peak("tf32") == 494e12
    m = n = k = 8192
    assert gemm_time(h, m, n, k, 1, h.peak("fp8")) == pytest.approx(gemm_time(h, m, n, k, 2, h.peak("bf16")) / 2, rel=0.02)
    b = CostModel.for_cluster(clusters.get("b200-1x8"))
    assert b.peak("fp4") == 9e15 and b.gemm_sustained == 1.0 and b.link_efficiency["intra"] == 0.8
    a = CostModel.for_cluster(clusters.get("a100-40gb-1x8"))
    assert a.gemm_sustained == CostModel.for_cluster(clusters.get("a100-1x8")).gemm_sustained < 0.81
    with pytest.raises(CostModelError, match="no fp8 rate") as e:
        a.peak("fp8")
    assert "\n" not in str(e.value)
    with pytest.raises(CostModelError, match="family 'z9'"):
        CostModel.for_gpu(dataclasses.replace(gpus.GPUS["h100"], family="z9"))
    # H800: 400 GB/s bidirectional NVLink at the measured 80% link efficiency is the 160 GB/s DeepSeek-V3 reports
    assert CostModel.for_cluster(clusters.get("h800-1x8")).link_bw("intra") == pytest.approx(160e9)


def test_nvl72_is_one_nvlink_domain_of_72_with_a_nic_per_gpu(tmp_path):
    c = clusters.get("gb200-nvl72")
    assert (c.nodes, c.per_node, c.devices, c.nics_per_node, c.inter_bw) == (1, 72, 72, 72, 50e9)
    assert c.with_devices(144).name == "gb200-2x72" and clusters.get("gb200-4x72").devices == 288
    assert clusters.get("gb200-nvl72:nic_bw=800Gb").nic_bw == 100e9
    with pytest.raises(ClusterError, match="joins at most 8 devices.*use b200-9x8") as e:    # not an NVL72
        clusters.get("b200-1x72")
    assert "\n" not in str(e.value) and clusters.get("b200-1x8:per_node=72").per_node == 72
    assert clusters.get("h100-pcie-1x16").per_node == 16                                        # PCIe: no domain
    hosted = clusters.get("b200-1x8").on_hosts([0] * 16 + [1] * 8)        # a host map's name round-trips
    assert clusters.get(hosted.name) == hosted and hosted.name == "b200-1x16:hosts=16+8"
    for bad in ("gb200-nvl8", "h100-nvl72", "b200-nvl72"):
        with pytest.raises(UnknownPresetError, match="gb200-nvl72"):
            clusters.get(bad)
    f = tmp_path / "rack.json"
    f.write_text(json.dumps({"gpu": "gb200", "nodes": 2, "per_node": 72}))
    assert clusters.get(str(f)).devices == 144
    f.write_text(json.dumps({"gpu": "z900", "nodes": 2, "per_node": 72}))
    with pytest.raises(ClusterError, match="unknown gpu 'z900'"):
        clusters.get(str(f))


def test_every_kind_has_a_preset_and_each_preset_simulates_a_small_strategy():
    names = [n for n in clusters.names() if n != "cpu-local"]
    assert {clusters.get(n).gpu.name for n in names} == set(gpus.GPUS) - {"cpu"}
    small = ps.models.gpt(4, 512, 8, ffn=2048, vocab=4096, seq_len=256, name="g-gpt")
    program = ps.ir.compile(small, "dp=2,pp=2,tp=2", global_batch=8)
    for n in names:
        r = ps.sim.simulate(program, clusters.get(n), model=small)
        assert r.fits and 0 < r.step_time < 1, n
    # a compute-bound step: faster tensor cores, HBM and links run it faster, in the datasheets' order
    big = ps.models.gpt(8, 8192, 64, ffn=32768, vocab=32768, seq_len=2048, name="g-big")
    program = ps.ir.compile(big, "pp=2,tp=4", global_batch=16)
    t = {g: ps.sim.simulate(program, clusters.get(f"{g}-1x8"), model=big).step_time
         for g in ("gb200", "b200", "mi300x", "h200", "h100", "h100-500w", "h800", "h100-nvl", "h100-pcie", "a100",
                   "a100-40gb", "v100")}
    assert list(t) == sorted(t, key=t.get)
    assert t["h100-500w"] / t["h100"] == pytest.approx(1 / gpus.GPUS["h100-500w"].clock, rel=0.05)
    assert t["b200"] / t["h100"] < 0.5 and t["h100"] / t["a100"] < 0.5


@pytest.mark.parametrize("alias,kind", [(a, g.name) for g in gpus.GPUS.values() for a in g.aliases])
def test_detection_by_every_alias(alias, kind):
    assert gpus.by_device_name(alias).name == kind
    assert gpus.by_device_name(f"  {alias.lower().replace(' ', '_')} ").name == kind
    c = switch_cluster("cuda", alias, count=4)
    assert c.gpu.name == kind and c.devices == 4


def test_aliases_are_unique_and_unknown_names_fail_in_one_line():
    aliases = [a.upper() for g in gpus.GPUS.values() for a in g.aliases]
    assert len(aliases) == len(set(aliases))
    for name in ("NVIDIA H800 PCIe", "NVIDIA A100 80GB PCIe", "Tesla K80", "NVIDIA GeForce RTX 4090"):
        with pytest.raises(UnknownGPUError, match="--switch-cluster PRESET") as e:
            switch_cluster("cuda", name)
        assert name in str(e.value) and "\n" not in str(e.value)
    with pytest.raises(UnknownGPUError, match="unknown GPU kind 'k80'"):
        gpus.get("k80")
    assert gpus.get(" H100 ") is gpus.GPUS["h100"]


def test_clusters_command_shows_every_kind(capsys):
    from parashift.cli import main
    assert main(["clusters", "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert {r["gpu"] for r in rows} == set(gpus.GPUS)
    nvl = next(r for r in rows if r["name"] == "gb200-nvl72")
    assert nvl["devices"] == 72 and nvl["peak_fp8"] == 5e15


def test_calibration_never_fits_a_gpus_datasheet_rates():
    from parashift.calibrate.params import compute_candidates
    cm = CostModel.for_cluster(clusters.get("b200-1x8"))
    assert cm.dtype_peaks and not [p for p in compute_candidates(cm) if p.field == "dtype_peaks"]
