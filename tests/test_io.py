"""stages/io.py's process helpers: heavy imports without the garbage collector."""

import gc

from stages import io


def test_heavy_imports_pause_the_collector_and_freeze_what_they_made():
    assert gc.isenabled()
    frozen = gc.get_freeze_count()
    with io.heavy_imports():
        assert not gc.isenabled()
        made = [[i] for i in range(1000)]  # tracked objects, as an import makes
    assert gc.isenabled()
    assert gc.get_freeze_count() >= frozen + len(made)
    # frozen: tracked, but in no generation a collection walks
    walked = {id(o) for o in gc.get_objects()}
    assert all(gc.is_tracked(x) and id(x) not in walked for x in made)


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
