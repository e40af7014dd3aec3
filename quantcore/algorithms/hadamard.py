"""Hadamard matrices of the sizes real models need, plain, randomised with a seed, or block-diagonal.

A Hadamard matrix H of order n has entries ±1 and ``H Hᵀ = n I``, so ``H / √n`` is orthogonal: rotating a layer's
input by it spreads one outlier channel's magnitude evenly over all n channels (QuaRot, SpinQuant, QuIP#).

Orders built here (:func:`hadamard_matrix`):

- powers of two, by Sylvester's doubling ``H_2n = [[H, H], [H, -H]]``;
- the known small orders 12, 20, 28, 36, 44 by Paley's constructions (Paley I for a prime q ≡ 3 mod 4 gives order
  q + 1: 12, 20, 44; Paley II for a prime q ≡ 1 mod 4 gives 2(q + 1): 28, 36), times any power of two (40 = 20 × 2);
- Kronecker products of those (the product of Hadamard matrices is one): 576 = 36 × 16, or 144 = 12 × 12.

A width none of these reach (e.g. 832 = 13 × 64: no Hadamard factor of 13 or 52 is built) takes a block Hadamard:
``block_size`` b divides the width n into n / b diagonal blocks, each the order-b Hadamard (MR-GPTQ's block rotation,
llm-compressor's ``transform_block_size``); outliers then spread within a block only. Randomised Hadamard multiplies
the columns by a random ±1 diagonal drawn from a :class:`torch.Generator` seeded with the stored seed, so the same seed
gives the same matrix on every machine. Everything is computed in float64.
"""

from __future__ import annotations

import functools

import torch

#: the small Hadamard orders built by Paley's constructions, with the prime each comes from and the construction
PALEY_ORDERS: dict[int, tuple[int, int]] = {12: (11, 1), 20: (19, 1), 28: (13, 2), 36: (17, 2), 44: (43, 1)}
MAX_ORDER = 1 << 16  # widest rotation built (65,536): a dense float64 matrix of that order is 32 GiB already


def _legendre(a: int, q: int) -> int:
    """χ(a) over the prime field q: 0, 1 for a square, -1 otherwise (Euler's criterion)."""
    a %= q
    if a == 0:
        return 0
    return 1 if pow(a, (q - 1) // 2, q) == 1 else -1


def _jacobsthal(q: int) -> torch.Tensor:
    """Q[i, j] = χ(j - i), the q × q Jacobsthal matrix of the prime q."""
    return torch.tensor([[_legendre(j - i, q) for j in range(q)] for i in range(q)], dtype=torch.float64)


def _paley(q: int, construction: int) -> torch.Tensor:
    """Paley I (q ≡ 3 mod 4: order q + 1) or Paley II (q ≡ 1 mod 4: order 2(q + 1)) Hadamard matrix."""
    jac = _jacobsthal(q)
    ones = torch.ones(q, dtype=torch.float64)
    if construction == 1:
        s = torch.zeros(q + 1, q + 1, dtype=torch.float64)
        s[0, 1:], s[1:, 0], s[1:, 1:] = ones, -ones, jac
        return s + torch.eye(q + 1, dtype=torch.float64)
    s = torch.zeros(q + 1, q + 1, dtype=torch.float64)
    s[0, 1:], s[1:, 0], s[1:, 1:] = ones, ones, jac
    a = torch.tensor([[1.0, -1.0], [-1.0, -1.0]], dtype=torch.float64)
    b = torch.tensor([[1.0, 1.0], [1.0, -1.0]], dtype=torch.float64)
    return torch.kron(s, a) + torch.kron(torch.eye(q + 1, dtype=torch.float64), b)


def _sylvester(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h


def hadamard_factors(n: int) -> tuple[int, ...] | None:
    """The orders whose Kronecker product makes a Hadamard matrix of order ``n``: (2^k,) for a power of two, one
    Paley order and a power of two where one does (576 → (36, 16)), else a product of Paley orders and a power of two
    (144 → (12, 12)); None when none reaches ``n``."""
    if n < 1:
        return None
    if n & (n - 1) == 0:
        return (n,)
    for m in PALEY_ORDERS:  # one small factor, as QuaRot and compressed-tensors build theirs
        if n % m == 0 and (rest := n // m) & (rest - 1) == 0:
            return (m, rest)
    for m in PALEY_ORDERS:
        if n % m == 0 and (more := hadamard_factors(n // m)) is not None:
            return (m, *more)
    return None


def has_hadamard(n: int) -> bool:
    """Whether :func:`hadamard_matrix` builds order ``n``."""
    return 0 < n <= MAX_ORDER and hadamard_factors(n) is not None


@functools.lru_cache(maxsize=32)
def _hadamard_cached(n: int) -> torch.Tensor:
    factors = hadamard_factors(n)
    if factors is None or n > MAX_ORDER:
        raise ValueError(
            f"no Hadamard matrix of order {n} is built here (orders: powers of two times products of "
            f"{', '.join(map(str, PALEY_ORDERS))}, up to {MAX_ORDER}); choose a block size that divides {n} and is "
            "one of those orders (e.g. a power of two)")
    h = torch.ones(1, 1, dtype=torch.float64)
    for f in factors:
        h = torch.kron(h, _paley(*PALEY_ORDERS[f]) if f in PALEY_ORDERS else _sylvester(f))
    return h


def hadamard_matrix(n: int) -> torch.Tensor:
    """The ±1 Hadamard matrix of order ``n`` (float64, ``H Hᵀ = n I``); ValueError for an order not built here."""
    return _hadamard_cached(int(n)).clone()


def random_signs(n: int, seed: int) -> torch.Tensor:
    """(n,) ±1 float64 drawn from a CPU :class:`torch.Generator` seeded with ``seed`` (the same on every machine)."""
    gen = torch.Generator().manual_seed(int(seed))
    return torch.randint(0, 2, (n,), generator=gen).to(torch.float64) * 2 - 1


def rotation_matrix(n: int, *, block_size: int | None = None, seed: int | None = None) -> torch.Tensor:
    """The orthogonal (n, n) rotation ``diag(d) · blockdiag(H_b, …) / √b`` in float64.

    block_size: b, the order of each diagonal block (None: one Hadamard of order n); must divide n.
    seed: draw the ±1 diagonal d from this seed (randomised Hadamard); None: d = 1.
    """
    b = n if block_size is None else int(block_size)
    if b < 1 or n % b:
        raise ValueError(f"block size {b} does not divide the width {n}; choose a divisor of {n}")
    hb = hadamard_matrix(b) / float(b) ** 0.5
    q = hb if b == n else torch.block_diag(*([hb] * (n // b)))
    if seed is not None:
        q = random_signs(n, seed)[:, None] * q
    return q


__all__ = ["MAX_ORDER", "PALEY_ORDERS", "hadamard_factors", "hadamard_matrix", "has_hadamard", "random_signs",
           "rotation_matrix"]
