"""EP dispatch/combine on emulated ranks: exact permutation, combine vs float64, determinism,
graph mode, gradients, bad input, and no torch.distributed collective on the data path."""
from __future__ import annotations


import pytest
import rank_fns_ep as fns
import torch

from ditron_ep.ops.ep.layout_replay import LENDABLE_COPIES

CASES = [  # (W, tokens per rank, H, E, K, dtype, routing, drop_prob)
    (2, [20, 13], 64, 8, 2, torch.float32, "uniform", 0.0),
    (2, [9, 17], 100, 4, 1, torch.bfloat16, "zipf", 0.0),            # H not a block multiple, K = 1
    (3, [11, 0, 7], 48, 6, 3, torch.float16, "uniform", 0.2),        # empty rank, dropped slots
    (3, [10, 10, 10], 32, 9, 2, torch.float32, "one_expert", 0.0),   # every token to expert 0
    (4, [8, 5, 12, 3], 40, 8, 4, torch.bfloat16, "one_rank", 0.0),   # every token to rank 0
    (4, [6, 6, 6, 6], 32, 256, 8, torch.float32, "zipf", 0.1),       # E = 256, K = 8
    (4, [17, 1, 0, 33], 72, 12, 3, torch.float32, "uniform", 0.0),   # T > block, ragged
]


@pytest.mark.parametrize("W,tokens,H,E,K,dtype,kind,drop", CASES,
                         ids=[f"W{c[0]}-T{max(c[1])}-H{c[2]}-E{c[3]}-K{c[4]}-{str(c[5])[6:]}-{c[6]}" for c in CASES])
def test_dispatch_combine(emulated_cluster, W, tokens, H, E, K, dtype, kind, drop):
    reports = emulated_cluster(W).run(fns.dispatch_combine_case, tokens, H, E, K, dtype, kind, 1, drop)
    for rank, rep in enumerate(reports):
        assert rep["dispatch_exact"], f"rank {rank}: received rows differ from the reference permutation {rep['rows']}"
        assert rep["counts_ok"] and rep["offsets_ok"], f"rank {rank}: per-expert counts/offsets (device or host) wrong"
        assert rep["recv_weights_ok"], f"rank {rank}: carried weights wrong"
        assert rep["combine_ok"], f"rank {rank}: combine off the float64 oracle by {rep['combine_max_abs']}"
        assert rep["rerun_bitwise"], f"rank {rank}: two runs differ"
        assert rep["graph_bitwise"], f"rank {rank}: graph mode differs from default mode"
        assert rep["graph_rows_cap"] == W * max(max(tokens), 1) * K
        assert rep["stamped"]["dispatch"] and rep["stamped"]["combine"], f"rank {rank}: signal words {rep['stamped']}"


def test_grid_chunk_and_slice_sizes_do_not_change_bits(emulated_cluster):
    base = emulated_cluster(3).run(fns.dispatch_combine_case, [13, 6, 9], 40, 6, 2, torch.float32, "zipf", 3)
    assert base[0]["n_slices"] == 1
    # (programs, rows per chunk, columns per step, column slices asked for -> slices used)
    for programs, block, block_h, slices, used in [(1, 16, None, None, 1), (5, 4, None, None, 1),
                                                   (3, 4, 16, None, 3), (2, 8, 16, 2, 2)]:
        other = emulated_cluster(3).run(fns.dispatch_combine_case, [13, 6, 9], 40, 6, 2, torch.float32, "zipf",
                                        3, 0.0, None, programs, block, block_h, slices)
        for a, b in zip(base, other):
            assert b["n_slices"] == used
            assert b["dispatch_exact"] and b["combine_ok"] and b["graph_bitwise"]
            assert b["stamped"]["dispatch"] and b["stamped"]["combine"], b["stamped"]
            assert a["out_bytes"] == b["out_bytes"], "combine output bits depend on the grid or the slicing"


