"""The accuracy regression's statistics: McNemar's exact test, the paired interval and the verdict
(benchmarks/paired_stats.py), on the counts of full-GSM8K runs (1,319 questions, 0.5B model)."""
import pytest

from arfusion.benchmarks import paired_stats as ps


def _records(n, a_only, b_only, both=0):
    """Runs A and B over ``n`` questions: ``both`` right in both, ``a_only`` / ``b_only`` discordant."""
    a = [{"id": str(i), "correct": i < both + a_only} for i in range(n)]
    b = [{"id": str(i), "correct": i < both or both + a_only <= i < both + a_only + b_only} for i in range(n)]
    return a, b


@pytest.mark.parametrize("b, c, p", [(19, 20, 1.0), (26, 12, 0.0336), (12, 26, 0.0336), (0, 0, 1.0), (5, 0, 0.0625),
                                     (40, 10, 2.386e-5)])  # scipy.stats.binomtest gives the same
def test_mcnemar_exact_p(b, c, p):
    assert ps.mcnemar_exact_p(b, c) == pytest.approx(p, rel=2e-3)  # the binomial tail, two-sided


def test_paired_interval_and_counts():
    a, b = _records(1319, 20, 19, both=170)
    cmp = ps.paired(a, b)
    assert (cmp.n, cmp.a_only, cmp.b_only) == (1319, 20, 19)
    assert cmp.diff == pytest.approx(-100 / 1319)
    half = 1.959964 * 100 * (39 - 1 / 1319) ** 0.5 / 1319  # about 0.92 points
    assert (cmp.ci_low, cmp.ci_high) == pytest.approx((cmp.diff - half, cmp.diff + half), rel=1e-6)


@pytest.mark.parametrize("n, a_only, b_only, tolerance, expected", [
    (1319, 20, 19, 1.0, "pass"),            # fusion on vs TP1 on full GSM8K: noise
    (1319, 26, 12, 1.0, "pass"),            # p = 0.034 is not significant at 0.01; the interval fits the tolerance
    (1319, 60, 12, 1.0, "fail"),            # a significant drop of 3.6 points
    (200, 10, 6, 1.0, "inconclusive"),      # too few questions: the interval is +-3.9 points
    (5000, 400, 310, 1.0, "fail"),          # p < 0.01 though the interval reaches above -tolerance
    (1319, 12, 26, 1.0, "pass"),            # a gain never fails
])
def test_verdict(n, a_only, b_only, tolerance, expected):
    assert ps.verdict(ps.paired(*_records(n, a_only, b_only)), tolerance) == expected


def test_whole_interval_below_minus_tolerance_fails_without_significance():
    cmp = ps.PairedComparison(n=100, a_only=3, b_only=0, diff=-3.0, ci_low=-6.4, ci_high=-1.5, p_value=0.25)
    assert ps.verdict(cmp, 1.0) == "fail"


def test_runs_without_a_shared_question_are_refused():
    with pytest.raises(ValueError, match="share no question id"):
        ps.paired([{"id": "a", "correct": True}], [{"id": "b", "correct": True}])
