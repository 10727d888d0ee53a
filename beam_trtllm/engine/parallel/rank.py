"""What a rank of a parallel engine adds to the forward (`BeamModel(parallel=ParallelRank)`).

- Row-parallel Linears (o_proj, dense down_proj, split by heads / MLP columns): each rank's
  partial product in FP32, one all-reduce per sublayer, handed to the boundary's add_rmsnorm
  as a single FP32 partial `[1, T, H]`, which it rounds once: the sandwich-norm boundary is
  where the all-reduce lands, and the output is the unsplit GEMM's up to FP32 summation order.
- MoE (expert parallel, tokens dispatched by allgather, combined by all-reduce or
  reduce-scatter): the router (FP32, replicated) routes this rank's tokens; each rank runs the
  (token, slot) pairs whose expert it holds, one pair a row, and writes their unweighted
  outputs into a per-slot tensor `[T, k, H]` that is zero elsewhere. With moe_tp = 1 every
  element is one rank's, so summing it over the ranks is exact in any dtype and the boundary
  combines the slots exactly as the single-rank engine does. With moe_tp > 1 each element is a
  sum of partial down projections, summed in FP32. Steps of >= 1,024 tokens (where the
  single-rank engine uses the MoE op's own combine) exchange FP32 weighted sums `[T, H]`
  instead of the k-times-larger per-slot tensor.
- Attention DP: each rank's tokens are gathered (padded to the step's largest count, every
  rank's count exchanged once a step), the pair outputs of the union reduce-scattered back.
  A rank with nothing scheduled while another has runs a one-token padding forward (reads no
  cache, writes nowhere, like a CUDA-graph padding row), so every rank joins the collectives.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from ..types import EngineError
from .comm import Comm
from .mapping import ParallelMapping


class ParallelRank:
    def __init__(self, mapping: ParallelMapping, comm: Comm, cfg):
        self.mapping, self.comm = mapping, comm
        self.experts = mapping.experts(cfg)
        self.splits_attention = mapping.attn_tp > 1
        self._counts_ready = False

    # ------------------------------------------------------------------ steps
    def begin_forward(self, tokens: int) -> None:
        if self.mapping.attention_dp and not self._counts_ready:
            self.comm.exchange_counts(tokens)
        self._counts_ready = False

    def idle_step(self, model) -> None:
        """Attention DP, nothing scheduled here: join the step if any other rank runs one."""
        if not self.mapping.attention_dp:
            return
        counts = self.comm.exchange_counts(0)
        if max(counts) == 0:
            return
        self._counts_ready = True
        model.forward(padding_step(model.kv, model.embed.device))

    def any_unfinished(self, engine) -> bool:
        """Whether any rank still has work (attention DP ranks step until all are done)."""
        return self.comm.any(engine.has_unfinished())

    # ------------------------------------------------------------------ row-parallel Linear
    def row_linear(self, x: torch.Tensor, segments, is_codes: bool) -> torch.Tensor:
        """This rank's FP32 partial of a row-parallel Linear, all-reduced: [1, T, N]."""
        parts = []
        for fmt, w in segments:
            if fmt == "bf16":
                parts.append(_fp32_linear(x, w["weight"]))
            elif fmt == "fp8":  # on FP8 codes (the attention's, or quantized here as the op
                # would quantize them itself), with an FP32 output
                from ...quant_formats import quantize_fp8_activation

                codes = x if is_codes else quantize_fp8_activation(x, w["input_scale"])
                parts.append(model_ops().linear_fp8(codes, w["weight"], w["weight_scale"],
                                                    w["input_scale"], torch.float32))
            else:  # other formats round their output once on each rank (no FP32 output)
                from ..model import _linear

                parts.append(_linear(x, [(fmt, w)], None, x.dtype).float())
        y = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return self.comm.all_reduce(y.contiguous()).unsqueeze(0)

    # ------------------------------------------------------------------ MoE
    def moe(self, model, i: int, layer: dict, x, xq, ids, weights, per_slot: bool):
        """-> (y, y_weights) as BeamModel._ffn returns them."""
        dp, t, own_weights = self.mapping.attention_dp, x.shape[0], weights
        if dp:  # the path is the union's, so that every rank runs the same collectives
            from plugins.add_rmsnorm import adds_partials

            per_slot = adds_partials(max(self.comm.counts or [t]))
            x, xq, ids, weights = self._gather(x, xq, ids, weights)
        slots = self._local_pairs(model, i, layer, x, xq, ids)
        if per_slot:  # exact with moe_tp = 1 (one rank's value per element); else FP32 sums
            y = slots if self.mapping.moe_tp == 1 else slots.float()
            y = self.comm.reduce_scatter(y) if dp else self.comm.all_reduce(y)
            return y[:t].to(model.act_dtype).transpose(0, 1), own_weights
        total = torch.zeros(slots.shape[0], slots.shape[2], dtype=torch.float32, device=x.device)
        for s in range(slots.shape[1]):  # slot order, as the combine kernel sums
            total += slots[:, s].float() * weights[:, s:s + 1]
        total = self.comm.reduce_scatter(total) if dp else self.comm.all_reduce(total)
        return (total[:t] * model.cfg.routed_scaling_factor).to(model.act_dtype), None

    def _local_pairs(self, model, i, layer, x, xq, ids) -> torch.Tensor:
        """Unweighted outputs of the (token, slot) pairs routed to this rank's experts, one
        pair a row, in a per-slot tensor [T, k, H] that is zero elsewhere."""
        e0, n = self.experts.start, len(self.experts)
        mine = (ids >= e0) & (ids < e0 + n)
        tok, slot = mine.nonzero(as_tuple=True)
        out = torch.zeros((*ids.shape, x.shape[1]), dtype=model.act_dtype, device=x.device)
        if tok.numel() == 0:
            return out
        local_ids = (ids[tok, slot] - e0).to(torch.int32).unsqueeze(1)
        ones = torch.ones(local_ids.shape, dtype=torch.float32, device=x.device)
        xq_p = None if xq is None else _rows(xq, tok)
        y = model._experts(i, layer, x.index_select(0, tok), xq_p, local_ids, ones, True)
        out[tok, slot] = y[:, 0].to(out.dtype)
        return out

    def _gather(self, x, xq, ids, weights):
        counts = self.comm.counts
        if counts is None:
            raise EngineError("attention DP: the step's token counts were not exchanged")
        tmax, own = max(counts), counts[self.mapping.rank]
        ids = ids.clone()
        ids[own:] = -1  # a padding row (an idle rank's) routes nowhere
        x, ids, weights = (_pad(a, tmax) for a in (x, ids, weights))
        gathered = [self.comm.all_gather(a) for a in (x, ids, weights)]
        xq_all = None
        if xq is not None:
            xq_all = self.comm.all_gather(_pad(xq.view(torch.uint8), tmax)).view(xq.dtype)
        return gathered[0], xq_all, gathered[1], gathered[2]


