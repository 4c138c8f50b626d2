"""The GRPO recipe's trainer stage as a gang: each rank trains the share of the batch its grant gives it."""

from jigsaw.recipes.grpo_step import _report, gang_shares
from jigsaw.runtime.client import GrantHandle


def _grants(*micro: int | None) -> list[GrantHandle]:
    return [GrantHandle(substage=f"p/0/{i}/training/0", device=i, micro_batch=m) for i, m in enumerate(micro)]


def test_a_gangs_skewed_grants_are_the_ranks_shares():
    assert gang_shares(_grants(6, 2), 8) == [6, 2]


def test_grants_that_say_nothing_usable_keep_the_even_split():
    assert gang_shares(_grants(None), 8) is None  # one sub-stage of every rank
    assert gang_shares(_grants(4, None), 8) is None  # no skew planned
    assert gang_shares(_grants(6, 3), 8) is None  # planned for another batch size


def test_each_member_reports_its_own_slice():
    seq = [10, 20, 30, 40, 50, 60, 70, 80]
    grants = _grants(6, 2)
    _report(grants, [6, 2], seq, flops_per_token=2.0)
    assert [g.numbers for g in grants] == [{"num_tokens": 210, "batch_size": 6, "flops": 420.0},
                                           {"num_tokens": 150, "batch_size": 2, "flops": 300.0}]
    one = _grants(None)
    _report(one, None, seq, flops_per_token=6.0)
    assert one[0].numbers == {"num_tokens": 360, "batch_size": 8, "flops": 2160.0}
