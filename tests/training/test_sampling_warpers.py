"""action=generate's sampling (training/hf/generate.py next_token) against transformers' own logits warpers,
applied in the order transformers' generate applies them (temperature, top-k, top-p): for random logits and
a grid of settings, the distribution next_token draws from keeps exactly the tokens the warpers keep, with the
same probabilities, and greedy is the argmax."""

from __future__ import annotations

import itertools

import pytest
import torch

from training.contract.config import GenerateConfig
from training.hf import generate as hf_generate

transformers = pytest.importorskip("transformers", reason="transformers is in the test extra: pip install -e .[test]")


def _reference(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    warpers = [transformers.TemperatureLogitsWarper(temperature)]
    if top_k > 0:
        warpers.append(transformers.TopKLogitsWarper(top_k))
    if top_p < 1.0:
        warpers.append(transformers.TopPLogitsWarper(top_p))
    scores = logits[None].clone()
    for w in warpers:
        scores = w(torch.zeros(1, 1, dtype=torch.long), scores)
    return scores[0].softmax(-1)


def _drawn_from(logits: torch.Tensor, g: GenerateConfig, monkeypatch) -> torch.Tensor:
    seen = []
    real = torch.multinomial

    def spy(probs, n, generator=None):
        seen.append(probs.detach().clone())
        return real(probs, n, generator=generator)

    monkeypatch.setattr(torch, "multinomial", spy)
    token = hf_generate.next_token(logits, g, torch.Generator().manual_seed(0))
    monkeypatch.setattr(torch, "multinomial", real)
    (probs,) = seen
    assert probs[token] > 0  # the draw is one of the kept tokens
    return probs


@pytest.mark.parametrize("vocab", [50, 1000])
def test_sampling_keeps_what_transformers_warpers_keep(vocab, monkeypatch):
    gen = torch.Generator().manual_seed(vocab)
    settings = itertools.product([0.7, 1.0, 1.6], [0, 1, 5, vocab - 1], [1.0, 0.9, 0.5, 0.05])
    for temperature, top_k, top_p in settings:
        logits = torch.randn(vocab, generator=gen) * 3
        g = GenerateConfig(greedy=False, temperature=temperature, top_k=top_k, top_p=top_p)
        ours = _drawn_from(logits, g, monkeypatch)
        want = _reference(logits, temperature, top_k, top_p)
        case = (temperature, top_k, top_p)
        assert torch.equal(ours > 0, want > 0), case
        assert torch.allclose(ours, want, atol=1e-6, rtol=1e-5), case


def test_greedy_is_the_argmax():
    logits = torch.randn(300, generator=torch.Generator().manual_seed(3))
    assert hf_generate.next_token(logits, GenerateConfig(greedy=True), torch.Generator()) == int(logits.argmax())
