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
    constant = mixing.Mixing("annealed", num_epochs=4, carry=False).schedule(sizes, 16, steps_per_epoch=5)
    np.testing.assert_array_equal(constant.starts, [0, 5, 10, 15])
    assert constant.counts_at(0) == mixing.largest_remainder_counts(mixing.annealed_rates(sizes, 1, 4), 16)
    assert constant.counts_at(12) == mixing.largest_remainder_counts(mixing.annealed_rates(sizes, 3, 4), 16)
    assert constant.counts_at(0)[0] > constant.counts_at(15)[0]  # towards equal
    carried = mixing.Mixing("annealed", num_epochs=4).schedule(sizes, 16, steps_per_epoch=5)
    for sched in (constant, carried):
        total = np.zeros(3, np.int64)
        for step in range(30):
            np.testing.assert_array_equal(sched.consumed_before(step), total)
            total += sched.counts_at(step)
        # Each epoch (piece) gets its rates' share of its 5 * 16 rows within a row or two.
        for epoch in range(1, 5):
            rows = sched.consumed_before(5 * epoch) - sched.consumed_before(5 * epoch - 5)
            expected = 80 * mixing.annealed_rates(sizes, epoch, 4)
            assert np.abs(rows - expected).max() <= (1.0 if sched is carried else 5.0)
    # An explicit Mixing.steps_per_epoch overrides the pipeline's.
    own = mixing.Mixing("annealed", num_epochs=2, steps_per_epoch=7).schedule(sizes, 16, steps_per_epoch=5)
    np.testing.assert_array_equal(own.starts, [0, 7])


SMALL = {"sst2": 67349, "cola": 8551, "mrpc": 4076, "stsb": 5749, "rte": 2490, "cb": 250, "copa": 400}


def test_apportion_rows_hand_computed_and_monotone():
    assert mixing.apportion_rows(1, [0.25, 0.75]).tolist() == [0, 1]
    assert mixing.apportion_rows(2, [0.25, 0.75]).tolist() == [1, 1]  # 0.5 rounds up
    assert mixing.apportion_rows(4, [0.25, 0.75]).tolist() == [1, 3]
    # (1, 1, 2): halves [0] | [1, 2] get round(4 * 1/4) = 1 and 3 -> [1] | [2]: round(3 / 3)
    assert mixing.apportion_rows(4, [1, 1, 2]).tolist() == [1, 1, 2]
    assert mixing.apportion_rows(5, [0, 1, 0]).tolist() == [0, 5, 0]
    previous = np.zeros(4, np.int64)
    for n in range(200):
        rows = mixing.apportion_rows(n, [0.9, 0.05, 0.03, 0.02])
        assert rows.sum() == n and (rows >= previous).all()
        previous = rows
    with pytest.raises(ValueError, match="at least one must be > 0"):
        mixing.apportion_rows(3, [0.0, 0.0])


@pytest.mark.parametrize("batch_size", [8, 32, 128])
def test_small_tasks_get_their_share_over_steps(batch_size):
    """glue_super_glue_small_v1, proportional: at batch 32 CB's quota is 0.09 rows and
    COPA's 0.14 per step, so per-batch rounding gave them 0 rows in every step."""
    sizes = list(SMALL.values())
    rates = mixing.proportional_rates(sizes)
    sched = mixing.Mixing("proportional").schedule(sizes, batch_size)
    bound = np.ceil(np.log2(len(sizes))) / 2  # 1.5 rows for 7 tasks
    previous = np.zeros(len(sizes), np.int64)
    for n in range(1, 1501):
        consumed = sched.consumed_before(n)
        step = consumed - previous
        assert step.min() >= 0 and step.sum() == batch_size
        assert np.abs(consumed - n * batch_size * rates).max() <= bound, n
        previous = consumed
    cb, copa = list(SMALL).index("cb"), list(SMALL).index("copa")
    assert sched.consumed_before(1000)[cb] == pytest.approx(1000 * batch_size * rates[cb], abs=bound)
    assert sched.consumed_before(100)[copa] >= 1
    # The counts of a step are a function of the step alone (resume = a fresh schedule).
    again = mixing.Mixing("proportional").schedule(sizes, batch_size)
    for s in (0, 1, 17, 999, 123_456):
        assert again.counts_at(s) == sched.counts_at(s)
        np.testing.assert_array_equal(again.consumed_before(s), sched.consumed_before(s))
    assert max(sched.counts_at(s)[cb] for s in range(100)) >= 1
    # carry=False: the old constant counts, CB and COPA never trained at batch 32.
    if batch_size == 32:
        constant = mixing.Mixing("proportional", carry=False).schedule(sizes, 32)
        assert {constant.counts_at(s)[cb] for s in range(100)} == {0}


def test_carried_counts_keep_min_count():
    sched = mixing.Mixing("proportional").schedule([97, 2, 1], 8, min_count=1)
    for s in range(50):
        counts = sched.counts_at(s)
        assert min(counts) >= 1 and sum(counts) == 8


GLUE_SIZES = [8551, 67349, 3668, 363846, 5749, 392702, 104743, 2490]  # CoLA .. RTE, train


