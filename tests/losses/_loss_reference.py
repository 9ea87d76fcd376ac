"""An independent NumPy (float64) reference for every objective, written from SPEC.md's formulas.

Detached quantities (SAT's q and c±, GSPO-token's sg(log ρ), SeqClip's and DPPO's masks) are
computed from ``frozen`` (the unperturbed logp), so central finite differences of ``loss`` in
``logp`` give the gradient that the JAX functions compute with stop-gradients.
"""

from __future__ import annotations

import math
from fractions import Fraction

import numpy as np

CLAMP = 20.0


def lower_quantile(values, alpha):
    """⌈α·n⌉-th smallest of ``values`` with α read as the decimal it is written as."""
    values = np.sort(np.asarray(values, np.float64))
    n = values.size
    if n == 0:
        return 0.0
    k = math.ceil(Fraction(repr(float(alpha))) * n)
    return float(values[k - 1])


def _lr(logp, beh, mask):
    return np.where(mask, np.clip(logp - beh, -CLAMP, CLAMP), 0.0)


SEQ_CAP = 10.0


def _seq_lr(logp, beh, mask, cap=SEQ_CAP):
    """Sequence log-ratio: mean of ±20-clamped token log-ratios, then capped above at ``cap``."""
    lr = _lr(logp, beh, mask)
    n = mask.sum(1)
    seq = np.where(n > 0, lr.sum(1) / np.maximum(n, 1), 0.0)
    if cap is not None:
        seq = np.minimum(seq, cap)
    return np.broadcast_to(seq[:, None], logp.shape)


def aggregate(values, mask, mode):
    x = np.where(mask, values, 0.0)
    m = mask.astype(np.float64)
    if mode == "token-mean":
        return x.sum() / max(m.sum(), 1.0)
    if mode == "seq-mean-token-sum-norm":
        return x.sum() / (x.shape[0] * x.shape[1])
    if mode == "seq-mean-token-sum-norm-active":
        return x.sum() / (max((m.sum(1) > 0).sum(), 1) * x.shape[1])
    if mode == "seq-sum-token-sum-norm":
        return x.sum() / x.shape[1]
    n = m.sum(1)
    active = n > 0
    if not active.any():
        return 0.0
    per_seq = x.sum(1)
    if mode == "seq-mean-token-mean":
        per_seq = per_seq / np.maximum(n, 1)
    return per_seq[active].mean()


def hill(u, q, p=2.0):
    return 1.0 / (1.0 + (u / q) ** p)


def sat_factors(d, mask, alpha, p=2.0):
    """q, gate and c± of Eqs. (14)–(16) for a detached score d."""
    a = np.abs(d)
    q = lower_quantile(a[mask], alpha)
    gated = mask & (q > 0) & (a > q)
    qs = q if q > 0 else 1.0
    c_plus = np.where(gated & (d > 0), hill(np.maximum(d, 0), qs, p), 1.0)
    c_minus = np.where(gated & (d < 0), hill(np.maximum(-d, 0), qs, p), 1.0)
    return q, gated, c_minus, c_plus


def clipped(r, adv, lo, hi, dual_clip=None):
    s = np.minimum(r * adv, np.clip(r, lo, hi) * adv)
    if dual_clip is not None:
        s = np.where(adv < 0, np.maximum(s, dual_clip * adv), s)
    return s


def bern_kl(p, q):
    p = np.clip(p, 0.0, 1.0)
    q = np.clip(q, 0.0, 1.0)
    with np.errstate(divide="ignore", invalid="ignore"):
        a = np.where(p > 0, p * np.log(p / q), 0.0)
        b = np.where(p < 1, (1 - p) * np.log((1 - p) / (1 - q)), 0.0)
    return a + b


