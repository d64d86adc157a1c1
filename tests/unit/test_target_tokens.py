"""The weights that make a step's loss the mean over the global batch's target tokens."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from paratrain.losses import IGNORE_INDEX
from paratrain.parallel.target_tokens import count_targets, micro_batch_weights

CPU = torch.device("cpu")


def test_full_length_micro_batches_keep_exactly_the_mean_of_means_weight():
    assert micro_batch_weights([16, 16, 16], group=None, ranks=1, device=CPU) == [1.0 / 3] * 3


def test_weighted_micro_batch_means_equal_the_mean_over_all_target_tokens():
    torch.manual_seed(0)
    logits, targets = torch.randn(2, 6, 5), torch.randint(0, 5, (2, 6))
    targets[0, :5] = IGNORE_INDEX  # one target in the first micro-batch, six in the second
    counts = [count_targets(targets[i]) for i in range(2)]
    weights = micro_batch_weights(counts, group=None, ranks=1, device=CPU)
    weighted = sum(w * F.cross_entropy(logits[i], targets[i]) for i, w in enumerate(weights))
    assert counts == [1, 6]
    torch.testing.assert_close(weighted, F.cross_entropy(logits.reshape(-1, 5), targets.reshape(-1)))


def test_a_micro_batch_without_targets_weighs_nothing_and_a_step_without_any_stays_finite():
    assert micro_batch_weights([0, 4], group=None, ranks=1, device=CPU) == [0.0, 1.0]
    assert micro_batch_weights([0, 0], group=None, ranks=1, device=CPU) == [0.0, 0.0]


def test_floating_targets_all_count():
    assert count_targets(torch.full((2, 3), -100.0)) == 6


def test_targets_that_are_not_one_tensor_weigh_each_micro_batch_alike():
    assert count_targets({"labels": torch.zeros(2, 3)}) == 1
    assert micro_batch_weights([1, 1], group=None, ranks=1, device=CPU) == [0.5, 0.5]
