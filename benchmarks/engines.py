"""Rollout engines on spread-out response lengths: the continuous engine against the static batch
and, with ``--torch-python``, transformers' ``generate``; prints JSON.

Two workloads of ``--sequences`` sequences (``--group`` samples per prompt) on the tiny MoE
(``ModelConfig.tiny()``, random weights, float32), each sequence's response length set by a
per-sequence limit so that every engine decodes the same lengths:

* ``heavy_tail``: 90 % of responses ``--new`` / 8 tokens, 10 % ``--new`` tokens;
* ``long_response``: 25–50 tokens, uniform (the long-response tasks' profile).

Engines: ``static`` (``Sampler.generate`` on batches of ``--batch`` sequences, each decoded to its
longest limit), ``continuous`` (``ContinuousSampler`` with ``--batch`` slots, admissions and
harvests every ``--harvest-every`` decode steps) and, with ``--torch-python``, ``generate``:
``benchmarks/peers/generate_torch.py --serve`` in that interpreter, on the same weights (a
Hugging Face checkpoint written by ``sat_jax.models.save_hf``), prompts and limits, in static
batches of ``--batch`` sequences as ``generate`` runs them. The engines are timed round-robin in
one run (each round times every engine once, so load drifting on a shared machine hits all
alike), after one untimed pass each. Reported per workload and engine: useful (response)
tokens/s, seconds, the share of decode row-steps spent on rows that had already finished (static
and generate: rows waiting for their batch's longest; continuous: slots waiting for the next
harvest, or free), and the ratios ``continuous_over_static`` and ``continuous_over_generate`` of
useful tokens/s (the median over rounds of the paired time ratio, scaled by the engines' useful
token counts, which differ a little because EOS is drawn with other keys; > 1: continuous is
faster).

Usage: ``python benchmarks/engines.py [--batch 32] [--sequences 128] [--group 4] [--new 64]
[--harvest-every 8] [--repeats 4] [--torch-python /work/venvs/torch/bin/python
--torch-threads 2]``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import tempfile

import jax
import numpy as np
from _timing import interleaved_ms, paired_ratio

from sat_jax.models import ModelConfig, init_model, param_count, save_hf
from sat_jax.sampling import ContinuousSampler, Sampler, SamplingParams

PROFILES = ("heavy_tail", "long_response")
HERE = os.path.dirname(os.path.abspath(__file__))


def limits_for(profile: str, sequences: int, n: int, rng) -> np.ndarray:
    """Per-sequence response-length limits of a workload."""
    if profile == "heavy_tail":
        return np.where(rng.random(sequences) < 0.1, n, max(1, n // 8)).astype(np.int32)
    return rng.integers(25, 51, size=sequences).astype(np.int32)  # long_response


class Peer:
    """``generate_torch.py --serve`` in another interpreter: one timed-by-us pass per request."""

    def __init__(self, python: str, folder: str, threads: int):
        script = os.path.join(HERE, "peers", "generate_torch.py")
        cmd = [python, script, folder, "--serve", "--threads", str(threads)]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        self.info = self._read()

    def _read(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"generate peer exited with status {self.proc.wait()}")
        return json.loads(line)

    def run(self, profile: str) -> dict:
        self.proc.stdin.write(profile + "\n")
        self.proc.stdin.flush()
        return self._read()

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def draw(cfg, args) -> dict[str, dict]:
    """Every workload's prompts, prompt lengths and response limits (the peer reads them too)."""
    rng = np.random.default_rng(1)
    m, p = args.sequences // args.group, args.prompt
    out = {}
    for profile, n in zip(PROFILES, (args.new, 50), strict=True):
        lengths = rng.integers(p // 2, p + 1, size=m)
        prompts = rng.integers(2, cfg.vocab_size - 1, size=(m, p))
        out[profile] = {
            "batch": args.batch,
            "group": args.group,
            "max_new_tokens": n,
            "prompts": prompts.tolist(),
            "prompt_lengths": lengths.tolist(),
            "limits": limits_for(profile, m * args.group, n, rng).tolist(),
            "eos_id": cfg.vocab_size - 1,
            "pad_id": 0,
        }
    return out


def compare(cfg, params, args, profile: str, work: dict, peer=None) -> dict:
    """One workload: every engine timed round-robin; their useful tokens/s and paired ratios."""
    b, p, g, h, n = args.batch, args.prompt, args.group, args.harvest_every, work["max_new_tokens"]
    common = dict(max_prompt_len=p, max_new_tokens=n, eos_id=cfg.vocab_size - 1)
    static = Sampler(cfg, **common)
    slots = ContinuousSampler(cfg, num_slots=b, harvest_every=h, group_size=g, **common)
    prompts, lengths = np.asarray(work["prompts"]), np.asarray(work["prompt_lengths"])
    limits = np.asarray(work["limits"], np.int32)
    m = len(prompts)
    rows, row_lengths = np.repeat(prompts, g, axis=0), np.repeat(lengths, g)
    key, sp = jax.random.key(2), SamplingParams()
    stats = {}

    def run_static():
        outs = [
            static.generate(
                params,
                rows[i : i + b],
                row_lengths[i : i + b],
                jax.random.fold_in(key, i),
                sp,
                group_size=g,
                max_lengths=limits[i : i + b],
            )
            for i in range(0, len(rows), b)
        ]
        steps = sum(int(np.max(o.response_lengths)) * o.tokens.shape[0] for o in outs)
        stats["static"] = (sum(int(np.sum(o.response_lengths)) for o in outs), steps)
        return [o.tokens for o in outs]

    def run_slots():
        run = slots.session(key, sp)
        run.add(prompts, lengths, prompt_ids=np.arange(m), max_lengths=limits)
        groups = []
        while run.pending:
            groups += run.advance(params, 0)
        stats["continuous"] = (run.live_steps, run.slot_steps)
        return [grp.output.tokens for grp in groups]

    def run_peer():
        out = peer.run(profile)
        stats["generate"] = (out["useful_tokens"], out["row_steps"])
        return []

    engines = {"static": run_static, "continuous": run_slots}
    if peer is not None:
        engines["generate"] = run_peer
    ms, rounds = interleaved_ms(engines, (), args.repeats)
    res = {
        "sequences": m * g,
        "group": g,
        "max_new_tokens": n,
        "mean_limit": float(limits.mean()),
    }
    for name in engines:
        useful, row_steps = stats[name]
        res[name] = {
            "useful_tokens": useful,
            "useful_tokens_per_s": useful / (ms[name] / 1e3),
            "seconds": ms[name] / 1e3,
            "finished_row_decode_share": 1.0 - useful / row_steps,
        }
    # Paired time ratio (median over rounds) scaled by the useful-token counts, which differ a
    # little between engines (their sampling keys differ, so EOS is drawn at other places).
    for other in engines:
        if other != "continuous":
            time_ratio = paired_ratio(rounds, other, "continuous")
            res[f"continuous_over_{other}"] = round(
                time_ratio * stats["continuous"][0] / stats[other][0], 3
            )
    return res


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, default=32, help="static batch = continuous slots")
    ap.add_argument("--prompt", type=int, default=16)
    ap.add_argument("--new", type=int, default=64, help="heavy_tail's long response length")
    ap.add_argument("--sequences", type=int, default=128, help="sequences per workload")
    ap.add_argument("--group", type=int, default=4, help="samples per prompt")
    ap.add_argument("--harvest-every", type=int, default=8, help="continuous engine window")
    ap.add_argument("--repeats", type=int, default=4, help="timed rounds")
    ap.add_argument("--torch-python", default="", help="a Python with torch + transformers")
    ap.add_argument("--torch-threads", type=int, default=2, help="torch intra-op threads")
    args = ap.parse_args()
    for name in ("batch", "prompt", "new", "sequences", "group", "harvest_every", "repeats"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.sequences % args.group:
        ap.error(f"--sequences {args.sequences} is not a multiple of --group {args.group}")
    if args.batch % args.group:
        ap.error(f"--batch {args.batch} is not a multiple of --group {args.group}")

    cfg = ModelConfig.tiny()
    _, params = init_model(cfg, seed=0)
    work = draw(cfg, args)
    peer = None
    with tempfile.TemporaryDirectory() as folder:
        if args.torch_python:
            save_hf(folder, cfg, params)
            with open(os.path.join(folder, "workloads.json"), "w") as f:
                json.dump(work, f)
            peer = Peer(args.torch_python, folder, args.torch_threads)
        try:
            workloads = {prof: compare(cfg, params, args, prof, work[prof], peer) for prof in work}
        finally:
            if peer is not None:
                peer.close()
    result = {
        "device": f"{jax.devices()[0].platform} ({platform.processor() or platform.machine()})",
        "model": {"config": "ModelConfig.tiny()", "params": param_count(params)},
        "engines": {
            "static_batch": args.batch,
            "slots": args.batch,
            "harvest_every": args.harvest_every,
            "generate": "off" if peer is None else peer.info,
        },
        "workloads": workloads,
    }
    print(json.dumps(result, indent=2))
    import _results  # benchmarks/results/engines.json, which benchmarks/report.py renders

    _results.write("engines", result)


if __name__ == "__main__":
    main()
