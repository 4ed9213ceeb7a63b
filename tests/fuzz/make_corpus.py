#!/usr/bin/env python3
"""Writes the fuzz targets' seed inputs into tests/fuzz/corpus/<target>/ (rerun after changing an
input layout; the layouts are described at the top of each *_fuzzer.cc). Standard library only:
protobuf wire format is encoded by hand."""

import os
import struct

HERE = os.path.dirname(os.path.abspath(__file__))


def varint(n):
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def field_varint(num, n):
    return varint(num << 3) + varint(n)


def field_bytes(num, data):
    return varint(num << 3 | 2) + varint(len(data)) + data


def field_double(num, x):
    return varint(num << 3 | 1) + struct.pack("<d", x)


def field_fixed64(num, n):
    return varint(num << 3 | 1) + struct.pack("<Q", n)


def hello(job, rank, world, dim, seed=0, attempt=0, encoding=0, group=b"", instance_id=b""):
    body = field_bytes(1, job.encode()) + field_varint(2, rank) + field_varint(3, world)
    body += field_varint(4, dim) + field_varint(5, seed) + field_varint(6, attempt)
    body += field_bytes(7, b"host-1") + field_bytes(8, b"0.1.0")
    if group:
        body += field_bytes(11, group)  # Hello.group
    if instance_id:
        body += field_bytes(13, instance_id)  # Hello.instance_id
    if encoding:
        body += field_varint(15, encoding)  # Hello.sketch_encoding: 1 float16, 2 int8
    return field_bytes(1, body)  # AgentMessage.hello


def report(seq, step, sketch, loss=1.5, grad_norm=2.0, fingerprints=False):
    body = field_varint(1, seq) + field_varint(2, step) + field_double(3, loss)
    body += field_double(4, grad_norm)
    body += field_bytes(5, b"".join(struct.pack("<f", v) for v in sketch))
    body += field_varint(6, 1_700_000_000_000_000_000)
    if fingerprints:
        body += field_fixed64(8, 0xDEADBEEF) + field_fixed64(9, 42) + field_double(10, 0.5)
        body += field_double(11, 0.1) + field_varint(12, 8)
    return field_bytes(2, body)  # AgentMessage.report


def packed_report(seq, step, bins, scale):
    """A StepReport whose sketch is packed (sketch_packed = 14, sketch_scale = 15)."""
    body = field_varint(1, seq) + field_varint(2, step) + field_double(3, 1.5)
    body += field_bytes(14, bins) + varint(15 << 3 | 5) + struct.pack("<f", scale)
    return field_bytes(2, body)  # AgentMessage.report


def validation_seed(first, second, limits=None, identity=None, dim=None):
    flags = 1 if limits else 0
    maxw, maxd, maxname = limits or (0, 0, 0)
    out = struct.pack("<BIIB", flags, maxw, maxd, maxname)
    idw, idd, idseed, idenc = (identity + (0,))[:4] if identity else (0, 0, 0, 0)
    out += struct.pack("<BIIQB", 1 if identity else 0, idw, idd, idseed, idenc)
    out += struct.pack("<BI", 1 if dim is not None else 0, dim or 0)
    return out + struct.pack("<H", len(first)) + first + second


NAN = float("nan")
INF = float("inf")

