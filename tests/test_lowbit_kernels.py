"""The release's FP8 and FP4 weights multiplied as stored (`native.fp8_mm`, `native.fp4_mm`, `cpu_lowbit.c`),
both builds (AVX-512 and AVX2): the reference's values (`reference.fp8_linear`, `reference.fp4_linear`) within fp32
sums' error over row counts 1-17 and a prefill's, output widths no tile divides, inputs past the last whole vector,
tile offsets, column slices read in place and scales spread wide; each row's result the same bits alone or beside
others, on one thread or two. The fast kernels for bf16 runs (`native.fp4_mm_q8`, `native.fp8_mm_bf16`, AVX-512
VNNI and BF16 only) likewise against their own oracles: x quantised per row (`reference.quantize_per_token`) in
exact integer sums, and x in bf16 against the weight with E4M3's subnormals as 0."""
import pytest
import torch

from dsv4cli.kernels import cpu, native, reference

ROWS = [*range(1, 18), 100]


@pytest.fixture(params=["avx512", "avx2"])
def lib(request):
    built = native.lowbit_library(request.param)
    if built is None:
        pytest.skip(f"no {request.param} build here (an x86-64 CPU with it and a C compiler)")
    return built


def e4m3(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """Every E4M3 byte but the NaNs (0x7f, 0xff), subnormals included."""
    b = torch.randint(0, 255, (rows, cols), generator=g, dtype=torch.uint8)
    b[b == 0x7f] = 0x80
    return b.view(torch.float8_e4m3fn)


def tile_scales(rows: int, cols: int, g: torch.Generator) -> torch.Tensor:
    """fp32 tile scales, not powers of two, from 2^-20 to 2^10."""
    return (torch.rand(rows, cols, generator=g) + 0.5) * torch.exp2(torch.randint(-20, 11, (rows, cols), generator=g))


def e2m1(rows: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """Packed E2M1 [rows, k/2] and E8M0 scales [rows, k/32] from 2^-20 to 2^10."""
    packed = torch.randint(0, 256, (rows, k // 2), generator=g, dtype=torch.uint8)
    scale = torch.randint(127 - 20, 127 + 11, (rows, k // 32), generator=g, dtype=torch.uint8)
    return packed.view(torch.float4_e2m1fn_x2), scale.view(torch.float8_e8m0fnu)


def relative_error(got: torch.Tensor, exact: torch.Tensor) -> float:
    return ((got.double() - exact).abs().max() / exact.abs().max()).item()


# (n, k, offset, the weight as a view of a wider one: (rows before it, columns before it, columns after it))
FP8_CASES = [(300, 200, (0, 0), None),            # rows past whole units, inputs past whole vectors
             (129, 384, (127, 127), None),        # the first tile row and column one wide
             (37, 7, (5, 100), None),             # fewer inputs than a vector
             (300, 300, (0, 2), (0, 130, 170)),   # a column slice (wo_a's group): rows 600 bytes apart
             (250, 256, (72, 0), (200, 0, 0))]    # a tensor-parallel rank's rows


@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: f"{c[0]}x{c[1]}@{c[2]}{'-view' if c[3] else ''}")
def test_fp8_gives_the_reference_values(lib, case):
    n, k, offset, view = case
    g = torch.Generator().manual_seed(n + k)
    if view is None:
        weight = e4m3(n, k, g)
        scale = tile_scales(-(-(offset[0] + n) // 128), -(-(offset[1] + k) // 128), g)
    else:                  # the whole tensor and its grid, read at the slice with the grid's covering tiles
        before, left, right = view
        whole = e4m3(before + n, left + k + right, g)
        grid = tile_scales(-(-(before + n) // 128), -(-(left + k + right) // 128), g)
        weight = whole[before:, left:left + k]
        scale = grid[before // 128:, left // 128:]
        assert weight.stride(0) > k or before
    w = reference.fp8_to_float(weight, scale, offset).double()
    for m in ROWS:
        x = torch.randn(m, k, generator=g)
        y = native.fp8_mm(x, weight, scale, offset, lib=lib)
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert relative_error(y, x.double() @ w.t()) < 1e-6
    assert relative_error(native.fp8_mm(x, weight, scale, offset, lib=lib),
                          reference.fp8_linear(x, weight, scale, offset).double()) < 1e-6


@pytest.mark.parametrize("n, k", [(37, 32), (301, 96), (64, 160), (9, 288), (130, 512)])
def test_fp4_gives_the_reference_values(lib, n, k):
    """k: one group; groups past whole chunks of 4 (96, 160, 288); whole chunks (512)."""
    g = torch.Generator().manual_seed(n + k)
    weight, scale = e2m1(n, k, g)
    w = reference.fp4_to_float(weight, scale).double()
    for m in ROWS:
        x = torch.randn(m, k, generator=g)
        y = native.fp4_mm(x, weight, scale, lib=lib)
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert relative_error(y, x.double() @ w.t()) < 1e-6
    y = native.fp4_mm(x, weight, scale, lib=lib)
    assert relative_error(y, reference.fp4_linear(x, weight, scale).double()) < 1e-6


def test_fp4_reads_a_column_slice_in_place(lib):
    """A rank's slice of w2's inputs: rows and scale rows wider than the slice, read where they lie."""
    g = torch.Generator().manual_seed(5)
    whole, whole_scale = e2m1(70, 1024, g)
    weight, scale = whole[:, 96:96 + 224], whole_scale[:, 6:6 + 14]             # inputs 192..639
    assert weight.data_ptr() == whole.data_ptr() + 96
    x = torch.randn(6, 448, generator=g)
    y = native.fp4_mm(x, weight, scale, lib=lib)
    assert relative_error(y, x.double() @ reference.fp4_to_float(weight, scale).double().t()) < 1e-6


def assert_rows_their_own(gemm, x, sizes):
    """Every slice of `sizes` rows gives the bits those rows get among all of x, and 2 threads the bits of 1."""
    y = gemm(x)
    for n in sizes:
        assert all(torch.equal(gemm(x[i:i + n]), y[i:i + n]) for i in range(len(x) - n + 1))
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        assert torch.equal(gemm(x), y)
    finally:
        torch.set_num_threads(threads)


def test_every_row_is_its_own_on_any_threads(lib):
    """A row's sums run in the same order whatever the rows beside it or the threads: the same bits."""
    g = torch.Generator().manual_seed(7)
    w8, s8 = e4m3(200, 384, g), tile_scales(2, 3, g)
    w4, s4 = e2m1(200, 384, g)
    x = torch.randn(21, 384, generator=g)
    for gemm in (lambda x: native.fp8_mm(x, w8, s8, (3, 0), lib=lib), lambda x: native.fp4_mm(x, w4, s4, lib=lib)):
        assert_rows_their_own(gemm, x, (1,))


def test_leading_dims_and_empty_inputs(lib):
    g = torch.Generator().manual_seed(3)
    w8, s8 = e4m3(40, 64, g), tile_scales(1, 1, g)
    w4, s4 = e2m1(40, 64, g)
    x = torch.randn(2, 3, 64, generator=g).bfloat16()
    flat = x.reshape(6, 64)
    assert torch.equal(native.fp8_mm(x, w8, s8, lib=lib), native.fp8_mm(flat, w8, s8, lib=lib).view(2, 3, 40))
    assert torch.equal(native.fp4_mm(x, w4, s4, lib=lib), native.fp4_mm(flat, w4, s4, lib=lib).view(2, 3, 40))
    assert native.fp8_mm(x[:0], w8, s8, lib=lib).shape == (0, 3, 40)
    assert native.fp4_mm(x[:, :0], w4, s4, lib=lib).shape == (2, 0, 40)


def test_shapes_the_kernels_cannot_read_are_refused():
    g = torch.Generator().manual_seed(1)
    w8, s8 = e4m3(40, 64, g), tile_scales(1, 1, g)
    w4, s4 = e2m1(40, 64, g)
    x = torch.randn(2, 64)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        native.fp8_mm(x, w8.view(torch.uint8), s8)
    with pytest.raises(ValueError, match="cover"):
        native.fp8_mm(x, w8, s8, (100, 0))
    with pytest.raises(ValueError, match="contiguous"):
        native.fp8_mm(x, w8.t(), s8)
    with pytest.raises(ValueError, match="inputs"):
        native.fp4_mm(x[:, :32], w4, s4)
    with pytest.raises(ValueError, match="scales"):
        native.fp4_mm(x, w4, s4[:, :1])


def test_the_build_follows_the_cpu_and_the_environment(monkeypatch):
    cpu = native._cpu_flags()
    widest = next((isa for isa, flags in native.LOWBIT_CPU_FLAGS.items() if cpu.issuperset(flags)), None)
    if widest is None or native._compiler() is None:
        pytest.skip("no x86-64 CPU with AVX2 and F16C, or no C compiler")
    native.lowbit_library.cache_clear()
    try:
        assert native.lowbit_library().isa == widest and native.lowbit_available()
        monkeypatch.setenv("DSV4_LOWBIT_ISA", "avx2")
        native.lowbit_library.cache_clear()
        assert native.lowbit_library().isa == "avx2"
        monkeypatch.setenv("DSV4_NATIVE_KERNELS", "0")
        native.lowbit_library.cache_clear()
        assert native.lowbit_library() is None
    finally:
        native.lowbit_library.cache_clear()


@pytest.fixture
def fast():
    built = native.lowbit_library("avx512")
    if built is None or not built.fast:
        pytest.skip("no fast kernels here (an x86-64 CPU with AVX-512 VNNI and BF16, and a C compiler)")
    return built


def quantised_oracle(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x quantised per row as W8A8 quantises it, times the decoded weight w, summed exactly (float64)."""
    q, sx = reference.quantize_per_token(x)
    return (q.double() @ w.t()) * sx.double()


@pytest.mark.parametrize("n, k", [(37, 32), (301, 96), (64, 160), (9, 288), (130, 512), (33, 1536)])
def test_fp4_q8_gives_the_quantised_sums(fast, n, k):
    """k: one group; steps of 16 groups cut short (96, 160, 288, 1536); one whole step (512). x in fp32, bf16, fp16:
    each quantised from its own values."""
    g = torch.Generator().manual_seed(n + k)
    weight, scale = e2m1(n, k, g)
    w = reference.fp4_to_float(weight, scale).double()
    for m in ROWS:
        for dtype in (torch.float32, torch.bfloat16, torch.float16):
            x = (torch.randn(m, k, generator=g) * 3).to(dtype)
            y = native.fp4_mm_q8(x, weight, scale, lib=fast)
            assert y.shape == (m, n) and y.dtype == torch.float32
            assert relative_error(y, quantised_oracle(x, w)) < 1e-6


def test_fp4_q8_reads_a_column_slice_in_place(fast):
    g = torch.Generator().manual_seed(5)
    whole, whole_scale = e2m1(70, 1024, g)
    weight, scale = whole[:, 96:96 + 224], whole_scale[:, 6:6 + 14]             # inputs 192..639
    x = torch.randn(6, 448, generator=g)
    y = native.fp4_mm_q8(x, weight, scale, lib=fast)
    assert relative_error(y, quantised_oracle(x, reference.fp4_to_float(weight, scale).double())) < 1e-6


def without_subnormals(weight: torch.Tensor) -> torch.Tensor:
    b = weight.view(torch.uint8)
    return torch.where(b & 0x78 == 0, 0, b).to(torch.uint8).view(torch.float8_e4m3fn)


@pytest.mark.parametrize("case", FP8_CASES, ids=lambda c: f"{c[0]}x{c[1]}@{c[2]}{'-view' if c[3] else ''}")
def test_fp8_bf16_gives_the_reference_values(fast, case):
    """Against the weight with its E4M3 subnormals as 0 within fp32 sums' error; against the whole weight, the
    subnormals' part (5% of these bytes, |v| < 2^-6 against up to 448)."""
    n, k, offset, view = case
    g = torch.Generator().manual_seed(n + k)
    if view is None:
        weight = e4m3(n, k, g)
        scale = tile_scales(-(-(offset[0] + n) // 128), -(-(offset[1] + k) // 128), g)
    else:
        before, left, right = view
        whole = e4m3(before + n, left + k + right, g)
        grid = tile_scales(-(-(before + n) // 128), -(-(left + k + right) // 128), g)
        weight = whole[before:, left:left + k]
        scale = grid[before // 128:, left // 128:]
    w = reference.fp8_to_float(without_subnormals(weight), scale, offset).double()
    for m in ROWS:
        x = torch.randn(m, k, generator=g).bfloat16()
        y = native.fp8_mm_bf16(x, weight, scale, offset, lib=fast)
        assert y.shape == (m, n) and y.dtype == torch.float32
        assert relative_error(y, x.double() @ w.t()) < 1e-6
    assert relative_error(y, x.double() @ reference.fp8_to_float(weight, scale, offset).double().t()) < 1e-4


def test_fp8_bf16_keeps_tiny_and_large_inputs(fast):
    """Products far below fp32's normals (x down to 2^-60 times weights ~ 2^-120 as decoded) and x up to 2^60: vdpbf16ps
    writes subnormal results as 0, so x comes in scaled up."""
    g = torch.Generator().manual_seed(11)
    weight, scale = without_subnormals(e4m3(64, 256, g)), tile_scales(1, 2, g)
    w = reference.fp8_to_float(weight, scale).double()
    for size in (2.0 ** -40, 2.0 ** -60, 2.0 ** 60):
        x = (torch.randn(3, 256, generator=g) * size).bfloat16()
        assert relative_error(native.fp8_mm_bf16(x, weight, scale, lib=fast), x.double() @ w.t()) < 1e-6


def test_fast_rows_are_their_own_on_any_threads(fast):
    """Speculative decoding verifies drafts as rows beside the committed one: each row the same bits as alone,
    whatever register tiles its rows make (FP4: 3 rows one tile of two weight rows, 5 one tile of one, 11 two,
    21 three; FP8: 5 rows 3 + 2, 11 rows 4 + 4 + 3). The weights span several groups of rows (those that meet
    each row of x while in L2)."""
    g = torch.Generator().manual_seed(7)
    w8, s8 = e4m3(1536, 1024, g), tile_scales(13, 9, g)
    w4, s4 = e2m1(2048, 1024, g)
    x = torch.randn(21, 1024, generator=g).bfloat16()
    for gemm in (lambda x: native.fp8_mm_bf16(x, w8, s8, (3, 5), lib=fast),
                 lambda x: native.fp4_mm_q8(x, w4, s4, lib=fast)):
        assert_rows_their_own(gemm, x, (1, 3, 5, 11))


def test_fast_fp8_many_rows_give_each_row_its_bits(fast):
    """From 48 rows (a prefill chunk's) the FP8 product runs with 16 outputs to a vector: each output the bits it
    gets alone and among 47 rows (the few-row kernel), with outputs ending mid-vector, row and column offsets
    within a tile, across the 256-row blocks and on 2 threads; and the reference's values."""
    g = torch.Generator().manual_seed(13)
    weight, scale = e4m3(150, 1000, g), tile_scales(2, 9, g)
    x = torch.randn(300, 1000, generator=g).bfloat16()
    y = native.fp8_mm_bf16(x, weight, scale, (3, 5), lib=fast)
    w = reference.fp8_to_float(without_subnormals(weight), scale, (3, 5)).double()
    assert relative_error(y, x.double() @ w.t()) < 1e-6
    assert_rows_their_own(lambda x: native.fp8_mm_bf16(x, weight, scale, (3, 5), lib=fast), x, (1, 47))


def test_fast_prefill_blocks_keep_each_row_its_own(fast):
    """A prefill's rows of 8192 inputs (FP8: 120 rows multiplied with 16 outputs to a vector; FP4: in blocks of
    112 rows of int8 that fit L2): the reference's values, and each row the same bits as alone."""
    g = torch.Generator().manual_seed(9)
    w8, s8 = e4m3(130, 8192, g), tile_scales(2, 64, g)
    w4, s4 = e2m1(64, 8192, g)
    x = torch.randn(120, 8192, generator=g).bfloat16()
    y8, y4 = native.fp8_mm_bf16(x, w8, s8, lib=fast), native.fp4_mm_q8(x, w4, s4, lib=fast)
    assert relative_error(y8, x.double() @ reference.fp8_to_float(without_subnormals(w8), s8).double().t()) < 1e-6
    assert relative_error(y4, quantised_oracle(x, reference.fp4_to_float(w4, s4).double())) < 1e-6
    for i in (0, 59, 60, 111, 112, 119):
        assert torch.equal(native.fp8_mm_bf16(x[i:i + 1], w8, s8, lib=fast), y8[i:i + 1])
        assert torch.equal(native.fp4_mm_q8(x[i:i + 1], w4, s4, lib=fast), y4[i:i + 1])


def test_fast_fp8_groups_in_one_call_give_each_groups_bits(fast):
    """Attention's wo_a in one call: each group's outputs are the single-group call's bits for its rows (groups of
    96 rows from row offset 40, so groups start inside tiles and straddle them), for a decode's rows and a
    prefill's; the CPU's grouped projection takes it, and fp32 x goes group by group."""
    g = torch.Generator().manual_seed(21)
    groups, r, k = 4, 96, 200
    weight, scale = e4m3(groups * r, k, g), tile_scales(4, 3, g)
    for rows in (1, 5, 60):
        x = torch.randn(2, rows, groups, k, generator=g).bfloat16()
        got = native.fp8_mm_bf16_groups(x, weight, scale, (40, 7), groups)
        assert got.shape == (2, rows, groups, r)
        for j in range(groups):
            first = 40 + j * r
            want = native.fp8_mm_bf16(x[..., j, :], weight[j * r:(j + 1) * r], scale[first // 128:],
                                      (first % 128, 7), lib=fast)
            assert torch.equal(got[..., j, :], want)
        assert torch.equal(cpu.fp8_grouped_projection(x, weight, scale, (40, 7), groups), got.bfloat16())
    x = torch.randn(3, groups, k, generator=g)
    assert torch.equal(cpu.fp8_grouped_projection(x, weight, scale, (40, 7), groups),
                       reference.fp8_by_groups(cpu.fp8_linear, x, weight, scale, (40, 7), groups))


def test_fast_leading_dims_and_empty_inputs(fast):
    g = torch.Generator().manual_seed(3)
    w8, s8 = e4m3(40, 64, g), tile_scales(1, 1, g)
    w4, s4 = e2m1(40, 64, g)
    x = torch.randn(2, 3, 64, generator=g).bfloat16()
    flat = x.reshape(6, 64)
    assert torch.equal(native.fp8_mm_bf16(x, w8, s8, lib=fast),
                       native.fp8_mm_bf16(flat, w8, s8, lib=fast).view(2, 3, 40))
    assert torch.equal(native.fp4_mm_q8(x, w4, s4, lib=fast), native.fp4_mm_q8(flat, w4, s4, lib=fast).view(2, 3, 40))
    assert native.fp8_mm_bf16(x[:0], w8, s8, lib=fast).shape == (0, 3, 40)
    assert native.fp4_mm_q8(x[:, :0], w4, s4, lib=fast).shape == (2, 0, 40)
    with pytest.raises(ValueError, match="inputs"):
        native.fp4_mm_q8(x[..., :32], w4, s4, lib=fast)
    with pytest.raises(ValueError, match="inputs"):
        native.fp8_mm_bf16(x[..., :32], w8, s8, lib=fast)


def test_only_the_avx512_build_on_vnni_and_bf16_has_the_fast_kernels():
    cpu = native._cpu_flags()
    if native._compiler() is None or not cpu.issuperset(native.LOWBIT_CPU_FLAGS["avx2"]):
        pytest.skip("no x86-64 CPU with AVX2 and F16C, or no C compiler")
    avx2 = native.lowbit_library("avx2")
    assert not avx2.fast and not hasattr(avx2, "dsv4_fp4_mm_q8")
    x, (w4, s4) = torch.randn(1, 64), e2m1(8, 64, torch.Generator().manual_seed(1))
    with pytest.raises(RuntimeError, match="VNNI and BF16"):
        native.fp4_mm_q8(x, w4, s4, lib=avx2)
    if cpu.issuperset(native.LOWBIT_CPU_FLAGS["avx512"]):
        assert native.lowbit_library("avx512").fast == cpu.issuperset(native.LOWBIT_FAST_CPU_FLAGS)


def fp4_experts(count: int, dim: int, inter: int, limit: float, g: torch.Generator) -> list:
    """Routed experts of the release's FP4 bytes (scales kept near 2^0, so SwiGLU sees values of every size)."""
    def projection(rows, k):
        weight, _ = e2m1(rows, k, g)
        return weight, torch.randint(124, 129, (rows, k // 32), generator=g, dtype=torch.uint8).view(
            torch.float8_e8m0fnu)
    experts = []
    for _ in range(count):
        (w1, s1), (w3, s3), (w2, s2) = projection(inter, dim), projection(inter, dim), projection(dim, inter)
        experts.append(cpu.TensorExpert([w1, w3, w2], [s1, s3, s2], limit))
    return experts


@pytest.mark.parametrize("limit", [10.0, 0.3])            # 0.3: the SwiGLU clamps bite
@torch.no_grad()
def test_fused_fp4_experts_give_each_experts_bits(fast, limit):
    """A bf16 run's routed FP4 experts in one native call against each expert through `fp4_mm_q8` and torch's
    ops between: the same bits, for a decode row, verify rows and a prefill chunk (experts with many rows; a
    width past a whole step of 512 inputs); pairs routed to another rank's experts add nothing; an expert no
    row is routed to is never read (its scales poisoned: every output unchanged); 2 threads give 1's bits."""
    g = torch.Generator().manual_seed(int(limit * 10))
    dim, inter, count, k = 640, 96, 8, 3
    experts = fp4_experts(count, dim, inter, limit, g)
    table = cpu.expert_table(experts)
    assert table is not None and table.format == "fp4" and (table.dim, table.inter) == (dim, inter)
    for tokens in (1, 4, 40):
        x = (torch.randn(tokens, dim, generator=g) * 3).bfloat16()
        weights = torch.rand(tokens, k, generator=g)
        local = torch.stack([torch.randperm(count + 2, generator=g)[:k] - 1 for _ in range(tokens)])  # -1, 8: others'
        want = reference.routed_experts(x, weights, local, experts)
        got = cpu.routed_experts(x, weights, local, experts)
        assert torch.equal(got, want)
        unused = [s for e in set(range(count)) - set(local.flatten().tolist()) for s in experts[e].tensors[1]]
        kept = [s.clone() for s in unused]
        for scale in unused:
            scale.view(torch.uint8).fill_(255)          # E8M0's NaN: any read of it shows
        threads = torch.get_num_threads()
        torch.set_num_threads(2)
        try:
            assert torch.equal(cpu.routed_experts(x, weights, local, experts), got)
        finally:
            torch.set_num_threads(threads)
        for scale, old in zip(unused, kept):
            scale.copy_(old)
    x32 = torch.randn(2, dim, generator=g)             # an fp32 run takes the exact kernels, one expert at a time
    local = torch.tensor([[0, 1, 2], [3, 4, 5]])
    weights = torch.rand(2, k, generator=g)
    assert torch.equal(cpu.routed_experts(x32, weights, local, experts),
                       reference.routed_experts(x32, weights, local, experts))
