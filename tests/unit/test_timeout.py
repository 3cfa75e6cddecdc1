"""ncclkv._timeout: the one rule every timeout and deadline follows."""

from __future__ import annotations

import math
import re
from fractions import Fraction

import numpy as np
import pytest

from ncclkv import transport
from ncclkv._timeout import MAX_TIMEOUT_S, check_timeout
from ncclkv.transport import _base


def test_a_good_timeout_comes_back_as_a_float() -> None:
    for good in (1, 0.5, 5e-324, MAX_TIMEOUT_S, np.float32(2.5), Fraction(1, 4)):
        value = check_timeout("t", good)
        assert type(value) is float and value == float(good)


@pytest.mark.parametrize("bad", [0, -1, 0.0, -0.0, math.inf, -math.inf, math.nan, math.nextafter(MAX_TIMEOUT_S, math.inf)],
                         ids=repr)
def test_a_value_no_wait_takes_is_a_value_error_naming_it_and_the_bounds(bad: float) -> None:
    with pytest.raises(ValueError, match=re.escape(
            f"op_timeout_s must be a finite number of seconds > 0 (at most 1e+09), got {bad!r}")):
        check_timeout("op_timeout_s", bad)


@pytest.mark.parametrize("bad", [True, "5", None, 1j], ids=repr)
def test_a_non_number_is_a_type_error_naming_it(bad: object) -> None:
    with pytest.raises(TypeError, match=re.escape(f"t must be a number of seconds, got {type(bad).__name__} {bad!r}")):
        check_timeout("t", bad)


def test_links_check_by_the_same_rule_and_only_this_module_exports_it() -> None:
    assert _base.check_timeout is check_timeout
    for module in (transport, _base):  # one place exports each name: here
        assert not {"MAX_TIMEOUT_S", "check_timeout"} & set(module.__all__), module.__name__
