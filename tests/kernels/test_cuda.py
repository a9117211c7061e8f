"""Each CUDA kernel against a float64 torch reference on fresh random data, outputs poisoned (NaN) first.

Bounds (ISSUE 6): fp16 GEMM-like ops relative error <= 2e-3, attention over int8 KV <= 1e-2; bf16 carries
8 bits of mantissa instead of 11, so its bounds are 8x wider. Run with ``pytest -m gpu``; skipped without
a GPU or without an engine built with the CUDA backend.
"""

from __future__ import annotations

import itertools
import math
import zlib

import pytest
import torch

from lmkit import _engine

pytestmark = pytest.mark.gpu
cu = _engine.cuda

ACTS = {"F16": torch.float16, "BF16": torch.bfloat16}
BOUND = {"F16": 2e-3, "BF16": 1.6e-2}


def p(t: torch.Tensor | None) -> int:
    return 0 if t is None else t.data_ptr()


def poisoned(*shape, dtype) -> torch.Tensor:
    return torch.full(shape, float("nan"), dtype=dtype, device="cuda")


def finite_rel_err(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    assert torch.isfinite(got).all(), "kernel left unwritten (NaN) or non-finite elements"
    return ((got - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def run(fn, *args):
    fn(*args)
    cu.synchronize()


@pytest.fixture(autouse=True)
def _seed(request):
    torch.manual_seed(zlib.crc32(request.node.name.encode()))  # the same data in every process


def test_device_queries_and_bandwidth():
    assert cu.is_available() and cu.device_count() >= 1
    assert "sm_" in cu.device_name() and cu.compute_capability() >= 80
    free, total = cu.memory_info()
    assert 0 < free <= total
    assert cu.measure_copy_bandwidth(64 << 20, 5) > 1e11  # any datacenter GPU copies > 100 GB/s


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("table_dtype", ["F32", "F16", "BF16"])
def test_embedding(act, table_dtype):
    tdt = {"F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}[table_dtype]
    table = torch.randn(1000, 96, device="cuda").to(tdt)
    ids = torch.randint(0, 1000, (37,), device="cuda", dtype=torch.int32)
    out = poisoned(37, 96, dtype=ACTS[act])
    run(cu.embedding, p(table), table_dtype, 1000, p(ids), 37, 96, p(out), act)
    torch.testing.assert_close(out, table[ids.long()].float().to(ACTS[act]), rtol=0, atol=0)


# dims: 16-byte vectors held in registers (576: one per thread or none, 4096: two, 8192: four, the widest),
# and the scalar loop (8200: too wide; 100: not a multiple of 8)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("fused", [False, True])
@pytest.mark.parametrize("dim,weight_dtype",
                         [(576, "act"), (4096, "F32"), (8192, "act"), (8200, "act"), (100, "F32")])
def test_rmsnorm(act, fused, dim, weight_dtype):
    dt = ACTS[act]
    rows = 13
    wdt = dt if weight_dtype == "act" else torch.float32
    weight_dtype = act if weight_dtype == "act" else weight_dtype
    x = torch.randn(rows, dim, device="cuda").to(dt)
    w = (1 + 0.1 * torch.randn(dim, device="cuda")).to(wdt)
    residual = torch.randn(rows, dim, device="cuda").to(dt)
    out = poisoned(rows, dim, dtype=dt)
    if fused:
        ref_res = (residual.double() + x.double()).to(dt)
        run(cu.add_rmsnorm, p(residual), p(x), p(w), weight_dtype, 1e-5, rows, dim, p(out), act)
        torch.testing.assert_close(residual, ref_res, rtol=0, atol=0)
        src = ref_res.double()
    else:
        run(cu.rmsnorm, p(x), p(w), weight_dtype, 1e-5, rows, dim, p(out), act)
        src = x.double()
    ref = src / torch.sqrt(src.pow(2).mean(-1, keepdim=True) + 1e-5) * w.double()
    assert finite_rel_err(out, ref) <= BOUND[act]


@pytest.mark.parametrize("act", ACTS)
def test_silu_mul_and_gather_rows(act):
    dt = ACTS[act]
    gate_up = torch.randn(9, 2 * 160, device="cuda").to(dt)
    out = poisoned(9, 160, dtype=dt)
    run(cu.silu_mul, p(gate_up), 9, 160, p(out), act)
    g, u = gate_up.double()[:, :160], gate_up.double()[:, 160:]
    assert finite_rel_err(out, torch.nn.functional.silu(g) * u) <= BOUND[act]
    rows = torch.tensor([8, 0, 3, 3], device="cuda", dtype=torch.int32)
    got = poisoned(4, 160, dtype=dt)
    run(cu.gather_rows, p(out), p(rows), 4, 160, p(got), act)
    torch.testing.assert_close(got, out[rows.long()], rtol=0, atol=0)


# ---- KV pool helpers ------------------------------------------------------------------------------
class Pool:
    """One layer's K and V pools in the kernels' byte layout (ops.h KVLayer), with a torch view of them."""

    def __init__(self, bits, num_blocks, num_kv_heads, block_size, head_dim, act):
        self.bits, self.nb, self.nkv, self.bs, self.hd, self.act = bits, num_blocks, num_kv_heads, block_size, head_dim, act
        self.row_bytes = head_dim * (2 if bits == 16 else 1) if bits >= 8 else head_dim // 2
        self.block_bytes = num_kv_heads * block_size * (self.row_bytes + (0 if bits == 16 else 4))
        self.k = torch.full((num_blocks, self.block_bytes), 0xAB, dtype=torch.uint8, device="cuda")
        self.v = torch.full((num_blocks, self.block_bytes), 0xAB, dtype=torch.uint8, device="cuda")

    def layer(self):
        return (p(self.k), p(self.v), self.bits, self.nb, self.nkv, self.bs, self.hd)

    def dequantized(self, pool: torch.Tensor) -> torch.Tensor:
        """float64 [num_blocks, nkv, block_size, head_dim]."""
        shape = (self.nb, self.nkv, self.bs)
        if self.bits == 16:
            return pool.view(ACTS[self.act]).view(*shape, self.hd).double()
        data = pool[:, : self.nkv * self.bs * self.row_bytes].reshape(*shape, self.row_bytes)
        params = pool[:, self.nkv * self.bs * self.row_bytes:].contiguous().view(torch.float16).view(*shape, 2).double()
        if self.bits == 8:
            q = data.double()
        else:
            q = torch.cat([(data & 15).double(), (data >> 4).double()], dim=-1)
        return q * params[..., :1] + params[..., 1:]

    def fill_random(self):
        """Random K/V contents in the pool's own format (so the reference reads exactly what the kernel reads)."""
        for pool in (self.k, self.v):
            if self.bits == 16:
                pool.view(ACTS[self.act]).copy_(torch.randn(self.nb, self.block_bytes // 2, device="cuda"))
            else:
                n_data = self.nkv * self.bs * self.row_bytes
                pool[:, :n_data] = torch.randint(0, 256, (self.nb, n_data), dtype=torch.uint8, device="cuda")
                params = torch.empty(self.nb, self.nkv * self.bs, 2, device="cuda")
                params[..., 0] = 0.02 + 0.1 * torch.rand(self.nb, self.nkv * self.bs, device="cuda")  # scale
                params[..., 1] = -1 - torch.rand(self.nb, self.nkv * self.bs, device="cuda")  # zero
                pool[:, n_data:] = params.half().view(torch.uint8).view(self.nb, -1)


def rope_ref(x: torch.Tensor, positions: torch.Tensor, inv_freq: torch.Tensor, scaling: float) -> torch.Tensor:
    """HF rotate_half rotary embedding in float64; x: [n, heads, head_dim]."""
    angle = (positions.float()[:, None] * inv_freq[None, :]).double()  # fp32 product, as HF
    c, s = (angle.cos() * scaling)[:, None, :], (angle.sin() * scaling)[:, None, :]
    half = x.shape[-1] // 2
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat([x1 * c - x2 * s, x2 * c + x1 * s], dim=-1)


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("bits", [16, 8, 4])
@pytest.mark.parametrize("with_bias", [False, True])
def test_qkv_rope_kv_write(act, bits, with_bias):
    dt = ACTS[act]
    n, heads, nkv, hd, bs, nb = 11, 8, 2, 64, 16, 6
    width = (heads + 2 * nkv) * hd
    qkv = torch.randn(n, width, device="cuda").to(dt)
    bias = torch.randn(width, device="cuda").to(dt) if with_bias else None
    positions = torch.randint(0, 4000, (n,), device="cuda", dtype=torch.int32)
    slots = torch.randperm(nb * bs, device="cuda")[:n].to(torch.int32)
    slots[3] = -1  # a padding row: q is rotated, the pool is not touched
    inv_freq = 1.0 / (10000 ** (torch.arange(0, hd, 2, device="cuda").float() / hd))
    pool = Pool(bits, nb, nkv, bs, hd, act)
    before_k = pool.k.clone()
    x = qkv.double() + (bias.double() if with_bias else 0)
    if with_bias:
        x = x.to(dt).double()  # the kernel rounds q + bias to the activation dtype, as a separate add would
    q_ref = rope_ref(x[:, : heads * hd].view(n, heads, hd), positions, inv_freq, 1.0)
    k_ref = rope_ref(x[:, heads * hd: (heads + nkv) * hd].view(n, nkv, hd), positions, inv_freq, 1.0)
    v_ref = x[:, (heads + nkv) * hd:].view(n, nkv, hd)
    run(cu.qkv_rope_kv_write, p(qkv), p(bias), p(positions), p(slots), n, heads, p(inv_freq), 1.0, pool.layer(), act)
    assert finite_rel_err(qkv[:, : heads * hd].view(n, heads, hd), q_ref) <= BOUND[act]
    k_pool, v_pool = pool.dequantized(pool.k), pool.dequantized(pool.v)
    written = torch.zeros(nb * bs, dtype=torch.bool)
    for t in range(n):
        slot = int(slots[t])
        if slot < 0:
            continue
        written[slot] = True
        b, off = divmod(slot, bs)
        for name, pooled, ref in (("k", k_pool, k_ref), ("v", v_pool, v_ref)):
            got = pooled[b, :, off]
            if bits == 16:
                tol = BOUND[act] * ref[t].abs().max().item() * 4
            else:  # within half a quantization step of the exact row
                span = (ref[t].amax(-1) - ref[t].amin(-1))[:, None]
                tol = (span / (2 ** bits - 1) * 0.5 + BOUND[act] * ref[t].abs().amax()).max().item() * 1.05
            assert (got - ref[t]).abs().max().item() <= tol, (name, t, bits)
    # rows of untouched slots keep the poison bytes
    unwritten_blocks = [b for b in range(nb) if not written[b * bs:(b + 1) * bs].any()]
    for b in unwritten_blocks:
        assert (pool.k[b] == before_k[b]).all()


def attention_ref(q, pool: Pool, seqs, heads, scale, sliding_window):
    """q: [rows, heads, hd] float64; seqs: list of (q_len, ctx_len, block_table)."""
    k_all, v_all = pool.dequantized(pool.k), pool.dequantized(pool.v)
    group = heads // pool.nkv
    out = torch.empty_like(q)
    row = 0
    for q_len, ctx, table in seqs:
        blocks = torch.tensor([table[i // pool.bs] for i in range(ctx)], device=q.device)
        offs = torch.arange(ctx, device=q.device) % pool.bs
        K = k_all[blocks, :, offs]  # [ctx, nkv, hd]
        V = v_all[blocks, :, offs]
        for j in range(q_len):
            pos = ctx - q_len + j
            keys = torch.arange(ctx, device=q.device)
            visible = keys <= pos
            if sliding_window > 0:
                visible &= pos - keys < sliding_window
            for h in range(heads):
                kv = h // group
                s = (K[:, kv] @ q[row + j, h]) * scale
                s[~visible] = -math.inf
                out[row + j, h] = torch.softmax(s, 0) @ V[:, kv]
        row += q_len
    return out


@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("bits", [16, 8, 4])
@pytest.mark.parametrize("case", ["decode_long", "mixed", "window"])
def test_paged_attention(act, bits, case):
    dt = ACTS[act]
    heads, nkv, hd, bs = 8, 2, 64, 16
    if case == "decode_long":  # one decode row over a long context: split into chunks, then merged
        seq_shapes, sliding_window = [(1, 1500)], 0
    elif case == "mixed":  # prefill chunks and decode rows in one launch, partial last blocks
        seq_shapes, sliding_window = [(1, 37), (20, 20), (5, 70), (1, 1)], 0
    else:
        seq_shapes, sliding_window = [(12, 90), (1, 300)], 24
    num_blocks = sum((ctx + bs - 1) // bs for _, ctx in seq_shapes) + 5
    pool = Pool(bits, num_blocks, nkv, bs, hd, act)
    pool.fill_random()
    ids = torch.randperm(num_blocks).tolist()  # exact, scattered block ids
    seqs, max_blocks = [], max((ctx + bs - 1) // bs for _, ctx in seq_shapes)
    for q_len, ctx in seq_shapes:
        n = (ctx + bs - 1) // bs
        seqs.append((q_len, ctx, [ids.pop() for _ in range(n)]))
    rows = sum(q for q, _ in seq_shapes)
    stride = (heads + 2 * nkv) * hd  # q read out of a fused qkv buffer
    qkv = torch.randn(rows, stride, device="cuda").to(dt)
    q = qkv[:, : heads * hd].reshape(rows, heads, hd)
    q_start = torch.tensor([0, *itertools.accumulate(s[0] for s in seqs)], dtype=torch.int32, device="cuda")
    ctx_lens = torch.tensor([s[1] for s in seqs], dtype=torch.int32, device="cuda")
    tables = torch.full((len(seqs), max_blocks), -7, dtype=torch.int32, device="cuda")
    for i, (_, _, t) in enumerate(seqs):
        tables[i, : len(t)] = torch.tensor(t, dtype=torch.int32)
    row_seq = torch.repeat_interleave(torch.arange(len(seqs), device="cuda"), torch.tensor([s[0] for s in seqs], device="cuda")).int()
    max_ctx = max(s[1] for s in seqs)
    ws_bytes = cu.attention_workspace_bytes(rows, heads, hd, max_ctx)
    if case == "decode_long":
        assert ws_bytes > 0, "a single long decode row should be split"
    workspace = torch.empty(max(ws_bytes, 1), dtype=torch.uint8, device="cuda")
    out = poisoned(rows, heads, hd, dtype=dt)
    scale = hd ** -0.5
    run(cu.paged_attention, p(qkv), stride, pool.layer(), p(q_start), p(ctx_lens), p(tables), p(row_seq), len(seqs),
        rows, max_blocks, max_ctx, heads, scale, sliding_window, p(workspace) if ws_bytes else 0, p(out), act)
    ref = attention_ref(q.double(), pool, seqs, heads, scale, sliding_window)
    bound = {16: 2e-3, 8: 1e-2, 4: 1e-2}[bits] * (8 if act == "BF16" else 1)
    assert finite_rel_err(out, ref) <= bound


# ---- linear layers ---------------------------------------------------------------------------------
@pytest.fixture
def linear_path(request):
    """'skinny': the skinny tensor-core kernel for every M the test uses (pipelined loads), 'skinny-batched'
    the same kernel loading a batch of steps, then multiplying it; 'other': the skinny kernel off (cuBLAS where
    found, int4 dequantized first); 'wmma' / 'cublas': off, and every weight on that GEMM."""
    path = request.param
    saved, saved_pipe = cu.skinny_rows(), cu.skinny_pipeline()
    cu.set_skinny_rows(*((1 << 20, 1 << 20) if path.startswith("skinny") else (0, 0)))
    cu.set_skinny_pipeline(path != "skinny-batched")
    cu.set_dense_gemm_backend("wmma" if path == "wmma" else "cublas")
    try:
        if path == "cublas" and cu.dense_gemm_backend() != "cublas":
            pytest.skip("libcublas not found")
        yield path
    finally:
        cu.set_dense_gemm_backend("cublas")
        cu.set_skinny_rows(*saved)
        cu.set_skinny_pipeline(saved_pipe)


def int4_case(act, group_size, M, N, K):
    from lmkit.lite.quantizer import pack_awq_gemm, quantize

    dt = ACTS[act]
    qw = quantize(torch.randn(N, K), group_size)
    packed = pack_awq_gemm(qw)
    w = cu.upload_int4(packed["qweight"].numpy(), packed["qzeros"].numpy(), packed["scales"].numpy(), group_size, act)
    x = torch.randn(M, K, device="cuda").to(dt)
    bias = torch.randn(N, device="cuda").to(dt)
    out = poisoned(M, N, dtype=dt)
    run(cu.linear, p(x), M, w, p(bias), p(out), act)
    ref = x.double() @ qw.dequantize().double().cuda().T + bias.double()
    return finite_rel_err(out, ref)


@pytest.mark.parametrize("linear_path", ["skinny", "skinny-batched", "other", "wmma"], indirect=True)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("M", [1, 3, 8, 9, 64, 100])
def test_linear_int4(linear_path, act, group_size, M):
    # N not a multiple of the 16 (skinny) or 64 (WMMA) rows of a tile
    assert int4_case(act, group_size, M, 200, 384) <= BOUND[act]


# K of "5 groups": a last step of 128 k that is partly past K (g 32, 64); K of 2,688: 21 steps over 8 warps,
# several loads in flight per warp and a partial last batch; N of 40 / 24 weight rows (AWQ packs 8 a word).
@pytest.mark.parametrize("linear_path", ["skinny", "skinny-batched"], indirect=True)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize("M,N,K", [(1, 40, "5 groups"), (5, 24, "5 groups"), (1, 200, 2688), (24, 40, 2688),
                                   (130, 24, 2688)])
def test_linear_int4_skinny_shapes(linear_path, act, group_size, M, N, K):
    K = 5 * group_size if K == "5 groups" else K
    assert int4_case(act, group_size, M, N, K) <= BOUND[act]


@pytest.mark.parametrize("linear_path", ["skinny", "skinny-batched", "wmma", "cublas"], indirect=True)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize("M,K", [(1, 576), (5, 576), (16, 576), (77, 576), (3, 4160), (8, 584)])
def test_linear_dense(linear_path, act, M, K):
    dt = ACTS[act]
    N = 136
    weight = torch.randn(N, K)
    w = cu.upload_dense(weight.numpy(), act)
    x = torch.randn(M, K, device="cuda").to(dt)
    bias = torch.randn(N, device="cuda").to(dt)
    out = poisoned(M, N, dtype=dt)
    run(cu.linear, p(x), M, w, p(bias), p(out), act)  # K = 584: no multiple of 32, the skinny kernel declines
    ref = x.double() @ weight.to(dt).double().cuda().T + bias.double()
    assert finite_rel_err(out, ref) <= BOUND[act]


@pytest.mark.parametrize("linear_path", ["cublas"], indirect=True)
@pytest.mark.parametrize("act", ACTS)
def test_linear_int4_dequantized_in_blocks(linear_path, act):
    # 4,200 x 8,192 int4 weights are 69 MB as fp16, over the 64 MiB scratch: two blocks of rows, the second
    # written into out's columns 2,112.. (cuBLAS's row stride of out = N)
    assert int4_case(act, 128, 100, 4200, 8192) <= BOUND[act]


@pytest.mark.parametrize("linear_path", ["cublas"], indirect=True)
def test_linear_int4_dequantized_under_graph_capture(linear_path):
    # A stream that ran the dequantizing path eagerly has its scratch: the capture records the same path. A
    # stream that never did cannot allocate under capture: the captured call takes the WMMA GEMM instead.
    from lmkit.lite.quantizer import pack_awq_gemm, quantize

    M, N, K = 96, 320, 512
    qw = quantize(torch.randn(N, K), 64)
    packed = pack_awq_gemm(qw)
    w = cu.upload_int4(packed["qweight"].numpy(), packed["qzeros"].numpy(), packed["scales"].numpy(), 64, "F16")
    x = torch.randn(M, K, device="cuda").half()
    for eager_first in (True, False):
        stream = torch.cuda.Stream()
        out = poisoned(M, N, dtype=torch.float16)
        if eager_first:
            with torch.cuda.stream(stream):
                cu.linear(p(x), M, w, 0, p(out), "F16", stream=stream.cuda_stream)
            stream.synchronize()
        out.fill_(float("nan"))
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            cu.linear(p(x), M, w, 0, p(out), "F16", stream=stream.cuda_stream)
        x.copy_(torch.randn(M, K, device="cuda").half())  # the replay reads the new x
        ref = x.double() @ qw.dequantize().double().cuda().T
        graph.replay()
        torch.cuda.synchronize()
        assert finite_rel_err(out, ref) <= BOUND["F16"], eager_first


def test_skinny_linear_on_a_stream_and_rows_setting():
    dt = torch.float16
    N, K = 64, 256
    weight = torch.randn(N, K)
    w = cu.upload_dense(weight.numpy(), "F16")
    x = torch.randn(4, K, device="cuda").to(dt)
    out = poisoned(4, N, dtype=dt)
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        cu.linear(p(x), 4, w, 0, p(out), "F16", stream=stream.cuda_stream)
    stream.synchronize()
    assert finite_rel_err(out, x.double() @ weight.half().double().cuda().T) <= BOUND["F16"]
    with pytest.raises(ValueError, match="skinny rows"):
        cu.set_skinny_rows(-1, 8)


# ---- sampling ----------------------------------------------------------------------------------------
def sample(logits: torch.Tensor, params: list, penalties=None) -> torch.Tensor:
    rows, vocab = logits.shape
    out = torch.full((rows,), -5, dtype=torch.int32, device="cuda")
    dtype = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}[logits.dtype]
    if penalties is None:
        run(cu.sample, p(logits), dtype, rows, vocab, params, 0, 0, 0, p(out))
    else:
        offsets, tokens, counts = (torch.tensor(a, dtype=torch.int32, device="cuda") for a in penalties)
        run(cu.sample, p(logits), dtype, rows, vocab, params, p(offsets), p(tokens), p(counts), p(out))
    return out


def params(**kw):
    sp = cu.SampleParams()
    for k, v in kw.items():
        setattr(sp, k, v)
    return sp


def test_greedy_is_argmax_lowest_id_on_ties():
    logits = torch.randn(6, 50000, device="cuda")
    logits[2, 7] = logits[2, 49999] = 100.0  # a tie: the lower id wins
    got = sample(logits.clone(), [params() for _ in range(6)])
    ref = logits.argmax(-1)
    ref[2] = 7
    assert got.tolist() == ref.int().tolist()


def test_penalties_then_greedy():
    vocab = 100
    logits = 0.1 * torch.randn(2, vocab, device="cuda")
    logits[0, 10] = 5.0  # best, but banned
    logits[0, 11] = 4.0  # second best, repetition-penalised below the third
    logits[0, 12] = 3.0
    logits[1, 20] = 5.0  # best, but presence + frequency push it down
    logits[1, 21] = 4.5
    offsets, tokens, counts = [0, 2, 3], [10, 11, 20], [-1, 0, 3]
    ps = [params(repetition_penalty=2.0), params(presence_penalty=0.1, frequency_penalty=0.2)]
    got = sample(logits, ps, (offsets, tokens, counts))
    assert got.tolist() == [12, 21]
    assert logits[0, 10].item() == -math.inf and logits[0, 11].item() == 2.0
    assert abs(logits[1, 20].item() - (5.0 - 0.1 - 0.6)) < 1e-6


def test_sampling_distribution_and_filters():
    vocab, rows = 8, 20000
    base = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.0, -0.5, -1.0, -8.0], device="cuda")
    logits = base.repeat(rows, 1)
    got = sample(logits, [params(temperature=0.7, seed=123, step=i) for i in range(rows)])
    freq = torch.bincount(got.long(), minlength=vocab).double() / rows
    expect = torch.softmax(base.double() / 0.7, 0)
    assert (freq - expect).abs().max().item() < 0.015, (freq, expect)
    # top-k 3: only the three best; top-p: the smallest prefix reaching the mass; min-p: relative floor
    got = sample(logits, [params(temperature=1.0, top_k=3, seed=5, step=i) for i in range(rows)])
    assert set(got.tolist()) == {0, 1, 2}
    probs = torch.softmax(base.double(), 0)
    nucleus = int((probs.cumsum(0) < 0.8).sum().item()) + 1
    got = sample(logits, [params(temperature=1.0, top_p=0.8, seed=6, step=i) for i in range(rows)])
    assert set(got.tolist()) == set(range(nucleus))
    got = sample(logits, [params(temperature=1.0, min_p=0.3, seed=7, step=i) for i in range(rows)])
    assert set(got.tolist()) == {i for i in range(vocab) if probs[i] >= 0.3 * probs[0]}
    # the same (seed, step) draws the same token
    again = sample(logits[:100], [params(temperature=1.0, min_p=0.3, seed=7, step=i) for i in range(100)])
    assert again.tolist() == got[:100].tolist()


def test_tiny_temperature_samples_the_argmax():
    """temperature 1e-38 (logit / t overflows fp32; 1 / t of a subnormal t is inf): every filter combination
    keeps only the best token, as greedy would, instead of whichever overflowed to +inf first."""
    logits = torch.randn(4, 1000, device="cuda") * 5
    ref = logits.argmax(-1).int().tolist()
    for t in (1e-38, 1e-44):
        for kw in ({}, {"top_p": 0.9}, {"top_k": 5}, {"min_p": 0.1}):
            got = sample(logits.clone(), [params(temperature=t, seed=1, step=i, **kw) for i in range(4)])
            assert got.tolist() == ref, (t, kw)
