"""The formats verispec's CPU kernel runs after repacking (kernels/kquant.py: Q5_0, Q5_1, Q4_K, Q5_K, Q6_K), and
stacked weights whose parts are in different formats, against references independent of the C source:

- random valid blocks of each format built byte by byte: the repacker's decoding equals gguf's own
  `gguf.quants.dequantize` bit for bit, and the kernel's view of the weight (probed with one-hot activations) is
  gguf's weight up to fp32 rounding;
- products: a float64 matmul of gguf's dequantised weights with the activations rounded by the rule written out in
  torch (int8, one scale per 32), within fp32 accumulation's bound; every body built here (portable, AVX2, AVX-512
  VNNI where the CPU has it) equal to the portable one bit for bit;
- batch invariance per format and body: a row's output is the same alone or among others, at any M;
- a mixed stacked weight is each part's own product, side by side, bit for bit;
- tiny GGUF files written with gguf's writer in each format (and one mixing them all) load on the gguf-q8act path,
  every linear and the head on the file's blocks, and decode greedily as a reference decoder does whose linears
  are the dense dequantised weights times the same rounded activations in float64;
- formats without a body are reported (stderr) and the path is not offered without a working compiler.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType, GGUFReader, GGUFWriter
from gguf.quants import dequantize

from verispec.kernels import kquant
from verispec.kernels.cpu_build import KernelUnavailable

try:
    from verispec.kernels.cpu_kernels import load

    LIB = load()
except KernelUnavailable as e:  # no C compiler: only the fallback tests below run
    LIB, WHY = None, str(e)
needs_kernel = pytest.mark.skipif(LIB is None, reason="verispec's CPU kernel cannot be built here")

NEW = ("Q5_0", "Q5_1", "Q4_K", "Q5_K", "Q6_K", "IQ4_NL", "IQ4_XS")
ALL = ("Q4_0", "Q4_1", "Q8_0") + NEW
BLOCKS = {"Q4_0": (32, 18), "Q4_1": (32, 20), "Q8_0": (32, 34), "Q3_K": (256, 110), **kquant.FILE_BLOCKS}
# format -> (byte offset of an fp16 scale, its range) for each scale a block holds: the rest of a block is any bytes
SCALES = {"Q4_0": [(0, 2e-3, 2e-2)], "Q4_1": [(0, 2e-3, 2e-2), (2, -0.1, 0.0)], "Q8_0": [(0, 2e-4, 2e-3)],
          "Q5_0": [(0, 1e-3, 1e-2)], "Q5_1": [(0, 1e-3, 1e-2), (2, -0.1, 0.0)],
          "Q4_K": [(0, 5e-5, 2e-4), (2, 0.0, 2e-4)], "Q5_K": [(0, 3e-5, 1e-4), (2, 0.0, 2e-4)],
          "Q6_K": [(208, 1e-5, 4e-5)], "Q3_K": [(108, 1e-4, 5e-4)], "IQ4_NL": [(0, 1e-4, 4e-4)],
          "IQ4_XS": [(0, 5e-6, 2e-5)]}


def random_blocks(kind: str, n: int, k: int, seed: int = 0) -> np.ndarray:
    """uint8 [N, K / block * bytes]: blocks of random bytes (every level, sub-block scale and min a file may hold)
    with their fp16 scales set to small finite values."""
    elems, size = BLOCKS[kind]
    rng = np.random.default_rng(seed)
    raw = rng.integers(0, 256, (n, k // elems, size), dtype=np.uint8)
    for at, lo, hi in SCALES[kind]:
        raw[:, :, at : at + 2] = rng.uniform(lo, hi, (n, k // elems, 1)).astype(np.float16).view(np.uint8)
    return raw.reshape(n, -1)


def gguf_weight(raw: np.ndarray, kind: str, n: int, k: int) -> torch.Tensor:
    """gguf's own dequantisation: [N, K] float64."""
    return torch.from_numpy(dequantize(raw, GGMLQuantizationType[kind]).reshape(n, k)).double()


