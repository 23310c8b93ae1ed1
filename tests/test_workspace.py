import json
import subprocess

import pytest

from flows.workspace import WorkspaceError, cycle_lock, find_root, inputs_fingerprint


def test_second_cycle_is_refused_naming_the_first(tmp_path):
    with cycle_lock(tmp_path, "offseason run"):
        with pytest.raises(WorkspaceError, match=r"another cycle is running .*offseason run \(pid "):
            with cycle_lock(tmp_path, "offseason run"):
                pass
    with cycle_lock(tmp_path, "offseason run"):  # released: free again
        pass


def test_stale_lock_of_a_dead_process_is_cleared(tmp_path):
    dead = subprocess.Popen(["true"])
    dead.wait()
    lock = tmp_path / ".offseason" / "cycle.lock"
    lock.parent.mkdir()
    lock.write_text(json.dumps({"pid": dead.pid, "what": "offseason run", "started": "earlier"}))
    with cycle_lock(tmp_path, "offseason run"):
        assert json.loads(lock.read_text())["what"] == "offseason run"
    assert not lock.exists()


def test_find_root_says_where_it_looked(tmp_path):
    with pytest.raises(WorkspaceError, match="not inside an offseason project"):
        find_root(tmp_path)


def test_fingerprint_follows_inbox_params_and_code(tmp_path):
    (tmp_path / "stages").mkdir()
    (tmp_path / "stages" / "a.py").write_text("x = 1\n")
    (tmp_path / "params.yaml").write_text("base: {}\n")
    first = inputs_fingerprint(tmp_path)
    (tmp_path / "stages" / "a.py").write_text("x = 2\n")
    second = inputs_fingerprint(tmp_path)
    assert first["code"] != second["code"] and first["params"] == second["params"]
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "inbox.dvc").write_text("outs: [md5: 1]\n")
    assert inputs_fingerprint(tmp_path)["inbox"] != second["inbox"]
