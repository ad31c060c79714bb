"""Kernels of the top-2 gate with expert capacity (GShard's, as DeepSpeed's TopKGate computes it).

Forward: one program walks the tokens in blocks, in order, so the capacity places (a token's rank
among the tokens before it that chose the same expert: a scan down the tokens) come from running
per-expert counts, and the l_aux column sums add blocks in a fixed order (deterministic). A second
walk applies the capacity (the second choices' places start after all first choices) and
normalises the kept gates. Backward: one program per token block (rows are independent).
"""
from __future__ import annotations

import triton
import triton.language as tl

from ditron_ep.language.registry import register_device_function, register_kernel

EPS = tl.constexpr(1.1920928955078125e-07)  # torch.finfo(torch.float32).eps: DeepSpeed's clamp of the gate sum


@register_device_function
@triton.jit
def _softmax_rows(logits_ptr, o_s, o_e, m_s, m_e, E):
    """The rows' softmax over the experts ([BLOCK_S, BLOCK_E], 0 outside), and the logits read
    (-inf in columns past E)."""
    b_l = tl.load(logits_ptr + o_s[:, None].to(tl.int64) * E + o_e[None, :], mask=m_s[:, None] & m_e[None, :],
                  other=0.0)  # [BLOCK_S, BLOCK_E]
    b_l = tl.where(m_e[None, :], b_l, float("-inf"))
    b_p = tl.exp(b_l - tl.max(b_l, axis=1)[:, None])
    b_p = b_p / tl.sum(b_p, axis=1)[:, None]
    return b_p, b_l


@triton.jit
def top2_gate_fwd_kernel(
    logits_ptr,    # fp32 (S, E)
    noise_ptr,     # fp32 (S, E): added to the logits for the second choice (HAS_NOISE)
    topk_ptr,      # i32 (S, 2) out: expert of each route, -1 where the capacity dropped it
    gates_ptr,     # fp32 (S, 2) out: kept gates over their sum (clamped at EPS)
    place_ptr,     # i32 (S, 2) scratch: the routes' capacity places
    counts_ptr,    # i64 (E,) out: first + second choices per expert, before drops (exp_counts)
    first_ptr,     # fp32 (E,) out: first choices per expert (l_aux's ce * S; kept for the backward)
    l_aux_ptr,     # fp32 (1,) out
    S, E, capacity,
    HAS_NOISE: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr,
):
    o_e = tl.arange(0, BLOCK_E)
    m_e = o_e < E
    run1 = tl.zeros((BLOCK_E,), dtype=tl.int32)  # first choices per expert so far
    run2 = tl.zeros((BLOCK_E,), dtype=tl.int32)  # second choices per expert so far
    prob_sum = tl.zeros((BLOCK_E,), dtype=tl.float32)
    for s0 in range(0, S, BLOCK_S):
        o_s = s0 + tl.arange(0, BLOCK_S)
        m_s = o_s < S
        b_p, b_l = _softmax_rows(logits_ptr, o_s, o_e, m_s, m_e, E)
        i_first = tl.argmax(b_p, axis=1, tie_break_left=True)  # [BLOCK_S]
        if HAS_NOISE:
            b_l += tl.load(noise_ptr + o_s[:, None].to(tl.int64) * E + o_e[None, :],
                           mask=m_s[:, None] & m_e[None, :], other=0.0)
        is1 = o_e[None, :] == i_first[:, None]
        i_second = tl.argmax(tl.where(is1, float("-inf"), b_l), axis=1, tie_break_left=True)
        is2 = o_e[None, :] == i_second[:, None]
        b_one1 = (is1 & m_s[:, None]).to(tl.int32)  # [BLOCK_S, BLOCK_E]
        b_one2 = (is2 & m_s[:, None]).to(tl.int32)
        # places: the expert's routes before this one (earlier blocks, then within the block)
        place1 = tl.sum(tl.where(is1, run1[None, :] + tl.cumsum(b_one1, axis=0) - 1, 0), axis=1)
        place2 = tl.sum(tl.where(is2, run2[None, :] + tl.cumsum(b_one2, axis=0) - 1, 0), axis=1)
        run1 += tl.sum(b_one1, axis=0)
        run2 += tl.sum(b_one2, axis=0)
        prob_sum += tl.sum(tl.where(m_s[:, None], b_p, 0.0), axis=0)
        p_first = tl.sum(tl.where(is1, b_p, 0.0), axis=1)
        p_second = tl.sum(tl.where(is2, b_p, 0.0), axis=1)
        tl.store(topk_ptr + o_s * 2, i_first.to(tl.int32), mask=m_s)
        tl.store(topk_ptr + o_s * 2 + 1, i_second.to(tl.int32), mask=m_s)
        tl.store(place_ptr + o_s * 2, place1, mask=m_s)
        tl.store(place_ptr + o_s * 2 + 1, place2, mask=m_s)
        tl.store(gates_ptr + o_s * 2, p_first, mask=m_s)
        tl.store(gates_ptr + o_s * 2 + 1, p_second, mask=m_s)
    # the second walk reads rows other threads of this program stored
    tl.debug_barrier()
    for s0 in range(0, S, BLOCK_S):
        o_s = s0 + tl.arange(0, BLOCK_S)
        m_s = o_s < S
        i_first = tl.load(topk_ptr + o_s * 2, mask=m_s, other=0)
        i_second = tl.load(topk_ptr + o_s * 2 + 1, mask=m_s, other=0)
        # second choices are placed after every first choice of their expert
        after = tl.sum(tl.where(o_e[None, :] == i_second[:, None], run1[None, :], 0), axis=1)
        kept1 = tl.load(place_ptr + o_s * 2, mask=m_s, other=0) < capacity
        kept2 = tl.load(place_ptr + o_s * 2 + 1, mask=m_s, other=0) + after < capacity
        g1 = tl.where(kept1, tl.load(gates_ptr + o_s * 2, mask=m_s, other=0.0), 0.0)
        g2 = tl.where(kept2, tl.load(gates_ptr + o_s * 2 + 1, mask=m_s, other=0.0), 0.0)
        denom = tl.maximum(g1 + g2, EPS)
        tl.store(topk_ptr + o_s * 2, tl.where(kept1, i_first, -1), mask=m_s)
        tl.store(topk_ptr + o_s * 2 + 1, tl.where(kept2, i_second, -1), mask=m_s)
        tl.store(gates_ptr + o_s * 2, g1 / denom, mask=m_s)
        tl.store(gates_ptr + o_s * 2 + 1, g2 / denom, mask=m_s)
    tl.store(counts_ptr + o_e, (run1 + run2).to(tl.int64), mask=m_e)
    first = run1.to(tl.float32)
    tl.store(first_ptr + o_e, first, mask=m_e)
    # l_aux = mean_e(mean_s(probs) * mean_s(first choices)) * E * E
    s_f = S * 1.0  # (not .to(): Triton makes an int argument of 1 a constant)
    e_f = E * 1.0
    tl.store(l_aux_ptr, tl.sum((prob_sum / s_f) * (first / s_f), axis=0) / e_f * e_f * e_f)