def surrogate(name, logp, beh, adv, mask, frozen, **hp):
    """Per-token surrogate S (maximised) of objective ``name``."""
    logp = np.where(mask, logp, 0.0)
    frozen = np.where(mask, frozen, 0.0)
    beh = np.where(mask, beh, 0.0)
    adv = np.where(mask, np.broadcast_to(adv if adv.ndim == 2 else adv[:, None], logp.shape), 0.0)
    # GSPO's own defaults are the GSPO paper's; every other clipped objective uses the SAT paper's.
    default = (3e-4, 4e-4) if name in ("gspo", "gspo_token", "seqclip") else (0.2, 0.2)
    el, eh = hp.get("eps_low", default[0]), hp.get("eps_high", default[1])
    if name == "ppo":
        r = np.exp(_lr(logp, beh, mask))
        return clipped(r, adv, 1 - el, 1 + eh, hp.get("dual_clip"))
    if name == "sat":
        d = _lr(frozen, beh, mask)
        _, _, cm, cp = sat_factors(d, mask, hp.get("alpha", 0.9), hp.get("hill_exponent", 2.0))
        r = np.exp(_lr(logp, beh, mask))
        return clipped(r, adv, 1 - el * cm, 1 + eh * cp, hp.get("dual_clip"))
    cap = hp.get("seq_log_ratio_cap", SEQ_CAP)
    if name == "gspo":
        rho = np.exp(_seq_lr(logp, beh, mask, cap))
        return clipped(rho, adv, 1 - el, 1 + eh)
    if name == "gspo_token":
        log_s = _seq_lr(frozen, beh, mask, None) + logp - frozen
        log_s = log_s if cap is None else np.minimum(log_s, cap)  # capped after the sum
        return clipped(np.exp(log_s), adv, 1 - el, 1 + eh)
    if name == "sat_gspo":
        d = _seq_lr(frozen, beh, mask, cap)
        _, _, cm, cp = sat_factors(d, mask, hp.get("alpha", 0.9), hp.get("hill_exponent", 2.0))
        rho = np.exp(_seq_lr(logp, beh, mask, cap))
        return clipped(rho, adv, 1 - el * cm, 1 + eh * cp)
    if name == "seqclip":
        rho0 = np.exp(_seq_lr(frozen, beh, mask, cap))
        keep = (rho0 >= hp.get("low", 0.995)) & (rho0 <= hp.get("high", 1.005))
        rho = np.exp(_seq_lr(logp, beh, mask, cap))
        return np.where(keep, clipped(rho, adv, 1 - el, 1 + eh), 0.0)
    if name == "dppo":
        r0 = np.exp(_lr(frozen, beh, mask))
        mu = np.exp(beh)
        if hp.get("divergence", "tv") == "tv":
            disc = mu * np.abs(r0 - 1)
            delta = hp.get("delta", 1e-3)
        else:
            disc = bern_kl(mu, np.exp(frozen))
            delta = hp.get("delta", 0.05)
        dropped = (adv * (r0 - 1) > 0) & (disc > delta)
        if hp.get("variant", "paper") == "verl":  # mask instead of clip, detached capped weight
            w = np.minimum(r0, hp.get("ratio_cap", 20.0))
            return np.where(dropped, 0.0, w * adv * (1.0 + logp - frozen))
        r = np.exp(_lr(logp, beh, mask))
        return np.where(dropped, 0.0, clipped(r, adv, 1 - el, 1 + eh))
    if name == "spo":
        r = np.exp(_lr(logp, beh, mask))
        return r * adv - np.abs(adv) / (2 * hp.get("eps", 0.2)) * (r - 1) ** 2
    if name == "drpo":
        r = np.exp(_lr(logp, beh, mask))
        return r * adv - np.abs(adv) / (2 * hp.get("delta", 1e-3)) * np.exp(beh) * (r - 1) ** 2
    if name == "tis_pg":  # detached truncated ratio times the REINFORCE term: value min(r, C)·A
        w = np.minimum(np.exp(_lr(frozen, beh, mask)), hp.get("cap", 2.0))
        return w * adv * (1.0 + logp - frozen)
    raise KeyError(name)


def loss(name, logp, beh, adv, mask, *, frozen=None, aggregation="token-mean", weights=None, **hp):
    logp, beh, adv = (np.asarray(x, np.float64) for x in (logp, beh, adv))
    mask = np.asarray(mask, bool)
    frozen = logp if frozen is None else np.asarray(frozen, np.float64)
    s = surrogate(name, logp, beh, adv, mask, frozen, **hp)
    if weights is not None:
        s = s * np.asarray(weights, np.float64)
    return -aggregate(s, mask, aggregation)


def grad(name, logp, beh, adv, mask, h=1e-6, **kw):
    """Central finite differences of ``loss`` in logp, detached parts held at ``logp``."""
    logp = np.asarray(logp, np.float64)
    return central_difference(lambda x: loss(name, x, beh, adv, mask, frozen=logp, **kw), logp, h)[
        1
    ]


def mismatch(logp, beh, mask):
    d = _lr(np.asarray(logp, np.float64), np.asarray(beh, np.float64), mask)[mask]
    if d.size == 0:
        return {"mismatch": 0.0, "k1": 0.0, "k3": 0.0, "log_ratio_var": 0.0, "mismatch_max": 0.0}
    return {
        "mismatch": np.abs(d).mean(),
        "k1": (-d).mean(),
        "k3": (np.expm1(d) - d).mean(),
        "log_ratio_var": d.var(),
        "mismatch_max": np.abs(d).max(),
    }


def central_difference(f, x, h=1e-6):
    """``f(x)`` and the central finite-difference gradient of the scalar ``f`` at the float64
    array ``x``: the gradient a peer's autograd would give its loss."""
    x = np.asarray(x, np.float64)
    g = np.zeros_like(x)
    for idx in np.ndindex(*x.shape):
        up, dn = x.copy(), x.copy()
        up[idx] += h
        dn[idx] -= h
        g[idx] = (f(up) - f(dn)) / (2 * h)
    return f(x), g
