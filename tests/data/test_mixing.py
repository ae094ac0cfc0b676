"""Tests of ktx.data.mixing: rates, largest-remainder counts and the annealed schedule."""

import numpy as np
import pytest

from ktx.data import mixing


def test_proportional_with_cap():
    np.testing.assert_allclose(mixing.proportional_rates([100, 300]), [0.25, 0.75])
    # cap 200: min(100, 200)=100, min(300, 200)=200 -> 1/3, 2/3.
    np.testing.assert_allclose(mixing.proportional_rates([100, 300], cap=200), [1 / 3, 2 / 3])


def test_temperature_and_equal():
    # T=2: sqrt(100)=10, sqrt(400)=20 -> 1/3, 2/3.
    np.testing.assert_allclose(mixing.temperature_rates([100, 400], temperature=2), [1 / 3, 2 / 3])
    np.testing.assert_allclose(mixing.temperature_rates([100, 400], temperature=1), [0.2, 0.8])
    # Default T=10 (HyperFormer): 100**0.1 / (100**0.1 + 400**0.1).
    expected = 100**0.1 / (100**0.1 + 400**0.1)
    np.testing.assert_allclose(mixing.temperature_rates([100, 400])[0], expected)
    np.testing.assert_allclose(mixing.equal_rates(4), [0.25] * 4)


def test_annealed_alpha_pals():
    assert mixing.annealed_alpha(1, 5) == 1.0
    assert mixing.annealed_alpha(3, 5) == pytest.approx(0.6)
    assert mixing.annealed_alpha(5, 5) == pytest.approx(0.2)
    assert mixing.annealed_alpha(9, 5) == pytest.approx(0.2)
    assert mixing.annealed_alpha(1, 1) == 1.0
    # epoch 3 of 5: alpha 0.6 -> 100**0.6 : 400**0.6.
    r = mixing.annealed_rates([100, 400], 3, 5)
    np.testing.assert_allclose(r[1] / r[0], 4**0.6)


def test_largest_remainder_counts_hand_computed():
    assert mixing.largest_remainder_counts([0.5, 0.3, 0.2], 4) == (2, 1, 1)  # 2.0 1.2 0.8
    assert mixing.largest_remainder_counts([1, 1, 1], 4) == (2, 1, 1)  # tie -> lower index
    assert mixing.largest_remainder_counts([0.97, 0.03], 8) == (8, 0)  # 7.76, 0.24
    assert mixing.largest_remainder_counts([0.97, 0.03], 8, min_count=1) == (7, 1)
    assert mixing.largest_remainder_counts([0.0, 1.0], 3, min_count=1) == (0, 3)
    rng = np.random.default_rng(0)
    for _ in range(50):
        r = rng.random(rng.integers(1, 9))
        b = int(rng.integers(1, 300))
        c = np.array(mixing.largest_remainder_counts(r, b))
        assert c.sum() == b
        assert np.all(np.abs(c - r / r.sum() * b) < 1)


def test_largest_remainder_errors():
    with pytest.raises(ValueError, match="batch_size=0"):
        mixing.largest_remainder_counts([1.0], 0)
    with pytest.raises(ValueError, match="at least one rate"):
        mixing.largest_remainder_counts([0.0, 0.0], 4)
    with pytest.raises(ValueError, match="more than batch_size=2"):
        mixing.largest_remainder_counts([1, 1, 1], 2, min_count=1)
    with pytest.raises(ValueError, match=">= 0"):
        mixing.largest_remainder_counts([1, -1], 2)


def test_schedule_constant_and_cursor():
    sched = mixing.Mixing("proportional").schedule([30, 10], 4)
    assert sched.counts_at(0) == (3, 1) == sched.counts_at(1000)
    np.testing.assert_array_equal(sched.consumed_before(7), [21, 7])


def test_annealed_schedule_closed_form_matches_replay():
    sizes = [1000, 100, 10]
    sched = mixing.Mixing("annealed", num_epochs=4).schedule(sizes, 16, steps_per_epoch=5)
    np.testing.assert_array_equal(sched.starts, [0, 5, 10, 15])
    assert sched.counts_at(0) == mixing.largest_remainder_counts(mixing.annealed_rates(sizes, 1, 4), 16)
    assert sched.counts_at(12) == mixing.largest_remainder_counts(mixing.annealed_rates(sizes, 3, 4), 16)
    assert sched.counts_at(0)[0] > sched.counts_at(15)[0]  # towards equal
    total = np.zeros(3, np.int64)
    for step in range(30):
        np.testing.assert_array_equal(sched.consumed_before(step), total)
        total += sched.counts_at(step)
    # An explicit Mixing.steps_per_epoch overrides the pipeline's.
    own = mixing.Mixing("annealed", num_epochs=2, steps_per_epoch=7).schedule(sizes, 16, steps_per_epoch=5)
    np.testing.assert_array_equal(own.starts, [0, 7])


def test_mixing_validation():
    with pytest.raises(ValueError, match="accepted"):
        mixing.Mixing("uniform")
    with pytest.raises(ValueError, match="num_epochs"):
        mixing.Mixing("annealed")
    with pytest.raises(ValueError, match="registered rates"):
        mixing.Mixing().schedule([1, 2], 4)
    assert mixing.parse_mixing("equal") == mixing.Mixing("equal")
    with pytest.raises(TypeError):
        mixing.parse_mixing(3)
    with pytest.raises(ValueError, match="temperature"):
        mixing.temperature_rates([1, 2], temperature=0)