VALIDATION = {
    "valid_hello_and_report": validation_seed(
        hello("exp-42", 3, 8, 4, seed=7), report(1, 5, [0.5, NAN, -INF, 1e-40], fingerprints=True)
    ),
    "rank_out_of_range": validation_seed(hello("exp-42", 8, 8, 4), report(1, 5, [1, 2, 3, 4])),
    "bad_job_name_short_sketch": validation_seed(
        hello("bad job\x00\xff", 0, 2, 4), report(2, 9, [1, 2])
    ),
    "small_limits_huge_step": validation_seed(
        hello("abcde", 3, 4, 2), report(3, 2**63, [1, 2]), limits=(4, 2, 5)
    ),
    "identity_mismatch_second_hello": validation_seed(
        hello("job.a:b_c-d", 0, 4, 16, seed=1),
        hello("job.a:b_c-d", 1, 4, 16, seed=2),
        identity=(4, 16, 1),
    ),
    "report_before_hello": validation_seed(report(1, 1, []), report(2, 2, [1.0]), dim=1),
    "packed_int8_report": validation_seed(
        hello("q8", 0, 2, 4, encoding=2), packed_report(1, 3, b"\x7f\x81\x00\x10", 0.25)
    ),
    "packed_float16_nan_scale": validation_seed(
        hello("q16", 0, 2, 2, encoding=1), packed_report(1, 3, b"\x00\x3c\x00\xbc", NAN)
    ),
    "packed_bad_scale_odd_bytes": validation_seed(
        hello("q16", 0, 2, 2, encoding=1), packed_report(1, 3, b"\x00\x3c\x00", -1.0)
    ),
    "mixed_encoding_second_hello": validation_seed(
        hello("mix", 0, 2, 8, encoding=2), hello("mix", 1, 2, 8), identity=(2, 8, 0, 2)
    ),
    "grouped_hello_and_report": validation_seed(
        hello("exp-42", 1, 4, 4, group=b"pp0.tp1", instance_id=b"host-1:4242:0"),
        report(1, 5, [1, 2, 3, 4]),
    ),
    # A bad group is refused as a bad hello even when the rank is out of range too.
    "bad_group_rank_out_of_range": validation_seed(
        hello("exp-42", 8, 8, 4, group=b"(\x00 0"), report(1, 5, [1, 2, 3, 4])
    ),
    "long_instance_id": validation_seed(
        hello("exp-42", 0, 2, 4, instance_id=b"i" * 129), report(1, 5, [1, 2, 3, 4])
    ),
}


def op_register(job, world):
    b = world % 6 if world < 6 else 192 + (world - 60)
    return bytes([5, job, b])


def op_add(job, rank, step, attempt=0):
    return bytes([0, job, rank, step, attempt])


def op_add_big_step(job, rank, step, attempt=0):
    return bytes([0x80, job, rank]) + struct.pack("<Q", step) + bytes([attempt])


def op_expire(seconds):
    return bytes([4, 0, seconds])


def op_tick(tenths):
    return bytes([7, 0, tenths])


def op_forget(job):
    return bytes([6, job])


def joiner_seed(timeout_s, cap, remembered, ops):
    return bytes([timeout_s - 1, cap, remembered]) + b"".join(ops)


JOINER = {
    "complete_then_duplicate": joiner_seed(
        4,
        4,
        7,
        [
            op_register(0, 3),
            op_add(0, 0, 1),
            op_add(0, 1, 1),
            op_add(0, 2, 1),
            op_add(0, 0, 1),
            op_add(0, 2, 2),
            op_add(0, 2, 2),
        ],
    ),
    "timeout_then_late": joiner_seed(
        2,
        4,
        7,
        [
            op_register(1, 2),
            op_add(1, 0, 1),
            op_tick(5),
            op_add(1, 0, 2),
            op_expire(2),
            op_add(1, 1, 1),
            op_add(1, 1, 1),
            op_expire(3),
        ],
    ),
    "evict_supersede_stale": joiner_seed(
        8,
        2,
        3,
        [
            op_register(0, 3),
            op_add(0, 0, 1),
            op_add(0, 0, 2),
            op_add(0, 0, 3),
            op_add(0, 1, 2, 1),
            op_add(0, 2, 2, 0),
            op_add(0, 1, 1, 2),
            op_add(0, 0, 1, 0),
        ],
    ),
    "wide_job_bitsets": joiner_seed(
        3,
        5,
        4,
        [op_register(2, 70)]
        + [op_add(2, r, 3) for r in range(70) if r != 5]
        + [op_add(2, r, 4) for r in range(0, 70, 9)]
        + [op_expire(5), op_add(2, 5, 3), op_add(2, 69, 4)],
    ),
    "forget_and_reregister": joiner_seed(
        5,
        3,
        2,
        [
            op_register(0, 4),
            op_add(0, 1, 1),
            op_add(0, 2, 2),
            op_register(0, 5),
            op_forget(0),
            op_add(0, 0, 1),
            op_register(0, 5),
            op_add(0, 4, 1),
            op_add(0, 5, 1),
            op_forget(1),
        ],
    ),
    "single_rank_job": joiner_seed(
        1,
        0,
        1,
        [
            op_register(1, 1),
            op_add(1, 0, 1),
            op_add(1, 0, 1),
            op_add(1, 0, 2),
            op_add(1, 0, 1),
            op_add_big_step(1, 0, 2**64 - 1),
            op_add_big_step(1, 0, 2**64 - 1, 1),
        ],
    ),
}


