"""Fitting a value or mask of one shape to a destination shape (broadcasting, partition-aligned
padding of rank-deficient values, same-size reshapes): shared by assignments (``_tensor``) and
the DMA layout model (``_dma``)."""
from __future__ import annotations

import numpy as np

from ._errors import nki_error, fmt_shape


def fit_value(vals, vshape, dshape, src_desc="b"):
    """Broadcast a value of shape vshape to the destination shape (partition-aligned right
    padding for rank-deficient values); raises err_store_dst_shape_smaller_than_other_shape."""
    if vshape == dshape:
        return vals
    vn = len(vshape)
    dn = len(dshape)
    try:
        if 0 < vn < dn:
            v2 = vals.reshape(tuple(vshape) + (1,) * (dn - vn))
            return np.broadcast_to(v2, dshape)
        return np.broadcast_to(vals, dshape)
    except ValueError:
        pass
    # same partitions and same elements per partition: (P,1) <-> (P,), (P,a,b) <-> (P,a*b)
    vsize = int(np.prod(vshape)) if vn else 1
    dsize = int(np.prod(dshape)) if dn else 1
    if vsize == dsize and (vn == 0 or dn == 0 or vshape[0] == dshape[0] or vsize == 1):
        return vals.reshape(dshape)
    raise nki_error(
        "err_store_dst_shape_smaller_than_other_shape", "value",
        f"Illegal assignment destination shape in 'a = b': shape {fmt_shape(dshape)} of "
        f"parameter 'a' is smaller than other parameter shapes {src_desc}{fmt_shape(vshape)}.")


def fit_mask(mask, vshape, dshape):
    if mask is None or mask is False:
        return mask
    if mask.shape == tuple(dshape):
        return mask
    vn, dn = len(vshape), len(dshape)
    if 0 < vn < dn:
        return np.broadcast_to(mask.reshape(mask.shape + (1,) * (dn - vn)), dshape)
    try:
        return np.broadcast_to(mask, dshape)
    except ValueError:
        return mask.reshape(dshape)
