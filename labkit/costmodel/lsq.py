"""A small, deterministic Levenberg-Marquardt fit of positive constants.

The cost model's constants are all positive (latencies, efficiencies, costs), and what
matters is *relative* error (a 10 us kernel and a 100 ms one count alike), so the fit
works on log(constant) (on its logit for efficiencies, which are bounded by 1) and
minimises the log-ratio log(predicted / measured) of every measurement. A soft-L1 loss
(quadratic below `scale`, linear above) keeps the few rows that a heuristic kernel
choice makes odd from dragging the physics. Derivatives are forward differences; the
iteration is plain numpy, so the same data gives the same constants.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np


def _loss(r: np.ndarray, scale: float) -> float:
    return float(np.sum(scale * scale * (np.sqrt(1.0 + (r / scale) ** 2) - 1.0)))


def _to_free(c: np.ndarray, upper: np.ndarray) -> np.ndarray:
    b = np.isfinite(upper)
    x = np.log(c)
    x[b] = np.log(c[b] / (upper[b] - c[b]))
    return x


def _from_free(x: np.ndarray, upper: np.ndarray) -> np.ndarray:
    b = np.isfinite(upper)
    c = np.exp(np.minimum(x, 700.0))
    c[b] = upper[b] / (1.0 + np.exp(-x[b]))
    return c


def fit_log_params(residuals: Callable[[np.ndarray], np.ndarray], x0: np.ndarray,
                   upper: np.ndarray | None = None, scale: float = 0.1,
                   max_iter: int = 200) -> np.ndarray:
    """Minimise sum soft_l1(residuals(constants)) over the constants, each positive and
    below its `upper` bound (inf: unbounded; efficiencies are bounded by 1 through a
    logistic, the rest are fitted as logarithms). Returns the constants."""
    x0 = np.asarray(x0, dtype=np.float64)
    upper = np.full(x0.size, np.inf) if upper is None else np.asarray(upper, dtype=np.float64)
    x = _to_free(x0, upper)
    r = residuals(_from_free(x, upper))
    cost = _loss(r, scale)
    damping = 1e-3
    for _ in range(max_iter):
        jac = np.empty((r.size, x.size))
        for j in range(x.size):
            step = 1e-6 * max(1.0, abs(x[j]))
            xj = x.copy()
            xj[j] += step
            jac[:, j] = (residuals(_from_free(xj, upper)) - r) / step
        # iteratively reweighted least squares for the soft-L1 loss
        w = 1.0 / np.sqrt(np.sqrt(1.0 + (r / scale) ** 2))
        jw, rw = jac * w[:, None], r * w
        a, g = jw.T @ jw, jw.T @ rw
        improved = False
        while damping < 1e10:
            dx = np.linalg.solve(a + damping * np.diag(np.diag(a) + 1e-12), -g)
            r_new = residuals(_from_free(x + dx, upper))
            cost_new = _loss(r_new, scale)
            if np.isfinite(cost_new) and cost_new < cost:
                improved = True
                break
            damping *= 4.0
        if not improved:
            break
        converged = cost - cost_new < 1e-10 * cost
        x, r, cost = x + dx, r_new, cost_new
        damping = max(damping / 3.0, 1e-9)
        if converged:
            break
    return _from_free(x, upper)
