"""dar's one-stream layout is written once in torch (``layout_lookaround.one_stream_rows``, with the rule
``first_group_opening``); the collator's numpy copy (``objectives/dar.one_stream_layout``, kept for speed) must
lay rows out exactly as it does (issue 38)."""

import numpy as np
import torch

from hf_lookaround.models.lookaround.layout_lookaround import first_group_opening, one_stream_rows
from hf_lookaround.objectives import dar

BOS, PAD = 1, 0


def test_the_collators_numpy_layout_equals_the_torch_helper():
    rng = np.random.default_rng(0)
    cases = 0
    for t in range(1, 7):
        for length in range(2, 20):
            batch = 4
            ids = rng.integers(4, 60, size=(batch, length))
            ids[:, 0] = BOS
            lengths = rng.integers(1, length + 1, size=batch)
            ids[np.arange(length)[None, :] >= lengths[:, None]] = PAD  # right padding, as the collator pads
            s1 = rng.integers(1, t + 1, size=batch)
            is_target = (np.arange(length)[None, :] >= 1) & (np.arange(length)[None, :] < lengths[:, None])
            inputs, labels = dar.one_stream_layout(ids, is_target, s1, t, BOS, PAD)
            rows, before, start = one_stream_rows(torch.from_numpy(ids), torch.zeros(batch, 1, dtype=torch.long),
                                                  torch.from_numpy(s1)[:, None], t, BOS, PAD)
            width = rows.shape[1]
            assert inputs.shape[1] == length + 2 * t - 2 and width <= inputs.shape[1]
            assert (start == 0).all()
            np.testing.assert_array_equal(inputs[:, :width], rows.numpy())
            assert (inputs[:, width:] == PAD).all()  # the numpy copy pads every batch to one width
            # the labels: the token at slot j goes to labels[j - t + 1] (the row one block earlier predicts it)
            expected = np.full_like(labels, -100)
            b, p = np.nonzero(is_target)
            expected[b, p + before.numpy()[b, 0] - t + 1] = ids[b, p]
            np.testing.assert_array_equal(labels, expected)
            cases += 1
    assert cases == 6 * 18


def test_the_opening_rule_is_the_plans():
    """Token ``k`` (BOS at 0) opens a group of the dar plan exactly for the first-group size the rule names (the
    first text token opens one for every ``s1``; the rule names ``t``)."""
    for t in range(1, 7):
        assert int(first_group_opening(torch.tensor(1), t)) == t
        for k in range(2, 40):
            opening = int(first_group_opening(torch.tensor(k), t))
            assert 1 <= opening <= t
            for s1 in range(1, t + 1):
                rank = dar.ranks(np.arange(k + 1) - 1, s1, t, num_condition_tokens=1)  # text position k - 1
                assert (rank[k] != rank[k - 1]) == (s1 == opening), (t, k, s1)
