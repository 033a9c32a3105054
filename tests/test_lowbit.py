"""The op's row-efficient low-bit products (lab/engine/native/lowbit_mm.h): every instruction-set variant this CPU
runs returns ATen's bits (int4 and int8, bf16), for any row count and for partial column blocks; a row does not
depend on the other rows; forwards give the same bits with one and two threads and with ATen's kernels."""

from __future__ import annotations

import pytest
import torch
from transformers import DynamicCache

from lab.engine import native_forward, quant
from lab.engine.invariance import rows_invariant
from lab.engine.lean_forward import lean_forward
from lab.engine.models import wrap_model
from lab.engine.quant import (
    GROUP,
    Int4Linear,
    Int8Linear,
    Q8Blocks,
    W4A8Linear,
    W8A8Linear,
    pack_w4a8,
    pack_w8a8,
    q4_from_weight,
    q8_from_weight,
    quantize_activations,
    quantize_model,
    set_lowbit_kernels,
    unpack_w4a8,
    unpack_w8a8,
    w4a8_reference,
    w8a8_reference,
)
from tests.test_lean_forward import _forwards
from tests.tiny import ByteTokenizer, tiny_llama

pytestmark = pytest.mark.skipif(not native_forward.build(), reason="no C++ compiler: ATen's kernels run")
SHAPES = [(1536, 576), (960, 576), (48, 64), (112, 96), (16, 32)]  # full 64-column blocks and partial ones
ROWS = (1, 2, 5, 7, 8, 13, 17)


def _modules(n: int, k: int, seed: int) -> tuple[Int4Linear, Int8Linear]:
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02
    return Int4Linear(q4_from_weight(weight), None, torch.bfloat16), Int8Linear(weight, None, torch.bfloat16)


def test_the_packed_layout_of_this_build_is_found() -> None:
    assert torch.ops.decoding_lab.int4_layout() in (64, 32, 0)


@pytest.mark.parametrize("n,k", SHAPES)
def test_every_variant_returns_atens_bits(n: int, k: int) -> None:
    variants = list(torch.ops.decoding_lab.lowbit_variants())
    assert 0 in variants  # the plain C++ reference runs everywhere
    int4, int8 = _modules(n, k, seed=n + k)
    generator = torch.Generator().manual_seed(k)
    for rows in ROWS:
        x = (torch.randn(rows, k, generator=generator) * 3).to(torch.bfloat16)
        expected4 = torch._weight_int4pack_mm_for_cpu(x, int4.packed, GROUP, int4.scales_and_zeros)
        expected8 = torch._weight_int8pack_mm(x, int8.qweight, int8.scales)
        for variant in variants:
            got4 = torch.ops.decoding_lab.int4_mm(x, int4.packed, int4.scales_and_zeros, variant)
            got8 = torch.ops.decoding_lab.int8_mm(x, int8.qweight, int8.scales, variant)
            assert torch.equal(got4, expected4), (rows, variant)
            assert torch.equal(got8, expected8), (rows, variant)


def test_a_row_does_not_depend_on_the_other_rows_or_the_thread_count() -> None:
    int4, int8 = _modules(1536, 576, seed=5)
    w4a8 = _w4a8(1536, 576, seed=5)
    x = torch.randn(16, 576, generator=torch.Generator().manual_seed(6)).to(torch.bfloat16)
    threads = torch.get_num_threads()
    try:
        results = []
        for count in (1, 2):
            torch.set_num_threads(count)
            results.append(
                [
                    torch.ops.decoding_lab.int4_mm(x, int4.packed, int4.scales_and_zeros),
                    torch.ops.decoding_lab.int8_mm(x, int8.qweight, int8.scales),
                    torch.ops.decoding_lab.w4a8_mm(x, w4a8.packed, w4a8.scales),
                ]
            )
    finally:
        torch.set_num_threads(threads)
    assert all(torch.equal(a, b) for a, b in zip(*results, strict=True))
    alone = torch.cat(
        [torch.ops.decoding_lab.int4_mm(x[i : i + 1], int4.packed, int4.scales_and_zeros) for i in range(16)]
    )
    assert torch.equal(alone, results[0][0])
    alone = torch.cat([torch.ops.decoding_lab.w4a8_mm(x[i : i + 1], w4a8.packed, w4a8.scales) for i in range(16)])
    assert torch.equal(alone, results[0][2])
    mixed = torch.cat([x[3:4], torch.randn(5, 576).to(torch.bfloat16)])  # the same row beside other rows
    assert torch.equal(torch.ops.decoding_lab.int8_mm(mixed, int8.qweight, int8.scales)[0], results[0][1][3])