@triton.jit
def top2_gate_bwd_kernel(
    logits_ptr,    # fp32 (S, E)
    topk_ptr,      # i32 (S, 2): the forward's routes (-1: dropped)
    d_gates_ptr,   # fp32 (S, 2): gradient of the gates (HAS_D_GATES)
    first_ptr,     # fp32 (E,): first choices per expert
    d_l_aux_ptr,   # fp32 (1,): gradient of l_aux (HAS_D_L_AUX)
    d_logits_ptr,  # fp32 (S, E) out
    S, E,
    HAS_D_GATES: tl.constexpr, HAS_D_L_AUX: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_E: tl.constexpr,
):
    o_s = tl.program_id(0) * BLOCK_S + tl.arange(0, BLOCK_S)
    o_e = tl.arange(0, BLOCK_E)
    m_s = o_s < S
    m_e = o_e < E
    b_p, _ = _softmax_rows(logits_ptr, o_s, o_e, m_s, m_e, E)
    b_dp = tl.zeros((BLOCK_S, BLOCK_E), dtype=tl.float32)
    if HAS_D_GATES:
        i_first = tl.load(topk_ptr + o_s * 2, mask=m_s, other=-1)
        i_second = tl.load(topk_ptr + o_s * 2 + 1, mask=m_s, other=-1)
        is1 = o_e[None, :] == i_first[:, None]  # never true for a dropped route (-1)
        is2 = o_e[None, :] == i_second[:, None]
        g1 = tl.sum(tl.where(is1, b_p, 0.0), axis=1)
        g2 = tl.sum(tl.where(is2, b_p, 0.0), axis=1)
        dg1 = tl.load(d_gates_ptr + o_s * 2, mask=m_s, other=0.0)
        dg2 = tl.load(d_gates_ptr + o_s * 2 + 1, mask=m_s, other=0.0)
        total = g1 + g2
        denom = tl.maximum(total, EPS)
        # g1 / denom and g2 / denom; the clamp passes no gradient to the sum below EPS
        through = tl.where(total >= EPS, (dg1 * g1 + dg2 * g2) / (denom * denom), 0.0)
        b_dp += tl.where(is1, (dg1 / denom - through)[:, None], 0.0)
        b_dp += tl.where(is2, (dg2 / denom - through)[:, None], 0.0)
    if HAS_D_L_AUX:
        s_f = S * 1.0
        e_f = E * 1.0
        first = tl.load(first_ptr + o_e, mask=m_e, other=0.0)
        b_dp += (tl.load(d_l_aux_ptr) * e_f * first / (s_f * s_f))[None, :]
    b_dl = b_p * (b_dp - tl.sum(b_p * b_dp, axis=1)[:, None])  # the softmax's backward
    tl.store(d_logits_ptr + o_s[:, None].to(tl.int64) * E + o_e[None, :], b_dl, mask=m_s[:, None] & m_e[None, :])


_FWD_SIG = {"logits_ptr": "*fp32", "noise_ptr": "*fp32", "topk_ptr": "*i32", "gates_ptr": "*fp32",
            "place_ptr": "*i32", "counts_ptr": "*i64", "first_ptr": "*fp32", "l_aux_ptr": "*fp32",
            "S": "i32", "E": "i32", "capacity": "i32"}
register_kernel(top2_gate_fwd_kernel, _FWD_SIG, {"HAS_NOISE": False, "BLOCK_S": 128, "BLOCK_E": 16}, label="E16")
register_kernel(top2_gate_fwd_kernel, _FWD_SIG, {"HAS_NOISE": True, "BLOCK_S": 32, "BLOCK_E": 64}, label="E64-noise")
register_kernel(top2_gate_bwd_kernel, {"logits_ptr": "*fp32", "topk_ptr": "*i32", "d_gates_ptr": "*fp32",
                                       "first_ptr": "*fp32", "d_l_aux_ptr": "*fp32", "d_logits_ptr": "*fp32",
                                       "S": "i32", "E": "i32"},
                {"HAS_D_GATES": True, "HAS_D_L_AUX": True, "BLOCK_S": 64, "BLOCK_E": 16}, label="E16")