@pytest.mark.parametrize("carry", [True, False])
def test_block_rows_put_one_task_on_each_data_device(carry):
    """GLUE at batch 128 on a 32-way `data` axis: single rows put up to 3 tasks on one
    device (4 rows each); in blocks of 4 rows every device holds one task, the steps sum
    to the batch, the closed form holds, and the shares stay the rates over the steps."""
    from ktx.optim.device_slots import device_slots, slots_advice

    rows = mixing.Mixing("proportional", carry=carry).schedule(GLUE_SIZES, 128)
    assert max(device_slots(rows.counts_at(s), 32) for s in range(200)) == 3
    sched = mixing.Mixing("proportional", carry=carry, block_rows=4).schedule(GLUE_SIZES, 128)
    counts = np.array([sched.counts_at(s) for s in range(2000)])
    assert (counts % 4 == 0).all() and (counts.sum(axis=1) == 128).all()
    assert {device_slots(c, 32) for c in counts} == {1}
    consumed = sched.consumed_before_many(np.arange(2001))
    np.testing.assert_array_equal(np.diff(consumed, axis=0), counts)
    np.testing.assert_array_equal(consumed[1234], sched.consumed_before(1234))
    if carry:  # within the bound in blocks (4 rows each) of the rates' share
        rates = mixing.proportional_rates(GLUE_SIZES)
        bound = 4 * np.ceil(np.log2(len(GLUE_SIZES))) / 2
        assert np.abs(consumed[2000] - 2000 * 128 * rates).max() <= bound
    first = [rows.counts_at(s) for s in range(64)]
    assert slots_advice(counts[:64], 32) is None
    assert slots_advice(first, 1) is None
    if carry:
        # 3 tasks on a device: 2.3 backward passes; the blocks, each task's most rows
        # padded to 32, 2.5 times the rows.
        assert slots_advice(first, 32) == (
            "Balanced step: up to 3 tasks' rows on one of the 32 data devices, so per-task "
            "gradients cost up to ~2.3x a plain step; rows in blocks of 4 (batch / data) put "
            "one task on each device: --gin.pipeline.MultiTaskInput.mixing=@mixing.Mixing() "
            "--gin.mixing.Mixing.block_rows=4")
    # min_count is kept, in whole blocks: every task gets a block in every batch.
    kept = mixing.Mixing("proportional", block_rows=4).schedule(GLUE_SIZES, 128, min_count=1)
    assert all(min(kept.counts_at(s)) >= 4 for s in range(100))


def test_block_rows_validation():
    with pytest.raises(ValueError, match="block_rows=0; accepted: an int >= 1"):
        mixing.Mixing(block_rows=0)
    with pytest.raises(ValueError, match="block_rows=5 does not divide the batch size 128"):
        mixing.Mixing("equal", block_rows=5).schedule([1, 2], 128)
    with pytest.raises(ValueError, match="min_count=1 in blocks of Mixing.block_rows=64 rows "
                                         "for 3 tasks needs 192 rows, more than batch_size=128"):
        mixing.Mixing("equal", block_rows=64).schedule([1, 2, 3], 128, min_count=1)


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


def _replay(sched, steps):
    total = np.zeros(sched.num_tasks, np.int64)
    for step in range(steps):
        np.testing.assert_array_equal(sched.consumed_before(step), total)  # closed form
        counts = np.asarray(sched.counts_at(step))
        assert np.count_nonzero(counts) == 1 and counts.sum() == sched.batch_size
        total += counts
    return total


def test_round_robin_one_task_per_batch_in_turn():
    sched = mixing.Mixing("proportional", batches="round_robin").schedule([30, 10, 5], 4)
    assert [sched.counts_at(s) for s in range(4)] == [(4, 0, 0), (0, 4, 0), (0, 0, 4), (4, 0, 0)]
    np.testing.assert_array_equal(_replay(sched, 10), [16, 12, 12])
    # a task with rate 0 is left out of the turn
    zero = mixing.Mixing("mixture", batches="round_robin").schedule([30, 10, 5], 2,
                                                                   mixture_rates=[1, 0, 1])
    assert [zero.counts_at(s) for s in range(3)] == [(2, 0, 0), (0, 0, 2), (2, 0, 0)]


def test_task_per_batch_follows_the_rates():
    sizes = [600, 300, 100]
    sched = mixing.Mixing("proportional", batches="task_per_batch").schedule(sizes, 8)
    total = _replay(sched, 100)
    np.testing.assert_array_equal(total // 8, mixing.apportion_rows(100, [0.6, 0.3, 0.1]))
    # every prefix stays within a batch of its share (smooth interleaving, not blocks)
    for n in range(1, 100):
        batches = sched.consumed_before(n) / 8
        assert np.abs(batches - n * np.array([0.6, 0.3, 0.1])).max() <= 1.0
    annealed = mixing.Mixing("annealed", num_epochs=3, batches="task_per_batch").schedule(
        sizes, 8, steps_per_epoch=10)
    _replay(annealed, 40)
    first, last = (annealed.consumed_before(10) // 8,
                   (annealed.consumed_before(30) - annealed.consumed_before(20)) // 8)
    assert first[0] > last[0] and first[2] < last[2]  # towards equal


def test_task_per_batch_validation():
    with pytest.raises(ValueError, match=r"Mixing.batches='mix'; accepted: \('mixed'"):
        mixing.Mixing(batches="mix")
    with pytest.raises(ValueError, match="min_rows_per_task=1 asks for every task"):
        mixing.Mixing("equal", batches="round_robin").schedule([3, 3], 4, min_count=1)