def test_buffer_sized_past_the_call_gives_the_same_bits(emulated_cluster):
    """A buffer sized for more tokens than the call (a prefill-sized buffer at decode) walks only
    the chunks below the largest T of any rank, split into more column slices when the buffer's
    own would leave programs idle, and returns the same bits."""
    args = ([13, 0, 9], 40, 6, 2, torch.float32, "uniform", 5)
    base = emulated_cluster(3).run(fns.dispatch_combine_case, *args)
    # (max_tokens, programs, rows per chunk, columns per step) -> the buffer's own column slices
    for max_tokens, block, block_h, slices in [(70, 16, None, 1),   # 5 chunks, the call uses 1
                                               (70, 4, 16, 2)]:     # 18 chunks of 2 slices; the call: 4 of 3
        big = emulated_cluster(3).run(fns.dispatch_combine_case, *args, 0.0, max_tokens, None, block, block_h)
        for rank, (a, b) in enumerate(zip(base, big)):
            assert b["n_slices"] == slices
            # the call's slices: 1 for the buffer of 70 rows of 16; 3 (the columns' blocks) for 18 chunks of 4
            assert b["stamped"] == {"n_sl": {16: 1, 4: 3}[block], "dispatch": True, "combine": True}, \
                f"rank {rank}: signal words of the call's chunks and slices: {b['stamped']}"
            assert b["dispatch_exact"] and b["combine_ok"] and b["rerun_bitwise"] and b["graph_bitwise"], \
                f"rank {rank}, buffer of {max_tokens} tokens"
            assert b["graph_rows_cap"] == 3 * max_tokens * 2
            assert a["out_bytes"] == b["out_bytes"], f"rank {rank}: combine bits depend on the buffer size"


@pytest.mark.parametrize("dtype,sync,block_h", [(torch.float32, True, None), (torch.bfloat16, False, None),
                                                 (torch.float32, True, 16)], ids=["fp32", "bf16-graph", "fp32-sliced"])
def test_gradients(emulated_cluster, dtype, sync, block_h):
    """Against float64; the default-mode cases with every torch.empty NaN-filled (outputs the kernels
    must write whole: the combine backward's rows)."""
    reports = emulated_cluster(3).run(fns.gradient_case, [9, 4, 0], 32, 6, 2, dtype, "uniform", 2, sync, block_h,
                                      poison=sync)
    for rank, rep in enumerate(reports):
        assert rep["dx_ok"], f"rank {rank}: dispatch backward off by {rep['dx_max']}"
        assert rep["dw_ok"], f"rank {rank}: combine weight gradient off by {rep['dw_max']}"
        assert rep["dw_dropped_zero"]


@pytest.mark.parametrize("W", [2, 3])
def test_layout_exchange_alternates_landing_halves(emulated_cluster, W):
    """The counts exchange has no entry barrier: it relies on alternate exchanges writing
    alternate halves of the landing buffer (ep_layout_kernel)."""
    calls = 4
    for rank, rep in enumerate(emulated_cluster(W).run(fns.layout_halves_case, W, 4 * W, 3, calls)):
        assert all(rep["halves_ok"]), f"rank {rank}: call c did not land in half c % 2 alone: {rep['halves_ok']}"
        assert all(rep["recv_ok"]), f"rank {rank}: receive layout of another call: {rep['recv_ok']}"
        assert rep["seq"] == list(range(1, 2 * calls + 1)), f"rank {rank}: call numbers {rep['seq']}"


def test_bad_input(emulated_cluster):
    for rank, res in enumerate(emulated_cluster(2).run(fns.error_cases)):
        assert res["bad_expert"].startswith("RoutingError") and "ranks 1" in res["bad_expert"], res["bad_expert"]
        assert res["too_many"].startswith("CapacityError") and "needed 12" in res["too_many"], res["too_many"]
        # rank 1's bad slot is dropped: 12 pairs minus one routed to [0, 1] on rank 0 only
        assert res["graph_then_check"].startswith("RoutingError")
        assert res["after_check_clean"] == "no error"
        for key in ("hidden", "dtype", "topk_shape", "idx_dtype", "non_contig", "y_rows", "bad_handle",
                    "experts_not_multiple", "block_hidden", "num_warps"):
            assert res[key].startswith("DitronConfigError"), f"rank {rank} {key}: {res[key]}"
        assert "power of two" in res["block_hidden"] and "num_warps" in res["num_warps"]
        assert res["one_rank_bad"].startswith("DitronConfigError") and "on rank(s) 1" in res["one_rank_bad"], res
        assert "hidden_slices" in res["one_rank_bad_slices"] and "on rank(s) 0" in res["one_rank_bad_slices"], res
    assert [r["graph_rows_dropped"] for r in emulated_cluster(2).run(fns.error_cases)] == [23, 0]


