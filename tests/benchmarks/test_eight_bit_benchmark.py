"""The 8-bit precision benchmark (benchmarks/eight_bit.py) without bitsandbytes (not a dependency):
our codes' errors are the format's bounds, and the training comparison runs and reports."""

import pytest

from benchmarks import eight_bit
from fused_optim import state_formats

pytest.importorskip("sklearn")  # the digits


def test_our_errors_are_half_an_entry_gap_in_every_normal_binade():
    """In the binades our codes hold with 2^M entries each (|x| / absmax down to 2^-15, M = 3
    signed, 4 unsigned), entries are 2^-(M+1) of the binade's top apart, so rounding to the nearest
    errs by at most 2^-(M+2) of it, in the code's units, which are absmax / top of x's (top = 1 −
    2^-(M+1)). The benchmark's grid (4096 values a binade) comes within 5% of that bound."""
    for row in eight_bit.precision_rows(bnb=None):
        for signed in (True, False):
            name = "signed" if signed else "unsigned"
            m = state_formats.mantissa_bits(signed)
            bound = 2.0 ** -(m + 2) / state_formats.top(signed) * (1 + 1e-5)  # (fp32 rounding of x itself)
            if row["binade"] < 15:
                assert 0.95 * bound < row[f"ours {name}"] <= bound, row
            assert row[f"bitsandbytes {name}"] == eight_bit.NOT_INSTALLED


def test_the_training_comparison_reports_each_variant():
    text = eight_bit.main(["--steps", "2", "--seeds", "1"])
    assert "| digits | fp32 state |" in text and "| lm | ours 8-bit |" in text
    assert "| lm | bitsandbytes AdamW8bit | not installed |" in text
