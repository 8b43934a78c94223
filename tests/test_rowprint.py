"""The device-side row fingerprint: exact (one number per row's bytes, whatever computed it),
order-sensitive, and blind to nothing a user relies on it to see."""

from __future__ import annotations

import struct
import zlib

import pytest
import torch

from dumpdiff.dumper import rowprint

M64 = (1 << 64) - 1


def _mix(x: int) -> int:
    x ^= x >> 30
    x = (x * 0xBF58476D1CE4E5B9) & M64
    x ^= x >> 27
    x = (x * 0x94D049BB133111EB) & M64
    return x ^ (x >> 31)


def reference_print(raw: bytes, size: int, dtype_name: str) -> int:
    """The fingerprint as the docstring of dumper/rowprint.py defines it, in plain Python."""
    width = len(raw) // size
    total = 0
    for j in range(width):
        bits = int.from_bytes(raw[j * size : (j + 1) * size], "little", signed=True) & M64
        z = ((bits + (j + 1) * 0x9E3779B97F4A7C15) * 0xBF58476D1CE4E5B9) & M64
        total = (total + ((z ^ (z >> 32)) * 0x94D049BB133111EB)) & M64
    seed = (width * 0x9E3779B97F4A7C15 + zlib.crc32(dtype_name.encode())) & M64
    value = _mix(total ^ seed)
    return struct.unpack("<q", value.to_bytes(8, "little"))[0]


def _rows(dtype, n=6, width=37, seed=0):
    g = torch.Generator().manual_seed(seed)
    if dtype.is_floating_point:
        return (torch.randn(n, width, generator=g) * 3).to(dtype)
    if dtype == torch.bool:
        return torch.rand(n, width, generator=g) > 0.5
    info = torch.iinfo(dtype)
    return torch.randint(max(info.min, -1000), min(info.max, 1000), (n, width), generator=g).to(dtype)


DTYPES = [
    torch.float32,
    torch.bfloat16,
    torch.float16,
    torch.float64,
    torch.int64,
    torch.int32,
    torch.int8,
    torch.uint8,
    torch.bool,
]


@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_fingerprint_is_the_reference_computation_of_the_bytes(dtype):
    rows = _rows(dtype)
    kept = rows.clone()
    got = rowprint.fingerprints(rows).tolist()
    assert torch.equal(rows.view(torch.uint8), kept.view(torch.uint8))  # the caller's tensor is not worked on
    name = str(dtype).replace("torch.", "")
    raw = rows.contiguous().view(torch.uint8).numpy().tobytes()
    per_row = len(raw) // rows.shape[0]
    want = [
        reference_print(raw[i * per_row : (i + 1) * per_row], rows.element_size(), name) for i in range(rows.shape[0])
    ]
    assert got == want


def test_any_chunking_and_memory_layout_give_the_same_prints(monkeypatch):
    rows = _rows(torch.bfloat16, n=50, width=64)
    whole = rowprint.fingerprints(rows)
    monkeypatch.setattr(rowprint, "CHUNK_ELEMENTS", 64 * 3)  # 3 rows at a time
    assert torch.equal(rowprint.fingerprints(rows), whole)
    strided = torch.empty(64, 50, dtype=torch.bfloat16).t()  # column-major storage
    strided.copy_(rows)
    assert torch.equal(rowprint.fingerprints(strided), whole)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16], ids=str)
def test_one_ulp_a_sign_flip_a_swapped_pair_or_reordered_elements_change_the_print(dtype):
    row = _rows(dtype, n=1, width=4096)
    base = int(rowprint.fingerprints(row)[0])
    size = row.element_size()
    bits = row.view(rowprint.INT_OF_SIZE[size])
    changed = []
    for j in (0, 1, 2047, 4095):  # one ulp up at several places
        one = bits.clone()
        one[0, j] += 1
        changed.append(one.view(dtype))
    for j in (0, 100, 4095):  # a sign flip
        flip = row.clone()
        flip[0, j] = -flip[0, j]
        changed.append(flip)
    swapped = row.clone()
    swapped[0, [10, 11]] = swapped[0, [11, 10]]
    changed.append(swapped)
    changed.append(row.flip(1))
    changed.append(row.roll(1, dims=1))
    prints = [int(rowprint.fingerprints(c)[0]) for c in changed]
    assert base not in prints and len(set(prints)) == len(prints)


def test_reordered_rows_keep_each_rows_print_and_equal_bytes_of_another_type_do_not_collide():
    rows = _rows(torch.float32, n=8, width=16)
    prints = rowprint.fingerprints(rows)
    order = torch.randperm(8, generator=torch.Generator().manual_seed(1))
    assert torch.equal(rowprint.fingerprints(rows[order]), prints[order])  # a row's print is its bytes' alone
    assert len(set(prints.tolist())) == 8
    as_int = rowprint.fingerprints(rows.view(torch.int32))
    assert not set(as_int.tolist()) & set(prints.tolist())
    halves = rowprint.fingerprints(rows.view(torch.bfloat16))  # same bytes, another width
    assert not set(halves.tolist()) & set(prints.tolist())


