"""The grading worker: run as a script by `sat_jax.data.grading.Grader`, never imported.

It imports neither sat_jax nor JAX, so it starts quickly and a crash or a kill costs nothing but
itself. Protocol on stdin/stdout: 8-byte big-endian length, then a pickle. The worker first sends
``("ready", None)``; then each request ``(kind, args)`` gets ``("ok", value)`` or
``("error", message)``.
"""

import importlib
import importlib.util
import pickle
import sys

_DATASETS = {}


def _read(stream, n):
    data = b""
    while len(data) < n:
        chunk = stream.read(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return data


def _send(stream, message):
    data = pickle.dumps(message, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(len(data).to_bytes(8, "big") + data)
    stream.flush()


def math_verify_equal(reference, answer):
    """math-verify's verdict on two answer strings (each already cut out of its text)."""
    from math_verify import ExprExtractionConfig, LatexExtractionConfig, parse, verify

    configs = [LatexExtractionConfig(), ExprExtractionConfig()]
    # The deadline is the parent's; math-verify's own timeouts use SIGALRM, which this loop does
    # not need.
    gold = parse(f"${reference}$", configs, parsing_timeout=None)
    pred = parse(f"${answer}$", configs, parsing_timeout=None)
    return bool(gold and pred and verify(gold, pred, timeout_seconds=None))


def reasoning_gym_score(name, config, answer, entry):
    """The score of a reasoning-gym generator for ``answer`` on ``entry`` (its own scorer)."""
    key = (name, tuple(sorted(config.items())))
    if key not in _DATASETS:
        import reasoning_gym

        _DATASETS[key] = reasoning_gym.create_dataset(name, **config)
    return float(_DATASETS[key].score_answer(answer, entry))


KINDS = {
    "math_verify": math_verify_equal,
    "reasoning_gym": reasoning_gym_score,
}


def main():
    import logging

    logging.disable(logging.WARNING)  # math-verify warns that its own timeouts are off
    # Imports and the first parse (which loads the LaTeX grammar) before "ready", so that they
    # are not charged to an answer's deadline.
    for module in ("math_verify", "reasoning_gym"):
        if importlib.util.find_spec(module) is not None:
            importlib.import_module(module)
    if "math_verify" in sys.modules:
        math_verify_equal("\\frac{1}{2}", "0.5")
    stdin, stdout = sys.stdin.buffer, sys.stdout.buffer
    _send(stdout, ("ready", None))
    while True:
        try:
            n = int.from_bytes(_read(stdin, 8), "big")
            kind, args = pickle.loads(_read(stdin, n))
        except EOFError:
            return
        try:
            _send(stdout, ("ok", KINDS[kind](*args)))
        except Exception as e:  # a scorer's failure on one answer is that answer's zero
            _send(stdout, ("error", f"{type(e).__name__}: {e}"))


if __name__ == "__main__":
    main()
