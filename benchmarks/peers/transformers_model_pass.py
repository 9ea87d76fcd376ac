"""sat_jax's model against transformers' PyTorch Qwen3-MoE on the same weights: the training
log-prob pass (forward + backward) and KV-cache decoding.

The project's Python builds ``ModelConfig.tiny()`` (4 blocks, d 128, 32 experts top-4 of width 32,
vocab 128) with random weights and writes it with ``save_hf``; a second process, in a virtualenv
with torch and transformers (``--torch-python``), loads that checkpoint with
``Qwen3MoeForCausalLM.from_pretrained`` and stays up, timing its side on request, so the two sides
run in alternating rounds of the same minutes and their ratio is a same-run ratio. Both sides see
the same tokens: B sequences of a 16-token prompt and N response tokens, all different (no shared
prompts). Torch uses ``--torch-threads`` threads (2 by default).

* forward + backward: the gradient of the summed response log-probs w.r.t. every parameter (ours
  ``jax.value_and_grad`` of ``token_logprobs``, jitted; theirs ``loss.backward()``).
* decode: N new tokens per sequence sampled at temperature 1 with the KV cache (ours
  ``Sampler.init`` + ``decode``, theirs ``generate(do_sample=True, min_new_tokens=N)``).

Ours runs in two layouts of the same weights, timed in the same rounds: ``scan``
(``ModelConfig``'s default ``scan_unroll=1``: one compiled block body, a ``lax.scan`` over the
stacked blocks) and ``unrolled`` (``scan_unroll`` = the 4 blocks: straight-line code, as
transformers' Python loop over its layers runs, and as ``sat-jax train``'s 2-block default
runs). ``*_torch_over_ours`` is the ``scan`` layout's ratio, ``*_torch_over_ours_unrolled`` the
other's, and ``*_unrolled_over_scan`` the unrolled layout's time over the scan's (< 1: faster).

    python3.11 -m venv /work/venvs/torch && \\
        /work/venvs/torch/bin/pip install torch==2.13.0 transformers safetensors
    PYTHONPATH=$PWD python benchmarks/peers/transformers_model_pass.py \\
        --torch-python /work/venvs/torch/bin/python

Prints one JSON object and writes it to ``benchmarks/results/transformers_model_pass.json``.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import numpy as np

PROMPT = 16
JOBS = ("fwd_bwd", "decode")


def _median_s(fn, repeats: int, warm: bool = True) -> float:
    if warm:
        fn()  # compilation, and the first call's allocations
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return float(np.median(times))


# --------------------------------------------------------------------------------------------
# The torch side: run by --torch-python with `--serve DIR`; imports neither JAX nor sat_jax.


def serve(folder: str, threads: int) -> None:
    import torch
    import transformers

    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=torch.float32)
    tokens = torch.from_numpy(np.load(os.path.join(folder, "tokens.npy")))
    b, n = tokens.shape[0], tokens.shape[1] - PROMPT

    def fwd_bwd():
        model.zero_grad(set_to_none=True)
        logits = model(tokens).logits[:, PROMPT - 1 : -1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, PROMPT:, None])
        (-logp.sum()).backward()

    @torch.no_grad()
    def decode():
        model.generate(
            tokens[:, :PROMPT],
            attention_mask=torch.ones(b, PROMPT, dtype=torch.long),
            do_sample=True,
            temperature=1.0,
            top_p=1.0,
            top_k=0,
            max_new_tokens=n,
            min_new_tokens=n,
            pad_token_id=0,
            eos_token_id=None,
        )

    jobs = {"fwd_bwd": fwd_bwd, "decode": decode}
    assert tuple(jobs) == JOBS
    info = {
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "class": type(model).__name__,
        "params": sum(p.numel() for p in model.parameters()),
        "threads": torch.get_num_threads(),
    }
    print(json.dumps(info), flush=True)
    for line in sys.stdin:
        job, repeats, warm = line.split()
        print(json.dumps(_median_s(jobs[job], int(repeats), warm == "1")), flush=True)


# --------------------------------------------------------------------------------------------
# Our side, and the driver.


class Peer:
    """The torch process: ``time(job, repeats)`` returns its median seconds."""

    def __init__(self, python: str, folder: str, threads: int):
        self.proc = subprocess.Popen(
            [python, os.path.abspath(__file__), "--serve", folder, "--torch-threads", str(threads)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        self.info = json.loads(self._line())

    def _line(self) -> str:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the torch process exited with code {self.proc.wait()}")
        return line

    def time(self, job: str, repeats: int, warm: bool) -> float:
        self.proc.stdin.write(f"{job} {repeats} {int(warm)}\n")
        self.proc.stdin.flush()
        return json.loads(self._line())

    def close(self) -> None:
        self.proc.stdin.close()
        self.proc.wait(timeout=60)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--torch-python", default="", help="a python with torch and transformers")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--new", type=int, default=128, help="response tokens per sequence")
    ap.add_argument("--rounds", type=int, default=3, help="alternating rounds of each side")
    ap.add_argument("--repeats", type=int, default=5, help="timed calls per round")
    ap.add_argument(
        "--torch-threads",
        type=int,
        default=2,
        help="torch's intra-op threads; 1 on a machine busier than its cores, where two threads "
        "spin-wait on each other",
    )
    ap.add_argument("--serve", default="", help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.serve:
        return serve(args.serve, args.torch_threads)
    if not args.torch_python:
        ap.error("--torch-python is required (see the module docstring for the venv)")

    import jax
    import jax.numpy as jnp

    from sat_jax.models import ModelConfig, init_model, save_hf, token_logprobs
    from sat_jax.sampling import Sampler, SamplingParams

    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    import _results

    config = ModelConfig.tiny()
    graphdef, params = init_model(config, seed=0)
    rng = np.random.default_rng(0)
    tokens = rng.integers(1, config.vocab_size, size=(args.batch, PROMPT + args.new))
    prompts, lengths = tokens[:, :PROMPT], np.full(args.batch, PROMPT)

    def jobs(cfg):
        """Our fwd+bwd and decode on ``params`` with the program layout of ``cfg``."""
        g, _ = init_model(cfg, seed=0)  # the graph only: the same parameters run either layout
        sampler = Sampler(
            cfg, max_prompt_len=PROMPT, max_new_tokens=args.new, eos_id=cfg.vocab_size - 1
        )

        def loss(p):
            logp = token_logprobs(g, p, jnp.asarray(tokens), response_start=PROMPT)[0]
            return -jnp.sum(logp)

        grad = jax.jit(jax.value_and_grad(loss))
        return {
            "fwd_bwd": lambda: jax.block_until_ready(grad(params)),
            "decode": lambda: jax.block_until_ready(
                sampler.decode(
                    params,
                    sampler.init(params, prompts, lengths, jax.random.key(1), SamplingParams()),
                ).tokens
            ),
        }

    layouts = {
        "scan": jobs(config),
        "unrolled": jobs(config.replace(scan_unroll=config.num_layers)),
    }
    with tempfile.TemporaryDirectory() as folder:
        save_hf(folder, config, params)
        np.save(os.path.join(folder, "tokens.npy"), tokens)
        peer = Peer(args.torch_python, folder, args.torch_threads)
        sides = ("torch", *layouts)
        rounds = {f"{side}_{job}": [] for side in sides for job in JOBS}
        try:
            for i in range(args.rounds):
                for job in JOBS:
                    print(f"round {i + 1}/{args.rounds}: {job}", file=sys.stderr, flush=True)
                    # Each round alternates which of our layouts runs first.
                    for name in list(layouts)[:: 1 if i % 2 == 0 else -1]:
                        fn = layouts[name][job]
                        rounds[f"{name}_{job}"].append(_median_s(fn, args.repeats, warm=i == 0))
                    rounds[f"torch_{job}"].append(peer.time(job, args.repeats, warm=i == 0))
        finally:
            peer.close()

    def ratio(job, num, den):  # median over rounds of the same round's pair
        pairs = np.array(rounds[f"{num}_{job}"]) / np.array(rounds[f"{den}_{job}"])
        return round(float(np.median(pairs)), 3)

    decode_tokens = args.batch * args.new
    med = {k: float(np.median(v)) for k, v in rounds.items()}
    out = {
        "model": "ModelConfig.tiny(): 4 blocks, d 128, 32 experts top-4 (width 32), vocab 128",
        "params": sum(int(x.size) for x in jax.tree.leaves(params)),
        "batch": args.batch,
        "prompt": PROMPT,
        "new_tokens": args.new,
        "rounds": args.rounds,
        "repeats": args.repeats,
        "peer": peer.info,
        "fwd_bwd_ms": {side: med[f"{side}_fwd_bwd"] * 1e3 for side in sides},
        "decode_tokens_per_s": {side: decode_tokens / med[f"{side}_decode"] for side in sides},
        **{
            f"{job}_torch_over_ours{suffix}": ratio(job, "torch", name)
            for job in JOBS
            for name, suffix in (("scan", ""), ("unrolled", "_unrolled"))
        },
        **{f"{job}_unrolled_over_scan": ratio(job, "unrolled", "scan") for job in JOBS},
    }
    print(json.dumps(out, indent=1))
    _results.write("transformers_model_pass", out)


if __name__ == "__main__":
    main()