def grid(x):
    """The byte that step_stats_fuzzer's grid mode reads as x (a multiple of 1/16, or special)."""
    special = {"nan": 250, "inf": 251, "-inf": 252, "-0": 253, "0": 254}
    if isinstance(x, str):
        return special[x]
    b = int(round(x * 16)) + 125
    assert 0 <= b < 250, x
    return b


def stats_seed(mode, ranks, k, extra=None):
    out = bytes([mode, len(ranks), k])
    for i, (loss, norm, sketch) in enumerate(ranks):
        if mode & 1:
            out += struct.pack("<dd", loss, norm)
        else:
            out += bytes([grid(loss), grid(norm)])
        if mode & 2:
            out += bytes([0 if extra and i in extra else 1])
        if mode & 1:
            out += b"".join(struct.pack("<f", v) for v in sketch)
        else:
            out += bytes(grid(v) for v in sketch)
    return out


STATS = {
    "grid_four_ranks": stats_seed(
        0,
        [
            (1, 2, [1, 0.5, -1, 2]),
            (1.5, 2, [1, 0.5, -1, 1.5]),
            (1.25, 2.5, [0, 0, 0, 0]),
            (3, 2, [-1, -0.5, 1, -2]),
        ],
        4,
    ),
    "grid_nan_inf": stats_seed(
        0, [("nan", "inf", [1, "nan"]), (1, 1, [1, 1]), (2, "-inf", [0, 1])], 2
    ),
    "grid_all_equal": stats_seed(0, [(0.5, "-0", [1, 1, 1]), (0.5, "0", [1, 1, 1])], 3),
    "grid_one_rank": stats_seed(0, [(2, 3, [1, 2, 3, 4, 5, 6, 7, 7.5])], 8),
    "raw_values": stats_seed(
        1,
        [
            (1e300, -1e-310, [3.4e38, 1e-45]),
            (-1e300, 5.0, [-3.4e38, 0.0]),
            (123.456, 1e-20, [1.0, 2.0]),
        ],
        2,
    ),
    "ragged_sketches": stats_seed(
        2, [(1, 1, [1, 2, 3]), (2, 2, [1, 2, 3, 4]), (3, 3, [1, 2, 3])], 3, extra={1}
    ),
    "no_ranks": bytes([0, 0, 4]),
    "packed_int8": stats_seed(
        4 | 8, [(1, 2, [1, 0.5, -1, 2]), (1.5, 2, [1, 0.5, -1, 1.5]), (1.25, 2.5, [0, 0, 0, 0])], 4
    ),
    "packed_float16_nan": stats_seed(4, [(1, 1, [1, "nan"]), (1, 1, [1, 1]), (2, 2, [0, 1])], 2),
}


def main():
    for target, seeds in (
        ("validation", VALIDATION),
        ("step_joiner", JOINER),
        ("step_stats", STATS),
    ):
        d = os.path.join(HERE, "corpus", target)
        os.makedirs(d, exist_ok=True)
        for name, data in seeds.items():
            with open(os.path.join(d, name), "wb") as f:
                f.write(data)


if __name__ == "__main__":
    main()