def _pad(t: torch.Tensor, rows: int) -> torch.Tensor:
    if t.shape[0] == rows:
        return t.contiguous()
    out = torch.zeros((rows, *t.shape[1:]), dtype=t.dtype, device=t.device)
    out[:t.shape[0]] = t[:rows]
    return out


def _rows(t: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    if t.dtype == torch.float8_e4m3fn:  # index_select has no float8 kernel everywhere
        return t.view(torch.uint8).index_select(0, index).view(t.dtype)
    return t.index_select(0, index)


def _fp32_linear(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    """x @ w.T summed in FP32, not rounded (the partial of a row-parallel Linear)."""
    if x.is_cuda and x.dtype != torch.float32:
        return torch.mm(x.reshape(-1, x.shape[-1]), w.t(), out_dtype=torch.float32)
    return F.linear(x.float(), w.float())


def model_ops():
    import plugins  # noqa: F401

    return torch.ops.beam


def padding_step(kv, device):
    """One token at position 0 that reads no cache and writes nowhere (slot -1, the rings'
    scratch row): an idle attention-DP rank's share of a step."""
    from ..model import StepInputs

    def ints(*values, dtype=torch.int32):
        return torch.tensor(values, dtype=dtype, device=device)

    empty = torch.zeros(0, dtype=torch.int64, device=device)
    return StepInputs(input_ids=ints(0, dtype=torch.int64), positions=ints(0, dtype=torch.int64),
                      cu_seqlens=ints(0, 1), q_start=ints(0), hist_full=ints(0),
                      hist_sliding=ints(0), block_table=ints(0).view(1, 1),
                      ring_index=ints(kv.scratch_row).view(1, 1),
                      slot_full=ints(-1, dtype=torch.int64),
                      slot_sliding=ints(-1, dtype=torch.int64),
                      write_rows=empty, write_slots=empty, restore_rows=empty, restore_slots=empty,
                      logits_rows=ints(0, dtype=torch.int64))
