"""`winograd`: F(2x2, 3x3) for 2-D 3x3, stride-1, undilated filters, all three kinds, with the reason
it refuses other problems (3-D ones among them) and its workspace layout beside it; workspace grows
linearly with n."""

from __future__ import annotations

import functools

import numpy as np

from ucudnn.backends.cpu.common import _blend, _gather
from ucudnn.backends.cpu.layout import _Layout
from ucudnn.problem import ConvProblem

# ---- Winograd F(2x2, 3x3) --------------------------------------------------------------------
# Y = A^T [(G g G^T) . (B^T d B)] A on 4x4 input tiles that overlap by 2, with the 16 products
# summed over channels as 16 GEMMs (one numpy.matmul over the 16 points and the groups). NumPy has
# no Winograd. The image transforms read overlapping strided views of the tiles, so they are
# written out as additions of views with `out=`:
#   B^T d  : d0 - d2, d1 + d2, d2 - d1, d1 - d3
#   A^T m  : m0 + m1 + m2, m1 - m2 - m3
# Filters do not overlap, so their transform is one GEMM with kron(G, G) (16 x 9).
# bwd_data is the same correlation of dy with the flipped, transposed filter: the flip reverses
# the 9 taps (columns of kron(G, G)) and the transpose is the GEMM's transposed operand. bwd_filter
# is F(3x3, 2x2), the transpose of the same algorithm: dW = G^T [(A e A^T) . (B^T d B)] G summed over
# tiles and samples, with A e : e0, e0 + e1, e0 - e1, -e1, and G^T . G one GEMM with kron(G, G)^T.

_WINO_G = np.array([[1.0, 0.0, 0.0], [0.5, 0.5, 0.5], [0.5, -0.5, 0.5], [0.0, 0.0, 1.0]])


@functools.cache
def _wino_filter_matrix(dtype: str, flipped: bool) -> np.ndarray:
    """kron(G, G) (16 x 9), its taps reversed when `flipped`; read-only."""
    matrix = np.kron(_WINO_G, _WINO_G)
    matrix = np.ascontiguousarray(matrix[:, ::-1] if flipped else matrix, dtype=dtype)
    matrix.flags.writeable = False
    return matrix


