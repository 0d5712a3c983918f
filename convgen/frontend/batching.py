"""Unbatched input, as PyTorch takes it: one image without its batch axis gives one result without it.

Every op (1-D, 2-D and 3-D, forward and backward) is wrapped by `accepts_unbatched`, the one place
that knows about unbatched calls. An op of spatial rank r takes batched arrays of r + 2 dimensions
(x (N, C, ...)); given x of r + 1 dimensions (C, ...) it runs on a batch of one, made by adding the
batch axis as a view (no copy), and drops that axis from the result again (a view too). `out=` of
an unbatched call has the unbatched shape, and so has a fused epilogue's `residual`. A backward op
needs dy and x both batched or both not.
"""

from __future__ import annotations

import functools

import numpy as np

from .resolve import split_out


def _ndim(value):
    """Dimensions of an array or array-like, or None when NumPy cannot read it (the op then says why)."""
    if isinstance(value, np.ndarray):
        return value.ndim
    if value is None or isinstance(value, (str, bytes)):
        return None
    try:
        return np.ndim(value)
    except (TypeError, ValueError):
        return None


def _with_batch(value):
    """`value` with a batch axis of one in front: a view of an array; a Python sequence stays one, so
    that it still adopts the other arrays' dtype."""
    if isinstance(value, np.ndarray):
        return value[np.newaxis]
    if isinstance(value, (list, tuple)):
        return [value]
    return np.asarray(value)[np.newaxis]


def _batched_out(name, out, unbatched_ndim):
    """The caller's unbatched output array as a batch of one (a view), or None."""
    if out is None or not isinstance(out, np.ndarray):
        return out  # not an array: the op refuses it by name
    if out.ndim != unbatched_ndim:
        raise ValueError(f"{name} must be unbatched like x ({unbatched_ndim} dimensions), got shape {out.shape}")
    return out[np.newaxis]


def _mixed(dy_ndim, x_ndim, batched):
    raise ValueError(f"dy and x must both be batched ({batched} dimensions) or both unbatched ({batched - 1}); "
                     f"got dy with {dy_ndim} and x with {x_ndim}")


def accepts_unbatched(rank: int):
    """Decorate an op of spatial rank `rank` so that it also takes unbatched input.

    A forward op is called as op(x, w, bias=None, *, out=None, **keywords), a backward op as
    op(dy, x, w, *, out=None, **keywords); batched calls pass straight through.
    """
    batched = rank + 2

    def decorate(op):
        if op.__name__.endswith("_backward"):
            @functools.wraps(op)
            def backward(dy, x, w, *, out=None, **keywords):
                x_ndim = x.ndim if type(x) is np.ndarray else _ndim(x)
                dy_ndim = dy.ndim if type(dy) is np.ndarray else _ndim(dy)
                if x_ndim != batched - 1:
                    if x_ndim == batched and dy_ndim == batched - 1:
                        _mixed(dy_ndim, x_ndim, batched)
                    return op(dy, x, w, out=out, **keywords)
                if dy_ndim != batched - 1:
                    _mixed(dy_ndim, x_ndim, batched)
                out_dx, out_dw, out_db = split_out(out)
                dx, dw, db = op(_with_batch(dy), _with_batch(x), w,
                                out=None if out is None else (_batched_out("out[0] (dx)", out_dx, batched - 1),
                                                              out_dw, out_db), **keywords)
                return (dx[0] if out_dx is None else out_dx), dw, db

            return backward

        @functools.wraps(op)
        def forward(x, w, bias=None, *, out=None, **keywords):
            if (x.ndim if type(x) is np.ndarray else _ndim(x)) != batched - 1:
                return op(x, w, bias, out=out, **keywords)
            if keywords.get("residual") is not None:  # (a fused epilogue's: shaped as the unbatched result)
                residual = keywords["residual"]
                if _ndim(residual) != batched - 1:
                    raise ValueError(f"residual must be unbatched like x ({batched - 1} dimensions), got shape "
                                     f"{np.shape(residual)}")
                keywords["residual"] = _with_batch(residual)
            y = op(_with_batch(x), w, bias, out=_batched_out("out", out, batched - 1), **keywords)
            return y[0] if out is None else out

        return forward

    return decorate


__all__ = ["accepts_unbatched"]