def quantised(x: torch.Tensor) -> torch.Tensor:
    """The activation rule, written out: per 32 values s = amax / 127 (fp32), q = round-half-even(x * (1 / s))
    -> q * s as float64."""
    m, k = x.shape
    xb = x.float().reshape(m, k // 32, 32)
    s = xb.abs().amax(-1, keepdim=True) / 127
    inv = torch.where(s != 0, 1 / s, torch.zeros_like(s))
    return (torch.round(xb * inv).double() * s.double()).reshape(m, k)


@pytest.mark.parametrize("kind", NEW)
def test_decoding_is_ggufs_dequantisation_bit_for_bit(kind: str) -> None:
    n, k = 24, 512
    raw = random_blocks(kind, n, k, seed=1)
    ours = kquant.dequantize(kquant.decode(raw, kind), kind)
    ref = dequantize(raw, GGMLQuantizationType[kind]).reshape(n, k)
    assert ours.dtype == ref.dtype == np.float32 and np.array_equal(ours.view(np.uint32), ref.view(np.uint32))
    levels = kquant.decode(raw, kind)["q"]
    assert levels.max() == {"Q4_K": 15, "Q6_K": 63, "IQ4_NL": 15, "IQ4_XS": 15}.get(kind, 31)  # the top level occurs


def bodies() -> list[str]:
    return list(LIB.bodies) if LIB is not None else []


@needs_kernel
@pytest.mark.parametrize("body", bodies())
@pytest.mark.parametrize("kind", NEW)
def test_the_kernels_view_of_the_weight_is_ggufs(kind: str, body: str) -> None:
    """x = 127 e_j (one row per input j): s = 1 and q = 127 e_j exactly, so output n of row j is 127 w[n, j] up to
    fp32 rounding of the scale products and the final sum; a wrong level, bit plane or scale is off by 127 d."""
    from verispec.kernels.q8act import Q8ActWeight

    n, k = 20, 256
    raw = random_blocks(kind, n, k, seed=2)
    w = gguf_weight(raw, kind, n, k)
    out = torch.empty(k, n)
    LIB.linear(Q8ActWeight(raw, kind, n, k).tiles, kind, n, k, 127 * torch.eye(k), out, body=body)
    bound = 127 * 2.0**-21 * (w.abs() + w.abs().amax(1, keepdim=True)).T
    assert ((out.double() - 127 * w.T).abs() <= bound).all()


@needs_kernel
@pytest.mark.parametrize("kind", ALL)
def test_products_are_gguf_weights_times_the_rounded_activations_on_every_body(kind: str) -> None:
    """N = 44 (a part-padded tile), 40 and 72 (odd tile counts: the AVX-512 body pairs tiles and takes the odd one
    alone); M covers every row-tile size of the bodies and their tails, and the AVX-512 body runs with pairs from
    1, 5 (its default) and 9 rows (8-lane tiles of up to 8 rows in one pass)."""
    from verispec.kernels.q8act import Q8ActWeight

    k = 512
    was = LIB.lib.vs_set_pair_rows(0)
    try:
        for n in (44, 40, 72):
            raw = random_blocks(kind, n, k, seed=n)
            packed, wd = Q8ActWeight(raw, kind, n, k), gguf_weight(raw, kind, n, k)
            for m in (1, 2, 3, 4, 5, 6, 7, 8, 9, 17):
                x = 3 * torch.randn(m, k, generator=torch.Generator().manual_seed(m))
                xq = quantised(x)
                ref, bound = xq @ wd.T, (xq.abs() @ wd.abs().T) * 2e-6 + 1e-6  # fp32 sums of K products
                outs = {}
                for body in LIB.bodies:
                    for pair_from in ((1, 5, 9) if body == "avx512-vnni" else (5,)):
                        LIB.lib.vs_set_pair_rows(pair_from)
                        outs[body, pair_from] = torch.empty(m, n)
                        LIB.linear(packed.tiles, packed.layout, n, k, x, outs[body, pair_from], body=body)
                assert ((outs["portable", 5].double() - ref).abs() <= bound).all(), (n, m)
                for key, out in outs.items():
                    assert torch.equal(out, outs["portable", 5]), (key, n, m)
    finally:
        LIB.lib.vs_set_pair_rows(was)


@needs_kernel
@pytest.mark.parametrize("body", bodies())
@pytest.mark.parametrize("kind", NEW)
def test_a_rows_output_does_not_depend_on_its_batch(kind: str, body: str) -> None:
    from verispec.kernels.q8act import Q8ActWeight

    n, k = 72, 256
    w = Q8ActWeight(random_blocks(kind, n, k, seed=5), kind, n, k)
    x = torch.randn(11, k, generator=torch.Generator().manual_seed(3))

    def run(rows: torch.Tensor) -> torch.Tensor:
        out = torch.empty(rows.shape[0], n)
        LIB.linear(w.tiles, w.layout, n, k, rows, out, body=body)
        return out

    full = run(x)
    for size in (1, 2, 3, 4, 8):
        assert torch.equal(torch.cat([run(x[i : i + size]) for i in range(0, 11, size)]), full), size
    other = x.clone()
    other[1:] = torch.randn(10, k, generator=torch.Generator().manual_seed(4)) * 50  # different neighbours
    assert torch.equal(run(other)[0], full[0])


@needs_kernel
@pytest.mark.parametrize("body", bodies())
def test_a_mixed_stacked_weight_is_each_parts_product_side_by_side(body: str) -> None:
    """q | k | v as Q4_K, Q5_0 and Q6_K rows (19 and 13: parts not whole tiles), with the fused RMSNorm and a
    residual: each part's columns are that part's own weight's product, bit for bit."""
    from verispec.kernels.q8act import Q8ActWeight

    k = 256
    parts = [(random_blocks("Q4_K", 40, k, 1), "Q4_K"), (random_blocks("Q5_0", 19, k, 2), "Q5_0"),
             (random_blocks("Q6_K", 13, k, 3), "Q6_K"), (random_blocks("Q6_K", 8, k, 4), "Q6_K")]
    fused = Q8ActWeight.stacked(parts, k)
    assert fused.kind == "Q4_K+Q5_0+Q6_K" and fused.shape == (80, k)
    g = torch.Generator().manual_seed(0)
    x, norm, res = torch.randn(5, k, generator=g), torch.rand(k, generator=g) + 0.5, torch.randn(5, 80, generator=g)
    got = torch.empty(5, 80)
    LIB.linear(fused.tiles, fused.layout, 80, k, x, got, body=body, norm=norm, eps=1e-5, residual=res)
    col = 0
    for raw, kind in parts:
        alone = Q8ActWeight(raw, kind, raw.shape[0], k)
        want = torch.empty(5, raw.shape[0])
        LIB.linear(alone.tiles, kind, raw.shape[0], k, x, want, body=body, norm=norm, eps=1e-5,
                   residual=res[:, col : col + raw.shape[0]].contiguous())
        assert torch.equal(got[:, col : col + raw.shape[0]], want), kind
        col += raw.shape[0]


@needs_kernel
def test_k_quants_need_whole_superblocks_and_bad_layouts_are_refused() -> None:
    from verispec.kernels.q8act import Q8ActWeight

    with pytest.raises(ValueError, match="Q4_K weight"):
        Q8ActWeight(np.zeros((8, 144), np.uint8), "Q4_K", 8, 288)  # K = 288 is not whole superblocks
    with pytest.raises(ValueError, match="unsupported block format 'Q3_K'"):
        Q8ActWeight(np.zeros((8, 110), np.uint8), "Q3_K", 8, 256)
    w = Q8ActWeight(random_blocks("Q6_K", 8, 256), "Q6_K", 8, 256)
    for bad in ([[7, 8, 0]], [[12, 8, 0]], [[7, 8, 0], [7, 1, 0]]):  # 8 rows for N = 9, no such kind, 9 rows
        with pytest.raises(RuntimeError, match="bad shape"):  # where K = 288 is not whole superblocks
            LIB.linear(w.tiles, torch.tensor(bad), 9, 256 if bad[0][0] != 7 or len(bad) == 1 else 288,
                       torch.ones(1, 288 if len(bad) == 2 else 256), torch.empty(1, 9))


# --- tiny GGUF files in each format ---

CFG = dict(model_type="llama", vocab_size=101, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512, rms_norm_eps=1e-5,
           rope_theta=10000.0, tie_word_embeddings=True)
# the mixed file: each tensor in its own format, as a Q4_K_M mixes Q4_K, Q6_K, Q8_0 and dense ones
MIXED = {"attn_q": "Q4_K", "attn_k": "Q5_K", "attn_v": "Q6_K", "attn_output": "Q5_0", "ffn_gate": "Q5_1",
         "ffn_up": "Q8_0", "ffn_down": "Q6_K", "output": "Q4_K", "token_embd": "Q8_0"}


def write_tiny(path, kind: str | None, formats: dict[str, str] = MIXED) -> None:
    """A tiny llama decoder (bench/synth_gguf.py's layout) whose matrices are random valid blocks of `kind`, or of
    `formats`' (tensor name -> format; kind None: then with an untied output head)."""
    from verispec.bench.synth_gguf import write_gguf

    cfg = dict(CFG, tie_word_embeddings=kind is not None)
    dense = path.with_suffix(".f32.gguf")
    write_gguf(dense, cfg, float_type="f32", seed=1)
    reader = GGUFReader(str(dense))
    w = GGUFWriter(str(path), "llama")
    for name, f in reader.fields.items():
        if not name.startswith("GGUF.") and name != "general.architecture":
            w.add_key_value(name, f.contents(), f.types[0], sub_type=f.types[-1] if len(f.types) > 1 else None)
    for i, t in enumerate(reader.tensors):
        n, k = (int(t.shape[1]), int(t.shape[0])) if len(t.shape) == 2 else (0, 0)
        if not n:
            w.add_tensor(t.name, np.asarray(t.data))
            continue
        fmt = kind or formats[t.name.split(".")[-2]]
        w.add_tensor(t.name, random_blocks(fmt, n, k, seed=i), raw_dtype=GGMLQuantizationType[fmt])
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()


def greedy(model, prompt: list[int], steps: int) -> list[int]:
    """Greedy tokens, each step a fresh forward over the whole sequence (no cache reuse: the plainest reference)."""
    from verispec.models.llama import Segment

    ids = list(prompt)
    for _ in range(steps):
        cache = model.new_cache(len(ids) + 1)
        slot = cache.allocate()
        with torch.inference_mode():
            logits = model(torch.tensor(ids), [Segment(slot, 0, len(ids))], cache, logits_indices=[len(ids) - 1]).logits
        ids.append(int(logits[-1].argmax()))
    return ids[len(prompt):]


class _RefLinear(torch.nn.Module):
    """A dense weight (gguf's dequantisation, through the dense loader) times the rounded activations, in float64."""

    def __init__(self, w: torch.Tensor) -> None:
        super().__init__()
        self.w = w.detach().double()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (quantised(x) @ self.w.T).to(x.dtype)


@needs_kernel
@pytest.mark.parametrize("kind", NEW + (None,))
def test_a_tiny_gguf_in_each_format_runs_on_its_blocks_and_decodes_as_the_reference(tmp_path, kind) -> None:
    from verispec.kernels.q8act import Q8ActWeight
    from verispec.models.loader import load_model
    from verispec.models.quantized import gguf_block_linears

    path = tmp_path / f"tiny-{kind or 'mixed'}.gguf"
    write_tiny(path, kind)
    assert gguf_block_linears(path)
    ours, _ = load_model(str(path), dtype="float32", quantization="gguf-q8act", progress=False)
    want = {"qkv": "+".join(dict.fromkeys((MIXED["attn_q"], MIXED["attn_k"], MIXED["attn_v"]))),
            "o": MIXED["attn_output"], "gate_up": "+".join((MIXED["ffn_gate"], MIXED["ffn_up"])),
            "down": MIXED["ffn_down"]} if kind is None else dict.fromkeys(("qkv", "o", "gate_up", "down"), kind)
    for layer in ours.layers:
        for name, fmt in want.items():
            assert isinstance(getattr(layer, name), Q8ActWeight) and getattr(layer, name).kind == fmt, name
    assert ours.head_weight.kind == (kind or MIXED["output"]) and ours.decoder_kernel is not None
    ref, _ = load_model(str(path), dtype="float32", progress=False)
    for layer in ref.layers:
        for name in want:
            w = getattr(layer, name)
            delattr(layer, name)
            setattr(layer, name, _RefLinear(w))
    ref.head_weight = _RefLinear(ref.output_weight())
    prompt = [1, 17, 42, 5, 99, 23]
    assert greedy(ours, prompt, 10) == greedy(ref, prompt, 10)


@needs_kernel
def test_a_mixed_files_rows_do_not_depend_on_their_batch_on_any_body(tmp_path) -> None:
    """The whole decoder (one kernel call) and the head of the mixed tiny file: a sequence's logits alone equal its
    logits beside another sequence, on every body, and every body gives the portable body's bits."""
    from verispec.models.llama import Segment
    from verispec.models.loader import load_model

    path = tmp_path / "tiny-mixed.gguf"
    write_tiny(path, None)
    model, _ = load_model(str(path), dtype="float32", quantization="gguf-q8act", progress=False)
    a, b = torch.tensor([3, 14, 15, 92, 65, 35, 89]), torch.tensor([27, 18, 28])
    runs = {}
    for body in LIB.bodies:
        with LIB.running(body), torch.inference_mode():
            cache = model.new_cache(16, num_slots=2)
            s0, s1 = cache.allocate(), cache.allocate()
            both = model(torch.cat([a, b]), [Segment(s0, 0, 7), Segment(s1, 0, 3)], cache,
                         logits_indices=range(10)).logits
            alone_cache = model.new_cache(16)
            s = alone_cache.allocate()
            alone = model(a, [Segment(s, 0, 7)], alone_cache, logits_indices=range(7)).logits
        assert torch.equal(both[:7], alone), body
        runs[body] = both
    for body, logits in runs.items():
        assert torch.equal(logits, runs["portable"]), body


def test_formats_without_a_body_are_reported_with_their_cost(tmp_path, capsys) -> None:
    from verispec.models.quantized import dense_fallbacks, fallback_note, gguf_block_linears, report_fallbacks

    path = tmp_path / "q3k.gguf"
    w = GGUFWriter(str(path), "llama")
    raw = np.random.default_rng(0).integers(0, 256, (16, 110), dtype=np.uint8)  # Q3_K: 110 bytes per 256
    w.add_tensor("blk.0.attn_q.weight", raw, raw_dtype=GGMLQuantizationType.Q3_K)
    w.add_tensor("blk.0.ffn_down.weight", random_blocks("Q6_K", 16, 256), raw_dtype=GGMLQuantizationType.Q6_K)
    w.add_tensor("output.weight", np.zeros((16, 256), np.float16))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    assert dense_fallbacks(path) == {"Q3_K": 1}  # F16 is dense already; Q6_K has a body
    note = fallback_note({"Q3_K": 1})
    assert "1 Q3_K tensor (3.44 bits/weight: dense bf16 reads x4.7 the bytes)" in note
    report_fallbacks.cache_clear()
    assert not gguf_block_linears(path)  # not every linear of layer 0 has a body (nor exists)
    assert "Q3_K" in capsys.readouterr().err


def test_doctor_reports_each_format_and_the_ones_without_a_body(tmp_path) -> None:
    from verispec.doctor.run import Ctx, DoctorOptions, _target
    from verispec.models.quantized import gguf_block_linears

    path = tmp_path / "tiny-q3k.gguf"
    write_tiny(path, None, dict(MIXED, ffn_down="Q3_K"))
    (check,) = _target(Ctx(DoctorOptions(model=str(path))))
    assert check.ok and "Q3_K x2 (dense)" in check.detail and "Q6_K x2," in check.detail, check.detail
    assert "no native CPU kernel body for 2 Q3_K tensors (3.44 bits/weight" in check.detail
    assert not gguf_block_linears(path)  # ffn_down has no body: dtype auto does not offer gguf-q8act
    mixed = tmp_path / "tiny-mixed.gguf"
    write_tiny(mixed, None)
    (check,) = _target(Ctx(DoctorOptions(model=str(mixed))))
    assert check.ok and check.detail.endswith("every quantised one native"), check.detail


def test_candidacy_follows_the_files_formats_and_a_missing_compiler(tmp_path, monkeypatch) -> None:
    from verispec.execution.paths import candidates
    from verispec.kernels import cpu_kernels

    native = cpu_kernels.fast_kernel_available()[0]
    names = [p.name for p in candidates("cpu", False, gguf_blocks=True)]  # e.g. a Q8_0 or Q4_K_M file
    assert "gguf-int4" not in names and ("gguf-q8act" in names) == native
    assert "gguf-q8act" not in [p.name for p in candidates("cpu", True, gguf_blocks=False)]
    monkeypatch.setenv("CC", "false")  # a "compiler" that fails every build: the path is not offered
    with pytest.raises(KernelUnavailable, match="could not build"):
        cpu_kernels.load.__wrapped__(cache=tmp_path)
    monkeypatch.setattr(cpu_kernels, "fast_kernel_available", lambda: (False, "no compiler"))
    assert "gguf-q8act" not in [p.name for p in candidates("cpu", False, gguf_blocks=True)]


@pytest.mark.parametrize("kind", ["Q4_1", "Q8_0", "Q5_0", "Q4_K", "Q6_K", "IQ4_XS"])
def test_packing_in_pieces_equals_packing_whole(kind: str, monkeypatch) -> None:
    """A head of ~150k rows is repacked PACK_ROWS rows at a time (its intermediates would otherwise be several
    times its size): the pieces, including a short last one, make exactly the whole's tiles."""
    from verispec.kernels import q8act

    elems = 256 if kind in kquant.FILE_BLOCKS and kquant.FILE_BLOCKS[kind][0] == 256 else 32
    raw = (random_blocks(kind, 203, 2 * elems, seed=3) if kind not in q8act.BLOCK_BYTES else
           np.random.default_rng(3).integers(0, 256, (203, 2 * q8act.BLOCK_BYTES[kind]), dtype=np.uint8))
    whole = q8act.tile_rows(raw, kind) if kind in q8act.BLOCK_BYTES else kquant.pack(raw, kind)
    monkeypatch.setattr(q8act, "PACK_ROWS", 64)
    assert np.array_equal(q8act.pack_rows(raw, kind), whole)


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_K", "Q6_K"])
def test_pieces_are_bounded_by_weights_not_only_rows(kind: str, monkeypatch) -> None:
    """A piece holds at most PACK_VALUES weights (decoding holds several bytes per weight): long rows come in fewer
    rows per piece, each piece a multiple of 8 rows, and the tiles still equal the whole's."""
    from verispec.kernels import q8act

    elems = 256 if kind in kquant.FILE_BLOCKS else 32
    width = 4 * elems  # weights per row
    raw = (random_blocks(kind, 203, width, seed=5) if kind not in q8act.BLOCK_BYTES else
           np.random.default_rng(5).integers(0, 256, (203, 4 * q8act.BLOCK_BYTES[kind]), dtype=np.uint8))
    whole = q8act.tile_rows(raw, kind) if kind in q8act.BLOCK_BYTES else kquant.pack(raw, kind)

    class Source:  # a RowSource that records the pieces asked for
        shape, ndim, asked = raw.shape, 2, []

        def rows(self, lo: int, hi: int) -> np.ndarray:
            self.asked.append(hi - lo)
            return raw[lo:hi]

    monkeypatch.setattr(q8act, "PACK_VALUES", 20 * width)  # 20 rows' weights: pieces of 16 rows
    src = Source()
    assert np.array_equal(q8act.pack_rows(src, kind), whole)
    assert max(src.asked) == 16 and sum(src.asked) == 203 and all(n % 8 == 0 for n in src.asked[:-1])