def test_copy_tiling_must_match_across_ranks(emulated_cluster):
    for rank, res in enumerate(emulated_cluster(2).run(fns.tiling_mismatch_case)):
        assert res.startswith("DitronConfigError") and "copy tiling" in res and "differs across ranks" in res, res


def test_no_collectives_on_the_data_path(emulated_cluster):
    assert all(r["ok"] for r in emulated_cluster(2).run(fns.no_collectives_case))


def test_functional_wrappers_regrow(emulated_cluster):
    for res in emulated_cluster(2).run(fns.functional_regrow_case):
        assert res[0] == (3, True) and res[1][1] and res[2][1]
        assert res[1][0] == 6  # regrown geometrically from 3
        assert res[2][0] == 40


def test_two_ranks_refusing_one_combine_are_both_counted(emulated_cluster):
    r0, r1, r2 = emulated_cluster(3).run(fns.two_refusers_combine_case)
    assert "rank(s) 1 rejected their own arguments" in r0["combine"], r0
    assert "y must be float32" in r1["combine"] and "y must be float32" in r2["combine"], (r1, r2)
    assert r0["after"] and r1["after"] and r2["after"]


@pytest.mark.parametrize("W,tokens", [(2, [13, 20]), (3, [7, 0, 18])], ids=["W2", "W3-empty-rank"])
def test_replayed_layout_gives_the_bits_of_direct_launches(emulated_cluster, W, tokens):
    """EPBuffer(graph_cache) replays a default-mode signature's layout from its second call on (a
    CPU stand-in for the CUDA graph reruns the buffer's own launch sequence into the same arena):
    every call's rows and combine are bitwise those of a buffer launching directly, also for
    handles combined only after later calls replayed over the graph's buffers; graph mode never
    replays; bad input on a replayed call still raises. A signature's captured copy is handed to
    one call at a time: held handles (or a view of their layout) keep theirs from being replayed
    over, dropped ones give it back."""
    calls = LENDABLE_COPIES + 2  # the last replay of the default-mode calls is copied out of a shared copy
    reuse = W == 2  # (the reuse loop once: it is rank-local)
    for rank, rep in enumerate(emulated_cluster(W).run(fns.replayed_layout_case, tokens, 64, 4 * W, 2, calls,
                                                       reuse=reuse)):
        assert rep["captured"] == 1, f"rank {rank}: expected one captured signature, got {rep['captured']}"
        assert rep["replays"] == calls - 1, f"rank {rank}: {rep['replays']} replays"
        assert all(rep["same"]), f"rank {rank}: replayed calls differ from direct ones: {rep['same']}"
        # the kept handles of the default-mode calls each hold a copy, the last one a copy out of
        # the shared one; then dropped handles give theirs back, and a view of a call's layout
        # keeps that copy from being replayed over
        assert rep["copies"] == rep["copies_after_reuse"] == LENDABLE_COPIES and rep["shared_copy"], rep
        if reuse:
            assert all(rep["reuse_same"]), f"rank {rank}: calls on lent copies differ: {rep['reuse_same']}"
            assert rep["copies_used"] == [0, 1, 1, 1], rep["copies_used"]
            assert rep["kept_view_intact"], "a replay overwrote a layout a live view still reads"
        assert rep["bad"].startswith("RoutingError") and "ranks 0" in rep["bad"], rep["bad"]
        assert rep["token_major_same"], f"rank {rank}: a replayed token-major call differs from a direct one"
        assert rep["bad_token_major"].startswith("RoutingError") and "ranks 0" in rep["bad_token_major"], \
            rep["bad_token_major"]
        assert rep["replays_after_bad"] == rep["replays_before_bad"] + 2, "the bad calls did not take the replay path"
        assert rep["bad_graph_mode"].startswith("RoutingError"), rep["bad_graph_mode"]
        assert rep["replays_after_graph_mode"] == rep["replays_after_bad"], "graph mode replayed a layout"


