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
