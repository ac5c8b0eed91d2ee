"""Switches whose pieces land at offsets that are not 8-byte aligned (odd DP sizes under ZeRO).

Regression: the transfer checksum once depended on the buffer's alignment, so a zero-copy receive
into an odd offset of the new store disagreed with the sender and every such switch rolled back.
"""
from __future__ import annotations

import torch

from parashift.exec.switch import checksum, run_live

from test_switch_live import GPT, check_switches


def test_checksum_depends_on_bytes_not_alignment():
    base = torch.arange(64, dtype=torch.float32)
    odd = base[1:33]                      # 4-byte aligned view
    assert odd.data_ptr() % 8 == 4
    assert checksum(odd) == checksum(odd.clone())
    assert checksum(odd) != checksum(base[2:34])


def test_tp_merge_in_many_small_parts_is_bit_exact():
    """Parts of 512 bytes: packed pieces (column halves of row-parallel weights) travel in many
    parts, each checksummed on both ends and folded per transfer."""
    chain = [(1, "tp=4", None), (2, "tp=2,dp=2,zero=1", (3, 2, 1, 0))]
    res = run_live(GPT, "tp=2,dp=2,zero=1", steps=3, switches=chain, export=True, timeout=240, switch_timeout=30,
                   big_piece=256, message_part=512, placement="given")
    assert [s.get("aborted") for s in res.switches] == [None] * len(chain)
    assert check_switches(GPT, res) == len(chain)
    packed = [sw["phases"]["pack"] for r in res.reports.values() if r for sw in r.get("switches", [])]
    assert max(packed) > 0


def test_shrink_4_to_3_under_zero_is_bit_exact():
    chain = [(1, "dp=3,zero=1", (0, 1, 2)), (2, "dp=2,zero=2", (0, 2))]
    res = run_live(GPT, "dp=4,zero=1", steps=4, switches=chain, global_batch=12, export=True, timeout=240,
                   switch_timeout=30, big_piece=256)
    assert [s.get("aborted") for s in res.switches] == [None] * len(chain)
    assert check_switches(GPT, res) == len(chain)
