"""The decode attention's launch defaults (plugins/_attention_decode.py reads them, and
plugins/tuning.py validates a tuned table's overrides against their names)."""

# Tile and pipeline choice for the split kernel, from the H200 sweep (bench/kernels_sweep.py):
# 128-key tiles for long contexts, 64 for short ones (a 512-slot ring: fewer idle lanes), and
# 2 programs an SM in whole waves (wave_fit, below), FP8 caches too.
# Short caches (a sliding layer's ring, a full layer's table of <= 2K slots: batch-1 decode
# of the engine bench's layers) take shorter splits and 2 stages: 7.3 us instead of 11.5 for
# a 512-slot ring at batch 1 (H200 sweep, bench/decode_sweep.py, 2026-11-29).
# Splits of one 128-key tile where the grid allows (min_split 128: at batch 1 with an FP8
# cache, caches of up to 50 tiles), so that the whole split is read before the wait when it
# is launched early, and a combine of one warp a 16 head dims: in the engine bench's decode
# chain the full MoE layer (2K context) -4 us, the sliding ones -1 (H200, 2026-11-30, commit
# 84866d1; docs/benchmarks-history.md "Decode attention").
# fp8_operands: how an FP8 cache's codes become the MMA's operands (plugins/_attention_tiles.py
# FP8_SETTINGS: 1 Triton's cast to BF16, 2 FP16 by cvt, 3 FP16 by bit operations, 4 K by cvt
# and V by bits; the full layers' prefill takes the same). sm_90 SASS of the batch-1 loop at
# 128K (a 128-key tile, 4 warps, per thread; block-table shifts in all): 1675 / 669 / 925 /
# 797 instructions, of them 384 / 128 / 0 / 64 conversions, against the BF16 cache's 748
# (before the shifts: FP8 2009, BF16 989). 4 until the H200 A/B (bench/decode_fp8kv.py)
# picks: it splits the work between the conversion and the integer units.
DECODE_CONFIG = dict(BLOCK_N=128, BLOCK_N_SHORT=64, short_capacity=2048, num_warps=4,
                     num_stages=3, num_stages_short=2, programs_per_sm=2, programs_per_sm_fp8=2,
                     min_split=128, min_split_short=64, combine_block_d=16, combine_warps=1,
                     fp8_operands=4, wave_fit=1)
# wave_fit: splits so that the grid is at most programs_per_sm programs an SM (num_splits),
# not at least. At Beam's heads over a long cache the split kernel holds 232 (BF16) / 254
# (FP8) registers a thread (sm_90 build, ptxas): 2 programs of 128 threads an SM, so the
# earlier 3 FP8 programs an SM ran as 1.5 waves. H200, bench/decode_fp8kv.py (2026-12-03,
# fa9a308): whole waves at 2 an SM, FP8 cache B=1 128K 118.7 -> 93.9 us, 1M 844.2 -> 660.6,
# B=8 32K 198.9 -> 175.0; BF16 B=8 8K 86.1 -> 66.4, 32K 319.6 -> 244.1; B=64 and the
# sliding rings unchanged.
# the settings that are tile widths (tl.arange's): powers of two
DECODE_POW2 = ("BLOCK_N", "BLOCK_N_SHORT", "combine_block_d")
# fp8_operands' values: setting -> (K's, V's) operand form (_attention_tiles: 1 CAST, 2 CVT,
# 3 BITS), and their names (bench/decode_fp8kv.py, docs)
FP8_FORMS = {1: (1, 1), 2: (2, 2), 3: (3, 3), 4: (2, 3)}
FP8_SETTINGS = {"cast": 1, "cvt": 2, "bits": 3, "cvt_k_bits_v": 4}