def test_no_collision_among_a_million_single_bit_and_swap_changes():
    """Every single-bit change of a 2048-wide bfloat16 row and every swap of neighbours: all
    distinct prints (single-element changes are distinct by construction; swaps by chance 2**-64)."""
    row = _rows(torch.bfloat16, n=1, width=2048, seed=3).view(torch.int16)
    variants = row.repeat(16 * 2048, 1)
    j = torch.arange(2048).repeat_interleave(16)
    bit = torch.arange(16).repeat(2048)
    variants[torch.arange(len(j)), j] ^= (1 << bit).to(torch.int16)
    swaps = row.repeat(2047, 1)
    k = torch.arange(2047)
    swaps[k, k], swaps[k, k + 1] = row[0, k + 1], row[0, k]
    differs = swaps[k, k] != swaps[k, k + 1]
    prints = torch.cat(
        [
            rowprint.fingerprints(variants.view(torch.bfloat16)),
            rowprint.fingerprints(swaps[differs].view(torch.bfloat16)),
            rowprint.fingerprints(row.view(torch.bfloat16)),
        ]
    )
    assert len(torch.unique(prints)) == len(prints)


def test_magnitudes_are_the_largest_finite_value_and_count_nan_and_inf():
    rows = torch.tensor(
        [[1.5, -7.25, float("inf"), 2.0], [float("nan"), -0.5, float("-inf"), 0.25], [0.0, 0.0, 0.0, 0.0]],
        dtype=torch.bfloat16,
    )
    stats = rowprint.row_stats(rows)
    assert stats[1].view(torch.float64).tolist() == [7.25, 0.5, 0.0]
    assert stats[2].tolist() == [1, 2, 0]
    ints = rowprint.row_stats(torch.ones(2, 3, dtype=torch.int32))
    assert torch.isnan(ints[1].view(torch.float64)).all() and ints[2].tolist() == [0, 0]


@pytest.mark.parametrize("dtype", [d for d in DTYPES if d.is_floating_point], ids=str)
def test_finite_rows_and_rows_with_one_nan_each_give_their_own_largest_value(dtype):
    """All-finite rows take a shorter path on a CPU than rows holding inf or NaN: both must give
    each row's largest |x| exactly, whichever rows share the tensor."""
    rows = _rows(dtype, n=8, width=33, seed=9)
    expected = rows.to(torch.float64).abs().amax(dim=1)
    finite = rowprint.row_stats(rows)
    assert torch.equal(finite[1].view(torch.float64), expected) and not finite[2].any()
    rows[2, 5] = float("nan")
    mixed = rowprint.row_stats(rows)
    others = [i for i in range(8) if i != 2]
    assert torch.equal(mixed[1].view(torch.float64)[others], expected[others])
    assert mixed[2].tolist() == [0, 0, 1, 0, 0, 0, 0, 0]
    assert torch.equal(mixed[0][others], finite[0][others]) and mixed[0][2] != finite[0][2]


def test_rows_of_token_dims_that_do_not_lead_and_of_no_token_dims():
    t = torch.randn(2, 3, 5, 4)  # [B, heads, S, D]: token dims 0 and 2
    rows = rowprint.as_rows(t, [0, 2])
    assert rows.shape == (10, 12) and torch.equal(rows[6], t[1, :, 1, :].reshape(-1))
    assert rowprint.as_rows(t, None).shape == (1, 120)
    assert rowprint.as_rows(torch.zeros(0, 7), [0]).shape == (0, 7)
    assert rowprint.fingerprints(torch.zeros(0, 7)).shape == (0,)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_cuda_prints_are_the_cpu_prints(dtype):
    rows = _rows(dtype, n=300, width=4096, seed=5)
    if dtype.is_floating_point:
        rows[3, 7], rows[5, 0] = float("nan"), float("inf")
    assert torch.equal(rowprint.row_stats(rows.cuda()).cpu(), rowprint.row_stats(rows))


@pytest.mark.parametrize("stage_bytes", [1, 1 << 30], ids=["worked-on-at-each-tensor", "at-the-end"])
def test_a_pass_prints_each_tensor_as_alone_and_as_it_was_when_staged(stage_bytes):
    """The dumper stages many tensors' rows together and works on them later (at the pass's end,
    or when the staged bytes exceed the budget): each tensor's rows still get their own prints,
    and a kernel that rewrites a tensor in place after its hook cannot change them."""
    from dumpdiff.dumper.passprints import PassPrints

    tensors = [
        _rows(torch.bfloat16, n=3, width=64),
        _rows(torch.float32, n=5, width=7, seed=1),
        _rows(torch.bfloat16, n=2, width=64, seed=2),
        _rows(torch.int64, n=4, width=1, seed=3),
        _rows(torch.float32, n=0, width=7),
    ]
    tensors[1][2, 3], tensors[2][1, 0] = float("nan"), float("-inf")  # rows whose largest skips them
    expected = [rowprint.row_stats(t) for t in tensors]
    prints = PassPrints(stage_bytes)
    metas = [{} for _ in tensors]
    for meta, tensor in zip(metas, tensors):
        prints.add(meta, tensor)
    for tensor in tensors:
        tensor.zero_()  # in place, after the hooks
    table = prints.finish()
    assert table.shape[1] == sum(t.shape[0] for t in tensors)
    for meta, want in zip(metas, expected):
        first, count = meta["print"]
        assert torch.equal(table[:, first : first + count], want)