def test_calls_of_varying_token_counts_replay_a_few_captures(emulated_cluster):
    """A default-mode call replays the layout captured for layout_rows(T) routing rows (the next
    power of two from 16), the rows past its own routed nowhere: serving's changing token counts
    replay a few captures instead of launching the layout directly, with the direct call's bits
    (rows, handle, combine; both layouts), while T shrinks and grows inside a capture's rows and
    differs between ranks (0 included)."""
    calls = [[20, 9], [31, 16], [17, 0], [32, 25], [5, 12], [24, 30], [3, 1], [29, 7]]
    for rank, rep in enumerate(emulated_cluster(2).run(fns.varying_tokens_replay_case, calls, 64, 8, 2, 40)):
        mine = [c[rank] for c in calls]
        assert all(rep["same"]), f"rank {rank}: calls replayed on a larger capture differ: {rep['same']}"
        assert rep["rows"] == sorted({0 if T == 0 else 16 if T <= 16 else 32 for T in mine}), rep["rows"]
        # a signature is captured on its second call, then every call of it replays
        assert rep["captured"] == [r for r in rep["rows"] if sum(
            (0 if T == 0 else 16 if T <= 16 else 32) == r for T in mine) >= 2], rep
        assert rep["replays"] == sum(max(0, sum((0 if T == 0 else 16 if T <= 16 else 32) == r for T in mine) - 1)
                                     for r in rep["captured"]), rep


def test_api_misuse_gets_clear_errors(emulated_cluster):
    for rank, res in enumerate(emulated_cluster(2).run(fns.api_misuse_cases)):
        assert "hidden" in res["hidden_differs"] and "rank 1 64" in res["hidden_differs"], res["hidden_differs"]
        assert "topk" in res["fused_topk_differs"] and "same" in res["fused_topk_differs"], res["fused_topk_differs"]
        assert "bfloat16 is not supported under the Triton interpreter" in res["fused_bf16"], res["fused_bf16"]
        if rank == 1:
            assert "x must have shape" in res["one_rank_bad_call"], res["one_rank_bad_call"]
        else:
            assert "rank(s) 1 rejected their own arguments" in res["one_rank_bad_call"], res["one_rank_bad_call"]
        assert res["one_rank_bad_call_s"] < 15.0, "a peer waited for the rank that rejected its call"
        assert res["in_step_after"], "the call after a rejected one gave wrong results"
        for key, own in (("one_rank_bad_combine", "y must be float32"), ("staged_one_rank_bad", "w1")):
            if rank == 1:
                assert own in res[key] and res[key].startswith("DitronConfigError"), res[key]
            else:
                assert res[key].startswith("DitronConfigError") and "rank(s) 1 rejected their own" in res[key], res[key]
            assert res[key + "_s"] < 15.0, f"{key}: a peer waited for the rank that rejected its call"
        assert res["in_step_after_combine"], "the combine after a rejected one gave wrong results"
        assert res["across_wrap"], "calls across the call-number wrap-around failed or were stopped"
        if rank == 1:
            assert "y must be float32" in res["lax_bad_combine"], res["lax_bad_combine"]
        else:
            assert res["lax_bad_combine"] == "no error", res["lax_bad_combine"]
        lax = res["lax_next_dispatch"]
        want = "rank(s) 1 rejected their own arguments" if rank == 0 else "rank(s) 0 held an error of an earlier call"
        assert lax.startswith("DitronConfigError") and want in lax, lax
        assert res["lax_in_step_after"], "the call after a reported refusal gave wrong results"
        assert res["pending_first"].startswith("CapacityError"), res["pending_first"]
        assert res["pending_second"].startswith("RoutingError"), res["pending_second"]
        assert res["pending_third"] == "no error", res["pending_third"]
        assert res["staged_in_step_after"], "the staged moe after a rejected call differs from the first"
        assert res["staged_dispatched"] == 0, "the staged schedule built a buffer for arguments it rejected"
        assert "was freed" in res["after_free"], res["after_free"]
        assert res["pending_capacity"].startswith("CapacityError") and "graph-mode" in res["pending_capacity"], \
            res["pending_capacity"]
        assert res["max_tokens_after"] == 4, "the functional API regrew on a graph-mode call's recorded problem"
        assert "y must have shape" in res["combine_bad_y"], res["combine_bad_y"]
        lone = res["functional_one_rank_bad_E"]
        want = "differs from the dispatch's" if rank == 1 else "rank(s) 1 rejected their own arguments"
        assert lone.startswith("DitronConfigError") and want in lone, lone
        assert res["functional_one_rank_bad_E_s"] < 15.0, "the peer waited for the rank that rejected its combine"
        assert res["functional_in_step_after"], "the combine after a rejected one gave wrong results"
        assert "topk_idx must be a 2-D tensor" in res["dispatch_1d_idx"], res["dispatch_1d_idx"]
        assert "topk_weights must be a 2-D tensor" in res["moe_no_weights"], res["moe_no_weights"]
        assert "w1" in res["staged_bad_w1"] and res["staged_bad_w1"].startswith("DitronConfigError"), \
            res["staged_bad_w1"]