def test_the_kernels_refuse_what_they_do_not_compute() -> None:
    int4, int8 = _modules(48, 64, seed=1)
    with pytest.raises(RuntimeError, match="int4_mm"):
        torch.ops.decoding_lab.int4_mm(torch.randn(2, 64), int4.packed, int4.scales_and_zeros)  # float32 x
    with pytest.raises(RuntimeError, match="int8_mm"):
        torch.ops.decoding_lab.int8_mm(torch.randn(2, 48).to(torch.bfloat16), int8.qweight, int8.scales)  # K


def _w4a8(n: int, k: int, seed: int) -> W4A8Linear:
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02
    return W4A8Linear(q4_from_weight(weight), None, torch.bfloat16)


def test_the_w4a8_layout_holds_the_q4_1_blocks() -> None:
    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(2))
    groups = q4_from_weight(weight)
    q, d, m = unpack_w4a8(*pack_w4a8(groups))
    assert torch.equal(q.int(), groups.q)
    assert torch.equal(d, groups.d.half().float()) and torch.equal(m, groups.m.half().float())
    module = W4A8Linear(groups, None, torch.bfloat16)
    scales = module.scales.clone()
    module.to(torch.float32)  # a dtype cast leaves the fp16 bits alone
    assert torch.equal(module.scales, scales)


@pytest.mark.parametrize("n,k", [(1536, 576), (576, 1536), (48, 64), (16, 32)])
def test_every_w4a8_variant_returns_the_python_definitions_bits(n: int, k: int) -> None:
    """Every instruction-set variant this CPU runs (AVX-512 VNNI, AVX-VNNI, AVX2, plain C++) against
    `quant.w4a8_reference`, for bf16, fp16 and float32 rows, any row count, with an all-zero block."""
    variants = list(torch.ops.decoding_lab.w4a8_variants())
    assert 0 in variants
    module = _w4a8(n, k, seed=n + k)
    q, d, m = unpack_w4a8(module.packed, module.scales)
    generator = torch.Generator().manual_seed(k)
    for rows in ROWS:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            x = (torch.randn(rows, k, generator=generator) * 3).to(dtype)
            x[0, :GROUP] = 0
            if k >= 2 * GROUP:  # d = 1: all but the first input lie halfway between two integers
                x[-1, GROUP : 2 * GROUP] = torch.tensor([127.0] + [v + 0.5 for v in range(-16, 15)]).to(dtype)
            expected = w4a8_reference(x, q, d, m)
            py_codes, py_scale, py_total = quantize_activations(x)
            for variant in variants:
                codes, scale, total = torch.ops.decoding_lab.w4a8_quantize(x, variant)
                assert torch.equal(codes.float(), py_codes.reshape(rows, k)) and torch.equal(scale, py_scale)
                assert torch.equal(total, py_total), (rows, dtype, variant)
                got = torch.ops.decoding_lab.w4a8_mm(x, module.packed, module.scales, variant)
                assert got.dtype == dtype and torch.equal(got, expected), (rows, dtype, variant)


def test_w4a8_forwards_without_the_op_give_its_bits(monkeypatch) -> None:
    """The PyTorch definition (no compiler) and the op give a model the same logits and hidden states."""
    model = tiny_llama(5, layers=2, hidden=128).to(torch.bfloat16)
    quantize_model(model, "w4a8", torch.bfloat16)
    monkeypatch.setenv(native_forward.SWITCH, "0")  # the Python loop, so only the linears differ
    with_op = _verify_run(model)
    monkeypatch.setattr(quant, "_lowbit_ops", lambda any_setting=False: None)
    without = _verify_run(model)
    assert all(torch.equal(a, b) for a, b in zip(with_op, without, strict=True))


def test_w4a8_and_w8a8_refuse_what_they_do_not_compute() -> None:
    module, head = _w4a8(48, 64, seed=1), _w8a8(48, 64, seed=1)
    for op, linear in ((torch.ops.decoding_lab.w4a8_mm, module), (torch.ops.decoding_lab.w8a8_mm, head)):
        name = "w4a8_mm" if linear is module else "w8a8_mm"
        with pytest.raises(RuntimeError, match=name):
            op(torch.randn(2, 48), linear.packed, linear.scales)  # K
        with pytest.raises(RuntimeError, match=name):
            op(torch.randn(2, 64), linear.packed, linear.scales.view(torch.float16))
    with pytest.raises(RuntimeError, match="w8a8_mm"):
        torch.ops.decoding_lab.w8a8_mm(torch.randn(2, 64), module.packed, module.scales)  # the w4a8 layout


def _w8a8(n: int, k: int, seed: int) -> W8A8Linear:
    """Q8_0 blocks of a random weight, with the extremes set: a block of -128 (ggml's files may hold it, its own
    rule does not make it), a block of zeros and one of 127."""
    weight = torch.randn(n, k, generator=torch.Generator().manual_seed(seed)) * 0.02
    blocks = q8_from_weight(weight)
    blocks.q[0, :GROUP], blocks.q[1 % n, :GROUP], blocks.q[2 % n, -GROUP:] = -128, 0, 127
    return W8A8Linear(blocks, None, torch.bfloat16)


