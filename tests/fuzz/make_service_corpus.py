#!/usr/bin/env python3
"""Writes the seeds of pool_transactions_fuzzer/ and request_validation_fuzzer/.

  PYTHONPATH=client/python MLAKV_PY_GEN=build/client/python/gen tests/fuzz/make_service_corpus.py

pool_transactions_fuzzer/: transaction scripts (tests/server/core/pool_model.h
decodes them): begin / stage / commit cycles, rewrites, a full pool,
truncates and frees, two transactions staged in one call.
request_validation_fuzzer/: a selector byte (0 AppendBatch, 1 Append
stream, 2 ReadSequence, 3 TruncateSequence, 4 FreeSequence, 5 GetPage, ...,
12 an Append stream committed by CommitAppend) then
serialized requests, messages of a stream separated by ff fe fd; valid
calls and near misses (holes, wrong byte counts, bad scales, expect_length,
AppendBatch's compact form and its malformed variants).
Deterministic output; needs the generated Python stubs (python3-protobuf).
"""
import os
import random

import mlakv  # noqa: F401  (puts the generated stubs on the path)
from mlakv.v1 import kv_cache_pb2 as pb

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
OUT = os.path.join(ROOT, "tests", "fuzz", "corpus")
SEP = b"\xff\xfe\xfd"
ONE = b"\x80\x3f"


def write(target, name, data):
    d = os.path.join(OUT, target)
    os.makedirs(d, exist_ok=True)
    with open(os.path.join(d, name), "wb") as f:
        f.write(data)


def scripts():
    rnd = random.Random(20261201)
    # op codes: 0 begin, 1-2 stage, 3 stage two, 4 commit, 5 abort, 6 free, 7 truncate, 8 verify
    cycles = bytes([0, 0, 1, 0, 0, 4, 0, 4, 0, 8, 0])
    write("pool_transactions_fuzzer", "append_commit_verify", cycles)
    rewrite = bytes([0, 1, 1, 1, 0, 6, 3, 4, 1, 0, 1, 1, 0, 3, 1, 4, 1, 8, 1])
    write("pool_transactions_fuzzer", "append_then_rewrite", rewrite)
    fill = bytes([0, 2, 1, 2, 0, 5, 0x08 | 0xf0, 4, 2, 0, 3, 1, 2, 9, 5, 3, 4, 3, 8, 2])
    write("pool_transactions_fuzzer", "reserve_fills_the_pool", fill)
    two = bytes([0, 0, 0, 1, 3, 0, 1, 0, 4, 3, 1, 4, 0, 4, 1, 7, 0, 2, 6, 1, 8, 0, 8, 1])
    write("pool_transactions_fuzzer", "two_transactions_one_call", two)
    for i in range(4):
        write("pool_transactions_fuzzer", "random_%d" % i, bytes(rnd.randrange(256) for _ in range(200)))


def rows(n, layer=0, scales=True):
    return pb.LayerRows(layer=layer, ckv=ONE * 512 * n, kpe=ONE * 64 * n,
                        ckv_scale=0.5 if scales else 0.0, kpe_scale=0.25 if scales else 0.0)


