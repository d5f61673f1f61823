"""LDLᵀ with Bunch–Kaufman pivoting: factors, pivots and info equal CPU PyTorch's (LAPACK)."""

import torch

import tpu_train  # noqa: F401  (registers the tpu device)

TOL = dict(atol=1e-4, rtol=1e-4)


def _matrices():
    """Symmetric indefinite, nonsymmetric (only the lower triangle counts), a zero leading
    diagonal (forces 2 x 2 blocks), a zero column (info) and batched, sizes 1-7."""
    generator = torch.Generator().manual_seed(0)
    out = []
    for trial in range(60):
        n = (1, 2, 3, 4, 5, 7)[trial % 6]
        a = torch.randn(n, n, generator=generator)
        if trial % 3 == 0:
            a = a + a.mT
        if trial % 4 == 0:
            a.diagonal().mul_(0.01)
        if trial % 10 == 5:
            a[:, 0] = 0.0
            a[0, :] = 0.0
        out.append(a)
    out.append(torch.randn(2, 3, 5, 5, generator=generator))
    return out


def test_factor_equals_cpu_lapack_with_its_pivots():
    blocks = 0
    for a in _matrices():
        ld, pivots, info = torch.linalg.ldl_factor_ex(a)
        got = torch.linalg.ldl_factor_ex(a.to("tpu"))
        assert torch.equal(got.pivots.cpu(), pivots), (a, pivots, got.pivots)
        assert torch.equal(got.info.cpu(), info)
        torch.testing.assert_close(got.LD.cpu(), ld, **TOL, equal_nan=True)
        blocks += int((pivots < 0).sum())
    assert blocks > 0  # the 2 x 2 pivot path ran
    assert any(torch.linalg.ldl_factor_ex(a).info.ne(0).any() for a in _matrices())


def test_solve_equals_cpu():
    generator = torch.Generator().manual_seed(1)
    for a in _matrices():
        ld, pivots, info = torch.linalg.ldl_factor_ex(a + a.mT)
        if info.ne(0).any():
            continue
        b = torch.randn(*a.shape[:-1], 3, generator=generator)
        want = torch.linalg.ldl_solve(ld, pivots, b)
        got = torch.linalg.ldl_solve(ld.to("tpu"), pivots.to("tpu"), b.to("tpu"))
        torch.testing.assert_close(got.cpu(), want, atol=1e-3, rtol=1e-3)
    # LD batched, B broadcast over the batch.
    a = torch.randn(2, 4, 4, generator=generator)
    ld, pivots = torch.linalg.ldl_factor(a + a.mT)
    b = torch.randn(4, 2, generator=generator)
    got = torch.linalg.ldl_solve(ld.to("tpu"), pivots.to("tpu"), b.to("tpu"))
    torch.testing.assert_close(got.cpu(), torch.linalg.ldl_solve(ld, pivots, b), atol=1e-3,
                               rtol=1e-3)
