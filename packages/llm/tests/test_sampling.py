"""sampling.py: each setting against its definition, with seeded draws."""
import numpy as np
import pytest

from kiln.llm.sampling import Sampler, SamplingError, Stop

LOGITS = np.array([1.0, 3.0, 2.5, -1.0, 0.5, 3.0 - 1e-3])


def _draws(s: Sampler, n: int = 4000, history: tuple[int, ...] = ()) -> np.ndarray:
  return np.bincount([s.next(LOGITS, history) for _ in range(n)], minlength=LOGITS.size) / n


def test_greedy_is_argmax_and_top_k_1_or_a_tiny_top_p_is_greedy():
  assert Sampler().next(LOGITS) == 1
  assert Sampler(temperature=5.0, top_k=1, seed=3).next(LOGITS) == 1
  assert all(Sampler(temperature=2.0, top_p=1e-6, seed=s).next(LOGITS) == 1 for s in range(5))


def test_temperature_draws_follow_the_softmax_and_a_seed_repeats_them():
  t = 1.5
  p = np.exp(LOGITS / t) / np.exp(LOGITS / t).sum()
  freq = _draws(Sampler(temperature=t, seed=0))
  assert np.abs(freq - p).max() < 0.03  # 4000 draws: a standard error of at most 0.008 per token
  a, b = Sampler(temperature=1.0, seed=7), Sampler(temperature=1.0, seed=7)
  assert [a.next(LOGITS) for _ in range(50)] == [b.next(LOGITS) for _ in range(50)]


def test_top_k_and_top_p_keep_the_most_likely():
  assert set(np.flatnonzero(_draws(Sampler(temperature=1.0, top_k=3, seed=1), 2000))) == {1, 2, 5}
  p = np.exp(LOGITS) / np.exp(LOGITS).sum()  # sorted: 1 (0.352), 5 (0.352), 2 (0.213), ... top_p 0.8 needs three
  assert p[1] + p[5] < 0.8 <= p[1] + p[5] + p[2]
  freq = _draws(Sampler(temperature=1.0, top_p=0.8, seed=2), 3000)
  assert set(np.flatnonzero(freq)) == {1, 2, 5}
  kept = p[[1, 2, 5]] / p[[1, 2, 5]].sum()
  assert np.abs(freq[[1, 2, 5]] - kept).max() < 0.04


def test_repetition_penalty_divides_positive_and_multiplies_negative_logits():
  s = Sampler(repetition_penalty=2.0)
  assert s.next(LOGITS, history=[1, 5]) == 2  # 3.0 -> 1.5, 2.999 -> 1.4995: 2.5 wins
  x = np.array([-1.0, -1.5])
  assert Sampler(repetition_penalty=2.0).next(x, history=[0]) == 1  # -1 -> -2


@pytest.mark.parametrize("kw", [{"temperature": -1.0}, {"top_k": 0}, {"top_p": 0.0}, {"top_p": 1.5}, {"repetition_penalty": 0.0}])
def test_bad_settings_are_refused(kw: dict):
  with pytest.raises(SamplingError): Sampler(**kw)


def test_stop_ids_and_strings():
  text = {1: "Hel", 2: "lo", 3: " wor", 4: "ld", 0: "<eos>"}
  st = Stop.of(["lo w", 9], eos=[0], decode=lambda ids: "".join(text[i] for i in ids))
  assert st.ids == {0, 9} and st.strings == ("lo w",)
  assert not st.hit([1, 2]) and st.hit([1, 2, 3]) and st.hit([1, 0])
  assert st.trim("Hello world") == "Hel"
  with pytest.raises(SamplingError, match="tokenizer"): Stop.of("x", eos=[], decode=None)
  with pytest.raises(SamplingError): Stop.of([1.5], eos=[], decode=None)  # type: ignore[list-item]
