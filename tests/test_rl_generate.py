"""Greedy decoding with a KV cache: against recomputation without a cache and the reference model."""
from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from parashift import models
from parashift.exec.reference import init_params, make_batch, reference_loss
from parashift.exec.rl.generate import _TP, greedy_generate, next_token_logits


@pytest.mark.parametrize("model", ["tiny-gpt", "tiny-moe"])
def test_cached_greedy_decoding_matches_recomputation_and_the_reference_model(model):
    spec = models.get(model)
    P = init_params(spec, 3)
    prompts = make_batch(spec, 0, 3, 5)[0]
    out = greedy_generate(spec, P, prompts, 7)
    assert out.shape == (3, 12) and torch.equal(out[:, :5], prompts)
    ce = 0.0
    for t in range(1, out.shape[1]):        # every prefix from scratch, no cache
        logits = next_token_logits(spec, P, out[:, :t], [[] for _ in range(spec.layers)], 0, _TP(None, 1, 0))
        if t >= 5:
            assert torch.equal(logits.argmax(-1), out[:, t])
        ce += float(F.cross_entropy(logits, out[:, t], reduction="sum"))
    ref = float(reference_loss(spec, P, out[:, :-1], out[:, 1:], out[:, 1:].numel()))
    assert abs(ce / out[:, 1:].numel() - ref) < 1e-5       # the same model as the training reference
    assert not torch.equal(out, greedy_generate(spec, init_params(spec, 4), prompts, 7))
