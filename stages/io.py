"""Writing outputs whole: every file goes to a temporary name first and is renamed into place, so a
stage killed midway never leaves a half-written file that a later stage could take for a whole one.

`exit_soon()`: what a command calls as it ends, so that Python's exit does not spend a second on
the objects of torch, transformers, Prefect or DVC; `heavy_imports()`: where a process loads them,
without the garbage collector walking them again and again meanwhile.

Also what a stage used, for the cost ledger (flows/orchestration/cost.py): `resources()` (wall and CPU seconds,
peak memory, from rusage) and, where a stage called `watch_gpus()` and NVML is there
(`nvidia-ml-py`, optional; nothing without it or without a GPU), each GPU's busy seconds, peak
memory and mean utilisation, sampled by a thread while the stage runs.
"""

from __future__ import annotations

import gc
import json
import os
import resource
import shutil
import sys
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process
        return True
    return True


# per folder, the temporary files found in it by this process's first write there, by the name
# of the file they were writing
_STALE: dict[Path, dict[str, list[Path]]] = {}


def tmp_name(path: Path) -> Path:
    """The temporary name this process writes `path` under. The remains of a writer that was
    killed (SIGKILL leaves no chance to clean up) are removed here, by the next writer of `path`.
    The folder is listed once per process (a listing per write made a stage that writes n files
    into one folder, as ingest does, O(n^2)): remains left meanwhile by a writer killed while this
    process runs are the next process's to remove.
    """
    folder = path.parent
    folder.mkdir(parents=True, exist_ok=True)
    if folder not in _STALE:
        found: dict[str, list[Path]] = {}
        for temp in folder.glob(".*.tmp-*"):
            found.setdefault(temp.name[1:].rsplit(".tmp-", 1)[0], []).append(temp)
        _STALE[folder] = found
    for stale in _STALE[folder].pop(path.name, []):
        pid = stale.name.rsplit("-", 1)[1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            stale.unlink(missing_ok=True)
    return path.with_name(f".{path.name}.tmp-{os.getpid()}")


@contextmanager
def _whole(path: Path):
    """The temporary path to write; renamed onto `path` on success, removed on failure (a full
    disk, say), so neither a partial file nor its remains are left for a later stage.
    """
    tmp = tmp_name(path)
    try:
        yield tmp
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    os.replace(tmp, path)


def fsync_folder(folder: Path) -> None:
    """A rename or a new file in `folder` is durable once the folder is fsynced."""
    fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_lines_durably(path: Path, lines) -> None:
    """Write `lines` (bytes each) as `path`, whole and durable: a hidden temporary name (which
    ingest and DVC skip), fsynced, renamed, the folder fsynced. For files another process
    acknowledges once written (`offseason collect`, `offseason pull`).
    """
    with _whole(path) as tmp:
        with open(tmp, "wb") as handle:
            handle.writelines(lines)
            handle.flush()
            os.fsync(handle.fileno())
    fsync_folder(path.parent)


def write_text(path: str | Path, text: str) -> None:
    """Write a text file whole: readers see the old or the new, never a part."""
    with _whole(Path(path)) as tmp:
        tmp.write_text(text)


def write_json(path: str | Path, data) -> None:
    """Write JSON whole, indented with sorted keys."""
    write_text(path, json.dumps(data, indent=2, sort_keys=True) + "\n")


# Characters that str.splitlines() (and many JSONL readers) take for line breaks: inside a JSON
# string they are legal, so they are written escaped to keep one record a line for every reader.
_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


STARTED = time.monotonic()  # when this stage's process began (the module loads first thing)


def _forked() -> None:
    global STARTED
    STARTED = time.monotonic()


# a stage forked from a warm process (flows/orchestration/forkserver.py) began at its fork
os.register_at_fork(after_in_child=_forked)


class GpuWatch(threading.Thread):
    """Samples every visible GPU through NVML every `interval` seconds, until the process ends:
    busy seconds (the sampled utilisation times the time between samples), peak memory used on
    the device (by every process on it, not only this one) and mean utilisation. Measured, not
    exact: NVML's utilisation is the share of its last sample period a kernel was running.
    """

    def __init__(self, nvml, handles: list[tuple[int, object]], interval: float = 0.5):
        """Watch `handles` ([(index, NVML handle)]) through the `nvml` module."""
        super().__init__(name="offseason-gpu-watch", daemon=True)
        self.nvml, self.handles, self.interval = nvml, handles, interval
        self.lock = threading.Lock()
        self.stats = {index: {"busy": 0.0, "util_sum": 0.0, "samples": 0, "peak": 0,
                              "name": nvml.nvmlDeviceGetName(handle)} for index, handle in handles}

    def sample(self, seconds: float) -> None:
        """One sample of every GPU, counting `seconds` since the last one."""
        for index, handle in self.handles:
            try:
                util = self.nvml.nvmlDeviceGetUtilizationRates(handle).gpu
                used = self.nvml.nvmlDeviceGetMemoryInfo(handle).used
            except self.nvml.NVMLError:  # a GPU fell off the bus: its later samples are missing
                continue
            with self.lock:
                stat = self.stats[index]
                stat["busy"] += seconds * util / 100
                stat["util_sum"] += util
                stat["samples"] += 1
                stat["peak"] = max(stat["peak"], used)

    def run(self) -> None:
        """Sample until the process ends (a daemon thread)."""
        last = time.monotonic()
        while True:
            time.sleep(self.interval)
            now = time.monotonic()
            self.sample(now - last)
            last = now

    def summary(self) -> list[dict]:
        """Per GPU: index, name, busy seconds, peak memory (MB), mean utilisation (%)."""
        with self.lock:
            return [{"index": index, "name": s["name"] if isinstance(s["name"], str)
                     else s["name"].decode(), "busy_seconds": round(s["busy"], 3),
                     "peak_memory_mb": round(s["peak"] / 2**20, 1),
                     "mean_utilisation": round(s["util_sum"] / s["samples"], 1)
                     if s["samples"] else None, "samples": s["samples"]}
                    for index, s in self.stats.items()]


class HeldGpus:
    """The GPUs torch sees where NVML cannot be read (no `nvidia-ml-py`, or its library
    missing): counted, each held for the stage's whole wall time, which is how the budget
    (`budget.max_gpu_hours`) and the cost ledger price a GPU anyway; not sampled, so no busy
    time or memory. Without it a GPU stage counted 0 GPU hours and no GPU budget ever tripped.
    """

    def __init__(self, names: list[str]):
        """`names`: each device's, as torch names it."""
        self.names = names

    def summary(self) -> list[dict]:
        """Per GPU: index and name; the sampled figures None (nothing sampled them)."""
        return [{"index": index, "name": name, "busy_seconds": None, "peak_memory_mb": None,
                 "mean_utilisation": None, "samples": 0} for index, name in enumerate(self.names)]


def held_by_torch() -> HeldGpus | None:
    """The CUDA devices this process may use (CUDA_VISIBLE_DEVICES applies), by torch; None
    without any (or without torch's CUDA).
    """
    import torch

    if not torch.cuda.is_available():
        return None
    return HeldGpus([torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())])


