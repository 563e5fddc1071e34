"""Board manifests are data checked against boards/schema.json."""
import copy

import pytest

from tinydeploy.targets import boards
from tinydeploy.errors import TinydeployError


def test_every_shipped_board_is_valid():
    all_boards = boards.load_all()
    assert "host" in all_boards
    for b in all_boards.values():
        boards.validate(boards.manifest_data(b.id))


GOOD = {"id": "x1", "name": "X", "target": "host", "kind": "linux", "runner": "native", "alignment_bytes": 16}


@pytest.mark.parametrize("change", [
    {"id": "Bad Id"}, {"ram_bytes": -1}, {"kind": "toaster"}, {"alignment_bytes": 3},
    {"clock_mhz": 64}, {"runner": None}, {"name": ""},
], ids=str)
def test_invalid_manifests_are_refused(change):
    data = copy.deepcopy(GOOD)
    data.update(change)
    with pytest.raises(TinydeployError, match="invalid board manifest"):
        boards.validate(data, "test.json")


def test_missing_required_key_is_refused():
    data = copy.deepcopy(GOOD)
    del data["target"]
    with pytest.raises(TinydeployError, match="target"):
        boards.validate(data)


def test_unknown_board_lists_known_ones():
    with pytest.raises(TinydeployError, match="known boards: .*host"):
        boards.get_board("nope")
