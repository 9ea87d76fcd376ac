"""transformers' ``generate`` on the workloads of ``benchmarks/engines.py``; prints JSON.

The peer of the continuous engine: the same tiny model's weights (a Hugging Face checkpoint in
DIR) and the same prompts and per-sequence length limits (DIR/workloads.json), decoded as
``generate`` does, in static batches of ``batch`` sequences (left-padded, sampling at
temperature 1, no truncation), each batch to its longest limit. Useful tokens are those within
each sequence's limit (and up to its EOS), as the JAX engines count them. Runs in a torch
environment without JAX. ``benchmarks/engines.py --torch-python PY`` starts it with ``--serve``
(one JSON line of versions, then one pass per workload name read from stdin, one JSON line
each), so that its passes are timed round-robin with the JAX engines'; alone it times
``--repeats`` passes per workload::

    /work/venvs/torch/bin/python benchmarks/peers/generate_torch.py DIR [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import numpy as np
import torch
import transformers


def _batches(work: dict):
    b, g = work["batch"], work["group"]
    prompts = np.repeat(np.asarray(work["prompts"]), g, axis=0)
    lengths = np.repeat(np.asarray(work["prompt_lengths"]), g)
    limits = np.asarray(work["limits"])
    for i in range(0, len(prompts), b):
        rows, lens = prompts[i : i + b], lengths[i : i + b]
        width = int(lens.max())
        ids = np.zeros((len(rows), width), np.int64)  # left-padded, as generate expects
        mask = np.zeros((len(rows), width), np.int64)
        for r, n in enumerate(lens):
            ids[r, width - n :] = rows[r, :n]
            mask[r, width - n :] = 1
        yield torch.from_numpy(ids), torch.from_numpy(mask), limits[i : i + b]


def _run(model, work: dict) -> tuple[int, int]:
    """(useful tokens, decoded row-steps) of one pass over the workload."""
    useful = row_steps = 0
    eos = work["eos_id"]
    for ids, mask, limits in _batches(work):
        with torch.no_grad():
            out = model.generate(
                ids,
                attention_mask=mask,
                max_new_tokens=int(limits.max()),
                do_sample=True,
                temperature=1.0,
                top_k=0,
                top_p=1.0,
                eos_token_id=eos,
                pad_token_id=work["pad_id"],
            )
        response = out[:, ids.shape[1] :].numpy()
        row_steps += response.size
        for row, limit in zip(response, limits, strict=True):
            ended = np.flatnonzero(row == eos)
            n = ended[0] + 1 if len(ended) else len(row)
            useful += int(min(n, limit))
    return useful, row_steps


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("peer_dir", help="a Hugging Face checkpoint and its workloads.json")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default="", help="one workload (heavy_tail | long_response)")
    ap.add_argument("--no-warmup", action="store_true", help="time the first pass too")
    ap.add_argument("--threads", type=int, default=0, help="torch intra-op threads (0: torch's)")
    ap.add_argument("--serve", action="store_true", help="one pass per workload name on stdin")
    args = ap.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    model = transformers.AutoModelForCausalLM.from_pretrained(args.peer_dir, dtype=torch.float32)
    model.eval()
    with open(f"{args.peer_dir}/workloads.json") as f:
        workloads = json.load(f)
    info = {
        "device": f"cpu ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
    }
    if args.serve:
        torch.manual_seed(0)
        print(json.dumps(info), flush=True)
        for line in sys.stdin:
            useful, steps = _run(model, workloads[line.strip()])
            print(json.dumps({"useful_tokens": useful, "row_steps": steps}), flush=True)
        return
    result = dict(info, workloads={})
    for name, work in workloads.items():
        if args.only and name != args.only:
            continue
        torch.manual_seed(0)
        if not args.no_warmup:
            _run(model, work)
        times, useful, steps = [], 0, 0
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            useful, steps = _run(model, work)
            times.append(time.perf_counter() - t0)
        seconds = statistics.median(times)
        result["workloads"][name] = {
            "sequences": len(work["limits"]),
            "batch": work["batch"],
            "useful_tokens": useful,
            "useful_tokens_per_s": useful / seconds,
            "seconds": seconds,
            "finished_row_decode_share": 1.0 - useful / steps,
        }
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
