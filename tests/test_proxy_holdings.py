"""Where a proxy session's buffers live (server/proxy/holdings.py): pure bookkeeping."""

from __future__ import annotations

import pytest

from server.proxy.backend import BackendError
from server.proxy.holdings import Holdings

pytestmark = pytest.mark.timeout(10)


def test_a_spread_result_and_a_replicated_upload_are_read_in_place_and_released_everywhere() -> None:
    h = Holdings()
    h.made([1], "a", ("b",), generation=3)  # parts on a and b
    h.stored([2], ["a", "b"])  # a copy on each
    h.stored([3], ["b"])
    assert h.input_home(1, "a", ("a", "b")) == "a|b" and h.input_home(1, "a", ("a",)) == "a"
    assert h.input_home(2, "a", ("b",)) == "b" and h.input_home(2, "a", ("a", "c")) == "a"
    assert h.input_home(3, "b", ("a", "b")) == "b"
    h.check_placed([1, 2, 3], 3, "s")
    with pytest.raises(BackendError, match="generation 3 -> 4"):
        h.check_placed([1], 4, "s")
    assert h.forget([1, 2, 3]) == {"a": [1, 2], "b": [1, 2, 3]}
    assert not (h.home or h.copies or h.others or h.placed_at)
    with pytest.raises(BackendError, match="not this session's"):
        h.address_of(1)