def requests():
    t = "request_validation_fuzzer"
    batch = pb.AppendBatchRequest(dtype=pb.ROW_DTYPE_BFLOAT16, sequences=[
        pb.SequenceRows(sequence="a", row_count=2, layers=[rows(2, 0)]),
        pb.SequenceRows(sequence="b", row_count=1, layers=[rows(1, 0), rows(1, 1)])])
    write(t, "batch_valid", b"\x00" + batch.SerializeToString())
    bad = pb.AppendBatchRequest(dtype=pb.ROW_DTYPE_BFLOAT16, sequences=[
        pb.SequenceRows(sequence="a", start=5, row_count=2, layers=[rows(2, 0)])])
    write(t, "batch_hole", b"\x00" + bad.SerializeToString())
    wrong = pb.AppendBatchRequest(dtype=pb.ROW_DTYPE_FLOAT16, sequences=[
        pb.SequenceRows(sequence="c", row_count=3, layers=[rows(2, 2)])])
    write(t, "batch_wrong_bytes", b"\x00" + wrong.SerializeToString())
    # The compact form: one LayerRows per layer for all the batch's sequences.
    compact = pb.AppendBatchRequest(dtype=pb.ROW_DTYPE_BFLOAT16, sequences=[
        pb.SequenceRows(sequence="a", row_count=2), pb.SequenceRows(sequence="b", row_count=1)],
        batch_layers=[rows(3, 0), rows(3, 1)])
    write(t, "batch_compact", b"\x00" + compact.SerializeToString())
    short = pb.AppendBatchRequest(dtype=pb.ROW_DTYPE_BFLOAT16, sequences=[
        pb.SequenceRows(sequence="a", row_count=2), pb.SequenceRows(sequence="b", row_count=2)],
        batch_layers=[rows(3, 0)])
    write(t, "batch_compact_short", b"\x00" + short.SerializeToString())
    mixed = pb.AppendBatchRequest(dtype=pb.ROW_DTYPE_BFLOAT16, sequences=[
        pb.SequenceRows(sequence="a", row_count=1, layers=[rows(1, 0)]), pb.SequenceRows(sequence="b", row_count=1)],
        batch_layers=[rows(2, 1)])
    write(t, "batch_compact_mixed", b"\x00" + mixed.SerializeToString())
    m1 = pb.AppendRequest(sequence="s", row_count=2, dtype=pb.ROW_DTYPE_BFLOAT16, layers=[rows(2, 0)],
                          reserve_tokens=8)
    m2 = pb.AppendRequest(start=2, row_count=1, dtype=pb.ROW_DTYPE_BFLOAT16, layers=[rows(1, 0, False)])
    write(t, "stream_two_messages", b"\x01" + m1.SerializeToString() + SEP + m2.SerializeToString())
    m3 = pb.AppendRequest(sequence="s", row_count=1, dtype=pb.ROW_DTYPE_BFLOAT16, layers=[rows(1, 1)],
                          expect_length=3, view=pb.SEQUENCE_VIEW_BASIC)
    write(t, "stream_expect_length", b"\x01" + m3.SerializeToString())
    m4 = pb.AppendRequest(sequence="s", row_count=1, dtype=pb.ROW_DTYPE_BFLOAT16,
                          layers=[pb.LayerRows(layer=0, ckv=ONE * 512, kpe=ONE * 64, ckv_scale=0.75, kpe_scale=0.25)])
    write(t, "stream_scale_mismatch", b"\x01" + m4.SerializeToString())
    write(t, "read", b"\x02" + pb.ReadSequenceRequest(sequence="a", layers=[0, 1], count=1,
                                                     format=pb.READ_FORMAT_DEQUANTIZED).SerializeToString())
    write(t, "truncate", b"\x03" + pb.TruncateSequenceRequest(sequence="a", length=1).SerializeToString())
    write(t, "free", b"\x04" + pb.FreeSequenceRequest(sequence="b").SerializeToString())
    write(t, "page", b"\x05" + pb.GetPageRequest(page=3).SerializeToString())
    # 12: an Append stream, then CommitAppend (the last part) while it is open.
    c1 = pb.AppendRequest(sequence="c", row_count=1, dtype=pb.ROW_DTYPE_BFLOAT16, layers=[rows(1, 0)],
                          commit_token="tok")
    c2 = pb.AppendRequest(start=1, row_count=1, dtype=pb.ROW_DTYPE_BFLOAT16, layers=[rows(1, 0)])
    for name, commit in (("commit_append", pb.CommitAppendRequest(commit_token="tok", messages=2)),
                         ("commit_append_too_few", pb.CommitAppendRequest(commit_token="tok", messages=1)),
                         ("commit_append_too_many", pb.CommitAppendRequest(messages=3)),
                         ("commit_append_other_token", pb.CommitAppendRequest(commit_token="other", messages=2))):
        write(t, name, b"\x0c" + c1.SerializeToString() + SEP + c2.SerializeToString() + SEP + commit.SerializeToString())
    # A stream refused at its first message (a ckv of 100 bytes) while
    # CommitAppend names a token no stream holds: what grew gRPC's in-process
    # transport by ~65 KB a run (the target now uses loopback TCP).
    bad = pb.AppendRequest(sequence="c", row_count=1, dtype=pb.ROW_DTYPE_BFLOAT16,
                           layers=[pb.LayerRows(layer=0, ckv=b"y" * 100, ckv_scale=0.5, kpe_scale=0.25)])
    write(t, "commit_append_after_a_refused_stream", b"\x0c" + bad.SerializeToString() + SEP + c2.SerializeToString() +
          SEP + pb.CommitAppendRequest(commit_token="tok", messages=2).SerializeToString())


if __name__ == "__main__":
    scripts()
    requests()
