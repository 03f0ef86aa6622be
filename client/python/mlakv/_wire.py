"""What the Append calls of Client and LayerwiseSave put into their messages
(one place for both): scales, block hashes, the first message's fields, and
one tensor's rows as bytes or a region reference."""

import numpy as np

from mlakv import rows as _rows
from mlakv.errors import client_error
from mlakv.v1 import kv_cache_pb2 as pb

# Bytes of an AppendRequest besides the rows (ids, counts, per-layer tags), bounded.
_MESSAGE_OVERHEAD = 1024


def _scale(value):
    return 0.0 if value is None else float(value)


# What a response's sequences carry (AppendRequest.view, AppendBatchRequest.view).
_VIEWS = {None: pb.SEQUENCE_VIEW_UNSPECIFIED, "full": pb.SEQUENCE_VIEW_FULL, "basic": pb.SEQUENCE_VIEW_BASIC,
          "compact": pb.SEQUENCE_VIEW_COMPACT, "lengths": pb.SEQUENCE_VIEW_LENGTHS,
          "packed": pb.SEQUENCE_VIEW_PACKED}


def _view(view):
    """The SequenceView of a view name: None or "full" (the whole page table and
    per-layer lengths), "basic" (lengths, capacity and only the pages the call
    allocated), "compact" (basic without the pool, id and server_id strings),
    "lengths" (compact without the page table), "packed" (AppendBatch only: no
    Sequence messages, response.packed holds every sequence's length, new
    pages' offset and count, generation and the new pages, as parallel arrays)."""
    if view is None or (isinstance(view, str) and view.lower() in _VIEWS):
        return _VIEWS[view if view is None else view.lower()]
    raise client_error("view %r is not one of \"full\", \"basic\", \"compact\", \"lengths\", \"packed\""
                       % (view,))


def _block_hashes(hashes, what="block_hashes"):
    """A list of bytes from bytes-like hashes (hex strings are refused: pass bytes.fromhex(h))."""
    if hashes is None:
        return []
    if isinstance(hashes, (bytes, bytearray, str)):
        raise client_error("%s is one %s; give a list of hashes (bytes), first page first"
                           % (what, type(hashes).__name__))
    out = []
    for i, h in enumerate(hashes):
        if not isinstance(h, (bytes, bytearray, memoryview)):
            raise client_error("%s[%d] is a %s; a block hash is bytes (bytes.fromhex() for hex)"
                               % (what, i, type(h).__name__))
        out.append(bytes(h))
    return out


def _set_first_fields(msg, reserve_tokens, expect_length, expect_generation, block_hashes, block_hashes_first_page,
                      pin, view=pb.SEQUENCE_VIEW_UNSPECIFIED):
    """The fields only the first message of an Append stream may carry (view:
    a SequenceView from _view, checked before the stream opens)."""
    msg.view = view
    msg.reserve_tokens = reserve_tokens
    if expect_length is not None:
        msg.expect_length = expect_length
    if expect_generation is not None:
        msg.expect_generation = expect_generation
    msg.block_hashes.extend(block_hashes)
    msg.block_hashes_first_page = block_hashes_first_page
    msg.pin = pin


def _set_part(layer_rows, field, part, lo, hi, dim):
    """Rows [lo, hi) of one tensor into a LayerRows: bytes, or the reference moved to row lo."""
    if isinstance(part, np.ndarray):
        setattr(layer_rows, field, part[lo:hi].tobytes())
        return
    stride = part.row_stride_bytes or dim * _rows.ELEMENT_BYTES
    ref = getattr(layer_rows, field + "_ref")  # set in place: no RegionRef built to be copied
    ref.region = part.region
    ref.offset = part.offset + lo * stride
    ref.row_stride_bytes = part.row_stride_bytes
