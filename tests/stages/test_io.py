"""stages/io.py's process helpers: heavy imports without the garbage collector."""

import gc
import sys

import pytest

from stages import io


@pytest.fixture(autouse=True)
def new_module(tmp_path, monkeypatch):
    """A module no test has imported yet: `import this_module_is_new`."""
    (tmp_path / "this_module_is_new.py").write_text("VALUE = [1, 2, 3]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    yield
    sys.modules.pop("this_module_is_new", None)


def test_heavy_imports_pause_the_collector_and_freeze_what_they_made():
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    with io.heavy_imports():
        assert not gc.isenabled()
        made = [[i] for i in range(1000)]  # tracked objects, as an import makes
        import this_module_is_new  # noqa: F401
    assert gc.isenabled()
    # frozen: tracked, but in no generation a collection walks. (The frozen count is no measure:
    # other threads of a test worker free frozen objects meanwhile, and the count drops by them.)
    assert gc.get_freeze_count() > frozen
    walked = {id(o) for o in gc.get_objects()}
    assert all(gc.is_tracked(x) and id(x) not in walked for x in made)


def test_heavy_imports_that_import_nothing_new_freeze_nothing():
    frozen = gc.get_freeze_count()
    with io.heavy_imports():
        import json  # noqa: F401  (loaded already)

        garbage = [[i] for i in range(1000)]
    # nothing frozen: the count did not grow (it may drop: other threads free frozen objects), and
    # the block's objects are still where collections walk
    assert gc.get_freeze_count() <= frozen and gc.isenabled()
    walked = {id(o) for o in gc.get_objects()}
    assert all(gc.is_tracked(x) and id(x) in walked for x in garbage)


def test_heavy_imports_leave_a_paused_collector_paused_even_on_error():
    gc.disable()
    try:
        try:
            with io.heavy_imports():
                raise ImportError("a broken module")
        except ImportError:
            pass
        assert not gc.isenabled()
    finally:
        gc.enable()
    try:
        with io.heavy_imports():
            raise ImportError("a broken module")
    except ImportError:
        pass
    assert gc.isenabled()


def test_a_stages_metrics_keep_their_numbers_apart_for_dvc(tmp_path):
    """`dvc metrics diff` reads metrics/numbers/<stage>.json: numbers only, nested as in the
    record; the whole record (reasons, switches, lists) stays at metrics/<stage>.json."""
    import json

    io.write_metrics(tmp_path / "gate.json", {
        "passed": True, "reason": "arith: 110-0 on the items only one model solved",
        "interval": [0.1, 0.3], "candidate_score": 0.6, "items": 200,
        "guards": {"format": {"arith": {"passed": True, "difference": -0.005}}, "empty": {"a": "b"}}})
    record = json.loads((tmp_path / "gate.json").read_text())
    assert record["passed"] is True and record["reason"].startswith("arith")
    numbers = json.loads((tmp_path / "numbers" / "gate.json").read_text())
    assert numbers["candidate_score"] == 0.6 and numbers["items"] == 200
    assert numbers["guards"] == {"format": {"arith": {"difference": -0.005}}}
    assert {"passed", "reason", "interval"}.isdisjoint(numbers)
    assert set(numbers["resources"]) >= {"cpu_seconds", "wall_seconds"}