def test_graph_mode_max_recv_rows(emulated_cluster):
    """Graph mode's explicit row capacity: exact when it fits; past it rows are dropped and at
    the next sync call rank 0 (which overflowed) raises CapacityError, its peer an error naming it
    (the call stops on both); the call after is right; max_recv_rows with sync=True is refused."""
    res = emulated_cluster(2).run(fns.max_recv_rows_case)
    assert max(r["rows"] for r in res) > 3, res  # some rank overflows the cap of 3
    for rank, r in enumerate(res):
        assert r["fits"] is True, (rank, r)
        assert max(r["cut_offsets"]) <= 3 and r["cut_rows_kept"], (rank, r)
        want = ("CapacityError", "max_recv_rows") if rank == 0 else ("DitronConfigError", "rank(s) 0 held an error")
        assert r["next_sync"].startswith(want[0]) and want[1] in r["next_sync"], (rank, r)
        assert r["after"], (rank, r)
        assert r["sync_cap"].startswith("DitronConfigError") and "sync=False" in r["sync_cap"], (rank, r)


RANK_REDUCED_CASES = [  # (W, tokens, H, E, K, dtype, routing, drop, partial_dtype, weighted[, programs, rows, cols])
    (2, [20, 13], 64, 8, 4, torch.float32, "uniform", 0.0, None, True, 3),  # 3 programs, the others 2
    # empty rank, dropped slots; chunks of 256 rows: the weighted fp32 sums step through each 64-column
    # copy step 32 columns at a time (H = 48: one full step and a tail)
    (3, [11, 0, 7], 48, 6, 3, torch.bfloat16, "zipf", 0.2, None, True, None, 256, 64),
    (3, [11, 5, 7], 48, 12, 6, torch.bfloat16, "uniform", 0.0, torch.float32, True),  # fp32 partials
    (4, [8, 5, 12, 3], 40, 8, 4, torch.float16, "one_rank", 0.0, None, False),     # unweighted, all to rank 0
    (2, [17, 33], 72, 4, 2, torch.float32, "one_expert", 0.0, None, True),         # T > block, one expert
    (8, [5, 0, 9, 3, 17, 1, 4, 6], 40, 16, 4, torch.bfloat16, "zipf", 0.1, None, True),  # W = 8 (issue 30)
]


@pytest.mark.parametrize("case", RANK_REDUCED_CASES,
                         ids=[f"W{c[0]}-{str(c[5])[6:]}-{c[6]}-{'fp32part' if c[8] else 'part'}"
                              f"{'' if c[9] else '-unweighted'}" for c in RANK_REDUCED_CASES])
