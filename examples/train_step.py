"""SAT in your own train step, with a real (tiny) Flax NNX policy.

The README quotes the part between the ``readme`` markers; ``tests/package/test_example.py`` runs
this file and checks the quote. Run it: ``python examples/train_step.py``.
"""

import jax.numpy as jnp
from flax import nnx

VOCAB, DIM = 16, 8


class TokenPolicy(nnx.Module):
    """Next-token logits from a token embedding and a linear head: the smallest real policy."""

    def __init__(self, rngs: nnx.Rngs):
        self.embed = nnx.Embed(VOCAB, DIM, rngs=rngs)
        self.head = nnx.Linear(DIM, VOCAB, rngs=rngs)

    def __call__(self, tokens):  # [B, T] -> [B, T, VOCAB]
        return self.head(self.embed(tokens))


graphdef, init_params = nnx.split(TokenPolicy(nnx.Rngs(0)))


def policy_logprobs(params, tokens):
    """log π(tokens[:, t+1] | tokens[:, t]) under ``params``: tokens [B, T+1] -> [B, T]."""
    logits = nnx.merge(graphdef, params)(tokens[:, :-1]).astype(jnp.float32)
    logp = nnx.log_softmax(logits)
    return jnp.take_along_axis(logp, tokens[:, 1:, None], axis=-1)[..., 0]


# readme: start
import jax
import optax

from sat_jax import losses


def train_step(params, opt_state, batch):  # batch: tokens, behavior_logp, advantages, mask
    def loss_fn(params):
        logp = policy_logprobs(params, batch["tokens"])  # [B, T], your model
        out = losses.sat(
            logp,
            batch["behavior_logp"],
            batch["advantages"],
            batch["mask"],
            eps_low=0.2,
            eps_high=0.2,
            alpha=0.9,  # the paper's defaults
        )
        return out.loss, out.metrics  # metrics: mismatch, sat/q, sat/binding_rate, ...

    (loss, metrics), grads = jax.value_and_grad(loss_fn, has_aux=True)(params)
    updates, opt_state = optimizer.update(grads, opt_state, params)
    return optax.apply_updates(params, updates), opt_state, metrics


optimizer = optax.adam(1e-2, b1=0.9, b2=0.98)  # a tiny policy's rate; LLMs take ~1e-6
train_step = jax.jit(train_step)
# readme: end


def make_batch(key, params, batch_size=8, length=6, mismatch=0.05):
    """Sequences with the log-probs a rollout engine recorded (the policy's, off by noise of
    scale ``mismatch``: a stale or lower-precision engine), per-sequence advantages and a mask
    whose rows end at different lengths."""
    k_tokens, k_noise, k_adv = jax.random.split(key, 3)
    tokens = jax.random.randint(k_tokens, (batch_size, length + 1), 0, VOCAB)
    noise = mismatch * jax.random.normal(k_noise, (batch_size, length))
    lengths = jnp.arange(batch_size) % length + 1
    return {
        "tokens": tokens,
        "behavior_logp": policy_logprobs(params, tokens) + noise,
        "advantages": jax.random.normal(k_adv, (batch_size,)),
        "mask": jnp.arange(length)[None, :] < lengths[:, None],
    }


def main(steps: int = 20) -> None:
    params, opt_state = init_params, optimizer.init(init_params)
    batch = make_batch(jax.random.key(0), params)
    for step in range(steps):
        params, opt_state, metrics = train_step(params, opt_state, batch)
        if step % 5 == 0 or step == steps - 1:
            print(
                f"step {step:2d}  mismatch {float(metrics['mismatch']):.4f}  "
                f"SAT binding rate {float(metrics['sat/binding_rate']):.3f}"
            )


if __name__ == "__main__":
    main()