def _wino_tiles(out_h: int, out_w: int) -> tuple[int, int]:
    return -(-out_h // 2), -(-out_w // 2)


# Tiles are stored channels-last, (rows, cols, n, channels), so every transform step is an
# addition of views whose innermost axis is a long contiguous run of n * channels values, and each
# Winograd point is a (tiles * n) x channels matrix that BLAS reads as-is or transposed.


def _wino_input_transform(
    inp: np.ndarray, offsets: tuple[int, int], d: np.ndarray, t: np.ndarray, v: np.ndarray
) -> None:
    """v[a, b] (th, tw, n, cin) = B^T d B of the 4x4 tiles of inp (n, cin, H, W) read from `offsets`."""
    th, tw = v.shape[2:4]
    _gather(d.transpose(2, 3, 0, 1), inp, (1, offsets[0]), (1, offsets[1]))
    rows = [d[q : q + 2 * th : 2] for q in range(4)]
    np.subtract(rows[0], rows[2], out=t[0])
    np.add(rows[1], rows[2], out=t[1])
    np.subtract(rows[2], rows[1], out=t[2])
    np.subtract(rows[1], rows[3], out=t[3])
    for a in range(4):
        cols = [t[a][:, q : q + 2 * tw : 2] for q in range(4)]
        np.subtract(cols[0], cols[2], out=v[a, 0])
        np.add(cols[1], cols[2], out=v[a, 1])
        np.subtract(cols[2], cols[1], out=v[a, 2])
        np.subtract(cols[1], cols[3], out=v[a, 3])


def _wino_output_transform(
    m: np.ndarray, s: np.ndarray, yq: np.ndarray, out: np.ndarray, alpha: float, beta: float
) -> None:
    """out[:, :, 2ti + a, 2tj + b] = alpha * (A^T m A)[a, b] + beta * out, m (4, 4, th, tw, n, cout)."""
    np.add(m[0], m[1], out=s[0])
    np.add(s[0], m[2], out=s[0])
    np.subtract(m[1], m[2], out=s[1])
    np.subtract(s[1], m[3], out=s[1])
    oh, ow = out.shape[-2:]
    for a in range(2):
        rows = (oh - a + 1) // 2
        for b in range(2):
            cols = (ow - b + 1) // 2
            if b == 0:
                np.add(s[a, 0], s[a, 1], out=yq)
                np.add(yq, s[a, 2], out=yq)
            else:
                np.subtract(s[a, 1], s[a, 2], out=yq)
                np.subtract(yq, s[a, 3], out=yq)
            _blend(out[:, :, a::2, b::2], yq[:rows, :cols].transpose(2, 3, 0, 1), alpha, beta)


def _winograd_reason(p: ConvProblem) -> str | None:
    if p.spatial_dims != 2:
        return f"winograd F(2x2,3x3) has no {p.spatial_dims}-D form (its tiles and transforms are 2-D)"
    if (p.r, p.s) != (3, 3):
        return f"winograd F(2x2,3x3) needs a 3x3 filter, got {p.r}x{p.s}"
    if (p.stride_h, p.stride_w) != (1, 1):
        return f"winograd F(2x2,3x3) needs stride 1, got {p.stride_h}x{p.stride_w}"
    if (p.dilation_h, p.dilation_w) != (1, 1):
        return f"winograd F(2x2,3x3) needs dilation 1, got {p.dilation_h}x{p.dilation_w}"
    return None


def _winograd_layout(p: ConvProblem) -> _Layout:
    dt = np.dtype(p.dtype)
    cg = p.c // p.groups
    lay = _Layout()
    if p.kind == "bwd_filter":
        th, tw = _wino_tiles(p.out_h, p.out_w)
        lay.add("v", (4, 4, th, tw, p.n, p.c), dt)
        lay.add("e", (4, 4, th, tw, p.n, p.k), dt)
        lay.add("m", (4, 4, p.k, cg), dt)
        lay.overlay(
            [("d", (2 * th + 2, 2 * tw + 2, p.n, p.c), dt), ("t", (4, th, 2 * tw + 2, p.n, p.c), dt)],
            [("dyp", (2 * th, 2 * tw, p.n, p.k), dt), ("ty", (4, th, 2 * tw, p.n, p.k), dt)],
            [("dw", (3, 3, p.k, cg), dt)],
        )
        return lay
    if p.kind == "fwd":
        cin, cout, oh, ow = p.c, p.k, p.out_h, p.out_w
    else:
        cin, cout, oh, ow = p.k, p.c, p.h, p.w
    th, tw = _wino_tiles(oh, ow)
    lay.add("u", (4, 4, p.k, cg), dt)  # G g G^T for every (k, c/g) filter, as stored
    lay.add("v", (4, 4, th, tw, p.n, cin), dt)
    lay.add("m", (4, 4, th, tw, p.n, cout), dt)
    lay.overlay(
        [("d", (2 * th + 2, 2 * tw + 2, p.n, cin), dt), ("t", (4, th, 2 * tw + 2, p.n, cin), dt)],
        [("s", (2, 4, th, tw, p.n, cout), dt), ("yq", (th, tw, p.n, cout), dt)],
    )
    return lay


def _run_winograd(p: ConvProblem, ws: dict[str, np.ndarray], x, w, dy, out, alpha: float, beta: float) -> None:
    g, kg, cg = p.groups, p.k // p.groups, p.c // p.groups
    if p.kind == "bwd_filter":
        th, tw = _wino_tiles(p.out_h, p.out_w)
        nt = p.n * th * tw
        v, e, m = ws["v"], ws["e"], ws["m"]
        _wino_input_transform(x, (-p.pad_h, -p.pad_w), ws["d"], ws["t"], v)
        dyp, ty = ws["dyp"], ws["ty"]
        _gather(dyp.transpose(2, 3, 0, 1), dy, (1, 0), (1, 0))  # zero row/column completes odd tiles
        r0, r1 = dyp[0::2], dyp[1::2]
        np.copyto(ty[0], r0)
        np.add(r0, r1, out=ty[1])
        np.subtract(r0, r1, out=ty[2])
        np.negative(r1, out=ty[3])
        for a in range(4):
            c0, c1 = ty[a][:, 0::2], ty[a][:, 1::2]
            np.copyto(e[a, 0], c0)
            np.add(c0, c1, out=e[a, 1])
            np.subtract(c0, c1, out=e[a, 2])
            np.negative(c1, out=e[a, 3])
        # M[point] (kg, cg) = E[point]^T (kg, tiles * n) @ V[point] (tiles * n, cg), per group
        np.matmul(
            e.reshape(16, nt, g, kg).transpose(0, 2, 3, 1),
            v.reshape(16, nt, g, cg).transpose(0, 2, 1, 3),
            out=m.reshape(16, g, kg, cg),
        )
        dw = ws["dw"]
        np.matmul(_wino_filter_matrix(p.dtype, False).T, m.reshape(16, p.k * cg), out=dw.reshape(9, p.k * cg))
        _blend(out, dw.transpose(2, 3, 0, 1), alpha, beta)
        return
    u = ws["u"]
    np.matmul(_wino_filter_matrix(p.dtype, p.kind == "bwd_data"), w.reshape(p.k * cg, 9).T, out=u.reshape(16, p.k * cg))
    u_g = u.reshape(16, g, kg, cg)  # fwd: (cout_g, cin_g) per point and group
    if p.kind == "fwd":
        inp, offsets, cin_g, cout_g = x, (-p.pad_h, -p.pad_w), cg, kg
    else:
        inp, offsets, cin_g, cout_g = dy, (p.pad_h - 2, p.pad_w - 2), kg, cg
        u_g = u_g.transpose(0, 1, 3, 2)  # the transposed filter: (c/g, k/g)
    th, tw = _wino_tiles(*out.shape[-2:])
    nt = p.n * th * tw
    _wino_input_transform(inp, offsets, ws["d"], ws["t"], ws["v"])
    # M[point] (tiles * n, cout_g) = V[point] (tiles * n, cin_g) @ U[point]^T (cin_g, cout_g), per group
    np.matmul(
        ws["v"].reshape(16, nt, g, cin_g).transpose(0, 2, 1, 3),
        u_g.transpose(0, 1, 3, 2),
        out=ws["m"].reshape(16, nt, g, cout_g).transpose(0, 2, 1, 3),
    )
    _wino_output_transform(ws["m"], ws["s"], ws["yq"], out, alpha, beta)