def test_rank_reduced_combine(emulated_cluster, case):
    """Bit for bit against its sequential schedule with 2 and 3 programs alike: the grid does not
    change the bits."""
    W, tokens, H, E, K, dtype, kind, drop, partial, weighted, *programs = case
    reports = emulated_cluster(W).run(fns.rank_reduced_case, tokens, H, E, K, dtype, kind, 6, drop, partial, weighted,
                                      *programs)
    for rank, rep in enumerate(reports):
        assert rep["sequential_bitwise"], f"rank {rank}: differs from its sequential schedule by {rep['sequential_max_abs']}; {rep}"
        assert rep["oracle_ok"], f"rank {rank}: off the float64 oracle by {rep['oracle_max_abs']}"
        assert rep["rerun_bitwise"] and rep["graph_bitwise"], f"rank {rank}: not deterministic"
        assert rep["grad_y_bitwise"], f"rank {rank}: y's gradient differs from w[t, k] * g[t]"
        assert rep["graph_grad_clean"], f"rank {rank}: graph mode's y gradient is not w * g, then zeros"


def test_combine_sum_columns_tile_every_copy_step():
    """The sums' column step (the kernel's BLOCK_HA) divides the copy step for every power-of-two
    block_hidden a buffer can have (down to 1: hidden <= 8) and any rows per chunk; only the
    weighted rank-reduced sends step narrower."""
    from ditron_ep.ops.ep.combine_kernels import combine_sum_columns

    for bh in (1 << i for i in range(12)):
        for rows in (1, 4, 16, 64, 256, 1024, 16384):
            cols = combine_sum_columns(bh, rows, True)
            assert 1 <= cols <= bh and bh % cols == 0, (bh, rows, cols)
            assert combine_sum_columns(bh, rows, False) == bh
    assert combine_sum_columns(1024, 16, True) == 512  # the CUDA bf16 default


def test_rank_reduced_combine_bad_modes(emulated_cluster):
    for rank, res in enumerate(emulated_cluster(2).run(fns.rank_reduced_errors_case)):
        assert "another mode" in res["mismatch"] and "rank(s) " + str(1 - rank) in res["mismatch"], res["mismatch"]
        assert "pass topk_weights to dispatch" in res["weights"], res["weights"]
        assert "topk_sum must be" in res["unknown"], res["unknown"]
        assert "applies to topk_sum='expert_rank' only" in res["partial_exact"], res["partial_exact"]
        assert "partial_dtype must be" in res["partial_bad"], res["partial_bad"]
        assert "needs 2 fp32 partials" in res["partial_room"], res["partial_room"]
        assert "cannot return their gradient" in res["weights_grad"], res["weights_grad"]
        assert "dispatch with layout='token_major'" in res["caller_expert_major"], res["caller_expert_major"]
        assert "pass neither topk_weights nor partial_dtype" in res["caller_weights"], res["caller_weights"]
        assert res["caller_rows"] != "no error", "a y without one row per token row was accepted"
        assert res["after_ok"]


TOKEN_MAJOR_CASES = [  # (W, tokens, H, E, K, dtype, routing, drop, (block_hidden, hidden_slices))
    (2, [20, 13], 64, 8, 4, torch.float32, "uniform", 0.0, (None, None)),
    (3, [11, 0, 7], 48, 6, 3, torch.bfloat16, "zipf", 0.2, (None, None)),       # empty rank, dropped slots
    (4, [8, 5, 12, 3], 40, 8, 2, torch.float16, "one_rank", 0.0, (None, None)),  # every token to rank 0
    # T > block, one expert; 5 column tiles in 2 slices: two tiles a copy step, the last one ragged
    (2, [17, 33], 72, 4, 2, torch.float32, "one_expert", 0.0, (16, 2)),
]


@pytest.mark.parametrize("W,tokens,H,E,K,dtype,kind,drop,tiling", TOKEN_MAJOR_CASES,
                         ids=[f"W{c[0]}-{str(c[5])[6:]}-{c[6]}" for c in TOKEN_MAJOR_CASES])