def test_the_w8a8_layout_holds_the_q8_0_blocks() -> None:
    weight = torch.randn(48, 96, generator=torch.Generator().manual_seed(2))
    blocks = q8_from_weight(weight)
    assert int(blocks.q.abs().max()) == 127 and torch.equal(blocks.d, blocks.d.half().float())
    dequantized = blocks.d.repeat_interleave(GROUP, 1) * blocks.q.float()
    assert (dequantized - weight).abs().max() <= blocks.d.max() * 0.5 * 1.01  # half a step (d rounded to fp16)
    unpacked = unpack_w8a8(*pack_w8a8(blocks))
    assert torch.equal(unpacked.q, blocks.q) and torch.equal(unpacked.d, blocks.d)
    module = W8A8Linear(blocks, None, torch.bfloat16)
    scales = module.scales.clone()
    module.to(torch.float32)  # a dtype cast leaves the fp16 bits alone
    assert torch.equal(module.scales, scales)


@pytest.mark.parametrize("n,k", [(1536, 576), (96, 1536), (48, 64), (16, 32)])
def test_every_w8a8_variant_returns_the_python_definitions_bits(n: int, k: int) -> None:
    """Every instruction-set variant this CPU runs against `quant.w8a8_reference`, for bf16, fp16 and float32 rows,
    any row count, with an all-zero activation block and weight blocks of -128, 0 and 127."""
    variants = list(torch.ops.decoding_lab.w4a8_variants())
    module = _w8a8(n, k, seed=n + k)
    blocks = unpack_w8a8(module.packed, module.scales)
    generator = torch.Generator().manual_seed(k)
    for rows in ROWS:
        for dtype in (torch.bfloat16, torch.float16, torch.float32):
            x = (torch.randn(rows, k, generator=generator) * 3).to(dtype)
            x[0, :GROUP] = 0
            expected = w8a8_reference(x, blocks)
            for variant in variants:
                got = torch.ops.decoding_lab.w8a8_mm(x, module.packed, module.scales, variant)
                assert got.dtype == dtype and torch.equal(got, expected), (rows, dtype, variant)


def test_w8a8_rows_give_the_heads_own_columns() -> None:
    """`W8A8Linear.rows` (a draft vocabulary of the LM head, any size): the same bits as those columns of the whole
    head, with the op and with the PyTorch definition."""
    head = _w8a8(160, 64, seed=4)
    index = torch.tensor([3, 159, 0, 77, 16, 17, 100])  # 7 rows: padded to a tile inside
    rows = W8A8Linear.rows(head, index)
    x = torch.randn(5, 64).to(torch.bfloat16)
    with torch.inference_mode():
        assert rows(x).shape == (5, 7) and rows.weight.shape == (7, 64)
        assert torch.equal(rows(x), head(x)[:, index])
        assert torch.equal(rows.weight, head.weight[index])
        whole = unpack_w8a8(head.packed, head.scales)
        blocks = Q8Blocks(whole.q[index], whole.d[index])
        assert torch.equal(w8a8_reference(x, blocks), head(x)[:, index])


def _verify_run(model) -> list[torch.Tensor]:
    """Logits, hidden states and cache of the prefill, a step, a chain and a tree verify (under rows_invariant)."""
    cache, out = DynamicCache(config=model.config), []
    with torch.inference_mode():
        for ids, kwargs in _forwards(9):
            logits, hidden = lean_forward(model, torch.tensor([ids]), cache, output_hidden_states=True, **kwargs)
            out += [logits, *hidden]
    return out + [t for layer in cache.layers for t in (layer.keys, layer.values)]


@pytest.mark.parametrize("precision", ["int8", "int4", "w4a8"])
def test_verify_forwards_give_the_same_bits_with_one_and_two_threads(precision: str) -> None:
    """The contract behind lossless decoding at any thread count: the kernels' sums do not depend on how the
    output columns are split between threads; and ATen's kernels (the switch off) give the same bits."""
    model = tiny_llama(5, layers=2, hidden=128).to(torch.bfloat16)
    quantize_model(model, precision, torch.bfloat16)
    loaded = wrap_model(model, ByteTokenizer())
    threads = torch.get_num_threads()
    runs = []
    try:
        with rows_invariant(loaded):
            for count, kernels in ((1, True), (2, True), (2, False)):
                torch.set_num_threads(count)
                set_lowbit_kernels(kernels)
                runs.append(_verify_run(model))
    finally:
        torch.set_num_threads(threads)
        set_lowbit_kernels(True)
    for other in runs[1:]:
        assert all(torch.equal(a, b) for a, b in zip(runs[0], other, strict=True))