_WATCH: list[GpuWatch | HeldGpus] = []


def visible_gpus(count: int) -> list[int]:
    """The NVML indices of the GPUs this process may use: CUDA_VISIBLE_DEVICES's (by index; a
    UUID list or an empty value: none we can map, so all or none as CUDA would see them).
    """
    setting = os.environ.get("CUDA_VISIBLE_DEVICES")
    if setting is None:
        return list(range(count))
    wanted = [part.strip() for part in setting.split(",") if part.strip()]
    if all(part.isdigit() for part in wanted):
        return [int(part) for part in wanted if int(part) < count]
    return list(range(count)) if wanted else []


def watch_gpus(interval: float = 0.5) -> GpuWatch | HeldGpus | None:
    """Start sampling the visible GPUs for this stage's metrics (once per process). Without
    `nvidia-ml-py` (or NVML's library), the GPUs torch sees, counted but not sampled
    (`HeldGpus`); None, and nothing started, without a GPU.
    """
    if _WATCH:
        return _WATCH[0]
    try:
        import pynvml as nvml
    except ImportError:  # nvidia-ml-py is optional: the GPUs counted, not sampled
        return _hold(held_by_torch())
    try:
        nvml.nvmlInit()
        count = nvml.nvmlDeviceGetCount()
        handles = [(i, nvml.nvmlDeviceGetHandleByIndex(i)) for i in visible_gpus(count)]
    except nvml.NVMLError:  # no driver or no NVML library: what torch sees, if anything
        return _hold(held_by_torch())
    if not handles:
        return None
    watch = GpuWatch(nvml, handles, interval)
    watch.sample(0.0)  # the memory already held when the stage starts counts toward its peak
    watch.start()
    _WATCH.append(watch)
    return watch


def _hold(held: HeldGpus | None) -> HeldGpus | None:
    if held is not None and held.names:
        _WATCH.append(held)
        return held
    return None


def resources() -> dict:
    """What this process and its children used so far: wall and CPU seconds, peak memory, and
    (after `watch_gpus()` found GPUs) `gpus`, each GPU's. The cycle's cost ledger
    (flows/orchestration/cost.py) reads them from each stage's metrics.
    """
    own, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(
        resource.RUSAGE_CHILDREN)
    used = {"wall_seconds": round(time.monotonic() - STARTED, 3),
            "cpu_seconds": round(own.ru_utime + own.ru_stime + kids.ru_utime + kids.ru_stime, 3),
            "max_rss_mb": round(max(own.ru_maxrss, kids.ru_maxrss) / 1024, 1)}
    if _WATCH:
        used["gpus"] = _WATCH[0].summary()
    return used


