"""The extended tier's selection (``tests/extended_tier.py``) on hand-made items: which slow matrix
cases leave CI's slow tier, and when a representative that matches nothing is an error."""
from __future__ import annotations

from pathlib import Path

import extended_tier
import pytest
from extended_tier import mark_extended

FUNCTION = "tests/test_matrix.py::test_mesh"


class FakeItem:
    """The three things ``mark_extended`` reads of a pytest item, and the one it writes."""

    def __init__(self, nodeid: str, slow: bool = True):
        self.nodeid = nodeid
        self.markers = {"slow"} if slow else set()

    def get_closest_marker(self, name: str):
        return name if name in self.markers else None

    def add_marker(self, marker) -> None:
        self.markers.add(marker.name)


@pytest.fixture
def matrix(monkeypatch):
    monkeypatch.setattr(extended_tier, "REPRESENTATIVES", {FUNCTION: ("tp2-dcp2]", "llama-tp4")})
    return [FakeItem(f"{FUNCTION}[{case}]") for case in
            ("qwen-tp2-dcp2", "qwen-tp4-dcp2", "llama-tp4-dcp4", "llama-tp2-dcp1")]


def extended(items) -> list[str]:
    return [item.nodeid.partition("[")[2] for item in items if "extended" in item.markers]


def test_cases_outside_the_representatives_are_extended(matrix):
    mark_extended(matrix)
    assert extended(matrix) == ["qwen-tp4-dcp2]", "llama-tp2-dcp1]"]


def test_default_tier_cases_and_unlisted_functions_are_left_alone(matrix):
    fast = FakeItem(f"{FUNCTION}[qwen-tp1-dcp1]", slow=False)
    other = FakeItem("tests/test_other.py::test_mesh[qwen-tp4-dcp2]")
    plain = FakeItem(FUNCTION)  # not parametrised
    mark_extended([*matrix, fast, other, plain])
    assert "extended" not in fast.markers | other.markers | plain.markers


def test_a_representative_matching_no_case_is_a_collection_error(matrix):
    renamed = [item for item in matrix if "llama-tp4" not in item.nodeid]
    with pytest.raises(pytest.UsageError, match=r"test_mesh has no case matching \['llama-tp4'\]"):
        mark_extended(renamed)


def test_cases_named_on_the_command_line_are_not_an_error(matrix):
    """``pytest file::function[id]`` collects that case alone: the other representatives are not
    collected, not renamed, and the case is still marked as it would be in a whole run."""
    one = [matrix[1]]
    mark_extended(one, ["tests/test_matrix.py::test_mesh[qwen-tp4-dcp2]"])
    assert extended(one) == ["qwen-tp4-dcp2]"]
    mark_extended([matrix[0]], ["/abs/path/tests/test_matrix.py::test_mesh[qwen-tp2-dcp2]"])
    with pytest.raises(pytest.UsageError):  # naming a case of another function does not excuse this one
        mark_extended([matrix[0]], ["tests/test_other.py::test_mesh[qwen-tp2-dcp2]", "tests/test_matrix.py"])


def test_every_listed_function_is_in_an_existing_file():
    root = Path(__file__).resolve().parent.parent
    for function, patterns in extended_tier.REPRESENTATIVES.items():
        path, _, name = function.partition("::")
        assert (root / path).is_file() and f"def {name}(" in (root / path).read_text(), function
        assert patterns and all(patterns), function
