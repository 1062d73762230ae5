from tests.helpers import model


def test_helpers_import_and_read_1orc():
    assert len(model("1orc")) == 559