@contextmanager
def explained(stage: str):
    """A stage's command line: an error whose message says what to do (a model folder that is
    not usable, a params key, a user's environment breaking the contract, a bad task file) ends
    it with that message and exit status 1, not under a traceback (which DVC's output, and the
    cycle's error quoting its last lines, then showed instead of the message).
    """
    try:
        yield
    except Exception as err:
        from stages.config import ParamsError
        from stages.envs.contract import ContractError
        from stages.envs.errors import TaskFileError
        from stages.modelfiles import ModelFolderError

        if not isinstance(err, (ParamsError, ContractError, TaskFileError, ModelFolderError)):
            raise
        print(f"{stage}: error: {err}", file=sys.stderr)
        sys.exit(1)


def numbers_path(path: str | Path) -> Path:
    """Where the numbers of a stage's metrics file go: `metrics/numbers/<stage>.json`, the file
    dvc.yaml declares as the stage's DVC metric (tests/test_layout.py checks each is declared).
    """
    path = Path(path)
    return path.parent / "numbers" / path.name


def numbers(record: dict) -> dict:
    """The numbers of a metrics record, nested as they are; no strings, lists or switches.

    `dvc metrics diff gen-1 gen-3` prints every value of a metrics file: the gate's reasons and
    the cost's notes made rows of 300 characters, and a switch that flipped showed as -1 (issue
    53.8). A stage's whole record stays beside it (`metrics/<stage>.json`) for the report, the
    lineage and MLflow.
    """
    out = {}
    for key, value in record.items():
        if isinstance(value, dict):
            value = numbers(value)
            if value:
                out[key] = value
        elif isinstance(value, int | float) and not isinstance(value, bool):
            out[key] = value
    return out


def write_metrics(path: str | Path, metrics: dict, carried: dict | None = None) -> None:
    """A stage's metrics file, with its `resources` (measured: they vary run to run), plus the
    `carried` CPU and wall seconds of its earlier attempts (a training resumed after a stop);
    then its numbers alone, for `dvc metrics diff` (`numbers_path`).
    """
    used = resources()
    for key, value in (carried or {}).items():
        used[key] = round(used[key] + value, 3)
    record = {**metrics, "resources": used}
    write_json(path, record)
    write_json(numbers_path(path), numbers(record))


def jsonl_line(row: dict) -> str:
    """One JSONL line of a row, line breaks inside strings escaped."""
    return json.dumps(row, ensure_ascii=False, sort_keys=True).translate(_BREAKS) + "\n"


def write_jsonl(path: str | Path, rows: list[dict]) -> None:
    """Write rows as a JSONL file, whole."""
    write_text(path, "".join(jsonl_line(r) for r in rows))


def write_parquet(path: str | Path, table: pa.Table, row_group_size: int | None = None) -> None:
    """Write a parquet table, whole (`row_group_size` rows a row group: pyarrow's default)."""
    with _whole(Path(path)) as tmp:
        pq.write_table(table, tmp, row_group_size=row_group_size)


def replace_dir(tmp: Path, path: Path) -> None:
    """Move a finished folder into place (the old one, if any, goes first)."""
    if path.exists():
        shutil.rmtree(path)
    os.replace(tmp, path)


def read_jsonl(path: str | Path) -> list[dict]:
    """The rows of a JSONL file."""
    # split on newlines only: splitlines() also breaks at U+2028, U+0085 and others
    return [json.loads(line) for line in Path(path).read_text().split("\n") if line.strip()]


@contextmanager
def heavy_imports():
    """Imports of large libraries (torch, transformers, Prefect, MLflow, Great Expectations) with
    the garbage collector paused, and what they made frozen out of its reach afterwards.

    CPython walks every object there is whenever the objects that outlived a collection grew by a
    quarter: while such a library loads (a million objects that live as long as the process), that
    is a walk of an ever larger heap, again and again: five to nine times for each of a cycle's
    processes, 3.0 of a TINY cycle's 16.8 CPU seconds, 1.6 of `offseason init`'s 8.3. A module is
    never garbage; frozen (`gc.freeze`), the walks after the import leave it alone too. Cycles of
    garbage an import leaves stay until exit (few: what a module makes lives with it). Where the
    block imported nothing new (the modules were loaded already) nothing is frozen: the garbage
    of a long process's work so far is not kept for good.
    """
    enabled, loaded = gc.isenabled(), len(sys.modules)
    gc.disable()
    try:
        yield
    finally:
        if len(sys.modules) > loaded:
            gc.freeze()
        if enabled:
            gc.enable()


def exit_soon() -> None:
    """The process ends next (a stage's or a command's last call). Python's last garbage
    collections at exit would walk every object torch, transformers, Prefect, MLflow or DVC made,
    only to free memory the OS frees anyway: about a second on 2 cores for a model stage
    (imports 3.6 s, exit 1.0 s), paid by each of a cycle's four model stages and each CLI
    command. Frozen, they are left alone; atexit handlers and the flush of every open file still
    run, as in any exit.
    """
    sys.stdout.flush()
    gc.freeze()