def test_token_major_dispatch(emulated_cluster, W, tokens, H, E, K, dtype, kind, drop, tiling):
    for rank, rep in enumerate(emulated_cluster(W).run(fns.token_major_case, tokens, H, E, K, dtype, kind, 7, drop,
                                                       *tiling)):
        assert rep["token_rows_exact"], f"rank {rank}: token rows differ from (source rank, token) order"
        assert rep["row_index_exact"], f"rank {rank}: recv_x[row_index] differs from the expert-major layout"
        assert rep["combine_same"], f"rank {rank}: combine along a token-major handle differs"
        assert rep["graph_same"], f"rank {rank}: graph mode differs"
        assert rep["grad_rows_exact_alloc"], f"rank {rank}: a token-major recv_x under autograd holds capacity"
        assert rep["grad_x_bitwise"], f"rank {rank}: x's gradient differs from its rank-ordered sum"
        assert rep["caller_sum_bitwise"], f"rank {rank}: combine(topk_sum='caller') differs from the rank-ordered sum"
        assert rep["caller_grad_bitwise"], f"rank {rank}: y's gradient under topk_sum='caller' differs"


@pytest.mark.parametrize("W,tokens,kind,drop", [(2, [20, 13], "uniform", 0.0), (3, [11, 0, 7], "zipf", 0.2)],
                         ids=["W2-uniform", "W3-zipf-empty-rank"])
def test_fp8_dispatch(emulated_cluster, W, tokens, kind, drop):
    for rank, rep in enumerate(emulated_cluster(W).run(fns.fp8_dispatch_case, tokens, 256, 6 * W, 3, kind, 11, drop)):
        assert rep["expert_major_exact"], f"rank {rank}: e4m3 rows or scales differ (expert-major)"
        assert rep["token_major_exact"], f"rank {rank}: e4m3 rows or scales differ (token-major)"
        assert rep["dequant_bitwise"], f"rank {rank}: dequantised rows differ from x * scale"
        assert rep["dequant_rel_err"] < 0.07, f"rank {rank}: e4m3 round trip off by {rep['dequant_rel_err']}"
        assert rep["combine_finite"]
        assert rep["gemm_on_fp8_rows"], f"rank {rank}: grouped_mlp(x_scales=) differs from it on dequantised rows"
        errs = rep["errors"]
        assert "float8_e4m3fn" in errs["bf16_x"] and "x_scales" in errs["no_scales"], errs
        assert "x_scales must have shape" in errs["bad_scales"], errs
        assert "dispatch_dtype=torch.float8_e4m3fn" in errs["scales_on_bf16"], errs
        assert "multiple of 128" in errs["bad_hidden"], errs


def test_token_major_training_step(emulated_cluster):
    """The token-major layout end to end with gradients: dispatch -> grouped_mlp(row_index=...) -> combine."""
    for rank, rep in enumerate(emulated_cluster(3).run(fns.token_major_training_case, [13, 0, 21], 32, 16, 6, 2, 5)):
        assert rep["rerun_bitwise"], f"rank {rank}: two steps differ"
        assert rep["graph_bitwise"], f"rank {rank}: the graph-mode (sync=False) step differs"
        for name, err in rep["rel_errs"]:
            assert err <= 1e-5, f"rank {rank}: {name} off the float64 oracle by {err:.2e} (relative)"


def test_tuned_copy_tiling_is_used_only_when_every_rank_has_it(emulated_cluster, tmp_path):
    """tune_ep_copy times every candidate on every rank together and records one choice everywhere;
    an EPBuffer with its copy tiling unset takes that entry only when every rank's cache has the
    same one (else every rank keeps the defaults); the bits are the same either way."""
    reps = emulated_cluster(2).run(fns.ep_copy_tuner_case, str(tmp_path))
    assert len({rep["chosen"] for rep in reps}) == 1, reps   # the slowest rank's times decide, alike everywhere
    for rep in reps:
        assert rep["timed"] == 3, rep
        chosen = [int(v) for v in rep["chosen"].replace("rows", "").replace("cols", "").replace("w", "").split("-")]
        assert rep["every rank"] == (rep["chosen"], *chosen), rep
        assert rep["rank 1 misses"] == (None, 16, 32, 4), rep   # the CPU defaults (H=32: 32 columns)
        assert rep["same bits"], rep
