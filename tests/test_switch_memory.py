"""Switch memory and transfer helpers: the state budget check, staging accounting, checksums of parts."""
from __future__ import annotations

import pytest
import torch

from parashift import models
from parashift.errors import MemoryBudgetError
from parashift.exec.switch import BufferPool, checksum, state_alloc
from parashift.exec.switch.wire import PartSums, fold, parts
from parashift.vps.transition import plan_live_switch
from parashift.strategy import Strategy

GPT = models.gpt(2, 64, 4, kv_heads=4, ffn=128, vocab=256, seq_len=16, name="sw-mem", dtype="fp32", pad_vocab=8)


def test_a_budget_below_the_new_state_is_refused_before_anything_moves():
    src, dst = Strategy.parse("dp=2,tp=2,zero=1"), Strategy.parse("tp=4")
    ok = plan_live_switch(GPT, src, dst, (0, 1, 2, 3), (0, 1, 2, 3), memory_budget=2**30)
    assert ok.program.meta["stages"] == 1 and not ok.staged
    with pytest.raises(MemoryBudgetError, match="needs"):
        plan_live_switch(GPT, src, dst, (0, 1, 2, 3), (0, 1, 2, 3), memory_budget=20_000)
    # a per-device budget only binds the devices it names
    assert not plan_live_switch(GPT, src, dst, (0, 1, 2, 3), (0, 1, 2, 3), memory_budget={7: 1}).staged


def test_pool_counts_bytes_in_use_and_reuses_buffers():
    pool = BufferPool()
    a, b = pool.get(1 << 20), pool.get(1 << 10)
    assert (pool.in_use, pool.peak, pool.held) == ((1 << 20) + (1 << 10),) * 3
    pool.put(a)
    assert pool.in_use == 1 << 10 and pool.peak == (1 << 20) + (1 << 10)
    assert pool.get(1 << 20).data_ptr() == a.data_ptr()          # reused, not reallocated
    assert pool.allocated == (1 << 20) + (1 << 10)
    pool.reset_peak()
    assert pool.peak == pool.in_use
    pool.put(b)
    pool.clear()
    assert pool.held == 1 << 20                                   # the buffer still in use stays counted


def test_parts_checksums_agree_across_alignments_and_catch_a_flipped_byte():
    base = torch.arange(3 * 1024 + 7, dtype=torch.float32)
    src = [base[1:1 + 2000].view(torch.uint8), base[10:10 + 9].view(torch.uint8)]     # 4-byte aligned views
    dst = [t.clone() for t in src]                                                     # 8-byte aligned copies

    def total(msgs):
        h = 0
        for m in parts(msgs, 1000):
            h = fold(h, checksum(m))
        return h
    assert [m.numel() for m in parts(src, 1000)] == [1000] * 8 + [36]
    assert total(src) == total(dst)
    dst[1][3] ^= 1
    assert total(src) != total(dst)
    assert total(src) != total(list(reversed(src)))                # the fold depends on the order


def test_checksum_wraps_alike_on_the_aligned_and_the_misaligned_path():
    words = torch.randint(-2**62, 2**62, (4096,), dtype=torch.int64, generator=torch.Generator().manual_seed(0))
    aligned = words.view(torch.uint8)
    shifted = torch.cat([torch.zeros(4, dtype=torch.uint8), aligned])[4:]     # same bytes, 4 mod 8
    assert aligned.data_ptr() % 8 == 0 and shifted.data_ptr() % 8 == 4
    assert checksum(aligned) == checksum(shifted)


def test_sums_taken_while_packing_equal_the_part_checksums_and_catch_a_flipped_byte():
    g = torch.Generator().manual_seed(1)
    for n, chunk, off in [(0, 64, 0), (5, 64, 0), (1000, 64, 0), (1003, 64, 0), (1003, 100, 4), (4096, 13, 3),
                          (12345, 4096, 0)]:
        base = torch.randint(0, 256, (n + 8,), dtype=torch.uint8, generator=g)
        msg = base[off:off + n]
        want = [checksum(p) for p in parts([msg], chunk)]
        hot = PartSums(msg, chunk)
        for end in torch.randint(0, n + 1, (5,), generator=g).sort().values.tolist():   # written in order
            hot.upto(end)
        assert hot.values() == want, (n, chunk, off)
        if n:
            msg[n // 2] ^= 1
            assert PartSums(msg, chunk).values() != want


def test_state_alloc_returns_zeroed_buffers():
    t = state_alloc(3 << 20, torch.float32, torch.device("cpu"))
    assert t.dtype == torch.float32 and t.numel() == 3 << 20 and not t.any()
