"""transformers' ``generate`` on the workloads of ``benchmarks/sampler.py``; prints JSON.

The peer of the continuous engine: the same tiny model's weights (written by
``python benchmarks/sampler.py --export-peer DIR``, a Hugging Face checkpoint) and the same
prompts and per-sequence length limits, decoded as ``generate`` does, in static batches of
``batch`` sequences (left-padded, sampling at temperature 1, no truncation), each batch to its
longest limit. Useful tokens are those within each sequence's limit (and up to its EOS), as the
JAX engines count them. Runs in a torch environment without JAX::

    python benchmarks/sampler.py --workloads-only --export-peer /tmp/peer   # JAX venv
    /work/venvs/torch/bin/python benchmarks/peers/generate_torch.py /tmp/peer [--repeats 3]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
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
    ap.add_argument("peer_dir", help="directory written by benchmarks/sampler.py --export-peer")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--only", default="", help="one workload (heavy_tail | long_response)")
    ap.add_argument("--no-warmup", action="store_true", help="time the first pass too")
    args = ap.parse_args()
    torch.set_num_threads(torch.get_num_threads())
    model = transformers.AutoModelForCausalLM.from_pretrained(args.peer_dir, dtype=torch.float32)
    model.eval()
    with open(f"{args.peer_dir}/workloads.json") as f:
        workloads = json.load(f)
    result = {
        "device": f"cpu ({platform.processor() or platform.machine()})",
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "threads": torch.get_num_threads(),
        "workloads": {},
    }
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
