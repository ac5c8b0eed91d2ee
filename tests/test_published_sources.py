"""Every published table under ``traces/published/``: the columns the benchmark reads, a source named in
PROVENANCE.md, step times that follow from the published figure, and the benchmark's report on a few rows."""
from __future__ import annotations

import re
import sys
from pathlib import Path

import pandas as pd
import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import fidelity_published as fp  # noqa: E402

PROVENANCE = (fp.DATA / "PROVENANCE.md").read_text()


def _section(file: str) -> str:
    """The PROVENANCE.md section headed by ``file``."""
    m = re.search(rf"^## {re.escape(file)}\b.*?(?=^## |\Z)", PROVENANCE, flags=re.M | re.S)
    assert m, f"PROVENANCE.md has no section for {file}"
    return m.group(0)


def test_every_csv_has_the_columns_and_sane_values():
    files = sorted(p.name for p in fp.DATA.glob("*.csv"))
    assert len(files) >= 6
    df = fp.load()
    assert set(df.file) == set(files) and len(df) >= 400
    for c in (*fp.COLUMNS, *fp.OPTIONAL):
        assert c in df.columns
        assert df[c].notna().all(), c
    assert (df.step_seconds > 0).all() and (df.gpus >= 1).all()
    assert (df.global_batch >= 1).all() and (df.seq_len >= 1).all()
    assert (df.job != "").all()


def test_every_rows_source_is_named_in_provenance():
    """Each row's source carries an arXiv id or a repository commit, and its file's PROVENANCE section names it."""
    for file, g in fp.load().groupby("file"):
        sec = _section(file)
        for src in g.source.unique():
            keys = re.findall(r"arXiv:\d{4}\.\d{4,5}|\b[0-9a-f]{12}\b", src)
            assert keys, f"{file}: source {src!r} names no arXiv id or commit"
            for k in keys:
                assert k in sec, f"{file}: {k} of {src!r} is not in its PROVENANCE section"


_FORMULAS = {   # the `derived` column's formula -> step seconds from the published figure
    "global_batch*seq_len/throughput_tokens_per_s": lambda r, x: r.global_batch * r.seq_len / x,
    "global_batch*seq_len/(tokens_per_s_per_gpu*gpus)": lambda r, x: r.global_batch * r.seq_len / (x * r.gpus),
    "global_batch/(samples_per_gpu_per_s*gpus)": lambda r, x: r.global_batch / (x * r.gpus),
}


def test_derived_step_times_follow_from_the_published_figures():
    df = fp.load()
    rows = df[df.derived != ""]
    assert len(rows) >= 400
    for _, r in rows.iterrows():
        formula, _, rest = r.derived.partition(" (")
        x = float(re.match(r"[\d.]+", rest).group(0))
        assert r.step_seconds == pytest.approx(_FORMULAS[formula](r, x), rel=1e-4), r["name"]


def test_llmfoundry_times_give_the_tables_mfu():
    """MPT's MFU formula (6N per token plus 6 l s d of attention per token) over the derived step time."""
    df = fp.load("llmfoundry")
    for _, r in df[df.precision == "bf16"].head(40).iterrows():
        spec = dict(kv.split("=") for kv in r.model.split(":", 1)[1].split(","))
        L, d, V, s = int(spec["layers"]), int(spec["hidden"]), int(spec["vocab"]), r.seq_len
        n = L * (12 * d * d + 13 * d) + V * d + s * d + 2 * d   # MPT parameter count (biases, LN, learned positions)
        flops = (6 * n * s + 12 * L * d * s * s) * r.global_batch
        peak = 989e12 if r.cluster.startswith("h100") else 312e12
        assert flops / (r.step_seconds * r.gpus * peak) == pytest.approx(r.measured_mfu, rel=0.02), r["name"]


def _res(rows):
    return pd.DataFrame([{"job": j, "schedule": s, "measured_s": m, "predicted_s": p, "expressed": e,
                          "strategy": f"dp={i + 1}", "cluster": "a100-1x8"} for i, (j, s, m, p, e) in enumerate(rows)])


def test_pairs_count_order_above_the_gap_and_schedule_pairs():
    res = _res([("a", "1F1B", 10.0, 9.0, True), ("a", "ZB-1p", 9.0, 9.5, True),     # 11% gap, ordered wrong
                ("a", "ZB-V", 9.8, 8.0, True),        # 2% from 1F1B: below the gap; 9% from ZB-1p, ordered wrong
                ("b", "", 4.0, 4.0, True), ("b", "", 5.0, 4.5, True),               # 25% gap, ordered right
                ("c", "1F1B", 3.0, float("nan"), False), ("c", "ZB-2p", 2.0, 1.0, True)])
    jp = fp.pairs(res, 0.05)
    assert (jp["pairs_measured"], jp["pairs_expressed"], jp["ordered_right"]) == (4, 3, 1)
    assert jp["fraction_right"] == pytest.approx(1 / 3) and jp["same_plan_pairs_left_out"] == 0
    res.loc[4, "strategy"] = res.loc[3, "strategy"]       # job b's two rows: one plan (e.g. with and without compile)
    assert fp.pairs(res, 0.05)["same_plan_pairs_left_out"] == 1 and fp.pairs(res, 0.05)["pairs_measured"] == 3
    sp = fp.pairs(res, schedules=True)
    assert (sp["pairs_measured"], sp["pairs_expressed"], sp["ordered_right"]) == (4, 3, 1)
    assert sp["by_pair"]["1F1B vs ZB-V"] == {"pairs": 1, "ordered_right": 1}
    assert sp["by_pair"]["1F1B vs ZB-1p"] == {"pairs": 1, "ordered_right": 0}


def test_report_per_source_on_five_rows():
    """Two expressible Korthikanti rows of one job, two zero-bubble rows of one job (uneven stages: not expressed
    yet) and one small llm-foundry run: the per-source report counts each and names why rows were left out."""
    df = fp.load("korthikanti,zerobubble,llmfoundry")
    kor = df[df.file.str.startswith("korthikanti") & df["name"].str.startswith("gpt-22B")]
    zb = df[df.file.str.startswith("zerobubble") & (df.job == "zb-1.5B/8gpu/gbs144/seq1024")].head(2)
    mpt = df[df.file.str.startswith("llmfoundry") & (df.gpus == 8) & df["name"].str.startswith("mpt-125m")
             & df.cluster.str.startswith("a100-1x8")].head(1)
    sub = pd.concat([kor, zb, mpt])
    assert len(sub) == 5
    rep = fp.report(fp.evaluate(sub, progress=False))
    k, z, m = (rep["by_file"][f] for f in ("korthikanti_2022_table5.csv", "zerobubble_2024_tables4_6_7.csv",
                                           "llmfoundry_mpt_benchmarks.csv"))
    assert (k["rows"], k["rows_expressed"], z["rows"], z["rows_expressed"], m["rows_expressed"]) == (2, 2, 2, 0, 1)
    assert k["within_job_pairs"]["pairs_expressed"] == 1 and 0 <= k["median_ape"] < 0.5
    assert z["schedule_pairs"]["pairs_measured"] == 1 and z["schedule_pairs"]["pairs_expressed"] == 0
    assert sum(z["not_expressed"].values()) == 2 and all(r.startswith("strategy:") for r in z["not_expressed"])
    assert z["blockers"] == {"strategy uneven_stages": 2}      # zb-1p and zb-2p are registered schedules now
    assert rep["overall"]["rows"] == 5 and rep["overall"]["rows_expressed"] == 3
    assert "| overall | 5 | 3 |" in fp.table(rep)
