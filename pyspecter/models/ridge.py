"""Ridge regression in closed form: the one fit behind the learned predictor's layer-ahead maps and its reuse maps
(models/predictor_fit.py, models/reuse_fit.py), below both so neither imports the other."""

from __future__ import annotations

import numpy as np


class Ridge:
    """Ridge regression of many targets on one design X [n, d], for any penalty, from one eigendecomposition.

    The penalty is ``alpha`` times the mean eigenvalue of the centred Gram matrix, so one alpha grid fits every
    layer whatever the scale of its activations. The intercept is not penalised (X and Y are centred)."""

    def __init__(self, X: np.ndarray) -> None:
        X = np.asarray(X, np.float64)
        self.mean = X.mean(axis=0)
        self.Xc = X - self.mean
        self.s, self.Q = np.linalg.eigh(self.Xc.T @ self.Xc)
        self.s = np.maximum(self.s, 0.0)
        self.scale = max(float(self.s.mean()), 1e-30)

    def project(self, Y: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """What every solve shares: Qᵀ Xcᵀ (Y - ȳ), and ȳ."""
        Y = np.asarray(Y, np.float64)
        ym = Y.mean(axis=0)
        return self.Q.T @ (self.Xc.T @ (Y - ym)), ym

    def solve(self, proj: tuple[np.ndarray, np.ndarray], alpha: float | np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """(B [d, m], c [m]) with Y ≈ X B + c; alpha a scalar or one per target column."""
        R, ym = proj
        a = np.asarray(alpha, np.float64) * self.scale
        B = self.Q @ (R / (self.s[:, None] + a))
        return B, ym - self.mean @ B

    def reduce_rank(self, B: np.ndarray, c: np.ndarray, rank: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """Reduced-rank ridge: the rank-r map closest to B in fitted values, B V Vᵀ with V the top right singular
        vectors of Xc B. Returns (P [d, r], V^T [r, m], c) so a prediction is (x @ P) @ Vᵀ + c: two linear layers
        d -> r -> m, fitted in closed form."""
        QB = self.Q.T @ B
        w, V = np.linalg.eigh(QB.T @ (self.s[:, None] * QB))  # (Xc B)ᵀ (Xc B), ascending
        V = V[:, ::-1][:, :rank]
        P = B @ V
        return P, V.T, c + self.mean @ B - self.mean @ P @ V.T
